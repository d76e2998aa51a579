//! The Kafka source against a bare rdkafka consumer loop, on a real broker
//! pre-loaded with Nexmark bids as JSON (~250 bytes each):
//!
//! 1. a bare `BaseConsumer` poll loop over every partition, touching each
//!    payload (the raw limit);
//! 2. the source (one subtask, `Format::bytes`), its batches pulled
//!    directly, bounded at the end offsets;
//! 3. the same source decoding JSON into a serde struct;
//! 4. the Arrow source decoding JSON into record batches (arrow-json);
//!
//! each timed from the first record to the last, with the peak RSS of the
//! process during the run (VmHWM, reset before each). Every variant gets the
//! source's default client settings (`DEFAULT_CLIENT_SETTINGS`) plus
//! `--props k=v,...`; `--compare-settings` runs the bare loop and the bytes
//! source under candidate settings instead. `--only N` runs variant N alone.
//!
//! `cargo xtask kafka start`, export the line it prints, then
//! `cargo run --release -p tinyflow-benches --bin kafka_source -- [--records N]
//! [--partitions N] [--repeat N] [--props k=v,...] [--compare-settings] [--only N]`.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark binary: prints its figures, and any failure ends it"
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use arrow_schema::{DataType, Field, Schema};
use tinyflow_api::{OperatorContext, SourceFactory};
use tinyflow_benches::kafka::{
    BidJson, BidsTopic, bare_consume, bootstrap, ensure_bids_topic, peak_rss_mb, reset_peak_rss,
};
use tinyflow_connectors_kafka::{
    DEFAULT_CLIENT_SETTINGS, Format, JsonArrow, KafkaArrowSource, KafkaSource, KafkaSourceConfig,
};

struct Args {
    records: u64,
    partitions: i32,
    repeat: usize,
    compare_settings: bool,
    /// Run only this variant (1-4).
    only: Option<u64>,
    /// Client settings for every variant, on top of the source's defaults.
    props: BTreeMap<String, String>,
}

fn parse_args() -> Args {
    let mut args = Args {
        records: 5_000_000,
        partitions: 4,
        repeat: 3,
        compare_settings: false,
        only: None,
        props: BTreeMap::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--compare-settings" {
            args.compare_settings = true;
            continue;
        }
        if flag == "--props" {
            let list = it.next().expect("--props needs k=v,k=v");
            for kv in list.split(',') {
                let (k, v) = kv.split_once('=').expect("--props needs k=v,k=v");
                args.props.insert(k.to_owned(), v.to_owned());
            }
            continue;
        }
        let value: u64 = it
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{flag} needs a number"));
        match flag.as_str() {
            "--records" => args.records = value,
            "--partitions" => args.partitions = value as i32,
            "--repeat" => args.repeat = value as usize,
            "--only" => args.only = Some(value),
            other => panic!("unknown option {other}; see the file's header"),
        }
    }
    args
}

struct Run {
    records: u64,
    /// Value bytes read (counted by the bare loop only).
    value_bytes: u64,
    secs: f64,
    rss_mb: f64,
}

impl Run {
    fn rate(&self) -> f64 {
        self.records as f64 / self.secs
    }
}

