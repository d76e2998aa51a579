//! `tinyflow demo`: everything in one process. An embedded Kafka cluster
//! (librdkafka's mock: fine for a demo, never proof of transactions) fed
//! with Nexmark bids at a chosen rate; the same job `tinyflow run` would run
//! from a job file, into an Iceberg table in a sqlite catalog under `--dir`;
//! a progress line; then a check that the table holds each produced bid
//! exactly once.

#![allow(
    clippy::print_stderr,
    clippy::print_stdout,
    reason = "the demo talks to its user"
)]

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use metrics_exporter_prometheus::PrometheusHandle;
use tinyflow_cli::nexmark::{BID_FIELDS, bids};
use tinyflow_cli::{
    CatalogSection, CheckpointSection, CommitSection, ComputeSection, FieldSection, JobFile,
    JobSection, MaintenanceSection, MetricsSection, PartitionSection, RestartSection, SinkSection,
    SourceSection, TransformSection, format_duration, install_metrics, metric_sum, parse_duration,
};
use tinyflow_connectors_iceberg::{TableReader, scan_longs, total_records};
use tinyflow_connectors_kafka::{EmbeddedKafka, RecordProducer};
use tinyflow_runtime::StopHandle;

/// `tinyflow demo` options.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Where the catalog, warehouse and checkpoints go (emptied first).
    #[arg(long, default_value = "tinyflow-demo")]
    dir: PathBuf,
    /// Bids produced per second.
    #[arg(long, default_value_t = 20_000)]
    rate: u64,
    /// How long to produce, e.g. 20s or 2m.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    duration: Duration,
    /// Partitions of the bids topic.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Source and writer subtasks.
    #[arg(long, default_value_t = 2)]
    parallelism: usize,
    /// Checkpoint (and commit) interval.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    checkpoint_interval: Duration,
    /// Also serve Prometheus metrics here, e.g. 127.0.0.1:9898.
    #[arg(long)]
    metrics: Option<SocketAddr>,
}

const TOPIC: &str = "bids";

/// The demo's job, as a job file would say it.
fn job_file(bootstrap: &str, dir: &Path, args: &DemoArgs) -> JobFile {
    let fields = BID_FIELDS
        .iter()
        .map(|(name, ty)| FieldSection {
            name: (*name).to_owned(),
            ty: (*ty).to_owned(),
            required: true,
        })
        .collect();
    JobFile {
        job: JobSection {
            name: "demo".to_owned(),
            parallelism: args.parallelism,
        },
        source: SourceSection {
            bootstrap_servers: bootstrap.to_owned(),
            topics: vec![TOPIC.to_owned()],
            fields,
            event_time: Some(tinyflow_cli::EventTimeSection {
                column: Some("date_time".to_owned()),
                record_timestamp: false,
                max_out_of_orderness: Some("5s".to_owned()),
                idle_timeout: None,
            }),
            ..SourceSection::default()
        },
        transforms: vec![
            TransformSection {
                compute: Some(ComputeSection {
                    column: "price_eur".to_owned(),
                    expr: "price / 100".to_owned(),
                }),
                ..TransformSection::default()
            },
            TransformSection {
                select: Some(
                    [
                        "id",
                        "auction",
                        "bidder",
                        "price",
                        "price_eur",
                        "channel",
                        "date_time",
                    ]
                    .map(str::to_owned)
                    .to_vec(),
                ),
                ..TransformSection::default()
            },
        ],
        sink: SinkSection {
            catalog: CatalogSection {
                kind: "sqlite".to_owned(),
                dir: Some(dir.display().to_string()),
                uri: None,
                warehouse: None,
                name: None,
                properties: BTreeMap::new(),
            },
            namespace: "demo".to_owned(),
            table: "bids".to_owned(),
            create_if_missing: true,
            partition: vec![PartitionSection {
                column: "auction".to_owned(),
                transform: "bucket[4]".to_owned(),
            }],
            sink_id: None,
            parallelism: None,
            target_file_size: None,
            distribution: None,
            max_writer_memory: None,
            max_open_files: None,
            compression: None,
            bad_records: None,
            schema_evolution: None,
            commit: CommitSection::default(),
            maintenance: MaintenanceSection::default(),
        },
        checkpoint: CheckpointSection {
            interval: Some(format_duration(args.checkpoint_interval)),
            dir: Some(dir.join("checkpoints").display().to_string()),
            ..CheckpointSection::default()
        },
        restart: RestartSection::default(),
        metrics: MetricsSection {
            address: args.metrics.map(|a| a.to_string()),
            linger: None,
        },
        columns: Default::default(),
        placement: None,
    }
}

