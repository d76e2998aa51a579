//! In-memory fakes of the crate's traits, for every crate's tests
//! (feature `testing`).
//!
//! - [`VecSource`]: a replayable source of fixed partitions of records.
//! - [`CollectingSink`]: a two-phase-commit sink that keeps what it commits
//!   in memory, deduplicating by checkpoint and subtask, with failures to
//!   inject.
//!
//! The checkpoint protocol's fakes (a memory checkpoint store, a manual wall
//! clock, control channels) are in `tinyflow_checkpoint::testing`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::{CheckpointId, StreamResult};

/// A replayable in-memory source: fixed partitions of records, read in
/// batches; its position (next index per partition) is its state, so a
/// restored job continues exactly after the checkpoint. Partition `p` is
/// read by subtask `p % parallelism`, also after a rescale.
#[derive(Debug, Clone)]
pub struct VecSource<T> {
    partitions: Arc<Vec<Vec<T>>>,
    batch_size: usize,
    pause: Option<std::time::Duration>,
}

impl<T: crate::Data> VecSource<T> {
    /// A source over `partitions`, in batches of 64.
    pub fn new(partitions: Vec<Vec<T>>) -> Self {
        VecSource {
            partitions: Arc::new(partitions),
            batch_size: 64,
            pause: None,
        }
    }

    /// Records per batch (at least 1).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// Sleeps `pause` (tokio time) before each batch, so checkpoints fall
    /// between batches under a paused test clock.
    pub fn pause(mut self, pause: std::time::Duration) -> Self {
        self.pause = Some(pause);
        self
    }
}

struct VecSourceReader<T> {
    partitions: Arc<Vec<Vec<T>>>,
    owned: Vec<usize>,
    positions: BTreeMap<usize, usize>,
    next: usize,
    batch_size: usize,
    pause: Option<std::time::Duration>,
}

fn decode_positions(bytes: &[u8]) -> StreamResult<BTreeMap<usize, usize>> {
    postcard::from_bytes::<Vec<(u64, u64)>>(bytes)
        .map_err(|e| crate::StreamError::State {
            operator: "VecSource".into(),
            action: "decoded",
            message: e.to_string(),
        })
        .map(|v| {
            v.into_iter()
                .map(|(p, i)| (p as usize, i as usize))
                .collect()
        })
}

impl<T: crate::Data> crate::SourceFactory<T> for VecSource<T> {
    fn create(
        &self,
        ctx: &crate::OperatorContext,
        restored: &[Vec<u8>],
    ) -> StreamResult<Box<dyn crate::Source<T>>> {
        let mut all = BTreeMap::new();
        for state in restored {
            all.extend(decode_positions(state)?);
        }
        let owned: Vec<_> = (0..self.partitions.len())
            .filter(|p| p % ctx.parallelism == ctx.subtask)
            .collect();
        let positions = owned
            .iter()
            .map(|p| (*p, all.get(p).copied().unwrap_or(0)))
            .collect();
        Ok(Box::new(VecSourceReader {
            partitions: Arc::clone(&self.partitions),
            owned,
            positions,
            next: 0,
            batch_size: self.batch_size,
            pause: self.pause,
        }))
    }
}

#[async_trait::async_trait]
impl<T: crate::Data> crate::Source<T> for VecSourceReader<T> {
    async fn next_batch(&mut self) -> StreamResult<Option<Vec<T>>> {
        // Cancel safe: the only await comes before any state changes.
        if let Some(pause) = self.pause {
            tokio::time::sleep(pause).await;
        }
        for _ in 0..self.owned.len() {
            let p = self.owned[self.next % self.owned.len()];
            self.next += 1;
            let at = self.positions[&p];
            let records = &self.partitions[p];
            if at < records.len() {
                let end = (at + self.batch_size).min(records.len());
                self.positions.insert(p, end);
                return Ok(Some(records[at..end].to_vec()));
            }
        }
        Ok(None)
    }

    fn snapshot(&mut self, _id: CheckpointId) -> StreamResult<Vec<u8>> {
        let v: Vec<(u64, u64)> = self
            .positions
            .iter()
            .map(|(p, i)| (*p as u64, *i as u64))
            .collect();
        postcard::to_allocvec(&v).map_err(|e| crate::StreamError::State {
            operator: "VecSource".into(),
            action: "encoded",
            message: e.to_string(),
        })
    }

    fn positions(&self) -> crate::SourcePositions {
        self.positions
            .iter()
            .map(|(p, i)| (format!("partition-{p}"), i.to_string()))
            .collect()
    }
}

/// What a [`CollectingSink`] committed, shared by all its subtasks and
/// surviving job restarts (the "external system").
#[derive(Debug)]
pub struct CollectedTable<T> {
    rows: Vec<T>,
    /// (checkpoint, writer subtask) units already committed: the dedupe key.
    committed: std::collections::BTreeSet<(u64, u32)>,
    commits: usize,
    fail_commits: u32,
    /// The source positions each writer subtask got with each barrier.
    positions: BTreeMap<(u64, u32), crate::JobPositions>,
}

/// A two-phase-commit sink into memory: records are staged per checkpoint
/// and become visible in the shared table only on commit, deduplicated by
/// (checkpoint, subtask), so replays and repeated commits never duplicate.
/// [`fail_next_commits`](Self::fail_next_commits) injects a crash between
/// a checkpoint's completion and its commit.
#[derive(Debug, Clone)]
pub struct CollectingSink<T> {
    table: Arc<Mutex<CollectedTable<T>>>,
}

