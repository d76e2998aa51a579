//! Running a job: attempts, restore, failover.
//!
//! One attempt wires the graph into tasks and channels, restores every task
//! from the newest completed checkpoint, and runs the checkpoint
//! coordinator's driver beside the tasks. The first task error, panic or
//! coordinator failure ends the attempt: every task is cancelled and joined,
//! and the restart strategy decides whether and when the next attempt
//! starts. A finished coordinator (final checkpoint durable and notified)
//! ends the attempt successfully once every task has wound down. A
//! [`StopHandle`] finishes the job the same way on request: a final
//! checkpoint at once, committed by the sinks, then the end.

use std::collections::HashMap;
use std::sync::Arc;

use tinyflow_api::engine::{NodeId, NodeKind, Partitioning};
use tinyflow_api::{
    CheckpointId, JobGraph, OperatorContext, SinkRestore, StreamError, TaskId, error_chain,
};
use tinyflow_checkpoint::{
    BoxFuture, CheckpointStore, FromTask, SystemWallClock, TaskRole, WallClock,
};
use tinyflow_checkpoint::{
    CheckpointConfig, CoordinatorDriver, CoordinatorHandle, DriverConfig, Outcome,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;

use crate::state::RestorePlan;
use crate::task::{
    Chain, ChainOp, ChainSink, ChainSource, ChainWriter, Message, Output, Scratch, TaskError,
    TaskIo, TaskMetrics, labels as task_labels, run_consumer, run_source,
};
use crate::{Error, RestartStrategy, Result};

/// How a job runs.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Checkpointing.
    pub checkpoint: CheckpointConfig,
    /// What to do when an attempt fails.
    pub restart: RestartStrategy,
    /// Batches buffered per data channel (one channel per pair of connected
    /// subtasks): the backpressure bound.
    pub channel_capacity: usize,
    /// Runs neighbouring nodes joined by a forward edge in one task.
    pub chaining: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            checkpoint: CheckpointConfig::default(),
            restart: RestartStrategy::default(),
            channel_capacity: 8,
            chaining: true,
        }
    }
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobReport {
    /// Attempts it took (1 without failures).
    pub attempts: u32,
    /// The final checkpoint, when checkpointing is on.
    pub final_checkpoint: Option<CheckpointId>,
}

/// Asks a running job to stop with a final checkpoint (Flink's "stop with
/// savepoint"): the checkpoint is taken at once, the sinks commit it, and
/// [`JobRunner::run`] returns with it as the final checkpoint. The next run
/// restores it, so nothing is lost or written twice, and the table holds
/// everything read up to the stop. Clones stop the same job.
#[derive(Debug, Clone)]
pub struct StopHandle {
    requested: Arc<watch::Sender<bool>>,
}

impl Default for StopHandle {
    fn default() -> Self {
        StopHandle {
            requested: Arc::new(watch::Sender::new(false)),
        }
    }
}

impl StopHandle {
    /// A handle no one has used yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests the stop; later calls change nothing.
    pub fn stop(&self) {
        self.requested.send_replace(true);
    }

    /// Whether a stop was requested.
    pub fn is_requested(&self) -> bool {
        *self.requested.borrow()
    }

    /// Completes once a stop is requested.
    async fn requested(&self) {
        let mut rx = self.requested.subscribe();
        // The sender lives in `self`, so the wait ends only by a request.
        let _ = rx.wait_for(|stop| *stop).await;
    }
}

/// Runs a [`JobGraph`] to completion with failover.
pub struct JobRunner {
    graph: JobGraph,
    store: Arc<dyn CheckpointStore>,
    clock: Arc<dyn WallClock>,
    config: RuntimeConfig,
    stop: StopHandle,
    /// An attempt that ran this long before it failed gives the restart
    /// strategy its whole budget back.
    budget_reset: Option<std::time::Duration>,
}

/// How long an attempt runs before its failure no longer counts against
/// the restart budget, by default: the restart strategy's `max_attempts`
/// bounds failures in a row, not over a job's whole life (like Flink's
/// failure-rate strategy).
pub const DEFAULT_BUDGET_RESET: std::time::Duration = std::time::Duration::from_secs(600);

