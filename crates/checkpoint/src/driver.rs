//! The coordinator's async shell: turns I/O into [`Event`]s and performs the
//! [`Action`]s the state machine returns.
//!
//! One loop, one owner of all state: a biased `select!` over shutdown, the
//! inbound channel (acks, registrations), task-loss watchers, deliveries
//! waiting for room, store writes and the next timer. Nothing is spawned:
//! every in-flight future lives in the loop and is dropped with it.
//!
//! Backpressure: a message for a task whose control channel is full waits in
//! that task's outbox while the loop goes on; a newer notify-complete replaces
//! an older queued one, and an abort cancels a trigger still queued, so an
//! outbox never holds more than `max_concurrent` triggers, their aborts and
//! one notification, however long a task stays busy (I8, I9).

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use futures_util::future::{AbortHandle, Abortable};
use futures_util::stream::{FuturesUnordered, StreamExt};
use tinyflow_api::{CheckpointId, JobId, StreamResult, TaskId};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::coordinator::{Action, Coordinator, Event, Now, Phase};
use crate::{
    BoxFuture, ChannelClosed, CheckpointStore, CompletedCheckpoint, ControlChannel, FromTask,
    TaskRole, ToTask, TrySendError, WallClock,
};
use crate::{CheckpointConfig, Error, Result};

/// Capacity of the inbound channel (acks, registrations) by default.
pub const DEFAULT_INBOUND_CAPACITY: usize = 1024;

/// How the driver ended, when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every source ended and the final checkpoint completed and was
    /// delivered to every task still listening.
    Finished {
        /// The final checkpoint (`None` with checkpointing off).
        final_checkpoint: Option<CheckpointId>,
    },
    /// The shutdown future completed first.
    Shutdown,
}

/// The coordinator is gone (finished, failed or shut down).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("checkpoint coordinator is gone")]
pub struct CoordinatorGone;

enum Inbound {
    Start,
    Register {
        task: TaskId,
        role: TaskRole,
        channel: Box<dyn ControlChannel>,
    },
    Deregister {
        task: TaskId,
    },
    Task(FromTask),
}

impl fmt::Debug for Inbound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Inbound::Start => f.write_str("Start"),
            Inbound::Register { task, role, .. } => write!(f, "Register({task}, {role:?})"),
            Inbound::Deregister { task } => write!(f, "Deregister({task})"),
            Inbound::Task(msg) => write!(f, "{msg:?}"),
        }
    }
}

/// How tasks (and the runtime) talk to the coordinator. Cheap to clone; when
/// every clone is dropped while the job runs, the driver fails with
/// [`Error::InboundClosed`] rather than stopping silently.
#[derive(Debug, Clone)]
pub struct CoordinatorHandle {
    tx: mpsc::Sender<Inbound>,
}

impl CoordinatorHandle {
    /// Registers a task and the channel to reach it. Checkpoints triggered
    /// from now on wait for its ack. Waits if the inbound channel is full.
    pub async fn register(
        &self,
        task: TaskId,
        role: TaskRole,
        channel: impl ControlChannel + 'static,
    ) -> Result<(), CoordinatorGone> {
        self.send_inbound(Inbound::Register {
            task,
            role,
            channel: Box::new(channel),
        })
        .await
    }

    /// Every task is registered: checkpointing may begin (only needed with
    /// [`DriverConfig::wait_for_start`]).
    pub async fn start(&self) -> Result<(), CoordinatorGone> {
        self.send_inbound(Inbound::Start).await
    }

    /// Removes a task on purpose (not a failure). Checkpoints waiting for it
    /// are aborted without counting as failures.
    pub async fn deregister(&self, task: TaskId) -> Result<(), CoordinatorGone> {
        self.send_inbound(Inbound::Deregister { task }).await
    }

    /// Sends a task's message (ack, decline, end of input, failure).
    pub async fn send(&self, msg: FromTask) -> Result<(), CoordinatorGone> {
        self.send_inbound(Inbound::Task(msg)).await
    }

    async fn send_inbound(&self, msg: Inbound) -> Result<(), CoordinatorGone> {
        self.tx.send(msg).await.map_err(|_| CoordinatorGone)
    }
}

