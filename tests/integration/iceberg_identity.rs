//! The table is the truth: a restored checkpoint that disagrees with its
//! table is refused, and a second writer of a sink is fenced.
//!
//! Each scenario changes the state around a job the way operators do: the
//! table dropped (and created again by the next run, or by someone else),
//! the catalog and the warehouse lost, data files deleted between a crash
//! and the restart (on local storage and on S3), the catalog restored from
//! an older backup, and two live runs of one sink. Each was a wrong table
//! before (old files in a new table, a table no engine can read, lost
//! commits papered over, two writers) and must now stop with a clear,
//! non-retryable error and an untouched table, which pyiceberg reads. A
//! property test runs generated interleavings of two runs' restarts
//! (claims) and commits, including a commit paused inside its catalog
//! update while the other run claims.

use std::path::Path;
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use tinyflow_api::{CheckpointId, SinkFactory, SinkRestore, StreamError, StreamResult};
use tinyflow_connectors_iceberg::identity::CommitterView;
use tinyflow_connectors_iceberg::{
    CatalogConfig, CommitStep, Fault, FaultHook, IcebergSink, IcebergSinkConfig, SUMMARY_EPOCH,
    SUMMARY_EPOCH_CLAIM, SUMMARY_SINK_ID, committed_id, iceberg_schema, load_table, open_catalog,
    table_epoch,
};
use tokio::sync::Notify;

use crate::iceberg_sink::{Driver, NS, TABLE, config, config_on, ctx, ids, range, table_spec};
use tinyflow_tests::ms;

/// A new run of the sink (a new process) restoring the committer from
/// `state`, checkpoint `id`.
async fn new_run_restoring(config: IcebergSinkConfig, state: &[u8], id: u64) -> StreamResult<()> {
    let sink = IcebergSink::new(config)?;
    let states = [state.to_vec()];
    sink.committer()
        .create(
            &ctx("c", 1),
            Some(SinkRestore {
                checkpoint: CheckpointId::new(id),
                states: &states,
            }),
        )
        .await
        .map(drop)
}

fn ident() -> iceberg::TableIdent {
    iceberg::TableIdent::new(
        iceberg::NamespaceIdent::new(NS.to_owned()),
        TABLE.to_owned(),
    )
}

async fn drop_table(catalog: &CatalogConfig) {
    let c = open_catalog(catalog, ms(5_000)).await.unwrap();
    c.drop_table(&ident()).await.unwrap();
}

async fn table(catalog: &CatalogConfig) -> iceberg::table::Table {
    load_table(catalog, NS, TABLE).await.unwrap()
}

/// What pyiceberg reads of the table: rows and distinct ids.
fn py_rows(catalog: &CatalogConfig) -> (u64, u64) {
    let py = tinyflow_tests::pyiceberg_read_catalog(catalog, &format!("{NS}.{TABLE}"), &["id"]);
    (
        py["rows"].as_u64().unwrap(),
        py["distinct_ids"].as_u64().unwrap(),
    )
}

/// A job that committed checkpoint 1 (ids 0..100) and completed
/// checkpoint 2 (ids 100..150), then died before committing it: the
/// checkpoint store holds checkpoint 2 with its files pending.
async fn crashed_after_checkpoint_2(config: IcebergSinkConfig) -> (Vec<u8>, Vec<String>) {
    let mut d = Driver::new(config).await;
    d.checkpoint(1, 0..100).await;
    d.commit(1).await.unwrap();
    d.checkpoint(2, 100..150).await;
    let state = d.states[&2].clone();
    let view = CommitterView::decode(&state).unwrap();
    let paths = view.pending[&2].paths.clone();
    assert!(!paths.is_empty());
    (state, paths)
}

fn mismatch_text(err: &StreamError) -> String {
    assert!(
        matches!(err, StreamError::StateMismatch { .. }),
        "expected a state mismatch: {err:?}"
    );
    assert!(!err.is_retryable(), "{err}");
    let text = err.to_string();
    assert!(text.contains("tinyflow reset"), "no way out named: {text}");
    text
}

