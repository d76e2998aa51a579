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

/// The Avro schema of a [`BidJson`]: the same fields, in order, `long` and
/// `string`.
pub const BID_AVRO_SCHEMA: &str = r#"{"type":"record","name":"Bid","namespace":"nexmark","fields":[{"name":"id","type":"long"},{"name":"auction","type":"long"},{"name":"bidder","type":"long"},{"name":"price","type":"long"},{"name":"channel","type":"string"},{"name":"url","type":"string"},{"name":"date_time","type":"long"},{"name":"extra","type":"string"}]}"#;

impl BidJson {
    /// The bid as a Kafka record value in the Confluent wire format: a zero
    /// byte, `schema_id` (the id of [`BID_AVRO_SCHEMA`] in the registry),
    /// then the Avro binary datum, byte for byte what Confluent's Avro
    /// serializer writes.
    pub fn to_avro(&self, schema_id: u32) -> Vec<u8> {
        fn long(v: i64, out: &mut Vec<u8>) {
            let mut z = ((v << 1) ^ (v >> 63)) as u64;
            while z >= 0x80 {
                out.push((z as u8) | 0x80);
                z >>= 7;
            }
            out.push(z as u8);
        }
        fn string(s: &str, out: &mut Vec<u8>) {
            long(s.len() as i64, out);
            out.extend_from_slice(s.as_bytes());
        }
        let mut out = Vec::with_capacity(5 + 40 + self.url.len() + self.extra.len());
        out.push(0);
        out.extend_from_slice(&schema_id.to_be_bytes());
        long(self.id as i64, &mut out);
        long(self.auction as i64, &mut out);
        long(self.bidder as i64, &mut out);
        long(self.price as i64, &mut out);
        string(&self.channel, &mut out);
        string(&self.url, &mut out);
        long(self.date_time, &mut out);
        string(&self.extra, &mut out);
        out
    }
}
