//! `tinyflow maintain JOB.toml` on a job's table: beside the running job
//! (its commits and the expiry's are ordered by the catalog, and the job
//! goes on), after the job was killed (a dry run that changes nothing, then
//! a round that keeps one snapshot and three previous metadata files), and
//! then a run restarted from the killed run's checkpoints, which must
//! leave each record once. Configuration errors in `[sink.maintenance]`
//! or on the command line exit 2 naming the key.

use super::*;

/// The chaos job (`source_extra` in `[source]`) with `[sink.maintenance]`
/// `maintenance`, in `dir/job.toml`.
fn maintained_job(
    dir: &Path,
    bootstrap: &str,
    topic: &str,
    source_extra: &str,
    maintenance: &str,
) -> PathBuf {
    let path = dir.join("job.toml");
    let text = format!(
        "{}\n[sink.maintenance]\n{maintenance}\n",
        job_text(dir, bootstrap, topic, source_extra)
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// The snapshots pyiceberg sees in `chaos.bids`.
fn snapshot_count(dir: &Path) -> usize {
    tinyflow_tests::pyiceberg_read(dir, "chaos.bids", &["id"])["snapshots"]
        .as_array()
        .unwrap()
        .len()
}

/// The table's `*.metadata.json` files on disk, as `file://` locations.
fn metadata_files(dir: &Path) -> std::collections::BTreeSet<String> {
    let metadata = dir.join("warehouse/chaos/bids/metadata");
    std::fs::read_dir(&metadata)
        .unwrap_or_else(|e| panic!("listing {}: {e}", metadata.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".metadata.json"))
        .map(|p| format!("file://{}", p.display()))
        .collect()
}

/// The version in a metadata file's name (`00042-<uuid>.metadata.json`).
fn version(location: &str) -> u64 {
    let name = location.rsplit('/').next().unwrap();
    name.split('-').next().unwrap().parse().unwrap()
}

/// The metadata files the table keeps (its log and the current one) are
/// on disk, and none older than the oldest of them: `kept` of them, plus
/// at most the files of commit attempts that lost a race (of a version
/// above those).
async fn metadata_kept(
    catalog: &tinyflow_connectors_iceberg::CatalogConfig,
    dir: &Path,
    kept: usize,
) {
    let table = TableReader::open(catalog, "chaos", "bids")
        .await
        .unwrap()
        .load()
        .await
        .unwrap();
    let logged: std::collections::BTreeSet<String> = table
        .metadata()
        .metadata_log()
        .iter()
        .map(|l| l.metadata_file.clone())
        .chain(table.metadata_location().map(str::to_owned))
        .collect();
    assert_eq!(logged.len(), kept, "{logged:?}");
    let on_disk = metadata_files(dir);
    assert!(logged.is_subset(&on_disk), "{logged:?} {on_disk:?}");
    let floor = logged.iter().map(|l| version(l)).min().unwrap();
    let older: Vec<&String> = on_disk.iter().filter(|f| version(f) < floor).collect();
    assert!(older.is_empty(), "left behind: {older:?}");
}

/// Produces bids `from..to` round-robin over the partitions in 20 slices,
/// `pause` apart, on a thread of its own.
fn produce_slowly(
    bootstrap: &str,
    topic: &str,
    from: u64,
    to: u64,
    pause: Duration,
) -> std::thread::JoinHandle<()> {
    let (bootstrap, topic) = (bootstrap.to_owned(), topic.to_owned());
    std::thread::spawn(move || {
        let step = ((to - from) / 20).max(1);
        let mut at = from;
        while at < to {
            let end = (at + step).min(to);
            produce_stream(
                &bootstrap,
                &topic,
                &[],
                (at..end).map(|id| ((id % PARTITIONS as u64) as i32, bid_json(id))),
            )
            .unwrap();
            at = end;
            std::thread::sleep(pause);
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintain_beside_a_running_job_then_after_a_kill_and_the_restarted_job_reads_each_record_once()
 {
    let n = 3_000u64;
    let (bootstrap, topic) = fresh_topic("maintained-bids", n).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    // The job's own rounds off: this test's rounds are `tinyflow maintain`'s.
    let job = maintained_job(
        &dir,
        &bootstrap,
        &topic,
        "",
        "enabled = false\nmetadata_versions_max = 3",
    );
    let job_arg = job.to_str().unwrap();
    let catalog = tinyflow_connectors_iceberg::CatalogConfig::sqlite(&dir);

    let mut run = Run::start(&job, &dir, 0);
    assert!(
        run.wait_for("CHAOS commit paused after", Duration::from_secs(60)),
        "no commit within 60 s"
    );
    // More records while the job runs, and rounds beside its commits
    // until they are all produced.
    let producer = produce_slowly(&bootstrap, &topic, n, 2 * n, Duration::from_millis(200));
    let (mut rounds, mut expired) = (0, 0);
    while rounds < 3 || !producer.is_finished() {
        let out = maintain_now(job_arg, "2", &[]);
        assert!(
            out.contains("table chaos.bids") && out.contains("kept)"),
            "{out}"
        );
        expired += out
            .split("expired ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|k| k.parse::<usize>().ok())
            .unwrap_or_else(|| panic!("no snapshot count in {out}"));
        rounds += 1;
        run.assert_alive();
    }
    producer.join().unwrap();
    assert!(
        expired > 0,
        "{rounds} rounds beside the job expired none of its commits"
    );
    let table = TableReader::open(&catalog, "chaos", "bids").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while committed_rows(&table).await < 2 * n {
        run.assert_alive();
        assert!(
            Instant::now() < deadline,
            "after 120 s the table holds {} of {} rows",
            committed_rows(&table).await,
            2 * n
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A crash: the next run restores this run's newest checkpoint.
    run.kill();
    read_each_once(&dir, 2 * n);

    let snapshots = snapshot_count(&dir);
    assert!(snapshots > 1, "{snapshots} snapshots");
    let files = metadata_files(&dir);
    let out = maintain_now(job_arg, "1", &["--dry-run"]);
    assert!(
        out.contains("dry run: nothing was changed")
            && out.contains(&format!(
                "would expire {} snapshots (1 kept)",
                snapshots - 1
            ))
            && out.contains("would delete file://"),
        "{out}"
    );
    assert_eq!(
        snapshot_count(&dir),
        snapshots,
        "the dry run expired nothing"
    );
    assert_eq!(metadata_files(&dir), files, "the dry run deleted nothing");

    let out = maintain_now(job_arg, "1", &[]);
    assert!(
        out.contains(&format!("expired {} snapshots (1 kept)", snapshots - 1))
            && out.contains("policy: expire snapshots older than 0s keeping at least 1; keep 3 previous metadata files"),
        "{out}"
    );
    assert_eq!(snapshot_count(&dir), 1);
    // The 3 previous metadata files and the current one.
    metadata_kept(&catalog, &dir, 4).await;
    let table = read_each_once(&dir, 2 * n);
    assert!(
        table["properties"]["tinyflow.sink.chaos.checkpoint-id"]
            .as_str()
            .is_some_and(|id| id.parse::<u64>().is_ok()),
        "the dedupe marker stays: {table}"
    );

    // More records, and the job again, bounded: it restores the killed
    // run's checkpoint, commits what the table lacks, drops what it holds.
    produce_slowly(&bootstrap, &topic, 2 * n, 3 * n, Duration::ZERO)
        .join()
        .unwrap();
    let job = maintained_job(
        &dir,
        &bootstrap,
        &topic,
        "bounded = true",
        "enabled = false\nmetadata_versions_max = 3",
    );
    Run::start(&job, &dir, 1).exits_0_within_120_s("the restarted bounded job did not end");
    read_each_once(&dir, 3 * n);
}

/// Bad `[sink.maintenance]` values and flags exit 2 naming the key, for
/// `maintain` and `validate` alike, before anything is contacted; a table
/// that does not exist is refused, not created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintain_refuses_bad_settings_with_exit_2_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    for (maintenance, key) in [
        (
            "expire_older_than = \"soon\"",
            "sink.maintenance.expire_older_than",
        ),
        ("retain_last = 0", "sink.maintenance.retain_last"),
        ("every = \"10\"", "sink.maintenance.every"),
        (
            "metadata_versions_max = \"all\"",
            "sink.maintenance.metadata_versions_max",
        ),
        ("retian_last = 3", "retian_last"),
    ] {
        let job = maintained_job(&dir, "127.0.0.1:1", "t", "", maintenance);
        let job_arg = job.to_str().unwrap();
        for command in ["maintain", "validate"] {
            let (code, out, err) = tinyflow(&[command, job_arg]);
            assert_eq!(code, Some(2), "{command} with {maintenance}: {out}{err}");
            assert!(err.contains(key), "{command} with {maintenance}: {err}");
        }
    }
    let job = maintained_job(&dir, "127.0.0.1:1", "t", "", "enabled = true");
    let job_arg = job.to_str().unwrap();
    for (flag, value) in [
        ("--older-than", "5x"),
        ("--retain-last", "0"),
        ("--metadata-versions-max", "all"),
    ] {
        let (code, out, err) = tinyflow(&["maintain", job_arg, flag, value]);
        assert_eq!(code, Some(2), "{flag} {value}: {out}{err}");
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
    // No table yet: nothing to maintain, and nothing is created.
    let (code, out, err) = tinyflow(&["maintain", job_arg]);
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(
        err.contains("chaos.bids") && err.contains("does not exist"),
        "{err}"
    );
    let (code, _, _) = tinyflow(&["maintain", job_arg]);
    assert_eq!(code, Some(2), "still not created");
}

/// `tinyflow maintain JOB [extra] --older-than 0s --retain-last N`, which
/// must succeed: what it printed.
fn maintain_now(job_arg: &str, retain_last: &str, extra: &[&str]) -> String {
    let mut args = vec!["maintain", job_arg];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--older-than", "0s", "--retain-last", retain_last]);
    let (code, out, err) = tinyflow(&args);
    assert_eq!(code, Some(0), "{out}{err}");
    out
}
