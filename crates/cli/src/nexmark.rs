//! Nexmark bids as JSON record values, numbered: the demo's input, the
//! chaos test's and the benchmarks'.

use nexmark::EventGenerator;
use nexmark::config::NexmarkConfig;
use nexmark::event::{Event, EventType};
use serde::{Deserialize, Serialize};

/// A Nexmark bid as the JSON value of a Kafka record (~260 bytes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BidJson {
    /// The bid's sequence number (unique): what exactly-once checks count.
    pub id: u64,
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

/// Bids numbered from 0 (fixed seed and start time, so a run is
/// repeatable), without end.
pub fn bids() -> impl Iterator<Item = BidJson> {
    let config = NexmarkConfig {
        base_time: 1_767_225_600_000,
        first_event_id: 0,
        first_event_number: 0,
        ..NexmarkConfig::default()
    };
    EventGenerator::new(config)
        .with_type_filter(EventType::Bid)
        .zip(0u64..)
        .filter_map(|(e, id)| match e {
            Event::Bid(b) => Some(BidJson {
                id,
                auction: b.auction as u64,
                bidder: b.bidder as u64,
                price: b.price as u64,
                channel: b.channel,
                url: b.url,
                date_time: b.date_time as i64,
                extra: b.extra,
            }),
            // The type filter lets bids through only.
            _ => None,
        })
}

/// The job-file fields of a [`BidJson`], in order (`id`, `auction`, ...).
pub const BID_FIELDS: [(&str, &str); 8] = [
    ("id", "long"),
    ("auction", "long"),
    ("bidder", "long"),
    ("price", "long"),
    ("channel", "string"),
    ("url", "string"),
    ("date_time", "long"),
    ("extra", "string"),
];
