//! The whole chain under crashes: `tinyflow run JOB.toml` as a child
//! process, reading a real Kafka broker of the test's own into an Iceberg
//! table in a sqlite catalog, killed with SIGKILL again and again (at random
//! moments, and inside commits: just before and just after the catalog
//! update) and restarted; the broker itself is killed and restarted once
//! mid-run, and once the checkpoint directory is wiped between two runs (the
//! next run starts where the table's data ends); one run ends with SIGTERM
//! instead: it must exit 0 after a final checkpoint, which no commit passes.
//! At the end pyiceberg reads
//! the table: N rows, N distinct ids, and sums of ids and prices equal to
//! what was produced.
//!
//! Beside it, a bounded job (`source.bounded = true`) run the same way must
//! end by itself with every record committed once, log its final counters
//! and, with `metrics.linger`, serve them at `/metrics` until it exits; a
//! bounded job with bad records and a dead-letter topic killed with SIGKILL
//! again and again must leave each bad record in that topic once
//! (`read_committed`); and the same job on a
//! disk too small for its data (a 512 KiB tmpfs; the test needs root to
//! mount it) must fail its attempts with an error naming the file and the
//! full disk, clean up after each, and finish with every record once when
//! the disk grows. A job whose commits take merged files is killed at
//! each step of the merge (`chaos/merge.rs`). `tinyflow maintain` (`chaos/maintain.rs`) runs beside a
//! job, after it was killed, and before it restarts from its checkpoints.
//!
//! It lives in the CLI crate so that cargo builds the binary for it, in the
//! same build as every other test.
//!
//! `TINYFLOW_CHAOS_KILLS` (default 10, at least 10) and
//! `TINYFLOW_CHAOS_RECORDS` (default 60000: produced at least, and for as
//! long as the kills go on) make it harder.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a panic is the failure report"
)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use serde_json::json;
use tinyflow_connectors_iceberg::TableReader;
use tinyflow_connectors_kafka::testing::{create_topic, produce_stream};
use tinyflow_tests::SplitMix64;
use tinyflow_tests::broker::OwnBroker;

#[path = "chaos/avro.rs"]
mod avro;
#[path = "chaos/maintain.rs"]
mod maintain;
#[path = "chaos/merge.rs"]
mod merge;
#[path = "chaos/workers.rs"]
mod workers;

const TOPIC: &str = "chaos-bids";
const PARTITIONS: i32 = 4;

fn env_count(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v}: expected a number"))
        })
        .unwrap_or(default)
}

/// The `tinyflow` binary, which cargo builds for this test.
fn tinyflow_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tinyflow"))
}

/// The job: `topic` into `chaos.bids`; `source_extra` is added to its
/// `[source]` section. Writes it to `dir/job.toml`.
fn job_file(dir: &Path, bootstrap: &str, topic: &str, source_extra: &str) -> PathBuf {
    let path = dir.join("job.toml");
    std::fs::write(&path, job_text(dir, bootstrap, topic, source_extra)).unwrap();
    path
}

/// The job's text, with its catalog, warehouse and checkpoints in `dir`.
fn job_text(dir: &Path, bootstrap: &str, topic: &str, source_extra: &str) -> String {
    format!(
        r#"
[job]
name = "chaos"
parallelism = 2

[source]
bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
{source_extra}
fields = [
  {{ name = "id", type = "long", required = true }},
  {{ name = "price", type = "long", required = true }},
  {{ name = "pad", type = "string" }},
]

[[transforms]]
compute = {{ column = "price_eur", expr = "price / 100" }}

[sink]
namespace = "chaos"
table = "bids"
partition = [{{ column = "id", transform = "bucket[4]" }}]
catalog = {{ type = "sqlite", dir = "{dir}" }}

[checkpoint]
interval = "300ms"
dir = "{dir}/checkpoints"

[restart]
strategy = "fixed"
delay = "500ms"
max_attempts = 1000
"#,
        dir = dir.display()
    )
}

/// A running `tinyflow run` and the lines of its stderr.
struct Run {
    child: Child,
    lines: mpsc::Receiver<String>,
    log: PathBuf,
}

impl Run {
    fn start(job: &Path, dir: &Path, n: u32) -> Run {
        Run::start_logging(job, dir, n, "info")
    }

    /// As [`Run::start`], with `TINYFLOW_LOG=log`.
    fn start_logging(job: &Path, dir: &Path, n: u32, log: &str) -> Run {
        Run::start_with(job, dir, n, log, 150)
    }

    /// As [`Run::start`], with `TINYFLOW_LOG=log` and every commit paused
    /// `pause_ms` before and after its catalog update.
    fn start_with(job: &Path, dir: &Path, n: u32, log: &str, pause_ms: u64) -> Run {
        Run::start_env(job, dir, n, log, pause_ms, &[])
    }

    /// As [`Run::start_with`], with these variables set for the child.
    fn start_env(
        job: &Path,
        dir: &Path,
        n: u32,
        log: &str,
        pause_ms: u64,
        envs: &[(&str, &str)],
    ) -> Run {
        Run::start_args(job, dir, n, log, pause_ms, envs, &[])
    }

