//! Nexmark q0 (pass-through), q1 (currency map) and q2 (filter and project)
//! through the tinyflow runtime, each against a bare loop doing the same work
//! on the same events in the same run, with checkpoints every second and with
//! checkpointing off; then peak memory of the engine at two stream lengths.
//!
//! ```text
//! cargo run --release -p tinyflow-benches --bin nexmark -- [--events N] [--query q0|q1|q2|all]
//!     [--pool N] [--batch N] [--runs N] [--threads LIST] [--off-interval none|SECS]
//!     [--cooperative-source] [--no-memory]
//! ```
//!
//! The `nexmark` crate's generator (fixed base time, first event id 0: every
//! event is seeded by its id) produces a pool of `--pool` bids once, before
//! anything is timed, as compact rows `(auction, bidder, price, date_time)`
//! (the columns q0 to q2 read). A stream of `--events` records walks that
//! pool round and round, so its length is independent of the memory the pool
//! takes.
//!
//! - bare: one loop folds each record's query output into a [`Tally`] (count
//!   and checksum) straight from the pool: the raw limit.
//! - batched: one loop does what the engine's tasks do to the data, without
//!   the engine: copy each batch of `--batch` records out of the pool into an
//!   owned `Vec` (the `Source` contract), run the operators' `Vec -> Vec`
//!   steps, fold.
//! - engine: `source -> [operators] -> sink`, parallelism 1, on a tokio
//!   runtime per `--threads` entry (0: current-thread; n: multi-thread with n
//!   workers); the source copies batches out of the pool, the sink folds them.
//!   All forward neighbours, so the runtime chains the whole job into one
//!   task (no channels between the nodes). Timed from `JobRunner::run` to its
//!   return: start-up and the final checkpoint included.
//!
//! All tallies must agree, or the binary fails. Each measurement is repeated
//! `--runs` times, interleaved, and the median is reported; the progress lines
//! also give the engine's CPU time (all threads, `/proc/self/stat`) and
//! context switches (`/proc/self/task/*/status`).
//!
//! "ckpt off" is `interval: None` with a non-transactional sink; with
//! `--off-interval SECS` it is checkpoints every SECS with the transactional
//! sink instead (only the final checkpoint then falls in the run). The
//! engine's source is always ready, so the task running it never waits;
//! `--cooperative-source` makes it spend tokio task budget per batch, so that
//! the task yields now and then (see `CyclicSource::cooperative`). The
//! progress lines and the table give the checkpoints taken in each 1 s run:
//! about one per second plus the final one is what the figure should be.
//!
//! Memory: a child process per runtime and stream length (`--events` and four
//! times it) regenerates the pool, then per query resets its peak RSS
//! (`/proc/self/clear_refs`), runs the engine with checkpoints every second
//! and reads `VmHWM`; flat means the peak does not grow with the length.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a bench binary reports progress and figures on the terminal"
)]

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nexmark::EventGenerator;
use nexmark::config::NexmarkConfig;
use nexmark::event::{Event, EventType};
use tinyflow_api::{JobBuilder, JobId};
use tinyflow_benches::WALL_START_MS;
use tinyflow_benches::pipeline::{
    AtEnd, CountingSink, CyclicSource, Fold, LatestStore, Tally, Visibility, cyclic_slices,
};
use tinyflow_checkpoint::CheckpointConfig;
use tinyflow_runtime::{JobRunner, RuntimeConfig};

/// One bid, as q0 to q2 see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bid {
    auction: u64,
    bidder: u64,
    price: u64,
    date_time: u64,
}

