//! One job as several worker processes (`tinyflow run --worker I/N`) on the
//! real broker, committing to one table: the job first runs in one process,
//! then is spread over 3 workers (`--rescale-from 1`); a worker killed and
//! restarted again and again, a worker started a second time elsewhere (the older
//! one is fenced inside its next commit), a rescale 3 -> 2 while the old
//! workers still run (they are fenced, and an old worker started again is
//! refused), a rescale 2 -> 4 after a clean stop; records are produced all
//! the while. pyiceberg finds every record once.

use super::*;

/// Partitions of the workers' topic.
const WORKER_PARTITIONS: i32 = 12;

/// The chaos job with parallelism 1 per worker, its checkpoints under
/// `checkpoints`, written to `dir/name`.
fn workers_job(dir: &Path, name: &str, bootstrap: &str, topic: &str, checkpoints: &str) -> PathBuf {
    let text = job_text(dir, bootstrap, topic, "")
        .replace("parallelism = 2", "parallelism = 1")
        .replace(
            &format!("dir = \"{}/checkpoints\"", dir.display()),
            &format!("dir = \"{}/{checkpoints}\"", dir.display()),
        );
    assert!(text.contains(checkpoints), "{text}");
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Starts the processes of the test, each with a log of its own.
struct Spawner {
    dir: PathBuf,
    next: u32,
}

impl Spawner {
    fn worker(&mut self, job: &Path, args: &[&str], envs: &[(&str, &str)]) -> Run {
        self.next += 1;
        Run::start_args(job, &self.dir, 100 + self.next, "info", 0, envs, args)
    }

    fn workers(&mut self, job: &Path, n: u32, extra: &[&str]) -> Vec<Run> {
        (0..n)
            .map(|i| {
                let w = format!("{i}/{n}");
                let mut args = vec!["--worker", w.as_str()];
                args.extend_from_slice(extra);
                self.worker(job, &args, &[])
            })
            .collect()
    }
}

/// Waits until `run` logged a commit of its own.
fn commits(run: &mut Run, what: &str) {
    assert!(
        run.wait_for("CHAOS commit paused after", Duration::from_secs(90)),
        "{what}: no commit within 90 s; log: {}",
        std::fs::read_to_string(&run.log).unwrap_or_default()
    );
}

/// Waits for `run` to exit by itself with `code`; its log.
fn exits_with(run: &mut Run, code: i32, what: &str) -> String {
    let (got, log) = run.exit_code_within_or(
        Duration::from_secs(90),
        &format!("{what}: still running after 90 s"),
    );
    assert_eq!(got, Some(code), "{what}: exit {got:?}; log: {log}");
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_killed_fenced_and_rescaled_to_2_then_4_leave_every_record_once() {
    let n = env_count("TINYFLOW_WORKERS_RECORDS", 200_000).max(200_000);
    let bootstrap = tinyflow_connectors_kafka::testing::bootstrap();
    let topic = format!(
        "workers-bids-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    create_topic(&bootstrap, &topic, WORKER_PARTITIONS)
        .await
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = workers_job(&dir, "job.toml", &bootstrap, &topic, "checkpoints");
    // The same job on "another machine": checkpoints of its own.
    let elsewhere = workers_job(&dir, "elsewhere.toml", &bootstrap, &topic, "elsewhere");

    // A tenth up front, the rest paced over about 40 s, while the workers
    // are killed, fenced and rescaled.
    let producer = {
        let (bootstrap, topic) = (bootstrap.clone(), topic.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let paced_from = n / 10;
            let per_second = (n - paced_from) as f64 / 40.0;
            let records = (0..n).map(move |id| {
                if id >= paced_from {
                    let due = Duration::from_secs_f64((id - paced_from) as f64 / per_second);
                    if let Some(wait) = due.checked_sub(start.elapsed()) {
                        std::thread::sleep(wait);
                    }
                }
                ((id % WORKER_PARTITIONS as u64) as i32, bid_json(id))
            });
            produce_stream(&bootstrap, &topic, &[], records)
        })
    };

    let mut spawn = Spawner {
        dir: dir.clone(),
        next: 0,
    };
    // The job in one process first, stopped cleanly.
    let mut single = spawn.worker(&job, &[], &[]);
    commits(&mut single, "the job in one process");
    single.stop();
    // Three workers start at once: one of them makes the table's first
    // layout from the single process's commits, the others join it.
    let mut three = spawn.workers(&job, 3, &["--rescale-from", "1"]);
    for (i, w) in three.iter_mut().enumerate() {
        commits(w, &format!("worker {i}/3"));
    }

    // Worker 1 is killed and restarted again and again; it goes on from
    // its checkpoints.
    let mut rng = SplitMix64::new(0x0057_0123);
    for k in 0..4 {
        std::thread::sleep(Duration::from_millis(200 + rng.below(1_500)));
        three[1].assert_alive();
        three.remove(1).kill();
        three.insert(1, spawn.worker(&job, &["--worker", "1/3"], &[]));
        commits(&mut three[1], &format!("worker 1/3 after kill {k}"));
    }

    // Worker 2 is started a second time, elsewhere: the newer claims its
    // sink, and the older is fenced inside its next commit (exit 3).
    let mut second = spawn.worker(&elsewhere, &["--worker", "2/3"], &[]);
    assert!(
        second.wait_for("claimed the sink", Duration::from_secs(60)),
        "the second worker 2/3 did not claim; log: {}",
        std::fs::read_to_string(&second.log).unwrap_or_default()
    );
    let log = exits_with(&mut three[2], 3, "the older worker 2/3");
    assert!(log.contains("fenced"), "{log}");
    three[2] = second;
    commits(&mut three[2], "the second worker 2/3");

    // Rescale 3 -> 2 while the old workers run (as in a rolling update):
    // the first new worker retires the old layout in the table; each old
    // worker is fenced at its next commit.
    let mut two = spawn.workers(&job, 2, &["--rescale-from", "3@1"]);
    for (i, old) in three.iter_mut().enumerate() {
        let log = exits_with(old, 3, &format!("old worker {i}/3 after the rescale"));
        assert!(log.contains("retired by layout generation 2"), "{log}");
    }
    for (i, w) in two.iter_mut().enumerate() {
        commits(w, &format!("worker {i}/2"));
    }
    // An old worker started again is refused at start, naming the layout.
    let mut late = spawn.worker(&job, &["--worker", "0/3"], &[]);
    let log = exits_with(&mut late, 2, "an old worker 0/3 started after the rescale");
    assert!(
        log.contains("this worker was started as 0/3")
            && log.contains("is 2 workers (generation 2"),
        "{log}"
    );
    // So is the job in one process, on a table its workers write.
    let mut late = spawn.worker(&job, &[], &[]);
    let log = exits_with(&mut late, 2, "the job in one process after the rescale");
    assert!(log.contains("is written by 2 workers"), "{log}");

    // Rescale 2 -> 4 after a clean stop, the new workers told by the
    // environment, as a StatefulSet does.
    for w in two {
        w.stop();
    }
    let mut four: Vec<Run> = (0..4)
        .map(|i| {
            let pod = format!("tinyflow-{i}");
            spawn.worker(
                &job,
                &[],
                &[
                    ("TINYFLOW_WORKERS", "4"),
                    ("TINYFLOW_WORKER_INDEX", pod.as_str()),
                    ("TINYFLOW_RESCALE_FROM", "2@2"),
                ],
            )
        })
        .collect();

    let produced = producer.join().unwrap().unwrap();
    assert_eq!(produced, n);
    let catalog = tinyflow_connectors_iceberg::CatalogConfig::sqlite(&dir);
    let table = TableReader::open(&catalog, "chaos", "bids").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let rows = committed_rows(&table).await;
        if rows >= n {
            break;
        }
        for w in &mut four {
            w.assert_alive();
        }
        assert!(
            Instant::now() < deadline,
            "after 180 s the table holds {rows} of {n} rows"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // A little longer: a duplicate commit, if there were one, would show.
    std::thread::sleep(Duration::from_secs(2));
    let switched = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            (path.extension()? == "log").then_some(path)
        })
        .filter(|p| {
            std::fs::read_to_string(p)
                .unwrap()
                .contains("switched the table to a new layout")
        })
        .count();
    // One process -> 3, 3 -> 2 and 2 -> 4: one switch each.
    assert_eq!(switched, 3, "layout switches in the logs");
    for w in four {
        w.stop();
    }

    let table = read_each_once(&dir, n);
    let props = &table["properties"];
    let layout: serde_json::Value =
        serde_json::from_str(props["tinyflow.layout.chaos"].as_str().unwrap()).unwrap();
    assert_eq!(layout["generation"], 3, "{table}");
    assert_eq!(layout["workers"], 4, "{table}");
    let mut retired = vec!["tinyflow.sink.chaos.retired".to_owned()];
    retired.extend((0..3).map(|i| format!("tinyflow.sink.chaos.w{i}-of-3.g1.retired")));
    retired.extend((0..2).map(|i| format!("tinyflow.sink.chaos.w{i}-of-2.g2.retired")));
    for id in retired {
        assert!(props[&id].is_string(), "{id} missing: {table}");
    }
}

/// A worker's endpoint: `/healthz` answers as soon as it serves, `/readyz`
/// only once a checkpoint completed (503 with the reason before), and
/// every metric carries the worker's label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serves_healthz_readyz_and_metrics_labelled_with_the_worker() {
    let (bootstrap, topic) = fresh_topic("probe-bids", 1_000).await;
    let port = free_port();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = dir.join("job.toml");
    // The first checkpoint comes 5 s after the start: time to see the
    // worker alive but not ready.
    let text =
        job_text(&dir, &bootstrap, &topic, "").replace("interval = \"300ms\"", "interval = \"5s\"");
    std::fs::write(
        &job,
        format!("{text}\n[metrics]\naddress = \"127.0.0.1:{port}\"\n"),
    )
    .unwrap();
    let mut spawn = Spawner {
        dir: dir.clone(),
        next: 0,
    };
    let mut run = spawn.worker(&job, &["--worker", "0/1"], &[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let health = loop {
        if let Some(answer) = get(port, "/healthz") {
            break answer;
        }
        run.assert_alive();
        assert!(Instant::now() < deadline, "no /healthz within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(health, (200, "ok\n".to_owned()));
    let (code, body) = get(port, "/readyz").unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("no checkpoint completed yet"), "{body}");
    assert!(
        run.wait_for("checkpoint completed", Duration::from_secs(60)),
        "no checkpoint within 60 s; log: {}",
        std::fs::read_to_string(&run.log).unwrap_or_default()
    );
    let (code, body) = get(port, "/readyz").unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.starts_with("ready: "), "{body}");
    let (code, metrics) = get(port, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(
        tinyflow_cli::metric_sum(
            &metrics,
            "tinyflow_checkpoints_completed_total",
            Some("worker=\"0/1\"")
        ) >= 1.0,
        "{metrics}"
    );
    assert_eq!(get(port, "/nothing").unwrap().0, 404);
    let log = std::fs::read_to_string(&run.log).unwrap();
    assert!(
        log.lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with("CHAOS "))
            .all(|l| l.starts_with("worker=0/1 ")),
        "a log line without the worker: {log}"
    );
    run.stop();
}

/// Checkpoints on object storage (the S3 server of the tests): a worker
/// killed and started again from another directory (as on another
/// machine) restores its own checkpoint from S3, goes on, and the table
/// holds every record once; `tinyflow inspect` shows both workers with
/// their checkpoints on S3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarted_elsewhere_restores_its_checkpoint_from_s3() {
    let n = 8_000u64;
    let (bootstrap, topic) = new_topic("s3-state-bids").await;
    let first = n / 2;
    produce_stream(
        &bootstrap,
        &topic,
        &[],
        (0..first).map(|id| ((id % PARTITIONS as u64) as i32, bid_json(id))),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let storage: Vec<String> = tinyflow_tests::s3_properties()
        .iter()
        .map(|(k, v)| format!("\"{k}\" = \"{v}\""))
        .collect();
    let text = job_text(&dir, &bootstrap, &topic, "").replace(
        &format!("dir = \"{}/checkpoints\"", dir.display()),
        &format!(
            "dir = \"s3://tinyflow/test-{nanos}/checkpoints\"\nstorage = {{ {} }}",
            storage.join(", ")
        ),
    );
    assert!(text.contains("s3://tinyflow"), "{text}");
    let job = dir.join("job.toml");
    std::fs::write(&job, &text).unwrap();
    // The same file on "another machine".
    let other = tempfile::tempdir().unwrap();
    let job_elsewhere = other.path().join("job.toml");
    std::fs::write(&job_elsewhere, &text).unwrap();

    let mut spawn = Spawner {
        dir: dir.clone(),
        next: 0,
    };
    let mut w0 = spawn.worker(&job, &["--worker", "0/2"], &[]);
    let mut w1 = spawn.worker(&job, &["--worker", "1/2"], &[]);
    commits(&mut w0, "worker 0/2");
    commits(&mut w1, "worker 1/2");
    // A few more checkpoints, then a crash.
    std::thread::sleep(Duration::from_secs(1));
    w1.kill();
    let mut w1 = spawn.worker(&job_elsewhere, &["--worker", "1/2"], &[]);
    assert!(
        w1.wait_for("restored=Some", Duration::from_secs(60)),
        "worker 1/2 did not restore its checkpoint from S3; log: {}",
        std::fs::read_to_string(&w1.log).unwrap_or_default()
    );
    produce_stream(
        &bootstrap,
        &topic,
        &[],
        (first..n).map(|id| ((id % PARTITIONS as u64) as i32, bid_json(id))),
    )
    .unwrap();
    let catalog = tinyflow_connectors_iceberg::CatalogConfig::sqlite(&dir);
    let table = TableReader::open(&catalog, "chaos", "bids").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while committed_rows(&table).await < n {
        w0.assert_alive();
        w1.assert_alive();
        assert!(
            Instant::now() < deadline,
            "the table holds {} of {n} rows after 120 s",
            committed_rows(&table).await
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let (code, out, err) = tinyflow(&["inspect", job.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{out}{err}");
    for want in [
        "2 workers (layout generation 1",
        "worker 0/2:",
        "worker 1/2:",
        &format!(
            "checkpoints on object storage at s3://tinyflow/test-{nanos}/checkpoints/chaos.w1-of-2.g1"
        ),
        "newest checkpoint:",
        "verdict: agree",
    ] {
        assert!(out.contains(want), "no {want:?} in: {out}");
    }
    w0.stop();
    w1.stop();
    read_each_once(&dir, n);
}
