//! Local-file storage for a `file://` warehouse that keeps the runtime's
//! worker threads free and makes every file it writes durable.
//!
//! iceberg's `LocalFsStorage` does its file I/O inline in `async fn`s: the
//! `fsync` of every data file a writer closes on a barrier, and of every
//! manifest a commit writes, blocks a tokio worker, and with two workers two
//! such syncs stall every task of the job until the disk answers. And its
//! one-shot `write` (table metadata files) does not sync at all, so after a
//! machine crash a catalog could point at metadata the disk never got.
//!
//! [`SyncedLocalStorage`] writes on tokio's blocking pool instead, and syncs
//! each file it wrote, and then its directory (a new file's name is only
//! durable once its directory is), before the write counts as done. Reads,
//! existence checks and deletes are rare and short; they go to iceberg's
//! storage as they are.
//!
//! The sink's writers get one more twist: closing a data file starts its
//! sync and returns, and the sync joins the sink's [`PendingSyncs`]. The
//! committer waits for all of them before it acks a checkpoint, so a
//! checkpoint never names a file the disk may not have, while the writers
//! go on encoding the next records during the sync. A data file's sync
//! takes tens of milliseconds (`docs/performance.md`), time in which a
//! writer with the sync on its path would stand still.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures_util::stream::BoxStream;
use iceberg::io::{
    FileMetadata, FileRead, FileWrite, InputFile, LocalFsStorage, OutputFile, Storage,
    StorageConfig, StorageFactory,
};
use iceberg::{Error, ErrorKind};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

/// Builds [`SyncedLocalStorage`]; the catalog's storage for a `file://`
/// warehouse, and with `defer` the sink writers'.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct SyncedLocalStorageFactory {
    /// Where closed files' syncs go instead of being awaited.
    #[serde(skip)]
    pub(crate) defer: Option<Arc<PendingSyncs>>,
}

#[typetag::serde(name = "tinyflow-synced-local")]
impl StorageFactory for SyncedLocalStorageFactory {
    fn build(&self, _config: &StorageConfig) -> iceberg::Result<Arc<dyn Storage>> {
        Ok(Arc::new(SyncedLocalStorage {
            inner: LocalFsStorage::new(),
            defer: self.defer.clone(),
        }))
    }
}

/// Local files, written off the runtime's workers and synced; see the
/// module documentation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct SyncedLocalStorage {
    inner: LocalFsStorage,
    #[serde(skip)]
    defer: Option<Arc<PendingSyncs>>,
}

type Sync = (PathBuf, JoinHandle<iceberg::Result<()>>);

/// The syncs of files closed but maybe not yet durable.
#[derive(Debug, Default)]
pub(crate) struct PendingSyncs {
    pending: std::sync::Mutex<Vec<Sync>>,
}

impl PendingSyncs {
    pub(crate) fn push(&self, path: PathBuf, sync: JoinHandle<iceberg::Result<()>>) {
        self.lock().push((path, sync));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Sync>> {
        // A panic elsewhere while holding the lock leaves a usable list.
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits until at most `room` syncs are still running (each holds its
    /// file open). It takes none of them: the committer's [`Self::wait`]
    /// still awaits every one, and reports a failed one, before the
    /// checkpoint that names the file completes.
    pub(crate) async fn wait_until(&self, room: usize) {
        loop {
            let running = self.lock().iter().filter(|(_, s)| !s.is_finished()).count();
            if running <= room {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// Waits until every file closed so far is durable; returns how many
    /// syncs it waited for, or the first that failed (a failed sync names
    /// its file).
    pub(crate) async fn wait(&self) -> iceberg::Result<usize> {
        let pending = std::mem::take(&mut *self.lock());
        let count = pending.len();
        let mut first_error = None;
        for (path, sync) in pending {
            let result = sync.await.map_err(|e| {
                Error::new(
                    ErrorKind::Unexpected,
                    format!(
                        "syncing {} on the blocking pool failed: {e}",
                        path.display()
                    ),
                )
            });
            if let Err(e) | Ok(Err(e)) = result {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(count), Err)
    }
}

/// The file system path of a `file:` location or a plain path (the same
/// reading as iceberg's local storage).
pub(crate) fn local_path(location: &str) -> PathBuf {
    let rest = location
        .strip_prefix("file://")
        .or_else(|| location.strip_prefix("file:"));
    match rest {
        Some(r) if r.starts_with('/') => PathBuf::from(r),
        Some(r) => PathBuf::from(format!("/{r}")),
        None => PathBuf::from(location),
    }
}

fn io_error(action: &str, path: &Path, e: &std::io::Error) -> Error {
    Error::new(
        ErrorKind::Unexpected,
        format!("{action} {}: {e}", path.display()),
    )
}

/// Runs blocking file work on tokio's blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> iceberg::Result<T> + Send + 'static,
) -> iceberg::Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        Error::new(
            ErrorKind::Unexpected,
            format!("a file operation on the blocking pool failed: {e}"),
        )
    })?
}

fn create(path: &Path) -> iceberg::Result<fs::File> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(|e| io_error("creating the directory", parent, &e))?;
    }
    fs::File::create(path).map_err(|e| io_error("creating", path, &e))
}

/// Syncs a file's data and then its directory entry.
fn sync(file: &fs::File, path: &Path) -> iceberg::Result<()> {
    file.sync_all().map_err(|e| io_error("syncing", path, &e))?;
    if let Some(parent) = path.parent() {
        fs::File::open(parent)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_error("syncing the directory", parent, &e))?;
    }
    Ok(())
}

