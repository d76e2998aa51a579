//! tinyflow's dataflow runtime.
//!
//! [`JobRunner`] runs a [`JobGraph`](tinyflow_api::JobGraph) on tokio: one
//! task per operator subtask, bounded channels of record batches between
//! them (backpressure), checkpoint barriers in band with alignment, state
//! snapshots in every ack, restore (with redistribution of keyed state when
//! parallelism changes), and failover under a [`RestartStrategy`].
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tinyflow_api::{JobBuilder, JobId};
//! use tinyflow_api::testing::{CollectingSink, VecSource};
//! use tinyflow_checkpoint::testing::MemoryCheckpointStore;
//! use tinyflow_runtime::{CheckpointConfig, JobRunner, RuntimeConfig};
//!
//! let job = JobBuilder::new(JobId::new("doubles").unwrap());
//! let sink = CollectingSink::<u64>::new();
//! job.source("numbers", 2, VecSource::new(vec![(0..100).collect(), (100..200).collect()]))
//!     .map("double", |n: u64| n * 2)
//!     .sink("out", 1, sink.clone());
//! let config = RuntimeConfig {
//!     checkpoint: CheckpointConfig { interval: Some(Duration::from_millis(100)), ..Default::default() },
//!     ..RuntimeConfig::default()
//! };
//! let report = JobRunner::new(job.build().unwrap(), Arc::new(MemoryCheckpointStore::new()), config)
//!     .run()
//!     .await
//!     .unwrap();
//! assert_eq!(report.attempts, 1);
//! let mut out = sink.committed();
//! out.sort();
//! assert_eq!(out, (0..200).map(|n| n * 2).collect::<Vec<u64>>());
//! # });
//! ```

mod error;
mod restart;
mod runner;
pub mod state;
mod task;

pub use error::{Error, Result};
pub use restart::RestartStrategy;
pub use runner::{DEFAULT_BUDGET_RESET, JobReport, JobRunner, RuntimeConfig, StopHandle};
pub use task::Message;
/// What a job's runner is configured with, from the checkpoint crate: the
/// checkpoint settings and the local-directory store, so that a job needs
/// no direct dependency on `tinyflow-checkpoint`.
pub use tinyflow_checkpoint::{CheckpointConfig, CheckpointStore, LocalDirStore};
