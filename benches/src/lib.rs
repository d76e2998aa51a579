//! Shared inputs for tinyflow's criterion benchmarks: a fixed-seed byte
//! generator, checkpoints of a stated size, and [`AckRounds`], which drives
//! the pure [`Coordinator`] through whole checkpoints on a hand-made clock, so
//! every run measures the same work and no runtime or real time is involved.
//! [`pipeline`] holds in-memory sources, sinks and a checkpoint store for the
//! benchmarks that run whole jobs (the runtime bench and the `nexmark` bench
//! binary). [`kafka`] pre-loads a real broker with Nexmark bids as JSON.
//! [`tinyflow_bin`] finds the `tinyflow` binary the benches that run jobs
//! as processes start.

use std::collections::BTreeMap;
use std::time::Duration;

use tinyflow_api::{CheckpointId, JobId, TaskId};
use tinyflow_checkpoint::{Action, CheckpointConfig, Coordinator, Event, Now};
use tinyflow_checkpoint::{CompletedCheckpoint, FromTask, StateHandle, TaskRole, ToTask};
use tokio::time::Instant;

pub mod kafka;
pub mod pipeline;

/// The Parquet settings the Iceberg sink writes with by default, for a file
/// whose first batch is `first`: its default compression, 64k-row row
/// groups, and no dictionary for the columns it finds mostly distinct. The
/// bare writer loops use them, so the ratios compare like with like.
///
/// # Panics
///
/// If the sink's default compression is not a valid Parquet one.
#[must_use]
pub fn sink_writer_properties(
    first: &arrow_array::RecordBatch,
) -> parquet::file::properties::WriterProperties {
    use tinyflow_connectors_iceberg::{Compression, plain_columns};
    let mut props = parquet::file::properties::WriterProperties::builder()
        .set_compression(
            Compression::default()
                .to_parquet()
                .expect("the default compression is valid"),
        )
        .set_max_row_group_row_count(Some(64 * 1024));
    for column in plain_columns(first) {
        props = props.set_column_dictionary_enabled(column.into(), false);
    }
    props.build()
}

/// Seed of every generated input.
pub const SEED: u64 = 0x7469_6E79_666C_6F77; // "tinyflow"

/// Trigger interval of the benchmarked coordinator.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// Wall-clock milliseconds at the start of a benchmark (a fixed date, so the
/// metadata is the same in every run).
pub const WALL_START_MS: u64 = 1_700_000_000_000;

