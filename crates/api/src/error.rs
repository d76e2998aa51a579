//! The error type shared across crate boundaries.

use std::path::PathBuf;

use crate::{CheckpointId, TaskId};

/// An error and its sources, `: `-separated, for one log field or message.
/// A source whose text the message so far already ends with (an error that
/// shows its cause, like [`StreamError::External`]) is not repeated.
///
/// ```
/// use tinyflow_api::{StreamError, error_chain};
///
/// let e = std::io::Error::other("disk full");
/// assert_eq!(error_chain(&e), "disk full");
/// let e = StreamError::external("sink", "iceberg", "committing", e, true);
/// assert_eq!(error_chain(&e), "sink: iceberg error while committing: disk full");
/// ```
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let cause = e.to_string();
        if !text.ends_with(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
        source = e.source();
    }
    text
}

/// A boxed error of any kind: the cause an error carries.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result with [`StreamError`].
pub type StreamResult<T> = Result<T, StreamError>;

/// An error crossing a crate boundary: what failed, where, and whether trying
/// again can help ([`StreamError::is_retryable`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// A file-system operation failed (full disk, permissions, missing dir).
    #[error("i/o error while {action} {path}")]
    Io {
        /// What was being done, e.g. `"writing checkpoint metadata to"`.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint store could not be reached or refused the operation.
    #[error("checkpoint store unavailable while {action} checkpoint {checkpoint}: {message}")]
    StoreUnavailable {
        /// What was being done.
        action: &'static str,
        /// The checkpoint concerned.
        checkpoint: CheckpointId,
        /// The store's description of the failure.
        message: String,
    },
    /// A configuration value is invalid.
    #[error("invalid configuration `{key}`: {message}")]
    Config {
        /// The configuration key, as a user writes it.
        key: &'static str,
        /// What is wrong and what is expected.
        message: String,
    },
    /// An operator received records of another type than it was built for
    /// (a broken job graph).
    #[error("operator {operator} received records of type {found}, expected {expected}")]
    TypeMismatch {
        /// The operator.
        operator: String,
        /// The type it expects.
        expected: &'static str,
        /// The type it got.
        found: &'static str,
    },
    /// Operator state could not be encoded or decoded.
    #[error("state of operator {operator} could not be {action}: {message}")]
    State {
        /// The operator.
        operator: String,
        /// `encoded` or `decoded`.
        action: &'static str,
        /// The codec's error.
        message: String,
    },
    /// User code in an operator, source or sink failed.
    #[error("operator {operator} failed: {message}")]
    User {
        /// The operator.
        operator: String,
        /// The error.
        message: String,
    },
    /// A source record could not be decoded (bad-record policy `fail`).
    #[error("bad record in {operator} at {topic}/{partition}@{offset}: {reason}")]
    BadRecord {
        /// The source.
        operator: String,
        /// Where the record is: topic (or stream) name.
        topic: String,
        /// Partition.
        partition: i32,
        /// Offset.
        offset: i64,
        /// Why it could not be decoded.
        reason: String,
    },
    /// An external system (broker, catalog) failed or is unreachable. Its
    /// text ends with the cause's, which stays reachable as the error's
    /// source (for its own causes and for downcasting).
    #[error("{operator}: {system} error while {action}: {source}")]
    External {
        /// The source or sink.
        operator: String,
        /// `kafka`, `iceberg`, ...
        system: &'static str,
        /// What was being done.
        action: String,
        /// The client's error, or what the connector found wrong (a
        /// `String` converts into one).
        #[source]
        source: BoxError,
        /// Whether trying again later may help: decided where the error is
        /// made, by what the cause is.
        retryable: bool,
    },
    /// The job graph is invalid.
    #[error("invalid job graph: {message}")]
    Graph {
        /// What is wrong.
        message: String,
    },
    /// Another run of the same job or sink took over: this run must stop
    /// for good (a restart would only be fenced again, or fence the newer
    /// run).
    #[error("{operator}: fenced: {message}")]
    Fenced {
        /// The sink or store that found out.
        operator: String,
        /// Who took over (the newer epoch, the holder of a lock) and what
        /// became of this run's data.
        message: String,
    },
    /// The job's state and the system it writes disagree (a dropped or
    /// replaced table, a table restored from an older backup, data files
    /// that are gone): going on would write a wrong table, so the job stops
    /// until an operator decides (`tinyflow inspect`, `tinyflow reset`).
    #[error("{operator}: the job's state disagrees with {target}: {message}")]
    StateMismatch {
        /// The sink.
        operator: String,
        /// What it writes, e.g. `table db.bids`.
        target: String,
        /// What differs, and the ways out.
        message: String,
    },
    /// A task failed.
    #[error("{task} failed: {message}")]
    TaskFailed {
        /// The task.
        task: TaskId,
        /// Its error.
        message: String,
    },
}

impl StreamError {
    /// An [`StreamError::External`] error: `operator` failed talking to
    /// `system` while `action`, because of `source`; `retryable` says
    /// whether trying again later may help.
    pub fn external(
        operator: impl Into<String>,
        system: &'static str,
        action: impl Into<String>,
        source: impl Into<BoxError>,
        retryable: bool,
    ) -> Self {
        StreamError::External {
            operator: operator.into(),
            system,
            action: action.into(),
            source: source.into(),
            retryable,
        }
    }

    /// Whether the same operation may succeed if tried again later.
    ///
    /// I/O errors and store outages are transient as far as one checkpoint
    /// goes (the next checkpoint tries again); corrupt data, bad
    /// configuration and task failures are not.
    pub fn is_retryable(&self) -> bool {
        match self {
            StreamError::Io { .. }
            | StreamError::StoreUnavailable { .. }
            | StreamError::User { .. } => true,
            StreamError::TypeMismatch { .. }
            | StreamError::State { .. }
            | StreamError::Graph { .. }
            | StreamError::BadRecord { .. } => false,
            StreamError::External { retryable, .. } => *retryable,
            StreamError::Fenced { .. } | StreamError::StateMismatch { .. } => false,
            StreamError::Config { .. } | StreamError::TaskFailed { .. } => false,
        }
    }
}
