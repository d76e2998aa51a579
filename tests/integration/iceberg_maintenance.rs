//! Table maintenance (`IcebergSink::maintain`, and the committer's rounds
//! after its commits) on a sqlite catalog and a local warehouse, the table
//! read back by pyiceberg, an independent reader.
//!
//! Expiry never removes a file a remaining snapshot needs: after a round
//! every row is there once, every data file the current snapshot lists is
//! on disk, and what went is exactly what only the expired snapshots named
//! (their manifest lists; after another engine deleted rows, the data files
//! and manifests of the old snapshots too), and the metadata files older
//! than the kept versions. A dry run says exactly what the round then does.
//! The dedupe marker (a table property) survives expiry: a checkpoint
//! committed again after its snapshot expired is dropped, and a job whose
//! every commit is followed by a round that expires all but the newest
//! snapshot, failing again and again, restarts from checkpoints whose
//! snapshots are gone and leaves each row once.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arrow_array::RecordBatch;
use tinyflow_api::testing::VecSource;
use tinyflow_api::{JobBuilder, JobId, StreamError};
use tinyflow_checkpoint::testing::MemoryCheckpointStore;
use tinyflow_connectors_iceberg::{
    CatalogConfig, CommitStep, DELETE_AFTER_COMMIT, Fault, IcebergSink, Maintenance,
    PREVIOUS_VERSIONS_MAX, SUMMARY_SINK_ID, committed_id, table_epoch,
};
use tinyflow_runtime::JobRunner;
use tinyflow_tests::{ms, pyiceberg_read};

use crate::iceberg_sink::{
    Driver, Faults, INJECTED, batches, config, config_on, ids, quiet_injected_panics, range,
};

/// Expire everything but the newest `retain_last` snapshots, whatever their
/// age, and keep `metadata` previous metadata files.
fn expire_all_but(retain_last: usize, metadata: Option<usize>) -> Maintenance {
    Maintenance {
        expire_older_than: Some(Duration::ZERO),
        retain_last,
        metadata_versions_max: metadata,
        every: Duration::ZERO,
    }
}

/// The local path of a `file://` location.
fn local(location: &str) -> PathBuf {
    PathBuf::from(location.strip_prefix("file://").unwrap_or(location))
}

/// Every file under `dir`, as `file://` locations (as the table names them).
fn files_under(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.insert(format!("file://{}", path.display()));
        }
    }
    out
}

/// The table's `*.metadata.json` files on disk.
fn metadata_files(table: &iceberg::table::Table) -> BTreeSet<String> {
    let root = local(table.metadata().location());
    files_under(&root.join("metadata"))
        .into_iter()
        .filter(|f| f.ends_with(".metadata.json"))
        .collect()
}

fn exists(location: &str) -> bool {
    local(location).exists()
}

/// The snapshot ids of the current branch, newest first, with their
/// manifest lists.
fn ancestry(table: &iceberg::table::Table) -> Vec<(i64, String)> {
    let metadata = table.metadata();
    let mut out = Vec::new();
    let mut next = metadata.current_snapshot().cloned();
    while let Some(s) = next {
        out.push((s.snapshot_id(), s.manifest_list().to_owned()));
        next = s
            .parent_snapshot_id()
            .and_then(|id| metadata.snapshot_by_id(id).cloned());
    }
    out
}

/// The data files live in the current snapshot, and its manifests.
async fn current_files(table: &iceberg::table::Table) -> (BTreeSet<String>, BTreeSet<String>) {
    let snapshot = table.metadata().current_snapshot().unwrap();
    let list = table.manifest_list_reader(snapshot).load().await.unwrap();
    let mut data = BTreeSet::new();
    let mut manifests = BTreeSet::new();
    for m in list.entries() {
        manifests.insert(m.manifest_path.clone());
        let manifest = m.load_manifest(table.file_io()).await.unwrap();
        for e in manifest.entries().iter().filter(|e| e.is_alive()) {
            data.insert(e.data_file().file_path().to_owned());
        }
    }
    (data, manifests)
}

