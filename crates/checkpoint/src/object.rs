//! A [`CheckpointStore`] on object storage (S3 and compatible stores), so
//! that a worker on another machine finds the job's checkpoints.
//!
//! The store speaks to its objects through [`ObjectStorage`]: whole-object
//! `get`, `put` (an atomic replace, as an S3 PUT is) and `delete` of names
//! under one location. This crate names no storage client; the CLI wraps
//! the Iceberg connector's `ObjectFiles` (S3, or a local directory for
//! tests) in it, so S3 is reached through the same storage layer as the
//! tables.
//!
//! Objects under the location:
//!
//! - `chk-<id, 20 digits>.ckpt`: one per retained checkpoint, in the same
//!   format as [`LocalDirStore`](crate::LocalDirStore)'s files
//!   ([`encode`]/[`decode`]: magic, version, length, CRC-32).
//! - `_index`: which checkpoints there are, as small text: the format line,
//!   the job id, the highest checkpoint id ever written, the retained ids
//!   newest first, and an end line. Object stores have no atomic rename and
//!   listing is slow and, on some stores, not read-after-write consistent,
//!   so the index, not a listing, says what exists; being one object
//!   replaced whole, a reader sees the old index or the new one, never a
//!   torn one.
//!
//! [`persist`](CheckpointStore::persist) puts the checkpoint's object,
//! then the new index (the commit point: the checkpoint exists once the
//! index names it), then deletes the objects that fell out of retention,
//! best effort (a failed delete is a warning and leaves a harmless object
//! behind, never a failed checkpoint). When the index write fails, the new
//! object stays: the failure may be a lost answer to an index write that
//! was done, and then the index names it. Such a checkpoint is visible
//! though `persist` failed: that is safe, as the
//! checkpoint is a consistent cut whose data the next one would carry, and
//! nothing was committed on its behalf. Writes of one store are queued
//! (the index is read, changed and written back), and ids only grow: a
//! checkpoint not newer than the index's highest is refused.
//!
//! [`latest`](CheckpointStore::latest) reads the index and tries the
//! retained ids newest first; a missing or damaged object is skipped with a
//! warning naming it and the [`CorruptReason`], falling back to the one
//! before. [`highest_id`](CheckpointStore::highest_id) is the index's
//! highest, so ids keep growing across runs, machines and
//! [`set_aside`](ObjectStore::set_aside). A damaged index is an error (it
//! is never torn, so only a person or another program can damage it); an
//! index or checkpoint of another job is an error too.
//!
//! There is no lock: two runs of a job on one object store are fenced by
//! the Iceberg table's epoch (the sink's claim; the older run's next
//! commit fails), not by the store. Until then both may write checkpoints
//! here; the queue is per store, and the ids-only-grow check turns away
//! most of the other run's writes.
//!
//! Cancel safety: a `persist` future dropped midway leaves at worst an
//! object that no index names (never read, never deleted), or objects that
//! fell out of retention and were not deleted yet.

use std::fmt;

use tinyflow_api::{CheckpointId, JobId, StreamError, StreamResult};

use crate::store::{decode, encode};
use crate::{CheckpointStore, CompletedCheckpoint, CorruptReason};

/// The index object's name.
pub const INDEX: &str = "_index";

const FORMAT_LINE: &str = "tinyflow checkpoint index 1";
const PREFIX: &str = "chk-";
const SUFFIX: &str = ".ckpt";

/// Whole objects under one location (an S3 prefix, a directory): what an
/// [`ObjectStore`] needs of its storage.
///
/// Names are relative to the location and may contain `/` (set-aside
/// checkpoints live under `<name>/`).
#[async_trait::async_trait]
pub trait ObjectStorage: Send + Sync + 'static {
    /// The object's bytes, or `None` when there is no object of that name.
    async fn get(&self, name: &str) -> StreamResult<Option<Vec<u8>>>;

    /// Writes the object whole, replacing one of the same name atomically:
    /// a reader sees the old bytes or the new, never a part. Returns once
    /// the object is durable.
    async fn put(&self, name: &str, bytes: Vec<u8>) -> StreamResult<()>;

    /// Deletes the object; a missing one is no error.
    async fn delete(&self, name: &str) -> StreamResult<()>;

    /// Where the objects are (`s3://bucket/prefix`), for messages.
    fn describe(&self) -> String;
}