impl std::fmt::Debug for JobRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobRunner")
            .field("graph", &self.graph)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl JobRunner {
    /// A runner for `graph`, checkpointing into `store`.
    pub fn new(graph: JobGraph, store: Arc<dyn CheckpointStore>, config: RuntimeConfig) -> Self {
        JobRunner {
            graph,
            store,
            clock: Arc::new(SystemWallClock),
            config,
            stop: StopHandle::new(),
            budget_reset: Some(DEFAULT_BUDGET_RESET),
        }
    }

    /// Gives the restart strategy its whole budget back (its attempt count
    /// and backoff) after an attempt that ran `after` before it failed;
    /// `None` counts every failure of the job's life. Default
    /// [`DEFAULT_BUDGET_RESET`].
    pub fn with_restart_budget_reset(mut self, after: Option<std::time::Duration>) -> Self {
        self.budget_reset = after;
        self
    }

    /// Stops the job when `stop` is used (see [`StopHandle`]).
    pub fn with_stop(mut self, stop: StopHandle) -> Self {
        self.stop = stop;
        self
    }

    /// Uses `clock` for checkpoint metadata timestamps.
    pub fn with_clock(mut self, clock: Arc<dyn WallClock>) -> Self {
        self.clock = clock;
        self
    }

    /// Runs attempts until the job finishes, or fails past its restart
    /// strategy (the error then carries the last attempt's root cause).
    pub async fn run(&self) -> Result<JobReport> {
        let mut attempt = 0;
        // Restarts counted against the strategy's budget.
        let mut restarts = 0;
        loop {
            attempt += 1;
            tracing::info!(job = %self.graph.job_id, attempt, "starting job attempt");
            let started = tokio::time::Instant::now();
            let cause = match self.attempt().await {
                Ok(final_checkpoint) => {
                    tracing::info!(job = %self.graph.job_id, attempt, ?final_checkpoint, "job finished");
                    return Ok(JobReport {
                        attempts: attempt,
                        final_checkpoint,
                    });
                }
                Err(cause) => cause,
            };
            if let Some(after) = self.budget_reset
                && restarts > 0
                && started.elapsed() >= after
            {
                tracing::info!(job = %self.graph.job_id, attempt, ran_secs = started.elapsed().as_secs(), "the attempt ran long enough before it failed: the restart budget starts afresh");
                restarts = 0;
            }
            restarts += 1;
            let delay = if cause.is_retryable() {
                self.config.restart.delay_before(restarts)
            } else {
                None
            };
            let Some(delay) = delay else {
                tracing::error!(job = %self.graph.job_id, attempt, error = %error_chain(&cause), "job failed");
                return Err(Error::JobFailed {
                    attempts: attempt,
                    cause: Box::new(cause),
                });
            };
            tracing::warn!(
                job = %self.graph.job_id,
                attempt,
                error = %error_chain(&cause),
                delay_ms = delay.as_millis() as u64,
                "job attempt failed, restarting from the newest completed checkpoint"
            );
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.stop.requested() => {
                    tracing::warn!(job = %self.graph.job_id, attempt, "stop requested while waiting to restart: the job ends failed, its data safe in its checkpoints");
                    return Err(Error::JobFailed {
                        attempts: attempt,
                        cause: Box::new(cause),
                    });
                }
            }
        }
    }

    async fn attempt(&self) -> Result<Option<CheckpointId>> {
        let g = &self.graph;
        let total: usize = g.nodes.iter().map(|n| n.parallelism).sum();
        let mut dc = DriverConfig::new(g.job_id.clone(), self.config.checkpoint.clone());
        dc.has_transactional_sink = g
            .nodes
            .iter()
            .any(|n| matches!(&n.kind, NodeKind::Sink(f) if f.is_transactional()));
        // Registrations are queued before the driver runs.
        dc.inbound_capacity = dc.inbound_capacity.max(total + 16);
        // Ids continue above whatever a sink committed already (a wiped
        // checkpoint store must not make new data look committed).
        for node in &g.nodes {
            if let NodeKind::Sink(f) = &node.kind
                && let Some(id) = f.last_committed().await?
            {
                tracing::info!(job = %g.job_id, sink = %node.name, committed = %id, "sink reports its last committed checkpoint");
                dc.sinks_committed = Some(dc.sinks_committed.map_or(id, |c| c.max(id)));
            }
        }
        // Setting tasks up can take a while (a Kafka source fetches
        // metadata): no checkpoint until every task is registered.
        dc.wait_for_start = true;
        let (driver, handle, restored) =
            CoordinatorDriver::start(dc, Arc::clone(&self.store), Arc::clone(&self.clock)).await?;
        let plan = RestorePlan::new(restored.checkpoint.as_ref())?;
        if let Some(id) = plan.checkpoint {
            tracing::info!(job = %g.job_id, checkpoint = %id, "restoring");
        }

        let own_thread = OwnThread::start(&g.job_id);
        let chains = self.chains();
        let (mut inputs, mut outputs) = self.wire(&chains);
        let mut tasks = JoinSet::new();
        let mut labels = HashMap::new();
        let mut next_id = 0u32;
        for chain in &chains {
            let (head, tail) = (&g.nodes[chain[0]], &g.nodes[chain[chain.len() - 1]]);
            for s in 0..head.parallelism {
                let id = TaskId::new(next_id);
                next_id += 1;
                let (control_tx, control) = mpsc::channel(16);
                let role = match (&head.kind, &tail.kind) {
                    (NodeKind::Source(_), _) => TaskRole::Source,
                    (_, NodeKind::Sink(f)) if f.is_transactional() => TaskRole::Committer,
                    _ => TaskRole::Operator,
                };
                handle
                    .register(id, role, control_tx)
                    .await
                    .map_err(|_| StreamError::Graph {
                        message: "coordinator gone during setup".into(),
                    })?;
                let chain_name: Vec<&str> =
                    chain.iter().map(|n| g.nodes[*n].name.as_str()).collect();
                let io = TaskIo {
                    id,
                    node: chain_name.join("->"),
                    subtask: u32::try_from(s).expect("parallelism fits u32"),
                    control,
                    coordinator: handle.clone(),
                    inputs: std::mem::take(&mut inputs[chain[0]][s]),
                    outputs: std::mem::take(&mut outputs[chain[chain.len() - 1]][s]),
                    metrics: TaskMetrics::new(&head.name, s),
                    checkpointing: self.config.checkpoint.interval.is_some(),
                };
                let label = io.label();
                let (source, body) = self.build_chain(chain, s, &plan).await?;
                let task = supervise(label.clone(), id, handle.clone(), async move {
                    match source {
                        Some(source) => run_source(io, source, body).await,
                        None => run_consumer(io, body).await,
                    }
                });
                let spawned = match &own_thread {
                    Some(t) if role == TaskRole::Committer && self.commits_files(chain) => {
                        tasks.spawn_on(task, &t.handle)
                    }
                    _ => tasks.spawn(task),
                };
                labels.insert(spawned.id(), label);
            }
        }
        handle.start().await.map_err(|_| StreamError::Graph {
            message: "coordinator gone during setup".into(),
        })?;
        drop(handle);

        let stop = self.stop.clone();
        let (run, shutdown) = drive(own_thread.as_ref(), driver, async move {
            stop.requested().await
        });
        tokio::pin!(run);
        let (ended, driver_ended) = loop {
            tokio::select! {
                biased;
                Some(joined) = tasks.join_next_with_id() => match joined {
                    Ok((_, Ok(()))) => {}
                    Ok((_, Err(e))) => break (Err(e), false),
                    Err(j) => break (Err(panic_error(&labels, j)), false),
                },
                outcome = &mut run => break (outcome, true),
            }
        };
        if !driver_ended {
            // A task ended the attempt: the driver ends before the next
            // attempt starts its own.
            drop(shutdown);
            let _ = run.await;
        }
        match ended {
            Ok(Outcome::Finished { final_checkpoint }) => {
                // The driver is gone, so every control channel closed: tasks
                // finish what they hold (the sinks' last commit) and end.
                while let Some(joined) = tasks.join_next_with_id().await {
                    match joined {
                        Ok((_, Ok(()))) => {}
                        Ok((_, Err(e))) => return Err(e),
                        Err(j) => return Err(panic_error(&labels, j)),
                    }
                }
                Ok(final_checkpoint)
            }
            Ok(Outcome::Shutdown) => Err(StreamError::Graph {
                message: "coordinator shut down".into(),
            }
            .into()),
            Err(mut cause) => {
                tasks.abort_all();
                while let Some(joined) = tasks.join_next_with_id().await {
                    // A task's own error explains a lost task better than the
                    // coordinator's view of it.
                    let task_cause = match joined {
                        Ok((_, Err(e))) => Some(e),
                        Err(j) if j.is_panic() => Some(panic_error(&labels, j)),
                        _ => None,
                    };
                    if let Some(e) = task_cause
                        && matches!(
                            cause,
                            Error::Checkpoint(tinyflow_checkpoint::Error::TaskLost { .. })
                        )
                    {
                        cause = e;
                    }
                }
                Err(cause)
            }
        }
    }

    /// Groups nodes into chains, head first: a forward edge from a node with
    /// one output to a node with one input joins them (sources only head a
    /// chain, sinks and writers only end one). With chaining off, every node is a chain.
    /// Whether `chain` is a sink alone whose every input is a parallel
    /// writer: a committer of what the writers wrote, which handles small
    /// committables (file metadata), never the records themselves, and can
    /// share the coordinator's thread.
    fn commits_files(&self, chain: &[NodeId]) -> bool {
        let g = &self.graph;
        let [sink] = chain else {
            return false;
        };
        let mut inputs = g.edges.iter().filter(|e| e.to == *sink).peekable();
        inputs.peek().is_some()
            && inputs.all(|e| matches!(g.nodes[e.from].kind, NodeKind::Writer(_)))
    }

    fn chains(&self) -> Vec<Vec<NodeId>> {
        let g = &self.graph;
        let n = g.nodes.len();
        let (mut outs, mut ins) = (vec![0usize; n], vec![0usize; n]);
        for e in &g.edges {
            outs[e.from] += 1;
            ins[e.to] += 1;
        }
        let mut next = vec![None; n];
        let mut joined = vec![false; n];
        for e in g.edges.iter().filter(|_| self.config.chaining) {
            let chainable = matches!(e.partitioning, Partitioning::Forward)
                && outs[e.from] == 1
                && ins[e.to] == 1
                && !matches!(
                    g.nodes[e.from].kind,
                    NodeKind::Sink(_) | NodeKind::Writer(_)
                )
                && !matches!(g.nodes[e.to].kind, NodeKind::Source(_));
            if chainable {
                next[e.from] = Some(e.to);
                joined[e.to] = true;
            }
        }
        (0..n)
            .filter(|i| !joined[*i])
            .map(|head| {
                let mut chain = vec![head];
                while let Some(to) = chain.last().and_then(|last| next[*last]) {
                    chain.push(to);
                }
                chain
            })
            .collect()
    }

    /// Creates subtask `s` of every node of `chain`, restored from `plan`.
    async fn build_chain(
        &self,
        chain: &[NodeId],
        s: usize,
        plan: &RestorePlan,
    ) -> Result<(Option<ChainSource>, Chain)> {
        let g = &self.graph;
        let mut source = None;
        let mut body = Chain {
            ops: Vec::new(),
            sink: None,
            writer: None,
            scratch: Scratch::default(),
        };
        for &ni in chain {
            let node = &g.nodes[ni];
            let ctx = OperatorContext {
                name: node.name.clone(),
                subtask: s,
                parallelism: node.parallelism,
                max_parallelism: g.max_parallelism,
            };
            let labels = task_labels(&node.name, s);
            match &node.kind {
                NodeKind::Source(f) => {
                    source = Some(ChainSource {
                        name: node.name.clone(),
                        source: f.create(&ctx, &plan.source(&node.name))?,
                        records_out: metrics::counter!("tinyflow_records_out_total", &labels),
                    });
                }
                NodeKind::Operator(f) => {
                    let mut op = f.create(&ctx)?;
                    if plan.checkpoint.is_some() {
                        op.restore(plan.operator(
                            &node.name,
                            s,
                            node.parallelism,
                            g.max_parallelism,
                        ))?;
                    }
                    body.ops.push(ChainOp {
                        name: node.name.clone(),
                        op,
                        records_in: metrics::counter!("tinyflow_records_in_total", &labels),
                        records_out: metrics::counter!("tinyflow_records_out_total", &labels),
                    });
                }
                NodeKind::Writer(f) => {
                    body.writer = Some(ChainWriter {
                        writer: f.create(&ctx).await?,
                        records_in: metrics::counter!("tinyflow_records_in_total", &labels),
                        records_out: metrics::counter!("tinyflow_records_out_total", &labels),
                    });
                }
                NodeKind::Sink(f) => {
                    let states = plan.sink(&node.name);
                    let restore = plan.checkpoint.map(|checkpoint| SinkRestore {
                        checkpoint,
                        states: &states,
                    });
                    body.sink = Some(ChainSink {
                        name: node.name.clone(),
                        sink: f.create(&ctx, restore).await?,
                        records_in: metrics::counter!("tinyflow_records_in_total", &labels),
                    });
                }
            }
        }
        Ok((source, body))
    }

    /// Creates the data channels: per node and subtask, its inputs and its
    /// outputs.
    #[allow(
        clippy::type_complexity,
        reason = "local plumbing, named by the return binding"
    )]
    fn wire(
        &self,
        chains: &[Vec<NodeId>],
    ) -> (
        Vec<Vec<Vec<mpsc::Receiver<Message>>>>,
        Vec<Vec<Vec<Output>>>,
    ) {
        let g = &self.graph;
        let mut inputs: Vec<Vec<Vec<mpsc::Receiver<Message>>>> = g
            .nodes
            .iter()
            .map(|n| (0..n.parallelism).map(|_| Vec::new()).collect())
            .collect();
        let mut outputs: Vec<Vec<Vec<Output>>> = g
            .nodes
            .iter()
            .map(|n| (0..n.parallelism).map(|_| Vec::new()).collect())
            .collect();
        let cap = self.config.channel_capacity.max(1);
        let inside = |e: &tinyflow_api::engine::Edge| {
            chains
                .iter()
                .any(|c| c.windows(2).any(|w| w == [e.from, e.to]))
        };
        for e in g.edges.iter().filter(|e| !inside(e)) {
            let (pf, pt) = (g.nodes[e.from].parallelism, g.nodes[e.to].parallelism);
            for (i, from) in outputs[e.from].iter_mut().enumerate().take(pf) {
                let targets: Vec<usize> = match e.partitioning {
                    Partitioning::Forward => vec![i],
                    _ => (0..pt).collect(),
                };
                let mut senders = Vec::with_capacity(targets.len());
                for j in targets {
                    let (tx, rx) = mpsc::channel(cap);
                    inputs[e.to][j].push(rx);
                    senders.push(tx);
                }
                from.push(Output {
                    targets: senders,
                    partitioning: e.partitioning.clone(),
                    max_parallelism: g.max_parallelism,
                    next: i,
                });
            }
        }
        (inputs, outputs)
    }
}

