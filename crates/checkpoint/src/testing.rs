//! In-memory fakes of the checkpoint protocol, for every crate's tests
//! (feature `testing`).
//!
//! - [`MemoryCheckpointStore`]: a [`CheckpointStore`] that keeps checkpoints in
//!   memory, can be told to fail the next writes, and can hold writes until
//!   released, so tests decide exactly when a checkpoint becomes durable.
//! - [`ManualWallClock`]: a [`WallClock`] that moves only when told.
//! - [`control_channel`]: a bounded tokio channel pair for one fake task.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tinyflow_api::{CheckpointId, StreamError, StreamResult};
use tokio::sync::{mpsc, watch};

use crate::{CheckpointStore, CompletedCheckpoint, ToTask, WallClock};

/// A bounded control channel for one fake task: give the sender to the
/// coordinator, read the receiver as the task. Dropping the receiver
/// simulates the task crashing.
pub fn control_channel(capacity: usize) -> (mpsc::Sender<ToTask>, mpsc::Receiver<ToTask>) {
    mpsc::channel(capacity)
}

#[derive(Debug, Default)]
struct StoreState {
    checkpoints: BTreeMap<CheckpointId, CompletedCheckpoint>,
    /// Ids whose writes were attempted (successful or not), in order.
    attempts: Vec<CheckpointId>,
    fail_next: u32,
    highest_seen: Option<CheckpointId>,
}

/// A [`CheckpointStore`] in memory, with failure injection and a gate.
///
/// Cloning shares the same store, so a test can keep a handle to inspect
/// what the coordinator persisted.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// use tinyflow_checkpoint::testing::MemoryCheckpointStore;
/// use tinyflow_checkpoint::CheckpointStore;
/// let store = MemoryCheckpointStore::new();
/// store.fail_next_writes(1);
/// assert_eq!(store.latest().await.unwrap(), None);
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct MemoryCheckpointStore {
    state: Arc<Mutex<StoreState>>,
    gate: Arc<watch::Sender<bool>>,
}

impl Default for MemoryCheckpointStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryCheckpointStore {
    /// An empty, open store.
    pub fn new() -> Self {
        let (gate, _) = watch::channel(true);
        MemoryCheckpointStore {
            state: Arc::default(),
            gate: Arc::new(gate),
        }
    }

    /// A store that already holds `checkpoint`, as after a previous run.
    pub fn with_checkpoint(checkpoint: CompletedCheckpoint) -> Self {
        let store = Self::new();
        {
            let mut st = store.lock();
            st.highest_seen = Some(checkpoint.id);
            st.checkpoints.insert(checkpoint.id, checkpoint);
        }
        store
    }

    fn lock(&self) -> MutexGuard<'_, StoreState> {
        // A panic while holding this lock is a test failure already.
        self.state.lock().expect("memory store lock poisoned")
    }

    /// The next `n` writes fail with a retryable error and leave nothing.
    pub fn fail_next_writes(&self, n: u32) {
        self.lock().fail_next = n;
    }

    /// Writes wait (not durable, not failed) until [`open`](Self::open).
    pub fn hold(&self) {
        self.gate.send_replace(false);
    }

    /// Lets held and future writes through.
    pub fn open(&self) {
        self.gate.send_replace(true);
    }

    /// Ids of durable checkpoints, ascending.
    pub fn persisted_ids(&self) -> Vec<CheckpointId> {
        self.lock().checkpoints.keys().copied().collect()
    }

    /// A durable checkpoint.
    pub fn get(&self, id: CheckpointId) -> Option<CompletedCheckpoint> {
        self.lock().checkpoints.get(&id).cloned()
    }

    /// Ids of every write attempt, in order, failed ones included.
    pub fn attempted_ids(&self) -> Vec<CheckpointId> {
        self.lock().attempts.clone()
    }

    /// Records that an id was used without keeping a readable checkpoint, as a
    /// corrupt file would.
    pub fn mark_seen(&self, id: CheckpointId) {
        let mut st = self.lock();
        st.highest_seen = st.highest_seen.max(Some(id));
    }
}

#[async_trait::async_trait]
impl CheckpointStore for MemoryCheckpointStore {
    async fn persist(&self, checkpoint: &CompletedCheckpoint) -> StreamResult<()> {
        let mut gate = self.gate.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = gate.wait_for(|open| *open).await;
        let mut st = self.lock();
        st.attempts.push(checkpoint.id);
        st.highest_seen = st.highest_seen.max(Some(checkpoint.id));
        if st.fail_next > 0 {
            st.fail_next -= 1;
            return Err(StreamError::StoreUnavailable {
                action: "persisting",
                checkpoint: checkpoint.id,
                message: "injected failure".to_owned(),
            });
        }
        st.checkpoints.insert(checkpoint.id, checkpoint.clone());
        Ok(())
    }

    async fn latest(&self) -> StreamResult<Option<CompletedCheckpoint>> {
        Ok(self.lock().checkpoints.values().next_back().cloned())
    }

    async fn highest_id(&self) -> StreamResult<Option<CheckpointId>> {
        Ok(self.lock().highest_seen)
    }
}

/// A [`WallClock`] that moves only when told.
#[derive(Debug, Default)]
pub struct ManualWallClock(AtomicU64);

impl ManualWallClock {
    /// A clock showing `millis`.
    pub fn new(millis: u64) -> Self {
        ManualWallClock(AtomicU64::new(millis))
    }

    /// Moves the clock forward.
    pub fn advance(&self, millis: u64) {
        self.0.fetch_add(millis, Ordering::SeqCst);
    }
}

impl WallClock for ManualWallClock {
    fn now_millis(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}