impl Fold for Bid {
    fn fold(&self) -> u64 {
        self.auction
            ^ self.bidder.rotate_left(16)
            ^ self.price.rotate_left(32)
            ^ self.date_time.rotate_left(48)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Query {
    /// `SELECT auction, bidder, price, date_time FROM bid`
    Q0,
    /// `SELECT auction, bidder, 0.908 * price, date_time FROM bid`
    Q1,
    /// `SELECT auction, price FROM bid WHERE auction % 123 = 0`
    Q2,
}

impl Query {
    fn name(self) -> &'static str {
        match self {
            Query::Q0 => "q0",
            Query::Q1 => "q1",
            Query::Q2 => "q2",
        }
    }
}

/// q1: dollars to euros, in the Nexmark convention.
fn to_euros(b: Bid) -> Bid {
    Bid {
        price: b.price * 908 / 1000,
        ..b
    }
}

/// q2's predicate.
fn selected(b: &Bid) -> bool {
    b.auction.is_multiple_of(123)
}

/// q2's projection.
fn auction_price(b: Bid) -> (u64, u64) {
    (b.auction, b.price)
}

#[derive(Debug, Clone)]
struct Args {
    events: u64,
    queries: Vec<Query>,
    pool: usize,
    batch: usize,
    runs: usize,
    /// Runtimes to run the engine on: 0 is current-thread, n > 0 is
    /// multi-thread with n workers.
    threads: Vec<usize>,
    /// `None`: checkpointing off (`interval: None`).
    off_interval: Option<Duration>,
    cooperative: bool,
    memory: bool,
    memory_child: bool,
}

const USAGE: &str = "usage: nexmark [--events N] [--query q0|q1|q2|all] [--pool N] [--batch N] \
                     [--runs N] [--threads LIST, e.g. 0,2] [--off-interval none|SECS] \
                     [--cooperative-source] [--no-memory]";

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        events: 400_000_000,
        queries: vec![Query::Q0, Query::Q1, Query::Q2],
        pool: 1 << 20,
        batch: 1024,
        runs: 3,
        threads: vec![0, 2],
        off_interval: None,
        cooperative: false,
        memory: true,
        memory_child: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        let number = |v: &str| {
            v.replace('_', "")
                .parse::<u64>()
                .map_err(|e| format!("{flag}: {e}\n{USAGE}"))
        };
        let index = |n: u64| usize::try_from(n).map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--events" => args.events = number(&value()?)?,
            "--pool" => args.pool = index(number(&value()?)?)?,
            "--batch" => args.batch = index(number(&value()?)?)?,
            "--runs" => args.runs = index(number(&value()?)?)?.max(1),
            "--threads" => {
                args.threads = value()?
                    .split(',')
                    .map(|t| number(t).and_then(index))
                    .collect::<Result<_, _>>()?;
            }
            "--off-interval" => {
                args.off_interval = match value()?.as_str() {
                    "none" => None,
                    secs => Some(Duration::from_secs(number(secs)?.max(1))),
                };
            }
            "--query" => {
                args.queries = match value()?.as_str() {
                    "q0" => vec![Query::Q0],
                    "q1" => vec![Query::Q1],
                    "q2" => vec![Query::Q2],
                    "all" => vec![Query::Q0, Query::Q1, Query::Q2],
                    other => return Err(format!("unknown query {other:?}\n{USAGE}")),
                };
            }
            "--cooperative-source" => args.cooperative = true,
            "--no-memory" => args.memory = false,
            "--memory-child" => args.memory_child = true,
            "--help" | "-h" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if args.events == 0 || args.pool == 0 || args.batch == 0 || args.threads.is_empty() {
        return Err(format!(
            "--events, --pool, --batch and --threads must be positive\n{USAGE}"
        ));
    }
    args.pool = args
        .pool
        .min(usize::try_from(args.events).unwrap_or(usize::MAX));
    Ok(args)
}

/// `count` bids from the Nexmark generator with a fixed base time; event ids
/// start at 0 and seed each event, so every run sees the same bids.
fn generate_bids(count: usize) -> Vec<Bid> {
    let config = NexmarkConfig {
        base_time: WALL_START_MS,
        first_event_id: 0,
        first_event_number: 0,
        ..NexmarkConfig::default()
    };
    let wide = |n: usize| u64::try_from(n).expect("a usize fits in u64");
    EventGenerator::new(config)
        .with_type_filter(EventType::Bid)
        .take(count)
        .map(|event| match event {
            Event::Bid(b) => Bid {
                auction: wide(b.auction),
                bidder: wide(b.bidder),
                price: wide(b.price),
                date_time: b.date_time,
            },
            other => panic!("the bid filter let through {:?}", other.event_type()),
        })
        .collect()
}

/// The bare loop: the query's work on `length` records of `pool`, straight
/// into a tally.
fn bare(query: Query, pool: &[Bid], length: u64) -> Tally {
    let mut tally = Tally::default();
    for slice in cyclic_slices(pool, 0, length) {
        match query {
            Query::Q0 => tally.add_all(slice),
            Query::Q1 => slice.iter().for_each(|b| tally.add(&to_euros(*b))),
            Query::Q2 => slice
                .iter()
                .filter(|b| selected(b))
                .for_each(|b| tally.add(&auction_price(*b))),
        }
    }
    tally
}

