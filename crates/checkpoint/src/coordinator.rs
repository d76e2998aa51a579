//! The coordinator's decisions: a pure state machine.
//!
//! [`Coordinator::handle`] takes one [`Event`] and the current time and returns
//! the [`Action`]s to perform. It does no I/O and reads no clock, so every
//! decision can be replayed, property-tested against a reference model and
//! benchmarked without a runtime. The async shell that feeds it is
//! [`crate::driver`].
//!
//! Rules it keeps (numbers refer to the invariants of the exactly-once
//! contract):
//! - triggers fall on a fixed-rate grid; at most `max_concurrent` checkpoints
//!   are in flight, at least `min_pause` after the previous completion (I9);
//! - a checkpoint is persisted only once every task live at its trigger acked,
//!   and is complete only when the store reports the write durable (I2);
//!   completions are strictly increasing and a completion subsumes every older
//!   pending checkpoint (I3); every registered task is notified (I4);
//! - a declined, timed-out or store-failed checkpoint is aborted and frees its
//!   slot; more than `tolerable_failures` in a row fail the job (I5);
//! - a lost task aborts, at once, every checkpoint waiting for it and fails the
//!   job attempt (I6);
//! - when every source reached the end of its input, a final checkpoint is
//!   taken before the job reports it finished (I7);
//! - slowness alone never fails the job: only a timeout does (I8).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tinyflow_api::{CheckpointId, JobId, StreamError, TaskId, error_chain};
use tokio::time::Instant;

use crate::{AbortReason, CompletedCheckpoint, FromTask, StateHandle, TaskRole, ToTask};
use crate::{CheckpointConfig, Error, LossCause};

/// The current time, as the driver read it: a monotonic instant for every
/// decision, and wall-clock milliseconds for metadata labels only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Monotonic time (`tokio::time`, so tests can pause it).
    pub at: Instant,
    /// Wall-clock milliseconds since the Unix epoch.
    pub wall_ms: u64,
}

/// Something that happened, for the coordinator to decide on.
#[derive(Debug)]
pub enum Event {
    /// Time passed; timers may have expired.
    Tick,
    /// Every task of the job is registered: checkpointing may begin (see
    /// [`Coordinator::wait_for_start`]). The fixed-rate grid starts now.
    Start,
    /// A task joined the job.
    Register {
        /// The task.
        task: TaskId,
        /// What it does.
        role: TaskRole,
    },
    /// A task left the job on purpose (not a failure).
    Deregister {
        /// The task.
        task: TaskId,
    },
    /// A message from a task.
    Task(FromTask),
    /// A task's control channel closed.
    ChannelClosed {
        /// The task.
        task: TaskId,
    },
    /// The store made checkpoint `id` durable.
    Persisted {
        /// The checkpoint.
        id: CheckpointId,
    },
    /// The store failed to make checkpoint `id` durable.
    PersistFailed {
        /// The checkpoint.
        id: CheckpointId,
        /// The store's error.
        error: StreamError,
    },
    /// Stop the job with a final checkpoint: it is taken now, as if every
    /// source had ended, and the job finishes when it completes (sinks
    /// commit it on its notify). Sources read on until then; what they read
    /// after its barrier belongs to no completed checkpoint and is read
    /// again by the next run.
    Stop,
}

/// Something the driver must do.
#[derive(Debug)]
pub enum Action {
    /// Deliver `msg` to `task`, waiting for room if its channel is full.
    Send {
        /// The recipient.
        task: TaskId,
        /// The message.
        msg: ToTask,
    },
    /// Write the checkpoint's metadata to the store and report back with
    /// [`Event::Persisted`] or [`Event::PersistFailed`].
    Persist(CompletedCheckpoint),
    /// The job is done: every source ended and the final checkpoint (if
    /// checkpointing is on) is durable and notified.
    Finished {
        /// The final checkpoint; `None` with checkpointing off.
        final_checkpoint: Option<CheckpointId>,
    },
    /// The job attempt fails.
    Fail(Error),
}

/// Where the job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Checkpointing on the fixed-rate grid.
    Running,
    /// Every source ended; a final checkpoint is being taken.
    Finishing,
    /// Done: the final checkpoint completed.
    Finished,
    /// The job attempt failed; further events are ignored.
    Failed,
}

#[derive(Debug)]
struct TaskEntry {
    role: TaskRole,
    end_of_input: bool,
}

