//! A real broker pre-loaded with Nexmark bids as JSON, for the benchmark
//! binaries that read Kafka (`kafka_source`, and the pipeline bench).

#![allow(
    clippy::print_stderr,
    reason = "loading millions of records takes a while; the bench binaries print its progress"
)]

use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

pub use tinyflow_cli::nexmark::BidJson;

/// What [`ensure_bids_topic`] found or wrote.
#[derive(Debug, Clone)]
pub struct BidsTopic {
    /// Topic name.
    pub name: String,
    /// Records in it.
    pub records: u64,
    /// Partitions.
    pub partitions: i32,
}

/// The broker address: `KAFKA_BOOTSTRAP`.
///
/// # Panics
/// When unset, saying how to start a broker.
pub fn bootstrap() -> String {
    std::env::var("KAFKA_BOOTSTRAP").unwrap_or_else(|_| {
        panic!(
            "KAFKA_BOOTSTRAP is not set: start a broker with `cargo xtask kafka start` and export the line it prints"
        )
    })
}

fn records_in(consumer: &BaseConsumer, topic: &str, partitions: i32) -> Result<u64, String> {
    let mut total = 0;
    for p in 0..partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        total += (high - low) as u64;
    }
    Ok(total)
}

/// A topic holding exactly the first `n` bids as JSON over `partitions`
/// (round-robin), reused when a previous run left it complete; progress is
/// printed while producing.
pub fn ensure_bids_topic(bootstrap: &str, n: u64, partitions: i32) -> Result<BidsTopic, String> {
    ensure_bids_topic_compressed(bootstrap, n, partitions, None)
}

/// As [`ensure_bids_topic`], produced with `compression.type = codec`
/// (a topic of its own per codec).
pub fn ensure_bids_topic_compressed(
    bootstrap: &str,
    n: u64,
    partitions: i32,
    codec: Option<&str>,
) -> Result<BidsTopic, String> {
    ensure_bids_topic_as(bootstrap, n, partitions, codec, None)
}

