//! The engine's side of the API: type-erased operators, sources, sinks and
//! writers, the batches they pass, and the job graph's parts.
//!
//! Job and connector authors never need this module: the job builder wraps
//! their typed [`Operator`]s, [`Source`]s, [`Sink`]s and [`Writer`]s into the
//! forms here, which the runtime drives without knowing record types. It is
//! public for the runtime crate only, and hidden from the docs.

use std::marker::PhantomData;

use crate::operator::Output;
use crate::{
    CheckpointId, Data, JobPositions, Operator, OperatorContext, OperatorFactory, OperatorState,
    Sink, SinkFactory, SinkRestore, Source, SourceFactory, SourcePositions, SourceWatermark,
    StreamError, StreamResult, Writer, WriterFactory,
};

pub use crate::data::{AnyBatch, key_groups_of, owner_of_group};
pub use crate::job::{Edge, Node, NodeId, NodeKind, Partitioner, Partitioning};

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

/// [`Operator`] with the record types erased, as the runtime drives it.
pub trait ErasedOperator: Send {
    /// See [`Operator::process`]; fails on a batch of another type.
    fn process(&mut self, batch: AnyBatch, out: &mut Collector) -> StreamResult<()>;
    /// See [`Operator::on_watermark`].
    fn on_watermark(&mut self, watermark: i64, out: &mut Collector) -> StreamResult<()>;
    /// See [`Operator::finish`].
    fn finish(&mut self, out: &mut Collector) -> StreamResult<()>;
    /// See [`Operator::snapshot`].
    fn snapshot(&mut self) -> StreamResult<OperatorState>;
    /// See [`Operator::restore`].
    fn restore(&mut self, state: OperatorState) -> StreamResult<()>;
}

/// [`OperatorFactory`] with the record types erased.
pub trait ErasedOperatorFactory: Send + Sync {
    /// See [`OperatorFactory::create`].
    fn create(&self, ctx: &OperatorContext) -> StreamResult<Box<dyn ErasedOperator>>;
}

pub(crate) struct TypedOperator<In, Out> {
    inner: Box<dyn Operator<In, Out>>,
    name: String,
}

impl<In: Data, Out: Data> ErasedOperator for TypedOperator<In, Out> {
    fn process(&mut self, batch: AnyBatch, out: &mut Collector) -> StreamResult<()> {
        let records = downcast::<In>(batch, &self.name)?;
        self.inner.process(records, &mut Output::new(out))
    }

    fn on_watermark(&mut self, watermark: i64, out: &mut Collector) -> StreamResult<()> {
        self.inner.on_watermark(watermark, &mut Output::new(out))
    }

    fn finish(&mut self, out: &mut Collector) -> StreamResult<()> {
        self.inner.finish(&mut Output::new(out))
    }

    fn snapshot(&mut self) -> StreamResult<OperatorState> {
        self.inner.snapshot()
    }

    fn restore(&mut self, state: OperatorState) -> StreamResult<()> {
        self.inner.restore(state)
    }
}

pub(crate) struct TypedOperatorFactory<In, Out, F>(
    pub(crate) F,
    pub(crate) PhantomData<fn(In) -> Out>,
);

impl<In: Data, Out: Data, F: OperatorFactory<In, Out>> ErasedOperatorFactory
    for TypedOperatorFactory<In, Out, F>
{
    fn create(&self, ctx: &OperatorContext) -> StreamResult<Box<dyn ErasedOperator>> {
        Ok(Box::new(TypedOperator {
            inner: self.0.create(ctx)?,
            name: ctx.name.clone(),
        }))
    }
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

pub(crate) struct TypedWriterFactory<T, C, F>(pub(crate) F, pub(crate) PhantomData<fn() -> (T, C)>);

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

pub(crate) struct TypedSourceFactory<T, F>(pub(crate) F, pub(crate) PhantomData<fn() -> T>);

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

pub(crate) struct TypedSinkFactory<T, F>(pub(crate) F, pub(crate) PhantomData<fn() -> T>);

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
        .map_err(|b| StreamError::TypeMismatch {
            operator: name.to_owned(),
            expected: std::any::type_name::<T>(),
            found: b.type_name(),
        })
}