#[tokio::test]
async fn a_dropped_table_is_refused_and_the_old_files_never_reach_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = CatalogConfig::sqlite(dir.path());
    let (state, _) = crashed_after_checkpoint_2(config(dir.path(), "s")).await;
    drop_table(&catalog).await;

    let err = new_run_restoring(config(dir.path(), "s"), &state, 2)
        .await
        .unwrap_err();
    let text = mismatch_text(&err);
    assert!(
        text.contains("not the table the checkpoint was written for")
            && text.contains("dropped and created again")
            && text.contains("this run created it"),
        "{text}"
    );
    // The new table (the next run created it, as declared) holds nothing.
    let t = table(&catalog).await;
    assert_eq!(ids(&t).await, Vec::<i64>::new());
    assert_eq!(py_rows(&catalog), (0, 0));
}

#[tokio::test]
async fn a_table_created_again_by_someone_else_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = CatalogConfig::sqlite(dir.path());
    let (state, _) = crashed_after_checkpoint_2(config(dir.path(), "s")).await;
    drop_table(&catalog).await;
    let c = open_catalog(&catalog, ms(5_000)).await.unwrap();
    let created = c
        .create_table(
            ident().namespace(),
            iceberg::TableCreation::builder()
                .name(TABLE.to_owned())
                .schema(iceberg_schema(&table_spec()).unwrap())
                .build(),
        )
        .await
        .unwrap();
    let uuid = created.metadata().uuid().to_string();

    let err = new_run_restoring(config(dir.path(), "s"), &state, 2)
        .await
        .unwrap_err();
    let text = mismatch_text(&err);
    assert!(
        text.contains(&uuid) && !text.contains("this run created it"),
        "{text}"
    );
    // Refused before the claim: someone else's table gets not even that.
    let t = table(&catalog).await;
    assert_eq!(t.metadata().snapshots().count(), 0);
    assert_eq!(table_epoch(&t, "s"), 0);
    assert_eq!(py_rows(&catalog), (0, 0));
}

#[tokio::test]
async fn a_lost_catalog_and_warehouse_are_refused_not_committed_into() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = CatalogConfig::sqlite(dir.path());
    let (state, paths) = crashed_after_checkpoint_2(config(dir.path(), "s")).await;
    // A new volume: the catalog and every file gone.
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            std::fs::remove_dir_all(&path).unwrap();
        } else {
            std::fs::remove_file(&path).unwrap();
        }
    }

    let err = new_run_restoring(config(dir.path(), "s"), &state, 2)
        .await
        .unwrap_err();
    let text = mismatch_text(&err);
    assert!(
        text.contains("not the table the checkpoint was written for"),
        "{text}"
    );
    // Before, the checkpoint's files (gone) were committed: no engine could
    // read the table. Now it is empty and readable.
    for p in &paths {
        assert!(!Path::new(p.trim_start_matches("file://")).exists());
    }
    assert_eq!(py_rows(&catalog), (0, 0));
}

#[tokio::test]
async fn data_files_deleted_between_crash_and_restart_are_named_not_committed() {
    let dir = tempfile::tempdir().unwrap();
    deleted_files_are_named(CatalogConfig::sqlite(dir.path())).await;
}

#[tokio::test]
async fn data_files_deleted_on_s3_between_crash_and_restart_are_named_not_committed() {
    let dir = tempfile::tempdir().unwrap();
    deleted_files_are_named(tinyflow_tests::s3_catalog(dir.path())).await;
}

async fn deleted_files_are_named(catalog: CatalogConfig) {
    let (state, paths) = crashed_after_checkpoint_2(config_on(catalog.clone(), "s")).await;
    let gone = paths.last().unwrap().clone();
    let io = table(&catalog).await.file_io().clone();
    io.delete(&gone).await.unwrap();

    let err = new_run_restoring(config_on(catalog.clone(), "s"), &state, 2)
        .await
        .unwrap_err();
    let text = mismatch_text(&err);
    assert!(
        text.contains(&gone) && text.contains("is missing") && text.contains("checkpoint 2"),
        "{text}"
    );
    let t = table(&catalog).await;
    assert_eq!(ids(&t).await, range(0..100));
    assert_eq!(committed_id(&t, "s"), Some(1));
    assert_eq!(py_rows(&catalog), (100, 100));
}

