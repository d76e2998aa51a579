//! tinyflow's checkpoint coordinator.
//!
//! - [`Coordinator`]: the decisions, as a pure state machine (event and time
//!   in, actions out). Property-tested against a reference model.
//! - [`CoordinatorDriver`]: the thin async shell that feeds it events from
//!   channels, timers and the store, and performs its actions.
//! - [`LocalDirStore`]: a [`CheckpointStore`] in a local directory, with
//!   atomic writes, checksums, retention and fallback to the previous
//!   checkpoint when the newest is damaged.
//! - [`ObjectStore`]: a [`CheckpointStore`] on object storage (S3 and
//!   compatible stores) through the [`ObjectStorage`] trait, so that a worker
//!   on another machine finds the job's checkpoints.
//! - The protocol between the coordinator and the tasks: control messages
//!   ([`ToTask`], [`FromTask`]), the [`ControlChannel`] they travel on, the
//!   tasks' [`StateHandle`]s and the [`CompletedCheckpoint`]s a
//!   [`CheckpointStore`] keeps, stamped by a [`WallClock`].
//! - [`testing`] (feature `testing`): a memory store, a manual clock and
//!   control channels for tests.
//!
//! A minimal job: one task that acks every checkpoint it is asked for.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tinyflow_api::{JobId, TaskId};
//! use tinyflow_checkpoint::testing::MemoryCheckpointStore;
//! use tinyflow_checkpoint::{
//!     CheckpointConfig, CoordinatorDriver, DriverConfig, FromTask, Outcome, StateHandle,
//!     SystemWallClock, TaskRole, ToTask,
//! };
//!
//! let config = CheckpointConfig { interval: Some(Duration::from_secs(1)), ..CheckpointConfig::default() };
//! let store = MemoryCheckpointStore::new();
//! let (driver, handle, restored) = CoordinatorDriver::start(
//!     DriverConfig::new(JobId::new("demo").unwrap(), config),
//!     Arc::new(store.clone()),
//!     Arc::new(SystemWallClock),
//! ).await.unwrap();
//! assert!(restored.checkpoint.is_none());
//!
//! let task = TaskId::new(0);
//! let (tx, mut rx) = tokio::sync::mpsc::channel(8);
//! handle.register(task, TaskRole::Source, tx).await.unwrap();
//! let job = tokio::spawn(driver.run(std::future::pending()));
//!
//! // Play the task: ack the first checkpoint, then report the end of input.
//! let Some(ToTask::TriggerCheckpoint { id, .. }) = rx.recv().await else { panic!() };
//! handle.send(FromTask::Ack { task, id, state: StateHandle::from(b"offset=42".to_vec()) }).await.unwrap();
//! assert_eq!(rx.recv().await, Some(ToTask::NotifyComplete { id }));
//! handle.send(FromTask::EndOfInput { task }).await.unwrap();
//! let Some(ToTask::TriggerCheckpoint { id: last, .. }) = rx.recv().await else { panic!() };
//! handle.send(FromTask::Ack { task, id: last, state: StateHandle::from(b"offset=99".to_vec()) }).await.unwrap();
//! assert_eq!(rx.recv().await, Some(ToTask::NotifyComplete { id: last }));
//! assert_eq!(job.await.unwrap().unwrap(), Outcome::Finished { final_checkpoint: Some(last) });
//! assert_eq!(store.persisted_ids(), vec![id, last]);
//! # });
//! ```

mod channel;
mod clock;
mod completed;
mod config;
mod control;
pub mod coordinator;
pub mod driver;
mod error;
pub mod object;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use channel::{BoxFuture, ChannelClosed, ControlChannel, TrySendError};
pub use clock::{SystemWallClock, WallClock};
pub use completed::{CheckpointStore, CompletedCheckpoint, StateHandle};
pub use control::{AbortReason, DeclineReason, FromTask, TaskRole, ToTask};

pub use config::{CheckpointConfig, MAX_CONCURRENT_LIMIT};
pub use coordinator::{Action, Coordinator, Event, Now, Phase};
pub use driver::{
    CoordinatorDriver, CoordinatorGone, CoordinatorHandle, DriverConfig, Outcome, Restored,
};
pub use error::{CorruptReason, Error, LossCause, Result};
pub use object::{ObjectStorage, ObjectStore};
pub use store::{LOCK_FILE, LocalDirStore};
