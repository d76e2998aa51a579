//! Small files and table upkeep (issue #24): what partitioning, the sink's
//! distribution of rows over its writers and the commit cadence do to the
//! files, snapshots and metadata of a table, to its readers' scan time, and
//! to how soon a record is visible. Every job runs as a `tinyflow run`
//! process from a job file (the `tinyflow` binary beside this one, or
//! `TINYFLOW_BIN`), on a real broker, with 1 s checkpoints, job and sink
//! parallelism 2, a topic of 4 partitions, and the pipeline bench's job
//! (Kafka JSON bids -> compute `price_eur` -> Iceberg in a sqlite catalog).
//!
//! **Part 1, `--only many`: many partitions, before and after.** A bounded
//! job (`source.bounded`) over `--records` bids (default 2,000,000), once
//! unpartitioned, then partitioned by `bucket[256]` of `auction` and by
//! `day` of `date_time`, each partitioned table twice: "before"
//! (`sink.distribution = "none"`: batches go to the writers round-robin,
//! so every writer opens a file for every partition it meets) and "after"
//! (the default: rows hashed to writers by table partition, under the
//! writer memory budget). The Nexmark generator's event times lie within
//! minutes, and the job file's transforms cannot make a timestamp, so the
//! bench loads a topic of its own whose bids carry `date_time` as
//! microseconds (a `timestamp` column) spread evenly over 30 days in bid
//! order: a backfill read in time order (`tinyflow-bench-bids-30d-...`;
//! every variant of part 1 reads it). Per variant: records/s from the
//! first record read to the process's exit (and from its start), and the
//! ratio to the unpartitioned table; data files committed; per commit and
//! writer, the files written against the partitions touched (one file per
//! partition per writer per commit is the floor); peak RSS of the process
//! (VmHWM, sampled every 50 ms); its CPU per record (steadier than its
//! rate on a machine other work shares) and the machine's load; the
//! table's data bytes against the unpartitioned table's.
//!
//! **Part 2, `--only cadence`: commit cadence, freshness, merging, scan
//! time.** A producer sends bids at `--rate` per second (default 50,000)
//! for `--secs` (default 600), `date_time` being the moment each is handed
//! to the producer, into a fresh topic, while jobs read it from the start:
//! unpartitioned and `day`-partitioned tables (`--layouts`; `bucket16`
//! partitions by `bucket[16]` of `auction`, which spreads each
//! checkpoint's rows over 16 files), with
//! `[sink.commit] interval` each of `--cadences` (default 1s,10s,1m,5m;
//! `ckpt` leaves the interval out: a commit at every checkpoint), each
//! with `merge = true` and `merge = false` (`--merges`), one job at a
//! time (`--at-once N` runs N of them side by side on one produced
//! stream, to save time at the cost of their sharing the machine).
//! Production starts once every job has read a warm-up bid from every
//! partition. Each job's table is polled every second; each snapshot's added data files are read
//! (`id`, `date_time`), so a bid's freshness is the commit time of the
//! first snapshot holding it minus its `date_time` (p50/p99/max). Once
//! every bid is visible, the bench notes the table's data files (and per
//! hour of input, extrapolated from `--secs`), snapshots, the bytes of its
//! `metadata/` directory (metadata JSON, manifest lists, manifests) and of
//! its data, then stops the job (SIGKILL: everything is committed) and
//! times full scans of the table with pyiceberg (`table.scan().to_arrow()`,
//! every row of every column into memory, the table loaded afresh each
//! time; median of `--scan-runs`, default 3) through
//! `benches/python/scan_table.py`, which adds DuckDB's `iceberg_scan` when
//! the `duckdb` module is installed and its extension loads.
//!
//! `cargo xtask kafka start`, export the line it prints, `cargo build
//! --release -p tinyflow-cli -p tinyflow-benches --bin tinyflow --bin
//! upkeep` (with `--bin upkeep` alone, cargo builds no `tinyflow`), then
//! `target/release/upkeep [--only many|cadence]... [--records N]
//! [--variant NAME]... [--secs N] [--rate N] [--cadences LIST]
//! [--layouts LIST] [--merges on,off] [--at-once N] [--scan-runs N]
//! [--legacy] [--keep]`.
//! `--legacy` leaves out the keys older builds refuse (`sink.distribution`,
//! `sink.commit.merge`): part 1 then runs the "before" variants with the
//! build's own behaviour and part 2 one job per cadence and layout. Each
//! job's log is in its directory under the bench's temporary directory
//! (`--keep` keeps it, with the tables, and prints where). Pyiceberg comes
//! from `TINYFLOW_PYTHON`, else `target/pyiceberg-venv` (`cargo xtask
//! py-setup`). Progress goes to stderr, the tables to stdout.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark binary: prints its figures, and any failure ends it"
)]

use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arrow_array::cast::AsArray;
use arrow_array::types::{Int64Type, TimestampMicrosecondType};
use arrow_schema::{DataType, TimeUnit};
use iceberg::spec::{DataContentType, ManifestStatus};
use iceberg::table::Table;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use tinyflow_benches::kafka::{CpuMeter, CpuUse, bootstrap};
use tinyflow_cli::nexmark::{BID_FIELDS, bids};
use tinyflow_connectors_iceberg::{CatalogConfig, TableReader};

const USAGE: &str = "usage: upkeep [--only many|cadence]... [--records N] [--variant NAME]... \
[--secs N] [--rate N] [--cadences 1s,10s,1m,5m] [--layouts unpartitioned,day,bucket16] [--merges on,off] [--at-once N] \
[--scan-runs N] [--legacy] [--keep]
cadences: durations, or ckpt (a commit at every checkpoint)
variants of part 1: unpartitioned, bucket-before, bucket-after, day-before, day-after
(start a broker with `cargo xtask kafka start` and export the line it prints first)";

/// Kafka partitions of every topic.
const TOPIC_PARTITIONS: i32 = 4;
/// Job, source and sink parallelism.
const WRITERS: usize = 2;
/// The backfill's span of event time.
const BACKFILL_DAYS: i64 = 30;
/// Start of event time in part 1: 2026-01-01T00:00:00Z, the generator's.
const BACKFILL_START_US: i64 = 1_767_225_600_000_000;

