//! The shared vocabulary of tinyflow.
//!
//! Every other crate speaks through the types defined here: id newtypes
//! ([`CheckpointId`], [`TaskId`], [`JobId`], [`SinkId`]), the control messages
//! exchanged between the checkpoint coordinator and the tasks ([`ToTask`],
//! [`FromTask`]), the traits that join the crates ([`ControlChannel`],
//! [`CheckpointStore`], [`WallClock`]) and the error type ([`StreamError`]).
//!
//! The crate is deliberately light: it depends on `tokio`'s `sync` module only,
//! so a connector or a user crate can name the vocabulary without pulling in a
//! runtime. In-memory fakes of the traits live behind the `testing` feature so
//! every crate's tests share one set.
//!
//! ```
//! use tinyflow_api::{CheckpointId, TaskId, ToTask};
//!
//! let first = CheckpointId::FIRST;
//! assert_eq!(first.next(), CheckpointId::new(2));
//! let msg = ToTask::TriggerCheckpoint { id: first, timestamp_ms: 1_700_000_000_000 };
//! assert_eq!(msg.checkpoint_id(), first);
//! assert_eq!(TaskId::new(3).to_string(), "task-3");
//! ```

mod channel;
mod checkpoint;
mod clock;
mod control;
mod data;
mod error;
mod ids;
mod job;
mod operator;
pub mod secrets;
mod window;

#[cfg(feature = "testing")]
pub mod testing;

pub use channel::{BoxFuture, ChannelClosed, ControlChannel, TrySendError};
pub use checkpoint::{CheckpointStore, CompletedCheckpoint, StateHandle};
pub use clock::{SystemWallClock, WallClock, civil_date, this_process};
pub use control::{AbortReason, DeclineReason, FromTask, TaskRole, ToTask};
pub use data::{
    AnyBatch, DEFAULT_MAX_PARALLELISM, Data, Key, StateValue, key_group, key_groups_of,
    owner_of_group,
};
pub use error::{CorruptReason, StreamError, StreamResult, error_chain};
pub use ids::{CheckpointId, IdError, JobId, SinkId, TaskId};
pub use job::{
    Edge, JobBuilder, JobGraph, KeyedStream, Node, NodeId, NodeKind, Partitioner, Partitioning,
    Stream,
};
pub use operator::{
    Collector, Emitted, ErasedSink, ErasedSinkFactory, ErasedSource, ErasedSourceFactory,
    ErasedWriter, ErasedWriterFactory, JobPositions, Operator, OperatorContext, OperatorFactory,
    OperatorState, Sink, SinkFactory, SinkRestore, Source, SourceFactory, SourcePositions,
    SourceWatermark, Writer, WriterFactory, merge_positions,
};
pub use window::{TumblingWindows, Window, WindowOutput, WindowedStream};