#[tokio::test]
async fn a_data_file_changed_between_crash_and_restart_is_named_not_committed() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = CatalogConfig::sqlite(dir.path());
    let (state, paths) = crashed_after_checkpoint_2(config(dir.path(), "s")).await;
    let changed = paths[0].trim_start_matches("file://").to_owned();
    std::fs::write(&changed, b"not parquet").unwrap();

    let err = new_run_restoring(config(dir.path(), "s"), &state, 2)
        .await
        .unwrap_err();
    let text = mismatch_text(&err);
    assert!(
        text.contains(&changed) && text.contains("is 11 bytes, but was written with"),
        "{text}"
    );
    assert_eq!(py_rows(&catalog), (100, 100));
}

/// The sqlite catalog's files (the database and its write-ahead log).
fn catalog_files(dir: &Path) -> Vec<std::path::PathBuf> {
    ["catalog.db", "catalog.db-wal", "catalog.db-shm"]
        .iter()
        .map(|n| dir.join(n))
        .collect()
}

#[tokio::test]
async fn a_catalog_restored_from_an_older_backup_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = CatalogConfig::sqlite(dir.path());
    let backup = tempfile::tempdir().unwrap();
    let mut d = Driver::new(config(dir.path(), "s")).await;
    d.checkpoint(1, 0..100).await;
    d.commit(1).await.unwrap();
    for f in catalog_files(dir.path()) {
        if f.exists() {
            std::fs::copy(&f, backup.path().join(f.file_name().unwrap())).unwrap();
        }
    }
    for (id, from) in [(2u64, 100i64), (3, 150)] {
        d.checkpoint(id, from..from + 50).await;
        d.commit(id).await.unwrap();
    }
    d.checkpoint(4, 200..250).await;
    let state = d.states[&4].clone();
    drop(d);
    // The catalog comes back from the backup; the checkpoint store did not.
    for f in catalog_files(dir.path()) {
        let saved = backup.path().join(f.file_name().unwrap());
        if saved.exists() {
            std::fs::copy(&saved, &f).unwrap();
        } else if f.exists() {
            std::fs::remove_file(&f).unwrap();
        }
    }
    assert_eq!(committed_id(&table(&catalog).await, "s"), Some(1));

    let err = new_run_restoring(config(dir.path(), "s"), &state, 4)
        .await
        .unwrap_err();
    let text = mismatch_text(&err);
    assert!(
        text.contains("lost commits")
            && text.contains("saw checkpoint 3 committed, the table's last is 1")
            && text.contains("older backup"),
        "{text}"
    );
    // Committing checkpoint 4 would have left 100..200 missing for good.
    let t = table(&catalog).await;
    assert_eq!(ids(&t).await, range(0..100));
    assert_eq!(py_rows(&catalog), (100, 100));
}

/// A fault hook that pauses the `n`-th catalog update (counting from 1)
/// until released, and says when it paused.
#[derive(Clone, Default)]
struct PauseAt {
    n: Arc<Mutex<Option<u32>>>,
    updates: Arc<Mutex<u32>>,
    paused: Arc<Notify>,
    go: Arc<Notify>,
}

impl PauseAt {
    fn arm(&self, n_from_now: u32) {
        let done = *self.updates.lock().unwrap();
        *self.n.lock().unwrap() = Some(done + n_from_now);
    }

    fn hook(&self) -> FaultHook {
        let me = self.clone();
        Arc::new(move |step| {
            let me = me.clone();
            Box::pin(async move {
                if let CommitStep::BeforeUpdate { .. } = step {
                    let n = {
                        let mut u = me.updates.lock().unwrap();
                        *u += 1;
                        *u
                    };
                    if *me.n.lock().unwrap() == Some(n) {
                        me.paused.notify_one();
                        me.go.notified().await;
                    }
                }
                Fault::Proceed
            })
        })
    }
}

