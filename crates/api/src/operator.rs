//! What the runtime runs: operators, sources and sinks.
//!
//! Users write typed [`Operator`]s, [`Source`]s, [`Sink`]s and [`Writer`]s
//! (or pass closures to the job builder, [`crate::JobBuilder`]); the builder
//! wraps them into the type-erased forms of [`crate::engine`], which the
//! runtime drives with batches of any type.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::{Deserialize, Serialize};

use crate::data::AnyBatch;
use crate::engine::Collector;
use crate::{CheckpointId, Data, StreamResult};

/// Where an operator instance runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorContext {
    /// The operator's name (unique in the job).
    pub name: String,
    /// This subtask's index, `0..parallelism`.
    pub subtask: usize,
    /// The operator's parallelism.
    pub parallelism: usize,
    /// Number of key groups of the job.
    pub max_parallelism: u16,
}

/// The state of one operator subtask in a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorState {
    /// Keyed state by key group; redistributed over subtasks on restore, so
    /// a job can change its parallelism.
    pub keyed: BTreeMap<u16, Vec<u8>>,
    /// State of the subtask as a whole (not keyed).
    pub local: Option<Vec<u8>>,
}

/// What an operator emits while handling one input: batches of `Out` and
/// watermarks, in order.
pub struct Output<'a, Out> {
    collector: &'a mut Collector,
    _t: PhantomData<fn(Out)>,
}

impl<Out> fmt::Debug for Output<'_, Out> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Output<{}>", std::any::type_name::<Out>())
    }
}

impl<'a, Out: Data> Output<'a, Out> {
    /// An output that collects into `collector` (the engine's side).
    pub(crate) fn new(collector: &'a mut Collector) -> Self {
        Output {
            collector,
            _t: PhantomData,
        }
    }

    /// Emits records (an empty batch is dropped).
    pub fn emit(&mut self, records: Vec<Out>) {
        self.collector.batch(AnyBatch::new(records));
    }

    /// Emits a watermark: event time (ms since the Unix epoch) up to which no
    /// more records are expected.
    pub fn watermark(&mut self, watermark: i64) {
        self.collector.watermark(watermark);
    }
}

/// A transformation from batches of `In` to batches of `Out`, one instance
/// per subtask: what [`Stream::transform`](crate::Stream::transform) adds.
///
/// Stateless per-batch work is simpler with
/// [`Stream::map`](crate::Stream::map) or
/// [`Stream::try_map`](crate::Stream::try_map); implement this trait for
/// operators with state, watermarks or records held until the end.
///
/// ```
/// use tinyflow_api::{Operator, OperatorState, Output, StreamResult};
///
/// /// Running count of the records seen, emitted after every batch.
/// struct Count(u64);
///
/// impl Operator<String, u64> for Count {
///     fn process(&mut self, batch: Vec<String>, out: &mut Output<'_, u64>) -> StreamResult<()> {
///         self.0 += batch.len() as u64;
///         out.emit(vec![self.0]);
///         Ok(())
///     }
///
///     fn snapshot(&mut self) -> StreamResult<OperatorState> {
///         Ok(OperatorState { local: Some(self.0.to_le_bytes().to_vec()), ..OperatorState::default() })
///     }
/// }
/// ```
pub trait Operator<In: Data, Out: Data>: Send {
    /// Processes one input batch.
    fn process(&mut self, batch: Vec<In>, out: &mut Output<'_, Out>) -> StreamResult<()>;

    /// The combined watermark of the inputs advanced to `watermark`. The
    /// default forwards it.
    fn on_watermark(&mut self, watermark: i64, out: &mut Output<'_, Out>) -> StreamResult<()> {
        out.watermark(watermark);
        Ok(())
    }

    /// Every input reached its end (after a final watermark of `i64::MAX`):
    /// emit what is still held.
    fn finish(&mut self, _out: &mut Output<'_, Out>) -> StreamResult<()> {
        Ok(())
    }

    /// The state to checkpoint.
    fn snapshot(&mut self) -> StreamResult<OperatorState> {
        Ok(OperatorState::default())
    }

    /// Restores state (only the key groups this subtask owns).
    fn restore(&mut self, _state: OperatorState) -> StreamResult<()> {
        Ok(())
    }
}

/// Creates an operator's instances.
///
/// Any `Fn(&OperatorContext) -> StreamResult<O>` closure is one.
pub trait OperatorFactory<In: Data, Out: Data>: Send + Sync {
    /// The instance for one subtask.
    fn create(&self, ctx: &OperatorContext) -> StreamResult<Box<dyn Operator<In, Out>>>;
}

impl<In, Out, O, F> OperatorFactory<In, Out> for F
where
    In: Data,
    Out: Data,
    O: Operator<In, Out> + 'static,
    F: Fn(&OperatorContext) -> StreamResult<O> + Send + Sync,
{
    fn create(&self, ctx: &OperatorContext) -> StreamResult<Box<dyn Operator<In, Out>>> {
        Ok(Box::new(self(ctx)?))
    }
}

/// A source of typed records, one instance per subtask.
///
/// Its position is its state: on restore the runtime hands the factory the
/// positions of every subtask of the checkpoint, so it can continue exactly
/// after them (also with a different parallelism).
#[async_trait::async_trait]
pub trait Source<T: Data>: Send {
    /// The next batch; `Ok(None)` at the end of a bounded input.
    ///
    /// Must be cancel safe: the runtime drops the future when a checkpoint
    /// trigger arrives first, and calls it again; nothing may be lost.
    async fn next_batch(&mut self) -> StreamResult<Option<Vec<T>>>;

