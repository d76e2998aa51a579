//! Writing tinyflow jobs and connectors.
//!
//! A job is a graph built with [`JobBuilder`]: a [`Source`] feeds typed
//! [`Stream`]s, which closures ([`Stream::map`], [`Stream::filter`],
//! [`Stream::try_map`], [`KeyedStream::reduce`],
//! [`KeyedStream::window_aggregate`]) or custom [`Operator`]s transform, and
//! which end in a two-phase-commit [`Sink`] (or a parallel [`Writer`] in front
//! of a committing sink). `tinyflow-runtime` runs the graph with exactly-once
//! checkpoints; the connector crates provide Kafka sources and Iceberg sinks.
//!
//! ```
//! use tinyflow_api::prelude::*;
//! use tinyflow_api::testing::{CollectingSink, VecSource};
//!
//! let job = JobBuilder::new(JobId::new("word-lengths").unwrap());
//! let lengths = CollectingSink::<(String, usize)>::new();
//! job.source("words", 1, VecSource::new(vec![vec!["a".to_owned(), "bb".into()]]))
//!     .map("length", |w: String| { let n = w.len(); (w, n) })
//!     .filter("long", |(_, n): &(String, usize)| *n > 1)
//!     .sink("out", 1, lengths.clone());
//! let graph = job.build().unwrap();
//! assert_eq!(graph.nodes.len(), 4);
//! ```
//!
//! What is where:
//! - **Jobs**: [`JobBuilder`], [`Stream`], [`KeyedStream`], windows
//!   ([`TumblingWindows`], [`WindowedStream`]), record bounds ([`Data`],
//!   [`Key`], [`StateValue`]).
//! - **Custom operators**: [`Operator`], [`OperatorFactory`], [`Output`],
//!   with their [`OperatorContext`] and checkpointed [`OperatorState`].
//! - **Connectors**: [`Source`], [`Sink`], [`Writer`] and their factories;
//!   the positions sources report ([`SourcePositions`]).
//! - **Ids and errors**: [`JobId`], [`CheckpointId`], [`StreamError`].
//! - [`testing`] (feature `testing`): a replayable source and a collecting
//!   sink for tests.
//!
//! The checkpoint protocol (control messages, checkpoint stores) lives in
//! `tinyflow-checkpoint`; connectors never need it.

mod data;
#[doc(hidden)]
pub mod engine;
mod error;
mod ids;
mod job;
mod operator;
pub mod secrets;
pub mod util;
mod window;

#[cfg(feature = "testing")]
pub mod testing;

pub use data::{DEFAULT_MAX_PARALLELISM, Data, Key, StateValue, key_group};
pub use error::{BoxError, StreamError, StreamResult, error_chain};
pub use ids::{CheckpointId, IdError, JobId, RescaleFrom, TaskId, Worker};
pub use job::{JobBuilder, JobGraph, KeyedStream, Stream};
pub use operator::{
    JobPositions, Operator, OperatorContext, OperatorFactory, OperatorState, Output, Sink,
    SinkFactory, SinkRestore, Source, SourceFactory, SourcePositions, SourceWatermark, Writer,
    WriterFactory, merge_positions,
};
pub use window::{TumblingWindows, Window, WindowOutput, WindowedStream};

/// What a job needs in scope: `use tinyflow_api::prelude::*;`.
pub mod prelude {
    pub use crate::{
        Data, JobBuilder, JobId, Key, KeyedStream, Operator, OperatorContext, OperatorFactory,
        OperatorState, Output, StateValue, Stream, StreamError, StreamResult, TumblingWindows,
        Window, WindowOutput,
    };
}