/// Checkpoint metadata on object storage. See the module docs.
pub struct ObjectStore<S: ObjectStorage> {
    storage: S,
    job_id: JobId,
    retain: usize,
    /// Queues this store's writes: each reads the index, changes it and
    /// writes it back. A tokio mutex, held across the awaits of one write
    /// on purpose: it orders remote writes, it guards no memory.
    writing: tokio::sync::Mutex<()>,
}

impl<S: ObjectStorage> fmt::Debug for ObjectStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectStore")
            .field("location", &self.storage.describe())
            .field("job_id", &self.job_id)
            .field("retain", &self.retain)
            .finish()
    }
}

impl<S: ObjectStorage> ObjectStore<S> {
    /// Opens the store for `job_id` on `storage`, keeping the newest
    /// `retain` checkpoints. Reads the index once, so that unreachable
    /// storage, refused credentials, a damaged index or another job's
    /// checkpoints fail here rather than at the first checkpoint. Writes
    /// nothing.
    pub async fn open(storage: S, job_id: JobId, retain: usize) -> StreamResult<Self> {
        if retain == 0 {
            return Err(StreamError::Config {
                key: "checkpoint.retain",
                message: "must keep at least 1 checkpoint".to_owned(),
            });
        }
        let store = ObjectStore {
            storage,
            job_id,
            retain,
            writing: tokio::sync::Mutex::new(()),
        };
        store.read_index().await?;
        Ok(store)
    }

    /// The newest readable checkpoint of `job_id` on `storage`, read
    /// without writing anything (for `tinyflow inspect`, which may look
    /// while a run writes; it sees the index before or after a write).
    pub async fn peek_latest(
        storage: S,
        job_id: JobId,
    ) -> StreamResult<Option<CompletedCheckpoint>> {
        let store = ObjectStore {
            storage,
            job_id,
            retain: usize::MAX,
            writing: tokio::sync::Mutex::new(()),
        };
        store.latest().await
    }

    /// The storage.
    pub fn storage(&self) -> &S {
        &self.storage
    }

    /// Where the store's objects are, for messages.
    pub fn location(&self) -> String {
        self.storage.describe()
    }

    /// Ids of the checkpoints the index retains, readable or not,
    /// ascending.
    pub async fn list(&self) -> StreamResult<Vec<CheckpointId>> {
        let mut ids = self
            .read_index()
            .await?
            .map(|index| index.retained)
            .unwrap_or_default();
        ids.reverse();
        Ok(ids)
    }

    /// Sets every retained checkpoint aside under `<name>/`, for `tinyflow
    /// reset`: their objects are copied to `<name>/chk-....ckpt` and the
    /// index to `<name>/_index`; then the index is written again with the
    /// same highest id and no checkpoints (from then on
    /// [`latest`](CheckpointStore::latest) is `None`, and ids keep growing
    /// past the ones set aside), and the originals are deleted, best
    /// effort. Nothing set aside is deleted; an object that was missing is
    /// skipped. A crash midway leaves the store as it was (the index is
    /// rewritten only after every copy). `name` is one path segment, not
    /// `_index` and not a checkpoint's name. Returns how many checkpoints
    /// were set aside.
    pub async fn set_aside(&self, name: &str) -> StreamResult<usize> {
        if name.is_empty()
            || name.contains('/')
            || name == "."
            || name == ".."
            || name == INDEX
            || parse_object_name(name).is_some()
        {
            return Err(StreamError::Config {
                key: "checkpoint.dir",
                message: format!(
                    "cannot set checkpoints aside under {name:?} in {}: not a plain name",
                    self.location()
                ),
            });
        }
        let _queued = self.writing.lock().await;
        let Some(index) = self.read_index().await? else {
            return Ok(0);
        };
        let mut moved = Vec::new();
        for &id in &index.retained {
            let object = object_name(id);
            match self.storage.get(&object).await? {
                Some(bytes) => {
                    self.storage.put(&format!("{name}/{object}"), bytes).await?;
                    moved.push(id);
                }
                None => tracing::warn!(
                    object = %self.path(&object),
                    "checkpoint named by the index is missing, nothing to set aside"
                ),
            }
        }
        self.storage
            .put(&format!("{name}/{INDEX}"), index.encode())
            .await?;
        let emptied = Index {
            job_id: index.job_id.clone(),
            highest: index.highest,
            retained: Vec::new(),
        };
        self.storage.put(INDEX, emptied.encode()).await?;
        for id in &moved {
            self.delete_quietly(
                *id,
                "deleting a checkpoint set aside failed; the copy is kept",
            )
            .await;
        }
        Ok(moved.len())
    }

