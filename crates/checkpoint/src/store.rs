//! A [`CheckpointStore`] in a local directory.
//!
//! One file per completed checkpoint, `chk-<id, 20 digits>.ckpt`, written
//! atomically: the bytes go to a hidden temporary file, which is fsynced,
//! renamed into place, and the directory is fsynced. A crash at any point
//! leaves either the whole file or none of it under its final name; stale
//! temporary files are removed when the store is opened.
//!
//! Each file carries a header (magic, format version, payload length, CRC-32
//! of the payload). Reading the newest checkpoint skips a truncated or
//! corrupt file with a warning and falls back to the previous one. Only the
//! newest `retain` files are kept. One job, one directory, one writer: an
//! open store holds an exclusive lock on `<dir>/.lock` (`flock`, released
//! by the kernel when the process dies, however it dies), so a second
//! process of the job is turned away at start with a [`StreamError::Fenced`]
//! that names the holder, rather than writing checkpoints under the same
//! ids. The lock is local: a directory on NFS, or a job run on two machines
//! with a directory each, is fenced by its sinks (the Iceberg sink's epoch).
//!
//! File layout, all integers little-endian:
//!
//! ```text
//! magic "TFCKPT\r\n" (8) | version u32 | payload length u64 | crc32 u32 | payload
//! payload: job id (u16 length + bytes) | id u64 | triggered_at_ms u64 |
//!          acked_at_ms u64 | is_final u8 | task count u32 |
//!          per task: task id u32 | state length u64 | state bytes
//! ```

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tinyflow_api::{CheckpointId, JobId, StreamError, StreamResult, TaskId};

use crate::CorruptReason;

use crate::{CheckpointStore, CompletedCheckpoint, StateHandle};

const MAGIC: &[u8; 8] = b"TFCKPT\r\n";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 8 + 4 + 8 + 4;
const PREFIX: &str = "chk-";
const SUFFIX: &str = ".ckpt";
const TMP_PREFIX: &str = ".tmp-chk-";

/// Checkpoint metadata files in a local directory. See the module docs.
#[derive(Debug, Clone)]
pub struct LocalDirStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    job_id: JobId,
    retain: usize,
    /// The open lock file; its lock lasts as long as the store.
    lock: std::sync::OnceLock<File>,
}

/// The lock file's name in the checkpoint directory.
pub const LOCK_FILE: &str = ".lock";

impl LocalDirStore {
    /// Opens (creating if needed) the store for `job_id` in `dir`, keeping
    /// the newest `retain` checkpoints, and removes temporary files a crash
    /// left behind.
    pub async fn open(dir: impl Into<PathBuf>, job_id: JobId, retain: usize) -> StreamResult<Self> {
        if retain == 0 {
            return Err(StreamError::Config {
                key: "checkpoint.retain",
                message: "must keep at least 1 checkpoint".to_owned(),
            });
        }
        let inner = Arc::new(Inner {
            dir: dir.into(),
            job_id,
            retain,
            lock: std::sync::OnceLock::new(),
        });
        let opened = Arc::clone(&inner);
        blocking(move || opened.open()).await?;
        Ok(LocalDirStore { inner })
    }