    /// The position after the last record returned, as the state of
    /// checkpoint `id`. Called once per checkpoint, in increasing id order.
    fn snapshot(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>>;

    /// The position of the last snapshot, for people and tools rather than
    /// for restoring: source-defined names (Kafka: `topic/partition`) to
    /// positions (Kafka: the next offset to read). The runtime carries them
    /// with the barrier to the sinks, which may record them with the data
    /// (the Iceberg sink puts them in the snapshot summary). The default
    /// reports none.
    fn positions(&self) -> SourcePositions {
        SourcePositions::new()
    }

    /// Checkpoint `id` is durable (e.g. commit offsets for lag monitoring).
    /// Completion of `id` also covers every lower id whose notification was
    /// coalesced or lost.
    async fn checkpoint_complete(&mut self, _id: CheckpointId) -> StreamResult<()> {
        Ok(())
    }

    /// Event-time progress, asked after every call to `next_batch`. The
    /// default tracks no event time.
    fn watermark(&self) -> SourceWatermark {
        SourceWatermark::None
    }
}

/// One source subtask's positions at a checkpoint: see [`Source::positions`].
pub type SourcePositions = BTreeMap<String, String>;

/// The positions of every source of a job at a checkpoint barrier, by source
/// node name: what the data before the barrier was read up to.
pub type JobPositions = BTreeMap<String, SourcePositions>;

/// Adds `from` to `into`. The subtasks of one source own disjoint
/// partitions, so their positions add up rather than replace each other.
pub fn merge_positions(into: &mut JobPositions, from: JobPositions) {
    for (source, at) in from {
        into.entry(source).or_default().extend(at);
    }
}

/// Event-time progress of a source subtask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceWatermark {
    /// The source tracks no event time.
    None,
    /// No record with an event time before this will follow.
    At(i64),
    /// The source has had no data for a while: operators downstream combine
    /// the watermarks of their other inputs without waiting for this one
    /// until it reports a watermark again.
    Idle,
}

/// Creates a source's instances.
pub trait SourceFactory<T: Data>: Send + Sync {
    /// The instance for one subtask; `restored` holds the snapshots of every
    /// subtask of this source in the restored checkpoint (empty on a fresh
    /// start).
    fn create(
        &self,
        ctx: &OperatorContext,
        restored: &[Vec<u8>],
    ) -> StreamResult<Box<dyn Source<T>>>;
}

/// A two-phase-commit sink of typed records, one instance per subtask.
#[async_trait::async_trait]
pub trait Sink<T: Data>: Send {
    /// Writes records (invisible until committed).
    async fn write(&mut self, batch: Vec<T>) -> StreamResult<()>;

