//! The `tinyflow` command's library: the job file (TOML) and what it turns
//! into, a job graph Kafka -> transforms -> Iceberg.
//!
//! `tinyflow run JOB.toml` reads a [`JobFile`], checks it against the
//! source schema ([`JobFile::plan`]) and runs the resulting [`JobPlan`].
//! Every error names the key of the file that is wrong and what was
//! expected.

mod duration;
mod jobfile;
pub mod nexmark;
mod plan;
mod transform;

pub use duration::{format_duration, parse_duration};
pub use jobfile::{
    CatalogSection, CheckpointSection, CommitSection, ComputeSection, EventTimeSection,
    FieldSection, JobFile, JobSection, MetricsSection, PartitionSection, RestartSection,
    SinkSection, SourceSection, TransformSection,
};
pub use plan::{JobPlan, absolute_path, counters_line, install_metrics, metric_sum};
pub use transform::Transforms;

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