    /// As [`Run::start_env`], with these arguments after `run JOB`.
    fn start_args(
        job: &Path,
        dir: &Path,
        n: u32,
        log: &str,
        pause_ms: u64,
        envs: &[(&str, &str)],
        args: &[&str],
    ) -> Run {
        let mut child = Command::new(tinyflow_bin())
            .args(["run", job.to_str().unwrap()])
            .args(args)
            .envs(envs.iter().copied())
            .env("TINYFLOW_CHAOS_COMMIT_PAUSE_MS", pause_ms.to_string())
            .env("TINYFLOW_LOG", log)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        let log = dir.join(format!("run-{n}.log"));
        let mut file = std::fs::File::create(&log).unwrap();
        std::thread::spawn(move || {
            use std::io::Write;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = writeln!(file, "{line}");
                let _ = tx.send(line);
            }
        });
        Run { child, lines, log }
    }

    /// Waits for a stderr line containing `marker`.
    fn wait_for(&mut self, marker: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(marker) => return true,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        false
    }

    fn assert_alive(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!(
                "tinyflow run exited by itself ({status}); its log: {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }

    /// SIGTERM: the job stops with a final checkpoint and exits by itself.
    /// Returns that checkpoint, as the log reports it.
    fn stop(mut self) -> u64 {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM failed");
        const MARKER: &str = "stopped with a final checkpoint";
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut reported = None;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(MARKER) => reported = Some(line),
                Ok(_) => {}
                // The pipe closed: the process is gone.
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                    "tinyflow run did not stop within 60 s of SIGTERM; its log: {}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                ),
            }
        }
        let status = self.child.wait().unwrap();
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        assert!(
            status.success(),
            "exit {status} after SIGTERM; its log: {log}"
        );
        let line = reported.unwrap_or_else(|| panic!("no `{MARKER}` line; log: {log}"));
        line.split("final_checkpoint=")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|id| id.parse().ok())
            .unwrap_or_else(|| panic!("no final_checkpoint=N in {line:?}"))
    }

    /// Waits up to 120 s for the process to exit by itself, with status 0;
    /// else kills it and fails with `late` and its log.
    fn exits_0_within_120_s(&mut self, late: &str) {
        let (code, log) = self.exit_code_within_or(Duration::from_secs(120), late);
        assert_eq!(code, Some(0), "exit {code:?}; its log: {log}");
    }

    /// Waits up to `within` for the process to exit by itself; its exit
    /// code (`None`: a signal) and its log.
    fn exit_code_within(&mut self, within: Duration) -> (Option<i32>, String) {
        self.exit_code_within_or(within, &format!("still running after {within:?}"))
    }

    /// As [`Run::exit_code_within`]; `late` says what it means when it
    /// does not exit in time.
    fn exit_code_within_or(&mut self, within: Duration, late: &str) -> (Option<i32>, String) {
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                self.child.kill().unwrap();
                panic!(
                    "{late}; its log: {}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        // The log thread may lag the exit a little.
        std::thread::sleep(Duration::from_millis(200));
        (
            status.code(),
            std::fs::read_to_string(&self.log).unwrap_or_default(),
        )
    }

    /// SIGKILL, as a crash.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

/// Rows in the table's current snapshot, by iceberg-rust (for polling;
/// the verdict is pyiceberg's).
async fn committed_rows(table: &TableReader) -> u64 {
    // Before the first commit the table may not exist yet.
    table
        .load()
        .await
        .map_or(0, |t| tinyflow_connectors_iceberg::total_records(&t))
}

/// pyiceberg's view of `chaos.bids` in the catalog in `dir`, checked to
/// hold ids `0..n` once each with their prices.
fn read_each_once(dir: &Path, n: u64) -> serde_json::Value {
    let table = tinyflow_tests::pyiceberg_read(dir, "chaos.bids", &["id", "price"]);
    assert_eq!(table["rows"], n, "{table}");
    assert_eq!(table["distinct_ids"], n, "{table}");
    assert_eq!(table["id_sum"], (0..n).sum::<u64>(), "{table}");
    assert_eq!(
        table["value_sum"],
        (0..n).map(price_of).sum::<u64>(),
        "{table}"
    );
    table
}

fn price_of(id: u64) -> u64 {
    100 + id * 7 % 9_900
}

fn bid_json(id: u64) -> Vec<u8> {
    format!(
        r#"{{"id":{id},"price":{},"pad":"{}"}}"#,
        price_of(id),
        "x".repeat(64)
    )
    .into_bytes()
}

/// A loopback port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET path` over plain HTTP: the status code and the body, or `None`
/// while nothing listens.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.") {
        return None;
    }
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_owned()))
}

/// `GET /metrics` over plain HTTP; the body, or `None` while the endpoint
/// is not up.
fn scrape(port: u16) -> Option<String> {
    get(port, "/metrics")
        .filter(|(code, _)| *code == 200)
        .map(|(_, body)| body)
}

/// A bounded job with `metrics.linger` logs its final counters when it
/// ends, bad records by reason included, and serves the final values at
/// `/metrics` for the linger before it exits 0. On the shared broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_job_logs_its_final_counters_and_serves_them_while_it_lingers() {
    let (bootstrap, topic) = new_topic("linger-bids").await;
    let n = 2_000u64;
    let bad = 10u64;
    produce_stream(
        &bootstrap,
        &topic,
        &[],
        (0..n + bad).map(|i| {
            let value = if i % 200 == 100 {
                b"{not json".to_vec()
            } else {
                bid_json(i - (i + 100) / 200)
            };
            ((i % PARTITIONS as u64) as i32, value)
        }),
    )
    .unwrap();
    let port = free_port();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = dir.join("job.toml");
    let text = job_text(
        &dir,
        &bootstrap,
        &topic,
        "bounded = true\nbad_records = \"skip\"",
    );
    std::fs::write(
        &job,
        format!("{text}\n[metrics]\naddress = \"127.0.0.1:{port}\"\nlinger = \"4s\"\n"),
    )
    .unwrap();
    let mut run = Run::start(&job, &dir, 0);
    let started = Instant::now();
    assert!(
        run.wait_for("final counters of this run", Duration::from_secs(120)),
        "no final counters; log: {}",
        std::fs::read_to_string(&run.log).unwrap_or_default()
    );
    let log = std::fs::read_to_string(&run.log).unwrap_or_default();
    let line = log
        .lines()
        .find(|l| l.contains("final counters of this run"))
        .unwrap();
    let total = n + bad;
    assert!(
        line.contains(&format!(
            "records_read={total} bad_records={bad} (invalid_json={bad})"
        )),
        "{line}"
    );
    // `skip` leaves a trace at info: a summary with counts and first
    // positions, and totals per source subtask when it ends.
    assert!(
        log.contains("bad records since the last summary")
            && log.contains("counts=invalid_json=")
            && log.contains(&format!("first={topic}/")),
        "no bad-record summary; log: {log}"
    );
    let totals: u64 = log
        .lines()
        .filter(|l| l.contains("bad records of this source subtask, in total"))
        .map(|l| {
            l.split("totals=invalid_json=")
                .nth(1)
                .and_then(|t| t.split_whitespace().next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no totals in {l:?}"))
        })
        .sum();
    assert_eq!(totals, bad, "final summaries; log: {log}");
    // The job has ended; the endpoint still serves its final values.
    let body = scrape(port).unwrap_or_else(|| panic!("no /metrics while lingering; log: {log}"));
    assert_eq!(
        tinyflow_cli::metric_sum(&body, "tinyflow_kafka_records_read_total", None),
        total as f64
    );
    assert_eq!(
        tinyflow_cli::metric_sum(
            &body,
            "tinyflow_bad_records_total",
            Some("reason=\"invalid_json\"")
        ),
        bad as f64
    );
    run.exits_0_within_120_s("a bounded job with metrics.linger = 4s still ran after 120 s");
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "exited before its linger"
    );
    read_each_once(&dir, n);
}

