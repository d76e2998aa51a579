//! Merge before commit (#24): a commit that takes several checkpoints
//! merges each partition's small files first; a crash at each step of the
//! merge (and of the commit that follows) leaves every record once, as
//! pyiceberg reads it, and no merged file that no snapshot references.
//! And the writers: rows distributed by table partition, with a memory
//! budget instead of a file per batch.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use tinyflow_api::{CheckpointId, WriterFactory};

use tinyflow_connectors_iceberg::{
    CommitCadence, CommitStep, Fault, IcebergSink, IcebergSinkConfig,
};
use tinyflow_tests::ms;

use crate::iceberg_sink::{Driver, NS, TABLE, batch, config, ctx, data_files, ids, range};

/// Every data file the table's current snapshot holds.
async fn live_files(table: &iceberg::table::Table) -> HashSet<String> {
    data_files(table).await.into_iter().collect()
}

/// Every Parquet file under the warehouse, as `file:` locations.
fn files_on_disk(dir: &Path) -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "parquet") {
                out.push(path.display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(&dir.join("warehouse"), &mut out);
    out
}

fn is_merged(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or("");
    name.split('-').any(|part| {
        part.len() > 1 && part.starts_with('m') && part[1..].bytes().all(|b| b.is_ascii_digit())
    })
}

fn merging(dir: &Path, sink_id: &str) -> IcebergSinkConfig {
    let mut c = config(dir, sink_id);
    c.cadence = CommitCadence {
        every_checkpoints: Some(4),
        ..CommitCadence::default()
    };
    c.merge_pending = true;
    // The cleanup on recovery is what must find uncommitted merged files.
    c.orphan_min_age = Some(std::time::Duration::from_secs(3600));
    c
}

/// 4 checkpoints of 200 rows written 20 at a time: every checkpoint has
/// a file per partition (3 parts x 2 days x 4 buckets).
async fn four_checkpoints(d: &mut Driver) {
    for id in 1..=4u64 {
        let from = (id as i64 - 1) * 200;
        d.checkpoint_in(id, from..from + 200, 20).await;
        d.commit(id).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_checkpoints_commit_as_one_file_per_partition_and_the_small_ones_go() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Driver::new(merging(dir.path(), "s")).await;
    four_checkpoints(&mut d).await;
    let small = files_on_disk(dir.path());
    // The merge runs beside the checkpoints; the job's end waits for it.
    d.committer.job_finished().await.unwrap();
    let table = d.table().await;
    assert_eq!(ids(&table).await, range(0..800));
    let live = live_files(&table).await;
    assert!(
        live.iter().all(|f| is_merged(f)),
        "unmerged files committed: {live:?}"
    );
    let partitions: HashSet<String> = live
        .iter()
        .map(|f| Path::new(f).parent().unwrap().display().to_string())
        .collect();
    assert_eq!(live.len(), partitions.len(), "one file per partition");
    assert!(
        small.len() >= 4 * partitions.len(),
        "{} small files",
        small.len()
    );
    // The replaced files are deleted (in the background).
    let deadline = std::time::Instant::now() + ms(10_000);
    loop {
        let left: Vec<String> = files_on_disk(dir.path())
            .into_iter()
            .filter(|f| !live.iter().any(|l| l.ends_with(f.as_str())))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "replaced files left: {left:?}"
        );
        tokio::time::sleep(ms(100)).await;
    }
    let py = tinyflow_tests::pyiceberg_read(dir.path(), &format!("{NS}.{TABLE}"), &["id"]);
    assert_eq!(py["rows"], 800, "{py}");
    assert_eq!(py["distinct_ids"], 800, "{py}");
}

/// A hook that hangs the first time it reaches `at` (a process stopped
/// there, to be killed) and records what it saw.
fn hang_at(
    at: CommitStep,
    seen: Arc<Mutex<Vec<CommitStep>>>,
) -> tinyflow_connectors_iceberg::FaultHook {
    let fired = Arc::new(std::sync::atomic::AtomicBool::new(false));
    Arc::new(move |step| -> BoxFuture<'static, Fault> {
        seen.lock().unwrap().push(step);
        if step == at && !fired.swap(true, std::sync::atomic::Ordering::SeqCst) {
            Box::pin(std::future::pending())
        } else {
            Box::pin(async { Fault::Proceed })
        }
    })
}

