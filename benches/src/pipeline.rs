//! In-memory ends of a tinyflow job, for whole-pipeline benchmarks: a
//! [`CyclicSource`] that replays a shared, pre-generated vector of records in
//! large batches (its checkpoint state is its position), a [`CountingSink`]
//! that only counts and checksums what it receives (trivially two-phase, or
//! not transactional at all), and a [`LatestStore`] that keeps only the
//! newest checkpoint in memory. A bare loop folding the same records into a
//! [`Tally`] must end with the same figures as the job, which is how the
//! benchmarks check that both did the same work.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tinyflow_api::{
    CheckpointId, Data, OperatorContext, Sink, SinkFactory, SinkRestore, Source, SourceFactory,
    StreamError, StreamResult,
};
use tinyflow_checkpoint::{CheckpointStore, CompletedCheckpoint};

/// A record's contribution to a [`Tally`]'s checksum.
pub trait Fold {
    /// Mixes the record's fields into one word (cheap: the sink's work per
    /// record should be small next to the engine's).
    fn fold(&self) -> u64;
}

impl Fold for u64 {
    fn fold(&self) -> u64 {
        *self
    }
}

impl Fold for (u64, u64) {
    fn fold(&self) -> u64 {
        self.0 ^ self.1.rotate_left(32)
    }
}

/// Records seen and an order-independent checksum of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Number of records.
    pub records: u64,
    /// Wrapping sum of [`Fold::fold`] over the records.
    pub checksum: u64,
}

impl Tally {
    /// Counts one record.
    #[inline]
    pub fn add<T: Fold>(&mut self, record: &T) {
        self.records += 1;
        self.checksum = self.checksum.wrapping_add(record.fold());
    }

    /// Counts every record of `records`.
    #[inline]
    pub fn add_all<T: Fold>(&mut self, records: &[T]) {
        for r in records {
            self.add(r);
        }
    }

    /// The two tallies together.
    pub fn merge(self, other: Tally) -> Tally {
        Tally {
            records: self.records + other.records,
            checksum: self.checksum.wrapping_add(other.checksum),
        }
    }

    fn encode(self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(16);
        bytes.extend_from_slice(&self.records.to_le_bytes());
        bytes.extend_from_slice(&self.checksum.to_le_bytes());
        bytes
    }
}

/// The records a stream of `length` records starting at `start` consists of,
/// as consecutive slices of `events` (which the stream walks round and
/// round). Both the bare loops and [`CyclicSource`] walk records this way.
pub fn cyclic_slices<T>(events: &[T], start: u64, length: u64) -> impl Iterator<Item = &[T]> {
    let len = u64::try_from(events.len()).expect("a vector's length fits in u64");
    assert!(len > 0 || length == 0, "no events to replay");
    let mut position = start;
    let end = start + length;
    std::iter::from_fn(move || {
        if position >= end {
            return None;
        }
        let at = position % len;
        let take = (len - at).min(end - position);
        position += take;
        let (at, take) = (as_index(at), as_index(take));
        Some(&events[at..at + take])
    })
}

fn as_index(n: u64) -> usize {
    usize::try_from(n).expect("bounded by a vector's length")
}

/// What a [`CyclicSource`] subtask does after its last record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtEnd {
    /// Reports the end of its input (the job takes a final checkpoint and
    /// finishes).
    Finish,
    /// Waits forever without reporting an end, so the job keeps
    /// checkpointing an idle pipeline until it is dropped.
    Idle,
}

/// A source that replays `events` round and round until it has emitted
/// `length` records, in batches of `batch`. Subtask `s` of `p` emits
/// positions `length * s / p .. length * (s + 1) / p`; its checkpoint state is
/// the next position (8 bytes, little endian).
///
/// Batches are copied out of the shared vector (the [`Source`] contract
/// hands the runtime owned records), so for `Copy` records a batch costs one
/// allocation and a `memcpy`.
///
/// A batch is always ready, so a task that reads this source never waits,
/// and unless the runtime yields on its own, it never lets other tasks or
/// timers run on its thread. [`cooperative`](Self::cooperative) makes it
/// spend a unit of tokio's task budget per batch, which yields now and then.
pub struct CyclicSource<T> {
    events: Arc<Vec<T>>,
    length: u64,
    batch: usize,
    at_end: AtEnd,
    cooperative: bool,
}