impl<T: crate::StateValue> Default for CollectingSink<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: crate::StateValue> CollectingSink<T> {
    /// An empty sink.
    pub fn new() -> Self {
        CollectingSink {
            table: Arc::new(Mutex::new(CollectedTable {
                rows: Vec::new(),
                committed: Default::default(),
                commits: 0,
                fail_commits: 0,
                positions: BTreeMap::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CollectedTable<T>> {
        self.table.lock().expect("collected table lock poisoned")
    }

    /// The committed records, in commit order.
    pub fn committed(&self) -> Vec<T> {
        self.lock().rows.clone()
    }

    /// Number of commits that added something.
    pub fn commits(&self) -> usize {
        self.lock().commits
    }

    /// The next `n` commit calls fail before committing anything.
    pub fn fail_next_commits(&self, n: u32) {
        self.lock().fail_commits = n;
    }

    /// The source positions that came with barrier `checkpoint` to writer
    /// subtask `subtask` ([`crate::Sink::on_positions`]), if it saw that
    /// barrier.
    pub fn positions(&self, checkpoint: CheckpointId, subtask: u32) -> Option<crate::JobPositions> {
        self.lock()
            .positions
            .get(&(checkpoint.get(), subtask))
            .cloned()
    }

    /// The highest checkpoint id whose barrier reached writer subtask
    /// `subtask` with positions.
    pub fn last_positioned(&self, subtask: u32) -> Option<CheckpointId> {
        self.lock()
            .positions
            .keys()
            .filter(|(_, s)| *s == subtask)
            .map(|(c, _)| CheckpointId::new(*c))
            .max()
    }
}

struct CollectingWriter<T> {
    table: Arc<Mutex<CollectedTable<T>>>,
    subtask: u32,
    buffer: Vec<T>,
    /// Staged units: (checkpoint, writer subtask) -> rows.
    staged: BTreeMap<(u64, u32), Vec<T>>,
}

fn commit_units<T: Clone>(
    table: &Mutex<CollectedTable<T>>,
    staged: &mut BTreeMap<(u64, u32), Vec<T>>,
    upto: CheckpointId,
) -> StreamResult<()> {
    let mut t = table.lock().expect("collected table lock poisoned");
    if t.fail_commits > 0 {
        t.fail_commits -= 1;
        return Err(crate::StreamError::User {
            operator: "CollectingSink".into(),
            message: format!("injected failure committing checkpoint {upto}"),
        });
    }
    let due: Vec<_> = staged
        .keys()
        .filter(|(c, _)| *c <= upto.get())
        .copied()
        .collect();
    let mut added = false;
    for unit in due {
        let rows = staged.remove(&unit).unwrap_or_default();
        // The "already committed?" check and the append are one step.
        if t.committed.insert(unit) {
            t.rows.extend(rows);
            added = true;
        }
    }
    if added {
        t.commits += 1;
    }
    Ok(())
}

fn encode_staged<T: crate::StateValue>(
    staged: &BTreeMap<(u64, u32), Vec<T>>,
) -> StreamResult<Vec<u8>> {
    postcard::to_allocvec(staged).map_err(|e| crate::StreamError::State {
        operator: "CollectingSink".into(),
        action: "encoded",
        message: e.to_string(),
    })
}

#[async_trait::async_trait]
impl<T: crate::StateValue> crate::SinkFactory<T> for CollectingSink<T> {
    async fn create(
        &self,
        ctx: &crate::OperatorContext,
        restored: Option<crate::SinkRestore<'_>>,
    ) -> StreamResult<Box<dyn crate::Sink<T>>> {
        let subtask = u32::try_from(ctx.subtask).expect("subtask index fits u32");
        if let (Some(r), 0) = (restored, ctx.subtask) {
            // Recovery: commit every restored staged unit up to the restored
            // checkpoint that the table does not hold yet.
            let mut all = BTreeMap::new();
            for state in r.states {
                let staged: BTreeMap<(u64, u32), Vec<T>> =
                    postcard::from_bytes(state).map_err(|e| crate::StreamError::State {
                        operator: ctx.name.clone(),
                        action: "decoded",
                        message: e.to_string(),
                    })?;
                all.extend(staged);
            }
            commit_units(&self.table, &mut all, r.checkpoint)?;
        }
        Ok(Box::new(CollectingWriter {
            table: Arc::clone(&self.table),
            subtask,
            buffer: Vec::new(),
            staged: BTreeMap::new(),
        }))
    }
}

#[async_trait::async_trait]
impl<T: crate::StateValue> crate::Sink<T> for CollectingWriter<T> {
    async fn write(&mut self, batch: Vec<T>) -> StreamResult<()> {
        self.buffer.extend(batch);
        Ok(())
    }

    async fn prepare_commit(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>> {
        let rows = std::mem::take(&mut self.buffer);
        if !rows.is_empty() {
            self.staged.insert((id.get(), self.subtask), rows);
        }
        encode_staged(&self.staged)
    }

    fn on_positions(&mut self, id: CheckpointId, positions: &crate::JobPositions) {
        self.table
            .lock()
            .expect("collected table lock poisoned")
            .positions
            .insert((id.get(), self.subtask), positions.clone());
    }

    async fn commit(&mut self, id: CheckpointId) -> StreamResult<()> {
        commit_units(&self.table, &mut self.staged, id)
    }
}
