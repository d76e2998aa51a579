//! The `tinyflow` command's library: the job file (TOML) and what it turns
//! into, a job graph Kafka -> transforms -> Iceberg.
//!
//! `tinyflow run JOB.toml` reads a [`JobFile`], checks it against the
//! source schema ([`JobFile::plan`]) and runs the resulting [`JobPlan`].
//! Every error names the key of the file that is wrong and what was
//! expected.

pub mod checkpoint_storage;
mod duration;
mod evolve;
mod jobfile;
pub mod jobstate;
pub mod maintain;
pub mod nexmark;
mod plan;
mod prometheus;
mod substitute;
mod transform;

pub use duration::{format_duration, parse_duration};
pub use evolve::LiveColumns;
pub use jobfile::{
    CatalogSection, CheckpointSection, CommitSection, ComputeSection, CountOrOff, EventTimeSection,
    FieldSection, JobFile, JobSection, MaintenanceSection, MetricsSection, PartitionSection,
    RestartSection, SinkSection, SourceSection, TransformSection,
};
pub use plan::{Checkpoints, JobPlan, ObjectCheckpoints, Placement, absolute_path};
pub use prometheus::{Endpoint, counters_line, install_metrics, metric_sum};
pub use transform::Transforms;

/// The exit codes of `tinyflow run` (and `inspect`, `reset`, `maintain`): what happened,
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

/// The worker `tinyflow run` runs as, and the layout a rescale replaces:
/// from `--worker I/N` and `--rescale-from N@G`, else from the environment
/// (`env`): `TINYFLOW_WORKER=I/N`, or `TINYFLOW_WORKERS=N` with
/// `TINYFLOW_WORKER_INDEX` (a number, or a StatefulSet pod name such as
/// `tinyflow-2`, whose ordinal is the index), and `TINYFLOW_RESCALE_FROM`.
/// `None`: the job in one process. Settings that contradict each other, or
/// half of a pair, are errors: a pod meant as a worker must never run as the
/// job in one process.
///
/// ```
/// use tinyflow_cli::worker_from;
/// let none = |_: &str| None;
/// assert_eq!(worker_from(None, None, &none).unwrap(), None);
/// let w = worker_from(Some("1/3"), Some("2@4"), &none).unwrap().unwrap();
/// assert_eq!((w.0.to_string(), w.1.unwrap().to_string()), ("1/3".to_owned(), "2@4".to_owned()));
/// let pod = |k: &str| match k {
///     "TINYFLOW_WORKERS" => Some("4".to_owned()),
///     "TINYFLOW_WORKER_INDEX" => Some("tinyflow-bids-3".to_owned()),
///     _ => None,
/// };
/// assert_eq!(worker_from(None, None, &pod).unwrap().unwrap().0.to_string(), "3/4");
/// assert!(worker_from(Some("3/3"), None, &none).unwrap_err().to_string().contains("--worker"));
/// let half = |k: &str| (k == "TINYFLOW_WORKER_INDEX").then(|| "tinyflow-1".to_owned());
/// assert!(worker_from(None, None, &half).is_err());
/// ```
pub fn worker_from(
    flag: Option<&str>,
    rescale_from: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<(tinyflow_api::Worker, Option<tinyflow_api::RescaleFrom>)>, JobFileError> {
    let set = |k: &str| env(k).filter(|v| !v.trim().is_empty());
    let rescale_from = match (rescale_from, set("TINYFLOW_RESCALE_FROM")) {
        (Some(f), _) => Some(("--rescale-from", f.to_owned())),
        (None, Some(v)) => Some(("TINYFLOW_RESCALE_FROM", v)),
        (None, None) => None,
    }
    .map(|(key, v)| {
        v.parse::<tinyflow_api::RescaleFrom>()
            .map_err(|m| JobFileError::new(key, m))
    })
    .transpose()?;
    let from_index = match (set("TINYFLOW_WORKERS"), set("TINYFLOW_WORKER_INDEX")) {
        (Some(n), Some(index)) => {
            let ordinal = index.trim().rsplit('-').next().unwrap_or("").to_owned();
            if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
                return Err(JobFileError::new(
                    "TINYFLOW_WORKER_INDEX",
                    format!("`{index}`: expected a number, or a pod name ending in -<ordinal>"),
                ));
            }
            Some(format!("{ordinal}/{}", n.trim()))
        }
        (Some(_), None) => {
            return Err(JobFileError::new(
                "TINYFLOW_WORKER_INDEX",
                "TINYFLOW_WORKERS is set but not TINYFLOW_WORKER_INDEX (a number, or the pod's name in a StatefulSet)",
            ));
        }
        (None, Some(_)) => {
            return Err(JobFileError::new(
                "TINYFLOW_WORKERS",
                "TINYFLOW_WORKER_INDEX is set but not TINYFLOW_WORKERS (how many workers the job has)",
            ));
        }
        (None, None) => None,
    };
    let mut said: Vec<(&str, String)> = Vec::new();
    if let Some(f) = flag {
        said.push(("--worker", f.to_owned()));
    }
    if let Some(w) = set("TINYFLOW_WORKER") {
        said.push(("TINYFLOW_WORKER", w));
    }
    if let Some(w) = from_index {
        said.push(("TINYFLOW_WORKERS", w));
    }
    let mut parsed = Vec::with_capacity(said.len());
    for (key, text) in &said {
        parsed.push((
            *key,
            text.parse::<tinyflow_api::Worker>()
                .map_err(|m| JobFileError::new(*key, m))?,
        ));
    }
    let Some(&(key, worker)) = parsed.first() else {
        if rescale_from.is_some() {
            return Err(JobFileError::new(
                "--rescale-from",
                "rescales the workers of a job: give the new layout's --worker I/N too",
            ));
        }
        return Ok(None);
    };
    if let Some((other, w)) = parsed.iter().find(|(_, w)| *w != worker) {
        return Err(JobFileError::new(
            key,
            format!("says worker {worker}, but {other} says {w}"),
        ));
    }
    Ok(Some((worker, rescale_from)))
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