/// The dead-letter topic under SIGKILL: a bounded job with bad records
/// among good ones, killed right after its source committed dead letters
/// (the 1st or 2nd time in the run), four times (at least twice before it
/// got to the end), then run to its end. Each bad record is in the dead-letter topic
/// once (`read_committed`), each good one in the table once. On the shared
/// broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_again_and_again_a_job_leaves_each_bad_record_in_the_dead_letter_topic_once() {
    use tinyflow_connectors_kafka::testing::read_topic;
    let bootstrap = tinyflow_connectors_kafka::testing::bootstrap();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let topic = format!("dl-kill-bids-{nanos}");
    let dlq = format!("dl-kill-dlq-{nanos}");
    create_topic(&bootstrap, &topic, PARTITIONS).await.unwrap();
    create_topic(&bootstrap, &dlq, 2).await.unwrap();
    let n = 600_000u64;
    // Not a multiple of the partitions: bad records in all of them.
    let every = 999u64;
    let mut bad = Vec::new();
    let mut next = [0i64; PARTITIONS as usize];
    let mut id = 0u64;
    let mut records: Vec<(i32, Vec<u8>)> = Vec::new();
    for i in 0.. {
        if id == n {
            break;
        }
        let p = (i % PARTITIONS as u64) as i32;
        let value = if i % every == every / 2 {
            bad.push((p, next[p as usize]));
            format!("{{not json {i}").into_bytes()
        } else {
            id += 1;
            bid_json(id - 1)
        };
        next[p as usize] += 1;
        records.push((p, value));
    }
    assert_eq!(id, n);
    produce_stream(&bootstrap, &topic, &[], records.into_iter()).unwrap();
    bad.sort_unstable();

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let extra = format!("bounded = true\nbad_records = \"dead-letter:{dlq}\"");
    let job = job_file(&dir, &bootstrap, &topic, &extra);
    let mut rng = SplitMix64::new(nanos as u64);
    let mut kills = 0;
    for k in 0..4 {
        // Killed just after the source committed dead letters in a
        // snapshot, mostly before that checkpoint is durable: the next run
        // restores the one before and reads those bad records again.
        let mut run = Run::start_logging(&job, &dir, k, "info,tinyflow_connectors_kafka=debug");
        let commits = 1 + rng.below(2);
        if !(0..commits).all(|_| run.wait_for("dead letters committed", Duration::from_secs(60))) {
            // Nothing left to read: an earlier run got to the end.
            run.exits_0_within_120_s("a run that met no bad record still ran after 120 s");
            break;
        }
        if run.child.try_wait().unwrap().is_some() {
            break;
        }
        run.kill();
        kills += 1;
    }
    assert!(kills >= 2, "only {kills} runs killed before the end");
    let mut run = Run::start(&job, &dir, 4);
    run.exits_0_within_120_s("the last run still ran after 120 s");
    read_each_once(&dir, n);

    let letters = read_topic(&bootstrap, &dlq, bad.len(), Duration::from_secs(60)).unwrap();
    assert_eq!(letters.len(), bad.len(), "dead letters after 60 s");
    // Anything more would be a duplicate: give it time to show.
    let letters = read_topic(&bootstrap, &dlq, bad.len() + 1, Duration::from_secs(5)).unwrap();
    let mut origins: Vec<(i32, i64)> = letters
        .iter()
        .map(|l| {
            assert_eq!(l.header("tinyflow.source.topic"), Some(topic.clone()));
            (
                l.header("tinyflow.source.partition")
                    .unwrap()
                    .parse()
                    .unwrap(),
                l.header("tinyflow.source.offset").unwrap().parse().unwrap(),
            )
        })
        .collect();
    origins.sort_unstable();
    assert_eq!(
        origins, bad,
        "each bad record once in the dead-letter topic"
    );
}

