//! The task loops: one tokio task per operator subtask.
//!
//! Data moves in bounded channels of [`Message`]s (record batches, barriers,
//! end of data), one channel per upstream subtask, so a full channel
//! backpressures exactly its producer and an input can be held during barrier
//! alignment. Control messages from the coordinator arrive on a separate
//! channel and are served first.
//!
//! - Source task: on `TriggerCheckpoint(N)` it snapshots its position, sends
//!   barrier N to every output after everything it emitted before, and acks.
//!   At the end of its input it sends `EndOfData` and reports it; it keeps
//!   serving triggers (the final checkpoint) until the coordinator is done.
//! - Operator task: processes batches; on barrier N from one input it holds
//!   that input until barrier N came on every input (alignment), then
//!   snapshots, forwards barrier N and acks.
//! - Sink task: writes batches; on aligned barrier N stages its work under N
//!   and acks with it; on `NotifyComplete(N)` commits everything up to N.
//!
//! Every loop ends when its control channel closes (the coordinator finished
//! or the attempt is being torn down).

use std::future::poll_fn;
use std::task::Poll;

use tinyflow_api::{
    AnyBatch, CheckpointId, Collector, Emitted, ErasedSink, ErasedSource, FromTask, Operator,
    Partitioning, TaskId, ToTask,
};
use tinyflow_checkpoint::CoordinatorHandle;
use tokio::sync::mpsc;

use crate::state::{NodeState, TaskSnapshot};

/// What travels between tasks.
#[derive(Debug)]
pub enum Message {
    /// Records.
    Data(AnyBatch),
    /// Checkpoint barrier.
    Barrier(CheckpointId),
    /// Event time up to which the upstream subtask will send no more records.
    Watermark(i64),
    /// The upstream subtask will send no more records (barriers may follow).
    EndOfData,
}

/// One outgoing edge of a task.
pub(crate) struct Output {
    pub(crate) targets: Vec<mpsc::Sender<Message>>,
    pub(crate) partitioning: Partitioning,
    pub(crate) max_parallelism: u16,
    pub(crate) next: usize,
}

/// The receiving end of the job: every channel closed means the attempt is
/// being torn down.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Disconnected;

/// Identity and plumbing shared by every kind of task.
pub(crate) struct TaskIo {
    pub(crate) id: TaskId,
    pub(crate) node: String,
    pub(crate) subtask: u32,
    pub(crate) control: mpsc::Receiver<ToTask>,
    pub(crate) coordinator: CoordinatorHandle,
    pub(crate) inputs: Vec<mpsc::Receiver<Message>>,
    pub(crate) outputs: Vec<Output>,
    pub(crate) metrics: TaskMetrics,
}

impl TaskIo {
    pub(crate) fn label(&self) -> String {
        format!("{}[{}]", self.node, self.subtask)
    }