/// Everything the driver needs besides the coordinator's decisions.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// The job.
    pub job_id: JobId,
    /// Checkpointing settings.
    pub checkpoint: CheckpointConfig,
    /// Whether the job has a transactional sink (then checkpointing must be on).
    pub has_transactional_sink: bool,
    /// The highest checkpoint id any of the job's sinks reports as committed
    /// (read from its table on open). New ids start above it, so a wiped
    /// checkpoint store cannot make new data look already committed.
    pub sinks_committed: Option<CheckpointId>,
    /// Capacity of the inbound channel.
    pub inbound_capacity: usize,
    /// Trigger nothing until [`CoordinatorHandle::start`]: for runtimes that
    /// register tasks one by one (a checkpoint triggered half-way would miss
    /// the state of tasks not yet registered).
    pub wait_for_start: bool,
}

impl DriverConfig {
    /// Defaults for `job_id` with `checkpoint` settings.
    pub fn new(job_id: JobId, checkpoint: CheckpointConfig) -> Self {
        DriverConfig {
            job_id,
            checkpoint,
            has_transactional_sink: false,
            sinks_committed: None,
            inbound_capacity: DEFAULT_INBOUND_CAPACITY,
            wait_for_start: false,
        }
    }
}

/// What [`CoordinatorDriver::start`] found in the store.
#[derive(Debug)]
pub struct Restored {
    /// The newest valid completed checkpoint, to restore every task from
    /// (`None`: start fresh from the configured start positions).
    pub checkpoint: Option<CompletedCheckpoint>,
    /// The id the next checkpoint will get.
    pub next_id: CheckpointId,
}

struct Link {
    channel: Box<dyn ControlChannel>,
    outbox: VecDeque<ToTask>,
    sending: bool,
    generation: u64,
    stop_watch: AbortHandle,
}

impl Link {
    /// Queues `msg`, keeping the outbox bounded: a notification replaces an
    /// older queued one; an abort cancels its trigger if that was never
    /// delivered (the task never hears of the checkpoint at all).
    fn enqueue(&mut self, msg: ToTask) {
        match &msg {
            ToTask::NotifyComplete { .. } => {
                self.outbox
                    .retain(|m| !matches!(m, ToTask::NotifyComplete { .. }));
            }
            ToTask::Abort { id, .. } => {
                let queued = self
                    .outbox
                    .iter()
                    .position(|m| matches!(m, ToTask::TriggerCheckpoint { id: t, .. } if t == id));
                if let Some(at) = queued {
                    self.outbox.remove(at);
                    return;
                }
            }
            ToTask::TriggerCheckpoint { .. } => {}
        }
        self.outbox.push_back(msg);
    }
}

type Delivery = BoxFuture<(TaskId, u64, Result<(), ChannelClosed>)>;
type Watch = BoxFuture<Option<(TaskId, u64)>>;
type Write = BoxFuture<(CheckpointId, StreamResult<()>)>;

/// The async driver of one job's [`Coordinator`].
pub struct CoordinatorDriver {
    core: Coordinator,
    store: Arc<dyn CheckpointStore>,
    clock: Arc<dyn WallClock>,
    inbound: mpsc::Receiver<Inbound>,
    links: BTreeMap<TaskId, Link>,
    next_generation: u64,
    deliveries: FuturesUnordered<Delivery>,
    watches: FuturesUnordered<Watch>,
    writes: FuturesUnordered<Write>,
}

impl fmt::Debug for CoordinatorDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CoordinatorDriver")
            .field("core", &self.core)
            .field("links", &self.links.len())
            .field("deliveries", &self.deliveries.len())
            .field("writes", &self.writes.len())
            .finish_non_exhaustive()
    }
}