    /// Who holds the directory's lock now (`pid N on HOST since
    /// UNIX-SECONDS`), or
    /// `None` when no process does; for tools that must not act while a
    /// run holds the job (`tinyflow reset`), and for `tinyflow inspect`.
    pub fn holder(dir: &Path) -> io::Result<Option<String>> {
        let path = dir.join(LOCK_FILE);
        let file = match fs::OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        match file.try_lock() {
            Ok(()) => Ok(None),
            Err(fs::TryLockError::WouldBlock) => Ok(Some(read_holder(&path))),
            Err(fs::TryLockError::Error(e)) => Err(e),
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Ids of the checkpoint files present, readable or not, ascending.
    pub async fn list(&self) -> StreamResult<Vec<CheckpointId>> {
        let inner = Arc::clone(&self.inner);
        blocking(move || inner.list()).await
    }

    /// The newest readable checkpoint of `job_id` in `dir`, read without
    /// taking the directory's lock or changing anything in it (for tools
    /// that only look while a run may hold the directory: `tinyflow
    /// inspect`).
    pub fn peek_latest(dir: &Path, job_id: JobId) -> StreamResult<Option<CompletedCheckpoint>> {
        if !dir.is_dir() {
            return Ok(None);
        }
        let inner = Inner {
            dir: dir.to_owned(),
            job_id,
            retain: usize::MAX,
            lock: std::sync::OnceLock::new(),
        };
        inner.latest()
    }

    /// Moves every checkpoint file into the subdirectory `name` (created),
    /// for `tinyflow reset`: nothing is deleted, and the next run starts
    /// without a checkpoint. Returns how many files moved.
    pub async fn set_aside(&self, name: &str) -> StreamResult<usize> {
        let inner = Arc::clone(&self.inner);
        let name = name.to_owned();
        blocking(move || {
            let to = inner.dir.join(&name);
            fs::create_dir_all(&to).map_err(io_err("creating", &to))?;
            let mut moved = 0;
            for id in inner.list()? {
                let from = inner.dir.join(file_name(id));
                let target = to.join(file_name(id));
                fs::rename(&from, &target)
                    .map_err(io_err("moving a checkpoint file to", &target))?;
                moved += 1;
            }
            sync_dir(&to).map_err(io_err("syncing", &to))?;
            sync_dir(&inner.dir).map_err(io_err("syncing checkpoint directory", &inner.dir))?;
            Ok(moved)
        })
        .await
    }

    /// The path of checkpoint `id`'s file.
    pub fn path_of(&self, id: CheckpointId) -> PathBuf {
        self.inner.dir.join(file_name(id))
    }
}

#[async_trait::async_trait]
impl CheckpointStore for LocalDirStore {
    async fn persist(&self, checkpoint: &CompletedCheckpoint) -> StreamResult<()> {
        if checkpoint.job_id != self.inner.job_id {
            return Err(job_mismatch(
                &self.inner.dir,
                &self.inner.job_id,
                &checkpoint.job_id,
            ));
        }
        let bytes = encode(checkpoint);
        let id = checkpoint.id;
        let inner = Arc::clone(&self.inner);
        blocking(move || inner.persist(id, &bytes)).await
    }

    async fn latest(&self) -> StreamResult<Option<CompletedCheckpoint>> {
        let inner = Arc::clone(&self.inner);
        blocking(move || inner.latest()).await
    }

    async fn highest_id(&self) -> StreamResult<Option<CheckpointId>> {
        Ok(self.list().await?.last().copied())
    }
}

impl Inner {
    fn open(&self) -> StreamResult<()> {
        if !self.dir.is_dir() {
            fs::create_dir_all(&self.dir)
                .map_err(io_err("creating checkpoint directory", &self.dir))?;
            // Make the new directory entry itself durable.
            if let Some(parent) = self.dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                sync_dir(parent)
                    .map_err(io_err("syncing parent of checkpoint directory", parent))?;
            }
        }
        self.lock()?;
        for entry in read_dir(&self.dir)? {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with(TMP_PREFIX) {
                let path = entry.path();
                tracing::warn!(path = %path.display(), "removing temporary checkpoint file left by a crash");
                fs::remove_file(&path).map_err(io_err("removing stale temporary file", &path))?;
            }
        }
        Ok(())
    }

    /// Takes the directory's lock, or says who holds it.
    fn lock(&self) -> StreamResult<()> {
        let path = self.dir.join(LOCK_FILE);
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err("opening the lock file", &path))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(StreamError::Fenced {
                    operator: "checkpoint store".to_owned(),
                    message: format!(
                        "{} is in use by another run of job {} ({}): one directory, one run; stop that run first, or give this one its own checkpoint.dir",
                        self.dir.display(),
                        self.job_id,
                        read_holder(&path)
                    ),
                });
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(io_err("locking", &path)(e));
            }
        }
        // Who holds it, for the message a second run gets. Best effort:
        // the lock itself is what counts.
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let holder = format!("{} since {since}", tinyflow_api::util::this_process());
        let wrote = file
            .set_len(0)
            .and_then(|()| io::Seek::rewind(&mut file))
            .and_then(|()| file.write_all(holder.as_bytes()));
        if let Err(e) = wrote {
            tracing::debug!(path = %path.display(), error = %e, "could not note the lock's holder");
        }
        // Only `open` calls this, once per store.
        let _ = self.lock.set(file);
        Ok(())
    }

    fn list(&self) -> StreamResult<Vec<CheckpointId>> {
        let mut ids: Vec<_> = read_dir(&self.dir)?
            .into_iter()
            .filter_map(|e| e.file_name().to_str().and_then(parse_file_name))
            .collect();
        ids.sort_unstable();
        Ok(ids)
    }

    fn persist(&self, id: CheckpointId, bytes: &[u8]) -> StreamResult<()> {
        let started = Instant::now();
        // Ids only grow: a lower one would be deleted by retention at once, or
        // be shadowed by a newer file on restore.
        if let Some(newest) = self.list()?.last()
            && *newest >= id
        {
            return Err(StreamError::Config {
                key: "checkpoint.dir",
                message: format!(
                    "checkpoint {id} is not newer than checkpoint {newest} already in {}: is another job writing here?",
                    self.dir.display()
                ),
            });
        }
        let tmp = self
            .dir
            .join(format!("{TMP_PREFIX}{:020}{SUFFIX}", id.get()));
        let target = self.dir.join(file_name(id));
        let written =
            write_synced(&tmp, bytes).map_err(io_err("writing checkpoint metadata to", &tmp));
        if let Err(e) = written {
            remove_quietly(&tmp);
            return Err(e);
        }
        if let Err(e) = fs::rename(&tmp, &target) {
            remove_quietly(&tmp);
            return Err(io_err(
                "renaming checkpoint metadata into place at",
                &target,
            )(e));
        }
        if let Err(e) = sync_dir(&self.dir) {
            // Not known durable: take it back so no reader relies on it.
            remove_quietly(&target);
            return Err(io_err("syncing checkpoint directory", &self.dir)(e));
        }
        tracing::debug!(
            checkpoint = %id,
            bytes = bytes.len(),
            path = %target.display(),
            write_ms = started.elapsed().as_millis() as u64,
            "checkpoint metadata durable"
        );
        self.apply_retention();
        Ok(())
    }

    /// Deletes all but the newest `retain` files. Failures only warn: the
    /// new checkpoint is durable already, and a leftover file is harmless.
    fn apply_retention(&self) {
        let ids = match self.list() {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(error = %e, "listing checkpoints for retention failed");
                return;
            }
        };
        let excess = ids.len().saturating_sub(self.retain);
        for id in &ids[..excess] {
            let path = self.dir.join(file_name(*id));
            if let Err(e) = fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), error = %e, "removing an old checkpoint failed");
            }
        }
    }

    fn latest(&self) -> StreamResult<Option<CompletedCheckpoint>> {
        for id in self.list()?.into_iter().rev() {
            let path = self.dir.join(file_name(id));
            let bytes = match fs::read(&path) {
                Ok(b) => b,
                // Removed by retention between listing and reading.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("reading checkpoint metadata from", &path)(e)),
            };
            match decode(&bytes) {
                Ok(cp) if cp.id != id => {
                    let reason = CorruptReason::IdMismatch {
                        in_name: id.get(),
                        in_content: cp.id.get(),
                    };
                    tracing::warn!(path = %path.display(), %reason, "skipping unreadable checkpoint, falling back to the previous one");
                }
                Ok(cp) if cp.job_id != self.job_id => {
                    return Err(job_mismatch(&path, &self.job_id, &cp.job_id));
                }
                Ok(cp) => return Ok(Some(cp)),
                Err(reason) => {
                    tracing::warn!(path = %path.display(), %reason, "skipping unreadable checkpoint, falling back to the previous one");
                }
            }
        }
        Ok(None)
    }
}