/// `source.bounded = true`: `tinyflow run` reads up to the end offsets it
/// found at start, takes a final checkpoint, commits it and exits 0 by
/// itself (a backfill). On the shared broker (`KAFKA_BOOTSTRAP`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_job_reads_to_the_end_commits_and_exits() {
    let n = 20_000u64;
    let (bootstrap, topic) = fresh_topic("bounded-bids", n).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = job_file(&dir, &bootstrap, &topic, "bounded = true");
    let mut run = Run::start(&job, &dir, 0);
    run.exits_0_within_120_s("a bounded job still ran after 120 s");
    read_each_once(&dir, n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_again_and_again_with_a_broker_restart_the_table_holds_each_record_once() {
    let kills = env_count("TINYFLOW_CHAOS_KILLS", 10).max(10);
    let n = env_count("TINYFLOW_CHAOS_RECORDS", 60_000);
    let broker = OwnBroker::start();
    let bootstrap = broker.bootstrap.clone();
    create_topic(&bootstrap, TOPIC, PARTITIONS).await.unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = job_file(&dir, &bootstrap, TOPIC, "");

    // Produced while the job is killed and restarted: a quarter of N up
    // front, then at N/kills a second until the kills are over and at least
    // N were produced, so every run has new records to commit (idempotent
    // producer: the broker restart cannot write a record twice).
    let paced_from = n / 4;
    let per_second = (n / kills).max(1_000);
    let kills_done = Arc::new(AtomicBool::new(false));
    let producer = {
        let (bootstrap, kills_done) = (bootstrap.clone(), Arc::clone(&kills_done));
        std::thread::spawn(move || {
            let start = Instant::now();
            let records = (0..)
                .take_while(move |id| *id < n || !kills_done.load(Ordering::SeqCst))
                .map(move |id| {
                    if id >= paced_from {
                        let due =
                            Duration::from_secs_f64((id - paced_from) as f64 / per_second as f64);
                        if let Some(wait) = due.checked_sub(start.elapsed()) {
                            std::thread::sleep(wait);
                        }
                    }
                    ((id % PARTITIONS as u64) as i32, bid_json(id))
                });
            produce_stream(&bootstrap, TOPIC, &[], records)
        })
    };

    let mut rng = SplitMix64::new(0x00C0_FFEE ^ n);
    let mut in_commit = 0;
    let wiped_after = kills / 3;
    // One run ends with SIGTERM rather than SIGKILL: it must exit 0 after a
    // final checkpoint.
    let stopped_at = (0..kills)
        .rev()
        .find(|k| k % 3 == 0 && *k != kills / 2 && *k != wiped_after + 1 && *k != wiped_after)
        .unwrap();
    let catalog = tinyflow_connectors_iceberg::CatalogConfig::sqlite(&dir);
    for k in 0..kills {
        let mut run = Run::start(&job, &dir, u32::try_from(k).unwrap());
        if k == wiped_after + 1 {
            assert!(
                run.wait_for(
                    "the source starts where the table's last commit of this sink ends",
                    Duration::from_secs(30)
                ),
                "run {k}: the checkpoints are gone, yet no start from the table; log: {}",
                std::fs::read_to_string(&run.log).unwrap_or_default()
            );
        }
        if k == kills / 2 {
            // The broker dies and comes back while the job runs; the job
            // rides it out (reconnects, or restarts from its checkpoint).
            assert!(
                run.wait_for("CHAOS commit paused", Duration::from_secs(60)),
                "no commit before the broker restart"
            );
            broker.kill();
            std::thread::sleep(Duration::from_secs(2));
            broker.resume();
            assert!(
                run.wait_for("CHAOS commit paused after", Duration::from_secs(120)),
                "no commit after the broker came back; log: {}",
                std::fs::read_to_string(&run.log).unwrap_or_default()
            );
        }
        match k % 3 {
            // Inside a commit: files written, the catalog not updated yet.
            1 => {
                let hit = run.wait_for("CHAOS commit paused before", Duration::from_secs(60));
                assert!(hit, "run {k}: no commit within 60 s");
                in_commit += 1;
            }
            // Inside a commit: the catalog updated, the job not told yet.
            2 => {
                let hit = run.wait_for("CHAOS commit paused after", Duration::from_secs(60));
                assert!(hit, "run {k}: no commit within 60 s");
                in_commit += 1;
            }
            // Anywhere: start-up, reading, writing, checkpointing.
            _ => std::thread::sleep(Duration::from_millis(200 + rng.below(1_800))),
        }
        run.assert_alive();
        if k == stopped_at {
            // Once the job reads and commits, so its final checkpoint has
            // data (a checkpoint without data adds no snapshot).
            assert!(
                run.wait_for("CHAOS commit paused after", Duration::from_secs(60)),
                "run {k}: no commit within 60 s"
            );
            let last = run.stop();
            let table = TableReader::open(&catalog, "chaos", "bids")
                .await
                .unwrap()
                .load()
                .await
                .unwrap();
            let committed = table.metadata().current_snapshot().and_then(|s| {
                s.summary()
                    .additional_properties
                    .get(tinyflow_connectors_iceberg::SUMMARY_CHECKPOINT_ID)
                    .cloned()
            });
            // The final checkpoint, or the newest before it that had rows
            // (one without rows adds no snapshot); never one after it.
            let committed: u64 = committed
                .expect("a commit before the stop")
                .parse()
                .unwrap();
            assert!(
                committed <= last,
                "run {k}: the table holds checkpoint {committed}, past the final {last}"
            );
            continue;
        }
        run.kill();
        if k == wiped_after {
            // Lost checkpoints: only the table knows where its data ends.
            std::fs::remove_dir_all(dir.join("checkpoints")).unwrap();
        }
    }
    assert!(
        in_commit >= kills / 2,
        "{in_commit} of {kills} kills inside commits"
    );

    kills_done.store(true, Ordering::SeqCst);
    let n = producer.join().unwrap().unwrap();
    // The last run goes on until the table holds everything.
    let mut last = Run::start(&job, &dir, u32::try_from(kills).unwrap());
    let deadline = Instant::now() + Duration::from_secs(180);
    let table = TableReader::open(&catalog, "chaos", "bids").await.unwrap();
    loop {
        let rows = committed_rows(&table).await;
        if rows >= n {
            break;
        }
        last.assert_alive();
        assert!(
            Instant::now() < deadline,
            "after 180 s the table holds {rows} of {n} rows; log: {}",
            std::fs::read_to_string(&last.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // A little longer: a duplicate commit, if there were one, would show.
    std::thread::sleep(Duration::from_secs(2));
    last.kill();

    let table = tinyflow_tests::pyiceberg_read(&dir, "chaos.bids", &["id", "price"]);
    let id_sum: u64 = (0..n).sum();
    let price_sum: u64 = (0..n).map(price_of).sum();
    assert_eq!(table["rows"], n, "{table}");
    assert_eq!(table["distinct_ids"], n, "{table}");
    assert_eq!(table["id_sum"], id_sum, "{table}");
    assert_eq!(table["value_sum"], price_sum, "{table}");
}

/// A tmpfs mounted for a test, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).unwrap();
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "tinyflow-test",
            ])
            .arg(at)
            .output()
            .unwrap_or_else(|e| panic!("running mount: {e}"));
        assert!(
            out.status.success(),
            "the full-disk test mounts a {size} tmpfs at {} and needs root (or CAP_SYS_ADMIN) \
             for it; mount said: {}",
            at.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Tmpfs(at.to_path_buf())
    }

    fn resize(&self, size: &str) {
        let out = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "growing the tmpfs at {} to {size} failed: {}",
            self.0.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A full disk: the job's catalog, warehouse and checkpoints on a 512 KiB
/// tmpfs, and 20,000 bids whose random padding makes their Parquet files
/// outgrow it. Each attempt must fail with an error that names the file it
/// could not write and says the disk is full, the job must restart (not
/// give up: the disk may get room), and each restart must delete the dead
/// attempts' files, or the disk would stay full of them. Once the tmpfs
/// grows, the same run must finish with every record once, read by pyiceberg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_full_disk_the_job_fails_clearly_cleans_up_and_resumes_once_there_is_room() {
    let (bootstrap, topic) = new_topic("full-disk-bids").await;
    let n = 20_000u64;
    let mut rng = SplitMix64::new(7);
    let bids: Vec<_> = (0..n)
        .map(|id| {
            let pad = format!("{:016x}{:016x}", rng.next_u64(), rng.next_u64());
            let json = format!(
                r#"{{"id":{id},"price":{},"pad":"{pad}{pad}"}}"#,
                price_of(id)
            );
            ((id % PARTITIONS as u64) as i32, json.into_bytes())
        })
        .collect();
    produce_stream(&bootstrap, &topic, &[], bids.into_iter()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let disk_dir = dir.join("disk");
    let disk = Tmpfs::mount(&disk_dir, "512k");
    let job = dir.join("job.toml");
    std::fs::write(
        &job,
        job_text(&disk_dir, &bootstrap, &topic, "bounded = true"),
    )
    .unwrap();
    let mut run = Run::start(&job, &dir, 0);

    let full = "No space left on device";
    assert!(
        run.wait_for(full, Duration::from_secs(60)),
        "no `{full}` error within 60 s; the log: {}",
        std::fs::read_to_string(&run.log).unwrap_or_default()
    );
    // Two more failed attempts, each after a cleanup of the ones before.
    for _ in 0..2 {
        assert!(
            run.wait_for("deleted orphan data files", Duration::from_secs(60)),
            "no restart cleaned up the failed attempts' files; the log: {}",
            std::fs::read_to_string(&run.log).unwrap_or_default()
        );
    }
    run.assert_alive();
    let log = std::fs::read_to_string(&run.log).unwrap();
    let data_dir = disk_dir.join("warehouse/chaos/bids/data");
    let named = log
        .lines()
        .find(|l| l.contains(full))
        .unwrap_or_else(|| panic!("the `{full}` line is not in the log file: {log}"));
    assert!(
        named.contains(&format!("writing {}/", data_dir.display()))
            || named.contains(&format!(
                "writing checkpoint metadata to {}",
                disk_dir.display()
            )),
        "the error names no file it could not write: {named}"
    );
    assert!(
        log.contains("restarting from the newest completed checkpoint"),
        "the job did not restart after the full disk: {log}"
    );

    disk.resize("64m");
    run.exits_0_within_120_s("the job did not finish within 120 s of the disk growing");
    let table = read_each_once(&disk_dir, n);
    // What is left on the disk: the committed files and none of the dead
    // attempts' (the last cleanup ran before the successful attempt wrote).
    assert_eq!(
        files_under(&data_dir),
        table["files"].as_u64().unwrap_or(u64::MAX),
        "data files on disk vs in the table: {table}"
    );
}

/// Files under `dir`, in its subdirectories too.
fn files_under(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap().path();
            if path.is_dir() { files_under(&path) } else { 1 }
        })
        .sum()
}

// ---- formats through the product ----

/// Writes `dir/<name>.toml`: a bounded job of two subtasks named `name`
/// with this `[source]` body, writing `namespace.table` in a sqlite catalog
/// in `dir`.
fn bounded_job(dir: &Path, name: &str, source: &str, namespace: &str, table: &str) -> PathBuf {
    let job = dir.join(format!("{name}.toml"));
    std::fs::write(
        &job,
        format!(
            r#"
[job]
name = "{name}"
parallelism = 2

[source]
bounded = true
{source}

[sink]
namespace = "{namespace}"
table = "{table}"
catalog = {{ type = "sqlite", dir = "{dir}" }}

[checkpoint]
interval = "300ms"
dir = "{dir}/checkpoints"
"#,
            dir = dir.display()
        ),
    )
    .unwrap();
    job
}

/// A bounded job of `format = "raw"` (log lines) with the key and three
/// headers as columns, one of them binary: pyiceberg reads back every row
/// value for value; a tombstone's value and a missing
/// key or header are null; a record whose key is not UTF-8 is skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_job_keeps_values_keys_and_headers_value_for_value() {
    use tinyflow_connectors_kafka::testing::{ToProduce, produce_records};
    let (bootstrap, topic) = new_topic("raw-lines").await;
    let n = 500u32;
    let mut records: Vec<ToProduce> = (0..n)
        .map(|i| ToProduce {
            partition: (i % PARTITIONS as u32) as i32,
            key: (!i.is_multiple_of(3)).then(|| format!("host-{}", i % 7).into_bytes()),
            value: (!i.is_multiple_of(50)).then(|| format!("{i} GET /index.html 200").into_bytes()),
            headers: [
                Some(("seq".to_owned(), Some(i.to_string().into_bytes()))),
                (i.is_multiple_of(2)).then(|| ("sig".to_owned(), Some(vec![0xde, 0xad, i as u8]))),
                (i == 7).then(|| ("env".to_owned(), Some(b"test".to_vec()))),
            ]
            .into_iter()
            .flatten()
            .collect(),
        })
        .collect();
    records.push(ToProduce {
        key: Some(vec![0xff, 0xfe]),
        value: Some(b"a key that is not UTF-8".to_vec()),
        headers: vec![("seq".to_owned(), Some(b"-1".to_vec()))],
        ..ToProduce::default()
    });
    produce_records(&bootstrap, &topic, &records).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let source = format!(
        r#"bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
bad_records = "skip"
format = "raw"
value = {{ column = "line" }}
key = {{ column = "host", type = "string" }}
metadata_columns = true

[[source.headers]]
name = "seq"

[[source.headers]]
name = "sig"
column = "signature"
type = "binary"

[[source.headers]]
name = "env""#
    );
    let job = bounded_job(&dir, "raw-lines", &source, "logs", "lines");
    let mut run = Run::start(&job, &dir, 0);
    run.exits_0_within_120_s("a bounded raw job still ran after 120 s");
    let mut got = tinyflow_tests::pyiceberg_rows(
        &dir,
        "logs.lines",
        &[
            "seq",
            "line",
            "host",
            "signature",
            "env",
            "_kafka_partition",
        ],
    );
    got.sort_by_key(|r| r[0].as_str().unwrap().parse::<i64>().unwrap());
    let want: Vec<Vec<serde_json::Value>> = (0..n)
        .map(|i| {
            vec![
                json!(i.to_string()),
                json!((!i.is_multiple_of(50)).then(|| format!("{i} GET /index.html 200"))),
                json!((!i.is_multiple_of(3)).then(|| format!("host-{}", i % 7))),
                json!((i.is_multiple_of(2)).then(|| format!("dead{:02x}", i as u8))),
                json!((i == 7).then_some("test")),
                json!(i % PARTITIONS as u32),
            ]
        })
        .collect();
    assert_eq!(got.len(), want.len(), "rows");
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g, w);
    }
}