/// pyiceberg deletes the rows of `filter` from `db.events` in the sqlite
/// catalog under `dir`.
fn pyiceberg_delete(dir: &Path, filter: &str) {
    let out = std::process::Command::new(tinyflow_tests::python())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/delete_rows.py"))
        .args([
            "tinyflow",
            &format!("sqlite:///{}", dir.join("catalog.db").display()),
            &format!("file://{}", dir.join("warehouse").display()),
            "db.events",
            filter,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pyiceberg's delete failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// pyiceberg reads `want` (sorted ids), each once, in the one-snapshot-or-
/// more table under `dir`.
fn pyiceberg_holds(dir: &Path, want: &[i64]) -> serde_json::Value {
    let read = pyiceberg_read(dir, "db.events", &["id"]);
    assert_eq!(read["rows"], want.len(), "{read}");
    assert_eq!(read["distinct_ids"], want.len(), "{read}");
    assert_eq!(read["id_sum"], want.iter().sum::<i64>(), "{read}");
    read
}

/// Twelve commits, then a round that keeps 3 snapshots and 4 previous
/// metadata files: after fast appends the current snapshot lists every
/// manifest, so only the 10 expired snapshots' manifest lists and the
/// metadata files past the 4 kept go. The dry run before it names exactly
/// those files and changes nothing; a second round has nothing to do and
/// commits nothing.
#[tokio::test]
async fn expiry_deletes_only_what_expired_snapshots_alone_named_and_old_metadata_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Driver::new(config(dir.path(), "s")).await;
    for id in 1..=12u64 {
        let from = (id as i64 - 1) * 10;
        d.checkpoint(id, from..from + 10).await;
        d.commit(id).await.unwrap();
    }
    let before = d.table().await;
    let root = local(before.metadata().location());
    let data_before = files_under(&root.join("data"));
    let history = ancestry(&before);
    assert_eq!(history.len(), 13, "12 commits and the run's claim");
    assert!(history.iter().all(|(_, list)| exists(list)));
    // Beside the table's own: the file of a commit under way (a version
    // above the current one, not in the catalog yet), and an old file of
    // another table at the same location (dropped, created again). Neither
    // is the round's to delete.
    let meta_dir = root.join("metadata");
    let uuid = before.metadata().uuid();
    let in_flight = meta_dir.join("99999-0badc0de-0000-4000-8000-000000000001.metadata.json");
    std::fs::write(
        &in_flight,
        format!(r#"{{"format-version":2,"table-uuid":"{uuid}","location":"x"}}"#),
    )
    .unwrap();
    let foreign = meta_dir.join("00000-0badc0de-0000-4000-8000-000000000002.metadata.json");
    std::fs::write(
        &foreign,
        r#"{"format-version":2,"table-uuid":"0badc0de-0000-4000-8000-0000000000ff","location":"x"}"#,
    )
    .unwrap();
    let metadata_before = metadata_files(&before);
    let policy = expire_all_but(3, Some(4));

    let dry = d.sink.maintain(&policy, true).await.unwrap();
    let unchanged = d.table().await;
    assert_eq!(
        unchanged.metadata_location(),
        before.metadata_location(),
        "a dry run commits nothing"
    );
    assert_eq!(metadata_files(&unchanged), metadata_before);
    assert_eq!(files_under(&root.join("data")), data_before);
    assert!(history.iter().all(|(_, list)| exists(list)));
    assert_eq!((dry.snapshots_expired, dry.snapshots_kept), (10, 3));

    let report = d.sink.maintain(&policy, false).await.unwrap();
    assert!(report.problems.is_empty(), "{report:?}");
    assert_eq!(report.files, dry.files, "the dry run said what would go");
    assert_eq!((report.snapshots_expired, report.snapshots_kept), (10, 3));
    assert_eq!(
        (report.manifest_lists, report.manifests, report.data_files),
        (10, 0, 0),
        "{report:?}"
    );
    assert!(report.bytes > 0);
    let after = d.table().await;
    let kept: BTreeSet<i64> = after
        .metadata()
        .snapshots()
        .map(|s| s.snapshot_id())
        .collect();
    let newest: BTreeSet<i64> = history[..3].iter().map(|(id, _)| *id).collect();
    assert_eq!(kept, newest, "the newest three are kept");
    for (id, list) in &history {
        assert_eq!(exists(list), kept.contains(id), "manifest list {list}");
    }
    assert_eq!(
        files_under(&root.join("data")),
        data_before,
        "every data file stays: the current snapshot lists them all"
    );
    let (live, manifests) = current_files(&after).await;
    assert_eq!(live, data_before);
    assert!(manifests.iter().all(|m| exists(m)));
    // The 4 previous metadata files the log keeps, the current one, and
    // nothing else.
    let logged: BTreeSet<String> = after
        .metadata()
        .metadata_log()
        .iter()
        .map(|l| l.metadata_file.clone())
        .chain(after.metadata_location().map(str::to_owned))
        .collect();
    assert_eq!(logged.len(), 5);
    let mut left = logged.clone();
    left.insert(format!("file://{}", in_flight.display()));
    left.insert(format!("file://{}", foreign.display()));
    assert_eq!(metadata_files(&after), left);
    assert_eq!(
        report.metadata_files,
        metadata_before.len() + 1 - left.len(),
        "every file before the expiry commit but the kept ones"
    );
    let props = after.metadata().properties();
    assert_eq!(
        props.get(DELETE_AFTER_COMMIT).map(String::as_str),
        Some("true")
    );
    assert_eq!(
        props.get(PREVIOUS_VERSIONS_MAX).map(String::as_str),
        Some("4")
    );
    assert_eq!(
        props
            .get("tinyflow.sink.s.checkpoint-id")
            .map(String::as_str),
        Some("12"),
        "the dedupe marker stays"
    );

    assert_eq!(ids(&after).await, range(0..120));
    let read = pyiceberg_holds(dir.path(), &range(0..120));
    assert_eq!(read["snapshots"].as_array().unwrap().len(), 3, "{read}");

    // Nothing left to do: no commit, nothing deleted.
    let again = d.sink.maintain(&policy, false).await.unwrap();
    assert_eq!((again.snapshots_expired, again.files_deleted()), (0, 0));
    assert_eq!(
        d.table().await.metadata_location(),
        after.metadata_location()
    );
    // The sink commits on top as before.
    d.checkpoint(13, 120..130).await;
    d.commit(13).await.unwrap();
    assert_eq!(ids(&d.table().await).await, range(0..130));
}

/// Another engine (pyiceberg) deletes the rows of one identity partition:
/// whole data files leave the table in a snapshot of its own. Expiring the
/// snapshots before it deletes those data files and the manifests that
/// listed them, and nothing the current snapshot lists.
#[tokio::test]
async fn after_another_engine_deleted_rows_expiry_deletes_the_data_files_only_old_snapshots_held() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Driver::new(config(dir.path(), "s")).await;
    for id in 1..=4u64 {
        let from = (id as i64 - 1) * 30;
        d.checkpoint(id, from..from + 30).await;
        d.commit(id).await.unwrap();
    }
    let (held, _) = current_files(&d.table().await).await;
    // `part` is id % 3, an identity partition.
    pyiceberg_delete(dir.path(), "part == 0");
    d.checkpoint(5, 120..150).await;
    d.commit(5).await.unwrap();
    let before = d.table().await;
    let (live, manifests) = current_files(&before).await;
    let gone: BTreeSet<String> = held.difference(&live).cloned().collect();
    assert!(
        !gone.is_empty() && gone.iter().all(|f| f.contains("part=0")),
        "{gone:?}"
    );
    assert!(
        gone.iter().all(|f| exists(f)),
        "the old snapshots hold them"
    );

    let report = d
        .sink
        .maintain(&expire_all_but(1, Some(1)), false)
        .await
        .unwrap();
    assert!(report.problems.is_empty(), "{report:?}");
    assert_eq!(report.snapshots_kept, 1);
    assert_eq!(report.data_files, gone.len(), "{report:?}");
    assert!(report.manifests >= 1, "{report:?}");
    let deleted: BTreeSet<String> = report.files.iter().cloned().collect();
    assert!(gone.is_subset(&deleted));
    assert!(gone.iter().all(|f| !exists(f)), "deleted from disk");
    assert!(live.is_disjoint(&deleted) && manifests.is_disjoint(&deleted));
    assert!(live.iter().chain(&manifests).all(|f| exists(f)));
    let after = d.table().await;
    assert_eq!(current_files(&after).await.0, live);

    let mut want: Vec<i64> = (0..120).filter(|i| i % 3 != 0).collect();
    want.extend(120..150);
    assert_eq!(ids(&after).await, want);
    pyiceberg_holds(dir.path(), &want);
}

/// The sink's commit of checkpoint 5 lands, but the process dies before it
/// learns so; another sink commits after it, and a round expires every
/// snapshot but that one: the history no longer shows any commit of the
/// sink. The table property still says 5, so the restored committer drops
/// checkpoint 5 instead of committing its files again, and the identity
/// check accepts the checkpoint whose snapshot is gone (and still refuses
/// an older one).
#[tokio::test]
async fn the_dedupe_marker_survives_expiry_and_a_checkpoint_committed_again_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Faults::default();
    let mut a = Driver::new(faults.config(dir.path(), "a")).await;
    for id in 1..=4u64 {
        let from = (id as i64 - 1) * 10;
        a.checkpoint(id, from..from + 10).await;
        a.commit(id).await.unwrap();
    }
    faults.at(
        CommitStep::AfterUpdate { attempt: 0 },
        Fault::Crash("after the update".into()),
    );
    a.checkpoint(5, 40..50).await;
    assert!(a.commit(5).await.is_err());
    let mut b = Driver::new(config(dir.path(), "b")).await;
    b.checkpoint(1, 1_000..1_010).await;
    b.commit(1).await.unwrap();
    let before = a.table().await;
    let marker = "tinyflow.sink.a.checkpoint-id";
    assert_eq!(
        before
            .metadata()
            .properties()
            .get(marker)
            .map(String::as_str),
        Some("5")
    );

    let report = a
        .sink
        .maintain(&expire_all_but(1, Some(2)), false)
        .await
        .unwrap();
    assert!(report.problems.is_empty(), "{report:?}");
    let after = a.table().await;
    assert_eq!(after.metadata().snapshots().count(), 1);
    assert!(
        after.metadata().snapshots().all(|s| s
            .summary()
            .additional_properties
            .get(SUMMARY_SINK_ID)
            .map(String::as_str)
            == Some("b")),
        "no snapshot of sink a is left"
    );
    assert_eq!(
        after.metadata().properties().get(marker),
        before.metadata().properties().get(marker),
        "expiry leaves the dedupe marker"
    );
    assert_eq!(committed_id(&after, "a"), Some(5));
    assert_eq!(table_epoch(&after, "a"), table_epoch(&before, "a"));

    let mut want = range(0..50);
    want.extend(1_000..1_010);
    // The restored committer drops checkpoint 5 (and what it holds of 4).
    a.restore(5).await;
    assert_eq!(ids(&a.table().await).await, want);
    // Restored again: still nothing twice.
    a.restore(5).await;
    assert_eq!(ids(&a.table().await).await, want);
    // An older checkpoint is refused as before: the table holds 5.
    let err = a.try_restore(4).await.unwrap_err();
    assert!(matches!(err, StreamError::StateMismatch { .. }), "{err:?}");
    a.restore(5).await;
    a.checkpoint(6, 50..60).await;
    a.commit(6).await.unwrap();
    want.extend(50..60);
    want.sort_unstable();
    assert_eq!(ids(&a.table().await).await, want);
    pyiceberg_holds(dir.path(), &want);
}

/// The committer's own rounds (`IcebergSinkConfig::maintenance`), one after
/// every commit, keeping 3 snapshots: the history stays short, a restore
/// of the newest checkpoint commits nothing again, and one whose snapshot
/// is gone and whose checkpoints the table went past is refused.
#[tokio::test]
async fn the_committers_rounds_keep_the_history_short_and_dedupe_still_holds() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), "s");
    c.maintenance = Some(expire_all_but(3, Some(3)));
    let mut d = Driver::new(c).await;
    for id in 1..=7u64 {
        let from = (id as i64 - 1) * 10;
        d.checkpoint(id, from..from + 10).await;
        d.commit(id).await.unwrap();
        // The round that commit started runs in the background; the end of
        // the job waits for it.
        d.committer.job_finished().await.unwrap();
        let table = d.table().await;
        assert!(
            table.metadata().snapshots().count() <= 3,
            "after commit {id}: {} snapshots",
            table.metadata().snapshots().count()
        );
        assert!(
            metadata_files(&table).len() <= 4,
            "after commit {id}: {:?}",
            metadata_files(&table)
        );
    }
    let table = d.table().await;
    assert_eq!(table.metadata().snapshots().count(), 3);
    assert_eq!(ids(&table).await, range(0..70));
    // Restoring an old checkpoint (whose snapshot is gone) is refused: its
    // sources would read again what checkpoints 3 to 7 committed.
    let err = d.try_restore(2).await.unwrap_err();
    assert!(matches!(err, StreamError::StateMismatch { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("holds checkpoint 7") && text.contains("tinyflow reset"),
        "{text}"
    );
    // The newest restores and commits nothing again.
    d.restore(7).await;
    assert_eq!(ids(&d.table().await).await, range(0..70));
    pyiceberg_holds(dir.path(), &range(0..70));
}

/// A whole job through the runtime, failing three times, whose sink runs a
/// round after every commit that expires all but the newest snapshot and
/// keeps 2 previous metadata files: each restart restores a checkpoint
/// whose snapshot a round expired, and pyiceberg reads every row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_restarted_after_expiry_still_dedupes_its_last_checkpoint() {
    quiet_injected_panics();
    let dir = tempfile::tempdir().unwrap();
    let catalog = CatalogConfig::sqlite(dir.path());
    let seen = Arc::new(AtomicU64::new(0));
    let panic_at = [60u64, 110, 170];
    let fired: Arc<Vec<AtomicBool>> =
        Arc::new(panic_at.iter().map(|_| AtomicBool::new(false)).collect());
    let job = JobBuilder::new(JobId::new("iceberg-maintained").unwrap());
    let stream = job
        .source(
            "batches",
            2,
            VecSource::new(batches(2, 120, 10, 0))
                .batch_size(1)
                .pause(ms(2)),
        )
        .map("check", move |b: RecordBatch| {
            let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
            for (i, at) in panic_at.iter().enumerate() {
                if n >= *at && !fired[i].swap(true, Ordering::SeqCst) {
                    panic!("{INJECTED} at batch {n}");
                }
            }
            b
        });
    let mut c = config_on(catalog.clone(), "m");
    c.maintenance = Some(expire_all_but(1, Some(2)));
    IcebergSink::new(c).unwrap().attach(stream, "events", 2);
    let report = JobRunner::new(
        job.build().unwrap(),
        Arc::new(MemoryCheckpointStore::new()),
        crate::iceberg_sink::quick_restarts(),
    )
    .run()
    .await
    .unwrap();
    assert_eq!(report.attempts, 4, "three failures: {report:?}");

    let sink = IcebergSink::new(config_on(catalog, "m")).unwrap();
    let table = sink.load_table().await.unwrap();
    let committed = committed_id(&table, "m").unwrap();
    let snapshots = table.metadata().snapshots().count();
    // Each commit is followed by a round unless one is still running, and
    // the end of the job waits for the last: at most the snapshot that
    // round kept and the commits after it started are left.
    assert!(
        snapshots <= 4 && committed >= 10,
        "{snapshots} snapshots after {committed} checkpoints"
    );
    assert!(
        metadata_files(&table).len() <= 6,
        "{:?}",
        metadata_files(&table)
    );
    assert_eq!(ids(&table).await, range(0..2_400));
    pyiceberg_holds(dir.path(), &range(0..2_400));
}

