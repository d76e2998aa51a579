//! Checkpoints on object storage: `checkpoint.dir = "s3://bucket/prefix"`.
//!
//! `tinyflow-checkpoint` names no storage client and the Iceberg connector
//! never names the checkpoint crate, so they meet here: [`ObjectFilesStorage`]
//! is the checkpoint store's [`ObjectStorage`] over the connector's
//! [`ObjectFiles`] (S3 through the same storage layer as the tables, with
//! the catalog's `s3.*` properties). The store itself, its objects and what
//! fences two runs are described in `tinyflow_checkpoint::object`.

use std::collections::HashMap;

use anyhow::Context as _;
use tinyflow_api::{JobId, StreamResult};
use tinyflow_checkpoint::CompletedCheckpoint;
use tinyflow_checkpoint::object::{ObjectStorage, ObjectStore};
use tinyflow_connectors_iceberg::ObjectFiles;

/// The checkpoint store's [`ObjectStorage`] over [`ObjectFiles`].
#[derive(Debug)]
pub struct ObjectFilesStorage(pub ObjectFiles);

#[async_trait::async_trait]
impl ObjectStorage for ObjectFilesStorage {
    async fn get(&self, name: &str) -> StreamResult<Option<Vec<u8>>> {
        self.0.get(name).await
    }

    async fn put(&self, name: &str, bytes: Vec<u8>) -> StreamResult<()> {
        self.0.put(name, bytes).await
    }

    async fn delete(&self, name: &str) -> StreamResult<()> {
        self.0.delete(name).await
    }

    fn describe(&self) -> String {
        self.0.location().to_owned()
    }
}

/// Whether a `checkpoint.dir` names object storage (`s3://`, `s3a://`,
/// `s3n://`) rather than a local directory.
pub fn is_object_location(dir: &str) -> bool {
    tinyflow_connectors_iceberg::is_s3_location(dir)
}

/// Opens the checkpoint store of `job_id` at `location`, keeping the newest
/// `retain` checkpoints; `properties` are the catalog's (`s3.endpoint`,
/// `s3.region`, keys...). Reads the store's index once, so unreachable
/// storage, refused keys or another job's checkpoints fail here.
pub async fn open_object_store(
    location: &str,
    properties: &HashMap<String, String>,
    job_id: JobId,
    retain: usize,
) -> anyhow::Result<ObjectStore<ObjectFilesStorage>> {
    let files = ObjectFiles::open(location, properties)?;
    ObjectStore::open(ObjectFilesStorage(files), job_id, retain)
        .await
        .with_context(|| format!("opening the checkpoint store at {location}"))
}

/// The newest readable checkpoint of `job_id` at `location`, read without
/// writing anything (`tinyflow inspect`).
pub async fn peek_object_latest(
    location: &str,
    properties: &HashMap<String, String>,
    job_id: JobId,
) -> anyhow::Result<Option<CompletedCheckpoint>> {
    let files = ObjectFiles::open(location, properties)?;
    ObjectStore::peek_latest(ObjectFilesStorage(files), job_id)
        .await
        .with_context(|| format!("reading the newest checkpoint at {location}"))
}

#[cfg(test)]
mod tests {
    use tinyflow_api::{CheckpointId, TaskId};
    use tinyflow_checkpoint::{CheckpointStore, StateHandle};

    use super::*;

    #[test]
    fn s3_locations_are_object_locations() {
        assert!(is_object_location("s3://bucket/checkpoints"));
        assert!(is_object_location("s3a://bucket/checkpoints"));
        assert!(!is_object_location("/var/lib/tinyflow/checkpoints"));
        assert!(!is_object_location("file:///var/lib/tinyflow"));
    }

    /// The whole path on a local directory (the same code as on S3 but for
    /// the last step; `tests/integration/checkpoint_object_store.rs` runs it
    /// against an S3 server).
    #[tokio::test]
    async fn checkpoints_persisted_through_object_files_read_back() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let location = format!("file://{}/checkpoints", dir.path().display());
        let job = JobId::new("job").expect("valid job id");
        let store = open_object_store(&location, &HashMap::new(), job.clone(), 2)
            .await
            .expect("opening");
        for id in 1..=3 {
            let cp = CompletedCheckpoint {
                job_id: job.clone(),
                id: CheckpointId::new(id),
                triggered_at_ms: id,
                acked_at_ms: id,
                is_final: false,
                task_states: [(TaskId::new(0), StateHandle::from(vec![id as u8]))]
                    .into_iter()
                    .collect(),
            };
            store.persist(&cp).await.expect("persisting");
        }
        let latest = peek_object_latest(&location, &HashMap::new(), job)
            .await
            .expect("peeking");
        assert_eq!(latest.map(|cp| cp.id), Some(CheckpointId::new(3)));
        assert_eq!(
            store.list().await.expect("listing"),
            [CheckpointId::new(2), CheckpointId::new(3)]
        );
        assert!(
            !dir.path()
                .join("checkpoints/chk-00000000000000000001.ckpt")
                .exists()
        );
    }
}
