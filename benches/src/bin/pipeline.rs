//! The whole pipeline against its raw limits, on a real broker pre-loaded
//! with Nexmark bids as JSON, all in one run:
//!
//! 1. a bare rdkafka consume loop (the raw read limit);
//! 2. a bare JSON decode (arrow-json) + Parquet write loop, from memory,
//!    compressed as the sink compresses by default (the raw processing limit);
//! 3. the tinyflow job end to end (the same job `tinyflow run` runs from a
//!    job file: Kafka -> compute price_eur -> Iceberg in a sqlite catalog),
//!    checkpoints (and commits) every 1 s, timed from the first record read
//!    to the moment the table's current snapshot holds every record; the job
//!    is bounded (`source.bounded`): it knows where the topic ends, as the
//!    Python loop does, and ends with a final checkpoint and commit instead
//!    of waiting for the next one on the 1 s grid;
//! 4. the same with checkpoints off (interval 1 h: nothing is committed
//!    before the end),
//!    timed to the last row handed to the Parquet writers;
//! 5. a Python loop with confluent-kafka and pyiceberg doing the same job
//!    as a user might script it (`benches/python/bids_loop.py`);
//!
//! 7. the job as `tinyflow run` processes (bounded, 1 s checkpoints): one
//!    process of 2 subtasks, then 2 worker processes (`--worker I/2`) of 1
//!    subtask each, committing to one table, timed from the start of the
//!    processes to the exit of the last (start-up included, the same for
//!    both): the cost of spreading a job over processes, with the commits,
//!    catalog updates and commit conflicts the processes report. It runs
//!    the `tinyflow` binary beside the bench's own (`cargo build --release
//!    -p tinyflow-cli`), or `TINYFLOW_BIN`;
//!
//! then the append-to-visible latency: bids produced at a steady rate while
//! the job runs with 1 s checkpoints, once it has read a first bid from
//! every partition; each bid's latency is the commit time of the snapshot
//! that first holds it minus the time it was produced (p50/p99/max, and
//! p99/max by second of production, which shows a slow checkpoint as one
//! bad second).
//! Peak RSS (VmHWM, reset before each variant) per variant; the reset cannot
//! take back memory an earlier variant left with the allocator, so the jobs
//! run right after the light bare loop, and
//! `--only 3` gives the job's RSS alone.
//!
//! `cargo xtask kafka start`, export the line it prints, then
//! `cargo run --release -p tinyflow-benches --bin pipeline -- [--records N]
//! [--partitions N] [--latency-rate N] [--latency-secs N] [--skip-python] [--only N]...
//! [--source-props k=v,...] [--batch-size N] [--compression CODEC] [--sasl-ssl]`.
//! `--compression zstd` reads a topic produced with that codec (a topic of
//! its own); `--sasl-ssl` reads over the broker's SASL_SSL listener with
//! SCRAM-SHA-512 (`cargo xtask kafka start --secured` and export its lines),
//! the bare consume loop as well, so that each ratio compares like with
//! like. `TINYFLOW_LOG=info` (an
//! env filter) prints the job's logs on stderr: each checkpoint's duration
//! and each commit.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark binary: prints its figures, and any failure ends it"
)]

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arrow_json::ReaderBuilder;
use arrow_schema::{DataType, Field, Schema};
use metrics_exporter_prometheus::PrometheusHandle;
use parquet::arrow::ArrowWriter;
use tinyflow_benches::kafka::{
    BidsTopic, CpuMeter, CpuUse, bare_consume, bootstrap, ensure_bids_topic_as, peak_rss_mb,
    reset_peak_rss,
};
use tinyflow_benches::sink_writer_properties;
use tinyflow_cli::JobFile;
use tinyflow_cli::nexmark::{BID_FIELDS, bids};
use tinyflow_connectors_iceberg::{TableReader, scan_longs};
use tinyflow_connectors_kafka::DEFAULT_CLIENT_SETTINGS;