/// One nested JSON record of [`a_nested_json_job_...`] and what pyiceberg
/// should read back: id, buyer, items, tags, scores.
fn nested_record(i: u64) -> (serde_json::Value, Vec<serde_json::Value>) {
    let buyer = match i % 4 {
        0 => {
            json!({"name": format!("b{i}"), "address": {"city": "Lyon", "zip": format!("{:05}", i)}})
        }
        1 => json!({"name": format!("b{i}"), "address": null}),
        2 => json!({"name": null, "address": {"city": "Oslo"}}),
        _ => serde_json::Value::Null,
    };
    let buyer_read = match i % 4 {
        0 => {
            json!({"name": format!("b{i}"), "address": {"city": "Lyon", "zip": format!("{:05}", i)}})
        }
        1 => json!({"name": format!("b{i}"), "address": null}),
        2 => json!({"name": null, "address": {"city": "Oslo", "zip": null}}),
        _ => serde_json::Value::Null,
    };
    let items: Vec<serde_json::Value> = (0..i % 3)
        .map(|k| json!({"sku": format!("s{}", i + k), "qty": (k + 1) as i64}))
        .collect();
    let tags = if i.is_multiple_of(5) {
        serde_json::Value::Null
    } else {
        json!({"a": i as i64, "b": null})
    };
    let tags_read = if i.is_multiple_of(5) {
        serde_json::Value::Null
    } else {
        json!([["a", i as i64], ["b", null]])
    };
    let scores = json!([i as f64 / 2.0, null, -1.5]);
    let record = json!({"id": i, "buyer": buyer, "items": items, "tags": tags, "scores": scores});
    let read = vec![json!(i), buyer_read, json!(items), tags_read, scores];
    (record, read)
}

