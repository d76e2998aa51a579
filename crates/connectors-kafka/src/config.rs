//! Configuration of the Kafka source.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

/// Where a partition without checkpointed position starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartPosition {
    /// The oldest retained record.
    Earliest,
    /// After the newest record at start.
    Latest,
    /// The consumer group's committed offset (earliest where there is none).
    Committed,
    /// The first record at or after this time (ms since the Unix epoch).
    Timestamp(i64),
    /// Explicit offsets per (topic, partition); others start at the earliest.
    Offsets(BTreeMap<(String, i32), i64>),
}

/// What to do with a record that does not decode. Every bad record is
/// counted in `tinyflow_bad_records_total`; the good records around it are
/// read as usual.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadRecordPolicy {
    /// Fail the job with the record's topic, partition, offset and reason.
    Fail,
    /// Skip it.
    Skip,
    /// Produce it (key, value and headers unchanged) to this topic, with
    /// the reason and origin in headers `tinyflow.error`, `tinyflow.group`,
    /// `tinyflow.source.topic`, `tinyflow.source.partition`,
    /// `tinyflow.source.offset` and `tinyflow.source.timestamp`, exactly
    /// once: the dead letters are written in a transaction that commits
    /// before every checkpoint's positions are taken, and a restored source
    /// reads the topic back and does not send a bad record whose dead
    /// letter is there already. A bad record larger than the topic takes
    /// is sent with its value truncated and headers `tinyflow.truncated`
    /// and `tinyflow.original.bytes`.
    DeadLetter {
        /// The dead-letter topic (on the same cluster, same client settings).
        topic: String,
    },
}

type DecodeFn<V> = Arc<dyn Fn(&[u8]) -> Result<V, String> + Send + Sync>;

/// How record values are decoded.
pub struct Format<V> {
    pub(crate) name: &'static str,
    pub(crate) decode: DecodeFn<V>,
}

impl<V> Clone for Format<V> {
    fn clone(&self) -> Self {
        Format {
            name: self.name,
            decode: Arc::clone(&self.decode),
        }
    }
}

impl<V> fmt::Debug for Format<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Format({})", self.name)
    }
}

impl Format<Vec<u8>> {
    /// The value's bytes as they are.
    pub fn bytes() -> Self {
        Format {
            name: "bytes",
            decode: Arc::new(|b| Ok(b.to_vec())),
        }
    }
}

impl Format<String> {
    /// The value as UTF-8 text.
    pub fn utf8() -> Self {
        Format {
            name: "utf8",
            decode: Arc::new(|b| {
                String::from_utf8(b.to_vec()).map_err(|e| format!("not UTF-8: {e}"))
            }),
        }
    }
}

impl<V: DeserializeOwned + 'static> Format<V> {
    /// The value as JSON, into `V`.
    pub fn json() -> Self {
        let _ = PhantomData::<V>;
        Format {
            name: "json",
            decode: Arc::new(|b| {
                serde_json::from_slice(b).map_err(|e| format!("invalid JSON: {e}"))
            }),
        }
    }
}

type TimeFn<V> = Arc<dyn Fn(&V) -> Option<i64> + Send + Sync>;

/// Where event time is read.
pub(crate) enum TimeFrom<V> {
    /// The record's Kafka timestamp.
    Record,
    /// A function of the decoded value.
    Field(TimeFn<V>),
    /// A column of decoded Arrow batches (integer ms or a timestamp).
    #[cfg_attr(not(feature = "arrow"), allow(dead_code))]
    Column(String),
}

impl<V> Clone for TimeFrom<V> {
    fn clone(&self) -> Self {
        match self {
            TimeFrom::Record => TimeFrom::Record,
            TimeFrom::Field(f) => TimeFrom::Field(Arc::clone(f)),
            TimeFrom::Column(c) => TimeFrom::Column(c.clone()),
        }
    }
}

/// Where a record's event time comes from, and how watermarks follow it.
///
/// Each partition's watermark trails the highest event time read from it by
/// `max_out_of_orderness`; the source's watermark is the minimum over its
/// partitions, leaving out those that had no record for `idle_timeout` (so
/// one quiet partition does not stall event time) and those a bounded read
/// finished. A subtask whose partitions are all idle tells the operators
/// downstream it is idle. Records without an event time (no broker
/// timestamp, or the field function returns `None`) pass through without
/// moving the watermark.
pub struct EventTime<V> {
    pub(crate) from: TimeFrom<V>,
    pub(crate) max_out_of_orderness: i64,
    pub(crate) idle_timeout: Option<Duration>,
}

impl<V> Clone for EventTime<V> {
    fn clone(&self) -> Self {
        EventTime {
            from: self.from.clone(),
            max_out_of_orderness: self.max_out_of_orderness,
            idle_timeout: self.idle_timeout,
        }
    }
}

impl<V> fmt::Debug for EventTime<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventTime")
            .field(
                "from",
                &match &self.from {
                    TimeFrom::Record => "record timestamp".to_owned(),
                    TimeFrom::Field(_) => "field".to_owned(),
                    TimeFrom::Column(c) => format!("column {c:?}"),
                },
            )
            .field("max_out_of_orderness_ms", &self.max_out_of_orderness)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

impl<V> EventTime<V> {
    /// The default idle timeout.
    pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