struct Args {
    records: u64,
    partitions: i32,
    latency_rate: u64,
    latency_secs: u64,
    python: bool,
    /// Run only these variants (1-7; 6 is the latency run, 7 the processes).
    only: Vec<u64>,
    /// librdkafka settings for the job's source, `k=v,k=v`.
    source_props: String,
    /// `source.batch_size` of the job (default: the source's).
    batch_size: Option<u64>,
    /// The topic's producer codec (`--compression`).
    compression: Option<String>,
    /// Read over the SASL_SSL listener (`--sasl-ssl`).
    sasl_ssl: bool,
    /// The bids as Avro in the Confluent wire format (`--format avro`),
    /// with a schema registry for the job.
    avro: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        records: 3_000_000,
        partitions: 4,
        latency_rate: 100_000,
        latency_secs: 15,
        python: true,
        only: Vec::new(),
        source_props: String::new(),
        batch_size: None,
        compression: None,
        sasl_ssl: false,
        avro: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if flag == "--skip-python" {
            a.python = false;
            continue;
        }
        if flag == "--sasl-ssl" {
            a.sasl_ssl = true;
            continue;
        }
        if flag == "--compression" {
            a.compression = Some(
                it.next()
                    .unwrap_or_else(|| usage_error("--compression needs a codec")),
            );
            continue;
        }
        if flag == "--format" {
            a.avro = match it.next().as_deref() {
                Some("avro") => true,
                Some("json") => false,
                _ => usage_error("--format needs json or avro"),
            };
            continue;
        }
        if flag == "--source-props" {
            a.source_props = it.next().expect("--source-props needs k=v,k=v");
            continue;
        }
        if !NUMERIC.contains(&flag.as_str()) {
            usage_error(&format!("unknown option {flag}"));
        }
        let v: u64 = it
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| usage_error(&format!("{flag} needs a whole number")));
        match flag.as_str() {
            "--records" => a.records = v,
            "--partitions" => a.partitions = v as i32,
            "--latency-rate" => a.latency_rate = v,
            "--latency-secs" => a.latency_secs = v,
            "--only" => a.only.push(v),
            _ => a.batch_size = Some(v),
        }
    }
    a
}

const USAGE: &str = "usage: pipeline [--records N] [--partitions N] [--latency-rate N] \
[--latency-secs N] [--skip-python] [--only 1..7]... [--source-props k=v,...] [--batch-size N] \
[--compression gzip|snappy|lz4|zstd] [--sasl-ssl] [--format json|avro]
(start the broker with `cargo xtask kafka start --secured` and export the lines it prints first)";

/// The options that take a whole number.
const NUMERIC: [&str; 6] = [
    "--records",
    "--partitions",
    "--latency-rate",
    "--latency-secs",
    "--only",
    "--batch-size",
];

fn usage_error(what: &str) -> ! {
    eprintln!("pipeline: {what}\n{USAGE}");
    std::process::exit(2);
}

/// Settings of the job variants beyond the defaults.
struct Knobs {
    /// Where the job reads.
    bootstrap: String,
    /// The schema registry of Avro bids (`--format avro`).
    registry: Option<String>,
    /// librdkafka settings, `k=v,k=v`.
    props: String,
    /// `source.batch_size`.
    batch_size: Option<u64>,
}

/// One variant's figures.
#[derive(Debug, Clone, Copy)]
struct Figure {
    events: u64,
    secs: f64,
    rss_mb: f64,
    /// Machine-wide CPU use while it ran (the broker's included).
    cpu: CpuUse,
    /// For the jobs: seconds from the first record read to the last.
    read_secs: Option<f64>,
    /// For the jobs: what their checkpoints cost, from the job's metrics.
    checkpoints: Option<CheckpointCost>,
}

/// A job's checkpoints while it ran, from its metrics (sums over subtasks).
#[derive(Debug, Clone, Copy)]
struct CheckpointCost {
    completed: f64,
    /// Mean trigger-to-durable seconds.
    mean_secs: f64,
    /// Seconds inputs were held for barrier alignment.
    alignment_secs: f64,
    /// Seconds tasks waited for room downstream.
    backpressure_secs: f64,
    commits: f64,
    /// Mean commit seconds.
    commit_secs: f64,
}

impl CheckpointCost {
    /// What changed between two renderings of the job's metrics.
    fn between(before: &str, after: &str) -> Self {
        let d = |name| {
            tinyflow_cli::metric_sum(after, name, None)
                - tinyflow_cli::metric_sum(before, name, None)
        };
        let commits = d("tinyflow_iceberg_commits_total");
        Self {
            completed: d("tinyflow_checkpoints_completed_total"),
            mean_secs: d("tinyflow_checkpoint_duration_seconds_sum")
                / d("tinyflow_checkpoint_duration_seconds_count").max(1.0),
            alignment_secs: d("tinyflow_alignment_seconds_sum"),
            backpressure_secs: d("tinyflow_backpressure_microseconds_total") / 1e6,
            commits,
            commit_secs: d("tinyflow_iceberg_commit_seconds_sum") / commits.max(1.0),
        }
    }
}

impl Figure {
    fn rate(&self) -> f64 {
        self.events as f64 / self.secs
    }