    /// Barrier `id` arrived: stage everything written since the previous
    /// barrier under `id` and return all staged, uncommitted work; it becomes
    /// the subtask's checkpoint state.
    async fn prepare_commit(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>>;

    /// Checkpoint `id` is durable: commit everything staged under ids up to
    /// and including `id`. Must be idempotent by checkpoint id.
    async fn commit(&mut self, id: CheckpointId) -> StreamResult<()>;

    /// The combined watermark of the inputs advanced: every record with an
    /// earlier event time has been written. The default ignores it.
    fn on_watermark(&mut self, _watermark: i64) {}

    /// Called just before [`Sink::prepare_commit`] for barrier `id`: where
    /// the sources stood at that barrier, merged over every input (see
    /// [`Source::positions`]). The default ignores them.
    fn on_positions(&mut self, _id: CheckpointId, _positions: &JobPositions) {}

    /// The job attempt ends without a failure of this task: no further
    /// checkpoint will be notified, and every one passed to
    /// [`Sink::commit`] is complete. A sink that holds commits back (a
    /// commit cadence) commits them now, so a stopped job leaves everything
    /// up to its final checkpoint visible. The default does nothing.
    async fn job_finished(&mut self) -> StreamResult<()> {
        Ok(())
    }
}

/// What a restored sink gets: the checkpoint and every subtask's staged work.
#[derive(Debug, Clone, Copy)]
pub struct SinkRestore<'a> {
    /// The restored checkpoint.
    pub checkpoint: CheckpointId,
    /// The snapshots of every subtask of this sink in that checkpoint.
    pub states: &'a [Vec<u8>],
}

/// Creates a sink's instances.
#[async_trait::async_trait]
pub trait SinkFactory<T: Data>: Send + Sync {
    /// The instance for one subtask. On restore, the instances together must
    /// commit the restored staged work up to the restored checkpoint that is
    /// not committed yet (subtask 0 may do it for all), and drop nothing.
    async fn create(
        &self,
        ctx: &OperatorContext,
        restored: Option<SinkRestore<'_>>,
    ) -> StreamResult<Box<dyn Sink<T>>>;

    /// Whether the sink makes data visible only on commit (the default).
    /// A job with a transactional sink must checkpoint; a sink that is not
    /// (a counter, a log) may run with checkpointing off.
    fn is_transactional(&self) -> bool {
        true
    }

    /// The highest checkpoint id this sink has committed for good, read from
    /// its target (e.g. an Iceberg table's properties) before the job starts.
    /// The job's next checkpoint id is above it, so a wiped checkpoint store
    /// cannot make new data look committed already.
    async fn last_committed(&self) -> StreamResult<Option<CheckpointId>> {
        Ok(None)
    }
}

/// A parallel writer in front of a committer: the first stage of a sink
/// that writes in parallel and commits in one place (e.g. Parquet files
/// written by many subtasks, added to a table by one).
///
/// On each barrier the runtime calls [`Writer::flush`] and sends what it
/// returns (the committables: e.g. file metadata) downstream before the
/// barrier, so the committer stages them under that checkpoint. Nothing
/// stays open across a barrier, so a writer has no state of its own:
/// whatever it wrote after the last completed checkpoint is orphaned by a
/// failure and never committed.
#[async_trait::async_trait]
pub trait Writer<T: Data, C: Data>: Send {
    /// Writes records (invisible until committed downstream).
    async fn write(&mut self, batch: Vec<T>) -> StreamResult<()>;

    /// Barrier `id` arrived: close everything open and return the
    /// committables of all that was written since the previous barrier.
    async fn flush(&mut self, id: CheckpointId) -> StreamResult<Vec<C>>;
}

/// Creates a writer's instances.
#[async_trait::async_trait]
pub trait WriterFactory<T: Data, C: Data>: Send + Sync {
    /// The instance for one subtask.
    async fn create(&self, ctx: &OperatorContext) -> StreamResult<Box<dyn Writer<T, C>>>;
}