/// Produces numbered bids at `rate` per second until `stop`; returns how
/// many were delivered (all of them, or an error).
fn produce(
    bootstrap: &str,
    rate: u64,
    stop: &AtomicBool,
    produced: &AtomicU64,
) -> anyhow::Result<u64> {
    let mut producer = RecordProducer::new(bootstrap, Duration::from_millis(5))
        .context("creating the demo's producer")?;
    let start = Instant::now();
    let mut sent = 0u64;
    let mut buf = Vec::with_capacity(512);
    let mut generator = bids();
    while !stop.load(Ordering::Relaxed) {
        // Paced in 10 ms steps: as many as the rate allows by now.
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        if sent >= due {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        for bid in generator.by_ref().take((due - sent) as usize) {
            buf.clear();
            serde_json::to_writer(&mut buf, &bid).context("encoding a bid")?;
            let key = bid.auction.to_string();
            producer
                .send(TOPIC, key.as_bytes(), &buf)
                .with_context(|| format!("producing bid {}", bid.id))?;
            sent += 1;
            produced.store(sent, Ordering::Relaxed);
        }
    }
    let failed = producer
        .flush(Duration::from_secs(30))
        .context("flushing the demo's producer")?;
    if failed > 0 {
        bail!("{failed} of {sent} bids were not delivered to the embedded cluster");
    }
    Ok(sent)
}

struct Progress {
    handle: PrometheusHandle,
    start: Instant,
    last: (Instant, f64),
}

impl Progress {
    /// One progress line from what a metrics scrape would show.
    fn line(&mut self, produced: u64) -> String {
        let text = self.handle.render();
        let read = metric_sum(&text, "tinyflow_kafka_records_read_total", None);
        let written = metric_sum(&text, "tinyflow_iceberg_rows_written_total", None);
        let checkpoints = metric_sum(&text, "tinyflow_checkpoints_completed_total", None);
        let commits = metric_sum(&text, "tinyflow_iceberg_commits_total", None);
        let files = metric_sum(&text, "tinyflow_iceberg_files_written_total", None);
        let now = Instant::now();
        let rate = (read - self.last.1) / now.duration_since(self.last.0).as_secs_f64().max(1e-3);
        self.last = (now, read);
        format!(
            "{:>5.1}s  produced {produced:>9}  read {:>9.0} ({:>7.0}/s)  behind {:>7.0}  written {:>9.0}  checkpoints {:>4.0}  commits {:>4.0}  files {:>5.0}",
            self.start.elapsed().as_secs_f64(),
            read,
            rate,
            (produced as f64 - read).max(0.0),
            written,
            checkpoints,
            commits,
            files,
        )
    }
}

fn fresh_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir = std::fs::canonicalize(dir).with_context(|| format!("resolving {}", dir.display()))?;
    // The embedded cluster is new every run, so a previous run's table and
    // checkpoints would not match it: start from nothing.
    for leftover in ["catalog.db", "warehouse", "checkpoints"] {
        let p = dir.join(leftover);
        if p.is_dir() {
            std::fs::remove_dir_all(&p).with_context(|| format!("removing {}", p.display()))?;
        } else if p.exists() {
            std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
        }
    }
    Ok(dir)
}