/// The engine's work on the data without the engine: `length` records of
/// `pool` copied into owned batches of `batch`, each put through the
/// query's `Vec -> Vec` steps as the job's operators do, then folded.
fn batched(query: Query, pool: &[Bid], length: u64, batch: usize) -> Tally {
    let mut tally = Tally::default();
    let batch = u64::try_from(batch).expect("batch size fits in u64");
    let mut position = 0;
    while position < length {
        let take = batch.min(length - position);
        let mut records =
            Vec::with_capacity(usize::try_from(take).expect("a batch fits in memory"));
        for slice in cyclic_slices(pool, position, take) {
            records.extend_from_slice(slice);
        }
        position += take;
        match query {
            Query::Q0 => tally.add_all(&records),
            Query::Q1 => {
                let out: Vec<Bid> = records.into_iter().map(to_euros).collect();
                tally.add_all(&out);
            }
            Query::Q2 => {
                records.retain(selected);
                let out: Vec<(u64, u64)> = records.into_iter().map(auction_price).collect();
                tally.add_all(&out);
            }
        }
    }
    tally
}

/// How the engine checkpoints in one measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checkpointing {
    Off,
    Every(Duration),
}

/// What one engine run did.
#[derive(Debug, Clone, Copy)]
struct EngineRun {
    tally: Tally,
    elapsed: Duration,
    /// CPU time and context switches of the whole process during the run.
    usage: Usage,
    checkpoints: u64,
}

/// Runs `query` as a job over `args.events` records of `pool`.
fn engine(
    runtime: &tokio::runtime::Runtime,
    query: Query,
    pool: &Arc<Vec<Bid>>,
    args: &Args,
    checkpointing: Checkpointing,
) -> Result<EngineRun, String> {
    let (interval, visibility) = match checkpointing {
        Checkpointing::Off => (None, Visibility::Immediate),
        Checkpointing::Every(i) => (Some(i), Visibility::Transactional),
    };
    let job = JobBuilder::new(JobId::new(format!("nexmark-{}", query.name())).expect("valid id"));
    let bids = job.source(
        "bids",
        1,
        CyclicSource::new(Arc::clone(pool), args.events, args.batch, AtEnd::Finish)
            .cooperative(args.cooperative),
    );
    let committed: Box<dyn Fn() -> Tally> = match query {
        Query::Q0 => {
            let sink = CountingSink::<Bid>::new(visibility);
            bids.sink("out", 1, sink.clone());
            Box::new(move || sink.committed())
        }
        Query::Q1 => {
            let sink = CountingSink::<Bid>::new(visibility);
            bids.map("to-euros", to_euros).sink("out", 1, sink.clone());
            Box::new(move || sink.committed())
        }
        Query::Q2 => {
            let sink = CountingSink::<(u64, u64)>::new(visibility);
            bids.filter("auction-mod-123", selected)
                .map("auction-price", auction_price)
                .sink("out", 1, sink.clone());
            Box::new(move || sink.committed())
        }
    };
    let graph = job.build().map_err(|e| format!("building the job: {e}"))?;
    let store = Arc::new(LatestStore::new());
    let config = RuntimeConfig {
        checkpoint: CheckpointConfig {
            interval,
            ..CheckpointConfig::default()
        },
        ..RuntimeConfig::default()
    };
    let runner = JobRunner::new(graph, Arc::clone(&store) as _, config);
    let (usage_before, started) = (Usage::now(), Instant::now());
    runtime
        .block_on(runner.run())
        .map_err(|e| format!("{} failed: {e}", query.name()))?;
    let elapsed = started.elapsed();
    Ok(EngineRun {
        tally: committed(),
        elapsed,
        usage: Usage::now().since(usage_before),
        checkpoints: store.persisted(),
    })
}

fn rate(records: u64, elapsed: Duration) -> f64 {
    records as f64 / elapsed.as_secs_f64().max(1e-9)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// The ratios `a[i] / b[i]` of measurements taken in the same run: median
/// (lowest-highest).
fn paired(a: &[f64], b: &[f64]) -> String {
    let ratios: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
    let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let high = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.3} ({low:.2}-{high:.2})", median(ratios))
}