/// A bounded job of nested JSON: structs in structs, a list of structs, a
/// map and a list of doubles become Iceberg struct, list and map columns
/// (with field ids of their own); pyiceberg reads every row back value for
/// value. A second run appends to the table, so the nested schema is checked
/// against the existing table too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_json_job_writes_structs_lists_and_maps_value_for_value() {
    let (bootstrap, topic) = new_topic("nested").await;
    let produce = |range: std::ops::Range<u64>| {
        produce_stream(
            &bootstrap,
            &topic,
            &[],
            range.map(|i| {
                (
                    (i % PARTITIONS as u64) as i32,
                    serde_json::to_vec(&nested_record(i).0).unwrap(),
                )
            }),
        )
        .unwrap();
    };
    produce(0..300);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let source = format!(
        r#"bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
fields = [
  {{ name = "id", type = "long", required = true }},
  {{ name = "buyer", type = "struct<name: string, address: struct<city: string, zip: string>>" }},
  {{ name = "items", type = "list<struct<sku: string not null, qty: int not null>>" }},
  {{ name = "tags", type = "map<string, long>" }},
  {{ name = "scores", type = "list<double>" }},
]"#
    );
    let job = bounded_job(&dir, "nested", &source, "shop", "orders");
    Run::start(&job, &dir, 0).exits_0_within_120_s("a bounded nested job still ran after 120 s");
    produce(300..400);
    Run::start(&job, &dir, 0).exits_0_within_120_s("the second run still ran after 120 s");
    let mut got = tinyflow_tests::pyiceberg_rows(
        &dir,
        "shop.orders",
        &["id", "buyer", "items", "tags", "scores"],
    );
    got.sort_by_key(|r| r[0].as_u64().unwrap());
    assert_eq!(got.len(), 400, "rows");
    for (i, row) in got.iter().enumerate() {
        assert_eq!(row, &nested_record(i as u64).1, "row {i}");
    }
}

// ---- the table is the truth: through the product ----

