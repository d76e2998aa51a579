//! Control messages between the checkpoint coordinator and the tasks.
//!
//! The coordinator sends [`ToTask`] messages down each task's bounded control
//! channel; tasks answer with [`FromTask`] messages on one shared channel.
//! Messages carry ids, never references, so a message that arrives late
//! (a stale ack, an abort for a checkpoint the task never saw) is harmless and
//! recognisable.

use std::fmt;

use tinyflow_api::{CheckpointId, TaskId};

use crate::StateHandle;

/// What a task does in the job, as far as checkpointing cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskRole {
    /// Reads from outside (Kafka). Reports [`FromTask::EndOfInput`] when a
    /// bounded input is exhausted; when every source has, the job takes a
    /// final checkpoint and finishes.
    Source,
    /// Anything between sources and committers.
    Operator,
    /// Commits to an external system on [`ToTask::NotifyComplete`] (the
    /// Iceberg committer). A job with a committer cannot run with
    /// checkpointing off: nothing would ever be committed.
    Committer,
}

/// A message from the coordinator to one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToTask {
    /// Take checkpoint `id`: sources record their positions and emit barrier
    /// `id`; every task acks with its state once the barrier passed it.
    TriggerCheckpoint {
        /// The checkpoint.
        id: CheckpointId,
        /// Wall-clock time of the trigger, milliseconds since the Unix epoch,
        /// for metadata only (never used to order anything).
        timestamp_ms: u64,
    },
    /// Checkpoint `id` is durable: commit everything up to and including it.
    /// A notification for `id` also covers every lower id, so a lost or
    /// coalesced notification loses nothing.
    NotifyComplete {
        /// The newest completed checkpoint.
        id: CheckpointId,
    },
    /// Checkpoint `id` will not complete in this attempt. What a task kept
    /// for it is not lost but carried into the next checkpoint: the records
    /// before barrier `id` were consumed and will not be replayed while the
    /// job runs on (a committer keeps the files it staged for `id` and commits
    /// them with a later checkpoint).
    Abort {
        /// The aborted checkpoint.
        id: CheckpointId,
        /// Why.
        reason: AbortReason,
    },
}

impl ToTask {
    /// The checkpoint the message is about.
    pub fn checkpoint_id(&self) -> CheckpointId {
        match self {
            ToTask::TriggerCheckpoint { id, .. }
            | ToTask::NotifyComplete { id }
            | ToTask::Abort { id, .. } => *id,
        }
    }
}

/// A message from a task to the coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FromTask {
    /// The task finished its part of checkpoint `id`; `state` is its snapshot.
    Ack {
        /// The acking task.
        task: TaskId,
        /// The checkpoint.
        id: CheckpointId,
        /// The task's state for this checkpoint (source positions, pending
        /// files, operator state).
        state: StateHandle,
    },
    /// The task cannot take checkpoint `id`; the checkpoint is aborted.
    Decline {
        /// The declining task.
        task: TaskId,
        /// The checkpoint.
        id: CheckpointId,
        /// Why.
        reason: DeclineReason,
    },
    /// A source task's bounded input is exhausted. It keeps running, and
    /// acking, until the job's final checkpoint completed.
    EndOfInput {
        /// The source task.
        task: TaskId,
    },
    /// The task failed; the job attempt fails and restarts.
    Failed {
        /// The failed task.
        task: TaskId,
        /// The failure, as the task reported it (user code's error text).
        message: String,
    },
}

impl FromTask {
    /// The task that sent the message.
    pub fn task(&self) -> TaskId {
        match self {
            FromTask::Ack { task, .. }
            | FromTask::Decline { task, .. }
            | FromTask::EndOfInput { task }
            | FromTask::Failed { task, .. } => *task,
        }
    }
}

/// Why a task declined a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeclineReason {
    /// The task is not ready to snapshot yet (still restoring, not started).
    NotReady,
    /// Barrier alignment was cancelled (an input closed mid-alignment).
    AlignmentCancelled,
    /// Taking the snapshot failed.
    SnapshotFailed {
        /// The error text of the snapshot failure.
        message: String,
    },
}

impl fmt::Display for DeclineReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeclineReason::NotReady => f.write_str("task not ready"),
            DeclineReason::AlignmentCancelled => f.write_str("barrier alignment cancelled"),
            DeclineReason::SnapshotFailed { message } => write!(f, "snapshot failed: {message}"),
        }
    }
}

/// Why the coordinator aborted a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbortReason {
    /// A task declined it.
    Declined {
        /// The declining task.
        task: TaskId,
        /// Its reason.
        reason: DeclineReason,
    },
    /// Not every task acked within the checkpoint timeout.
    Expired,
    /// A task it waited for was lost.
    TaskLost {
        /// The lost task.
        task: TaskId,
    },
    /// A task it waited for deregistered before acking.
    TaskDeregistered {
        /// The task.
        task: TaskId,
    },
    /// Writing its metadata to the checkpoint store failed.
    StoreFailed,
    /// A newer checkpoint completed first and covers it.
    Subsumed {
        /// The newer, completed checkpoint.
        by: CheckpointId,
    },
    /// The coordinator is shutting down or the job failed.
    JobEnding,
}

impl AbortReason {
    /// Whether this abort counts towards the tolerable consecutive failures.
    /// Subsumption, planned deregistration and shutdown are not failures.
    pub fn is_failure(&self) -> bool {
        match self {
            AbortReason::Declined { .. }
            | AbortReason::Expired
            | AbortReason::TaskLost { .. }
            | AbortReason::StoreFailed => true,
            AbortReason::TaskDeregistered { .. }
            | AbortReason::Subsumed { .. }
            | AbortReason::JobEnding => false,
        }
    }
}

impl fmt::Display for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbortReason::Declined { task, reason } => write!(f, "declined by {task}: {reason}"),
            AbortReason::Expired => f.write_str("timed out"),
            AbortReason::TaskLost { task } => write!(f, "{task} was lost"),
            AbortReason::TaskDeregistered { task } => write!(f, "{task} deregistered"),
            AbortReason::StoreFailed => f.write_str("checkpoint store write failed"),
            AbortReason::Subsumed { by } => write!(f, "subsumed by checkpoint {by}"),
            AbortReason::JobEnding => f.write_str("job ending"),
        }
    }
}