fn mega(x: f64) -> String {
    format!("{:.1}", x / 1e6)
}

/// CPU time (user and system, every thread) and context switches (voluntary
/// and not, every live thread) of this process.
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    cpu: Duration,
    switches: u64,
}

impl Usage {
    fn now() -> Usage {
        // Fields 14 and 15 of /proc/self/stat, in clock ticks of 10 ms (the
        // USER_HZ of every Linux build this runs on).
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let after_name = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
        let cpu = match (ticks(11), ticks(12)) {
            (Some(user), Some(system)) => Duration::from_millis((user + system) * 10),
            _ => Duration::ZERO,
        };
        let mut switches = 0;
        if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
            for task in tasks.flatten() {
                let status =
                    std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
                switches += status
                    .lines()
                    .filter(|l| l.contains("ctxt_switches:"))
                    .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .sum::<u64>();
            }
        }
        Usage { cpu, switches }
    }

    fn since(self, before: Usage) -> Usage {
        Usage {
            cpu: self.cpu.saturating_sub(before.cpu),
            switches: self.switches.saturating_sub(before.switches),
        }
    }
}

/// `VmRSS` and `VmHWM` (peak) of this process, in KiB.
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets the peak RSS to the current RSS (Linux 4.0 and later).
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn runtime_label(threads: usize) -> String {
    match threads {
        0 => "current-thread".to_owned(),
        n => format!("multi-thread x{n}"),
    }
}

fn build_runtime(threads: usize) -> tokio::runtime::Runtime {
    let mut builder = if threads == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    builder
        .enable_time()
        .build()
        .expect("building the tokio runtime")
}

/// Everything measured for one query on one runtime.
#[derive(Debug, Default, Clone)]
struct Row {
    output: u64,
    bare: Vec<f64>,
    batched: Vec<f64>,
    off: Vec<f64>,
    every_second: Vec<f64>,
    checkpoints: Vec<u64>,
    /// CPU seconds per wall second of the engine runs with checkpoints off.
    cpu_per_wall: Vec<f64>,
    /// Per stream length, the engine's memory at that length.
    memory: Vec<(u64, Option<Peak>)>,
}