pub(crate) async fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.rate == 0 || args.partitions < 1 || args.parallelism == 0 {
        bail!("--rate, --partitions and --parallelism must be at least 1");
    }
    let dir = fresh_dir(&args.dir)?;
    let kafka = EmbeddedKafka::start(1)?;
    kafka.create_topic(TOPIC, args.partitions)?;
    let bootstrap = kafka.bootstrap_servers();
    let plan = job_file(&bootstrap, &dir, &args).plan()?;
    let sink = plan.sink.clone();
    let handle = install_metrics(plan.endpoint(), &[]).await?;
    println!(
        "tinyflow demo: embedded Kafka at {bootstrap}, topic `{TOPIC}` ({} partitions); {} bids/s for {}; \
         table demo.bids in {} (sqlite catalog); checkpoints every {}",
        args.partitions,
        args.rate,
        format_duration(args.duration),
        dir.display(),
        format_duration(args.checkpoint_interval),
    );

    let stop = Arc::new(AtomicBool::new(false));
    let produced = Arc::new(AtomicU64::new(0));
    let generator = {
        let (stop, produced, bootstrap, rate) = (
            Arc::clone(&stop),
            Arc::clone(&produced),
            bootstrap.clone(),
            args.rate,
        );
        std::thread::spawn(move || produce(&bootstrap, rate, &stop, &produced))
    };
    let job_stop = StopHandle::new();
    let job = tokio::spawn(plan.run_until_stopped(job_stop.clone()));
    let mut progress = Progress {
        handle,
        start: Instant::now(),
        last: (Instant::now(), 0.0),
    };
    let mut stderr = std::io::stderr();
    let end = Instant::now() + args.duration;
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if job.is_finished() {
            break;
        }
        let _ = write!(
            stderr,
            "\r{}",
            progress.line(produced.load(Ordering::Relaxed))
        );
    }
    stop.store(true, Ordering::Relaxed);
    let total = tokio::task::spawn_blocking(move || generator.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the bid generator panicked"))??;
    if job.is_finished() {
        let _ = writeln!(stderr);
        match job.await? {
            Ok(r) => bail!("the job ended on its own after {} attempts", r.attempts),
            Err(e) => return Err(e.context("the demo job failed")),
        }
    }

    // Wait for the job to commit what was produced.
    let reader = TableReader::open(&sink.catalog, &sink.namespace.join("."), &sink.table).await?;
    let drain_start = Instant::now();
    let rows = loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = write!(stderr, "\r{}", progress.line(total));
        // Before the first commit the table may not exist yet.
        let rows = reader.load().await.map_or(0, |t| total_records(&t));
        if rows >= total || drain_start.elapsed() > Duration::from_secs(120) || job.is_finished() {
            break rows;
        }
    };
    let _ = writeln!(stderr);
    if rows < total {
        job.abort();
        bail!(
            "after 120 s the table holds {rows} of {total} produced bids; is the job stuck? (TINYFLOW_LOG=info shows why)"
        );
    }
    // Stop as `tinyflow run` does on SIGTERM: a final checkpoint, committed.
    job_stop.stop();
    let stopped = match tokio::time::timeout(Duration::from_secs(60), job).await {
        Ok(joined) => joined?.context("the demo job failed while stopping")?,
        Err(_) => bail!("the demo job did not stop within 60 s of the stop request"),
    };
    let table = reader.load().await?;
    // Snapshots with data (the run's claim of the sink adds one without).
    let snapshots = table
        .metadata()
        .snapshots()
        .filter(|s| {
            s.summary()
                .additional_properties
                .contains_key(tinyflow_connectors_iceberg::SUMMARY_SINK_ID)
        })
        .count();
    let elapsed = progress.start.elapsed().as_secs_f64();

    // Every `id` in the table (an independent read through iceberg's scan).
    let mut ids = scan_longs(&table, "id", None).await?;
    let count = ids.len() as u64;
    ids.sort_unstable();
    ids.dedup();
    let distinct = ids.len() as u64;
    let in_range = ids.first() == Some(&0) && ids.last().copied() == Some(total as i64 - 1);
    println!(
        "produced {total} bids; the table demo.bids holds {count} rows in {snapshots} snapshots \
         ({:.0} bids/s end to end over {elapsed:.1} s); the job stopped with final checkpoint {}",
        total as f64 / elapsed,
        stopped
            .final_checkpoint
            .map_or_else(|| "none".to_owned(), |c| c.to_string())
    );
    if count == total && distinct == total && in_range {
        println!(
            "exactly once: every produced bid id 0..{total} is in the table once (checked by scanning the table)"
        );
        println!("look inside: tinyflow inspect {} demo.bids", dir.display());
        // The process ends now: dropping the cluster first would only make
        // the job's closing clients log connection errors.
        std::mem::forget(kafka);
        Ok(())
    } else {
        bail!(
            "NOT exactly once: {count} rows, {distinct} distinct ids, expected {total} ids 0..{total}"
        )
    }
}