/// `tinyflow ARGS...` to its end: exit code, stdout, stderr.
fn tinyflow(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(tinyflow_bin())
        .args(args)
        .env("TINYFLOW_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A topic of its own for a test, `PARTITIONS` partitions, on the shared
/// broker: (bootstrap, topic).
async fn new_topic(prefix: &str) -> (String, String) {
    let bootstrap = tinyflow_connectors_kafka::testing::bootstrap();
    let topic = format!(
        "{prefix}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    create_topic(&bootstrap, &topic, PARTITIONS).await.unwrap();
    (bootstrap, topic)
}

/// [`new_topic`] holding bids `0..n`, round-robin over the partitions.
async fn fresh_topic(prefix: &str, n: u64) -> (String, String) {
    let (bootstrap, topic) = new_topic(prefix).await;
    produce_stream(
        &bootstrap,
        &topic,
        &[],
        (0..n).map(|id| ((id % PARTITIONS as u64) as i32, bid_json(id))),
    )
    .unwrap();
    (bootstrap, topic)
}

/// The table is dropped after a run while its checkpoints survive: the
/// next run refuses them (exit 4) instead of committing the old files into
/// the table it creates again; `inspect` shows the disagreement (exit 4);
/// `reset` sets the checkpoints aside; the run after it reads the topic
/// again into the new table, each record once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_table_is_refused_then_inspect_and_reset_start_the_job_again() {
    let n = 4_000u64;
    let (bootstrap, topic) = fresh_topic("dropped-bids", n).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = job_file(&dir, &bootstrap, &topic, "bounded = true");
    let job_arg = job.to_str().unwrap();
    Run::start(&job, &dir, 0).exits_0_within_120_s("the first run did not end");
    read_each_once(&dir, n);
    let (code, out, _) = tinyflow(&["inspect", job_arg]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("verdict: agree"), "{out}");

    let catalog = tinyflow_connectors_iceberg::CatalogConfig::sqlite(&dir);
    let c = tinyflow_connectors_iceberg::open_catalog(&catalog, Duration::from_secs(5))
        .await
        .unwrap();
    c.drop_table(&iceberg::TableIdent::from_strs(["chaos", "bids"]).unwrap())
        .await
        .unwrap();

    let (code, log) = Run::start(&job, &dir, 1).exit_code_within(Duration::from_secs(60));
    assert_eq!(code, Some(4), "{log}");
    assert!(
        log.contains("not the table the checkpoint was written for")
            && log.contains("tinyflow reset"),
        "{log}"
    );
    let empty = tinyflow_tests::pyiceberg_read(&dir, "chaos.bids", &["id"]);
    assert_eq!(empty["rows"], 0, "old files reached the new table: {empty}");

    let (code, out, err) = tinyflow(&["inspect", job_arg]);
    assert_eq!(code, Some(4), "{out}{err}");
    assert!(out.contains("verdict: DISAGREE"), "{out}");
    let (code, out, err) = tinyflow(&["reset", job_arg]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("moved") && out.contains("starts at source.start"),
        "{out}"
    );
    let (code, out, _) = tinyflow(&["inspect", job_arg]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("no checkpoint"), "{out}");

    Run::start(&job, &dir, 2).exits_0_within_120_s("the run after the reset did not end");
    read_each_once(&dir, n);
}

/// `reset --to-offsets` starts a job without a checkpoint at the given
/// offsets: the table then holds exactly the records from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_to_offsets_starts_the_next_run_there() {
    let n = 2_000u64;
    let (bootstrap, topic) = fresh_topic("reset-bids", n).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = job_file(&dir, &bootstrap, &topic, "bounded = true");
    let half = n / PARTITIONS as u64 / 2;
    let offsets: Vec<String> = (0..PARTITIONS)
        .map(|p| format!("{topic}/{p}={half}"))
        .collect();
    let (code, out, err) = tinyflow(&[
        "reset",
        job.to_str().unwrap(),
        "--to-offsets",
        &offsets.join(","),
    ]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains(&format!("{topic}/0@{half}")), "{out}");
    let (code, _, err) = tinyflow(&["reset", job.to_str().unwrap(), "--to-offsets", "nonsense"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--to-offsets"), "{err}");

    Run::start(&job, &dir, 0).exits_0_within_120_s("the run did not end");
    // Offset k of partition p holds id k * PARTITIONS + p.
    let table = tinyflow_tests::pyiceberg_read(&dir, "chaos.bids", &["id"]);
    let from = half * PARTITIONS as u64;
    assert_eq!(table["rows"], n - from, "{table}");
    assert_eq!(table["distinct_ids"], n - from, "{table}");
    assert_eq!(table["id_min"], from, "{table}");
}

/// A second `tinyflow run` of a job whose checkpoint directory a run holds
/// exits at once with 3, naming the holder; the first goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_run_on_the_same_checkpoint_directory_exits_3_at_once() {
    let (bootstrap, topic) = fresh_topic("locked-bids", 1_000).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = job_file(&dir, &bootstrap, &topic, "");
    let mut first = Run::start(&job, &dir, 0);
    assert!(
        first.wait_for("committed", Duration::from_secs(60)),
        "no commit; log: {}",
        std::fs::read_to_string(&first.log).unwrap_or_default()
    );
    let started = Instant::now();
    let (code, log) = Run::start(&job, &dir, 1).exit_code_within(Duration::from_secs(30));
    assert_eq!(code, Some(3), "{log}");
    assert!(
        log.contains("in use by another run") && log.contains(&format!("pid {}", first.child.id())),
        "{log}"
    );
    assert!(started.elapsed() < Duration::from_secs(15), "{log}");
    first.assert_alive();
    first.stop();
}

/// Two live runs of one job on two machines (a checkpoint directory each):
/// the older pauses inside a commit (after its checks, before the catalog
/// update) while the newer starts and claims the sink. The older is
/// refused, exits 3 saying it was fenced, and commits nothing more; the
/// newer reads on from where the table ends, and the table holds every
/// record once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_live_runs_of_one_job_the_newer_fences_the_older_inside_its_commit() {
    let n = 6_000u64;
    let (bootstrap, topic) = fresh_topic("fenced-bids", n).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let text = job_text(&dir, &bootstrap, &topic, "bounded = true");
    let old_job = dir.join("old.toml");
    std::fs::write(&old_job, &text).unwrap();
    let new_job = dir.join("new.toml");
    std::fs::write(
        &new_job,
        text.replace("/checkpoints\"", "/checkpoints-elsewhere\""),
    )
    .unwrap();
    let mut old = Run::start_with(&old_job, &dir, 0, "info", 6_000);
    assert!(
        old.wait_for("CHAOS commit paused before update", Duration::from_secs(60)),
        "the older run never reached a commit; log: {}",
        std::fs::read_to_string(&old.log).unwrap_or_default()
    );
    let mut new = Run::start_with(&new_job, &dir, 1, "info", 0);
    assert!(
        new.wait_for("claimed the sink", Duration::from_secs(5)),
        "the newer run did not claim within the older's pause; log: {}",
        std::fs::read_to_string(&new.log).unwrap_or_default()
    );
    let (code, log) = old.exit_code_within(Duration::from_secs(60));
    assert_eq!(code, Some(3), "{log}");
    assert!(log.contains("fenced") && log.contains("epoch 2"), "{log}");
    assert!(
        !log.contains("CHAOS commit paused after update"),
        "the older run's commit went through: {log}"
    );
    new.exits_0_within_120_s("the newer run did not end");
    let table = read_each_once(&dir, n);
    assert_eq!(
        table["properties"]["tinyflow.sink.chaos.epoch"], "2",
        "{table}"
    );
}

// ---- Kafka in production: secured clusters, secrets, honest exits ----

/// The example job for a secured cluster (`examples/jobs/secured.toml`).
fn secured_example() -> PathBuf {
    example_job("secured.toml")
}

fn example_job(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/jobs")
        .join(name)
}

/// The example job for a secured cluster, run as it is against the test
/// broker's SASL_SSL listener with SCRAM-SHA-512 (secrets from the
/// environment), with every log on: it reads every record once, stops on
/// SIGTERM with exit 0, and no output of it, of `validate` or of `inspect`
/// shows the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_secured_example_job_reads_every_record_once_and_shows_no_secret() {
    let secured = tinyflow_connectors_kafka::testing::secured();
    secured_job_reads_once_showing_no_secret(&secured_example(), "bids", &[], &secured.password)
        .await;
}

/// The example job that logs in with OAUTHBEARER and the OIDC
/// client-credentials flow (`examples/jobs/secured-oidc.toml`), run as it
/// is against the test broker and its identity provider (Keycloak): the
/// same as the SCRAM job, and the client secret shows nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oidc_example_job_reads_every_record_once_and_shows_no_secret() {
    let oidc = tinyflow_connectors_kafka::testing::oidc();
    secured_job_reads_once_showing_no_secret(
        &example_job("secured-oidc.toml"),
        "oidc_bids",
        &[
            ("OIDC_ISSUER", oidc.issuer.as_str()),
            ("OIDC_CLIENT_ID", oidc.client_id.as_str()),
            ("OIDC_CLIENT_SECRET", oidc.client_secret.as_str()),
        ],
        &oidc.client_secret,
    )
    .await;
}