/// RSS right before an engine run and its peak during the run, in KiB.
#[derive(Debug, Clone, Copy)]
struct Peak {
    before: u64,
    peak: u64,
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(2);
        }
    };
    let outcome = if args.memory_child {
        memory_child(&args)
    } else {
        measure(&args)
    };
    if let Err(message) = outcome {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn pool_of(args: &Args) -> Arc<Vec<Bid>> {
    let started = Instant::now();
    let pool = generate_bids(args.pool);
    eprintln!(
        "generated {} bids in {:.2} s ({} MiB as rows)",
        pool.len(),
        started.elapsed().as_secs_f64(),
        (pool.len() * size_of::<Bid>()) >> 20
    );
    Arc::new(pool)
}

fn off_mode(args: &Args) -> Checkpointing {
    match args.off_interval {
        None => Checkpointing::Off,
        Some(i) => Checkpointing::Every(i),
    }
}

fn off_label(off: Checkpointing) -> String {
    match off {
        Checkpointing::Off => "off".to_owned(),
        Checkpointing::Every(i) => format!("{}s", i.as_secs()),
    }
}

const EVERY_SECOND: Checkpointing = Checkpointing::Every(Duration::from_secs(1));

fn measure(args: &Args) -> Result<(), String> {
    let off = off_mode(args);
    println!(
        "nexmark: {} events per measurement, pool of {} bids, batches of {}, {} runs, engine on {}{}",
        args.events,
        args.pool,
        args.batch,
        args.runs,
        args.threads
            .iter()
            .map(|t| runtime_label(*t))
            .collect::<Vec<_>>()
            .join(" and "),
        if args.cooperative {
            ", cooperative source"
        } else {
            ""
        }
    );
    let pool = pool_of(args);
    let runtimes: Vec<(usize, tokio::runtime::Runtime)> = args
        .threads
        .iter()
        .map(|&t| (t, build_runtime(t)))
        .collect();
    let mut rows: Vec<(Query, usize, Row)> = Vec::new();
    for &query in &args.queries {
        let mut per_runtime = vec![Row::default(); runtimes.len()];
        let (mut bare_rates, mut batched_rates, mut output) = (Vec::new(), Vec::new(), 0);
        for run in 1..=args.runs {
            let started = Instant::now();
            let expected = bare(query, &pool, args.events);
            let bare_elapsed = started.elapsed();
            let started = Instant::now();
            let in_batches = batched(query, &pool, args.events, args.batch);
            let batched_elapsed = started.elapsed();
            if in_batches != expected {
                return Err(format!(
                    "{} batched loop counted {in_batches:?}, the bare loop {expected:?}",
                    query.name()
                ));
            }
            output = expected.records;
            bare_rates.push(rate(args.events, bare_elapsed));
            batched_rates.push(rate(args.events, batched_elapsed));
            eprintln!(
                "{} run {run}/{}: bare {} M ev/s ({:.2} s), batched {} M ev/s ({:.2} s), {} records out",
                query.name(),
                args.runs,
                mega(rate(args.events, bare_elapsed)),
                bare_elapsed.as_secs_f64(),
                mega(rate(args.events, batched_elapsed)),
                batched_elapsed.as_secs_f64(),
                expected.records,
            );
            for ((threads, runtime), row) in runtimes.iter().zip(&mut per_runtime) {
                for mode in [off, EVERY_SECOND] {
                    let r = engine(runtime, query, &pool, args, mode)?;
                    let label = off_label(mode);
                    if r.tally != expected {
                        return Err(format!(
                            "{} engine ({}, ckpt {label}) committed {:?}, the bare loop {expected:?}",
                            query.name(),
                            runtime_label(*threads),
                            r.tally
                        ));
                    }
                    let events_per_second = rate(args.events, r.elapsed);
                    if mode == off {
                        row.off.push(events_per_second);
                        row.cpu_per_wall
                            .push(r.usage.cpu.as_secs_f64() / r.elapsed.as_secs_f64());
                    } else {
                        row.every_second.push(events_per_second);
                        row.checkpoints.push(r.checkpoints);
                    }
                    eprintln!(
                        "{} run {run}/{}: engine {} ckpt {label}: {} M ev/s ({:.2} s, cpu {:.2} s, \
                         {} context switches, {} checkpoints)",
                        query.name(),
                        args.runs,
                        runtime_label(*threads),
                        mega(events_per_second),
                        r.elapsed.as_secs_f64(),
                        r.usage.cpu.as_secs_f64(),
                        r.usage.switches,
                        r.checkpoints,
                    );
                }
            }
        }
        for ((threads, _), mut row) in runtimes.iter().zip(per_runtime) {
            row.output = output;
            row.bare.clone_from(&bare_rates);
            row.batched.clone_from(&batched_rates);
            rows.push((query, *threads, row));
        }
    }
    drop(runtimes);

    if args.memory {
        for &threads in &args.threads {
            for length in [args.events, args.events * 4] {
                eprintln!(
                    "memory: child process, engine on {}, {length} events per query ...",
                    runtime_label(threads)
                );
                let found = memory_in_child(args, threads, length)?;
                for (query, t, row) in &mut rows {
                    if *t == threads {
                        let m = found.iter().find(|(q, _)| q == query).map(|(_, m)| *m);
                        row.memory.push((length, m));
                    }
                }
            }
        }
    }
    print_table(args, off, &rows);
    Ok(())
}

fn print_table(args: &Args, off: Checkpointing, rows: &[(Query, usize, Row)]) {
    let off_label = off_label(off);
    println!();
    println!(
        "M ev/s: input events per second, median of {} runs of {} events; ratios: median \
         (lowest-highest) of the ratios within each run; engine: source -> \
         operators -> sink, parallelism 1, batches of {}{}; ckpt {off_label}: {}",
        args.runs,
        args.events,
        args.batch,
        if args.cooperative {
            ", cooperative source"
        } else {
            ""
        },
        match off {
            Checkpointing::Off => "interval None, non-transactional counting sink",
            Checkpointing::Every(_) => {
                "transactional sink, only the final checkpoint falls in the run"
            }
        }
    );
    let mut header = format!(
        "| query | engine runtime | records out | bare M ev/s | batched M ev/s \
         | engine ckpt {off_label} M ev/s | engine ckpt 1s M ev/s | engine {off_label} / bare \
         | engine 1s / bare | engine {off_label} / batched | 1s / {off_label} \
         | ckpts in 1s run | engine CPU / wall |"
    );
    let mut rule = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|".to_owned();
    let lengths: Vec<u64> = rows
        .first()
        .map(|(_, _, r)| r.memory.iter().map(|(l, _)| *l).collect())
        .unwrap_or_default();
    for l in &lengths {
        header.push_str(&format!(" peak RSS MiB, {} M ev |", l / 1_000_000));
        rule.push_str("---:|");
    }
    println!("{header}");
    println!("{rule}");
    for (query, threads, row) in rows {
        let (bare, batched, o, s) = (
            median(row.bare.clone()),
            median(row.batched.clone()),
            median(row.off.clone()),
            median(row.every_second.clone()),
        );
        let checkpoints = (
            row.checkpoints.iter().min().copied().unwrap_or(0),
            row.checkpoints.iter().max().copied().unwrap_or(0),
        );
        let mut line = format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} |",
            query.name(),
            runtime_label(*threads),
            row.output,
            mega(bare),
            mega(batched),
            mega(o),
            mega(s),
            paired(&row.off, &row.bare),
            paired(&row.every_second, &row.bare),
            paired(&row.off, &row.batched),
            paired(&row.every_second, &row.off),
            if checkpoints.0 == checkpoints.1 {
                checkpoints.0.to_string()
            } else {
                format!("{}-{}", checkpoints.0, checkpoints.1)
            },
            median(row.cpu_per_wall.clone()),
        );
        for (_, m) in &row.memory {
            match m {
                Some(Peak { before, peak }) => line.push_str(&format!(
                    " {:.1} (+{:.1}) |",
                    *peak as f64 / 1024.0,
                    peak.saturating_sub(*before) as f64 / 1024.0
                )),
                None => line.push_str(" ? |"),
            }
        }
        println!("{line}");
    }
    if !lengths.is_empty() {
        println!(
            "peak RSS: VmHWM of a child process (same pool, regenerated) over an engine run with \
             ckpt 1s, peak reset right before the run; (+x): above the RSS right before the run"
        );
    }
}