    /// `location/name`, for messages.
    fn path(&self, name: &str) -> String {
        format!("{}/{name}", self.storage.describe().trim_end_matches('/'))
    }

    async fn read_index(&self) -> StreamResult<Option<Index>> {
        let Some(bytes) = self.storage.get(INDEX).await? else {
            return Ok(None);
        };
        let index = Index::decode(&bytes).map_err(|detail| StreamError::Config {
            key: "checkpoint.dir",
            message: format!(
                "{} is not a readable checkpoint index ({detail}): it was changed by something other than tinyflow; restore it, or delete it to start without checkpoints",
                self.path(INDEX)
            ),
        })?;
        if index.job_id != self.job_id {
            return Err(job_mismatch(&self.path(INDEX), &self.job_id, &index.job_id));
        }
        Ok(Some(index))
    }

    async fn delete_quietly(&self, id: CheckpointId, what: &'static str) {
        let object = object_name(id);
        if let Err(e) = self.storage.delete(&object).await {
            let error = tinyflow_api::error_chain(&e);
            tracing::warn!(object = %self.path(&object), error, "{what}");
        }
    }
}

#[async_trait::async_trait]
impl<S: ObjectStorage> CheckpointStore for ObjectStore<S> {
    async fn persist(&self, checkpoint: &CompletedCheckpoint) -> StreamResult<()> {
        if checkpoint.job_id != self.job_id {
            return Err(job_mismatch(
                &self.location(),
                &self.job_id,
                &checkpoint.job_id,
            ));
        }
        let started = tokio::time::Instant::now();
        let bytes = encode(checkpoint);
        let size = bytes.len();
        let id = checkpoint.id;
        let _queued = self.writing.lock().await;
        let old = self.read_index().await?;
        if let Some(old) = &old
            && old.highest >= id
        {
            return Err(StreamError::Config {
                key: "checkpoint.dir",
                message: format!(
                    "checkpoint {id} is not newer than checkpoint {} already in {}: is another job writing here?",
                    old.highest,
                    self.location()
                ),
            });
        }
        let object = object_name(id);
        self.storage.put(&object, bytes).await?;
        let mut retained = vec![id];
        retained.extend(old.map(|o| o.retained).unwrap_or_default());
        let dropped = retained.split_off(self.retain.min(retained.len()));
        let index = Index {
            job_id: self.job_id.clone(),
            highest: id,
            retained,
        };
        // On an error the object stays: the store may have taken the index
        // and only the answer was lost, and then the index names it. An
        // object no index names is never read, and goes with the prefix.
        self.storage.put(INDEX, index.encode()).await?;
        tracing::debug!(
            checkpoint = %id,
            bytes = size,
            object = %self.path(&object),
            write_ms = started.elapsed().as_millis() as u64,
            "checkpoint metadata durable"
        );
        for old in dropped {
            self.delete_quietly(old, "removing an old checkpoint failed")
                .await;
        }
        Ok(())
    }