/// As [`ensure_bids_topic_compressed`], the values Avro in the Confluent
/// wire format with writer schema id `avro_schema_id` when given (a topic
/// of its own per id).
pub fn ensure_bids_topic_as(
    bootstrap: &str,
    n: u64,
    partitions: i32,
    codec: Option<&str>,
    avro_schema_id: Option<u32>,
) -> Result<BidsTopic, String> {
    // `v2`: bids carry a sequence number `id` (topics of earlier versions did not).
    let mut name = match codec {
        Some(c) => format!("tinyflow-bench-bids-v2-{n}-p{partitions}-{c}"),
        None => format!("tinyflow-bench-bids-v2-{n}-p{partitions}"),
    };
    if let Some(id) = avro_schema_id {
        name.push_str(&format!("-avro{id}"));
    }
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .map_err(|e| e.to_string())?;
    let md = consumer
        .fetch_metadata(Some(&name), Duration::from_secs(10))
        .map_err(|e| format!("broker at {bootstrap}: {e}"))?;
    let exists = md.topics().iter().any(|t| {
        t.name() == name && t.error().is_none() && t.partitions().len() == partitions as usize
    });
    if exists && records_in(&consumer, &name, partitions)? == n {
        eprintln!("topic {name}: {n} bids already there");
        return Ok(BidsTopic {
            name,
            records: n,
            partitions,
        });
    }
    if exists {
        return Err(format!(
            "topic {name} exists with a different number of records; delete it (or the broker's data dir) and run again"
        ));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(tinyflow_connectors_kafka::testing::create_topic(
        bootstrap, &name, partitions,
    ))?;
    let started = Instant::now();
    let step = (n / 10).max(1);
    let values = tinyflow_cli::nexmark::bids()
        .take(n as usize)
        .enumerate()
        .map(|(i, bid)| {
            if (i as u64 + 1).is_multiple_of(step) {
                eprintln!(
                    "topic {name}: {} of {n} bids produced ({:.0} s)",
                    i + 1,
                    started.elapsed().as_secs_f64()
                );
            }
            let value = match avro_schema_id {
                Some(id) => bid.to_avro(id),
                None => serde_json::to_vec(&bid).expect("a bid serialises"),
            };
            ((i as u64 % partitions as u64) as i32, value)
        });
    let mut settings = vec![("linger.ms", "20"), ("batch.size", "1000000")];
    if let Some(c) = codec {
        settings.push(("compression.type", c));
    }
    tinyflow_connectors_kafka::testing::produce_stream(bootstrap, &name, &settings, values)?;
    let found = records_in(&consumer, &name, partitions)?;
    if found != n {
        return Err(format!(
            "topic {name} holds {found} records after producing {n}"
        ));
    }
    Ok(BidsTopic {
        name,
        records: n,
        partitions,
    })
}

/// Resets the peak RSS of this process (Linux: `clear_refs` 5).
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak RSS in MB since the last reset.
pub fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Machine-wide CPU use from [`CpuMeter::start`] on: every process's, the
/// broker's and the Python interpreter's included, so the bench can show how
/// much of the machine a variant kept busy and what one event costs it.
#[derive(Debug, Clone, Copy)]
pub struct CpuMeter {
    busy_ticks: u64,
    started: Instant,
}

/// What [`CpuMeter::stop`] measured.
#[derive(Debug, Clone, Copy)]
pub struct CpuUse {
    /// CPU seconds spent by every process, summed over the cores.
    pub core_secs: f64,
    /// `core_secs` per second of wall time: how many cores were busy on average.
    pub busy_cores: f64,
}

impl CpuMeter {
    /// Starts measuring.
    #[must_use]
    pub fn start() -> Self {
        Self {
            busy_ticks: busy_ticks(),
            started: Instant::now(),
        }
    }

    /// What was used since [`start`](Self::start).
    #[must_use]
    pub fn stop(&self) -> CpuUse {
        // USER_HZ: /proc/stat counts in hundredths of a second on every Linux
        // architecture this bench builds for.
        let core_secs = busy_ticks().saturating_sub(self.busy_ticks) as f64 / 100.0;
        CpuUse {
            core_secs,
            busy_cores: core_secs / self.started.elapsed().as_secs_f64(),
        }
    }
}

/// Busy ticks of all cores together (user, nice, system, irq, softirq,
/// steal) from the `cpu` line of `/proc/stat`; 0 where that cannot be read.
fn busy_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return 0;
    };
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|t| t.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is in user).
    [0, 1, 2, 5, 6, 7]
        .iter()
        .filter_map(|&i| ticks.get(i))
        .sum()
}

/// What a bare consume loop did.
#[derive(Debug, Clone, Copy)]
pub struct BareRun {
    /// Records read.
    pub records: u64,
    /// Value bytes read.
    pub value_bytes: u64,
    /// From the first record to the last.
    pub secs: f64,
    /// Peak RSS during the run.
    pub rss_mb: f64,
}

/// The raw limit: a bare `BaseConsumer` poll loop over every partition of
/// `topic` from the beginning, touching each payload, with `settings`.
///
/// # Panics
/// On a consumer error: a benchmark has no use for a partial figure.
pub fn bare_consume(topic: &BidsTopic, settings: &[(&str, &str)]) -> BareRun {
    reset_peak_rss();
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", bootstrap())
        .set("group.id", "bench-bare")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false");
    for (k, v) in settings {
        cc.set(*k, *v);
    }
    let consumer: BaseConsumer = cc.create().expect("a bare consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..topic.partitions {
        tpl.add_partition_offset(&topic.name, p, Offset::Beginning)
            .expect("a partition to assign");
    }
    consumer.assign(&tpl).expect("assigning the partitions");
    let mut n = 0u64;
    let mut bytes = 0u64;
    let mut first = None;
    while n < topic.records {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                first.get_or_insert_with(Instant::now);
                bytes += m.payload().map_or(0, <[u8]>::len) as u64;
                n += 1;
            }
            Some(Err(e)) => panic!("bare consumer: {e}"),
            None => {}
        }
    }
    assert!(bytes > 0, "the bare consumer read empty values");
    BareRun {
        records: n,
        value_bytes: bytes,
        secs: first.map_or(0.0, |f| f.elapsed().as_secs_f64()),
        rss_mb: peak_rss_mb(),
    }
}