    /// Machine-wide CPU microseconds per event.
    fn cpu_us_per_event(&self) -> f64 {
        self.cpu.core_secs * 1e6 / self.events as f64
    }
}

fn bid_schema() -> Arc<Schema> {
    let fields = BID_FIELDS
        .iter()
        .map(|(name, ty)| {
            let t = if *ty == "long" {
                DataType::Int64
            } else {
                DataType::Utf8
            };
            Field::new(*name, t, false)
        })
        .collect::<Vec<_>>();
    Arc::new(Schema::new(fields))
}

/// (2) for Avro bids: decode them with arrow-avro (the Confluent framing,
/// writer schema id `id`) into record batches and write them to one zstd
/// Parquet file, from values held in memory.
fn decode_avro_and_write(n: u64, dir: &Path, id: u32) -> Figure {
    use arrow_avro::reader::ReaderBuilder;
    use arrow_avro::schema::{AvroSchema, Fingerprint, FingerprintAlgorithm, SchemaStore};
    let pool: Vec<Vec<u8>> = bids().take(200_000).map(|b| b.to_avro(id)).collect();
    reset_peak_rss();
    let mut store = SchemaStore::new_with_type(FingerprintAlgorithm::Id);
    store
        .set(
            Fingerprint::Id(id),
            AvroSchema::new(tinyflow_cli::nexmark::BID_AVRO_SCHEMA.to_owned()),
        )
        .unwrap();
    let mut decoder = ReaderBuilder::new()
        .with_writer_schema_store(store)
        .with_active_fingerprint(Fingerprint::Id(id))
        .with_batch_size(8192)
        .build_decoder()
        .unwrap();
    let mut file = Some(std::fs::File::create(dir.join("bare-avro.parquet")).unwrap());
    let mut writer = None;
    let mut write = |batch: &arrow_array::RecordBatch| {
        writer
            .get_or_insert_with(|| {
                let props = sink_writer_properties(batch);
                ArrowWriter::try_new(file.take().unwrap(), batch.schema(), Some(props)).unwrap()
            })
            .write(batch)
            .unwrap();
    };
    let start = Instant::now();
    let cpu = CpuMeter::start();
    for value in pool.iter().cycle().take(n as usize) {
        let used = decoder.decode(value).unwrap();
        assert_eq!(used, value.len());
        if decoder.batch_is_full()
            && let Some(batch) = decoder.flush().unwrap()
        {
            write(&batch);
        }
    }
    if let Some(batch) = decoder.flush().unwrap() {
        write(&batch);
    }
    writer.unwrap().close().unwrap();
    Figure {
        events: n,
        secs: start.elapsed().as_secs_f64(),
        rss_mb: peak_rss_mb(),
        cpu: cpu.stop(),
        read_secs: None,
        checkpoints: None,
    }
}

/// (2): decode JSON bids into record batches and write them to one zstd
/// Parquet file, from values held in memory (a pool reused in a cycle).
fn decode_and_write(n: u64, dir: &Path) -> Figure {
    let pool: Vec<Vec<u8>> = bids()
        .take(200_000)
        .map(|b| serde_json::to_vec(&b).unwrap())
        .collect();
    reset_peak_rss();
    let schema = bid_schema();
    let mut file = Some(std::fs::File::create(dir.join("bare.parquet")).unwrap());
    // Opened on the first batch, which decides the columns without a dictionary.
    let mut writer = None;
    let mut write = |batch: &arrow_array::RecordBatch| {
        writer
            .get_or_insert_with(|| {
                let props = sink_writer_properties(batch);
                ArrowWriter::try_new(file.take().unwrap(), batch.schema(), Some(props)).unwrap()
            })
            .write(batch)
            .unwrap();
    };
    let mut decoder = ReaderBuilder::new(schema)
        .with_batch_size(8192)
        .build_decoder()
        .unwrap();
    let start = Instant::now();
    let cpu = CpuMeter::start();
    let mut done = 0u64;
    for value in pool.iter().cycle().take(n as usize) {
        decoder.decode(value).unwrap();
        done += 1;
        if done.is_multiple_of(8192)
            && let Some(batch) = decoder.flush().unwrap()
        {
            write(&batch);
        }
    }
    if let Some(batch) = decoder.flush().unwrap() {
        write(&batch);
    }
    writer.unwrap().close().unwrap();
    Figure {
        events: n,
        secs: start.elapsed().as_secs_f64(),
        rss_mb: peak_rss_mb(),
        cpu: cpu.stop(),
        read_secs: None,
        checkpoints: None,
    }
}

