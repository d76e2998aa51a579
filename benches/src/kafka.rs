//! A real broker pre-loaded with Nexmark bids as JSON, for the benchmark
//! binaries that read Kafka (`kafka_source`, and the pipeline bench).

#![allow(
    clippy::print_stderr,
    reason = "loading millions of records takes a while; the bench binaries print its progress"
)]

use std::time::{Duration, Instant};

use nexmark::EventGenerator;
use nexmark::config::NexmarkConfig;
use nexmark::event::{Event, EventType};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use serde::{Deserialize, Serialize};

/// A Nexmark bid as the JSON value of a Kafka record (~250 bytes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BidJson {
    /// Auction id.
    pub auction: u64,
    /// Bidder id.
    pub bidder: u64,
    /// Price in cents.
    pub price: u64,
    /// Channel.
    pub channel: String,
    /// URL.
    pub url: String,
    /// Event time, ms since the epoch.
    pub date_time: i64,
    /// Padding, as Nexmark generates it.
    pub extra: String,
}

/// The first `n` Nexmark bids (fixed seed and start time).
pub fn bids(n: usize) -> impl Iterator<Item = BidJson> {
    let config = NexmarkConfig {
        base_time: 1_767_225_600_000,
        first_event_id: 0,
        first_event_number: 0,
        ..NexmarkConfig::default()
    };
    EventGenerator::new(config)
        .with_type_filter(EventType::Bid)
        .take(n)
        .map(|e| match e {
            Event::Bid(b) => BidJson {
                auction: b.auction as u64,
                bidder: b.bidder as u64,
                price: b.price as u64,
                channel: b.channel,
                url: b.url,
                date_time: b.date_time as i64,
                extra: b.extra,
            },
            other => panic!("the bid filter let through {:?}", other.event_type()),
        })
}

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
    let name = format!("tinyflow-bench-bids-{n}-p{partitions}");
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
    let values = bids(n as usize).enumerate().map(|(i, bid)| {
        if (i as u64 + 1).is_multiple_of(step) {
            eprintln!(
                "topic {name}: {} of {n} bids produced ({:.0} s)",
                i + 1,
                started.elapsed().as_secs_f64()
            );
        }
        let value = serde_json::to_vec(&bid).expect("a bid serialises");
        ((i as u64 % partitions as u64) as i32, value)
    });
    let settings = [("linger.ms", "20"), ("batch.size", "1000000")];
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
