//! What the runtime runs: operators, sources and sinks.
//!
//! Users write typed [`Source`]s and [`Sink`]s and pass closures to the job
//! builder ([`crate::JobBuilder`]); the builder wraps them into the
//! type-erased forms in this module ([`Operator`], [`ErasedSource`],
//! [`ErasedSink`]), which the runtime drives with [`AnyBatch`]es.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{AnyBatch, CheckpointId, Data, StreamResult};

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

/// What an operator emits while handling one input: batches and
/// watermarks, in order.
#[derive(Debug, Default)]
pub struct Collector {
    items: Vec<Emitted>,
}

/// One item a [`Collector`] holds.
#[derive(Debug)]
pub enum Emitted {
    /// Records.
    Batch(AnyBatch),
    /// Event time (ms since the Unix epoch) up to which no more records are
    /// expected.
    Watermark(i64),
}

impl Collector {
    /// Emits records (an empty batch is dropped).
    pub fn batch(&mut self, batch: AnyBatch) {
        if !batch.is_empty() {
            self.items.push(Emitted::Batch(batch));
        }
    }

    /// Emits a watermark.
    pub fn watermark(&mut self, watermark: i64) {
        self.items.push(Emitted::Watermark(watermark));
    }

    /// Takes what was emitted.
    pub fn drain(&mut self) -> std::vec::Drain<'_, Emitted> {
        self.items.drain(..)
    }
}

/// A type-erased transformation, one instance per subtask.
pub trait Operator: Send {
    /// Processes one input batch.
    fn process(&mut self, batch: AnyBatch, out: &mut Collector) -> StreamResult<()>;

    /// The combined watermark of the inputs advanced to `watermark`. The
    /// default forwards it.
    fn on_watermark(&mut self, watermark: i64, out: &mut Collector) -> StreamResult<()> {
        out.watermark(watermark);
        Ok(())
    }