/// Runs `job` (an example on the secured listener, writing
/// `secured.<table>`) with `envs` and every log on, on a fresh topic:
/// every record once, exit 0 on SIGTERM, and `secret` in no output of the
/// run, of `validate` or of `inspect`.
async fn secured_job_reads_once_showing_no_secret(
    job: &Path,
    table: &str,
    envs: &[(&str, &str)],
    secret: &str,
) {
    let n = 3_000u64;
    let (_, topic) = fresh_topic("secured-bids", n).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let data = dir.to_str().unwrap();
    let mut envs = envs.to_vec();
    envs.extend([("TOPIC", topic.as_str()), ("TINYFLOW_DATA", data)]);
    let mut run = Run::start_env(job, &dir, 0, "debug", 0, &envs);
    let reader = TableReader::open(
        &tinyflow_connectors_iceberg::CatalogConfig::sqlite(&dir),
        "secured",
        table,
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while committed_rows(&reader).await < n {
        assert!(
            Instant::now() < deadline,
            "not every record after 120 s; log: {}",
            std::fs::read_to_string(&run.log).unwrap_or_default()
        );
        run.assert_alive();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log_path = run.log.clone();
    run.stop();
    let table = tinyflow_tests::pyiceberg_read(&dir, &format!("secured.{table}"), &["id", "price"]);
    assert_eq!(table["rows"], n, "{table}");
    assert_eq!(table["distinct_ids"], n, "{table}");
    let mut output = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        output.contains(" DEBUG ") && output.contains(&topic),
        "not the debug log of a run on the secured listener: {output}"
    );
    for args in [
        vec!["validate", job.to_str().unwrap()],
        vec!["inspect", job.to_str().unwrap()],
    ] {
        let out = Command::new(tinyflow_bin())
            .args(&args)
            .envs(envs.iter().copied())
            .env("TINYFLOW_LOG", "debug")
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        output.push_str(&String::from_utf8_lossy(&out.stdout));
        output.push_str(&String::from_utf8_lossy(&out.stderr));
    }
    assert!(!output.contains(secret), "the secret shows in the output");
}

/// The same job with a wrong password: it fails within 30 s, for good (exit
/// 2, a configuration error), saying which settings to check, and the
/// wrong password shows nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_fails_the_secured_job_within_30_s_with_exit_2_and_no_secret() {
    let (_, topic) = fresh_topic("secured-wrong", 10).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let wrong = "wrong-password-3f9a1c";
    let envs = [
        ("TOPIC", topic.as_str()),
        ("TINYFLOW_DATA", dir.to_str().unwrap()),
        ("KAFKA_SASL_PASSWORD", wrong),
    ];
    let started = Instant::now();
    let mut run = Run::start_env(&secured_example(), &dir, 0, "debug", 0, &envs);
    let (code, log) = run.exit_code_within(Duration::from_secs(60));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?}; log: {log}",
        started.elapsed()
    );
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(
            "authentication failed: check sasl.mechanism, sasl.username and sasl.password"
        ),
        "{log}"
    );
    assert!(!log.contains(wrong), "the wrong password shows: {log}");
    assert_eq!(
        log.matches("starting job attempt").count(),
        1,
        "restarted: {log}"
    );
}

/// A broker that cannot be reached: the first attempt fails within 30 s,
/// and with the default restart settings the job within 2 minutes, exit 1,
/// saying what it could not reach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_fails_the_job_within_2_minutes() {
    let port = free_port();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let job = dir.join("job.toml");
    // The chaos job's text without its own [restart]: the defaults.
    let text = job_text(&dir, &format!("127.0.0.1:{port}"), "nowhere", "");
    let text = text[..text.find("[restart]").unwrap()].to_owned();
    std::fs::write(&job, text).unwrap();
    let started = Instant::now();
    let mut run = Run::start(&job, &dir, 0);
    assert!(
        run.wait_for("job attempt failed", Duration::from_secs(30)),
        "the first attempt did not fail within 30 s; log: {}",
        std::fs::read_to_string(&run.log).unwrap_or_default()
    );
    let (code, log) = run.exit_code_within(Duration::from_secs(150));
    let took = started.elapsed();
    assert!(took < Duration::from_secs(120), "took {took:?}; log: {log}");
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains(&format!("127.0.0.1:{port}")), "{log}");
}

/// A second signal stops a job at once, without a final checkpoint, and the
/// exit code says which signal (130 for SIGINT, 143 for SIGTERM); a job
/// file that does not parse exits 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_130_or_143_and_a_bad_job_file_exits_2() {
    let (bootstrap, topic) = fresh_topic("forced-bids", 2_000).await;
    for (signal, code) in [("-INT", 130), ("-TERM", 143)] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        // Commits pause 2 s, so the final checkpoint cannot finish in time.
        let job = job_file(&dir, &bootstrap, &topic, "");
        let mut run = Run::start_with(&job, &dir, 0, "info", 2_000);
        assert!(
            run.wait_for("CHAOS commit paused", Duration::from_secs(60)),
            "no commit; log: {}",
            std::fs::read_to_string(&run.log).unwrap_or_default()
        );
        let pid = run.child.id().to_string();
        for _ in 0..2 {
            let sent = Command::new("kill").args([signal, &pid]).status().unwrap();
            assert!(sent.success());
            std::thread::sleep(Duration::from_millis(300));
        }
        let (exit, log) = run.exit_code_within(Duration::from_secs(30));
        assert_eq!(exit, Some(code), "{signal}: {log}");
        assert!(log.contains("without a final checkpoint"), "{log}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.toml");
    std::fs::write(&bad, "[job]\nname = \"x\"\nparalelism = 2\n").unwrap();
    let (code, _, err) = tinyflow(&["run", bad.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("paralelism"), "{err}");
}

/// Settings the client refuses, with secrets among them (a key password
/// read from a file, an OAUTHBEARER client secret written in the file):
/// the run fails at once with exit 2, naming the setting, and neither
/// secret shows in anything it prints, whatever the log level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_of_a_refused_configuration_show_nowhere() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let key_pass = "key-pass-445566";
    let oauth = "oauth-client-secret-778899";
    std::fs::write(dir.join("key-pass"), format!("{key_pass}\n")).unwrap();
    std::fs::write(dir.join("bogus.pem"), "not a key").unwrap();
    let text = job_text(&dir, "127.0.0.1:9", "bids", "").replace(
        "fields = [",
        &format!(
            r#"properties = {{ "security.protocol" = "SSL", "ssl.key.location" = "{d}/bogus.pem", "ssl.certificate.location" = "{d}/bogus.pem", "ssl.key.password" = "${{file:{d}/key-pass}}", "sasl.oauthbearer.config" = "clientId=tinyflow clientSecret={oauth}" }}
fields = ["#,
            d = dir.display()
        ),
    );
    let job = dir.join("job.toml");
    std::fs::write(&job, text).unwrap();
    let mut run = Run::start_logging(&job, &dir, 0, "trace");
    let (code, log) = run.exit_code_within(Duration::from_secs(30));
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("ssl.certificate.location"), "{log}");
    for secret in [key_pass, oauth] {
        assert!(!log.contains(secret), "{secret} shows: {log}");
    }
    let (code, out, err) = tinyflow(&["validate", job.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        !out.contains(key_pass) && !out.contains(oauth) && !err.contains(oauth),
        "{out}{err}"
    );
}