    async fn emit(&mut self, batch: AnyBatch) -> Result<(), TaskError> {
        let n = self.outputs.len();
        let mut batch = Some(batch);
        for (i, out) in self.outputs.iter_mut().enumerate() {
            // Fan-out clones; the last edge takes the batch itself.
            let batch = if i + 1 == n {
                batch.take().expect("taken once, by the last edge")
            } else {
                batch.clone().expect("present until the last edge")
            };
            match &out.partitioning {
                Partitioning::Forward => {
                    send(
                        &out.targets[0],
                        Message::Data(batch),
                        &self.metrics.backpressure,
                    )
                    .await?
                }
                Partitioning::Rebalance => {
                    let at = out.next % out.targets.len();
                    out.next = out.next.wrapping_add(1);
                    send(
                        &out.targets[at],
                        Message::Data(batch),
                        &self.metrics.backpressure,
                    )
                    .await?;
                }
                Partitioning::Hash(p) => {
                    for (at, part) in p.partition(batch, out.max_parallelism, out.targets.len())? {
                        send(
                            &out.targets[at],
                            Message::Data(part),
                            &self.metrics.backpressure,
                        )
                        .await?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Sends what an operator emitted, in order; returns the records sent.
    async fn emit_collected(&mut self, out: &mut Collector) -> Result<u64, TaskError> {
        let mut records = 0;
        let items: Vec<Emitted> = out.drain().collect();
        for item in items {
            match item {
                Emitted::Batch(b) => {
                    records += b.len() as u64;
                    self.emit(b).await?;
                }
                Emitted::Watermark(w) => self.broadcast(|| Message::Watermark(w)).await?,
            }
        }
        self.metrics.records_out.increment(records);
        Ok(records)
    }

    async fn broadcast(&mut self, msg: impl Fn() -> Message) -> Result<(), TaskError> {
        for out in &self.outputs {
            for target in &out.targets {
                send(target, msg(), &self.metrics.backpressure).await?;
            }
        }
        Ok(())
    }

    async fn ack(&self, id: CheckpointId, state: NodeState) -> Result<(), TaskError> {
        let snap = TaskSnapshot {
            node: self.node.clone(),
            subtask: self.subtask,
            state,
        };
        let state = snap.encode()?;
        self.coordinator
            .send(FromTask::Ack {
                task: self.id,
                id,
                state,
            })
            .await
            .map_err(|_| TaskError::Gone)
    }
}

/// Sends without waiting when there is room; otherwise waits, and counts
/// the wait as backpressure.
async fn send(
    target: &mpsc::Sender<Message>,
    msg: Message,
    backpressure: &metrics::Counter,
) -> Result<(), TaskError> {
    match target.try_send(msg) {
        Ok(()) => Ok(()),
        Err(mpsc::error::TrySendError::Closed(_)) => Err(TaskError::Gone),
        Err(mpsc::error::TrySendError::Full(msg)) => {
            let waited = tokio::time::Instant::now();
            target.send(msg).await.map_err(|_| TaskError::Gone)?;
            backpressure.increment(u64::try_from(waited.elapsed().as_micros()).unwrap_or(u64::MAX));
            Ok(())
        }
    }
}

/// A task's metrics, through the `metrics` facade (no-ops until the
/// application installs a recorder, e.g. a Prometheus exporter).
#[derive(Clone)]
pub(crate) struct TaskMetrics {
    pub(crate) records_in: metrics::Counter,
    pub(crate) records_out: metrics::Counter,
    pub(crate) alignment: metrics::Histogram,
    pub(crate) backpressure: metrics::Counter,
}

impl TaskMetrics {
    pub(crate) fn new(node: &str, subtask: usize) -> Self {
        let labels = [
            ("operator", node.to_owned()),
            ("subtask", subtask.to_string()),
        ];
        TaskMetrics {
            records_in: metrics::counter!("tinyflow_records_in_total", &labels),
            records_out: metrics::counter!("tinyflow_records_out_total", &labels),
            alignment: metrics::histogram!("tinyflow_alignment_seconds", &labels),
            backpressure: metrics::counter!("tinyflow_backpressure_microseconds_total", &labels),
        }
    }
}

/// How a task loop ends badly.
#[derive(Debug)]
pub(crate) enum TaskError {
    /// Its user code, connector or state failed.
    Failed(tinyflow_api::StreamError),
    /// A peer or the coordinator is gone: the attempt is being torn down,
    /// and the task that caused it reports the cause.
    Gone,
}

impl From<tinyflow_api::StreamError> for TaskError {
    fn from(e: tinyflow_api::StreamError) -> Self {
        TaskError::Failed(e)
    }
}

impl From<Disconnected> for TaskError {
    fn from(_: Disconnected) -> Self {
        TaskError::Gone
    }
}

pub(crate) async fn run_source(
    mut io: TaskIo,
    mut source: Box<dyn ErasedSource>,
) -> Result<(), TaskError> {
    let mut ended = false;
    let mut records = 0u64;
    loop {
        tokio::select! {
            biased;
            msg = io.control.recv() => match msg {
                Some(ToTask::TriggerCheckpoint { id, .. }) => {
                    let position = source.snapshot()?;
                    io.broadcast(|| Message::Barrier(id)).await?;
                    io.ack(id, NodeState::Source(position)).await?;
                }
                Some(ToTask::NotifyComplete { id }) => source.checkpoint_complete(id).await?,
                Some(ToTask::Abort { .. }) => {}
                None => break,
            },
            batch = source.next_batch(), if !ended => match batch? {
                Some(batch) => {
                    records += batch.len() as u64;
                    io.metrics.records_out.increment(batch.len() as u64);
                    io.emit(batch).await?;
                }
                None => {
                    ended = true;
                    io.broadcast(|| Message::EndOfData).await?;
                    tracing::debug!(task = %io.label(), records, "source reached the end of its input");
                    io.coordinator.send(FromTask::EndOfInput { task: io.id }).await.map_err(|_| TaskError::Gone)?;
                }
            },
        }
    }
    tracing::debug!(task = %io.label(), records_out = records, "source task done");
    Ok(())
}

/// What a non-source task does with its input.
pub(crate) enum Body {
    /// Transform and forward.
    Operator(Box<dyn Operator>),
    /// Write and commit.
    Sink(Box<dyn ErasedSink>),
}

pub(crate) async fn run_consumer(mut io: TaskIo, mut body: Body) -> Result<(), TaskError> {
    let n = io.inputs.len();
    let mut held = vec![false; n];
    let mut closed = vec![false; n];
    let mut ended = vec![false; n];
    let mut aligning: Option<CheckpointId> = None;
    let mut align_started = tokio::time::Instant::now();
    let mut next = 0usize;
    let mut inputs_done = n == 0;
    let mut watermarks = vec![i64::MIN; n];
    let mut watermark = i64::MIN;
    let mut out = Collector::default();
    let (mut records_in, mut records_out) = (0u64, 0u64);
    loop {
        let inputs = &mut io.inputs;
        let input = poll_fn(|cx| {
            let mut open = false;
            for k in 0..n {
                let i = (next + k) % n;
                if closed[i] || held[i] {
                    open |= !closed[i];
                    continue;
                }
                open = true;
                match inputs[i].poll_recv(cx) {
                    Poll::Ready(Some(msg)) => return Poll::Ready(Some((i, msg))),
                    Poll::Ready(None) => closed[i] = true,
                    Poll::Pending => {}
                }
            }
            if open {
                Poll::Pending
            } else {
                Poll::Ready(None)
            }
        });
        tokio::select! {
            biased;
            msg = io.control.recv() => match msg {
                Some(ToTask::NotifyComplete { id }) => {
                    if let Body::Sink(sink) = &mut body {
                        sink.commit(id).await?;
                    }
                }
                Some(_) => {}
                None => break,
            },
            got = input, if !inputs_done => match got {
                Some((i, Message::Data(batch))) => {
                    next = i + 1;
                    records_in += batch.len() as u64;
                    io.metrics.records_in.increment(batch.len() as u64);
                    match &mut body {
                        Body::Operator(op) => {
                            op.process(batch, &mut out)?;
                            records_out += io.emit_collected(&mut out).await?;
                        }
                        Body::Sink(sink) => sink.write(batch).await?,
                    }
                }
                Some((i, Message::Watermark(w))) => {
                    next = i + 1;
                    watermarks[i] = watermarks[i].max(w);
                    records_out += advance(&mut io, &mut body, &watermarks, &mut watermark, &mut out).await?;
                }
                Some((i, Message::Barrier(id))) => {
                    if let Some(current) = aligning && current != id {
                        return Err(TaskError::Failed(tinyflow_api::StreamError::Graph {
                            message: format!("{} got barrier {id} while aligning {current}", io.label()),
                        }));
                    }
                    if aligning.is_none() {
                        align_started = tokio::time::Instant::now();
                    }
                    aligning = Some(id);
                    held[i] = true;
                    if (0..n).all(|j| held[j] || closed[j]) {
                        let state = match &mut body {
                            Body::Operator(op) => {
                                let state = NodeState::Operator(op.snapshot()?);
                                io.broadcast(|| Message::Barrier(id)).await?;
                                state
                            }
                            Body::Sink(sink) => NodeState::Sink(sink.prepare_commit(id).await?),
                        };
                        io.ack(id, state).await?;
                        held.fill(false);
                        aligning = None;
                        let took = align_started.elapsed();
                        io.metrics.alignment.record(took.as_secs_f64());
                        tracing::debug!(task = %io.label(), checkpoint = %id, alignment_us = took.as_micros() as u64, records_in, records_out, "checkpoint acked");
                    }
                }
                Some((i, Message::EndOfData)) => {
                    ended[i] = true;
                    // An ended input holds no event time back.
                    watermarks[i] = i64::MAX;
                    records_out += advance(&mut io, &mut body, &watermarks, &mut watermark, &mut out).await?;
                    if ended.iter().all(|e| *e)
                        && let Body::Operator(op) = &mut body
                    {
                        op.finish(&mut out)?;
                        records_out += io.emit_collected(&mut out).await?;
                        io.broadcast(|| Message::EndOfData).await?;
                    }
                }
                // Every upstream task is gone: only the coordinator matters now.
                None => inputs_done = true,
            },
        }
    }
    tracing::debug!(task = %io.label(), records_in, records_out, "task done");
    Ok(())
}

/// Hands the operator the combined (minimum) watermark of the inputs when it
/// advanced; returns the records emitted.
async fn advance(
    io: &mut TaskIo,
    body: &mut Body,
    watermarks: &[i64],
    current: &mut i64,
    out: &mut Collector,
) -> Result<u64, TaskError> {
    let combined = watermarks.iter().copied().min().unwrap_or(i64::MAX);
    if combined <= *current {
        return Ok(0);
    }
    *current = combined;
    match body {
        Body::Operator(op) => {
            op.on_watermark(combined, out)?;
            io.emit_collected(out).await
        }
        Body::Sink(_) => Ok(0),
    }
}
