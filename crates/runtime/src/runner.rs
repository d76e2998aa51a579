//! Running a job: attempts, restore, failover.
//!
//! One attempt wires the graph into tasks and channels, restores every task
//! from the newest completed checkpoint, and runs the checkpoint
//! coordinator's driver beside the tasks. The first task error, panic or
//! coordinator failure ends the attempt: every task is cancelled and joined,
//! and the restart strategy decides whether and when the next attempt
//! starts. A finished coordinator (final checkpoint durable and notified)
//! ends the attempt successfully once every task has wound down.

use std::collections::HashMap;
use std::sync::Arc;

use tinyflow_api::{
    CheckpointId, CheckpointStore, FromTask, JobGraph, NodeKind, OperatorContext, Partitioning,
    SinkRestore, StreamError, SystemWallClock, TaskId, TaskRole, WallClock,
};
use tinyflow_checkpoint::{
    CheckpointConfig, CoordinatorDriver, CoordinatorHandle, DriverConfig, Outcome,
};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::state::RestorePlan;
use crate::task::{
    Body, Message, Output, TaskError, TaskIo, TaskMetrics, run_consumer, run_source,
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
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            checkpoint: CheckpointConfig::default(),
            restart: RestartStrategy::default(),
            channel_capacity: 8,
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

/// Runs a [`JobGraph`] to completion with failover.
pub struct JobRunner {
    graph: JobGraph,
    store: Arc<dyn CheckpointStore>,
    clock: Arc<dyn WallClock>,
    config: RuntimeConfig,
}

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
        }
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
        loop {
            attempt += 1;
            tracing::info!(job = %self.graph.job_id, attempt, "starting job attempt");
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
            let delay = if cause.is_retryable() {
                self.config.restart.delay_before(attempt)
            } else {
                None
            };
            let Some(delay) = delay else {
                tracing::error!(job = %self.graph.job_id, attempt, error = %chain(&cause), "job failed");
                return Err(Error::JobFailed {
                    attempts: attempt,
                    cause: Box::new(cause),
                });
            };
            tracing::warn!(
                job = %self.graph.job_id,
                attempt,
                error = %chain(&cause),
                delay_ms = delay.as_millis() as u64,
                "job attempt failed, restarting from the newest completed checkpoint"
            );
            tokio::time::sleep(delay).await;
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
        let (driver, handle, restored) =
            CoordinatorDriver::start(dc, Arc::clone(&self.store), Arc::clone(&self.clock)).await?;
        let plan = RestorePlan::new(restored.checkpoint.as_ref())?;
        if let Some(id) = plan.checkpoint {
            tracing::info!(job = %g.job_id, checkpoint = %id, "restoring");
        }

        let (mut inputs, mut outputs) = self.wire();
        let mut tasks = JoinSet::new();
        let mut labels = HashMap::new();
        let mut next_id = 0u32;
        for (ni, node) in g.nodes.iter().enumerate() {
            let sink_states = plan.sink(&node.name);
            let source_states = plan.source(&node.name);
            for s in 0..node.parallelism {
                let ctx = OperatorContext {
                    name: node.name.clone(),
                    subtask: s,
                    parallelism: node.parallelism,
                    max_parallelism: g.max_parallelism,
                };
                let id = TaskId::new(next_id);
                next_id += 1;
                let (control_tx, control) = mpsc::channel(16);
                let role = match &node.kind {
                    NodeKind::Source(_) => TaskRole::Source,
                    NodeKind::Operator(_) => TaskRole::Operator,
                    NodeKind::Sink(f) if f.is_transactional() => TaskRole::Committer,
                    NodeKind::Sink(_) => TaskRole::Operator,
                };
                handle
                    .register(id, role, control_tx)
                    .await
                    .map_err(|_| StreamError::Graph {
                        message: "coordinator gone during setup".into(),
                    })?;
                let io = TaskIo {
                    id,
                    node: node.name.clone(),
                    subtask: u32::try_from(s).expect("parallelism fits u32"),
                    control,
                    coordinator: handle.clone(),
                    inputs: std::mem::take(&mut inputs[ni][s]),
                    outputs: std::mem::take(&mut outputs[ni][s]),
                    metrics: TaskMetrics::new(&node.name, s),
                };
                let label = io.label();
                let coordinator = handle.clone();
                let spawned = match &node.kind {
                    NodeKind::Source(f) => {
                        let source = f.create(&ctx, &source_states)?;
                        tasks.spawn(supervise(
                            label.clone(),
                            id,
                            coordinator,
                            run_source(io, source),
                        ))
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
                        tasks.spawn(supervise(
                            label.clone(),
                            id,
                            coordinator,
                            run_consumer(io, Body::Operator(op)),
                        ))
                    }
                    NodeKind::Sink(f) => {
                        let restore = plan.checkpoint.map(|checkpoint| SinkRestore {
                            checkpoint,
                            states: &sink_states,
                        });
                        let sink = f.create(&ctx, restore).await?;
                        tasks.spawn(supervise(
                            label.clone(),
                            id,
                            coordinator,
                            run_consumer(io, Body::Sink(sink)),
                        ))
                    }
                };
                labels.insert(spawned.id(), label);
            }
        }
        drop(handle);

        let run = driver.run(std::future::pending::<()>());
        tokio::pin!(run);
        let ended = loop {
            tokio::select! {
                biased;
                Some(joined) = tasks.join_next_with_id() => match joined {
                    Ok((_, Ok(()))) => {}
                    Ok((_, Err(e))) => break Err(e),
                    Err(j) => break Err(panic_error(&labels, j)),
                },
                outcome = &mut run => break outcome.map_err(Error::from),
            }
        };
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

    /// Creates the data channels: per node and subtask, its inputs and its
    /// outputs.
    #[allow(
        clippy::type_complexity,
        reason = "local plumbing, named by the return binding"
    )]
    fn wire(
        &self,
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
        for e in &g.edges {
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
            let message = chain(&source);
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
    let message = if j.is_panic() {
        let payload = j.into_panic();
        payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".into())
    } else {
        "cancelled".into()
    };
    Error::Panic { task, message }
}

fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}
