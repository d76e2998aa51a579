//! Checkpoint configuration and its validation.

use std::time::Duration;

use crate::{Error, Result};

/// How a job checkpoints.
///
/// ```
/// use std::time::Duration;
/// use tinyflow_checkpoint::CheckpointConfig;
///
/// let config = CheckpointConfig {
///     interval: Some(Duration::from_secs(1)),
///     timeout: Duration::from_secs(30),
///     ..CheckpointConfig::default()
/// };
/// config.validate(true).expect("valid with a transactional sink");
/// let off = CheckpointConfig { interval: None, ..CheckpointConfig::default() };
/// assert!(off.validate(true).is_err(), "a committer would never commit");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointConfig {
    /// Fixed-rate trigger interval; `None` turns checkpointing off. Triggers
    /// fall on a fixed grid (start + k * interval): acks, completions and
    /// slow tasks never push the next one back. A slot missed because
    /// `max_concurrent` checkpoints are in flight, or `min_pause` has not
    /// passed, is taken as soon as it is allowed.
    pub interval: Option<Duration>,
    /// A checkpoint not fully acked this long after its trigger is aborted.
    pub timeout: Duration,
    /// Minimum time between the completion of one checkpoint and the trigger
    /// of the next.
    pub min_pause: Duration,
    /// Checkpoints in flight at once (triggered, not yet complete or aborted).
    pub max_concurrent: usize,
    /// Consecutive failed checkpoints tolerated; one more fails the job.
    /// Aborts that are not failures (subsumed, planned deregistration) do not
    /// count, and a completed checkpoint resets the count.
    pub tolerable_failures: u32,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            interval: Some(Duration::from_secs(10)),
            timeout: Duration::from_secs(600),
            min_pause: Duration::ZERO,
            max_concurrent: 1,
            tolerable_failures: 3,
        }
    }
}

/// Upper bound on `max_concurrent`: each in-flight checkpoint holds every
/// task's state in memory, so the bound is what keeps memory bounded.
pub const MAX_CONCURRENT_LIMIT: usize = 64;

impl CheckpointConfig {
    /// Checks the values, and that checkpointing is on when the job has a
    /// transactional sink (a committer commits only on completed checkpoints,
    /// so with checkpointing off its data would silently never appear).
    pub fn validate(&self, has_transactional_sink: bool) -> Result<()> {
        let err = |key: &'static str, message: String| Err(Error::Config { key, message });
        match self.interval {
            None if has_transactional_sink => {
                return err(
                    "checkpoint.interval",
                    "checkpointing is off but the job has a transactional sink, which commits \
                     only when a checkpoint completes: set an interval (e.g. 10s)"
                        .to_owned(),
                );
            }
            Some(i) if i.is_zero() => {
                return err(
                    "checkpoint.interval",
                    "must be greater than zero; to turn checkpointing off, leave it unset"
                        .to_owned(),
                );
            }
            _ => {}
        }
        if self.timeout.is_zero() {
            return err("checkpoint.timeout", "must be greater than zero".to_owned());
        }
        if !(1..=MAX_CONCURRENT_LIMIT).contains(&self.max_concurrent) {
            return err(
                "checkpoint.max_concurrent",
                format!(
                    "is {}, expected 1 to {MAX_CONCURRENT_LIMIT}",
                    self.max_concurrent
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_values_are_rejected_with_the_key() {
        let bad = |c: CheckpointConfig| c.validate(false).unwrap_err().to_string();
        let base = CheckpointConfig::default();
        let e = bad(CheckpointConfig {
            interval: Some(Duration::ZERO),
            ..base.clone()
        });
        assert!(e.contains("checkpoint.interval"), "{e}");
        let e = bad(CheckpointConfig {
            timeout: Duration::ZERO,
            ..base.clone()
        });
        assert!(e.contains("checkpoint.timeout"), "{e}");
        let e = bad(CheckpointConfig {
            max_concurrent: 0,
            ..base.clone()
        });
        assert!(
            e.contains("checkpoint.max_concurrent") && e.contains("is 0"),
            "{e}"
        );
        let e = bad(CheckpointConfig {
            max_concurrent: 65,
            ..base
        });
        assert!(e.contains("expected 1 to 64"), "{e}");
    }

    #[test]
    fn off_is_fine_without_a_transactional_sink() {
        let off = CheckpointConfig {
            interval: None,
            ..CheckpointConfig::default()
        };
        off.validate(false).unwrap();
        let e = off.validate(true).unwrap_err().to_string();
        assert!(e.contains("transactional sink"), "{e}");
    }
}