struct Args {
    many: bool,
    cadence: bool,
    records: u64,
    variants: Vec<String>,
    secs: u64,
    rate: u64,
    cadences: Vec<String>,
    layouts: Vec<String>,
    /// `sink.commit.merge` values to run (`--merges on,off`).
    merges: Vec<bool>,
    at_once: usize,
    scan_runs: usize,
    legacy: bool,
    keep: bool,
}

fn usage_error(what: &str) -> ! {
    eprintln!("upkeep: {what}\n{USAGE}");
    std::process::exit(2);
}

fn parse_args() -> Args {
    let mut a = Args {
        many: false,
        cadence: false,
        records: 2_000_000,
        variants: Vec::new(),
        secs: 600,
        rate: 50_000,
        cadences: ["1s", "10s", "1m", "5m"].map(str::to_owned).to_vec(),
        layouts: ["unpartitioned", "day"].map(str::to_owned).to_vec(),
        merges: vec![true, false],
        at_once: 1,
        scan_runs: 3,
        legacy: false,
        keep: false,
    };
    let mut it = std::env::args().skip(1);
    let list = |v: String| v.split(',').map(str::to_owned).collect::<Vec<_>>();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| usage_error(&format!("{flag} needs a value")))
        };
        let number = |v: String| -> u64 {
            v.parse()
                .unwrap_or_else(|_| usage_error(&format!("{flag} needs a whole number")))
        };
        match flag.as_str() {
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--only" => match value().as_str() {
                "many" => a.many = true,
                "cadence" => a.cadence = true,
                other => usage_error(&format!("--only {other}: expected many or cadence")),
            },
            "--records" => a.records = number(value()),
            "--variant" => a.variants.push(value()),
            "--secs" => a.secs = number(value()),
            "--rate" => a.rate = number(value()),
            "--cadences" => a.cadences = list(value()),
            "--layouts" => a.layouts = list(value()),
            "--merges" => {
                a.merges = list(value())
                    .iter()
                    .map(|m| match m.as_str() {
                        "on" => true,
                        "off" => false,
                        other => usage_error(&format!("--merges {other}: expected on or off")),
                    })
                    .collect();
            }
            "--at-once" => a.at_once = number(value()).max(1) as usize,
            "--scan-runs" => a.scan_runs = number(value()).max(1) as usize,
            "--legacy" => a.legacy = true,
            "--keep" => a.keep = true,
            other => usage_error(&format!("unknown option {other}")),
        }
    }
    if !a.many && !a.cadence {
        a.many = true;
        a.cadence = true;
    }
    for l in &a.layouts {
        if layout_partition(l).is_none() && l != "unpartitioned" {
            usage_error(&format!(
                "--layouts: {l}: expected unpartitioned, day or bucket16"
            ));
        }
    }
    for v in &a.variants {
        if !MANY.iter().any(|m| m.name == v) {
            usage_error(&format!("--variant {v}: no such variant"));
        }
    }
    a
}

// ---------------------------------------------------------------- job files

/// What a job file of the bench sets beyond the pipeline bench's job.
struct JobSpec<'a> {
    /// Job name and so sink id (file names start with it).
    name: &'a str,
    topic: &'a str,
    dir: &'a Path,
    bounded: bool,
    /// `(column, transform)` of the one partition field.
    partition: Option<(&'a str, &'a str)>,
    /// `sink.distribution`.
    distribution: Option<&'a str>,
    /// `sink.commit.interval`.
    commit_interval: Option<&'a str>,
    /// `sink.commit.merge`.
    merge: Option<bool>,
    metrics_port: u16,
}

/// The pipeline bench's job (`benches/src/bin/pipeline.rs`), `date_time` a
/// `timestamp` (microseconds in the JSON), with the bench's sink settings.
fn job_text(s: &JobSpec<'_>) -> String {
    let fields: Vec<String> = BID_FIELDS
        .iter()
        .map(|(n, t)| {
            let t = if *n == "date_time" { "timestamp" } else { t };
            format!("  {{ name = \"{n}\", type = \"{t}\", required = true }},")
        })
        .collect();
    let mut sink = String::new();
    if let Some((column, transform)) = s.partition {
        sink.push_str(&format!(
            "partition = [{{ column = \"{column}\", transform = \"{transform}\" }}]\n"
        ));
    }
    if let Some(d) = s.distribution {
        sink.push_str(&format!("distribution = \"{d}\"\n"));
    }
    if s.commit_interval.is_some() || s.merge.is_some() {
        sink.push_str("\n[sink.commit]\n");
        if let Some(i) = s.commit_interval {
            sink.push_str(&format!("interval = \"{i}\"\n"));
        }
        if let Some(m) = s.merge {
            sink.push_str(&format!("merge = {m}\n"));
        }
    }
    format!(
        r#"
[job]
name = "{name}"
parallelism = {WRITERS}

[source]
bootstrap_servers = "{bootstrap}"
topics = ["{topic}"]
parallelism = {TOPIC_PARTITIONS}
bounded = {bounded}
fields = [
{fields}
]

[[transforms]]
compute = {{ column = "price_eur", expr = "price / 100" }}

[sink]
namespace = "bench"
table = "bids"
parallelism = {WRITERS}
catalog = {{ type = "sqlite", dir = "{dir}" }}
{sink}
[checkpoint]
interval = "1s"
dir = "{dir}/checkpoints"

[restart]
strategy = "none"

[metrics]
address = "127.0.0.1:{port}"
"#,
        name = s.name,
        bootstrap = bootstrap(),
        topic = s.topic,
        bounded = s.bounded,
        fields = fields.join("\n"),
        dir = s.dir.display(),
        port = s.metrics_port,
    )
}

/// A port free now, for a job's metrics endpoint.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The job's `/metrics`, or `None` while it does not answer.
fn scrape(port: u16) -> Option<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_owned())
}

fn metric(text: &str, name: &str) -> f64 {
    tinyflow_cli::metric_sum(text, name, None)
}