#[async_trait::async_trait]
#[typetag::serde(name = "tinyflow-synced-local-storage")]
impl Storage for SyncedLocalStorage {
    async fn exists(&self, path: &str) -> iceberg::Result<bool> {
        self.inner.exists(path).await
    }

    async fn metadata(&self, path: &str) -> iceberg::Result<FileMetadata> {
        self.inner.metadata(path).await
    }

    async fn read(&self, path: &str) -> iceberg::Result<Bytes> {
        self.inner.read(path).await
    }

    async fn reader(&self, path: &str) -> iceberg::Result<Box<dyn FileRead>> {
        self.inner.reader(path).await
    }

    async fn write(&self, path: &str, bs: Bytes) -> iceberg::Result<()> {
        let path = local_path(path);
        blocking(move || {
            let mut file = create(&path)?;
            file.write_all(&bs)
                .map_err(|e| io_error("writing", &path, &e))?;
            sync(&file, &path)
        })
        .await
    }

    async fn writer(&self, path: &str) -> iceberg::Result<Box<dyn FileWrite>> {
        let path = local_path(path);
        let (file, path) = blocking(move || Ok((create(&path)?, path))).await?;
        Ok(Box::new(SyncedFileWrite {
            file: Some(file),
            path,
            defer: self.defer.clone(),
        }))
    }

    async fn delete(&self, path: &str) -> iceberg::Result<()> {
        self.inner.delete(path).await
    }

    async fn delete_prefix(&self, path: &str) -> iceberg::Result<()> {
        self.inner.delete_prefix(path).await
    }

    async fn delete_stream(&self, paths: BoxStream<'static, String>) -> iceberg::Result<()> {
        self.inner.delete_stream(paths).await
    }

    fn new_input(&self, path: &str) -> iceberg::Result<InputFile> {
        Ok(InputFile::new(Arc::new(self.clone()), path.to_owned()))
    }

    fn new_output(&self, path: &str) -> iceberg::Result<OutputFile> {
        Ok(OutputFile::new(Arc::new(self.clone()), path.to_owned()))
    }
}

/// A file being written: each write (a Parquet row group, a manifest) goes
/// to the blocking pool with the file, which comes back with the result.
struct SyncedFileWrite {
    /// `None` once closed, or after a write whose task was lost.
    file: Option<fs::File>,
    path: PathBuf,
    defer: Option<Arc<PendingSyncs>>,
}

impl SyncedFileWrite {
    fn take(&mut self) -> iceberg::Result<fs::File> {
        self.file.take().ok_or_else(|| {
            Error::new(
                ErrorKind::DataInvalid,
                format!("{} is closed or failed earlier", self.path.display()),
            )
        })
    }
}

#[async_trait::async_trait]
impl FileWrite for SyncedFileWrite {
    async fn write(&mut self, bs: Bytes) -> iceberg::Result<()> {
        let mut file = self.take()?;
        let path = self.path.clone();
        let file = blocking(move || {
            file.write_all(&bs)
                .map_err(|e| io_error("writing", &path, &e))?;
            Ok(file)
        })
        .await?;
        self.file = Some(file);
        Ok(())
    }