/// The same round on a warehouse on S3 (the server `cargo xtask ci`
/// starts): the expired snapshots' manifest lists and the metadata files
/// past the kept versions are deleted through the table's storage (listed
/// and deleted in batches), every file the current snapshot lists stays,
/// and the table reads back whole.
#[tokio::test]
async fn expiry_on_s3_storage_deletes_through_the_tables_storage() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Driver::new(config_on(tinyflow_tests::s3_catalog(dir.path()), "s")).await;
    for id in 1..=6u64 {
        let from = (id as i64 - 1) * 10;
        d.checkpoint(id, from..from + 10).await;
        d.commit(id).await.unwrap();
    }
    let before = d.table().await;
    let io = before.file_io().clone();
    let history = ancestry(&before);
    let metadata_before: Vec<String> = before
        .metadata()
        .metadata_log()
        .iter()
        .map(|l| l.metadata_file.clone())
        .chain(before.metadata_location().map(str::to_owned))
        .collect();
    assert_eq!(
        metadata_before.len(),
        8,
        "the table's creation, the claim, 6 commits"
    );

    let report = d
        .sink
        .maintain(&expire_all_but(2, Some(2)), false)
        .await
        .unwrap();
    assert!(report.problems.is_empty(), "{report:?}");
    assert_eq!(
        (
            report.snapshots_expired,
            report.manifest_lists,
            report.data_files
        ),
        (5, 5, 0)
    );
    // The expiry commit wrote a ninth; the log keeps the two before it.
    assert_eq!(report.metadata_files, 6, "{report:?}");
    let after = d.table().await;
    let kept: BTreeSet<i64> = after
        .metadata()
        .snapshots()
        .map(|s| s.snapshot_id())
        .collect();
    for (id, list) in &history {
        assert_eq!(
            io.exists(list).await.unwrap(),
            kept.contains(id),
            "manifest list {list}"
        );
    }
    let logged: BTreeSet<&str> = after
        .metadata()
        .metadata_log()
        .iter()
        .map(|l| l.metadata_file.as_str())
        .collect();
    for m in &metadata_before {
        assert_eq!(
            io.exists(m).await.unwrap(),
            logged.contains(m.as_str()),
            "metadata file {m}"
        );
    }
    let (live, manifests) = current_files(&after).await;
    for f in live.iter().chain(&manifests) {
        assert!(io.exists(f).await.unwrap(), "{f} is gone");
    }
    assert_eq!(ids(&after).await, range(0..60));
}