/// Starts `tinyflow run` on the job text in `dir/job.toml`, its log in
/// `dir/job.log`.
fn spawn_job(dir: &Path, text: &str) -> Child {
    std::fs::create_dir_all(dir).unwrap();
    let job = dir.join("job.toml");
    std::fs::write(&job, text).unwrap();
    Command::new(tinyflow_benches::tinyflow_bin())
        .arg("run")
        .arg(&job)
        .env("TINYFLOW_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("job.log")).unwrap())
        .spawn()
        .unwrap()
}

/// The last lines of a job's log, for a failure message.
fn log_tail(dir: &Path) -> String {
    let text = std::fs::read_to_string(dir.join("job.log")).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Peak RSS of process `pid` so far (VmHWM), in MB.
fn peak_rss_of(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
}

/// CPU seconds (user and system) process `pid` used so far.
fn cpu_secs_of(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command, which is in parentheses: state is field 3,
    // utime 14 and stime 15, in ticks of 1/100 s (USER_HZ).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// The machine's 1-minute load average.
fn load_1m() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

// ------------------------------------------------------------ table facts

fn local(location: &str) -> PathBuf {
    PathBuf::from(location.strip_prefix("file://").unwrap_or(location))
}

/// Bytes and files under `dir`, recursively.
fn du(dir: &Path) -> (u64, u64) {
    let mut bytes = 0;
    let mut files = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    for e in entries.flatten() {
        let Ok(md) = e.metadata() else { continue };
        if md.is_dir() {
            let (b, f) = du(&e.path());
            bytes += b;
            files += f;
        } else {
            bytes += md.len();
            files += 1;
        }
    }
    (bytes, files)
}

/// One data file a snapshot added.
struct Added {
    path: String,
    /// The writer subtask, from the file name (`<sink id>-<subtask>-...`),
    /// or the file name's first part after the sink id when it is not a
    /// number (a file the committer wrote, say).
    writer: String,
    /// The partition value, as text.
    partition: String,
}

/// The data files `snapshot` added (manifests it wrote, entries it added).
async fn added_files(
    table: &Table,
    snapshot: &iceberg::spec::SnapshotRef,
    sink_id: &str,
) -> Vec<Added> {
    let list = table.manifest_list_reader(snapshot).load().await.unwrap();
    let mut out = Vec::new();
    for mf in list
        .entries()
        .iter()
        .filter(|m| m.added_snapshot_id == snapshot.snapshot_id())
    {
        let manifest = mf.load_manifest(table.file_io()).await.unwrap();
        for e in manifest.entries() {
            if e.status() != ManifestStatus::Added || e.content_type() != DataContentType::Data {
                continue;
            }
            let path = e.file_path().to_owned();
            let name = path.rsplit('/').next().unwrap_or(&path);
            let writer = name
                .strip_prefix(sink_id)
                .and_then(|r| r.strip_prefix('-'))
                .and_then(|r| r.split('-').next())
                .unwrap_or("?")
                .to_owned();
            out.push(Added {
                partition: format!("{:?}", e.data_file().partition()),
                path,
                writer,
            });
        }
    }
    out
}

/// What a table holds and what its commits added.
#[derive(Debug, Clone, Default)]
struct TableFacts {
    /// Snapshots in the metadata (after any expiry).
    snapshots: usize,
    /// Of the current snapshot: rows, data files, their bytes.
    records: u64,
    data_files: u64,
    data_bytes: u64,
    /// Distinct partition values among the current data files.
    partitions: usize,
    /// Bytes and files of `metadata/` and of `data/` on disk.
    metadata_bytes: u64,
    metadata_files: u64,
    data_dir_bytes: u64,
    /// Over the snapshots that added data files: their number, the files
    /// they added, the writers present in each (summed), the distinct
    /// (writer, partition) pairs in each (summed).
    commits: u64,
    added: u64,
    writer_commits: u64,
    writer_partitions: u64,
    /// Files added by writer name (a name that is no subtask is a file
    /// another part wrote).
    by_writer: BTreeMap<String, u64>,
}

impl TableFacts {
    fn files_per_commit_per_writer(&self) -> f64 {
        self.added as f64 / self.writer_commits.max(1) as f64
    }

    fn partitions_per_commit_per_writer(&self) -> f64 {
        self.writer_partitions as f64 / self.writer_commits.max(1) as f64
    }
}

fn summary_u64(s: &iceberg::spec::Snapshot, key: &str) -> u64 {
    s.summary()
        .additional_properties
        .get(key)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The facts of `table`; with `per_commit`, walks every snapshot's added
/// files too.
async fn table_facts(table: &Table, sink_id: &str, per_commit: bool) -> TableFacts {
    let md = table.metadata();
    let root = local(md.location());
    let (metadata_bytes, metadata_files) = du(&root.join("metadata"));
    let (data_dir_bytes, _) = du(&root.join("data"));
    let mut f = TableFacts {
        snapshots: md.snapshots().count(),
        metadata_bytes,
        metadata_files,
        data_dir_bytes,
        ..TableFacts::default()
    };
    if let Some(s) = md.current_snapshot() {
        f.records = summary_u64(s, "total-records");
        f.data_files = summary_u64(s, "total-data-files");
        f.data_bytes = summary_u64(s, "total-files-size");
    }
    if !per_commit {
        return f;
    }
    let mut snapshots: Vec<_> = md.snapshots().cloned().collect();
    snapshots.sort_by_key(|s| s.sequence_number());
    for s in &snapshots {
        let added = added_files(table, s, sink_id).await;
        if added.is_empty() {
            continue;
        }
        f.commits += 1;
        f.added += added.len() as u64;
        let writers: HashSet<&str> = added.iter().map(|a| a.writer.as_str()).collect();
        let pairs: HashSet<(&str, &str)> = added
            .iter()
            .map(|a| (a.writer.as_str(), a.partition.as_str()))
            .collect();
        f.writer_commits += writers.len() as u64;
        f.writer_partitions += pairs.len() as u64;
        for a in &added {
            *f.by_writer.entry(a.writer.clone()).or_default() += 1;
        }
    }
    f.partitions = current_partitions(table).await;
    f
}

// ------------------------------------------------------------------ part 1

/// One variant of part 1.
struct ManyVariant {
    name: &'static str,
    label: &'static str,
    partition: Option<(&'static str, &'static str)>,
    /// `sink.distribution` ("before": `none`; "after": the default).
    before: bool,
}

const MANY: [ManyVariant; 5] = [
    ManyVariant {
        name: "unpartitioned",
        label: "unpartitioned",
        partition: None,
        before: false,
    },
    ManyVariant {
        name: "bucket-after",
        label: "bucket[256](auction), after (hash)",
        partition: Some(("auction", "bucket[256]")),
        before: false,
    },
    ManyVariant {
        name: "day-after",
        label: "day(date_time), after (hash)",
        partition: Some(("date_time", "day")),
        before: false,
    },
    ManyVariant {
        name: "bucket-before",
        label: "bucket[256](auction), before (none)",
        partition: Some(("auction", "bucket[256]")),
        before: true,
    },
    ManyVariant {
        name: "day-before",
        label: "day(date_time), before (none)",
        partition: Some(("date_time", "day")),
        before: true,
    },
];

/// A topic of `n` bids as JSON over [`TOPIC_PARTITIONS`] (round-robin by
/// id), `date_time` in microseconds spread evenly over [`BACKFILL_DAYS`]
/// in id order; reused when a previous run left it complete.
fn ensure_backfill_topic(n: u64) -> String {
    let name = format!("tinyflow-bench-bids-30d-v1-{n}-p{TOPIC_PARTITIONS}");
    let span_us = BACKFILL_DAYS * 86_400_000_000;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let have = rt.block_on(async {
        tinyflow_connectors_kafka::testing::create_topic(&bootstrap(), &name, TOPIC_PARTITIONS)
            .await
            .is_err()
    });
    if have {
        let found = topic_records(&name);
        if found == n {
            eprintln!("topic {name}: {n} bids already there");
            return name;
        }
        panic!("topic {name} holds {found} records, not {n}: delete it and run again");
    }
    let started = Instant::now();
    let step = (n / 10).max(1);
    let label = name.clone();
    let values = bids().take(n as usize).map(move |mut b| {
        b.date_time =
            BACKFILL_START_US + (i128::from(span_us) * i128::from(b.id) / i128::from(n)) as i64;
        if (b.id + 1).is_multiple_of(step) {
            eprintln!(
                "topic {label}: {} of {n} bids produced ({:.0} s)",
                b.id + 1,
                started.elapsed().as_secs_f64()
            );
        }
        (
            (b.id % TOPIC_PARTITIONS as u64) as i32,
            serde_json::to_vec(&b).unwrap(),
        )
    });
    tinyflow_connectors_kafka::testing::produce_stream(
        &bootstrap(),
        &name,
        &[("linger.ms", "20"), ("batch.size", "1000000")],
        values,
    )
    .unwrap();
    assert_eq!(topic_records(&name), n, "topic {name} is complete");
    name
}

/// Records in `topic` (high minus low watermarks).
fn topic_records(topic: &str) -> u64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .unwrap();
    (0..TOPIC_PARTITIONS)
        .map(|p| {
            let (low, high) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap();
            (high - low) as u64
        })
        .sum()
}

/// What a bounded `tinyflow run` process took.
struct ProcessRun {
    /// From spawn to exit.
    wall_secs: f64,
    /// From the first record read (as its metrics showed, polled every
    /// 50 ms) to exit.
    read_secs: f64,
    rss_mb: f64,
    cpu: CpuUse,
    /// CPU seconds of the job's process (sampled every 50 ms).
    job_cpu_secs: f64,
    /// The machine's 1-minute load average when it ended (other work
    /// included).
    load: f64,
    /// Its final counters line.
    counters: String,
}

/// Runs a bounded job to its end, printing progress every 15 s.
fn run_bounded(dir: &Path, text: &str, port: u16, label: &str, n: u64) -> ProcessRun {
    let start = Instant::now();
    let cpu = CpuMeter::start();
    let mut child = spawn_job(dir, text);
    let pid = child.id();
    let mut rss: f64 = 0.0;
    let mut job_cpu = 0.0;
    let mut first_read = None;
    let mut last_progress = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if let Some(r) = peak_rss_of(pid) {
            rss = rss.max(r);
        }
        if let Some(c) = cpu_secs_of(pid) {
            job_cpu = c;
        }
        if first_read.is_none()
            && scrape(port).is_some_and(|t| metric(&t, "tinyflow_kafka_records_read_total") > 0.0)
        {
            first_read = Some(Instant::now());
        }
        if last_progress.elapsed() >= Duration::from_secs(15) {
            last_progress = Instant::now();
            if let Some(t) = scrape(port) {
                eprintln!(
                    "  {label}: {:.0} s, {:.0} of {n} records read, {:.0} rows written, {:.0} checkpoints, {:.0} commits, peak RSS {rss:.0} MB",
                    start.elapsed().as_secs_f64(),
                    metric(&t, "tinyflow_kafka_records_read_total"),
                    metric(&t, "tinyflow_iceberg_rows_written_total"),
                    metric(&t, "tinyflow_checkpoints_completed_total"),
                    metric(&t, "tinyflow_iceberg_commits_total"),
                );
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let end = Instant::now();
    let wall_secs = (end - start).as_secs_f64();
    let cpu = cpu.stop();
    assert!(
        status.success(),
        "{label}: {status}; log:\n{}",
        log_tail(dir)
    );
    let log = std::fs::read_to_string(dir.join("job.log")).unwrap();
    let counters = log
        .lines()
        .find(|l| l.contains("final counters of this run"))
        .map(|l| {
            l.split_once("counters=")
                .map_or(l, |(_, c)| c)
                .trim()
                .to_owned()
        })
        .unwrap_or_default();
    ProcessRun {
        wall_secs,
        read_secs: first_read.map_or(wall_secs, |f| (end - f).as_secs_f64()),
        rss_mb: rss,
        cpu,
        job_cpu_secs: job_cpu,
        load: load_1m(),
        counters,
    }
}

struct ManyResult {
    variant: &'static ManyVariant,
    run: ProcessRun,
    facts: TableFacts,
}

fn part_many(a: &Args, rt: &tokio::runtime::Runtime, tmp: &Path) -> Vec<ManyResult> {
    let n = a.records;
    let topic = ensure_backfill_topic(n);
    let mut out = Vec::new();
    for v in MANY
        .iter()
        .filter(|v| a.variants.is_empty() || a.variants.iter().any(|x| x == v.name))
    {
        let dir = tmp.join(format!("many-{}", v.name));
        let port = free_port();
        let distribution = (v.before && !a.legacy).then_some("none");
        let text = job_text(&JobSpec {
            name: "bench",
            topic: &topic,
            dir: &dir,
            bounded: true,
            partition: v.partition,
            distribution,
            commit_interval: None,
            merge: None,
            metrics_port: port,
        });
        eprintln!("part 1, {}: {n} bids, bounded ...", v.label);
        let run = run_bounded(&dir, &text, port, v.name, n);
        eprintln!(
            "  {}: {:.1} s ({:.1} s from the first record read), reading the table ...",
            v.name, run.wall_secs, run.read_secs
        );
        let facts = rt.block_on(async {
            let reader = TableReader::open(&CatalogConfig::sqlite(&dir), "bench", "bids")
                .await
                .unwrap();
            let table = reader.load().await.unwrap();
            table_facts(&table, "bench", true).await
        });
        assert_eq!(
            facts.records, n,
            "{}: the table holds {} rows, not {n}",
            v.name, facts.records
        );
        eprintln!(
            "  {}: {} data files, {} commits, {:.1} MB of data; counters: {}",
            v.name,
            facts.data_files,
            facts.commits,
            facts.data_bytes as f64 / 1e6,
            run.counters
        );
        out.push(ManyResult {
            variant: v,
            run,
            facts,
        });
        if !a.keep {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    out
}

fn print_many(a: &Args, results: &[ManyResult]) {
    let n = a.records as f64;
    let base = results.iter().find(|r| r.variant.partition.is_none());
    println!(
        "\nPart 1: many partitions. {} bids (JSON, date_time over {BACKFILL_DAYS} days in order), {TOPIC_PARTITIONS} Kafka partitions, job and sink parallelism {WRITERS}, 1 s checkpoints, bounded; one `tinyflow run` process each{}",
        a.records,
        if a.legacy {
            " (--legacy: no sink.distribution key)"
        } else {
            ""
        }
    );
    println!(
        "| variant | records/s (from first read) | vs unpartitioned | records/s (from start) | wall s | job CPU us / record | machine busy cores | load 1m | data files | commits | files / commit / writer | partitions / commit / writer | peak RSS MB | data MB | data vs unpartitioned |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in results {
        let rate = n / r.run.read_secs;
        let vs = base.map_or(String::new(), |b| {
            format!("{:.2}", rate / (n / b.run.read_secs))
        });
        let bytes_vs = base.map_or(String::new(), |b| {
            format!(
                "{:.2}",
                r.facts.data_bytes as f64 / b.facts.data_bytes as f64
            )
        });
        println!(
            "| {} | {:.0} | {vs} | {:.0} | {:.1} | {:.2} | {:.2} | {:.1} | {} | {} | {:.1} | {:.1} | {:.0} | {:.1} | {bytes_vs} |",
            r.variant.label,
            rate,
            n / r.run.wall_secs,
            r.run.wall_secs,
            r.run.job_cpu_secs * 1e6 / n,
            r.run.cpu.busy_cores,
            r.run.load,
            r.facts.data_files,
            r.facts.commits,
            r.facts.files_per_commit_per_writer(),
            r.facts.partitions_per_commit_per_writer(),
            r.run.rss_mb,
            r.facts.data_bytes as f64 / 1e6,
        );
    }
    for r in results {
        let writers: Vec<String> = r
            .facts
            .by_writer
            .iter()
            .map(|(w, c)| format!("{w}: {c}"))
            .collect();
        println!(
            "  {}: files added by writer {}; {} partitions in the table; metadata {:.1} MB in {} files; counters: {}",
            r.variant.name,
            writers.join(", "),
            r.facts.partitions,
            r.facts.metadata_bytes as f64 / 1e6,
            r.facts.metadata_files,
            r.run.counters
        );
    }
    for name in ["bucket-after", "day-after"] {
        if let (Some(b), Some(r)) = (base, results.iter().find(|r| r.variant.name == name)) {
            println!(
                "  goal: {name} at >= 0.5x unpartitioned: {:.2}x",
                b.run.read_secs / r.run.read_secs
            );
        }
    }
}

// ------------------------------------------------------------------ part 2

/// One job of part 2.
#[derive(Debug, Clone)]
struct CadenceVariant {
    cadence: String,
    layout: String,
    /// `None` with `--legacy`: the key is left out.
    merge: Option<bool>,
}

impl CadenceVariant {
    fn name(&self) -> String {
        let merge = match self.merge {
            Some(true) => "-merge",
            Some(false) => "-nomerge",
            None => "",
        };
        format!("upkeep-{}-{}{merge}", self.layout, self.cadence)
    }

    fn label(&self) -> String {
        let merge = match self.merge {
            Some(true) => "on",
            Some(false) => "off",
            None => "(default)",
        };
        format!("{} | {} | {merge}", self.layout, self.cadence)
    }
}

/// The commit cadence `c` in seconds (`ckpt`: every checkpoint, 1 s).
/// The partition column and transform of a part 2 layout; `None` for
/// `unpartitioned` (and for a name that is not a layout).
fn layout_partition(layout: &str) -> Option<(&'static str, &'static str)> {
    match layout {
        "day" => Some(("date_time", "day")),
        "bucket16" => Some(("auction", "bucket[16]")),
        _ => None,
    }
}

fn cadence_secs(c: &str) -> f64 {
    if c == CADENCE_EVERY_CHECKPOINT {
        return 1.0;
    }
    tinyflow_cli::parse_duration(c)
        .map(|d| d.as_secs_f64())
        .unwrap_or_else(|_| panic!("cadence {c}: not a duration"))
}

/// The cadence that leaves `sink.commit.interval` out: a commit at every
/// completed checkpoint.
const CADENCE_EVERY_CHECKPOINT: &str = "ckpt";

/// A job of part 2 running, and what its table showed so far.
struct Watched {
    variant: CadenceVariant,
    dir: PathBuf,
    port: u16,
    child: Child,
    reader: TableReader,
    seen: HashSet<i64>,
    /// Freshness in ms by id (`u32::MAX`: not visible yet).
    fresh: Vec<u32>,
    visible: u64,
    /// Snapshots that added data files, as the polls saw them.
    commits: u64,
    /// Duplicates: rows of ids already visible in a later snapshot's added
    /// files (a rewrite shows its rows again; a second commit would too).
    again: u64,
    /// Facts when every bid was visible.
    facts: Option<TableFacts>,
    done_at: Option<f64>,
    /// CPU seconds of the job's process, at the last poll before every
    /// bid was visible.
    cpu_secs: f64,
}

/// Reads `id` and `date_time` of a local Parquet data file.
fn ids_and_times(path: &str) -> Vec<(i64, i64)> {
    let file = std::fs::File::open(local(path)).unwrap();
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
    let leaves: Vec<usize> = builder
        .parquet_schema()
        .columns()
        .iter()
        .enumerate()
        .filter(|(_, c)| c.name() == "id" || c.name() == "date_time")
        .map(|(i, _)| i)
        .collect();
    let mask = ProjectionMask::leaves(builder.parquet_schema(), leaves);
    let reader = builder
        .with_projection(mask)
        .with_batch_size(64 * 1024)
        .build()
        .unwrap();
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.unwrap();
        let ids = batch
            .column_by_name("id")
            .unwrap()
            .as_primitive::<Int64Type>();
        let times = batch.column_by_name("date_time").unwrap();
        let times: &[i64] = match times.data_type() {
            DataType::Timestamp(TimeUnit::Microsecond, _) => {
                times.as_primitive::<TimestampMicrosecondType>().values()
            }
            other => panic!("date_time is {other}"),
        };
        out.extend(ids.values().iter().copied().zip(times.iter().copied()));
    }
    out
}

impl Watched {
    /// Takes in the snapshots committed since the last poll.
    async fn poll(&mut self, n: u64) {
        let Ok(table) = self.reader.load().await else {
            return;
        };
        let mut snapshots: Vec<_> = table
            .metadata()
            .snapshots()
            .filter(|s| !self.seen.contains(&s.snapshot_id()))
            .cloned()
            .collect();
        snapshots.sort_by_key(|s| s.sequence_number());
        let sink_id = self.variant.name();
        for s in snapshots {
            self.seen.insert(s.snapshot_id());
            let added = added_files(&table, &s, &sink_id).await;
            if added.is_empty() {
                continue;
            }
            self.commits += 1;
            for a in added {
                for (id, us) in ids_and_times(&a.path) {
                    if id < 0 || id as u64 >= n {
                        continue;
                    }
                    let slot = &mut self.fresh[id as usize];
                    if *slot == u32::MAX {
                        *slot =
                            (s.timestamp_ms() - us / 1000).clamp(0, i64::from(u32::MAX - 1)) as u32;
                        self.visible += 1;
                    } else {
                        self.again += 1;
                    }
                }
            }
        }
        if self.visible == n && self.facts.is_none() {
            let mut f = table_facts(&table, &sink_id, false).await;
            f.partitions = current_partitions(&table).await;
            self.facts = Some(f);
        }
    }
}

/// Distinct partition values among the current snapshot's data files.
async fn current_partitions(table: &Table) -> usize {
    let Some(cur) = table.metadata().current_snapshot() else {
        return 0;
    };
    let list = table.manifest_list_reader(cur).load().await.unwrap();
    let mut parts = HashSet::new();
    for mf in list.entries() {
        let manifest = mf.load_manifest(table.file_io()).await.unwrap();
        for e in manifest.entries() {
            if e.status() != ManifestStatus::Deleted && e.content_type() == DataContentType::Data {
                parts.insert(format!("{:?}", e.data_file().partition()));
            }
        }
    }
    parts.len()
}

struct Scan {
    rows: u64,
    /// Median seconds of pyiceberg's full scans.
    pyiceberg: f64,
    duckdb: Option<f64>,
    duckdb_skipped: Option<String>,
}

/// The Python the scans run with.
fn python() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::env::var("TINYFLOW_PYTHON").map_or_else(
        |_| root.join("target/pyiceberg-venv/bin/python"),
        PathBuf::from,
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Full scans of the table in `dir`'s sqlite catalog.
fn scan(dir: &Path, runs: usize) -> Scan {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python())
        .arg(root.join("python/scan_table.py"))
        .args([
            "tinyflow",
            &format!("sqlite:///{}", dir.join("catalog.db").display()),
            &format!("file://{}", dir.join("warehouse").display()),
            "bench.bids",
            &runs.to_string(),
        ])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running {} (pyiceberg: `cargo xtask py-setup`, or TINYFLOW_PYTHON): {e}",
                python().display()
            )
        });
    assert!(
        out.status.success(),
        "scan_table.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let secs = |key: &str| {
        v[key]
            .as_array()
            .map(|a| median(a.iter().map(|x| x.as_f64().unwrap()).collect()))
    };
    Scan {
        rows: v["rows"].as_u64().unwrap(),
        pyiceberg: secs("pyiceberg").unwrap(),
        duckdb: secs("duckdb"),
        duckdb_skipped: v["duckdb_skipped"].as_str().map(str::to_owned),
    }
}

struct CadenceResult {
    variant: CadenceVariant,
    /// Sorted freshness, ms.
    fresh: Vec<u32>,
    commits: u64,
    again: u64,
    facts: TableFacts,
    /// Seconds from the start of production to every bid visible.
    done_secs: f64,
    scan: Scan,
    /// CPU seconds of the job's process (start-up and warm-up included).
    cpu_secs: f64,
    /// The machine's CPU use during the round, and its mean 1-minute load
    /// average (other work on the machine included).
    machine: CpuUse,
    load: f64,
}

/// One round: a fresh topic fed at `rate` for `secs` while `variants` run.
fn round(
    a: &Args,
    rt: &tokio::runtime::Runtime,
    tmp: &Path,
    variants: &[CadenceVariant],
) -> Vec<CadenceResult> {
    let n = a.rate * a.secs;
    let topic = format!("tinyflow-bench-upkeep-{}", tinyflow_benches::now_ms());
    rt.block_on(tinyflow_connectors_kafka::testing::create_topic(
        &bootstrap(),
        &topic,
        TOPIC_PARTITIONS,
    ))
    .unwrap();
    let names: Vec<String> = variants.iter().map(CadenceVariant::name).collect();
    eprintln!(
        "part 2, round of {}: {} bids/s for {} s into {topic} ...",
        names.join(", "),
        a.rate,
        a.secs
    );
    let mut jobs: Vec<Watched> = variants
        .iter()
        .map(|v| {
            let dir = tmp.join(v.name());
            let port = free_port();
            let text = job_text(&JobSpec {
                name: &v.name(),
                topic: &topic,
                dir: &dir,
                bounded: false,
                partition: layout_partition(&v.layout),
                distribution: None,
                commit_interval: (v.cadence != CADENCE_EVERY_CHECKPOINT)
                    .then_some(v.cadence.as_str()),
                merge: v.merge,
                metrics_port: port,
            });
            let child = spawn_job(&dir, &text);
            let reader = rt
                .block_on(TableReader::open(
                    &CatalogConfig::sqlite(&dir),
                    "bench",
                    "bids",
                ))
                .unwrap();
            Watched {
                variant: v.clone(),
                dir,
                port,
                child,
                reader,
                seen: HashSet::new(),
                fresh: vec![u32::MAX; n as usize],
                visible: 0,
                commits: 0,
                again: 0,
                facts: None,
                done_at: None,
                cpu_secs: 0.0,
            }
        })
        .collect();
    // A warm-up bid per partition (ids from n on, left out of the figures),
    // then, once every job has read them, the timed bids, through one
    // producer (a new idempotent producer waits for its id).
    let go = Arc::new(AtomicBool::new(false));
    let produced = Arc::new(AtomicU64::new(0));
    let producer = {
        let (go, produced, topic, rate) = (
            Arc::clone(&go),
            Arc::clone(&produced),
            topic.clone(),
            a.rate,
        );
        std::thread::spawn(move || {
            let warmup: Vec<(i32, Vec<u8>)> = bids()
                .take(TOPIC_PARTITIONS as usize)
                .zip(0..TOPIC_PARTITIONS)
                .map(|(mut b, p)| {
                    b.id = n + p as u64;
                    b.date_time = now_us();
                    (p, serde_json::to_vec(&b).unwrap())
                })
                .collect();
            let mut start = None;
            let timed = bids().take(n as usize).map(move |mut b| {
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
                b.date_time = now_us();
                produced.store(b.id + 1, Ordering::Relaxed);
                (
                    (b.id % TOPIC_PARTITIONS as u64) as i32,
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
    let ready_by = Instant::now() + Duration::from_secs(120);
    for j in &mut jobs {
        loop {
            if let Some(status) = j.child.try_wait().unwrap() {
                panic!(
                    "{} ended before reading: {status}; log:\n{}",
                    j.variant.name(),
                    log_tail(&j.dir)
                );
            }
            let read =
                scrape(j.port).map_or(0.0, |t| metric(&t, "tinyflow_kafka_records_read_total"));
            if read >= f64::from(TOPIC_PARTITIONS) {
                break;
            }
            assert!(
                Instant::now() < ready_by,
                "{} did not read the warm-up bids within 120 s; log:\n{}",
                j.variant.name(),
                log_tail(&j.dir)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let started = Instant::now();
    let machine = CpuMeter::start();
    let mut loads = Vec::new();
    go.store(true, Ordering::Release);
    let longest = variants
        .iter()
        .map(|v| cadence_secs(&v.cadence))
        .fold(0.0, f64::max);
    let deadline = a.secs as f64 + 2.0 * longest + 180.0;
    let mut last_progress = Instant::now();
    while jobs.iter().any(|j| j.facts.is_none()) {
        std::thread::sleep(Duration::from_secs(1));
        for j in jobs.iter_mut().filter(|j| j.facts.is_none()) {
            if let Some(status) = j.child.try_wait().unwrap() {
                panic!(
                    "{} ended: {status}; log:\n{}",
                    j.variant.name(),
                    log_tail(&j.dir)
                );
            }
            if let Some(c) = cpu_secs_of(j.child.id()) {
                j.cpu_secs = c;
            }
            rt.block_on(j.poll(n));
            if j.facts.is_some() {
                j.done_at = Some(started.elapsed().as_secs_f64());
            }
        }
        let elapsed = started.elapsed().as_secs_f64();
        loads.push(load_1m());
        if last_progress.elapsed() >= Duration::from_secs(15) {
            last_progress = Instant::now();
            let states: Vec<String> = jobs
                .iter()
                .map(|j| {
                    format!(
                        "{} {} visible in {} commits",
                        j.variant.name(),
                        j.visible,
                        j.commits
                    )
                })
                .collect();
            eprintln!(
                "  {elapsed:.0} s: {} of {n} produced; {}",
                produced.load(Ordering::Relaxed),
                states.join("; ")
            );
        }
        assert!(
            elapsed < deadline,
            "not every bid visible after {elapsed:.0} s: {}",
            jobs.iter()
                .map(|j| format!("{}: {} of {n}", j.variant.name(), j.visible))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let machine = machine.stop();
    let load = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    let sent = producer.join().unwrap().unwrap();
    assert_eq!(sent, n + TOPIC_PARTITIONS as u64, "every bid produced");
    let mut out = Vec::new();
    for mut j in jobs {
        // Everything is committed: no need for a final checkpoint.
        j.child.kill().unwrap();
        j.child.wait().unwrap();
        let name = j.variant.name();
        eprintln!(
            "  {name}: every bid visible after {:.1} s; scanning ...",
            j.done_at.unwrap()
        );
        let scan = scan(&j.dir, a.scan_runs);
        let mut fresh = std::mem::take(&mut j.fresh);
        fresh.sort_unstable();
        let facts = j.facts.take().unwrap();
        if scan.rows != facts.records {
            eprintln!(
                "  {name}: pyiceberg read {} rows, the table's summary says {}",
                scan.rows, facts.records
            );
        }
        eprintln!(
            "  {name}: {} data files, {} commits, {} snapshots kept, metadata {:.2} MB, data {:.1} MB, fresh p50 {:.2} s p99 {:.2} s, pyiceberg scan {:.2} s, job CPU {:.0} s",
            facts.data_files,
            j.commits,
            facts.snapshots,
            facts.metadata_bytes as f64 / 1e6,
            facts.data_bytes as f64 / 1e6,
            pct(&fresh, 0.5),
            pct(&fresh, 0.99),
            scan.pyiceberg,
            j.cpu_secs
        );
        out.push(CadenceResult {
            variant: j.variant.clone(),
            fresh,
            commits: j.commits,
            again: j.again,
            facts,
            done_secs: j.done_at.unwrap(),
            scan,
            cpu_secs: j.cpu_secs,
            machine,
            load,
        });
        if !a.keep {
            let _ = std::fs::remove_dir_all(&j.dir);
        }
    }
    let _ = rt.block_on(tinyflow_connectors_kafka::testing::delete_topic(
        &bootstrap(),
        &topic,
    ));
    out
}

fn part_cadence(a: &Args, rt: &tokio::runtime::Runtime, tmp: &Path) -> Vec<CadenceResult> {
    let merges: Vec<Option<bool>> = if a.legacy {
        vec![None]
    } else {
        a.merges.iter().copied().map(Some).collect()
    };
    let mut variants = Vec::new();
    for c in &a.cadences {
        for l in &a.layouts {
            for m in &merges {
                variants.push(CadenceVariant {
                    cadence: c.clone(),
                    layout: l.clone(),
                    merge: *m,
                });
            }
        }
    }
    let mut out = Vec::new();
    for chunk in variants.chunks(a.at_once) {
        out.extend(round(a, rt, tmp, chunk));
    }
    out
}

fn pct(v: &[u32], p: f64) -> f64 {
    f64::from(v[((v.len() as f64 - 1.0) * p).round() as usize]) / 1000.0
}

fn print_cadence(a: &Args, results: &[CadenceResult]) {
    println!(
        "\nPart 2: commit cadence. {} bids/s for {} s ({} bids), {TOPIC_PARTITIONS} Kafka partitions, job and sink parallelism {WRITERS}, 1 s checkpoints, {} job(s) at once per produced stream",
        a.rate,
        a.secs,
        a.rate * a.secs,
        a.at_once
    );
    println!(
        "| layout | cadence | merge | data files | files / hour | files / min / writer / partition | commits | snapshots kept | metadata MB (files) | data MB | fresh p50 s | fresh p99 s | fresh max s | pyiceberg scan s | scan speed-up vs 1s, merge off | job CPU us / record | machine busy cores | load 1m |"
    );
    println!(
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let secs = a.secs as f64;
    for r in results {
        let f = &r.facts;
        let base = results.iter().find(|b| {
            b.variant.layout == r.variant.layout
                && b.variant.cadence == "1s"
                && b.variant.merge != Some(true)
        });
        let vs = base.map_or(String::new(), |b| {
            format!("{:.2}", b.scan.pyiceberg / r.scan.pyiceberg)
        });
        println!(
            "| {} | {} | {:.0} | {:.2} | {} | {} | {:.2} ({}) | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {vs} | {:.2} | {:.2} | {:.1} |",
            r.variant.label(),
            f.data_files,
            f.data_files as f64 * 3600.0 / secs,
            f.data_files as f64 * 60.0 / secs / WRITERS as f64 / f.partitions.max(1) as f64,
            r.commits,
            f.snapshots,
            f.metadata_bytes as f64 / 1e6,
            f.metadata_files,
            f.data_bytes as f64 / 1e6,
            pct(&r.fresh, 0.5),
            pct(&r.fresh, 0.99),
            pct(&r.fresh, 1.0),
            r.scan.pyiceberg,
            r.cpu_secs * 1e6 / (a.rate * a.secs) as f64,
            r.machine.busy_cores,
            r.load,
        );
    }
    for r in results {
        let duck = match (&r.scan.duckdb, &r.scan.duckdb_skipped) {
            (Some(d), _) => format!("DuckDB scan {d:.2} s"),
            (None, Some(why)) => format!("DuckDB skipped: {why}"),
            (None, None) => String::new(),
        };
        println!(
            "  {}: {} partitions; every bid visible {:.1} s after production started; {} rows seen again in later commits; data/ on disk {:.1} MB; {duck}",
            r.variant.name(),
            r.facts.partitions,
            r.done_secs,
            r.again,
            r.facts.data_dir_bytes as f64 / 1e6,
        );
    }
    for layout in &a.layouts {
        let find = |c: &str, m: Option<bool>| {
            results.iter().find(|r| {
                &r.variant.layout == layout && r.variant.cadence == c && r.variant.merge == m
            })
        };
        let merged = if a.legacy { None } else { Some(true) };
        if let Some(m) = find("1m", merged) {
            let per = m.facts.data_files as f64 * 60.0
                / secs
                / WRITERS as f64
                / m.facts.partitions.max(1) as f64;
            println!(
                "  goal ({layout}): 1m cadence, at most one file per writer per partition per minute: {per:.2}"
            );
            if let Some(b) = find("1s", if a.legacy { None } else { Some(false) }) {
                println!(
                    "  goal ({layout}): full scan >= 5x faster than 1s, merge off: {:.2}x",
                    b.scan.pyiceberg / m.scan.pyiceberg
                );
            }
        }
    }
}

fn main() {
    let a = parse_args();
    let keep = tempfile::Builder::new()
        .prefix("tinyflow-upkeep-")
        .tempdir()
        .unwrap();
    let tmp = keep.path().to_owned();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let many = a.many.then(|| part_many(&a, &rt, &tmp));
    let cadence = a.cadence.then(|| part_cadence(&a, &rt, &tmp));
    if let Some(m) = &many {
        print_many(&a, m);
    }
    if let Some(c) = &cadence {
        print_cadence(&a, c);
    }
    if a.keep {
        let kept = keep.keep();
        println!("tables and logs kept in {}", kept.display());
    }
}