    async fn latest(&self) -> StreamResult<Option<CompletedCheckpoint>> {
        let Some(index) = self.read_index().await? else {
            return Ok(None);
        };
        for id in index.retained {
            let object = object_name(id);
            let Some(bytes) = self.storage.get(&object).await? else {
                tracing::warn!(object = %self.path(&object), reason = "missing", "skipping unreadable checkpoint, falling back to the previous one");
                continue;
            };
            match decode(&bytes) {
                Ok(cp) if cp.id != id => {
                    let reason = CorruptReason::IdMismatch {
                        in_name: id.get(),
                        in_content: cp.id.get(),
                    };
                    tracing::warn!(object = %self.path(&object), %reason, "skipping unreadable checkpoint, falling back to the previous one");
                }
                Ok(cp) if cp.job_id != self.job_id => {
                    return Err(job_mismatch(&self.path(&object), &self.job_id, &cp.job_id));
                }
                Ok(cp) => return Ok(Some(cp)),
                Err(reason) => {
                    tracing::warn!(object = %self.path(&object), %reason, "skipping unreadable checkpoint, falling back to the previous one");
                }
            }
        }
        Ok(None)
    }

    async fn highest_id(&self) -> StreamResult<Option<CheckpointId>> {
        Ok(self.read_index().await?.map(|index| index.highest))
    }
}

fn job_mismatch(location: &str, expected: &JobId, found: &JobId) -> StreamError {
    StreamError::Config {
        key: "checkpoint.dir",
        message: format!(
            "{location} belongs to job \"{found}\", not \"{expected}\": give each job its own checkpoint location"
        ),
    }
}

/// The object name of checkpoint `id`.
pub fn object_name(id: CheckpointId) -> String {
    format!("{PREFIX}{:020}{SUFFIX}", id.get())
}

fn parse_object_name(name: &str) -> Option<CheckpointId> {
    let digits = name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().map(CheckpointId::new)
}

/// What the index object holds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Index {
    job_id: JobId,
    /// The highest checkpoint id ever written here.
    highest: CheckpointId,
    /// The checkpoints kept, newest first.
    retained: Vec<CheckpointId>,
}

impl Index {
    /// ```text
    /// tinyflow checkpoint index 1
    /// job <job id>
    /// highest <id>
    /// retained <id> <id> ...      (newest first; none after a reset)
    /// end
    /// ```
    fn encode(&self) -> Vec<u8> {
        let retained: String = self
            .retained
            .iter()
            .map(|id| format!(" {}", id.get()))
            .collect();
        format!(
            "{FORMAT_LINE}\njob {}\nhighest {}\nretained{retained}\nend\n",
            self.job_id,
            self.highest.get()
        )
        .into_bytes()
    }

