//! The checkpoint crate's error type.

use std::fmt;

use tinyflow_api::{CheckpointId, StreamError, TaskId};

use crate::AbortReason;

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why the coordinator could not start, or why it failed the job.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is invalid.
    #[error("invalid configuration `{key}`: {message}")]
    Config {
        /// The configuration key, as a user writes it.
        key: &'static str,
        /// What is wrong and what is expected.
        message: String,
    },
    /// More consecutive checkpoints failed than tolerated.
    #[error(
        "{failures} consecutive checkpoints failed (tolerated: {tolerated}); the last, checkpoint {last}, {reason}"
    )]
    TooManyFailures {
        /// Consecutive failures.
        failures: u32,
        /// The configured tolerance.
        tolerated: u32,
        /// The last failed checkpoint.
        last: CheckpointId,
        /// Why it failed.
        reason: AbortReason,
    },
    /// A task died; the job attempt fails so the restart strategy can act.
    #[error("{task} was lost: {cause}")]
    TaskLost {
        /// The task.
        task: TaskId,
        /// How the loss was noticed.
        cause: LossCause,
    },
    /// A task id was registered twice.
    #[error("{task} registered twice")]
    DuplicateTask {
        /// The task.
        task: TaskId,
    },
    /// Every sender of the coordinator's inbound channel was dropped while
    /// the job was still running: nobody could ack or register any more.
    #[error(
        "coordinator inbound channel closed while the job was running ({live_tasks} tasks registered)"
    )]
    InboundClosed {
        /// Tasks still registered.
        live_tasks: usize,
    },
    /// The newest readable checkpoint is older than what the job's sinks
    /// already committed (newer checkpoint files were lost or damaged).
    /// Restoring from it would commit replayed records a second time.
    #[error(
        "newest readable checkpoint is {restored} but the sinks already committed checkpoint {committed}: \
         restoring would duplicate data (newer checkpoint files were lost, or another run of the job committed them); `tinyflow inspect JOB.toml` shows both sides, and `tinyflow reset JOB.toml` starts the job again from what the table holds"
    )]
    RestoreBehindSinks {
        /// The checkpoint the store could offer.
        restored: CheckpointId,
        /// The highest checkpoint the sinks committed.
        committed: CheckpointId,
    },
    /// The checkpoint store failed where there is no later attempt to fall
    /// back on (at start-up, reading the newest checkpoint).
    #[error("checkpoint store failed")]
    Store(#[from] StreamError),
}

impl Error {
    /// Whether restarting the job attempt may help (the restart strategy's
    /// question). Configuration errors and duplicate registrations will fail
    /// the same way again.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Config { .. }
            | Error::DuplicateTask { .. }
            | Error::RestoreBehindSinks { .. } => false,
            Error::TooManyFailures { .. }
            | Error::TaskLost { .. }
            | Error::InboundClosed { .. } => true,
            Error::Store(e) => e.is_retryable(),
        }
    }
}

/// How the coordinator learned that a task was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LossCause {
    /// Its control channel closed (the task's end was dropped).
    ChannelClosed,
    /// The task reported a failure.
    Reported {
        /// The task's error text.
        message: String,
    },
}

impl fmt::Display for LossCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossCause::ChannelClosed => f.write_str("its control channel closed"),
            LossCause::Reported { message } => write!(f, "it reported: {message}"),
        }
    }
}

/// What is wrong with a corrupt checkpoint file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CorruptReason {
    /// It does not start with the expected magic bytes.
    #[error("not a tinyflow checkpoint file (bad magic)")]
    BadMagic,
    /// It is a checkpoint file of a format version this build cannot read.
    #[error("unsupported format version {found}")]
    UnsupportedVersion {
        /// The version in the file.
        found: u32,
    },
    /// It ends before the length its header announces (a torn write).
    #[error("truncated: {expected} bytes expected, {found} present")]
    Truncated {
        /// Bytes the header announces.
        expected: u64,
        /// Bytes present.
        found: u64,
    },
    /// The payload does not match its checksum.
    #[error("checksum mismatch: header says {expected:#010x}, payload hashes to {actual:#010x}")]
    ChecksumMismatch {
        /// Checksum recorded in the header.
        expected: u32,
        /// Checksum of the payload read.
        actual: u32,
    },
    /// The payload is internally inconsistent.
    #[error("malformed payload: {detail}")]
    Malformed {
        /// What did not decode.
        detail: &'static str,
    },
    /// The file name and the content disagree on the checkpoint id.
    #[error("file name says checkpoint {in_name}, content says {in_content}")]
    IdMismatch {
        /// From the file name.
        in_name: u64,
        /// From the content.
        in_content: u64,
    },
}