#[derive(Debug)]
struct Pending {
    triggered_at_ms: u64,
    deadline: Instant,
    /// Tasks live at trigger time that have not acked yet.
    awaiting: BTreeSet<TaskId>,
    /// Acks received so far.
    states: BTreeMap<TaskId, StateHandle>,
    /// Set when the last ack arrived.
    acked_at_ms: Option<u64>,
    is_final: bool,
}

impl Pending {
    fn involves(&self, task: TaskId) -> bool {
        self.awaiting.contains(&task) || self.states.contains_key(&task)
    }

    fn participants(&self) -> impl Iterator<Item = TaskId> + '_ {
        self.awaiting.iter().chain(self.states.keys()).copied()
    }
}

/// The checkpoint coordinator's state machine. See the module docs.
#[derive(Debug)]
pub struct Coordinator {
    job_id: JobId,
    config: CheckpointConfig,
    tasks: BTreeMap<TaskId, TaskEntry>,
    pending: BTreeMap<CheckpointId, Pending>,
    /// Checkpoints whose metadata is being written, at most `max_concurrent`.
    persisting: BTreeSet<CheckpointId>,
    next_id: CheckpointId,
    last_completed: Option<CheckpointId>,
    last_completed_at: Option<Instant>,
    /// The next point of the fixed-rate grid; `None` with checkpointing off.
    next_slot: Option<Instant>,
    /// A grid point passed but a trigger was not allowed yet.
    trigger_due: bool,
    consecutive_failures: u32,
    phase: Phase,
    /// No trigger until [`Event::Start`].
    waiting_for_start: bool,
    /// [`Event::Stop`] arrived: the next checkpoint is the final one.
    stop_requested: bool,
    metrics: CoordinatorMetrics,
}

/// Metric handles, made once (labels are not rebuilt per checkpoint).
struct CoordinatorMetrics {
    completed: metrics::Counter,
    last_completed: metrics::Gauge,
    duration: metrics::Histogram,
}

impl CoordinatorMetrics {
    fn new(job: &JobId) -> Self {
        let labels = [("job", job.to_string())];
        CoordinatorMetrics {
            completed: metrics::counter!("tinyflow_checkpoints_completed_total", &labels),
            last_completed: metrics::gauge!("tinyflow_last_completed_checkpoint", &labels),
            duration: metrics::histogram!("tinyflow_checkpoint_duration_seconds", &labels),
        }
    }
}

impl std::fmt::Debug for CoordinatorMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CoordinatorMetrics")
    }
}

impl Coordinator {
    /// A coordinator for `job_id` whose first checkpoint gets `first_id` (the
    /// driver computes it from the store and the sinks so ids continue across
    /// restarts). The first trigger is one interval after `start`.
    ///
    /// The config must have been validated ([`CheckpointConfig::validate`]).
    pub fn new(
        job_id: JobId,
        config: CheckpointConfig,
        first_id: CheckpointId,
        start: Instant,
    ) -> Self {
        let next_slot = config.interval.map(|i| start + i);
        let metrics = CoordinatorMetrics::new(&job_id);
        Coordinator {
            job_id,
            config,
            tasks: BTreeMap::new(),
            pending: BTreeMap::new(),
            persisting: BTreeSet::new(),
            next_id: first_id,
            last_completed: None,
            last_completed_at: None,
            next_slot,
            trigger_due: false,
            consecutive_failures: 0,
            phase: Phase::Running,
            waiting_for_start: false,
            stop_requested: false,
            metrics,
        }
    }

    /// Holds every trigger (periodic and final) until [`Event::Start`], for a
    /// runtime that registers its tasks one by one: the grid then starts at
    /// the start event instead of at construction.
    pub fn wait_for_start(&mut self) {
        self.waiting_for_start = true;
        self.next_slot = None;
    }

    /// Decides on one event at time `now`.
    pub fn handle(&mut self, event: Event, now: Now) -> Vec<Action> {
        let mut out = Vec::new();
        self.handle_into(event, now, &mut out);
        out
    }

    /// Like [`handle`](Self::handle), appending to `out` (no allocation when
    /// nothing is to be done).
    pub fn handle_into(&mut self, event: Event, now: Now, out: &mut Vec<Action>) {
        if self.is_terminal() {
            tracing::debug!(job = %self.job_id, ?event, phase = ?self.phase, "event after the job ended, ignored");
            return;
        }
        // Timers first: an ack that arrives after the deadline does not save
        // the checkpoint.
        self.expire(now, out);
        if !self.is_terminal() {
            self.apply(event, now, out);
        }
        if !self.is_terminal() {
            self.maybe_persist(out);
            self.maybe_trigger(now, out);
        }
    }