fn job_mismatch(path: &Path, expected: &JobId, found: &JobId) -> StreamError {
    StreamError::Config {
        key: "checkpoint.dir",
        message: format!(
            "{} belongs to job {found:?}, not {expected:?}: give each job its own checkpoint directory",
            path.display()
        ),
    }
}

/// What the holder of a lock file wrote into it.
fn read_holder(path: &Path) -> String {
    match fs::read_to_string(path) {
        Ok(text) if !text.trim().is_empty() => text.trim().to_owned(),
        _ => "holder unknown".to_owned(),
    }
}

fn file_name(id: CheckpointId) -> String {
    format!("{PREFIX}{:020}{SUFFIX}", id.get())
}

fn parse_file_name(name: &str) -> Option<CheckpointId> {
    let digits = name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().map(CheckpointId::new)
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn remove_quietly(path: &Path) {
    if let Err(e) = fs::remove_file(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), error = %e, "could not remove file after a failed write");
    }
}

fn read_dir(dir: &Path) -> StreamResult<Vec<fs::DirEntry>> {
    fs::read_dir(dir)
        .and_then(|it| it.collect::<io::Result<Vec<_>>>())
        .map_err(io_err("listing checkpoint directory", dir))
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StreamError + 'a {
    move |source| StreamError::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> StreamResult<T> + Send + 'static,
) -> StreamResult<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result,
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        // Only a runtime shutting down cancels a blocking task.
        Err(join) => Err(StreamError::Io {
            action: "running blocking file operation in",
            path: PathBuf::new(),
            source: io::Error::other(join),
        }),
    }
}