/// Runs this binary as a child that measures the engine's peak memory at
/// `length` on runtime `threads`; returns its figures per query.
fn memory_in_child(args: &Args, threads: usize, length: u64) -> Result<Vec<(Query, Peak)>, String> {
    let exe = std::env::current_exe().map_err(|e| format!("locating this binary: {e}"))?;
    let queries = match args.queries.as_slice() {
        [one] => one.name(),
        _ => "all",
    };
    let output = Command::new(exe)
        .args(["--memory-child", "--query", queries])
        .args(["--events", &length.to_string()])
        .args(["--pool", &args.pool.to_string()])
        .args(["--batch", &args.batch.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(args.cooperative.then_some("--cooperative-source"))
        .output()
        .map_err(|e| format!("running the memory child: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "memory child failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if let ["memory", q, before, peak, reset] = fields.as_slice() {
            let query = [Query::Q0, Query::Q1, Query::Q2]
                .into_iter()
                .find(|x| x.name() == *q)
                .ok_or_else(|| format!("the memory child named query {q:?}"))?;
            let kib = |s: &str| {
                s.parse::<u64>()
                    .map_err(|e| format!("the memory child: {e}"))
            };
            eprintln!(
                "memory {q}, {}, {length} events: RSS {before} KiB before the run, peak {peak} KiB \
                 (peak reset: {reset})",
                runtime_label(threads)
            );
            found.push((
                query,
                Peak {
                    before: kib(before)?,
                    peak: kib(peak)?,
                },
            ));
        }
    }
    Ok(found)
}

/// The child side: per query, one engine run with checkpoints every second,
/// printing `memory <query> <RSS before, KiB> <peak, KiB> <peak was reset>`.
fn memory_child(args: &Args) -> Result<(), String> {
    let pool = pool_of(args);
    let threads = args.threads.first().copied().unwrap_or(0);
    let runtime = build_runtime(threads);
    for &query in &args.queries {
        let reset = reset_peak();
        let (before, _) = rss_kib();
        let run = engine(&runtime, query, &pool, args, EVERY_SECOND)?;
        let (_, peak) = rss_kib();
        eprintln!(
            "memory child {}: {} records out in {:.2} s, {} checkpoints",
            query.name(),
            run.tally.records,
            run.elapsed.as_secs_f64(),
            run.checkpoints
        );
        println!("memory {} {before} {peak} {reset}", query.name());
    }
    Ok(())
}
