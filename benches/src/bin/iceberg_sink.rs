//! The Iceberg sink's figures, against limits measured in the same run:
//!
//! 1. rows/s of the sink's writer (record batches to Parquet data files,
//!    closed at every checkpoint) and of writer plus committer (one commit
//!    per checkpoint on a sqlite catalog), each divided by a bare arrow-rs
//!    `ArrowWriter` loop writing the same batches with the same Parquet
//!    settings and the same file boundaries, with and without an fsync per
//!    file (the sink syncs every file it closes: iceberg's local storage
//!    does, and a checkpoint must not refer to a file a crash can lose);
//! 2. commit latency on the sqlite catalog (p50, p99, and how it moves as
//!    the table's history grows);
//! 3. snapshots and data files per hour at 1 s checkpoints, with a commit
//!    per checkpoint and with a cadence of one commit per 10 checkpoints.
//!
//! `cargo run --release -p tinyflow-benches --bin iceberg_sink -- [--rows N]
//! [--checkpoint-rows N] [--commits N] [--repeat N]`. The rows are Nexmark
//! bids (auction, bidder, price, channel, url, timestamp, extra), compressed
//! as the sink compresses by default (zstd(1)).

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark binary: prints its figures, and any failure ends it"
)]

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use nexmark::EventGenerator;
use nexmark::config::NexmarkConfig;
use nexmark::event::{Event, EventType};
use parquet::arrow::ArrowWriter;
use tinyflow_api::{CheckpointId, OperatorContext, SinkFactory, WriterFactory};
use tinyflow_benches::sink_writer_properties;
use tinyflow_connectors_iceberg::{
    CatalogConfig, Column, ColumnType, CommitCadence, Compression, IcebergSink, IcebergSinkConfig,
    TableSpec,
};

struct Args {
    rows: usize,
    batch: usize,
    checkpoint_rows: usize,
    commits: usize,
    repeat: usize,
}

fn parse_args() -> Args {
    let mut args = Args {
        rows: 2_000_000,
        batch: 8_192,
        checkpoint_rows: 250_000,
        commits: 300,
        repeat: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value: usize = it
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{flag} needs a number"));
        match flag.as_str() {
            "--rows" => args.rows = value,
            "--batch" => args.batch = value,
            "--checkpoint-rows" => args.checkpoint_rows = value,
            "--commits" => args.commits = value,
            "--repeat" => args.repeat = value,
            other => panic!("unknown option {other}; see the file's header"),
        }
    }
    args
}

fn spec() -> TableSpec {
    TableSpec {
        columns: vec![
            Column::required("auction", ColumnType::Long),
            Column::required("bidder", ColumnType::Long),
            Column::required("price", ColumnType::Long),
            Column::required("channel", ColumnType::String),
            Column::required("url", ColumnType::String),
            Column::required("ts", ColumnType::Timestamptz),
            Column::required("extra", ColumnType::String),
        ],
        partition: vec![],
    }
}

/// `rows` Nexmark bids (fixed base time, so every run sees the same) in
/// batches of `batch`.
fn bids(rows: usize, batch: usize) -> Vec<RecordBatch> {
    let config = NexmarkConfig {
        base_time: 1_767_225_600_000,
        first_event_id: 0,
        first_event_number: 0,
        ..NexmarkConfig::default()
    };
    let all: Vec<nexmark::event::Bid> = EventGenerator::new(config)
        .with_type_filter(EventType::Bid)
        .take(rows)
        .map(|e| match e {
            Event::Bid(b) => b,
            other => panic!("the bid filter let through {:?}", other.event_type()),
        })
        .collect();
    all.chunks(batch)
        .map(|c| {
            let long = |f: &dyn Fn(&nexmark::event::Bid) -> i64| {
                Arc::new(Int64Array::from(c.iter().map(f).collect::<Vec<_>>())) as ArrayRef
            };
            let text = |f: &dyn Fn(&nexmark::event::Bid) -> &str| {
                Arc::new(StringArray::from(c.iter().map(f).collect::<Vec<_>>())) as ArrayRef
            };
            RecordBatch::try_from_iter(vec![
                ("auction", long(&|b| b.auction as i64)),
                ("bidder", long(&|b| b.bidder as i64)),
                ("price", long(&|b| b.price as i64)),
                ("channel", text(&|b| b.channel.as_str())),
                ("url", text(&|b| b.url.as_str())),
                (
                    "ts",
                    Arc::new(
                        TimestampMicrosecondArray::from(
                            c.iter()
                                .map(|b| b.date_time as i64 * 1000)
                                .collect::<Vec<_>>(),
                        )
                        .with_timezone("+00:00"),
                    ) as ArrayRef,
                ),
                ("extra", text(&|b| b.extra.as_str())),
            ])
            .unwrap()
        })
        .collect()
}