    /// Event time is the record's Kafka timestamp (ms since the epoch).
    pub fn record_timestamp() -> Self {
        EventTime {
            from: TimeFrom::Record,
            max_out_of_orderness: 0,
            idle_timeout: Some(Self::DEFAULT_IDLE_TIMEOUT),
        }
    }

    /// Event time is read from the decoded value (ms since the epoch).
    pub fn field(from: impl Fn(&V) -> Option<i64> + Send + Sync + 'static) -> Self {
        EventTime {
            from: TimeFrom::Field(Arc::new(from)),
            ..Self::record_timestamp()
        }
    }

    /// How far behind the highest event time of a partition its records may
    /// arrive without being late (default 0).
    pub fn max_out_of_orderness(mut self, bound: Duration) -> Self {
        self.max_out_of_orderness = i64::try_from(bound.as_millis()).unwrap_or(i64::MAX);
        self
    }

    /// A partition with no record for this long stops holding the watermark
    /// back (default 10 s; `None`: never).
    pub fn idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout;
        self
    }
}

/// How a [`KafkaSource`](crate::KafkaSource) connects and reads.
#[derive(Clone)]
pub struct KafkaSourceConfig {
    /// `host:port,...`
    pub bootstrap_servers: String,
    /// The topics to read (all their partitions).
    pub topics: Vec<String>,
    /// Consumer group, for committing offsets (monitoring only).
    pub group_id: String,
    /// Where partitions without a checkpointed position start.
    pub start: StartPosition,
    /// Read up to the end offsets seen at start, then end (a bounded job).
    pub bounded: bool,
    /// Commit positions to the consumer group after each completed
    /// checkpoint (for lag monitoring; never used for recovery).
    pub commit_offsets: bool,
    /// What to do with records that do not decode.
    pub bad_records: BadRecordPolicy,
    /// Records per batch at most.
    pub batch_size: usize,
    /// Timeout for metadata and offset look-ups.
    pub request_timeout: Duration,
    /// librdkafka settings passed through (SASL, SSL, fetch sizes). Values of
    /// keys that look secret never appear in `Debug` output or logs.
    pub properties: BTreeMap<String, String>,
}

impl KafkaSourceConfig {
    /// Reads `topics` from `bootstrap_servers` from the earliest offsets,
    /// unbounded, committing offsets to `group_id` after checkpoints.
    pub fn new(
        bootstrap_servers: impl Into<String>,
        topics: &[&str],
        group_id: impl Into<String>,
    ) -> Self {
        KafkaSourceConfig {
            bootstrap_servers: bootstrap_servers.into(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            group_id: group_id.into(),
            start: StartPosition::Earliest,
            bounded: false,
            commit_offsets: true,
            bad_records: BadRecordPolicy::Fail,
            batch_size: 1024,
            request_timeout: Duration::from_secs(10),
            properties: BTreeMap::new(),
        }
    }
}

/// librdkafka settings the source's consumer gets unless
/// [`KafkaSourceConfig::properties`] sets them, chosen by measurement (the
/// `kafka_source` bench binary, see `docs/kafka.md`): with the default
/// `fetch.queue.backoff.ms` (1 s) a consumer that drains its queue in
/// batches waits for fetches a third of the time (0.24 M rec/s against
/// 0.99 M rec/s with 10 ms, on a local broker). librdkafka's default
/// pre-fetch queue of 64 MiB per consumer made the pipeline bench's job
/// (4 source subtasks) peak at 498 MB RSS; with 8 MiB it peaked at 197 MB
/// and ran no slower (0.278 against 0.228 M events/s, one run each).
pub const DEFAULT_CLIENT_SETTINGS: &[(&str, &str)] = &[
    ("fetch.queue.backoff.ms", "10"),
    ("queued.max.messages.kbytes", "8192"),
];

/// Whether a librdkafka property holds a secret.
pub(crate) fn is_secret(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "jaas",
        "ssl.key",
        "token",
        "credential",
    ]
    .iter()
    .any(|s| k.contains(s))
}

impl fmt::Debug for KafkaSourceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let props: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| (k.as_str(), if is_secret(k) { "***" } else { v.as_str() }))
            .collect();
        f.debug_struct("KafkaSourceConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("topics", &self.topics)
            .field("group_id", &self.group_id)
            .field("start", &self.start)
            .field("bounded", &self.bounded)
            .field("commit_offsets", &self.commit_offsets)
            .field("bad_records", &self.bad_records)
            .field("batch_size", &self.batch_size)
            .field("properties", &props)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_show_in_debug() {
        let mut c = KafkaSourceConfig::new("b:9092", &["t"], "g");
        c.properties
            .insert("sasl.password".into(), "hunter2".into());
        c.properties
            .insert("sasl.jaas.config".into(), "user=me password=hunter2".into());
        c.properties
            .insert("fetch.max.bytes".into(), "1048576".into());
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(
            shown.contains("1048576") && shown.contains("***"),
            "{shown}"
        );
    }

    #[test]
    fn formats_decode_or_say_why_not() {
        assert_eq!((Format::bytes().decode)(b"\xff").unwrap(), vec![0xff]);
        assert!(
            (Format::utf8().decode)(b"\xff")
                .unwrap_err()
                .contains("not UTF-8")
        );
        let json = Format::<BTreeMap<String, u32>>::json();
        assert_eq!((json.decode)(br#"{"a":1}"#).unwrap()["a"], 1);
        assert!((json.decode)(b"{").unwrap_err().contains("invalid JSON"));
    }
}