/// The bench's job file; `bounded`: read to the topic's end, then a final
/// checkpoint and commit, and the job ends.
fn job_text(
    topic: &str,
    partitions: i32,
    dir: &Path,
    interval: &str,
    bounded: bool,
    knobs: &Knobs,
) -> String {
    let props: Vec<String> = knobs
        .props
        .split(',')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("--source-props needs k=v,k=v");
            format!("\"{k}\" = \"{v}\"")
        })
        .collect();
    let fields: Vec<String> = BID_FIELDS
        .iter()
        .map(|(n, t)| format!("  {{ name = \"{n}\", type = \"{t}\", required = true }},"))
        .collect();
    format!(
        r#"
[job]
name = "bench"
parallelism = 2

[source]
bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
parallelism = {partitions}
bounded = {bounded}
{batch}
{format}
properties = {{ {props} }}
fields = [
{fields}
]

[[transforms]]
compute = {{ column = "price_eur", expr = "price / 100" }}

[sink]
namespace = "bench"
table = "bids"
parallelism = 2
catalog = {{ type = "sqlite", dir = "{dir}" }}

[checkpoint]
interval = "{interval}"
dir = "{dir}/checkpoints"

[restart]
strategy = "none"
"#,
        bootstrap = knobs.bootstrap,
        fields = fields.join("\n"),
        props = props.join(", "),
        batch = knobs
            .batch_size
            .map_or(String::new(), |b| format!("batch_size = {b}")),
        format = knobs.registry.as_ref().map_or(String::new(), |r| format!(
            "format = \"avro\"\nregistry = {{ url = \"{r}\" }}"
        )),
        dir = dir.display(),
    )
}

fn metric(handle: &PrometheusHandle, name: &str) -> f64 {
    tinyflow_cli::metric_sum(&handle.render(), name, None)
}

async fn total_records(table: &TableReader) -> u64 {
    // Before the first commit the table may not exist yet.
    table
        .load()
        .await
        .map_or(0, |t| tinyflow_connectors_iceberg::total_records(&t))
}