/// Checkpoint boundaries: after which batch index a checkpoint falls.
fn is_boundary(i: usize, batch: usize, checkpoint_rows: usize) -> bool {
    let per = checkpoint_rows.div_ceil(batch).max(1);
    (i + 1).is_multiple_of(per)
}

/// The bare loop: ArrowWriter into local files, a new file per checkpoint;
/// with `fsync`, each file is synced at close as the sink's files are (a
/// file a checkpoint refers to must be durable before it completes).
fn bare(batches: &[RecordBatch], dir: &Path, a: &Args, fsync: bool) -> Duration {
    let finish = |w: ArrowWriter<File>| {
        if fsync {
            w.into_inner().unwrap().sync_all().unwrap();
        } else {
            w.close().unwrap();
        }
    };
    let started = Instant::now();
    let mut n = 0;
    let mut writer: Option<ArrowWriter<File>> = None;
    for (i, b) in batches.iter().enumerate() {
        let w = writer.get_or_insert_with(|| {
            n += 1;
            let f = File::create(dir.join(format!("bare-{n}.parquet"))).unwrap();
            ArrowWriter::try_new(f, b.schema(), Some(sink_writer_properties(b))).unwrap()
        });
        w.write(b).unwrap();
        if is_boundary(i, a.batch, a.checkpoint_rows) {
            finish(writer.take().unwrap());
        }
    }
    if let Some(w) = writer {
        finish(w);
    }
    started.elapsed()
}