/// Two live runs of one sink: the older pauses inside its commit (after it
/// checked the table, before the catalog update) while the newer claims.
/// The older's commit is refused, for good, saying it was fenced and by
/// which epoch; the newer goes on; the table holds every record once.
#[tokio::test]
async fn two_live_runs_of_one_sink_the_newer_fences_the_older_inside_its_commit() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = CatalogConfig::sqlite(dir.path());
    let pause = PauseAt::default();
    let mut c = config(dir.path(), "s");
    c.fault_hook = Some(pause.hook());
    let mut old = Driver::new(c).await;
    old.checkpoint(1, 0..100).await;
    old.commit(1).await.unwrap();
    assert_eq!(table_epoch(&table(&catalog).await, "s"), 1);

    old.checkpoint(2, 100..150).await;
    pause.arm(1);
    let committing = tokio::spawn(async move {
        let result = old.commit(2).await;
        (old, result)
    });
    pause.paused.notified().await;
    // The newer run starts meanwhile (another machine: its own checkpoint
    // store, empty) and claims the sink.
    let newer = IcebergSink::new(config(dir.path(), "s")).unwrap();
    assert_eq!(newer.claim().await.unwrap(), 2);
    pause.go.notify_one();
    let (mut old, result) = committing.await.unwrap();
    let err = result.unwrap_err();
    assert!(matches!(err, StreamError::Fenced { .. }), "{err:?}");
    assert!(!err.is_retryable());
    let text = err.to_string();
    assert!(
        text.contains("fenced") && text.contains("epoch 2") && text.contains("pid"),
        "{text}"
    );
    assert_eq!(ids(&table(&catalog).await).await, range(0..100));

    // The newer run reads on from where the table ends.
    let mut new = Driver::with_sink(newer).await;
    new.checkpoint(2, 100..150).await;
    new.commit(2).await.unwrap();
    // The older stays fenced, whatever it tries.
    old.checkpoint(3, 150..160).await;
    assert!(matches!(
        old.commit(3).await,
        Err(StreamError::Fenced { .. })
    ));
    let t = table(&catalog).await;
    assert_eq!(ids(&t).await, range(0..150));
    assert_eq!(py_rows(&catalog), (150, 150));
    assert_data_only_from_the_newest_claim(&t);
}

/// Along the table's history, every data snapshot of the sink carries the
/// epoch of the newest claim before it, and claims only grow.
fn assert_data_only_from_the_newest_claim(t: &iceberg::table::Table) {
    let mut snapshots: Vec<_> = t.metadata().snapshots().collect();
    snapshots.sort_by_key(|s| s.sequence_number());
    let mut epoch = 0u64;
    for s in snapshots {
        let p = &s.summary().additional_properties;
        let e: u64 = p[SUMMARY_EPOCH].parse().unwrap();
        if p.contains_key(SUMMARY_EPOCH_CLAIM) {
            assert!(e > epoch, "claims grow: {e} after {epoch}");
            epoch = e;
        } else {
            assert!(p.contains_key(SUMMARY_SINK_ID));
            assert_eq!(e, epoch, "a data commit of epoch {e} after claim {epoch}");
        }
    }
}

/// One step of two runs of a sink.
#[derive(Debug, Clone)]
enum Step {
    /// Run `r` starts again (a new process: a new claim).
    Restart(usize),
    /// Run `r` writes a checkpoint's rows.
    Write(usize),
    /// Run `r` commits what it wrote.
    Commit(usize),
    /// Run `r` commits, and pauses inside the commit while the other run
    /// starts again.
    CommitWhileTheOtherRestarts(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        1 => (0..2usize).prop_map(Step::Restart),
        3 => (0..2usize).prop_map(Step::Write),
        3 => (0..2usize).prop_map(Step::Commit),
        1 => (0..2usize).prop_map(Step::CommitWhileTheOtherRestarts),
    ]
}

struct RunState {
    driver: Driver,
    pause: PauseAt,
    /// Rows written since its last commit.
    pending: Vec<i64>,
    next_checkpoint: u64,
    /// Refused once: a fenced run stays fenced.
    fenced: bool,
}