    /// When the driver must wake up with [`Event::Tick`] at the latest.
    pub fn next_deadline(&self) -> Option<Instant> {
        if self.is_terminal() {
            return None;
        }
        let timeouts = self
            .pending
            .values()
            .filter(|p| !p.awaiting.is_empty())
            .map(|p| p.deadline);
        let slot = match self.phase {
            Phase::Running => self.next_slot,
            _ => None,
        };
        // Waiting out `min_pause` is the only thing that can hold a due
        // trigger while a slot is free; a full slot count waits for an event.
        let pause_end = if self.trigger_due
            && self.phase == Phase::Running
            && self.pending.len() < self.config.max_concurrent
        {
            self.last_completed_at.map(|t| t + self.config.min_pause)
        } else {
            None
        };
        timeouts.chain(slot).chain(pause_end).min()
    }

    /// The job's phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Checkpoints in flight (triggered, neither complete nor aborted).
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Ids of the checkpoints in flight, ascending.
    pub fn in_flight_ids(&self) -> impl Iterator<Item = CheckpointId> + '_ {
        self.pending.keys().copied()
    }

    /// Checkpoints whose metadata write is under way.
    pub fn persisting(&self) -> usize {
        self.persisting.len()
    }

    /// The newest completed checkpoint.
    pub fn last_completed(&self) -> Option<CheckpointId> {
        self.last_completed
    }

    /// The id the next trigger will use.
    pub fn next_id(&self) -> CheckpointId {
        self.next_id
    }

    /// Failed checkpoints since the last completion.
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    /// Registered tasks.
    pub fn task_count(&self) -> usize {
        self.tasks.len()
    }

    /// The configuration in force.
    pub fn config(&self) -> &CheckpointConfig {
        &self.config
    }

    fn is_terminal(&self) -> bool {
        matches!(self.phase, Phase::Finished | Phase::Failed)
    }

    fn apply(&mut self, event: Event, now: Now, out: &mut Vec<Action>) {
        match event {
            Event::Tick => {}
            Event::Start => {
                if self.waiting_for_start {
                    self.waiting_for_start = false;
                    self.next_slot = self.config.interval.map(|i| now.at + i);
                    tracing::debug!(job = %self.job_id, tasks = self.tasks.len(), "all tasks registered, checkpointing starts");
                    // Sources that ended while others were still registering.
                    self.check_sources_done(now, out);
                }
            }
            Event::Stop => {
                if !self.stop_requested {
                    self.stop_requested = true;
                    tracing::info!(job = %self.job_id, phase = ?self.phase, "stop requested");
                    self.check_sources_done(now, out);
                }
            }
            Event::Register { task, role } => self.register(task, role, out),
            Event::Deregister { task } => self.deregister(task, now, out),
            Event::Task(FromTask::Ack { task, id, state }) => self.ack(task, id, state, now),
            Event::Task(FromTask::Decline { task, id, reason }) => {
                if self.tasks.contains_key(&task)
                    && self.pending.get(&id).is_some_and(|p| p.involves(task))
                {
                    self.abort(id, AbortReason::Declined { task, reason }, out);
                } else {
                    tracing::debug!(job = %self.job_id, %task, checkpoint = %id, "decline for a checkpoint not in flight, ignored");
                }
            }
            Event::Task(FromTask::EndOfInput { task }) => self.end_of_input(task, now, out),
            Event::Task(FromTask::Failed { task, message }) => {
                self.lose(task, LossCause::Reported { message }, out);
            }
            Event::ChannelClosed { task } => self.lose(task, LossCause::ChannelClosed, out),
            Event::Persisted { id } => self.persisted(id, now, out),
            Event::PersistFailed { id, error } => {
                if self.persisting.remove(&id) {
                    tracing::warn!(job = %self.job_id, checkpoint = %id, error = %error_chain(&error), "checkpoint metadata write failed");
                    self.abort(id, AbortReason::StoreFailed, out);
                } else {
                    tracing::debug!(job = %self.job_id, checkpoint = %id, "store failure for a checkpoint no longer persisting, ignored");
                }
            }
        }
    }

    fn register(&mut self, task: TaskId, role: TaskRole, out: &mut Vec<Action>) {
        if self.tasks.contains_key(&task) {
            self.fail(Error::DuplicateTask { task }, out);
            return;
        }
        if role == TaskRole::Committer && self.config.interval.is_none() {
            self.fail(
                Error::Config {
                    key: "checkpoint.interval",
                    message: format!(
                        "checkpointing is off but {task} is a committer, which commits only when a checkpoint completes"
                    ),
                },
                out,
            );
            return;
        }
        tracing::debug!(job = %self.job_id, %task, ?role, "task registered");
        self.tasks.insert(
            task,
            TaskEntry {
                role,
                end_of_input: false,
            },
        );
    }

    fn deregister(&mut self, task: TaskId, now: Now, out: &mut Vec<Action>) {
        if self.tasks.remove(&task).is_none() {
            tracing::warn!(job = %self.job_id, %task, "deregistration of an unknown task, ignored");
            return;
        }
        tracing::debug!(job = %self.job_id, %task, "task deregistered");
        let waiting: Vec<_> = self
            .pending
            .iter()
            .filter(|(_, p)| p.awaiting.contains(&task))
            .map(|(id, _)| *id)
            .collect();
        for id in waiting {
            self.abort(id, AbortReason::TaskDeregistered { task }, out);
        }
        self.check_sources_done(now, out);
    }

    fn ack(&mut self, task: TaskId, id: CheckpointId, state: StateHandle, now: Now) {
        let Some(p) = self.pending.get_mut(&id) else {
            tracing::debug!(job = %self.job_id, %task, checkpoint = %id, "ack for a checkpoint not in flight, ignored");
            return;
        };
        if !p.awaiting.remove(&task) {
            tracing::debug!(job = %self.job_id, %task, checkpoint = %id, "duplicate or unexpected ack, ignored");
            return;
        }
        p.states.insert(task, state);
        if p.awaiting.is_empty() {
            p.acked_at_ms = Some(now.wall_ms);
            tracing::debug!(job = %self.job_id, checkpoint = %id, "all tasks acked");
        }
    }

    /// Starts writing the newest fully acked checkpoint, if none newer is
    /// being written already (a newer one subsumes it).
    fn maybe_persist(&mut self, out: &mut Vec<Action>) {
        let newest_acked = self
            .pending
            .iter()
            .rev()
            .find(|(id, p)| p.awaiting.is_empty() && !self.persisting.contains(id))
            .map(|(id, _)| *id);
        let Some(id) = newest_acked else { return };
        if self
            .persisting
            .iter()
            .next_back()
            .is_some_and(|newest| *newest > id)
        {
            return;
        }
        let Some(p) = self.pending.get(&id) else {
            return;
        };
        self.persisting.insert(id);
        out.push(Action::Persist(CompletedCheckpoint {
            job_id: self.job_id.clone(),
            id,
            triggered_at_ms: p.triggered_at_ms,
            acked_at_ms: p.acked_at_ms.unwrap_or(p.triggered_at_ms),
            is_final: p.is_final,
            task_states: p.states.clone(),
        }));
    }

    fn persisted(&mut self, id: CheckpointId, now: Now, out: &mut Vec<Action>) {
        if !self.persisting.remove(&id) {
            tracing::debug!(job = %self.job_id, checkpoint = %id, "store result for a checkpoint no longer persisting, ignored");
            return;
        }
        let Some(p) = self.pending.remove(&id) else {
            // `persisting` only holds ids of pending checkpoints.
            debug_assert!(false, "persisting checkpoint {id} not pending");
            return;
        };
        self.last_completed = Some(id);
        self.last_completed_at = Some(now.at);
        self.consecutive_failures = 0;
        tracing::info!(
            job = %self.job_id,
            checkpoint = %id,
            tasks = p.states.len(),
            state_bytes = p.states.values().map(StateHandle::len).sum::<usize>(),
            duration_ms = now.wall_ms.saturating_sub(p.triggered_at_ms),
            is_final = p.is_final,
            "checkpoint completed"
        );
        self.metrics.completed.increment(1);
        self.metrics.last_completed.set(id.get() as f64);
        self.metrics
            .duration
            .record(now.wall_ms.saturating_sub(p.triggered_at_ms) as f64 / 1000.0);
        for task in self.tasks.keys() {
            out.push(Action::Send {
                task: *task,
                msg: ToTask::NotifyComplete { id },
            });
        }
        let older: Vec<_> = self.pending.range(..id).map(|(id, _)| *id).collect();
        for old in older {
            self.persisting.remove(&old);
            self.abort(old, AbortReason::Subsumed { by: id }, out);
        }
        if p.is_final {
            self.phase = Phase::Finished;
            tracing::info!(job = %self.job_id, checkpoint = %id, "final checkpoint completed, job finished");
            out.push(Action::Finished {
                final_checkpoint: Some(id),
            });
        }
    }

    fn end_of_input(&mut self, task: TaskId, now: Now, out: &mut Vec<Action>) {
        let Some(entry) = self.tasks.get_mut(&task) else {
            tracing::warn!(job = %self.job_id, %task, "end of input from an unknown task, ignored");
            return;
        };
        if entry.role != TaskRole::Source {
            tracing::warn!(job = %self.job_id, %task, role = ?entry.role, "end of input from a task that is not a source, ignored");
            return;
        }
        entry.end_of_input = true;
        tracing::info!(job = %self.job_id, %task, "source reached the end of its input");
        self.check_sources_done(now, out);
    }

    fn check_sources_done(&mut self, now: Now, out: &mut Vec<Action>) {
        // Until every task is registered, "all sources ended" may only mean
        // "all sources registered so far ended".
        if self.phase != Phase::Running || self.waiting_for_start {
            return;
        }
        let mut sources = self
            .tasks
            .values()
            .filter(|t| t.role == TaskRole::Source)
            .peekable();
        let ended = sources.peek().is_some() && sources.all(|t| t.end_of_input);
        if !ended && !self.stop_requested {
            return;
        }
        let why = if ended {
            "all sources ended"
        } else {
            "stop requested"
        };
        if self.config.interval.is_none() {
            self.phase = Phase::Finished;
            tracing::info!(job = %self.job_id, why, "checkpointing off: job finished");
            out.push(Action::Finished {
                final_checkpoint: None,
            });
            return;
        }
        tracing::info!(job = %self.job_id, why, "taking the final checkpoint");
        self.phase = Phase::Finishing;
        self.trigger_due = true;
        self.maybe_trigger(now, out);
    }

    fn lose(&mut self, task: TaskId, cause: LossCause, out: &mut Vec<Action>) {
        if self.tasks.remove(&task).is_none() {
            tracing::debug!(job = %self.job_id, %task, %cause, "loss of a task not registered, ignored");
            return;
        }
        tracing::warn!(job = %self.job_id, %task, %cause, "task lost");
        let ids: Vec<_> = self.pending.keys().copied().collect();
        for id in ids {
            let reason = if self.pending.get(&id).is_some_and(|p| p.involves(task)) {
                AbortReason::TaskLost { task }
            } else {
                AbortReason::JobEnding
            };
            self.abort_quietly(id, reason, out);
        }
        self.fail(Error::TaskLost { task, cause }, out);
    }

    /// Aborts checkpoints past their deadline that still wait for acks (the
    /// timeout is about slow tasks). A fully acked one is left alone: either
    /// its metadata is being written, and the store decides (the write cannot
    /// be called back, and a checkpoint that became durable after being
    /// declared aborted would be restored by the next attempt), or it waits
    /// behind a newer one being written, which subsumes it or, if that write
    /// fails, lets it be written instead.
    fn expire(&mut self, now: Now, out: &mut Vec<Action>) {
        let expired: Vec<_> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now.at && !p.awaiting.is_empty())
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            if self.is_terminal() {
                return;
            }
            self.abort(id, AbortReason::Expired, out);
        }
    }

    /// Aborts `id`, counting the failure and failing the job past tolerance.
    fn abort(&mut self, id: CheckpointId, reason: AbortReason, out: &mut Vec<Action>) {
        let was_final = self.abort_quietly(id, reason.clone(), out);
        if reason.is_failure() {
            self.consecutive_failures += 1;
            if self.consecutive_failures > self.config.tolerable_failures {
                let failures = self.consecutive_failures;
                let tolerated = self.config.tolerable_failures;
                self.fail(
                    Error::TooManyFailures {
                        failures,
                        tolerated,
                        last: id,
                        reason,
                    },
                    out,
                );
                return;
            }
        }
        if was_final && self.phase == Phase::Finishing {
            self.trigger_due = true;
        }
    }

    /// Drops `id` and tells its participants; returns whether it was final.
    fn abort_quietly(
        &mut self,
        id: CheckpointId,
        reason: AbortReason,
        out: &mut Vec<Action>,
    ) -> bool {
        let Some(p) = self.pending.remove(&id) else {
            return false;
        };
        self.persisting.remove(&id);
        if matches!(
            reason,
            AbortReason::Subsumed { .. } | AbortReason::JobEnding
        ) {
            tracing::debug!(job = %self.job_id, checkpoint = %id, %reason, "checkpoint aborted");
        } else {
            tracing::warn!(job = %self.job_id, checkpoint = %id, %reason, "checkpoint aborted");
        }
        if reason.is_failure() {
            let kind = match reason {
                AbortReason::Declined { .. } => "declined",
                AbortReason::Expired => "expired",
                AbortReason::TaskLost { .. } => "task_lost",
                AbortReason::StoreFailed => "store_failed",
                _ => "other",
            };
            metrics::counter!("tinyflow_checkpoints_failed_total", "job" => self.job_id.to_string(), "reason" => kind)
                .increment(1);
        }
        for task in p.participants() {
            if self.tasks.contains_key(&task) {
                out.push(Action::Send {
                    task,
                    msg: ToTask::Abort {
                        id,
                        reason: reason.clone(),
                    },
                });
            }
        }
        p.is_final
    }

    fn fail(&mut self, error: Error, out: &mut Vec<Action>) {
        let ids: Vec<_> = self.pending.keys().copied().collect();
        for id in ids {
            self.abort_quietly(id, AbortReason::JobEnding, out);
        }
        tracing::error!(job = %self.job_id, error = %error_chain(&error), "job attempt failed");
        self.phase = Phase::Failed;
        out.push(Action::Fail(error));
    }

    fn maybe_trigger(&mut self, now: Now, out: &mut Vec<Action>) {
        let Some(interval) = self.config.interval else {
            return;
        };
        // A checkpoint triggered while tasks are still registering would
        // leave their state out of it.
        if self.waiting_for_start {
            return;
        }
        if self.phase == Phase::Running
            && let Some(slot) = self.next_slot
            && now.at >= slot
        {
            self.trigger_due = true;
            self.next_slot = Some(next_grid_point(slot, interval, now.at));
        }
        if !self.trigger_due || self.pending.len() >= self.config.max_concurrent {
            return;
        }
        let is_final = self.phase == Phase::Finishing;
        if is_final && self.pending.values().any(|p| p.is_final) {
            self.trigger_due = false;
            return;
        }
        if !is_final
            && let Some(done) = self.last_completed_at
            && now.at < done + self.config.min_pause
        {
            return;
        }
        if self.tasks.is_empty() {
            // Nothing to checkpoint; skip this grid point.
            self.trigger_due = false;
            return;
        }
        self.trigger_due = false;
        let id = self.next_id;
        self.next_id = id.next();
        tracing::debug!(job = %self.job_id, checkpoint = %id, tasks = self.tasks.len(), is_final, "triggering checkpoint");
        for task in self.tasks.keys() {
            out.push(Action::Send {
                task: *task,
                msg: ToTask::TriggerCheckpoint {
                    id,
                    timestamp_ms: now.wall_ms,
                },
            });
        }
        self.pending.insert(
            id,
            Pending {
                triggered_at_ms: now.wall_ms,
                deadline: now.at + self.config.timeout,
                awaiting: self.tasks.keys().copied().collect(),
                states: BTreeMap::new(),
                acked_at_ms: None,
                is_final,
            },
        );
    }
}

/// The first grid point `slot + k * interval` (k >= 1) strictly after `now`.
fn next_grid_point(slot: Instant, interval: Duration, now: Instant) -> Instant {
    let behind = now.saturating_duration_since(slot);
    let steps = behind.as_nanos() / interval.as_nanos().max(1) + 1;
    let steps = u32::try_from(steps).unwrap_or(u32::MAX);
    slot + interval.saturating_mul(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn grid_points_skip_missed_slots_without_drift() {
        let t0 = Instant::now();
        assert_eq!(next_grid_point(t0, ms(100), t0), t0 + ms(100));
        assert_eq!(next_grid_point(t0, ms(100), t0 + ms(99)), t0 + ms(100));
        assert_eq!(next_grid_point(t0, ms(100), t0 + ms(100)), t0 + ms(200));
        assert_eq!(next_grid_point(t0, ms(100), t0 + ms(350)), t0 + ms(400));
    }

    #[test]
    fn error_chain_joins_sources() {
        let e = Error::Store(StreamError::Io {
            action: "writing",
            path: "/x".into(),
            source: std::io::Error::other("disk full"),
        });
        assert_eq!(
            error_chain(&e),
            "checkpoint store failed: i/o error while writing /x: disk full"
        );
    }
}