async fn supervise(
    label: String,
    id: TaskId,
    coordinator: CoordinatorHandle,
    task: impl std::future::Future<Output = Result<(), TaskError>>,
) -> Result<()> {
    match task.await {
        Ok(()) | Err(TaskError::Gone) => Ok(()),
        Err(TaskError::Failed(source)) => {
            let message = error_chain(&source);
            tracing::warn!(task = %label, error = %message, "task failed");
            // Best effort: the coordinator may be gone already.
            let _ = coordinator
                .send(FromTask::Failed { task: id, message })
                .await;
            Err(Error::Task {
                task: label,
                source,
            })
        }
    }
}

fn panic_error(labels: &HashMap<tokio::task::Id, String>, j: tokio::task::JoinError) -> Error {
    let task = labels
        .get(&j.id())
        .cloned()
        .unwrap_or_else(|| "<unknown>".into());
    Error::Panic {
        task,
        message: join_message(j),
    }
}

/// What ended a task that did not return: its panic's message, or
/// "cancelled".
fn join_message(j: tokio::task::JoinError) -> String {
    if !j.is_panic() {
        return "cancelled".into();
    }
    let payload = j.into_panic();
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// A thread of an attempt's own, driving a current-thread runtime until the
/// attempt drops it: the checkpoint coordinator's driver runs there, and
/// so do the committers behind parallel writers.
///
/// The job's workers are busy with tasks that may poll for milliseconds at
/// a time (decoding, encoding Parquet). A driver queued behind them would
/// trigger late and complete checkpoints late, and a committer queued
/// behind them would start its commit late (the pipeline bench's latency
/// figures in `docs/performance.md`, "Defaults chosen by measurement", show
/// by how much). Both do little work, at the moments the latency from
/// append to visible depends on.
struct OwnThread {
    handle: tokio::runtime::Handle,
    /// Dropping it ends the thread, and with its runtime whatever still
    /// runs there: the attempt drops it only after its tasks have ended.
    _keep: oneshot::Sender<()>,
}

impl OwnThread {
    /// The thread, on a multi-thread runtime; `None` on a current-thread one
    /// (tests, paused clocks: everything runs in place, on that runtime's
    /// clock) or when no thread can be started (logged).
    fn start(job: &tinyflow_api::JobId) -> Option<OwnThread> {
        let flavor = tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor());
        if matches!(flavor, Ok(tokio::runtime::RuntimeFlavor::CurrentThread)) {
            return None;
        }
        let started = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .and_then(|rt| {
                let handle = rt.handle().clone();
                let (keep, kept) = oneshot::channel::<()>();
                std::thread::Builder::new()
                    .name("tinyflow-coordinator".into())
                    .spawn(move || {
                        rt.block_on(async move {
                            let _ = kept.await;
                        });
                    })?;
                Ok(OwnThread {
                    handle,
                    _keep: keep,
                })
            });
        match started {
            Ok(thread) => Some(thread),
            Err(e) => {
                tracing::warn!(job = %job, error = %e, "no thread for the checkpoint coordinator; it runs on the job's runtime");
                None
            }
        }
    }
}