impl CoordinatorDriver {
    /// Validates the configuration, reads the store and prepares a driver.
    ///
    /// The first checkpoint id is above the newest id the store holds any
    /// trace of and above what the sinks report committed. The returned
    /// [`Restored`] carries the checkpoint to restore tasks from.
    pub async fn start(
        config: DriverConfig,
        store: Arc<dyn CheckpointStore>,
        clock: Arc<dyn WallClock>,
    ) -> Result<(Self, CoordinatorHandle, Restored)> {
        config.checkpoint.validate(config.has_transactional_sink)?;
        let checkpoint = store.latest().await?;
        let in_store = store.highest_id().await?;
        let highest = [
            in_store,
            config.sinks_committed,
            checkpoint.as_ref().map(|c| c.id),
        ]
        .into_iter()
        .flatten()
        .max();
        let next_id = highest.map_or(CheckpointId::FIRST, CheckpointId::next);
        // A sink commits a checkpoint only after it is durable in the store,
        // so the store's newest readable checkpoint can only be behind the
        // sinks if newer files were lost or damaged. Restoring from it would
        // replay records the sinks already committed: refuse.
        if let (Some(restored), Some(committed)) = (&checkpoint, config.sinks_committed)
            && restored.id < committed
        {
            return Err(Error::RestoreBehindSinks {
                restored: restored.id,
                committed,
            });
        }
        tracing::info!(
            job = %config.job_id,
            restored = ?checkpoint.as_ref().map(|c| c.id),
            store_highest = ?in_store,
            sinks_committed = ?config.sinks_committed,
            %next_id,
            "checkpoint coordinator starting"
        );
        let (tx, inbound) = mpsc::channel(config.inbound_capacity.max(1));
        let mut core = Coordinator::new(config.job_id, config.checkpoint, next_id, Instant::now());
        if config.wait_for_start {
            core.wait_for_start();
        }
        let driver = CoordinatorDriver {
            core,
            store,
            clock,
            inbound,
            links: BTreeMap::new(),
            next_generation: 0,
            deliveries: FuturesUnordered::new(),
            watches: FuturesUnordered::new(),
            writes: FuturesUnordered::new(),
        };
        Ok((
            driver,
            CoordinatorHandle { tx },
            Restored {
                checkpoint,
                next_id,
            },
        ))
    }