    /// Every input reached its end (after a final watermark of `i64::MAX`):
    /// emit what is still held.
    fn finish(&mut self, _out: &mut Collector) -> StreamResult<()> {
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
pub trait OperatorFactory: Send + Sync {
    /// The instance for one subtask.
    fn create(&self, ctx: &OperatorContext) -> StreamResult<Box<dyn Operator>>;
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

/// [`Writer`] with the record types erased.
#[async_trait::async_trait]
pub trait ErasedWriter: Send {
    /// See [`Writer::write`]; fails on a batch of another type.
    async fn write(&mut self, batch: AnyBatch) -> StreamResult<()>;
    /// See [`Writer::flush`].
    async fn flush(&mut self, id: CheckpointId) -> StreamResult<AnyBatch>;
}

/// [`WriterFactory`] with the record types erased.
#[async_trait::async_trait]
pub trait ErasedWriterFactory: Send + Sync {
    /// See [`WriterFactory::create`].
    async fn create(&self, ctx: &OperatorContext) -> StreamResult<Box<dyn ErasedWriter>>;
}

pub(crate) struct TypedWriter<T, C> {
    pub(crate) inner: Box<dyn Writer<T, C>>,
    pub(crate) name: String,
}

#[async_trait::async_trait]
impl<T: Data, C: Data> ErasedWriter for TypedWriter<T, C> {
    async fn write(&mut self, batch: AnyBatch) -> StreamResult<()> {
        let records = downcast::<T>(batch, &self.name)?;
        self.inner.write(records).await
    }

    async fn flush(&mut self, id: CheckpointId) -> StreamResult<AnyBatch> {
        Ok(AnyBatch::new(self.inner.flush(id).await?))
    }
}

pub(crate) struct TypedWriterFactory<T, C, F>(
    pub(crate) F,
    pub(crate) std::marker::PhantomData<fn() -> (T, C)>,
);

#[async_trait::async_trait]
impl<T: Data, C: Data, F: WriterFactory<T, C>> ErasedWriterFactory for TypedWriterFactory<T, C, F> {
    async fn create(&self, ctx: &OperatorContext) -> StreamResult<Box<dyn ErasedWriter>> {
        Ok(Box::new(TypedWriter {
            inner: self.0.create(ctx).await?,
            name: ctx.name.clone(),
        }))
    }
}

/// [`Source`] with the record type erased, as the runtime drives it.
#[async_trait::async_trait]
pub trait ErasedSource: Send {
    /// See [`Source::next_batch`].
    async fn next_batch(&mut self) -> StreamResult<Option<AnyBatch>>;
    /// See [`Source::snapshot`].
    fn snapshot(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>>;
    /// See [`Source::positions`].
    fn positions(&self) -> SourcePositions;
    /// See [`Source::checkpoint_complete`].
    async fn checkpoint_complete(&mut self, id: CheckpointId) -> StreamResult<()>;
    /// See [`Source::watermark`].
    fn watermark(&self) -> SourceWatermark;
}

/// [`SourceFactory`] with the record type erased.
pub trait ErasedSourceFactory: Send + Sync {
    /// See [`SourceFactory::create`].
    fn create(
        &self,
        ctx: &OperatorContext,
        restored: &[Vec<u8>],
    ) -> StreamResult<Box<dyn ErasedSource>>;
}

/// [`Sink`] with the record type erased.
#[async_trait::async_trait]
pub trait ErasedSink: Send {
    /// See [`Sink::write`]; fails on a batch of another type.
    async fn write(&mut self, batch: AnyBatch) -> StreamResult<()>;
    /// See [`Sink::prepare_commit`].
    async fn prepare_commit(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>>;
    /// See [`Sink::commit`].
    async fn commit(&mut self, id: CheckpointId) -> StreamResult<()>;
    /// See [`Sink::on_watermark`].
    fn on_watermark(&mut self, watermark: i64);
    /// See [`Sink::on_positions`].
    fn on_positions(&mut self, id: CheckpointId, positions: &JobPositions);
    /// See [`Sink::job_finished`].
    async fn job_finished(&mut self) -> StreamResult<()>;
}

/// [`SinkFactory`] with the record type erased.
#[async_trait::async_trait]
pub trait ErasedSinkFactory: Send + Sync {
    /// See [`SinkFactory::create`].
    async fn create(
        &self,
        ctx: &OperatorContext,
        restored: Option<SinkRestore<'_>>,
    ) -> StreamResult<Box<dyn ErasedSink>>;

    /// See [`SinkFactory::is_transactional`].
    fn is_transactional(&self) -> bool;

    /// See [`SinkFactory::last_committed`].
    async fn last_committed(&self) -> StreamResult<Option<CheckpointId>>;
}

pub(crate) struct TypedSource<T>(pub(crate) Box<dyn Source<T>>);

#[async_trait::async_trait]
impl<T: Data> ErasedSource for TypedSource<T> {
    async fn next_batch(&mut self) -> StreamResult<Option<AnyBatch>> {
        Ok(self.0.next_batch().await?.map(AnyBatch::new))
    }

    fn snapshot(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>> {
        self.0.snapshot(id)
    }

    fn positions(&self) -> SourcePositions {
        self.0.positions()
    }

    async fn checkpoint_complete(&mut self, id: CheckpointId) -> StreamResult<()> {
        self.0.checkpoint_complete(id).await
    }

    fn watermark(&self) -> SourceWatermark {
        self.0.watermark()
    }
}

pub(crate) struct TypedSourceFactory<T, F>(
    pub(crate) F,
    pub(crate) std::marker::PhantomData<fn() -> T>,
);

impl<T: Data, F: SourceFactory<T>> ErasedSourceFactory for TypedSourceFactory<T, F> {
    fn create(
        &self,
        ctx: &OperatorContext,
        restored: &[Vec<u8>],
    ) -> StreamResult<Box<dyn ErasedSource>> {
        Ok(Box::new(TypedSource(self.0.create(ctx, restored)?)))
    }
}

pub(crate) struct TypedSink<T> {
    pub(crate) inner: Box<dyn Sink<T>>,
    pub(crate) name: String,
}

#[async_trait::async_trait]
impl<T: Data> ErasedSink for TypedSink<T> {
    async fn write(&mut self, batch: AnyBatch) -> StreamResult<()> {
        let records = downcast::<T>(batch, &self.name)?;
        self.inner.write(records).await
    }

    async fn prepare_commit(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>> {
        self.inner.prepare_commit(id).await
    }

    async fn commit(&mut self, id: CheckpointId) -> StreamResult<()> {
        self.inner.commit(id).await
    }

    fn on_watermark(&mut self, watermark: i64) {
        self.inner.on_watermark(watermark);
    }

    fn on_positions(&mut self, id: CheckpointId, positions: &JobPositions) {
        self.inner.on_positions(id, positions);
    }

    async fn job_finished(&mut self) -> StreamResult<()> {
        self.inner.job_finished().await
    }
}

pub(crate) struct TypedSinkFactory<T, F>(
    pub(crate) F,
    pub(crate) std::marker::PhantomData<fn() -> T>,
);

#[async_trait::async_trait]
impl<T: Data, F: SinkFactory<T>> ErasedSinkFactory for TypedSinkFactory<T, F> {
    async fn create(
        &self,
        ctx: &OperatorContext,
        restored: Option<SinkRestore<'_>>,
    ) -> StreamResult<Box<dyn ErasedSink>> {
        let inner = self.0.create(ctx, restored).await?;
        Ok(Box::new(TypedSink {
            inner,
            name: ctx.name.clone(),
        }))
    }

    fn is_transactional(&self) -> bool {
        self.0.is_transactional()
    }

    async fn last_committed(&self) -> StreamResult<Option<CheckpointId>> {
        self.0.last_committed().await
    }
}

/// Unwraps a batch for operator `name`, or says which types disagreed.
pub(crate) fn downcast<T: Data>(batch: AnyBatch, name: &str) -> StreamResult<Vec<T>> {
    batch
        .downcast::<T>()
        .map_err(|b| crate::StreamError::TypeMismatch {
            operator: name.to_owned(),
            expected: std::any::type_name::<T>(),
            found: b.type_name(),
        })
}