async fn start_run(dir: &Path) -> RunState {
    let pause = PauseAt::default();
    let mut c = config(dir, "s");
    c.fault_hook = Some(pause.hook());
    let driver = Driver::new(c).await;
    let committed = committed_id(&driver.table().await, "s").unwrap_or(0);
    RunState {
        driver,
        pause,
        pending: Vec::new(),
        next_checkpoint: committed + 1,
        fenced: false,
    }
}

/// Plays `steps`; checks every commit's outcome against the model (only
/// the run holding the newest claim commits) and, at the end, that the
/// table holds exactly the rows of the commits that succeeded, once.
async fn play(steps: Vec<Step>) {
    let dir = tempfile::tempdir().unwrap();
    let mut runs = vec![start_run(dir.path()).await, start_run(dir.path()).await];
    let mut owner = 1usize;
    let mut committed: Vec<i64> = Vec::new();
    let mut next_row = 0i64;
    for step in steps {
        match step {
            Step::Restart(r) => {
                runs[r] = start_run(dir.path()).await;
                owner = r;
            }
            Step::Write(r) => {
                let run = &mut runs[r];
                let rows = next_row..next_row + 5;
                next_row += 5;
                let id = run.next_checkpoint;
                run.next_checkpoint += 1;
                run.driver.checkpoint(id, rows.clone()).await;
                run.pending.extend(rows);
            }
            Step::Commit(r) | Step::CommitWhileTheOtherRestarts(r) => {
                let interleave = matches!(step, Step::CommitWhileTheOtherRestarts(_));
                let last = runs[r].next_checkpoint - 1;
                if runs[r].pending.is_empty() {
                    continue;
                }
                let result = if interleave {
                    let mut run = runs.remove(r);
                    run.pause.arm(1);
                    let paused = Arc::clone(&run.pause.paused);
                    let go = Arc::clone(&run.pause.go);
                    let task = tokio::spawn(async move {
                        let result = run.driver.commit(last).await;
                        (run, result)
                    });
                    // The commit may stop before the update (already fenced).
                    let reached = tokio::select! {
                        () = paused.notified() => true,
                        () = tokio::time::sleep(ms(5_000)) => false,
                    };
                    // The other run is the one left in `runs`.
                    runs[0] = start_run(dir.path()).await;
                    let new_owner = 1 - r;
                    if reached {
                        go.notify_one();
                    }
                    let (run, result) = task.await.unwrap();
                    runs.insert(r, run);
                    let expected_ok = false;
                    check_outcome(&result, expected_ok, &mut runs[r]);
                    owner = new_owner;
                    result
                } else {
                    let expected_ok = owner == r && !runs[r].fenced;
                    let result = runs[r].driver.commit(last).await;
                    check_outcome(&result, expected_ok, &mut runs[r]);
                    result
                };
                if result.is_ok() {
                    committed.append(&mut runs[r].pending);
                }
            }
        }
    }
    let t = table(&CatalogConfig::sqlite(dir.path())).await;
    let mut want = committed;
    want.sort_unstable();
    assert_eq!(
        ids(&t).await,
        want,
        "the table holds the successful commits once"
    );
    assert_data_only_from_the_newest_claim(&t);
}

fn check_outcome(result: &StreamResult<()>, expected_ok: bool, run: &mut RunState) {
    match result {
        Ok(()) => assert!(expected_ok, "a run that does not own the sink committed"),
        Err(e) => {
            assert!(!expected_ok, "the owner's commit failed: {e}");
            assert!(matches!(e, StreamError::Fenced { .. }), "{e:?}");
            run.fenced = true;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, max_shrink_iters: 50, ..ProptestConfig::default() })]

    /// Interleavings of two runs' claims and commits: only the run with
    /// the newest claim commits, and the table holds what it committed,
    /// once.
    #[test]
    fn interleaved_claims_and_commits_of_two_runs_leave_one_writer(steps in proptest::collection::vec(step(), 4..14)) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(play(steps));
    }
}
