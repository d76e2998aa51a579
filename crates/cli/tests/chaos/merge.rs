//! Merge before commit under SIGKILL: the chaos job with a commit cadence
//! of 1.5 s (5 checkpoints of 300 ms held back), so every commit takes
//! merged files; the process is killed at each step of a merge (planned,
//! half written, written), inside the commit that takes the merged files
//! (before and after the catalog update), and after that commit before the
//! small files are deleted; records are produced all the while. pyiceberg
//! finds every record once, the table holds merged files, and no merged
//! file of a killed run is left that no snapshot holds.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_each_merge_step_a_job_with_a_commit_cadence_leaves_every_record_once() {
    let (bootstrap, topic) = new_topic("chaos-merge").await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let text = job_text(&dir, &bootstrap, &topic, "").replace(
        "[checkpoint]",
        "[sink.commit]\ninterval = \"1500ms\"\n\n[checkpoint]",
    );
    assert!(text.contains("[sink.commit]"), "{text}");
    let job = dir.join("job.toml");
    std::fs::write(&job, text).unwrap();

    // 5,000 up front, then 2,000 a second while the kills go on.
    let n: u64 = 40_000;
    let producer = {
        let (bootstrap, topic) = (bootstrap.clone(), topic.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let records = (0..n).map(move |id| {
                if id >= 5_000 {
                    let due = Duration::from_secs_f64((id - 5_000) as f64 / 2_000.0);
                    if let Some(wait) = due.checked_sub(start.elapsed()) {
                        std::thread::sleep(wait);
                    }
                }
                ((id % PARTITIONS as u64) as i32, bid_json(id))
            });
            produce_stream(&bootstrap, &topic, &[], records)
        })
    };

    // Each kill: the markers to pass, in order; the process dies at the last.
    let kills: [&[&str]; 6] = [
        &["CHAOS merge paused planned"],
        &["CHAOS merge paused writing"],
        &["CHAOS merge paused written"],
        &[
            "CHAOS merge paused written",
            "CHAOS commit paused before update",
        ],
        &[
            "CHAOS merge paused written",
            "CHAOS commit paused after update",
        ],
        &["CHAOS merge paused committed"],
    ];
    for (k, markers) in kills.iter().enumerate() {
        let mut run = Run::start(&job, &dir, u32::try_from(k).unwrap());
        for marker in *markers {
            assert!(
                run.wait_for(marker, Duration::from_secs(60)),
                "run {k}: no `{marker}` within 60 s; log: {}",
                std::fs::read_to_string(&run.log).unwrap_or_default()
            );
        }
        run.assert_alive();
        run.kill();
    }
    let produced = producer.join().unwrap().unwrap();
    assert_eq!(produced, n);

    // The last run goes on until the table holds everything, then stops.
    let mut last = Run::start(&job, &dir, 100);
    // Running (the killed runs may have committed everything already): it
    // must be up to stop with a final checkpoint.
    assert!(
        last.wait_for("checkpoint completed", Duration::from_secs(60)),
        "the last run completed no checkpoint within 60 s; log: {}",
        std::fs::read_to_string(&last.log).unwrap_or_default()
    );
    let catalog = tinyflow_connectors_iceberg::CatalogConfig::sqlite(&dir);
    let table = TableReader::open(&catalog, "chaos", "bids").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    while committed_rows(&table).await < n {
        last.assert_alive();
        assert!(
            Instant::now() < deadline,
            "after 180 s the table holds {} of {n} rows; log: {}",
            committed_rows(&table).await,
            std::fs::read_to_string(&last.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let log = std::fs::read_to_string(&last.log).unwrap_or_default();
    last.stop();

    let py = tinyflow_tests::pyiceberg_read(&dir, "chaos.bids", &["id", "price"]);
    assert_eq!(py["rows"], n, "{py}");
    assert_eq!(py["distinct_ids"], n, "{py}");
    assert_eq!(py["id_sum"], (0..n).sum::<u64>(), "{py}");
    assert_eq!(py["value_sum"], (0..n).map(price_of).sum::<u64>(), "{py}");
    let loaded = table.load().await.unwrap();
    let live = current_files(&loaded).await;
    assert_eq!(py["files"], live.len(), "{py}");
    let merged_name = |name: &str| -> Option<u64> {
        name.strip_prefix("chaos-m")?
            .split('-')
            .next()?
            .parse()
            .ok()
    };
    assert!(
        live.iter().any(|f| merged_name(f).is_some()),
        "no merged file in the table: {live:?}; last log: {log}"
    );
    let epoch = tinyflow_connectors_iceberg::table_epoch(&loaded, "chaos");
    // Merged files of the killed runs (older epochs) that no snapshot holds
    // were deleted when a later run recovered.
    let mut stale = Vec::new();
    let mut stack = vec![dir.join("warehouse")];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if merged_name(&name).is_some_and(|e| e < epoch)
                && !live.contains(&name)
                && !referenced_anywhere(&loaded, &name).await
            {
                stale.push(name);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "merged files of killed runs left behind: {stale:?}"
    );
}

/// The names of the data files the table's current snapshot holds.
async fn current_files(table: &iceberg::table::Table) -> Vec<String> {
    let io = table.file_io();
    let snapshot = table.metadata().current_snapshot().unwrap();
    let list = table.manifest_list_reader(snapshot).load().await.unwrap();
    let mut names = Vec::new();
    for m in list.entries() {
        let manifest = m.load_manifest(io).await.unwrap();
        for e in manifest.entries().iter().filter(|e| e.is_alive()) {
            names.push(
                e.data_file()
                    .file_path()
                    .rsplit('/')
                    .next()
                    .unwrap()
                    .to_owned(),
            );
        }
    }
    names
}

/// Whether any snapshot of the table (not only the current one) holds a
/// data file of this name.
async fn referenced_anywhere(table: &iceberg::table::Table, name: &str) -> bool {
    let io = table.file_io();
    for snapshot in table.metadata().snapshots() {
        let list = table.manifest_list_reader(snapshot).load().await.unwrap();
        for m in list.entries() {
            let manifest = m.load_manifest(io).await.unwrap();
            if manifest
                .entries()
                .iter()
                .any(|e| e.data_file().file_path().ends_with(name))
            {
                return true;
            }
        }
    }
    false
}