    fn decode(bytes: &[u8]) -> Result<Index, &'static str> {
        let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8")?;
        let mut lines = text.lines();
        if lines.next() != Some(FORMAT_LINE) {
            return Err("unknown format line");
        }
        let job = lines
            .next()
            .and_then(|l| l.strip_prefix("job "))
            .ok_or("no job line")?;
        let job_id = JobId::new(job).map_err(|_| "invalid job id")?;
        let highest = lines
            .next()
            .and_then(|l| l.strip_prefix("highest "))
            .and_then(|n| n.parse().ok())
            .map(CheckpointId::new)
            .ok_or("no highest checkpoint id")?;
        let retained = lines
            .next()
            .and_then(|l| l.strip_prefix("retained"))
            .ok_or("no retained line")?
            .split_ascii_whitespace()
            .map(|n| n.parse().map(CheckpointId::new))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| "a retained id is not a number")?;
        if lines.next() != Some("end") || lines.next().is_some() {
            return Err("truncated, or more after the end line");
        }
        if retained.first().is_some_and(|newest| *newest > highest)
            || retained.windows(2).any(|w| w[0] <= w[1])
        {
            return Err("retained ids out of order");
        }
        Ok(Index {
            job_id,
            highest,
            retained,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashSet};
    use std::sync::{Arc, Mutex};

    use tinyflow_api::TaskId;

    use super::*;
    use crate::StateHandle;

    /// Objects in memory, with puts and deletes that fail when told.
    #[derive(Debug, Clone, Default)]
    struct MemoryObjects {
        state: Arc<Mutex<Objects>>,
    }

    #[derive(Debug, Default)]
    struct Objects {
        objects: BTreeMap<String, Vec<u8>>,
        /// Names whose next put fails.
        fail_put: HashSet<String>,
        /// Names whose next put is done, but answers with an error (a lost
        /// answer).
        lose_answer: HashSet<String>,
        fail_deletes: bool,
    }

    impl MemoryObjects {
        fn lock(&self) -> std::sync::MutexGuard<'_, Objects> {
            self.state.lock().unwrap()
        }

        fn names(&self) -> Vec<String> {
            self.lock().objects.keys().cloned().collect()
        }

        fn set(&self, name: &str, bytes: &[u8]) {
            self.lock().objects.insert(name.to_owned(), bytes.to_vec());
        }

        fn get_now(&self, name: &str) -> Option<Vec<u8>> {
            self.lock().objects.get(name).cloned()
        }
    }

    fn unavailable(name: &str) -> StreamError {
        StreamError::external(
            "object storage",
            "memory",
            format!("writing memory://test/{name}"),
            "injected failure",
            true,
        )
    }

    #[async_trait::async_trait]
    impl ObjectStorage for MemoryObjects {
        async fn get(&self, name: &str) -> StreamResult<Option<Vec<u8>>> {
            Ok(self.get_now(name))
        }

        async fn put(&self, name: &str, bytes: Vec<u8>) -> StreamResult<()> {
            let mut st = self.lock();
            if st.fail_put.remove(name) {
                return Err(unavailable(name));
            }
            st.objects.insert(name.to_owned(), bytes);
            if st.lose_answer.remove(name) {
                return Err(unavailable(name));
            }
            Ok(())
        }

        async fn delete(&self, name: &str) -> StreamResult<()> {
            let mut st = self.lock();
            if st.fail_deletes {
                return Err(unavailable(name));
            }
            st.objects.remove(name);
            Ok(())
        }

        fn describe(&self) -> String {
            "memory://test".to_owned()
        }
    }

    fn job(name: &str) -> JobId {
        JobId::new(name).unwrap()
    }

    fn checkpoint(job_id: &JobId, id: u64) -> CompletedCheckpoint {
        CompletedCheckpoint {
            job_id: job_id.clone(),
            id: CheckpointId::new(id),
            triggered_at_ms: 1_000 * id,
            acked_at_ms: 1_000 * id + 10,
            is_final: false,
            task_states: [(
                TaskId::new(0),
                StateHandle::from(format!("state {id}").into_bytes()),
            )]
            .into_iter()
            .collect(),
        }
    }

    async fn store(objects: &MemoryObjects, retain: usize) -> ObjectStore<MemoryObjects> {
        ObjectStore::open(objects.clone(), job("j"), retain)
            .await
            .unwrap()
    }

    async fn persist_ids(store: &ObjectStore<MemoryObjects>, ids: impl IntoIterator<Item = u64>) {
        for id in ids {
            store.persist(&checkpoint(&job("j"), id)).await.unwrap();
        }
    }

    fn ids(raw: &[u64]) -> Vec<CheckpointId> {
        raw.iter().copied().map(CheckpointId::new).collect()
    }

    #[test]
    fn the_index_round_trips_and_damage_is_detected() {
        let index = Index {
            job_id: job("j"),
            highest: CheckpointId::new(12),
            retained: ids(&[12, 11, 9]),
        };
        assert_eq!(Index::decode(&index.encode()), Ok(index.clone()));
        let empty = Index {
            retained: Vec::new(),
            ..index.clone()
        };
        assert_eq!(Index::decode(&empty.encode()), Ok(empty));
        let bytes = index.encode();
        // Every cut short of the whole object is refused: none reads as a
        // smaller highest id or fewer checkpoints.
        for cut in 0..bytes.len() - 1 {
            assert!(
                Index::decode(&bytes[..cut]).is_err(),
                "cut at {cut} decoded"
            );
        }
        let unordered = Index {
            retained: ids(&[9, 11]),
            ..index
        };
        assert!(Index::decode(&unordered.encode()).is_err());
    }

    #[tokio::test]
    async fn retention_keeps_the_newest_and_deletes_the_rest() {
        let objects = MemoryObjects::default();
        let store = store(&objects, 3).await;
        assert_eq!(store.latest().await.unwrap(), None);
        assert_eq!(store.highest_id().await.unwrap(), None);
        persist_ids(&store, 1..=5).await;
        assert_eq!(store.list().await.unwrap(), ids(&[3, 4, 5]));
        assert_eq!(
            objects.names(),
            [
                INDEX.to_owned(),
                object_name(CheckpointId::new(3)),
                object_name(CheckpointId::new(4)),
                object_name(CheckpointId::new(5)),
            ]
        );
        assert_eq!(
            store.latest().await.unwrap(),
            Some(checkpoint(&job("j"), 5))
        );
        assert_eq!(
            store.highest_id().await.unwrap(),
            Some(CheckpointId::new(5))
        );
        // Ids only grow.
        let e = store.persist(&checkpoint(&job("j"), 5)).await.unwrap_err();
        assert!(e.to_string().contains("not newer"), "{e}");
    }

    #[tokio::test]
    async fn a_reopened_store_continues_where_the_last_left_off() {
        let objects = MemoryObjects::default();
        persist_ids(&store(&objects, 2).await, [1, 2, 3]).await;
        let again = store(&objects, 2).await;
        assert_eq!(
            again.latest().await.unwrap(),
            Some(checkpoint(&job("j"), 3))
        );
        assert_eq!(
            again.highest_id().await.unwrap(),
            Some(CheckpointId::new(3))
        );
        persist_ids(&again, [4]).await;
        assert_eq!(again.list().await.unwrap(), ids(&[3, 4]));
        assert_eq!(
            ObjectStore::peek_latest(objects.clone(), job("j"))
                .await
                .unwrap()
                .map(|cp| cp.id),
            Some(CheckpointId::new(4))
        );
    }

    #[tokio::test]
    async fn latest_falls_back_past_damaged_and_missing_objects() {
        let objects = MemoryObjects::default();
        let store = store(&objects, 4).await;
        persist_ids(&store, 1..=4).await;
        let newest = object_name(CheckpointId::new(4));
        let mut flipped = objects.get_now(&newest).unwrap();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x01;
        objects.set(&newest, &flipped);
        objects
            .lock()
            .objects
            .remove(&object_name(CheckpointId::new(3)));
        // Checkpoint 2's object holds checkpoint 1: its name and content disagree.
        let one = objects.get_now(&object_name(CheckpointId::new(1))).unwrap();
        objects.set(&object_name(CheckpointId::new(2)), &one);
        assert_eq!(
            store.latest().await.unwrap(),
            Some(checkpoint(&job("j"), 1))
        );
        assert_eq!(
            store.highest_id().await.unwrap(),
            Some(CheckpointId::new(4)),
            "damaged checkpoints still count for ids"
        );
        objects.set(&object_name(CheckpointId::new(1)), b"garbage");
        assert_eq!(store.latest().await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_failed_put_leaves_latest_at_the_previous_checkpoint() {
        let objects = MemoryObjects::default();
        let store = store(&objects, 2).await;
        persist_ids(&store, [1, 2]).await;

        // The checkpoint's own object cannot be written.
        let three = object_name(CheckpointId::new(3));
        objects.lock().fail_put.insert(three.clone());
        assert!(store.persist(&checkpoint(&job("j"), 3)).await.is_err());
        assert_eq!(store.latest().await.unwrap().unwrap().id.get(), 2);
        assert_eq!(
            store.highest_id().await.unwrap(),
            Some(CheckpointId::new(2))
        );

        // The object is written, the index is not: the object stays (the
        // index might name it, had only the answer been lost), unnamed.
        objects.lock().fail_put.insert(INDEX.to_owned());
        let e = store.persist(&checkpoint(&job("j"), 3)).await.unwrap_err();
        assert!(e.is_retryable(), "{e}");
        assert_eq!(store.latest().await.unwrap().unwrap().id.get(), 2);
        assert_eq!(store.list().await.unwrap(), ids(&[1, 2]));
        assert!(objects.get_now(&three).is_some());

        // Deletes that fail lose nothing but space.
        objects.lock().fail_deletes = true;
        persist_ids(&store, [3, 4]).await;
        assert_eq!(store.latest().await.unwrap().unwrap().id.get(), 4);
        assert_eq!(store.list().await.unwrap(), ids(&[3, 4]));
        assert!(
            objects
                .get_now(&object_name(CheckpointId::new(1)))
                .is_some()
        );
    }

    /// The index was written but its answer lost: `persist` fails, yet
    /// the index names the checkpoint, and its object is there to restore
    /// (never deleted on the error), also with one checkpoint retained.
    #[tokio::test]
    async fn an_index_written_whose_answer_was_lost_names_a_checkpoint_that_is_there() {
        let objects = MemoryObjects::default();
        let store = ObjectStore::open(objects.clone(), job("j"), 1)
            .await
            .unwrap();
        persist_ids(&store, [1, 2]).await;
        objects.lock().lose_answer.insert(INDEX.to_owned());
        assert!(store.persist(&checkpoint(&job("j"), 3)).await.is_err());
        assert_eq!(store.latest().await.unwrap().unwrap().id.get(), 3);
        assert_eq!(store.list().await.unwrap(), ids(&[3]));
        persist_ids(&store, [4]).await;
        assert_eq!(store.latest().await.unwrap().unwrap().id.get(), 4);
    }

    #[tokio::test]
    async fn set_aside_empties_the_store_but_ids_keep_growing() {
        let objects = MemoryObjects::default();
        let store = store(&objects, 3).await;
        assert_eq!(store.set_aside("reset-1").await.unwrap(), 0, "nothing yet");
        persist_ids(&store, 1..=4).await;
        assert_eq!(store.set_aside("reset-2").await.unwrap(), 3);
        assert_eq!(store.latest().await.unwrap(), None);
        assert_eq!(store.list().await.unwrap(), Vec::<CheckpointId>::new());
        assert_eq!(
            store.highest_id().await.unwrap(),
            Some(CheckpointId::new(4))
        );
        assert_eq!(
            objects.names(),
            [
                INDEX.to_owned(),
                format!("reset-2/{INDEX}"),
                format!("reset-2/{}", object_name(CheckpointId::new(2))),
                format!("reset-2/{}", object_name(CheckpointId::new(3))),
                format!("reset-2/{}", object_name(CheckpointId::new(4))),
            ]
        );
        // What was set aside reads back as a store of its own.
        let aside = Index::decode(&objects.get_now(&format!("reset-2/{INDEX}")).unwrap()).unwrap();
        assert_eq!(aside.retained, ids(&[4, 3, 2]));
        let e = store.persist(&checkpoint(&job("j"), 4)).await.unwrap_err();
        assert!(e.to_string().contains("not newer"), "{e}");
        persist_ids(&store, [5]).await;
        assert_eq!(store.latest().await.unwrap().unwrap().id.get(), 5);
        for bad in ["", "a/b", INDEX, "..", &object_name(CheckpointId::new(9))] {
            assert!(store.set_aside(bad).await.is_err(), "{bad:?} accepted");
        }
    }

    #[tokio::test]
    async fn another_jobs_checkpoints_are_an_error() {
        let objects = MemoryObjects::default();
        persist_ids(&store(&objects, 3).await, [1]).await;
        let e = ObjectStore::open(objects.clone(), job("other"), 3)
            .await
            .unwrap_err();
        assert!(
            !e.is_retryable() && e.to_string().contains("belongs to job \"j\""),
            "{e}"
        );
        let ours = store(&objects, 3).await;
        let e = ours
            .persist(&checkpoint(&job("other"), 2))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("belongs to job"), "{e}");
        // A checkpoint object of another job under an index of ours.
        objects.set(
            &object_name(CheckpointId::new(1)),
            &encode(&checkpoint(&job("other"), 1)),
        );
        let e = ours.latest().await.unwrap_err();
        assert!(e.to_string().contains("belongs to job \"other\""), "{e}");
    }

    #[tokio::test]
    async fn a_damaged_index_and_zero_retention_are_errors() {
        let objects = MemoryObjects::default();
        objects.set(INDEX, b"tinyflow checkpoint index 1\njob j\nhighest 3\n");
        let e = ObjectStore::open(objects.clone(), job("j"), 3)
            .await
            .unwrap_err();
        assert!(
            !e.is_retryable() && e.to_string().contains("memory://test/_index"),
            "{e}"
        );
        let e = ObjectStore::open(MemoryObjects::default(), job("j"), 0)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("checkpoint.retain"), "{e}");
    }
}