/// Serialises a checkpoint into the file format described in the module docs.
pub fn encode(cp: &CompletedCheckpoint) -> Vec<u8> {
    let job = cp.job_id.as_str().as_bytes();
    let mut payload =
        Vec::with_capacity(64 + job.len() + cp.state_bytes() + cp.task_states.len() * 12);
    // Job ids are at most 128 bytes (validated by `JobId`).
    payload.extend_from_slice(&u16::try_from(job.len()).unwrap_or(u16::MAX).to_le_bytes());
    payload.extend_from_slice(job);
    payload.extend_from_slice(&cp.id.get().to_le_bytes());
    payload.extend_from_slice(&cp.triggered_at_ms.to_le_bytes());
    payload.extend_from_slice(&cp.acked_at_ms.to_le_bytes());
    payload.push(u8::from(cp.is_final));
    let tasks = u32::try_from(cp.task_states.len()).expect("more than u32::MAX tasks");
    payload.extend_from_slice(&tasks.to_le_bytes());
    for (task, state) in &cp.task_states {
        payload.extend_from_slice(&task.get().to_le_bytes());
        payload.extend_from_slice(&(state.len() as u64).to_le_bytes());
        payload.extend_from_slice(state.as_bytes());
    }
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Parses and verifies a file written by [`encode`].
pub fn decode(bytes: &[u8]) -> Result<CompletedCheckpoint, CorruptReason> {
    let mut r = Reader(bytes);
    if r.take(8).ok() != Some(&MAGIC[..]) {
        return Err(CorruptReason::BadMagic);
    }
    let truncated_header = || CorruptReason::Truncated {
        expected: HEADER_LEN as u64,
        found: bytes.len() as u64,
    };
    let version = r.u32().map_err(|_| truncated_header())?;
    if version != VERSION {
        return Err(CorruptReason::UnsupportedVersion { found: version });
    }
    let len = r.u64().map_err(|_| truncated_header())?;
    let expected = r.u32().map_err(|_| truncated_header())?;
    let found = r.0.len() as u64;
    if found > len {
        return Err(CorruptReason::Malformed {
            detail: "file is longer than its header says",
        });
    }
    if found < len {
        return Err(CorruptReason::Truncated {
            expected: HEADER_LEN as u64 + len,
            found: HEADER_LEN as u64 + found,
        });
    }
    let actual = crc32fast::hash(r.0);
    if actual != expected {
        return Err(CorruptReason::ChecksumMismatch { expected, actual });
    }
    let job_len = r.u16()?;
    let job = std::str::from_utf8(r.take(usize::from(job_len))?).map_err(|_| {
        CorruptReason::Malformed {
            detail: "job id is not UTF-8",
        }
    })?;
    let job_id = JobId::new(job).map_err(|_| CorruptReason::Malformed {
        detail: "invalid job id",
    })?;
    let id = CheckpointId::new(r.u64()?);
    let triggered_at_ms = r.u64()?;
    let acked_at_ms = r.u64()?;
    let is_final = match r.take(1)?[0] {
        0 => false,
        1 => true,
        _ => {
            return Err(CorruptReason::Malformed {
                detail: "is_final flag is neither 0 nor 1",
            });
        }
    };
    let tasks = r.u32()?;
    let mut task_states = BTreeMap::new();
    for _ in 0..tasks {
        let task = TaskId::new(r.u32()?);
        let len = usize::try_from(r.u64()?).map_err(|_| CorruptReason::Malformed {
            detail: "state length",
        })?;
        let state = StateHandle::from(r.take(len)?);
        if task_states.insert(task, state).is_some() {
            return Err(CorruptReason::Malformed {
                detail: "task listed twice",
            });
        }
    }
    if !r.0.is_empty() {
        return Err(CorruptReason::Malformed {
            detail: "trailing bytes after the last task",
        });
    }
    Ok(CompletedCheckpoint {
        job_id,
        id,
        triggered_at_ms,
        acked_at_ms,
        is_final,
        task_states,
    })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CorruptReason> {
        if self.0.len() < n {
            return Err(CorruptReason::Malformed {
                detail: "a field runs past the end of the payload",
            });
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], CorruptReason> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u16(&mut self) -> Result<u16, CorruptReason> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, CorruptReason> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, CorruptReason> {
        self.array().map(u64::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CompletedCheckpoint {
        CompletedCheckpoint {
            job_id: JobId::new("job").unwrap(),
            id: CheckpointId::new(7),
            triggered_at_ms: 1_000,
            acked_at_ms: 1_250,
            is_final: true,
            task_states: [
                (TaskId::new(0), StateHandle::from(b"a".to_vec())),
                (TaskId::new(5), StateHandle::empty()),
            ]
            .into_iter()
            .collect(),
        }
    }

    #[test]
    fn encoding_round_trips() {
        let cp = sample();
        assert_eq!(decode(&encode(&cp)).unwrap(), cp);
    }

    #[test]
    fn every_truncation_and_bit_flip_is_detected() {
        let bytes = encode(&sample());
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "truncated at {cut} decoded");
        }
        for at in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[at] ^= 0x10;
            assert!(decode(&flipped).is_err(), "flip at {at} decoded");
        }
    }

    #[test]
    fn file_names_sort_by_id_and_parse_back() {
        assert_eq!(
            parse_file_name(&file_name(CheckpointId::new(42))),
            Some(CheckpointId::new(42))
        );
        assert!(file_name(CheckpointId::new(9)) < file_name(CheckpointId::new(10)));
        assert_eq!(parse_file_name("chk-1.ckpt"), None);
        assert_eq!(parse_file_name(".tmp-chk-00000000000000000001.ckpt"), None);
    }
}