fn bare(topic: &BidsTopic, props: &BTreeMap<String, String>) -> Run {
    // The same client settings as the source's consumer.
    let mut settings: Vec<(&str, &str)> = DEFAULT_CLIENT_SETTINGS.to_vec();
    settings.extend(props.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let r = bare_consume(topic, &settings);
    Run {
        records: r.records,
        value_bytes: r.value_bytes,
        secs: r.secs,
        rss_mb: r.rss_mb,
    }
}

fn config(topic: &BidsTopic, props: &BTreeMap<String, String>) -> KafkaSourceConfig {
    let mut c = KafkaSourceConfig::new(bootstrap(), &[&topic.name], "bench-source");
    c.bounded = true;
    c.commit_offsets = false;
    c.properties.extend(props.clone());
    c
}

/// Pulls every batch of `factory`'s one subtask; `rows` counts a batch.
fn drain<T: tinyflow_api::Data>(
    rt: &tokio::runtime::Runtime,
    factory: &dyn SourceFactory<T>,
    rows: impl Fn(&[T]) -> u64,
) -> Run {
    reset_peak_rss();
    let ctx = OperatorContext {
        name: "bench".into(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 128,
    };
    rt.block_on(async {
        let mut source = factory.create(&ctx, &[]).unwrap();
        let mut n = 0u64;
        let mut first = None;
        let mut empty = 0u64;
        let mut batches = 0u64;
        while let Some(batch) = source.next_batch().await.unwrap() {
            batches += 1;
            if batch.is_empty() && first.is_some() {
                empty += 1;
            }
            if !batch.is_empty() {
                first.get_or_insert_with(Instant::now);
                n += rows(&batch);
            }
        }
        report_empty(batches, empty);
        Run {
            records: n,
            value_bytes: 0,
            secs: first.unwrap().elapsed().as_secs_f64(),
            rss_mb: peak_rss_mb(),
        }
    })
}

/// How often the source came back empty-handed after the first record.
fn report_empty(batches: u64, empty: u64) {
    eprintln!("  {batches} batches, {empty} of them empty after the first record");
}

fn bid_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("auction", DataType::Int64, false),
        Field::new("bidder", DataType::Int64, false),
        Field::new("price", DataType::Int64, false),
        Field::new("channel", DataType::Utf8, false),
        Field::new("url", DataType::Utf8, false),
        Field::new("date_time", DataType::Int64, false),
        Field::new("extra", DataType::Utf8, false),
    ]))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn line(label: &str, runs: &[Run], base: Option<f64>) -> f64 {
    let rate = median(runs.iter().map(Run::rate).collect());
    let rss = runs.iter().map(|r| r.rss_mb).fold(0.0, f64::max);
    let each: Vec<String> = runs
        .iter()
        .map(|r| format!("{:.2}", r.rate() / 1e6))
        .collect();
    let ratio = base.map_or(String::new(), |b| format!("  ratio {:.2}", rate / b));
    println!(
        "{label:<34} {:>6.3} M rec/s (runs {}), peak RSS {rss:>5.0} MB{ratio}",
        rate / 1e6,
        each.join(" ")
    );
    rate
}

fn main() {
    let args = parse_args();
    let topic = ensure_bids_topic(&bootstrap(), args.records, args.partitions).unwrap();
    println!(
        "topic {}: {} bids, {} partitions",
        topic.name, topic.records, topic.partitions
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut settings: Vec<(&str, BTreeMap<String, String>)> =
        vec![("source defaults and --props", args.props.clone())];
    if args.compare_settings {
        let props = |list: &[(&str, &str)]| -> BTreeMap<String, String> {
            list.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        settings.push((
            "librdkafka's fetch backoff (1 s)",
            props(&[("fetch.queue.backoff.ms", "1000")]),
        ));
        settings.push((
            "smaller queue (16 MB)",
            props(&[("queued.max.messages.kbytes", "16384")]),
        ));
        settings.push((
            "large fetches and queues",
            props(&[
                ("queued.max.messages.kbytes", "262144"),
                ("fetch.max.bytes", "104857600"),
                ("max.partition.fetch.bytes", "8388608"),
                ("queued.min.messages", "1000000"),
            ]),
        ));
    }
    for (label, props) in &settings {
        println!("\n== {label}: {props:?}");
        let want = |k: u64| args.only.is_none_or(|o| o == k) && (k <= 2 || !args.compare_settings);
        let mut runs: [Vec<Run>; 4] = Default::default();
        for round in 0..args.repeat {
            eprintln!("round {} of {}", round + 1, args.repeat);
            if want(1) {
                runs[0].push(bare(&topic, props));
            }
            if want(2) {
                let bytes = KafkaSource::new(config(&topic, props), Format::bytes());
                runs[1].push(drain(&rt, &bytes, |b| b.len() as u64));
            }
            if want(3) {
                let json = KafkaSource::new(config(&topic, props), Format::<BidJson>::json());
                runs[2].push(drain(&rt, &json, |b| b.len() as u64));
            }
            if want(4) {
                let arrow =
                    KafkaArrowSource::new(config(&topic, props), JsonArrow::new(bid_schema()));
                runs[3].push(drain(&rt, &arrow, |b| {
                    b.iter().map(|b| b.num_rows() as u64).sum()
                }));
            }
        }
        for r in runs.iter().flatten() {
            assert_eq!(r.records, topic.records, "a run lost or repeated records");
        }
        let labels = [
            "1. bare rdkafka consumer loop",
            "2. source, bytes",
            "3. source, JSON -> serde struct",
            "4. source, JSON -> Arrow batches",
        ];
        if let Some(bare) = runs[0].first() {
            println!(
                "{:.0} bytes per value on average (counted by the bare loop)",
                bare.value_bytes as f64 / bare.records as f64
            );
        }
        let mut base = None;
        for (label, runs) in labels.iter().zip(&runs) {
            if !runs.is_empty() {
                let rate = line(label, runs, base);
                base = base.or(Some(rate));
            }
        }
    }
}
