//! Completed checkpoints and where they are kept.
//!
//! A checkpoint is complete only once its [`CompletedCheckpoint`] metadata is
//! durable in a [`CheckpointStore`]; only then may anything be committed
//! outside (invariant I2 of the exactly-once contract).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use tinyflow_api::{CheckpointId, JobId, StreamResult, TaskId};

/// One task's snapshot for one checkpoint: opaque bytes the task alone
/// interprets (source offsets, pending data files, operator state).
///
/// Cloning is cheap (the bytes are shared).
///
/// ```
/// use tinyflow_checkpoint::StateHandle;
/// let h = StateHandle::from(b"offsets:0=42".to_vec());
/// assert_eq!(h.as_bytes(), b"offsets:0=42");
/// assert!(StateHandle::empty().is_empty());
/// ```
#[derive(Clone, PartialEq, Eq, Default)]
pub struct StateHandle(Arc<[u8]>);

impl StateHandle {
    /// A task with no state.
    pub fn empty() -> Self {
        StateHandle(Arc::from(&[][..]))
    }

    /// The snapshot bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the task has no state.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<Vec<u8>> for StateHandle {
    fn from(bytes: Vec<u8>) -> Self {
        StateHandle(Arc::from(bytes))
    }
}

impl From<&[u8]> for StateHandle {
    fn from(bytes: &[u8]) -> Self {
        StateHandle(Arc::from(bytes))
    }
}

impl fmt::Debug for StateHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StateHandle({} bytes)", self.0.len())
    }
}

/// The metadata of a completed checkpoint: every task's state handle.
///
/// Source positions and the committer's pending files are part of the task
/// states, so restoring this one value restores the whole job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletedCheckpoint {
    /// The job it belongs to.
    pub job_id: JobId,
    /// Its id.
    pub id: CheckpointId,
    /// Wall-clock time of the trigger (ms since the Unix epoch).
    pub triggered_at_ms: u64,
    /// Wall-clock time when the last ack arrived (ms since the Unix epoch).
    pub acked_at_ms: u64,
    /// Whether this is the job's final checkpoint, taken after every source
    /// reached the end of its input.
    pub is_final: bool,
    /// The state of every task that was live at trigger time.
    pub task_states: BTreeMap<TaskId, StateHandle>,
}

impl CompletedCheckpoint {
    /// Total bytes of task state.
    pub fn state_bytes(&self) -> usize {
        self.task_states.values().map(StateHandle::len).sum()
    }
}

/// Durable storage of completed checkpoints' metadata.
///
/// Implementations must make [`persist`](CheckpointStore::persist) atomic: a
/// reader sees either the whole checkpoint or none of it, also after a crash
/// mid-write.
#[async_trait::async_trait]
pub trait CheckpointStore: Send + Sync + fmt::Debug {
    /// Makes `checkpoint` durable. Returns only once it survives a crash.
    /// On error nothing of it is visible to [`latest`](CheckpointStore::latest).
    async fn persist(&self, checkpoint: &CompletedCheckpoint) -> StreamResult<()>;

    /// The newest checkpoint that reads back intact, if any. Unreadable newer
    /// ones are skipped (implementations say so in a warning).
    async fn latest(&self) -> StreamResult<Option<CompletedCheckpoint>>;

    /// The highest checkpoint id the store holds any trace of, readable or
    /// not, so a restarted job never reuses an id.
    async fn highest_id(&self) -> StreamResult<Option<CheckpointId>>;
}
