//! The task loops: one tokio task per chain of operator subtasks.
//!
//! Neighbouring nodes joined by a forward edge (same parallelism, one
//! output, one input) are chained into one task, so a batch passes through
//! them without a channel hop; the chain snapshots all its nodes on one
//! barrier and acks once with all their states.
//!
//! Between tasks, data moves in bounded channels of [`Message`]s (record
//! batches, barriers, watermarks, end of data), one channel per upstream
//! subtask, so a full channel backpressures exactly its producer and an input
//! can be held during barrier alignment. Control messages from the
//! coordinator arrive on a separate channel and are served first.
//!
//! - A chain headed by a source: on `TriggerCheckpoint(N)` it snapshots its
//!   position and its chained operators, sends barrier N after everything it
//!   emitted before, and acks. At the end of its input it pushes a final
//!   watermark through the chain, finishes it, sends `EndOfData` and reports
//!   the end; it keeps serving triggers (the final checkpoint) until the
//!   coordinator is done.
//! - A chain fed by inputs: on barrier N from one input it holds that input
//!   until barrier N came on every input (alignment), then snapshots, forwards
//!   barrier N (or, ending in a sink, stages the sink's work under N) and
//!   acks. A sink commits everything up to N on `NotifyComplete(N)`.
//!
//! Every loop ends when its control channel closes (the coordinator finished
//! or the attempt is being torn down).

use std::future::poll_fn;
use std::sync::Arc;
use std::task::Poll;

use tinyflow_api::engine::{
    AnyBatch, Collector, Emitted, ErasedOperator, ErasedSink, ErasedSource, ErasedWriter,
    Partitioning,
};
use tinyflow_api::{CheckpointId, JobPositions, SourceWatermark, TaskId, merge_positions};
use tinyflow_checkpoint::CoordinatorHandle;
use tinyflow_checkpoint::{FromTask, ToTask};
use tokio::sync::mpsc;

use crate::state::{NodeState, TaskSnapshot};

/// What travels between tasks.
#[derive(Debug)]
pub enum Message {
    /// Records.
    Data(AnyBatch),
    /// Checkpoint barrier, with the positions of the sources upstream at
    /// that barrier (merged over the inputs at each alignment).
    Barrier(CheckpointId, Arc<JobPositions>),
    /// Event time up to which the upstream subtask will send no more records.
    Watermark(i64),
    /// The upstream subtask went idle (`true`): combine watermarks without
    /// it until it sends `Idle(false)` or a watermark.
    Idle(bool),
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
    /// With checkpointing on, a task runs until the coordinator is done (the
    /// final checkpoint covers everything in flight); with it off, the
    /// coordinator is done as soon as the sources ended, so a task first
    /// passes on everything still in its inputs.
    pub(crate) checkpointing: bool,
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

    async fn broadcast(&mut self, msg: impl Fn() -> Message) -> Result<(), TaskError> {
        for out in &self.outputs {
            for target in &out.targets {
                send(target, msg(), &self.metrics.backpressure).await?;
            }
        }
        Ok(())
    }