/// (3) and (4): the job; with `commit`, until the table holds `n` rows,
/// else until `n` rows reached the writers.
async fn job(
    knobs: &Knobs,
    topic: &BidsTopic,
    n: u64,
    dir: &Path,
    interval: &str,
    commit: bool,
    handle: &PrometheusHandle,
) -> Figure {
    let plan = JobFile::parse(
        &job_text(&topic.name, topic.partitions, dir, interval, true, knobs),
        "bench",
    )
    .unwrap()
    .plan()
    .unwrap();
    // Opened once: a catalog opened on every poll would load the machine.
    let table = TableReader::open(&plan.sink.catalog, "bench", "bids")
        .await
        .unwrap();
    let read0 = metric(handle, "tinyflow_kafka_records_read_total");
    let metrics0 = handle.render();
    let written0 = metric(handle, "tinyflow_iceberg_rows_written_total");
    reset_peak_rss();
    let running = tokio::spawn(plan.run());
    while metric(handle, "tinyflow_kafka_records_read_total") <= read0 {
        assert!(!running.is_finished(), "the job ended before reading");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let start = Instant::now();
    let cpu = CpuMeter::start();
    let mut read_secs = None;
    // Loading the table costs the job CPU: only after a commit.
    let mut commits_seen = metric(handle, "tinyflow_iceberg_commits_total");
    loop {
        // A bounded job ends by itself once its last commit is done.
        let finished = running.is_finished();
        // One rendering of the metrics per round: it costs the job CPU.
        let text = handle.render();
        let now = |name| tinyflow_cli::metric_sum(&text, name, None);
        if read_secs.is_none() && now("tinyflow_kafka_records_read_total") - read0 >= n as f64 {
            read_secs = Some(start.elapsed().as_secs_f64());
        }
        let done = if commit {
            let commits = now("tinyflow_iceberg_commits_total");
            commits > commits_seen && {
                commits_seen = commits;
                total_records(&table).await >= n
            }
        } else {
            now("tinyflow_iceberg_rows_written_total") - written0 >= n as f64
        };
        if done {
            break;
        }
        assert!(!finished, "the job ended early: {:?}", running.await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu.stop();
    let rss_mb = peak_rss_mb();
    let checkpoints = Some(CheckpointCost::between(&metrics0, &handle.render()));
    running.abort();
    let _ = running.await;
    Figure {
        events: n,
        secs,
        rss_mb,
        cpu,
        read_secs,
        checkpoints,
    }
}

/// What (7) measured of one layout of processes.
struct Processes {
    secs: f64,
    cpu: CpuUse,
    /// Summed over the processes: `commits`, `commit_attempts`,
    /// `commit_conflicts`, from each one's final counters line.
    commits: u64,
    attempts: u64,
    conflicts: u64,
}

/// (7): the bounded job with 1 s checkpoints as `workers` processes of
/// `parallelism` subtasks each (one process without `--worker` when
/// `workers` is 1), until every process exited.
fn processes(
    knobs: &Knobs,
    topic: &BidsTopic,
    dir: &Path,
    workers: u32,
    parallelism: usize,
) -> Processes {
    std::fs::create_dir_all(dir).unwrap();
    let text: String = job_text(&topic.name, topic.partitions, dir, "1s", true, knobs)
        .lines()
        .map(|l| {
            if l.starts_with("parallelism =") {
                format!("parallelism = {parallelism}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    let job = dir.join("job.toml");
    std::fs::write(&job, text).unwrap();
    let start = Instant::now();
    let cpu = CpuMeter::start();
    let children: Vec<(std::process::Child, PathBuf)> = (0..workers)
        .map(|i| {
            let log = dir.join(format!("worker-{i}.log"));
            let mut cmd = Command::new(tinyflow_benches::tinyflow_bin());
            cmd.arg("run").arg(&job);
            if workers > 1 {
                cmd.args(["--worker", &format!("{i}/{workers}")]);
            }
            let child = cmd
                .env("TINYFLOW_LOG", "info")
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap();
            (child, log)
        })
        .collect();
    let (mut commits, mut attempts, mut conflicts) = (0, 0, 0);
    for (mut child, log) in children {
        let status = child.wait().unwrap();
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(status.success(), "{}: {status}; log: {text}", log.display());
        let line = text
            .lines()
            .find(|l| l.contains("final counters of this run"))
            .unwrap_or_else(|| panic!("no final counters in {}", log.display()));
        let count = |key: &str| -> u64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(key))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {key} in {line}"))
        };
        commits += count("commits=");
        attempts += count("commit_attempts=");
        conflicts += count("commit_conflicts=");
    }
    Processes {
        secs: start.elapsed().as_secs_f64(),
        cpu: cpu.stop(),
        commits,
        attempts,
        conflicts,
    }
}

/// (5): the Python loop.
fn python(topic: &BidsTopic, n: u64, dir: &Path) -> Option<Figure> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let py = std::env::var("TINYFLOW_PYTHON").map_or_else(
        |_| root.join("target/pyiceberg-venv/bin/python"),
        PathBuf::from,
    );
    let has = Command::new(&py)
        .args(["-c", "import confluent_kafka, pyiceberg"])
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        eprintln!(
            "installing benches/python/requirements.txt into {}",
            py.display()
        );
        let ok = Command::new(&py)
            .args(["-m", "pip", "install", "-q", "-r"])
            .arg(root.join("benches/python/requirements.txt"))
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!(
                "(5) skipped: could not install the Python loop's packages into {} (run `cargo xtask py-setup` first)",
                py.display()
            );
            return None;
        }
    }
    // The whole process: the interpreter's start and imports count too.
    let cpu = CpuMeter::start();
    let out = Command::new(&py)
        .arg(root.join("benches/python/bids_loop.py"))
        .args(["--bootstrap", &bootstrap(), "--topic", &topic.name])
        .args(["--expect", &n.to_string(), "--dir"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the Python loop failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(line.lines().last().unwrap()).unwrap();
    Some(Figure {
        events: v["events"].as_u64().unwrap(),
        secs: v["seconds"].as_f64().unwrap(),
        rss_mb: v["peak_rss_mb"].as_f64().unwrap(),
        cpu: cpu.stop(),
        read_secs: None,
        checkpoints: None,
    })
}

/// Each bid's append-to-visible latency, in ms, with the second (from the
/// start of production) in which it was produced.
struct Latencies {
    /// Sorted.
    all: Vec<i64>,
    /// Latencies by second of production, each sorted.
    by_second: Vec<Vec<i64>>,
}

/// Append-to-visible latency, from a fresh topic fed at `rate` bids/s for
/// `secs` while the job commits every second.
async fn latency(
    knobs: &Knobs,
    partitions: i32,
    rate: u64,
    secs: u64,
    dir: &Path,
    handle: &PrometheusHandle,
) -> Latencies {
    let topic = format!("tinyflow-bench-latency-{}", tinyflow_benches::now_ms());
    tinyflow_connectors_kafka::testing::create_topic(&bootstrap(), &topic, partitions)
        .await
        .unwrap();
    let n = rate * secs;
    let plan = JobFile::parse(
        &job_text(&topic, partitions, dir, "1s", false, knobs),
        "latency",
    )
    .unwrap()
    .plan()
    .unwrap();
    let reader = TableReader::open(&plan.sink.catalog, "bench", "bids")
        .await
        .unwrap();
    let read0 = metric(handle, "tinyflow_kafka_records_read_total");
    let running = tokio::spawn(plan.run());
    // Time only a running job: a bid per partition (ids from n on, left out
    // of the figures) must have been read first.
    let warmup: Vec<(i32, Vec<u8>)> = bids()
        .take(partitions as usize)
        .zip(0..partitions)
        .map(|(mut b, p)| {
            b.id = n + p as u64;
            (p, serde_json::to_vec(&b).unwrap())
        })
        .collect();
    // The same producer sends the warm-up and the timed bids: a new
    // idempotent producer takes a while to get its producer id.
    let go = Arc::new(AtomicBool::new(false));
    let sent_at: Arc<std::sync::Mutex<Vec<i64>>> = Arc::default();
    let producer = {
        let (sent_at, topic, go) = (Arc::clone(&sent_at), topic.clone(), Arc::clone(&go));
        std::thread::spawn(move || {
            let mut start = None;
            let timed = bids().take(n as usize).map(move |b| {
                let start = *start.get_or_insert_with(|| {
                    while !go.load(Ordering::Acquire) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Instant::now()
                });
                let due = Duration::from_secs_f64(b.id as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(start.elapsed()) {
                    std::thread::sleep(wait);
                }
                sent_at.lock().unwrap().push(tinyflow_benches::now_ms());
                (
                    (b.id % partitions as u64) as i32,
                    serde_json::to_vec(&b).unwrap(),
                )
            });
            tinyflow_connectors_kafka::testing::produce_stream(
                &bootstrap(),
                &topic,
                &[("linger.ms", "5")],
                warmup.into_iter().chain(timed),
            )
        })
    };
    while metric(handle, "tinyflow_kafka_records_read_total") - read0 < f64::from(partitions) {
        assert!(!running.is_finished(), "the latency job ended early");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let produce_start_ms = tinyflow_benches::now_ms();
    go.store(true, Ordering::Release);
    while total_records(&reader).await < n + partitions as u64 {
        assert!(!running.is_finished(), "the latency job ended early");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    producer.join().unwrap().unwrap();
    running.abort();
    let _ = running.await;
    // Which snapshot first holds each id: scan every snapshot, oldest first.
    let table = reader.load().await.unwrap();
    let mut snapshots: Vec<_> = table.metadata().snapshots().cloned().collect();
    snapshots.sort_by_key(|s| s.sequence_number());
    let sent = sent_at.lock().unwrap().clone();
    let mut seen: HashSet<i64> = HashSet::with_capacity(n as usize);
    let mut lat = Vec::with_capacity(n as usize);
    let mut by_second = vec![Vec::new(); secs as usize + 1];
    for s in snapshots {
        let ids = scan_longs(&table, "id", Some(s.snapshot_id()))
            .await
            .unwrap();
        for id in ids {
            if (id as u64) < n && seen.insert(id) {
                let sent = sent[id as usize];
                let l = s.timestamp_ms() - sent;
                lat.push(l);
                let second = ((sent - produce_start_ms).max(0) / 1000) as usize;
                by_second[second.min(secs as usize)].push(l);
            }
        }
    }
    assert_eq!(lat.len() as u64, n, "every bid is visible once");
    lat.sort_unstable();
    by_second.retain(|v| !v.is_empty());
    for v in &mut by_second {
        v.sort_unstable();
    }
    Latencies {
        all: lat,
        by_second,
    }
}

fn pct(v: &[i64], p: f64) -> i64 {
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    let a = parse_args();
    // The job's logs, on stderr, only when asked for: `TINYFLOW_LOG=info`.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("TINYFLOW_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
    // Avro bids: a schema registry of their schema for the job (the tests'
    // Confluent-compatible one; stopped when the bench ends).
    let registry = a.avro.then(tinyflow_tests::registry::SchemaRegistry::start);
    let avro_id = registry.as_ref().map(|r| {
        r.register(
            "tinyflow-bench-bids-value",
            tinyflow_cli::nexmark::BID_AVRO_SCHEMA,
        )
    });
    let topic = ensure_bids_topic_as(
        &bootstrap(),
        a.records,
        a.partitions,
        a.compression.as_deref(),
        avro_id,
    )
    .unwrap();
    // Over the SASL_SSL listener: the job and the bare loop alike.
    let secured = a.sasl_ssl.then(tinyflow_connectors_kafka::testing::secured);
    let security: Vec<(String, String)> = secured
        .as_ref()
        .map(|s| {
            vec![
                ("security.protocol".to_owned(), "SASL_SSL".to_owned()),
                ("sasl.mechanism".to_owned(), "SCRAM-SHA-512".to_owned()),
                ("sasl.username".to_owned(), s.username.clone()),
                ("sasl.password".to_owned(), s.password.clone()),
                ("ssl.ca.location".to_owned(), s.ca.clone()),
            ]
        })
        .unwrap_or_default();
    let n = topic.records;
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let handle = rt
        .block_on(tinyflow_cli::install_metrics(None, &[]))
        .unwrap();
    println!(
        "pipeline bench: {n} Nexmark bids as {} in {} ({} partitions), read over {}",
        if a.avro {
            "Avro (Confluent wire format)"
        } else {
            "JSON"
        },
        topic.name,
        topic.partitions,
        if a.sasl_ssl {
            "SASL_SSL (SCRAM-SHA-512)"
        } else {
            "PLAINTEXT"
        }
    );

    let on = |v: u64| a.only.is_empty() || a.only.contains(&v);
    let mut props: Vec<String> = security.iter().map(|(k, v)| format!("{k}={v}")).collect();
    props.extend(
        a.source_props
            .split(',')
            .filter(|kv| !kv.is_empty())
            .map(str::to_owned),
    );
    let knobs = Knobs {
        bootstrap: secured
            .as_ref()
            .map_or_else(bootstrap, |s| s.bootstrap.clone()),
        props: props.join(","),
        batch_size: a.batch_size,
        registry: registry
            .as_ref()
            .map(tinyflow_tests::registry::SchemaRegistry::url),
    };
    let mut bare_settings: Vec<(&str, &str)> = DEFAULT_CLIENT_SETTINGS.to_vec();
    bare_settings.extend(security.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    if let Some(s) = &secured {
        bare_settings.push(("bootstrap.servers", s.bootstrap.as_str()));
    }
    let props = &knobs;
    let bare = on(1).then(|| {
        eprintln!("(1) bare consume ...");
        let cpu = CpuMeter::start();
        let b = bare_consume(&topic, &bare_settings);
        Figure {
            events: b.records,
            secs: b.secs,
            rss_mb: b.rss_mb,
            cpu: cpu.stop(),
            read_secs: None,
            checkpoints: None,
        }
    });
    let job1s = on(3).then(|| {
        eprintln!("(3) tinyflow job, checkpoints every 1 s ...");
        rt.block_on(job(
            props,
            &topic,
            n,
            &tmp.path().join("job"),
            "1s",
            true,
            &handle,
        ))
    });
    let off = on(4).then(|| {
        eprintln!("(4) tinyflow job, checkpoints off ...");
        rt.block_on(job(
            props,
            &topic,
            n,
            &tmp.path().join("job-off"),
            "1h",
            false,
            &handle,
        ))
    });
    let decode = on(2).then(|| {
        eprintln!("(2) bare decode + parquet ...");
        match avro_id {
            Some(id) => decode_avro_and_write(n, tmp.path(), id),
            None => decode_and_write(n, tmp.path()),
        }
    });
    let procs = on(7).then(|| {
        eprintln!("(7) tinyflow run: 1 process of 2 subtasks, then 2 workers of 1 ...");
        let one = processes(props, &topic, &tmp.path().join("procs-1x2"), 1, 2);
        let two = processes(props, &topic, &tmp.path().join("procs-2x1"), 2, 1);
        (one, two)
    });
    // The Python loop and the latency run produce and read JSON bids.
    let py = if a.python && !a.sasl_ssl && !a.avro && on(5) {
        eprintln!("(5) Python loop ...");
        python(&topic, n, &tmp.path().join("python"))
    } else {
        None
    };
    let lat = (on(6) && !a.avro).then(|| {
        eprintln!(
            "latency: {} bids/s for {} s ...",
            a.latency_rate, a.latency_secs
        );
        rt.block_on(latency(
            props,
            a.partitions,
            a.latency_rate,
            a.latency_secs,
            &tmp.path().join("latency"),
            &handle,
        ))
    });

    let show = |label: &str, f: &Figure| {
        println!(
            "{label:<44} {:>7.3} M events/s  ({:>6.2} s, peak RSS {:>5.0} MB, {:.2} cores busy, {:.2} us CPU/event)",
            f.rate() / 1e6,
            f.secs,
            f.rss_mb,
            f.cpu.busy_cores,
            f.cpu_us_per_event()
        );
        if let Some(read) = f.read_secs {
            println!(
                "{:<44} read every record in {read:.2} s ({:.3} M events/s), then {:.2} s to the end",
                "",
                f.events as f64 / read / 1e6,
                f.secs - read
            );
        }
        if let Some(c) = f.checkpoints {
            println!(
                "{:<44} {:.0} checkpoints ({:.0} ms each), {:.0} commits ({:.0} ms each); inputs held {:.2} s for alignment, tasks waited {:.2} s for room downstream",
                "",
                c.completed,
                c.mean_secs * 1e3,
                c.commits,
                c.commit_secs * 1e3,
                c.alignment_secs,
                c.backpressure_secs
            );
        }
    };
    let rows = [
        ("(1) bare rdkafka consume loop", &bare),
        (
            if a.avro {
                "(2) bare Avro decode + Parquet write"
            } else {
                "(2) bare JSON decode + Parquet write"
            },
            &decode,
        ),
        ("(3) tinyflow job, checkpoints every 1 s", &job1s),
        ("(4) tinyflow job, checkpoints off", &off),
        ("(5) Python loop (confluent-kafka + pyiceberg)", &py),
    ];
    for (label, f) in rows {
        if let Some(f) = f {
            show(label, f);
        }
    }
    if let Some((one, two)) = &procs {
        for (label, p) in [
            ("(7a) tinyflow run, 1 process x 2 subtasks", one),
            ("(7b) tinyflow run, 2 workers x 1 subtask", two),
        ] {
            println!(
                "{label:<44} {:>7.3} M events/s  ({:>6.2} s from start to exit, {:.2} cores busy); {} commits, {} catalog updates, {} commit conflicts",
                n as f64 / p.secs / 1e6,
                p.secs,
                p.cpu.busy_cores,
                p.commits,
                p.attempts,
                p.conflicts
            );
        }
        println!(
            "  (7b)/(7a) = {:.2}  (the cost of two processes instead of one)",
            one.secs / two.secs
        );
    }
    println!("ratios:");
    if let Some(j) = &job1s {
        if let Some(b) = &bare {
            println!("  (3)/(1) = {:.2}  (goal >= 0.9)", j.rate() / b.rate());
        }
        println!(
            "  (3)     = {:.3} M events/s  (goal >= 0.5)",
            j.rate() / 1e6
        );
        if let Some(o) = &off {
            println!("  (3)/(4) = {:.2}  (goal >= 0.95)", j.rate() / o.rate());
        }
        if let Some(p) = &py {
            println!("  (3)/(5) = {:.1}  (goal >= 6)", j.rate() / p.rate());
        }
        println!("  peak RSS of (3) = {:.0} MB  (goal <= 256)", j.rss_mb);
        // What the machine allows at the CPU each event costs (3): every
        // core busy with nothing else running.
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let ceiling = cores as f64 / j.cpu_us_per_event();
        print!(
            "  at {:.2} us CPU/event, {cores} cores allow (3) at most {ceiling:.3} M events/s",
            j.cpu_us_per_event()
        );
        match &bare {
            Some(b) => println!(", (3)/(1) <= {:.2}", ceiling * 1e6 / b.rate()),
            None => println!(),
        }
        // The same for a job that costs no more than its raw parts: reading
        // as (1) does plus decoding and writing as (2) does.
        if let (Some(b), Some(d)) = (&bare, &decode) {
            let parts = b.cpu_us_per_event() + d.cpu_us_per_event();
            let ceiling = cores as f64 / parts;
            println!(
                "  (1) + (2) cost {parts:.2} us CPU/event: at that, {cores} cores allow at most {ceiling:.3} M events/s, (3)/(1) <= {:.2}",
                ceiling * 1e6 / b.rate()
            );
        }
    }
    if let Some(Latencies { all, by_second }) = lat {
        println!(
            "append-to-visible ({} bids/s, checkpoints every 1 s): p50 {} ms, p99 {} ms, max {} ms  (goal p99 <= 1300 ms)",
            a.latency_rate,
            pct(&all, 0.5),
            pct(&all, 0.99),
            all[all.len() - 1]
        );
        let line: Vec<String> = by_second
            .iter()
            .map(|v| format!("{}/{}", pct(v, 0.99), v[v.len() - 1]))
            .collect();
        println!("  p99/max ms by second of production: {}", line.join(" "));
    }
}