impl<T> fmt::Debug for CyclicSource<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CyclicSource")
            .field("events", &self.events.len())
            .field("length", &self.length)
            .field("batch", &self.batch)
            .field("at_end", &self.at_end)
            .field("cooperative", &self.cooperative)
            .finish()
    }
}

impl<T> CyclicSource<T> {
    /// A source of `length` records taken round and round from `events`, in
    /// batches of `batch` (at least 1).
    pub fn new(events: Arc<Vec<T>>, length: u64, batch: usize, at_end: AtEnd) -> Self {
        assert!(
            !events.is_empty() || length == 0,
            "a cyclic source needs events to replay"
        );
        CyclicSource {
            events,
            length,
            batch: batch.max(1),
            at_end,
            cooperative: false,
        }
    }

    /// Spends a unit of tokio's cooperative budget per batch
    /// ([`tokio::task::consume_budget`]), so the reading task yields to the
    /// scheduler once its budget is spent, as tokio's own channels do.
    pub fn cooperative(mut self, cooperative: bool) -> Self {
        self.cooperative = cooperative;
        self
    }
}

impl<T: Data> SourceFactory<T> for CyclicSource<T> {
    fn create(
        &self,
        ctx: &OperatorContext,
        restored: &[Vec<u8>],
    ) -> StreamResult<Box<dyn Source<T>>> {
        let parallelism = u64::try_from(ctx.parallelism).expect("parallelism fits in u64");
        let subtask = u64::try_from(ctx.subtask).expect("subtask index fits in u64");
        let start = self.length * subtask / parallelism;
        let end = self.length * (subtask + 1) / parallelism;
        let position = if restored.is_empty() {
            start
        } else {
            let state = restored
                .get(ctx.subtask)
                .filter(|_| restored.len() == ctx.parallelism)
                .ok_or_else(|| StreamError::User {
                    operator: ctx.name.clone(),
                    message: format!(
                        "restoring {} positions into {} subtasks is not supported",
                        restored.len(),
                        ctx.parallelism
                    ),
                })?;
            let bytes: [u8; 8] = state
                .as_slice()
                .try_into()
                .map_err(|_| StreamError::State {
                    operator: ctx.name.clone(),
                    action: "decoded",
                    message: format!("a position is 8 bytes, got {}", state.len()),
                })?;
            u64::from_le_bytes(bytes)
        };
        Ok(Box::new(CyclicReader {
            events: Arc::clone(&self.events),
            position,
            end,
            batch: u64::try_from(self.batch).expect("batch size fits in u64"),
            at_end: self.at_end,
            cooperative: self.cooperative,
        }))
    }
}

struct CyclicReader<T> {
    events: Arc<Vec<T>>,
    position: u64,
    end: u64,
    batch: u64,
    at_end: AtEnd,
    cooperative: bool,
}

#[async_trait::async_trait]
impl<T: Data> Source<T> for CyclicReader<T> {
    // Cancel safe: the only await comes before anything is taken.
    async fn next_batch(&mut self) -> StreamResult<Option<Vec<T>>> {
        if self.cooperative {
            tokio::task::consume_budget().await;
        }
        let take = self.batch.min(self.end - self.position);
        if take == 0 {
            return match self.at_end {
                AtEnd::Finish => Ok(None),
                AtEnd::Idle => std::future::pending().await,
            };
        }
        let mut batch = Vec::with_capacity(as_index(take));
        for slice in cyclic_slices(&self.events, self.position, take) {
            batch.extend_from_slice(slice);
        }
        self.position += take;
        Ok(Some(batch))
    }

    fn snapshot(&mut self, _id: CheckpointId) -> StreamResult<Vec<u8>> {
        Ok(self.position.to_le_bytes().to_vec())
    }
}

/// When a [`CountingSink`] makes what it counted visible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visibility {
    /// Two-phase: `prepare_commit(N)` stages the running tally under N (and
    /// returns it, 16 bytes, as the checkpoint state), `commit(N)` publishes
    /// it. The job must checkpoint.
    Transactional,
    /// Every write is visible at once; the job may run with checkpointing off.
    Immediate,
}

