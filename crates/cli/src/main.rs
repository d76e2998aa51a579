//! `tinyflow`: run a Kafka -> Iceberg job from a TOML file, check one, run
//! the zero-setup demo, or inspect a table's snapshots.

mod demo;
mod inspect;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tinyflow_cli::jobstate::{ResetStart, ResetTo, parse_offsets, reset};
use tinyflow_cli::{JobFile, JobFileError, counters_line, exit_code, install_metrics};
use tinyflow_runtime::StopHandle;

#[derive(Debug, Parser)]
#[command(
    name = "tinyflow",
    version,
    about = "Exactly-once Kafka -> Apache Iceberg"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the job a TOML file describes until it ends or fails past its
    /// restart strategy. Stop it any time (Ctrl-C, or kill): the next run
    /// goes on from the last completed checkpoint.
    Run {
        /// The job file.
        job: PathBuf,
        /// Run as worker I of N of the job (`0/3`): the worker reads its
        /// share of the partitions and commits with a sink id of its own.
        /// Also from the environment: `TINYFLOW_WORKER=I/N`, or
        /// `TINYFLOW_WORKERS=N` with `TINYFLOW_WORKER_INDEX` (a number, or a
        /// StatefulSet pod name ending in `-<ordinal>`).
        #[arg(long, value_name = "I/N")]
        worker: Option<String>,
        /// Rescale: the layout this one replaces, `WORKERS@GENERATION` as
        /// `tinyflow inspect` shows it (`1` for the job in one process; also
        /// `TINYFLOW_RESCALE_FROM`). The first worker of the new layout
        /// retires the old one in the table (fencing its workers) and the
        /// new workers start where the old ones committed.
        #[arg(long, value_name = "N@G")]
        rescale_from: Option<String>,
    },
    /// Checks a job file without connecting to anything.
    Validate {
        /// The job file.
        job: PathBuf,
    },
    /// Zero setup: an in-process Kafka cluster fed with Nexmark bids, a
    /// job into an Iceberg table in a local sqlite catalog, a live progress
    /// line, then a check that the table holds every bid exactly once.
    Demo(demo::DemoArgs),
    /// `inspect JOB.toml`: the job's state beside its table (epoch, last
    /// commit, positions, pending checkpoints) and whether a run would
    /// accept it (exit 4 when not). `inspect CATALOG TABLE`: a table's
    /// snapshots with the checkpoint ids, watermarks and source positions
    /// that made them.
    Inspect(inspect::InspectArgs),
    /// Starts a job again from what its table holds (or from given
    /// offsets or a time): sets its checkpoints aside (moved, not deleted)
    /// and claims its sink, so that a run of it elsewhere is fenced.
    /// Refuses while a run holds the checkpoint directory.
    Reset {
        /// The job file.
        job: PathBuf,
        /// Start where the table's last commit of the sink ends (the
        /// default; source.start when the table holds none).
        #[arg(long, conflicts_with_all = ["to_offsets", "to_timestamp"])]
        to_table: bool,
        /// Start at these offsets: `topic/partition=offset,...` (partitions
        /// not named start at the earliest).
        #[arg(long, value_name = "OFFSETS", conflicts_with = "to_timestamp")]
        to_offsets: Option<String>,
        /// Start at the first records at or after this time (ms since the
        /// Unix epoch).
        #[arg(long, value_name = "MS")]
        to_timestamp: Option<i64>,
        /// Reset worker I of N of a job spread over workers (its sink id and
        /// checkpoints); N must be the table's layout. Also from the
        /// environment, as for `run`.
        #[arg(long, value_name = "I/N")]
        worker: Option<String>,
    },
    /// One round of table maintenance on the job's table, with the job
    /// file's `[sink.maintenance]` policy (the flags override it): expires
    /// snapshots, deletes the files only they referenced and the metadata
    /// files past the kept versions. For tables no job maintains; safe
    /// beside a running job (its commits and this one's are ordered by the
    /// catalog). Exit 0 when done, 1 when it failed or left files behind,
    /// 2 on a configuration error.
    Maintain {
        /// The job file.
        job: PathBuf,
        /// Expire snapshots older than this (`1h`, `0s`), or `off`.
        #[arg(long, value_name = "DURATION")]
        older_than: Option<String>,
        /// Keep at least this many snapshots, whatever their age.
        #[arg(long, value_name = "N")]
        retain_last: Option<usize>,
        /// Keep this many previous metadata files, or `off` (leave them).
        #[arg(long, value_name = "N")]
        metadata_versions_max: Option<String>,
        /// Change nothing; print what would expire and every file that
        /// would be deleted.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Standard error with every registered secret masked
/// ([`tinyflow_api::secrets::scrub`]): what the logs go through.
struct ScrubbedStderr(std::sync::Arc<str>);

impl std::io::Write for ScrubbedStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // The formatter writes each event whole.
        let text = tinyflow_api::secrets::scrub(&String::from_utf8_lossy(buf));
        let mut err = std::io::stderr().lock();
        err.write_all(self.0.as_bytes())?;
        err.write_all(text.as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Logs at `default` unless `TINYFLOW_LOG` says otherwise; a worker's lines
/// start with `worker=I/N`.
fn init_tracing(default: &str, worker: Option<tinyflow_api::Worker>) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TINYFLOW_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let prefix: std::sync::Arc<str> = match worker {
        Some(w) => format!("worker={w} ").into(),
        None => "".into(),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(move || ScrubbedStderr(std::sync::Arc::clone(&prefix)))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

#[allow(
    clippy::print_stderr,
    clippy::print_stdout,
    reason = "a command line tool's output"
)]
fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Validate { job } => {
                let plan = JobFile::load(&job)?.resolve_schema().await?.plan()?;
                let columns: Vec<String> = plan
                    .output_schema
                    .fields()
                    .iter()
                    .map(|f| format!("{}: {}", f.name(), f.data_type()))
                    .collect();
                println!(
                    "{}: ok; job `{}` writes {}.{} with columns {}",
                    job.display(),
                    plan.job_id,
                    plan.sink.namespace.join("."),
                    plan.sink.table,
                    columns.join(", ")
                );
                Ok(())
            }
            Command::Run {
                job,
                worker,
                rescale_from,
            } => {
                let env = |k: &str| std::env::var(k).ok();
                let placement =
                    tinyflow_cli::worker_from(worker.as_deref(), rescale_from.as_deref(), &env)?;
                init_tracing("info", placement.map(|(w, _)| w));
                let mut plan = JobFile::load(&job)?.resolve_schema().await?.plan()?;
                // Before the worker joins its layout, so that the switch's
                // catalog updates are counted too.
                let labels: Vec<(&str, String)> = placement
                    .map(|(w, _)| vec![("worker", w.to_string())])
                    .unwrap_or_default();
                let metrics = install_metrics(plan.endpoint(), &labels).await?;
                if let Some((worker, from)) = placement {
                    plan = plan.for_worker(worker, from).await?;
                }
                let (address, linger) = (plan.metrics_address, plan.metrics_linger);
                let stop = StopHandle::new();
                let run = plan.run_until_stopped(stop.clone());
                tokio::pin!(run);
                let ended = tokio::select! {
                    r = &mut run => r,
                    _ = shutdown_signal() => {
                        tracing::info!("stopping on a signal: taking a final checkpoint and committing it (a second signal stops at once)");
                        stop.stop();
                        tokio::select! {
                            r = &mut run => r,
                            signal = shutdown_signal() => {
                                tracing::warn!(signal = signal.name(), "stopping at once on a second signal, without a final checkpoint; the next run goes on from the last completed checkpoint");
                                return Err(anyhow::Error::new(ForcedStop(signal)));
                            }
                        }
                    }
                };
                // A bounded job ends before a scraper's next visit: the
                // counters go to the log, and the endpoint can stay up.
                tracing::info!(counters = %counters_line(&metrics.render()), "final counters of this run");
                if let Some(address) = address
                    && !linger.is_zero()
                    && !stop.is_requested()
                {
                    tracing::info!(%address, secs = linger.as_secs_f64(), "serving the final metrics at /metrics a while longer (metrics.linger; a signal ends it)");
                    tokio::select! {
                        () = tokio::time::sleep(linger) => {}
                        _ = shutdown_signal() => {}
                    }
                }
                let report = ended?;
                match report.final_checkpoint {
                    Some(id) if stop.is_requested() => tracing::info!(
                        attempts = report.attempts,
                        final_checkpoint = %id,
                        "stopped with a final checkpoint: the table holds everything read before it, and the next run goes on from it"
                    ),
                    _ => tracing::info!(attempts = report.attempts, final_checkpoint = ?report.final_checkpoint, "job ended"),
                }
                Ok(())
            }
            Command::Demo(args) => {
                init_tracing("warn", None);
                demo::run(args).await
            }
            Command::Inspect(args) => {
                init_tracing("warn", None);
                inspect::run(args).await
            }
            Command::Maintain {
                job,
                older_than,
                retain_last,
                metadata_versions_max,
                dry_run,
            } => {
                init_tracing("warn", None);
                let file = JobFile::load(&job)?;
                let overrides = tinyflow_cli::maintain::Overrides {
                    older_than,
                    retain_last,
                    metadata_versions_max,
                    dry_run,
                };
                let done = tinyflow_cli::maintain::maintain(&file, &overrides).await?;
                for line in &done.lines {
                    println!("{}", tinyflow_api::secrets::scrub(line));
                }
                if !done.problems.is_empty() {
                    anyhow::bail!(
                        "the round left files behind (nothing a snapshot needs was deleted): {}",
                        done.problems.join("; ")
                    );
                }
                Ok(())
            }
            Command::Reset {
                job,
                to_table: _,
                to_offsets,
                to_timestamp,
                worker,
            } => {
                init_tracing("warn", None);
                let env = |k: &str| std::env::var(k).ok();
                let placement = tinyflow_cli::worker_from(worker.as_deref(), None, &env)?;
                let mut plan = JobFile::load(&job)?.resolve_schema().await?.plan()?;
                if let Some((worker, _)) = placement {
                    plan = plan.as_current_worker(worker).await?;
                }
                let to = match (to_offsets, to_timestamp) {
                    (Some(o), _) => ResetTo::Start(ResetStart::Offsets(
                        parse_offsets(&o).map_err(|e| JobFileError {
                            key: "--to-offsets".to_owned(),
                            message: e.to_string(),
                        })?,
                    )),
                    (None, Some(ms)) => ResetTo::Start(ResetStart::TimestampMs(ms)),
                    (None, None) => ResetTo::Table,
                };
                for line in reset(&plan, to).await? {
                    println!("{}", tinyflow_api::secrets::scrub(&line));
                }
                Ok(())
            }
        }
    });
    // Do not wait for blocking threads (a Kafka client's close) on exit.
    runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<ForcedStop>().is_some() => {
            let code = e
                .downcast_ref::<ForcedStop>()
                .map_or(130, |f| f.0.exit_code());
            eprintln!("{e}");
            ExitCode::from(code)
        }
        Err(e) => {
            let e: anyhow::Error = e;
            let text = tinyflow_api::error_chain(e.as_ref() as &dyn std::error::Error);
            eprintln!("error: {}", tinyflow_api::secrets::scrub(&text));
            ExitCode::from(exit_code(&e))
        }
    }
}

/// The signals that stop `tinyflow run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signal {
    Interrupt,
    Terminate,
}

impl Signal {
    fn name(self) -> &'static str {
        match self {
            Signal::Interrupt => "SIGINT",
            Signal::Terminate => "SIGTERM",
        }
    }

    /// 128 + the signal's number, as shells report a process the signal
    /// ended.
    fn exit_code(self) -> u8 {
        match self {
            Signal::Interrupt => tinyflow_cli::exit::FORCED_SIGINT,
            Signal::Terminate => tinyflow_cli::exit::FORCED_SIGTERM,
        }
    }
}

/// A second signal stopped the job at once, without a final checkpoint.
#[derive(Debug)]
struct ForcedStop(Signal);

impl std::fmt::Display for ForcedStop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stopped at once by a second {}, without a final checkpoint: the next run goes on from the last completed one",
            self.0.name()
        )
    }
}

impl std::error::Error for ForcedStop {}

async fn shutdown_signal() -> Signal {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            return tokio::select! {
                _ = tokio::signal::ctrl_c() => Signal::Interrupt,
                _ = term.recv() => Signal::Terminate,
            };
        }
    }
    let _ = tokio::signal::ctrl_c().await;
    Signal::Interrupt
}
