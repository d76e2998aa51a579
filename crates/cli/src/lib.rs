//! The `tinyflow` command's library: the job file (TOML) and what it turns
//! into, a job graph Kafka -> transforms -> Iceberg.
//!
//! `tinyflow run JOB.toml` reads a [`JobFile`], checks it against the
//! source schema ([`JobFile::plan`]) and runs the resulting [`JobPlan`].
//! Every error names the key of the file that is wrong and what was
//! expected.

mod duration;
mod evolve;
mod jobfile;
pub mod jobstate;
pub mod nexmark;
mod plan;
mod prometheus;
mod substitute;
mod transform;

pub use duration::{format_duration, parse_duration};
pub use evolve::LiveColumns;
pub use jobfile::{
    CatalogSection, CheckpointSection, CommitSection, ComputeSection, EventTimeSection,
    FieldSection, JobFile, JobSection, MetricsSection, PartitionSection, RestartSection,
    SinkSection, SourceSection, TransformSection,
};
pub use plan::{JobPlan, absolute_path};
pub use prometheus::{counters_line, install_metrics, metric_sum};
pub use transform::Transforms;

/// The exit codes of `tinyflow run` (and `inspect`, `reset`): what happened,
/// for a supervisor or a script.
pub mod exit {
    /// The job ended (a bounded job read everything, or a stop took a final
    /// checkpoint), or the command did what it was asked.
    pub const OK: u8 = 0;
    /// The job failed (past its restart strategy, or an error no restart
    /// mends, such as a bad record under `bad_records = "fail"`).
    pub const FAILED: u8 = 1;
    /// A configuration error: the job file, the command line, or a setting
    /// the systems it names refuse (a topic that does not exist, security
    /// settings the broker does not accept). Restarting does not help.
    pub const USAGE: u8 = 2;
    /// Another run owns the job: a newer run of the sink fenced this one, or
    /// a run holds the checkpoint directory. Restarting this process does
    /// not help.
    pub const FENCED: u8 = 3;
    /// The job's state and its table disagree (a dropped or replaced table,
    /// a table restored from an older backup, lost data files): nothing was
    /// committed; `tinyflow inspect` shows both sides, `tinyflow reset`
    /// starts again from the table.
    pub const STATE_MISMATCH: u8 = 4;
    /// A second SIGINT stopped the job at once, without a final checkpoint.
    pub const FORCED_SIGINT: u8 = 130;
    /// A second SIGTERM stopped the job at once, without a final checkpoint.
    pub const FORCED_SIGTERM: u8 = 143;
}

/// The exit code for an error (see [`exit`]): its causes decide.
pub fn exit_code(error: &anyhow::Error) -> u8 {
    for cause in error.chain() {
        if let Some(e) = cause.downcast_ref::<tinyflow_api::StreamError>() {
            match e {
                tinyflow_api::StreamError::Fenced { .. } => return exit::FENCED,
                tinyflow_api::StreamError::StateMismatch { .. } => return exit::STATE_MISMATCH,
                tinyflow_api::StreamError::Config { .. } => return exit::USAGE,
                _ => {}
            }
        }
        if let Some(tinyflow_checkpoint::Error::RestoreBehindSinks { .. }) =
            cause.downcast_ref::<tinyflow_checkpoint::Error>()
        {
            return exit::STATE_MISMATCH;
        }
        if cause.downcast_ref::<JobFileError>().is_some() {
            return exit::USAGE;
        }
    }
    exit::FAILED
}

/// What is wrong with a job file: the key and what was expected there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct JobFileError {
    /// The key, e.g. `source.fields[2].type` or `transforms[1].filter`.
    pub key: String,
    /// What was wrong and what was expected.
    pub message: String,
}

impl JobFileError {
    pub(crate) fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        JobFileError {
            key: key.into(),
            message: message.into(),
        }
    }
}