/// A crash at each step of a merge and of the commit that takes the
/// merged files, in the same process (the attempt restarts) and in a new
/// one (a new run claims the sink): the restored run commits each record
/// once, and on recovery deletes every merged file that was written but
/// not committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_each_merge_step_leaves_every_record_once_and_no_merged_orphan() {
    let steps = [
        CommitStep::MergePlanned,
        CommitStep::MergeWriting,
        CommitStep::MergeWritten,
        CommitStep::BeforeUpdate { attempt: 0 },
        CommitStep::AfterUpdate { attempt: 0 },
        CommitStep::MergeCommitted,
    ];
    for new_process in [false, true] {
        for at in steps {
            let dir = tempfile::tempdir().unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let mut c = merging(dir.path(), "s");
            c.fault_hook = Some(hang_at(at, Arc::clone(&seen)));
            let mut d = Driver::new(c).await;
            let why = format!("crash at {at:?}, new process: {new_process}");
            // Checkpoints of 200 rows each; the cadence commits at the 4th:
            // merge (beside the checkpoints), then commit. A hang inside
            // the commit holds the committer: the crash comes from
            // outside, as a kill would.
            let mut last = 0u64;
            let deadline = std::time::Instant::now() + ms(20_000);
            while !seen.lock().unwrap().contains(&at) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{why}: never reached; saw {:?}",
                    seen.lock().unwrap()
                );
                last += 1;
                let from = (last as i64 - 1) * 200;
                d.checkpoint_in(last, from..from + 200, 20).await;
                let _ = tokio::time::timeout(ms(2_000), d.commit(last)).await;
                if last >= 4 {
                    tokio::time::sleep(ms(100)).await;
                }
            }
            if matches!(at, CommitStep::MergeWriting | CommitStep::MergeWritten) {
                let written = files_on_disk(dir.path());
                assert!(
                    written.iter().any(|f| is_merged(f)),
                    "{why}: no merged file written yet"
                );
            }
            // The crash, and the restore from the newest checkpoint.
            if new_process {
                let states = d.states.clone();
                drop(d);
                d = Driver::with_sink(IcebergSink::new(merging(dir.path(), "s")).unwrap()).await;
                d.states = states;
            }
            if new_process {
                d.try_restore(last).await
            } else {
                d.restart_attempt(last).await
            }
            .unwrap_or_else(|e| panic!("{why}: {e}"));
            // The rest of the input (4 more checkpoints: the restored run
            // merges too), and the end.
            for id in last + 1..=last + 4 {
                let from = (id as i64 - 1) * 200;
                d.checkpoint_in(id, from..from + 200, 20).await;
                d.commit(id).await.unwrap();
            }
            let end = (last as i64 + 4) * 200;
            d.committer.job_finished().await.unwrap();
            let table = d.table().await;
            assert_eq!(ids(&table).await, range(0..end), "{why}");
            let live = live_files(&table).await;
            assert!(
                live.iter().any(|f| is_merged(f)),
                "{why}: the restored run committed no merged file"
            );
            let orphans = |live: &HashSet<String>| -> Vec<String> {
                files_on_disk(dir.path())
                    .into_iter()
                    .filter(|f| is_merged(f) && !live.iter().any(|l| l.ends_with(f.as_str())))
                    .collect()
            };
            // A merge not yet handed to a commit is found by the next
            // attempt. One handed to a commit may still land after the
            // attempt is gone (its catalog update sent), so within the
            // process only the age rule takes its files; the next process
            // takes them at once (they are of an older epoch).
            let handed_to_commit = matches!(
                at,
                CommitStep::BeforeUpdate { .. }
                    | CommitStep::AfterUpdate { .. }
                    | CommitStep::MergeCommitted
            );
            if new_process || !handed_to_commit {
                assert!(
                    orphans(&live).is_empty(),
                    "{why}: merged files no snapshot holds: {:?}",
                    orphans(&live)
                );
            }
            drop(d);
            let next = IcebergSink::new(merging(dir.path(), "s")).unwrap();
            drop(Driver::with_sink(next).await);
            assert!(
                orphans(&live).is_empty(),
                "{why}: merged files no snapshot holds after the next start: {:?}",
                orphans(&live)
            );
            let py = tinyflow_tests::pyiceberg_read(dir.path(), &format!("{NS}.{TABLE}"), &["id"]);
            assert_eq!(py["rows"], end, "{why}: {py}");
            assert_eq!(py["distinct_ids"], end, "{why}: {py}");
        }
    }
}

/// A merge that fails (here: after it wrote its files, as on a full disk)
/// commits the small files as they are: nothing is lost or held back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_merge_commits_the_small_files_as_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut c = merging(dir.path(), "s");
    let crash = Arc::clone(&seen);
    c.fault_hook = Some(Arc::new(move |step| -> BoxFuture<'static, Fault> {
        crash.lock().unwrap().push(step);
        Box::pin(async move {
            if step == CommitStep::MergeWritten {
                Fault::Crash("the disk is full".to_owned())
            } else {
                Fault::Proceed
            }
        })
    }));
    let mut d = Driver::new(c).await;
    four_checkpoints(&mut d).await;
    d.committer.job_finished().await.unwrap();
    let table = d.table().await;
    assert_eq!(ids(&table).await, range(0..800));
    let live = live_files(&table).await;
    assert!(
        live.iter().all(|f| !is_merged(f)),
        "merged files committed after a failed merge"
    );
    assert!(seen.lock().unwrap().contains(&CommitStep::MergeWritten));
    // The merge wrote its files before it failed, and deleted them.
    let left: Vec<String> = files_on_disk(dir.path())
        .into_iter()
        .filter(|f| is_merged(f))
        .collect();
    assert!(left.is_empty(), "a failed merge left its files: {left:?}");
}