    /// Runs until the job finishes, fails, or `shutdown` completes.
    ///
    /// On [`Outcome::Finished`] every task still listening has received the
    /// final notify-complete. On error the job attempt failed; checkpoints in
    /// flight were aborted (tasks still listening are told, best effort).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<Outcome> {
        self.run_until_stopped(shutdown, std::future::pending())
            .await
    }

    /// Like [`run`](Self::run), and when `stop` completes the job stops with
    /// a final checkpoint ([`Event::Stop`]): [`Outcome::Finished`] once it
    /// completed and every task still listening was notified.
    pub async fn run_until_stopped(
        mut self,
        shutdown: impl Future<Output = ()>,
        stop: impl Future<Output = ()>,
    ) -> Result<Outcome> {
        tokio::pin!(shutdown);
        tokio::pin!(stop);
        let mut stopping = false;
        let mut actions: Vec<Action> = Vec::new();
        loop {
            let deadline = self.core.next_deadline();
            let event = tokio::select! {
                biased;
                () = &mut shutdown => {
                    tracing::info!(phase = ?self.core.phase(), in_flight = self.core.in_flight(), "coordinator shutting down");
                    return Ok(Outcome::Shutdown);
                }
                () = &mut stop, if !stopping => {
                    stopping = true;
                    Event::Stop
                }
                msg = self.inbound.recv() => match msg {
                    Some(Inbound::Register { task, role, channel }) => {
                        self.link(task, channel);
                        Event::Register { task, role }
                    }
                    Some(Inbound::Deregister { task }) => {
                        self.unlink(task);
                        Event::Deregister { task }
                    }
                    Some(Inbound::Task(msg)) => Event::Task(msg),
                    Some(Inbound::Start) => Event::Start,
                    None => return Err(Error::InboundClosed { live_tasks: self.core.task_count() }),
                },
                Some(watched) = self.watches.next(), if !self.watches.is_empty() => match watched {
                    Some((task, generation)) if self.is_current(task, generation) => {
                        self.unlink(task);
                        Event::ChannelClosed { task }
                    }
                    _ => continue,
                },
                Some((task, generation, delivered)) = self.deliveries.next(), if !self.deliveries.is_empty() => {
                    if !self.is_current(task, generation) {
                        continue;
                    }
                    if let Some(link) = self.links.get_mut(&task) {
                        link.sending = false;
                    }
                    match delivered {
                        Ok(()) => match self.pump(task) {
                            Ok(()) => continue,
                            Err(ChannelClosed) => Event::ChannelClosed { task },
                        },
                        Err(ChannelClosed) => {
                            self.unlink(task);
                            Event::ChannelClosed { task }
                        }
                    }
                }
                Some((id, written)) = self.writes.next(), if !self.writes.is_empty() => match written {
                    Ok(()) => Event::Persisted { id },
                    Err(error) => Event::PersistFailed { id, error },
                },
                () = sleep_until_or_forever(deadline) => Event::Tick,
            };
            let now = self.now();
            self.core.handle_into(event, now, &mut actions);
            while !actions.is_empty() {
                let mut follow_up = Vec::new();
                for action in std::mem::take(&mut actions) {
                    match action {
                        Action::Send { task, msg } => {
                            if let Err(ChannelClosed) = self.deliver(task, msg) {
                                // The loss is an event of its own; its actions
                                // are performed in this same turn.
                                self.core.handle_into(
                                    Event::ChannelClosed { task },
                                    self.now(),
                                    &mut follow_up,
                                );
                            }
                        }
                        Action::Persist(checkpoint) => self.write(checkpoint),
                        Action::Finished { final_checkpoint } => {
                            self.flush().await;
                            return Ok(Outcome::Finished { final_checkpoint });
                        }
                        // The coordinator logged the failure with its cause.
                        Action::Fail(error) => return Err(error),
                    }
                }
                actions = follow_up;
            }
        }
    }

    /// The coordinator's state (for tests and metrics).
    pub fn coordinator(&self) -> &Coordinator {
        &self.core
    }

    fn now(&self) -> Now {
        Now {
            at: Instant::now(),
            wall_ms: self.clock.now_millis(),
        }
    }

    fn is_current(&self, task: TaskId, generation: u64) -> bool {
        self.links
            .get(&task)
            .is_some_and(|l| l.generation == generation)
    }

    fn link(&mut self, task: TaskId, channel: Box<dyn ControlChannel>) {
        if self.links.contains_key(&task) {
            // A duplicate registration: the coordinator fails the job; keep
            // the first link so the error names the right channel.
            return;
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        let (stop_watch, registration) = AbortHandle::new_pair();
        let closed = Abortable::new(channel.closed(), registration);
        self.watches.push(Box::pin(async move {
            closed.await.ok().map(|()| (task, generation))
        }));
        self.links.insert(
            task,
            Link {
                channel,
                outbox: VecDeque::new(),
                sending: false,
                generation,
                stop_watch,
            },
        );
    }

    fn unlink(&mut self, task: TaskId) {
        if let Some(link) = self.links.remove(&task) {
            link.stop_watch.abort();
        }
    }

    fn deliver(&mut self, task: TaskId, msg: ToTask) -> Result<(), ChannelClosed> {
        let Some(link) = self.links.get_mut(&task) else {
            tracing::debug!(%task, ?msg, "message for a task without a link, dropped");
            return Ok(());
        };
        link.enqueue(msg);
        self.pump(task)
    }

    /// Moves queued messages into the task's channel until it is full; the
    /// first that does not fit waits in a delivery future.
    fn pump(&mut self, task: TaskId) -> Result<(), ChannelClosed> {
        let Some(link) = self.links.get_mut(&task) else {
            return Ok(());
        };
        while !link.sending {
            let Some(msg) = link.outbox.pop_front() else {
                break;
            };
            match link.channel.try_send(msg) {
                Ok(()) => {}
                Err(TrySendError::Full(msg)) => {
                    tracing::debug!(%task, checkpoint = %msg.checkpoint_id(), queued = link.outbox.len(), "control channel full, delivery waits");
                    let generation = link.generation;
                    let send = link.channel.send(msg);
                    self.deliveries
                        .push(Box::pin(async move { (task, generation, send.await) }));
                    link.sending = true;
                }
                Err(TrySendError::Closed(_)) => {
                    self.unlink(task);
                    return Err(ChannelClosed);
                }
            }
        }
        Ok(())
    }

    fn write(&mut self, checkpoint: CompletedCheckpoint) {
        let store = Arc::clone(&self.store);
        self.writes.push(Box::pin(async move {
            let written = store.persist(&checkpoint).await;
            (checkpoint.id, written)
        }));
    }

    /// Delivers everything still queued, in order; tasks that went away are
    /// skipped. Deliveries already waiting for room go first (each holds the
    /// oldest message of its task).
    async fn flush(&mut self) {
        while self.deliveries.next().await.is_some() {}
        for link in self.links.values_mut() {
            while let Some(msg) = link.outbox.pop_front() {
                if link.channel.send(msg).await.is_err() {
                    break;
                }
            }
        }
    }

    /// The coordinator's phase.
    pub fn phase(&self) -> Phase {
        self.core.phase()
    }
}

/// Sleeps until `deadline`, or forever when there is none.
///
/// Cancel safe: it holds no state besides the timer.
async fn sleep_until_or_forever(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