fn ctx(name: &str) -> OperatorContext {
    OperatorContext {
        name: name.to_owned(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 128,
    }
}

fn config(dir: &Path, cadence: CommitCadence) -> IcebergSinkConfig {
    let mut c = IcebergSinkConfig::new(CatalogConfig::sqlite(dir), "bench", "bids", "bench")
        .create_if_missing(spec());
    c.cadence = cadence;
    c.orphan_min_age = None;
    c
}

/// The sink's writer (and, with `commit`, its committer) over the batches,
/// a checkpoint at each boundary.
async fn sink(batches: &[RecordBatch], dir: &Path, a: &Args, commit: bool) -> Duration {
    let sink = IcebergSink::new(config(dir, CommitCadence::default())).unwrap();
    let mut writer = sink.writers().create(&ctx("w")).await.unwrap();
    let mut committer = sink.committer().create(&ctx("c"), None).await.unwrap();
    let started = Instant::now();
    let mut id = 0;
    for (i, b) in batches.iter().enumerate() {
        writer.write(vec![b.clone()]).await.unwrap();
        if is_boundary(i, a.batch, a.checkpoint_rows) || i + 1 == batches.len() {
            id += 1;
            let files = writer.flush(CheckpointId::new(id)).await.unwrap();
            if commit {
                committer.write(files).await.unwrap();
                committer
                    .prepare_commit(CheckpointId::new(id))
                    .await
                    .unwrap();
                committer.commit(CheckpointId::new(id)).await.unwrap();
            }
        }
    }
    started.elapsed()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Commit latency: `a.commits` checkpoints of one small file each; with
/// `expire`, table maintenance keeps 100 snapshots (a round after every
/// commit, in the background, expiring all but the newest 100 and deleting
/// what only they referenced), to see what the history costs. Rounds run
/// beside the commits and conflict with some of them.
async fn commit_latency(dir: &Path, a: &Args, small: &RecordBatch, expire: bool) -> Vec<f64> {
    let mut c = config(dir, CommitCadence::default());
    if expire {
        c.maintenance = Some(tinyflow_connectors_iceberg::Maintenance {
            expire_older_than: Some(std::time::Duration::ZERO),
            retain_last: 100,
            metadata_versions_max: Some(100),
            every: std::time::Duration::ZERO,
        });
    }
    let sink = IcebergSink::new(c).unwrap();
    let mut writer = sink.writers().create(&ctx("w")).await.unwrap();
    let mut committer = sink.committer().create(&ctx("c"), None).await.unwrap();
    let mut ms = Vec::with_capacity(a.commits);
    for id in 1..=a.commits as u64 {
        writer.write(vec![small.clone()]).await.unwrap();
        let files = writer.flush(CheckpointId::new(id)).await.unwrap();
        committer.write(files).await.unwrap();
        committer
            .prepare_commit(CheckpointId::new(id))
            .await
            .unwrap();
        let started = Instant::now();
        committer.commit(CheckpointId::new(id)).await.unwrap();
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    ms
}

/// Snapshots and files after `checkpoints` checkpoints of two writers.
async fn per_hour(
    dir: &Path,
    checkpoints: u64,
    cadence: CommitCadence,
    small: &RecordBatch,
) -> (usize, usize) {
    let sink = IcebergSink::new(config(dir, cadence)).unwrap();
    let mut writers = Vec::new();
    for _ in 0..2 {
        writers.push(sink.writers().create(&ctx("w")).await.unwrap());
    }
    let mut committer = sink.committer().create(&ctx("c"), None).await.unwrap();
    let mut files = 0;
    for id in 1..=checkpoints {
        for w in &mut writers {
            w.write(vec![small.clone()]).await.unwrap();
            let f = w.flush(CheckpointId::new(id)).await.unwrap();
            files += f.len();
            committer.write(f).await.unwrap();
        }
        committer
            .prepare_commit(CheckpointId::new(id))
            .await
            .unwrap();
        committer.commit(CheckpointId::new(id)).await.unwrap();
    }
    let table = sink.load_table().await.unwrap();
    (table.metadata().snapshots().len(), files)
}

fn main() {
    let a = parse_args();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    eprintln!("generating {} bids in batches of {}", a.rows, a.batch);
    let batches = bids(a.rows, a.batch);
    let bytes: usize = batches.iter().map(RecordBatch::get_array_memory_size).sum();
    println!(
        "iceberg sink bench: {} rows ({} MiB in Arrow), a checkpoint every {} rows, {:?}, 1 writer, current-thread runtime",
        a.rows,
        bytes >> 20,
        a.checkpoint_rows,
        Compression::default()
    );
    let (mut bare_r, mut synced_r, mut write_r, mut commit_r) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..a.repeat {
        let d = tempfile::tempdir().unwrap();
        let t = bare(&batches, d.path(), &a, false);
        bare_r.push(a.rows as f64 / t.as_secs_f64());
        let d = tempfile::tempdir().unwrap();
        let t = bare(&batches, d.path(), &a, true);
        synced_r.push(a.rows as f64 / t.as_secs_f64());
        let d = tempfile::tempdir().unwrap();
        let t = rt.block_on(sink(&batches, d.path(), &a, false));
        write_r.push(a.rows as f64 / t.as_secs_f64());
        let d = tempfile::tempdir().unwrap();
        let t = rt.block_on(sink(&batches, d.path(), &a, true));
        commit_r.push(a.rows as f64 / t.as_secs_f64());
        eprintln!(
            "round {round}: bare {:.2}M rows/s, bare+fsync {:.2}M, writer {:.2}M, writer+commit {:.2}M",
            bare_r[round] / 1e6,
            synced_r[round] / 1e6,
            write_r[round] / 1e6,
            commit_r[round] / 1e6
        );
    }
    let (b, f, w, c) = (
        median(bare_r),
        median(synced_r),
        median(write_r),
        median(commit_r),
    );
    println!("bare ArrowWriter loop            {:>6.2}M rows/s", b / 1e6);
    println!("bare loop, files fsynced         {:>6.2}M rows/s", f / 1e6);
    println!(
        "sink writer                      {:>6.2}M rows/s   ratio {:.2} to bare, {:.2} to fsynced",
        w / 1e6,
        w / b,
        w / f
    );
    println!(
        "sink writer + commit             {:>6.2}M rows/s   ratio {:.2} to bare, {:.2} to fsynced   (goal >= 0.9)",
        c / 1e6,
        c / b,
        c / f
    );

    let small = batches[0].slice(0, 1_000.min(batches[0].num_rows()));
    for expire in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let ms = rt.block_on(commit_latency(d.path(), &a, &small, expire));
        let mut sorted = ms.clone();
        sorted.sort_by(f64::total_cmp);
        let tenth = (ms.len() / 10).max(1);
        println!(
            "commit latency, sqlite, {} commits of 1 file{}: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; p50 of first {tenth} {:.1} ms, of last {tenth} {:.1} ms",
            ms.len(),
            if expire {
                ", maintenance keeping 100 snapshots"
            } else {
                ""
            },
            percentile(&sorted, 0.5),
            percentile(&sorted, 0.99),
            sorted[sorted.len() - 1],
            median(ms[..tenth].to_vec()),
            median(ms[ms.len() - tenth..].to_vec()),
        );
    }

    let checkpoints = 120;
    for (label, cadence) in [
        ("a commit per checkpoint", CommitCadence::default()),
        (
            "a commit per 10 checkpoints",
            CommitCadence {
                every_checkpoints: Some(10),
                ..CommitCadence::default()
            },
        ),
    ] {
        let d = tempfile::tempdir().unwrap();
        let (snaps, files) = rt.block_on(per_hour(d.path(), checkpoints, cadence, &small));
        let scale = 3600 / checkpoints as usize;
        println!(
            "1 s checkpoints, 2 writers, {label}: {} snapshots/hour, {} files/hour (counted over {checkpoints} checkpoints, x{scale})",
            snaps * scale,
            files * scale
        );
    }
}