/// A merge that does not end (storage that hangs) is abandoned after
/// `merge_timeout`: the commit takes the small files, and the rows are
/// visible, not held back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merge_that_hangs_is_abandoned_and_the_small_files_committed() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = merging(dir.path(), "s");
    c.merge_timeout = ms(500);
    c.fault_hook = Some(hang_at(
        CommitStep::MergePlanned,
        Arc::new(Mutex::new(Vec::new())),
    ));
    let mut d = Driver::new(c).await;
    four_checkpoints(&mut d).await;
    tokio::time::sleep(ms(600)).await;
    // The next completed checkpoint finds the merge past its time, and
    // the checkpoints it held commit (5 waits for its own cadence).
    d.checkpoint_in(5, 800..1000, 20).await;
    d.commit(5).await.unwrap();
    let table = d.table().await;
    assert_eq!(ids(&table).await, range(0..800));
    assert!(live_files(&table).await.iter().all(|f| !is_merged(f)));
}

/// A writer over its memory budget closes its largest files, not a file
/// per batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_its_memory_budget_a_writer_closes_its_largest_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), "s");
    c.max_writer_memory = 1 << 20;
    let sink = IcebergSink::new(c).unwrap();
    let mut w = sink.writers().create(&ctx("w", 1)).await.unwrap();
    // 60,000 rows in batches of 500 over 24 partitions: a 1 MiB budget
    // holds a part of them, so files close by size, far fewer than one per
    // part of a batch.
    for k in 0..120i64 {
        w.write(vec![batch(k * 500..(k + 1) * 500)]).await.unwrap();
    }
    let files = w.flush(CheckpointId::new(1)).await.unwrap();
    assert_eq!(files.iter().map(|f| f.records).sum::<u64>(), 60_000);
    let parts_written = 120 * 24;
    assert!(
        files.len() < parts_written / 4,
        "{} files for {parts_written} batch parts",
        files.len()
    );
    assert!(
        files.len() > 24,
        "{} files: the budget closed none early",
        files.len()
    );
}

/// Rows reach the writers by table partition: a job of 2 writer subtasks
/// commits one file per partition, where round-robin batches make each
/// writer write a file for nearly every partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_partition_two_writers_write_one_file_per_partition() {
    use tinyflow_api::testing::VecSource;
    use tinyflow_api::{JobBuilder, JobId};
    use tinyflow_checkpoint::CheckpointConfig;
    use tinyflow_checkpoint::testing::MemoryCheckpointStore;
    use tinyflow_connectors_iceberg::Distribution;
    use tinyflow_runtime::{JobRunner, RuntimeConfig};
    let mut files = Vec::new();
    for distribution in [Distribution::Hash, Distribution::None] {
        let dir = tempfile::tempdir().unwrap();
        let job = JobBuilder::new(JobId::new("by-partition").unwrap());
        let input: Vec<Vec<arrow_array::RecordBatch>> = (0..2i64)
            .map(|p| {
                (0..20i64)
                    .map(|k| batch((p * 20 + k) * 100..(p * 20 + k + 1) * 100))
                    .collect()
            })
            .collect();
        let stream = job.source("batches", 2, VecSource::new(input).batch_size(1));
        let mut c = config(dir.path(), "s");
        c.distribution = distribution;
        IcebergSink::new(c).unwrap().attach(stream, "events", 2);
        let config = RuntimeConfig {
            checkpoint: CheckpointConfig {
                // Only the final checkpoint: one commit of everything.
                interval: Some(ms(3_600_000)),
                timeout: ms(20_000),
                ..CheckpointConfig::default()
            },
            ..RuntimeConfig::default()
        };
        JobRunner::new(
            job.build().unwrap(),
            Arc::new(MemoryCheckpointStore::new()),
            config,
        )
        .run()
        .await
        .unwrap();
        let table = IcebergSink::new(config_for(dir.path()))
            .unwrap()
            .load_table()
            .await
            .unwrap();
        assert_eq!(ids(&table).await, range(0..4_000), "{distribution:?}");
        let live = live_files(&table).await;
        let partitions: HashSet<String> = live
            .iter()
            .map(|f| Path::new(f).parent().unwrap().display().to_string())
            .collect();
        files.push((distribution, live.len(), partitions.len()));
    }
    let (_, hash_files, partitions) = files[0];
    assert_eq!(hash_files, partitions, "by partition: {files:?}");
    let (_, none_files, _) = files[1];
    assert!(none_files > partitions * 3 / 2, "round-robin: {files:?}");
}

fn config_for(dir: &Path) -> IcebergSinkConfig {
    config(dir, "s")
}