    async fn close(&mut self) -> iceberg::Result<()> {
        let file = self.take()?;
        let path = self.path.clone();
        match &self.defer {
            None => blocking(move || sync(&file, &path)).await,
            Some(pending) => {
                let sync = tokio::task::spawn_blocking(move || sync(&file, &path));
                pending.push(self.path.clone(), sync);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn files_written_through_it_read_back_whole_and_bad_paths_name_themselves() {
        let dir = tempfile::tempdir().unwrap();
        let storage = SyncedLocalStorage::default();
        assert!(storage.defer.is_none());
        let nested = format!("file://{}/a/b/data.parquet", dir.path().display());
        let mut w = storage.writer(&nested).await.unwrap();
        w.write(Bytes::from_static(b"hello ")).await.unwrap();
        w.write(Bytes::from_static(b"world")).await.unwrap();
        w.close().await.unwrap();
        let again = w.write(Bytes::from_static(b"!")).await.unwrap_err();
        assert!(again.to_string().contains("is closed"), "{again}");
        assert_eq!(
            fs::read(dir.path().join("a/b/data.parquet")).unwrap(),
            b"hello world"
        );

        let meta = format!("{}/metadata/v1.json", dir.path().display());
        storage
            .write(&meta, Bytes::from_static(b"{}"))
            .await
            .unwrap();
        let out = storage.new_output(&meta).unwrap();
        assert_eq!(&out.to_input_file().read().await.unwrap()[..], b"{}");

        // A file where a directory should be: the error names the path.
        fs::write(dir.path().join("blocker"), b"").unwrap();
        let bad = format!("{}/blocker/x.parquet", dir.path().display());
        let e = storage.write(&bad, Bytes::new()).await.unwrap_err();
        assert!(e.to_string().contains("blocker"), "{e}");
    }

    /// A writer holding back for running syncs leaves them to the
    /// committer: every sync, and a failure, still reaches `wait`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn holding_back_for_running_syncs_leaves_them_to_the_committer() {
        let pending = PendingSyncs::default();
        let (release, gate) = std::sync::mpsc::channel::<()>();
        pending.push(
            PathBuf::from("/slow"),
            tokio::task::spawn_blocking(move || {
                gate.recv().ok();
                Err(Error::new(ErrorKind::Unexpected, "slow disk failed"))
            }),
        );
        pending.push(
            PathBuf::from("/fast"),
            tokio::task::spawn_blocking(|| Ok(())),
        );
        let held =
            tokio::time::timeout(std::time::Duration::from_millis(200), pending.wait_until(0))
                .await;
        assert!(held.is_err(), "returned while a sync runs");
        release.send(()).unwrap();
        pending.wait_until(0).await;
        let e = pending.wait().await.unwrap_err();
        assert!(e.to_string().contains("slow disk failed"), "{e}");
    }

    #[tokio::test]
    async fn deferred_syncs_are_waited_for_once_and_a_failed_one_fails_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let pending = Arc::new(PendingSyncs::default());
        let storage = SyncedLocalStorageFactory {
            defer: Some(Arc::clone(&pending)),
        }
        .build(&StorageConfig::default())
        .unwrap();
        for name in ["a", "b"] {
            let path = format!("{}/data/{name}.parquet", dir.path().display());
            let mut w = storage.writer(&path).await.unwrap();
            w.write(Bytes::from_static(b"rows")).await.unwrap();
            w.close().await.unwrap();
        }
        assert_eq!(pending.wait().await.unwrap(), 2);
        assert_eq!(
            pending.wait().await.unwrap(),
            0,
            "each sync is waited for once"
        );

        let lost = PathBuf::from("/nonexistent/x.parquet");
        let failed =
            tokio::task::spawn_blocking(|| Err(Error::new(ErrorKind::Unexpected, "disk on fire")));
        pending.push(lost, failed);
        pending.push(PathBuf::from("/ok"), tokio::task::spawn_blocking(|| Ok(())));
        let e = pending.wait().await.unwrap_err();
        assert!(e.to_string().contains("disk on fire"), "{e}");
        assert_eq!(
            pending.wait().await.unwrap(),
            0,
            "a failure is reported once"
        );
    }
}