/// The `tinyflow` binary that the benches running jobs as processes start:
/// `TINYFLOW_BIN`, else the one beside the running bench.
pub fn tinyflow_bin() -> std::path::PathBuf {
    if let Ok(bin) = std::env::var("TINYFLOW_BIN") {
        return std::path::PathBuf::from(bin);
    }
    let bin = std::env::current_exe()
        .unwrap_or_default()
        .with_file_name(format!("tinyflow{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "`tinyflow` not found at {}: `cargo build --release -p tinyflow-cli` first, or set TINYFLOW_BIN",
        bin.display()
    );
    bin
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// `len` bytes of a SplitMix64 stream started at `seed`.
pub fn pseudo_random(seed: u64, len: usize) -> Vec<u8> {
    tinyflow_tests::SplitMix64::new(seed).bytes(len)
}

/// The benchmarks' job id.
pub fn bench_job() -> JobId {
    JobId::new("bench").expect("\"bench\" is a valid job id")
}

/// Checkpoint `id` of `job_id` with `tasks` tasks sharing `total_bytes` of
/// state evenly (the first tasks take the remainder), generated from [`SEED`].
pub fn checkpoint_of_size(
    job_id: &JobId,
    id: CheckpointId,
    tasks: u32,
    total_bytes: usize,
) -> CompletedCheckpoint {
    let tasks = tasks.max(1);
    let count = usize::try_from(tasks).expect("task count fits in usize");
    let (each, rest) = (total_bytes / count, total_bytes % count);
    let task_states: BTreeMap<_, _> = (0..tasks)
        .zip(0..)
        .map(|(task, index): (u32, usize)| {
            let len = each + usize::from(index < rest);
            let bytes = pseudo_random(SEED ^ u64::from(task), len);
            (TaskId::new(task), StateHandle::from(bytes))
        })
        .collect();
    CompletedCheckpoint {
        job_id: job_id.clone(),
        id,
        triggered_at_ms: WALL_START_MS,
        acked_at_ms: WALL_START_MS + 250,
        is_final: false,
        task_states,
    }
}

/// A [`Coordinator`] with `tasks` registered tasks, driven one whole
/// checkpoint at a time: trigger, one ack per task, store durable.
///
/// Each [`round`](AckRounds::round) leaves the coordinator as it found it
/// (nothing in flight), so repeating it measures the steady state.
#[derive(Debug)]
pub struct AckRounds {
    coordinator: Coordinator,
    tasks: Vec<TaskId>,
    state: StateHandle,
    now: Now,
    actions: Vec<Action>,
}

impl AckRounds {
    /// Task 0 is a source, the last task (if more than one) a committer, the
    /// rest operators. Every ack carries the same 16-byte state.
    pub fn new(tasks: u32) -> Self {
        let config = CheckpointConfig {
            interval: Some(INTERVAL),
            timeout: Duration::from_secs(3600),
            min_pause: Duration::ZERO,
            max_concurrent: 1,
            tolerable_failures: 0,
        };
        config
            .validate(false)
            .expect("the benchmark's checkpoint config is valid");
        let now = Now {
            at: Instant::now(),
            wall_ms: WALL_START_MS,
        };
        let mut coordinator = Coordinator::new(bench_job(), config, CheckpointId::FIRST, now.at);
        let tasks: Vec<_> = (0..tasks).map(TaskId::new).collect();
        let mut actions = Vec::new();
        for (index, task) in tasks.iter().enumerate() {
            let role = if index == 0 {
                TaskRole::Source
            } else if index + 1 == tasks.len() {
                TaskRole::Committer
            } else {
                TaskRole::Operator
            };
            coordinator.handle_into(Event::Register { task: *task, role }, now, &mut actions);
        }
        assert!(actions.is_empty(), "registration acted: {actions:?}");
        AckRounds {
            coordinator,
            tasks,
            state: StateHandle::from(pseudo_random(SEED, 16)),
            now,
            actions,
        }
    }

    /// Number of tasks, i.e. acks per round.
    pub fn tasks(&self) -> usize {
        self.tasks.len()
    }

    /// Moves time one interval on (a trigger is due), acks the triggered
    /// checkpoint from every task and reports it durable. Returns its id.
    ///
    /// Panics if the coordinator does not act as a healthy job expects: the
    /// measurement would be of something else.
    pub fn round(&mut self) -> CheckpointId {
        self.now.at += INTERVAL;
        self.now.wall_ms += 1_000;
        self.actions.clear();
        self.coordinator
            .handle_into(Event::Tick, self.now, &mut self.actions);
        let id = match self.actions.first() {
            Some(Action::Send {
                msg: ToTask::TriggerCheckpoint { id, .. },
                ..
            }) if self.actions.len() == self.tasks.len() => *id,
            _ => panic!("tick did not trigger every task: {:?}", self.actions),
        };
        self.actions.clear();
        for task in &self.tasks {
            let ack = FromTask::Ack {
                task: *task,
                id,
                state: self.state.clone(),
            };
            self.coordinator
                .handle_into(Event::Task(ack), self.now, &mut self.actions);
        }
        match self.actions.as_slice() {
            [Action::Persist(cp)] if cp.id == id && cp.task_states.len() == self.tasks.len() => {}
            _ => panic!("acks of {id} did not ask to persist it: {:?}", self.actions),
        }
        self.actions.clear();
        self.coordinator
            .handle_into(Event::Persisted { id }, self.now, &mut self.actions);
        if self.actions.len() != self.tasks.len() || self.coordinator.last_completed() != Some(id) {
            panic!("persisting {id} did not complete it: {:?}", self.actions);
        }
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_complete_consecutive_checkpoints() {
        for tasks in [1, 2, 64] {
            let mut rounds = AckRounds::new(tasks);
            for expected in 1..=5 {
                assert_eq!(rounds.round(), CheckpointId::new(expected), "{tasks} tasks");
                assert_eq!(rounds.coordinator.in_flight(), 0);
            }
        }
    }

    #[test]
    fn checkpoints_have_the_stated_size_and_are_deterministic() {
        let job = bench_job();
        for (tasks, bytes) in [(4, 1024), (3, 1000), (4, 1 << 20)] {
            let cp = checkpoint_of_size(&job, CheckpointId::FIRST, tasks, bytes);
            assert_eq!(cp.state_bytes(), bytes);
            assert_eq!(cp.task_states.len(), tasks as usize);
            assert_eq!(
                cp,
                checkpoint_of_size(&job, CheckpointId::FIRST, tasks, bytes)
            );
        }
    }
}