/// Runs the coordinator's driver until it ends or `shutdown` is dropped: on
/// `thread` when there is one (see [`OwnThread`]), else in place. Dropping
/// the returned future drops the driver, as dropping it in place would; a
/// panic in it fails the attempt, as a task's panic does.
fn drive(
    thread: Option<&OwnThread>,
    driver: CoordinatorDriver,
    stop: impl Future<Output = ()> + Send + 'static,
) -> (BoxFuture<Result<Outcome>>, oneshot::Sender<()>) {
    let (shutdown, dropped) = oneshot::channel::<()>();
    let run = driver.run_until_stopped(
        async move {
            let _ = dropped.await;
        },
        stop,
    );
    let Some(thread) = thread else {
        return (Box::pin(async move { Ok(run.await?) }), shutdown);
    };
    let task = thread.handle.spawn(run);
    let run = async move {
        match task.await {
            Ok(outcome) => Ok(outcome?),
            Err(j) => Err(Error::Panic {
                task: "checkpoint coordinator".into(),
                message: join_message(j),
            }),
        }
    };
    (Box::pin(run), shutdown)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tinyflow_api::testing::{CollectingSink, VecSource};

    use tinyflow_api::{JobBuilder, JobId};
    use tinyflow_checkpoint::testing::MemoryCheckpointStore;

    fn runner(chaining: bool) -> JobRunner {
        let job = JobBuilder::new(JobId::new("chains").unwrap());
        let words = job.source("src", 2, VecSource::new(vec![vec![1u64]]));
        words
            .map("a", |n: u64| n + 1)
            .filter("b", |n: &u64| *n > 0)
            .rebalance()
            .map("c", |n: u64| n)
            .parallelism(2)
            .key_by(|n: &u64| *n)
            .reduce("d", |acc: &mut u64, n| *acc += n)
            .sink("e", 2, CollectingSink::<u64>::new());
        let config = RuntimeConfig {
            chaining,
            ..RuntimeConfig::default()
        };
        JobRunner::new(
            job.build().unwrap(),
            Arc::new(MemoryCheckpointStore::new()),
            config,
        )
    }

    #[test]
    fn forward_neighbours_chain_and_other_edges_cut() {
        // src -> a -> b (forward), b => c (rebalance), c => d (hash), d -> e (forward).
        assert_eq!(
            runner(true).chains(),
            vec![vec![0, 1, 2], vec![3], vec![4, 5]]
        );
        assert_eq!(
            runner(false).chains(),
            (0..6).map(|n| vec![n]).collect::<Vec<_>>()
        );
    }
}