    async fn ack(
        &self,
        id: CheckpointId,
        nodes: Vec<(String, NodeState)>,
    ) -> Result<(), TaskError> {
        let state = TaskSnapshot {
            subtask: self.subtask,
            nodes,
        }
        .encode()?;
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

/// Labels for a node subtask's metrics.
pub(crate) fn labels(node: &str, subtask: usize) -> [(&'static str, String); 2] {
    [
        ("operator", node.to_owned()),
        ("subtask", subtask.to_string()),
    ]
}

/// A task's metrics, through the `metrics` facade (no-ops until the
/// application installs a recorder, e.g. a Prometheus exporter). Labelled
/// with the chain's first node.
#[derive(Clone)]
pub(crate) struct TaskMetrics {
    pub(crate) alignment: metrics::Histogram,
    pub(crate) backpressure: metrics::Counter,
}

impl TaskMetrics {
    pub(crate) fn new(node: &str, subtask: usize) -> Self {
        let labels = labels(node, subtask);
        TaskMetrics {
            alignment: metrics::histogram!("tinyflow_alignment_seconds", &labels),
            backpressure: metrics::counter!("tinyflow_backpressure_microseconds_total", &labels),
        }
    }
}

/// An operator in a chain, with its record counters.
pub(crate) struct ChainOp {
    pub(crate) name: String,
    pub(crate) op: Box<dyn ErasedOperator>,
    pub(crate) records_in: metrics::Counter,
    pub(crate) records_out: metrics::Counter,
}

/// The sink ending a chain.
pub(crate) struct ChainSink {
    pub(crate) name: String,
    pub(crate) sink: Box<dyn ErasedSink>,
    pub(crate) records_in: metrics::Counter,
}

/// The writer ending a chain: its committables go downstream.
pub(crate) struct ChainWriter {
    pub(crate) writer: Box<dyn ErasedWriter>,
    pub(crate) records_in: metrics::Counter,
    pub(crate) records_out: metrics::Counter,
}

/// The operators of a task, in order, and the sink or writer that may end
/// them (never both).
pub(crate) struct Chain {
    pub(crate) ops: Vec<ChainOp>,
    pub(crate) sink: Option<ChainSink>,
    pub(crate) writer: Option<ChainWriter>,
    /// Buffers reused for every batch, so that passing a batch through the
    /// operators allocates nothing of the chain's own.
    pub(crate) scratch: Scratch,
}

/// The chain's reusable buffers: what enters an operator, what leaves it.
#[derive(Default)]
pub(crate) struct Scratch {
    items: Vec<Emitted>,
    next: Vec<Emitted>,
    collector: Collector,
}

impl Chain {
    /// Runs `items` through the operators from `from` on; leaves what comes
    /// out of the last one in `items`.
    fn run_ops(&mut self, from: usize, items: &mut Vec<Emitted>) -> Result<(), TaskError> {
        let mut next = std::mem::take(&mut self.scratch.next);
        let collector = &mut self.scratch.collector;
        for op in &mut self.ops[from..] {
            if items.is_empty() {
                break;
            }
            next.clear();
            for item in items.drain(..) {
                match item {
                    Emitted::Batch(b) => {
                        op.records_in.increment(b.rows() as u64);
                        op.op.process(b, collector)?;
                    }
                    Emitted::Watermark(w) => op.op.on_watermark(w, collector)?,
                }
                for e in collector.drain() {
                    if let Emitted::Batch(b) = &e {
                        op.records_out.increment(b.rows() as u64);
                    }
                    next.push(e);
                }
            }
            std::mem::swap(items, &mut next);
        }
        self.scratch.next = next;
        Ok(())
    }

    /// Hands what left the operators to the sink, or downstream.
    async fn deliver(&mut self, io: &mut TaskIo, item: Emitted) -> Result<(), TaskError> {
        match (item, &mut self.sink, &mut self.writer) {
            (Emitted::Batch(b), Some(s), _) => {
                s.records_in.increment(b.rows() as u64);
                s.sink.write(b).await?;
            }
            (Emitted::Watermark(w), Some(s), _) => s.sink.on_watermark(w),
            (Emitted::Batch(b), None, Some(w)) => {
                w.records_in.increment(b.rows() as u64);
                w.writer.write(b).await?;
            }
            (Emitted::Batch(b), None, None) => io.emit(b).await?,
            (Emitted::Watermark(w), None, _) => io.broadcast(|| Message::Watermark(w)).await?,
        }
        Ok(())
    }

    /// Runs `items` through the operators from `from` on and delivers what
    /// comes out, reusing the chain's buffers.
    async fn run_and_deliver(
        &mut self,
        io: &mut TaskIo,
        from: usize,
        items: &mut Vec<Emitted>,
    ) -> Result<(), TaskError> {
        self.run_ops(from, items)?;
        for item in items.drain(..) {
            self.deliver(io, item).await?;
        }
        Ok(())
    }

    async fn push(&mut self, io: &mut TaskIo, item: Emitted) -> Result<(), TaskError> {
        if self.ops.is_empty() {
            return self.deliver(io, item).await;
        }
        let mut items = std::mem::take(&mut self.scratch.items);
        items.push(item);
        self.run_and_deliver(io, 0, &mut items).await?;
        self.scratch.items = items;
        Ok(())
    }

    /// Every input ended: finish each operator in order, passing what it
    /// emits through the rest; then tell downstream.
    async fn finish(&mut self, io: &mut TaskIo) -> Result<(), TaskError> {
        for i in 0..self.ops.len() {
            let mut collector = Collector::default();
            self.ops[i].op.finish(&mut collector)?;
            let mut items: Vec<Emitted> = collector.drain().collect();
            for e in &items {
                if let Emitted::Batch(b) = e {
                    self.ops[i].records_out.increment(b.rows() as u64);
                }
            }
            self.run_and_deliver(io, i + 1, &mut items).await?;
        }
        if self.sink.is_none() {
            io.broadcast(|| Message::EndOfData).await?;
        }
        Ok(())
    }

    /// Barrier `id` reached the chain: snapshot every node, forward the
    /// barrier (or stage the sink's work), and ack with all states.
    async fn checkpoint(
        &mut self,
        io: &mut TaskIo,
        id: CheckpointId,
        positions: Arc<JobPositions>,
        mut states: Vec<(String, NodeState)>,
    ) -> Result<(), TaskError> {
        for op in &mut self.ops {
            states.push((op.name.clone(), NodeState::Operator(op.op.snapshot()?)));
        }
        if let Some(w) = &mut self.writer {
            // The committables go before the barrier: the committer stages
            // them under `id`.
            let committables = w.writer.flush(id).await?;
            w.records_out.increment(committables.rows() as u64);
            if !committables.is_empty() {
                io.emit(committables).await?;
            }
        }
        match &mut self.sink {
            Some(s) => {
                s.sink.on_positions(id, &positions);
                states.push((
                    s.name.clone(),
                    NodeState::Sink(s.sink.prepare_commit(id).await?),
                ));
            }
            None => {
                io.broadcast(|| Message::Barrier(id, Arc::clone(&positions)))
                    .await?
            }
        }
        io.ack(id, states).await
    }

    async fn commit(&mut self, id: CheckpointId) -> Result<(), TaskError> {
        if let Some(s) = &mut self.sink {
            s.sink.commit(id).await?;
        }
        Ok(())
    }

    /// The coordinator is done with this task (its control channel closed
    /// after the last notify): a sink commits what it held back.
    async fn job_finished(&mut self) -> Result<(), TaskError> {
        if let Some(s) = &mut self.sink {
            s.sink.job_finished().await?;
        }
        Ok(())
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

/// The source heading a chain.
pub(crate) struct ChainSource {
    pub(crate) name: String,
    pub(crate) source: Box<dyn ErasedSource>,
    pub(crate) records_out: metrics::Counter,
}

pub(crate) async fn run_source(
    mut io: TaskIo,
    mut head: ChainSource,
    mut chain: Chain,
) -> Result<(), TaskError> {
    let mut ended = false;
    let mut records = 0u64;
    let mut progress = SourceProgress::default();
    loop {
        tokio::select! {
            biased;
            msg = io.control.recv() => match msg {
                Some(ToTask::TriggerCheckpoint { id, .. }) => {
                    let position = head.source.snapshot(id)?;
                    let mut positions = JobPositions::new();
                    let shown = head.source.positions();
                    if !shown.is_empty() {
                        positions.insert(head.name.clone(), shown);
                    }
                    let states = vec![(head.name.clone(), NodeState::Source(position))];
                    chain.checkpoint(&mut io, id, Arc::new(positions), states).await?;
                }
                Some(ToTask::NotifyComplete { id }) => {
                    head.source.checkpoint_complete(id).await?;
                    chain.commit(id).await?;
                }
                Some(ToTask::Abort { .. }) => {}
                None => break,
            },
            batch = head.source.next_batch(), if !ended => match batch? {
                Some(batch) => {
                    records += batch.rows() as u64;
                    head.records_out.increment(batch.rows() as u64);
                    if !batch.is_empty() {
                        chain.push(&mut io, Emitted::Batch(batch)).await?;
                    }
                    progress.report(&mut io, &mut chain, head.source.watermark()).await?;
                    // A source that always has data, chained to a sink that
                    // never waits, would otherwise never yield: the driver
                    // (and its checkpoint timer) would starve on a
                    // current-thread runtime, or on a busy worker.
                    tokio::task::consume_budget().await;
                }
                None => {
                    ended = true;
                    chain.push(&mut io, Emitted::Watermark(i64::MAX)).await?;
                    chain.finish(&mut io).await?;
                    tracing::debug!(task = %io.label(), records, "source reached the end of its input");
                    io.coordinator.send(FromTask::EndOfInput { task: io.id }).await.map_err(|_| TaskError::Gone)?;
                }
            },
        }
    }
    chain.job_finished().await?;
    tracing::debug!(task = %io.label(), records_out = records, "source task done");
    Ok(())
}

/// What a source task last told downstream about event time.
#[derive(Default)]
struct SourceProgress {
    emitted: Option<i64>,
    idle: bool,
}

impl SourceProgress {
    /// Passes the source's event-time progress on when it changed.
    async fn report(
        &mut self,
        io: &mut TaskIo,
        chain: &mut Chain,
        now: SourceWatermark,
    ) -> Result<(), TaskError> {
        match now {
            SourceWatermark::None => Ok(()),
            SourceWatermark::Idle => {
                if !self.idle {
                    self.idle = true;
                    io.broadcast(|| Message::Idle(true)).await?;
                }
                Ok(())
            }
            SourceWatermark::At(w) => {
                if self.idle {
                    self.idle = false;
                    io.broadcast(|| Message::Idle(false)).await?;
                }
                if self.emitted.is_none_or(|e| w > e) {
                    self.emitted = Some(w);
                    chain.push(io, Emitted::Watermark(w)).await?;
                }
                Ok(())
            }
        }
    }
}

pub(crate) async fn run_consumer(mut io: TaskIo, mut chain: Chain) -> Result<(), TaskError> {
    let n = io.inputs.len();
    let mut held = vec![false; n];
    let mut closed = vec![false; n];
    let mut ended = vec![false; n];
    let mut aligning: Option<CheckpointId> = None;
    // The positions that came with the barriers of the checkpoint aligning.
    let mut positions = JobPositions::new();
    let mut align_started = tokio::time::Instant::now();
    let mut next = 0usize;
    let mut inputs_done = n == 0;
    let mut control_open = true;
    let mut finished = false;
    let mut time = InputTime::new(n);
    let mut records_in = 0u64;
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
            msg = io.control.recv(), if control_open => match msg {
                Some(ToTask::NotifyComplete { id }) => chain.commit(id).await?,
                Some(_) => {}
                None if io.checkpointing || inputs_done || finished => break,
                // Checkpointing off: the coordinator may finish before the
                // data does; drain the inputs first.
                None => control_open = false,
            },
            got = input, if !inputs_done => match got {
                Some((i, Message::Data(batch))) => {
                    next = i + 1;
                    records_in += batch.rows() as u64;
                    chain.push(&mut io, Emitted::Batch(batch)).await?;
                }
                Some((i, Message::Watermark(w))) => {
                    next = i + 1;
                    time.watermark(i, w, &mut io, &mut chain).await?;
                }
                Some((i, Message::Idle(now))) => {
                    next = i + 1;
                    time.idle(i, now, &mut io, &mut chain).await?;
                }
                Some((i, Message::Barrier(id, upstream))) => {
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
                    merge_positions(&mut positions, Arc::unwrap_or_clone(upstream));
                    if (0..n).all(|j| held[j] || closed[j]) {
                        let merged = Arc::new(std::mem::take(&mut positions));
                        chain.checkpoint(&mut io, id, merged, Vec::new()).await?;
                        held.fill(false);
                        aligning = None;
                        let took = align_started.elapsed();
                        io.metrics.alignment.record(took.as_secs_f64());
                        tracing::debug!(task = %io.label(), checkpoint = %id, alignment_us = took.as_micros() as u64, records_in, "checkpoint acked");
                    }
                }
                Some((i, Message::EndOfData)) => {
                    ended[i] = true;
                    // An ended input holds no event time back.
                    time.watermark(i, i64::MAX, &mut io, &mut chain).await?;
                    if ended.iter().all(|e| *e) {
                        chain.finish(&mut io).await?;
                        finished = true;
                        // Checkpointing off and the coordinator already done:
                        // everything is passed on, nothing else will come.
                        if !control_open {
                            break;
                        }
                    }
                }
                // Every upstream task is gone: only the coordinator matters now.
                None if control_open => inputs_done = true,
                None => break,
            },
        }
    }
    chain.job_finished().await?;
    tracing::debug!(task = %io.label(), records_in, "task done");
    Ok(())
}

/// The event time of a task's inputs.
struct InputTime {
    /// The latest watermark of each input (`i64::MAX` once it ended).
    watermarks: Vec<i64>,
    /// Whether each input said it is idle.
    idle: Vec<bool>,
    /// The watermark passed on so far.
    current: i64,
    /// Whether this task told its outputs it is idle.
    idle_out: bool,
}

impl InputTime {
    fn new(n: usize) -> Self {
        InputTime {
            watermarks: vec![i64::MIN; n],
            idle: vec![false; n],
            current: i64::MIN,
            idle_out: false,
        }
    }

    /// Input `i` reached `watermark` (and is not idle).
    async fn watermark(
        &mut self,
        i: usize,
        watermark: i64,
        io: &mut TaskIo,
        chain: &mut Chain,
    ) -> Result<(), TaskError> {
        self.watermarks[i] = self.watermarks[i].max(watermark);
        self.idle[i] = false;
        self.advance(io, chain).await
    }

    /// Input `i` went idle or came back.
    async fn idle(
        &mut self,
        i: usize,
        idle: bool,
        io: &mut TaskIo,
        chain: &mut Chain,
    ) -> Result<(), TaskError> {
        self.idle[i] = idle;
        self.advance(io, chain).await
    }

    /// Passes on the combined watermark when it advanced: the minimum over
    /// the inputs that are not idle. When every input still sending is
    /// idle, the task tells its outputs it is idle too, and that it is
    /// back when one of them is.
    async fn advance(&mut self, io: &mut TaskIo, chain: &mut Chain) -> Result<(), TaskError> {
        let active = || {
            self.watermarks
                .iter()
                .zip(&self.idle)
                .filter(|(w, idle)| !**idle || **w == i64::MAX)
                .map(|(w, _)| *w)
        };
        let all_idle = active().all(|w| w == i64::MAX) && self.idle.iter().any(|i| *i);
        if all_idle != self.idle_out {
            self.idle_out = all_idle;
            io.broadcast(|| Message::Idle(all_idle)).await?;
        }
        if all_idle {
            return Ok(());
        }
        let combined = active().min().unwrap_or(i64::MAX);
        if combined <= self.current {
            return Ok(());
        }
        self.current = combined;
        chain.push(io, Emitted::Watermark(combined)).await
    }
}
