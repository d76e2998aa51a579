//! The checkpoint store on object storage (`tinyflow_checkpoint::ObjectStore`
//! over the Iceberg connector's `ObjectFiles`) against a real S3 server:
//! S3Proxy, which `cargo xtask ci` starts and names in
//! `TINYFLOW_S3_ENDPOINT` (`cargo xtask s3 start` for a run by hand). These
//! tests panic with that advice when it is not set; they never skip.
//!
//! Each test writes under a prefix of its own in the bucket `tinyflow` (the
//! server outlives test runs). A second store opened on the same prefix
//! plays the worker on a new machine; damage is done through `ObjectFiles`,
//! the way another program or a bad copy would.

use std::collections::HashMap;
use std::sync::Arc;

use tinyflow_api::{CheckpointId, JobId, TaskId, error_chain};
use tinyflow_checkpoint::object::{INDEX, ObjectStorage, ObjectStore, object_name};
use tinyflow_checkpoint::{
    CheckpointConfig, CheckpointStore, CompletedCheckpoint, CoordinatorDriver, DriverConfig,
    StateHandle, SystemWallClock,
};
use tinyflow_connectors_iceberg::ObjectFiles;

/// The store's storage: `ObjectFiles` as the CLI wraps it
/// (`tinyflow_cli::checkpoint_storage`, which this package does not build).
#[derive(Debug)]
struct S3(ObjectFiles);

#[async_trait::async_trait]
impl ObjectStorage for S3 {
    async fn get(&self, name: &str) -> tinyflow_api::StreamResult<Option<Vec<u8>>> {
        self.0.get(name).await
    }

    async fn put(&self, name: &str, bytes: Vec<u8>) -> tinyflow_api::StreamResult<()> {
        self.0.put(name, bytes).await
    }

    async fn delete(&self, name: &str) -> tinyflow_api::StreamResult<()> {
        self.0.delete(name).await
    }

    fn describe(&self) -> String {
        self.0.location().to_owned()
    }
}

/// A prefix no earlier run used.
fn new_location(what: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("s3://tinyflow/checkpoints-{what}-{nanos}")
}

fn job() -> JobId {
    JobId::new("s3-job").unwrap()
}

/// Checkpoint `id` with two tasks whose states name it.
fn checkpoint(id: u64) -> CompletedCheckpoint {
    CompletedCheckpoint {
        job_id: job(),
        id: CheckpointId::new(id),
        triggered_at_ms: 1_700_000_000_000 + id * 1_000,
        acked_at_ms: 1_700_000_000_000 + id * 1_000 + 250,
        is_final: false,
        task_states: (0..2)
            .map(|t| {
                (
                    TaskId::new(t),
                    StateHandle::from(format!("task {t} at {id}").into_bytes()),
                )
            })
            .collect(),
    }
}

async fn open(location: &str, properties: &HashMap<String, String>) -> ObjectStore<S3> {
    let files = ObjectFiles::open(location, properties).unwrap();
    ObjectStore::open(S3(files), job(), 3).await.unwrap()
}

/// Five checkpoints with three retained; a new store on the same prefix
/// (a worker on another machine) restores the fifth and continues the ids,
/// also through the coordinator driver; the objects of the first two are
/// gone; garbage over the newest object falls back to the fourth.
#[tokio::test]
async fn a_new_store_on_the_prefix_finds_the_newest_checkpoint_and_falls_back_past_damage() {
    let properties = tinyflow_tests::s3_properties();
    let location = new_location("restore");
    let first = open(&location, &properties).await;
    assert_eq!(first.latest().await.unwrap(), None);
    assert_eq!(first.highest_id().await.unwrap(), None);
    for id in 1..=5 {
        first.persist(&checkpoint(id)).await.unwrap();
    }
    drop(first);

    let again = open(&location, &properties).await;
    assert_eq!(again.latest().await.unwrap(), Some(checkpoint(5)));
    assert_eq!(
        again.highest_id().await.unwrap(),
        Some(CheckpointId::new(5))
    );
    assert_eq!(
        again.list().await.unwrap(),
        [3, 4, 5].map(CheckpointId::new)
    );
    let files = ObjectFiles::open(&location, &properties).unwrap();
    for gone in [1, 2] {
        let name = object_name(CheckpointId::new(gone));
        assert_eq!(
            files.get(&name).await.unwrap(),
            None,
            "{name} is still there"
        );
    }
    for kept in [3, 4, 5] {
        let name = object_name(CheckpointId::new(kept));
        assert!(files.get(&name).await.unwrap().is_some(), "{name} is gone");
    }
    assert!(files.get(INDEX).await.unwrap().is_some());

    files
        .put(
            &object_name(CheckpointId::new(5)),
            b"not a checkpoint at all".to_vec(),
        )
        .await
        .unwrap();
    assert_eq!(again.latest().await.unwrap(), Some(checkpoint(4)));
    assert_eq!(
        again.highest_id().await.unwrap(),
        Some(CheckpointId::new(5)),
        "a damaged checkpoint still counts for ids"
    );

    let (_driver, _handle, restored) = CoordinatorDriver::start(
        DriverConfig::new(job(), CheckpointConfig::default()),
        Arc::new(again),
        Arc::new(SystemWallClock),
    )
    .await
    .unwrap();
    assert_eq!(restored.checkpoint, Some(checkpoint(4)));
    assert_eq!(restored.next_id, CheckpointId::new(6));
}

/// A secret key the server refuses fails at open, naming the location and
/// the action, not retryable (trying again will not mend the key), and
/// neither secret shows; a server that does not answer is retryable.
#[tokio::test]
async fn a_refused_key_and_an_unreachable_server_are_clear_errors() {
    let mut properties = tinyflow_tests::s3_properties();
    let location = new_location("refused");
    properties.insert(
        "s3.secret-access-key".to_owned(),
        "not-the-s3-secret-key".to_owned(),
    );
    let files = ObjectFiles::open(&location, &properties).unwrap();
    let e = ObjectStore::open(S3(files), job(), 3).await.unwrap_err();
    let text = error_chain(&e);
    assert!(!e.is_retryable(), "{text}");
    assert!(
        text.contains(&format!("reading {location}/{INDEX}")),
        "{text}"
    );
    assert!(
        !text.contains("not-the-s3-secret-key") && !text.contains(tinyflow_tests::S3_SECRET_KEY),
        "{text}"
    );
    let files = ObjectFiles::open(&location, &properties).unwrap();
    assert!(!format!("{files:?}").contains("not-the-s3-secret-key"));
    let e = files.put(INDEX, b"x".to_vec()).await.unwrap_err();
    assert!(
        !e.is_retryable() && error_chain(&e).contains(&format!("writing {location}/{INDEX}")),
        "{e}"
    );

    properties.insert("s3.endpoint".to_owned(), "http://127.0.0.1:1".to_owned());
    let files = ObjectFiles::open(&location, &properties).unwrap();
    let e = ObjectStore::open(S3(files), job(), 3).await.unwrap_err();
    let text = error_chain(&e);
    assert!(
        e.is_retryable() && text.contains(&format!("reading {location}/{INDEX}")),
        "{text}"
    );
}