/// A sink that counts and checksums its records and keeps nothing else.
/// [`committed`](Self::committed) is the sum of what every subtask made
/// visible.
#[derive(Clone)]
pub struct CountingSink<T> {
    visible: Arc<Mutex<Vec<Tally>>>,
    visibility: Visibility,
    _t: std::marker::PhantomData<fn(T)>,
}

impl<T> fmt::Debug for CountingSink<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountingSink")
            .field("visibility", &self.visibility)
            .field("committed", &self.committed())
            .finish()
    }
}

impl<T> CountingSink<T> {
    /// A sink that has seen nothing yet.
    pub fn new(visibility: Visibility) -> Self {
        CountingSink {
            visible: Arc::default(),
            visibility,
            _t: std::marker::PhantomData,
        }
    }

    /// What every subtask made visible so far, together.
    pub fn committed(&self) -> Tally {
        lock(&self.visible)
            .iter()
            .fold(Tally::default(), |a, b| a.merge(*b))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking writer leaves a consistent tally behind.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[async_trait::async_trait]
impl<T: Data + Fold> SinkFactory<T> for CountingSink<T> {
    async fn create(
        &self,
        ctx: &OperatorContext,
        _restored: Option<SinkRestore<'_>>,
    ) -> StreamResult<Box<dyn Sink<T>>> {
        {
            let mut visible = lock(&self.visible);
            if visible.len() < ctx.parallelism {
                visible.resize(ctx.parallelism, Tally::default());
            }
        }
        Ok(Box::new(CountingWriter {
            visible: Arc::clone(&self.visible),
            visibility: self.visibility,
            subtask: ctx.subtask,
            running: Tally::default(),
            staged: None,
        }))
    }

    fn is_transactional(&self) -> bool {
        self.visibility == Visibility::Transactional
    }
}

struct CountingWriter {
    visible: Arc<Mutex<Vec<Tally>>>,
    visibility: Visibility,
    subtask: usize,
    running: Tally,
    staged: Option<(CheckpointId, Tally)>,
}

#[async_trait::async_trait]
impl<T: Data + Fold> Sink<T> for CountingWriter {
    async fn write(&mut self, batch: Vec<T>) -> StreamResult<()> {
        self.running.add_all(&batch);
        if self.visibility == Visibility::Immediate {
            lock(&self.visible)[self.subtask] = self.running;
        }
        Ok(())
    }

    async fn prepare_commit(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>> {
        self.staged = Some((id, self.running));
        Ok(self.running.encode())
    }

    async fn commit(&mut self, id: CheckpointId) -> StreamResult<()> {
        if let Some((staged, tally)) = self.staged
            && staged <= id
        {
            lock(&self.visible)[self.subtask] = tally;
            self.staged = None;
        }
        Ok(())
    }
}

/// A checkpoint store in memory that keeps only the newest checkpoint (so a
/// long benchmark holds one checkpoint, not all of them) and counts persists.
#[derive(Debug, Default)]
pub struct LatestStore {
    inner: Mutex<LatestInner>,
}

#[derive(Debug, Default)]
struct LatestInner {
    latest: Option<CompletedCheckpoint>,
    persisted: u64,
}

impl LatestStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checkpoints persisted so far.
    pub fn persisted(&self) -> u64 {
        lock(&self.inner).persisted
    }
}

#[async_trait::async_trait]
impl CheckpointStore for LatestStore {
    async fn persist(&self, checkpoint: &CompletedCheckpoint) -> StreamResult<()> {
        let mut inner = lock(&self.inner);
        inner.latest = Some(checkpoint.clone());
        inner.persisted += 1;
        Ok(())
    }

    async fn latest(&self) -> StreamResult<Option<CompletedCheckpoint>> {
        Ok(lock(&self.inner).latest.clone())
    }

    async fn highest_id(&self) -> StreamResult<Option<CheckpointId>> {
        Ok(lock(&self.inner).latest.as_ref().map(|c| c.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cyclic_slices_wrap_around_and_stop_at_the_length() {
        let events = [1u64, 2, 3];
        let got: Vec<u64> = cyclic_slices(&events, 2, 5).flatten().copied().collect();
        assert_eq!(got, [3, 1, 2, 3, 1]);
        assert_eq!(cyclic_slices(&events, 0, 0).count(), 0);
    }
}
