//! Configuration of the Kafka source.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use tinyflow_api::{StreamError, StreamResult, Worker};

use crate::bad_record::{BadReason, BadRecord};
use crate::scan::{Limits, check_structure};

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

type DecodeFn<V> = Arc<dyn Fn(&[u8], &Limits) -> Result<V, BadRecord> + Send + Sync>;

/// How record values are decoded. Whatever the format, a value larger than
/// [`KafkaSourceConfig::max_record_bytes`] is a bad record (`too_large`).
pub struct Format<V> {
    pub(crate) name: &'static str,
    decode: DecodeFn<V>,
    limits: Limits,
}

impl<V> Clone for Format<V> {
    fn clone(&self) -> Self {
        Format {
            name: self.name,
            decode: Arc::clone(&self.decode),
            limits: self.limits,
        }
    }
}

impl<V> Format<V> {
    fn new(
        name: &'static str,
        decode: impl Fn(&[u8], &Limits) -> Result<V, BadRecord> + Send + Sync + 'static,
    ) -> Self {
        Format {
            name,
            decode: Arc::new(decode),
            limits: KafkaSourceConfig::DEFAULT_LIMITS,
        }
    }

    /// This format with the limits of `config`.
    pub(crate) fn with_limits(&self, config: &KafkaSourceConfig) -> Self {
        Format {
            limits: config.limits(),
            ..self.clone()
        }
    }

    /// Decodes one value, or says why it is bad.
    pub(crate) fn decode(&self, value: &[u8]) -> Result<V, BadRecord> {
        self.limits.check_size(value)?;
        (self.decode)(value, &self.limits)
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
        Format::new("bytes", |b, _| Ok(b.to_vec()))
    }
}

impl Format<String> {
    /// The value as UTF-8 text.
    pub fn utf8() -> Self {
        Format::new("utf8", |b, _| {
            String::from_utf8(b.to_vec())
                .map_err(|e| BadRecord::new(BadReason::Undecodable, format!("not UTF-8: {e}")))
        })
    }
}

impl<V: DeserializeOwned + 'static> Format<V> {
    /// The value as JSON, into `V`. A value nested deeper than
    /// [`KafkaSourceConfig::max_nesting_depth`] is bad (`too_deep`; serde_json
    /// refuses more than 128 levels whatever the limit); so is one that is
    /// not JSON (`invalid_json`) or does not fit `V` (`schema_mismatch`:
    /// serde converts no number lossily, `1.5` into an integer is an error).
    pub fn json() -> Self {
        let _ = PhantomData::<V>;
        Format::new("json", |b, limits| {
            check_structure(b, limits)?;
            serde_json::from_slice(b).map_err(|e| {
                let reason = match e.classify() {
                    serde_json::error::Category::Data => BadReason::SchemaMismatch,
                    _ if e.to_string().starts_with("recursion limit exceeded") => {
                        BadReason::TooDeep
                    }
                    _ => BadReason::InvalidJson,
                };
                BadRecord::new(reason, e.to_string())
            })
        })
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
    /// How often an unbounded source looks for partitions added to its
    /// topics (default 30 s; `None`: never). New partitions start at their
    /// earliest offset: they are new to the job, whatever `start` says.
    pub partition_discovery: Option<Duration>,
    /// A partition with committed records not read yet that makes no
    /// progress for this long is reported: a warning and
    /// `tinyflow_kafka_stalled_partitions` (default 60 s).
    pub stall_warn: Duration,
    /// A source subtask that made no progress on any of its partitions for
    /// this long while behind on one of them fails (retryably; the restart
    /// strategy decides) instead of stalling silently (default 10 min;
    /// `None`: never).
    pub stall_fail: Option<Duration>,
    /// A record value larger than this is bad (`too_large`), whatever the
    /// format: default [`KafkaSourceConfig::DEFAULT_MAX_RECORD_BYTES`].
    pub max_record_bytes: usize,
    /// A JSON value nested deeper than this (arrays and objects; `{"a":1}`
    /// is 1 deep) is bad (`too_deep`): default
    /// [`KafkaSourceConfig::DEFAULT_MAX_NESTING_DEPTH`], at most
    /// [`KafkaSourceConfig::MAX_NESTING_DEPTH`].
    pub max_nesting_depth: usize,
    /// The worker this source runs in, when the job is spread over several
    /// processes ([`Worker::SINGLE`] by default): the worker reads only the
    /// partitions dealt to it (see [`KafkaSourceConfig::reads`]).
    pub worker: Worker,
}

/// The subtask of `parallelism` that reads `partition` of `topic`: each
/// topic's partitions are dealt round-robin from a start that depends on
/// the topic's name alone (FNV-1a), so a partition added later moves no
/// other partition to another subtask.
pub(crate) fn owner(topic: &str, partition: i32, parallelism: usize) -> usize {
    let parallelism = parallelism.max(1) as u64;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in topic.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let start = hash % parallelism;
    ((start + u64::from(partition.unsigned_abs())) % parallelism) as usize
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
            partition_discovery: Some(Duration::from_secs(30)),
            stall_warn: Duration::from_secs(60),
            stall_fail: Some(Duration::from_secs(600)),
            max_record_bytes: Self::DEFAULT_MAX_RECORD_BYTES,
            max_nesting_depth: Self::DEFAULT_MAX_NESTING_DEPTH,
            worker: Worker::SINGLE,
        }
    }

    /// Whether subtask `subtask` of `parallelism` of this source reads
    /// `partition` of `topic`. Partitions are dealt in two rounds by the
    /// same round-robin rule: first to the workers, then each worker's share
    /// to its subtasks, so the partitions of a worker depend only on the
    /// number of workers and a worker's parallelism may change without
    /// moving a partition to another worker. With one worker this is the
    /// single deal of a job in one process.
    pub fn reads(&self, topic: &str, partition: i32, parallelism: usize, subtask: usize) -> bool {
        let workers = self.worker.count() as usize;
        if owner(topic, partition, workers) != self.worker.index() as usize {
            return false;
        }
        // A worker's partitions of a topic are every `workers`-th one; their
        // rank among them deals them over the worker's subtasks.
        let rank = partition / self.worker.count().max(1) as i32;
        owner(topic, rank, parallelism) == subtask
    }

    /// 8 MiB: eight times the largest record a Kafka broker accepts by
    /// default (`message.max.bytes`, about 1 MiB), so no record of a topic
    /// with default settings is refused, while one record's decoding stays
    /// bounded where a topic allows more.
    pub const DEFAULT_MAX_RECORD_BYTES: usize = 8 << 20;

    /// 64: event JSON is rarely more than a few levels deep (Nexmark's is
    /// 1), and half of serde_json's own limit (128).
    pub const DEFAULT_MAX_NESTING_DEPTH: usize = 64;

    /// The largest `max_nesting_depth` allowed: arrow-json formats an error
    /// by recursing over the value, and 1024 levels of that fit easily in a
    /// thread's stack (100000 overflowed it and aborted the process).
    pub const MAX_NESTING_DEPTH: usize = 1024;

    const DEFAULT_LIMITS: Limits = Limits {
        max_bytes: Self::DEFAULT_MAX_RECORD_BYTES,
        max_depth: Self::DEFAULT_MAX_NESTING_DEPTH,
    };

    pub(crate) fn limits(&self) -> Limits {
        Limits {
            max_bytes: self.max_record_bytes,
            max_depth: self.max_nesting_depth,
        }
    }

    /// Checks `max_record_bytes` and `max_nesting_depth`.
    pub fn validate_limits(&self) -> StreamResult<()> {
        if self.max_record_bytes == 0 {
            return Err(StreamError::Config {
                key: "source.max_record_bytes",
                message: "expected at least 1".to_owned(),
            });
        }
        if !(1..=Self::MAX_NESTING_DEPTH).contains(&self.max_nesting_depth) {
            return Err(StreamError::Config {
                key: "source.max_nesting_depth",
                message: format!(
                    "{}: expected 1 to {}",
                    self.max_nesting_depth,
                    Self::MAX_NESTING_DEPTH
                ),
            });
        }
        Ok(())
    }
}

/// librdkafka settings the source's consumer gets unless
/// [`KafkaSourceConfig::properties`] sets them, chosen by measurement (the
/// `kafka_source` and `pipeline` bench binaries; figures in
/// `docs/performance.md`): with the default `fetch.queue.backoff.ms` (1 s)
/// a consumer that drains its queue in batches waits for fetches a third of
/// the time, and librdkafka's default pre-fetch queue of 64 MiB per consumer
/// more than doubles the job's peak memory without making it faster.
pub const DEFAULT_CLIENT_SETTINGS: &[(&str, &str)] = &[
    ("fetch.queue.backoff.ms", "10"),
    ("queued.max.messages.kbytes", "8192"),
];

impl fmt::Debug for KafkaSourceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let props: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| (k.as_str(), tinyflow_api::secrets::shown(k, v)))
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
            .field("request_timeout", &self.request_timeout)
            .field("properties", &props)
            .field("partition_discovery", &self.partition_discovery)
            .field("stall_warn", &self.stall_warn)
            .field("stall_fail", &self.stall_fail)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("max_nesting_depth", &self.max_nesting_depth)
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
        assert_eq!(Format::bytes().decode(b"\xff").unwrap(), vec![0xff]);
        let bad = Format::utf8().decode(b"\xff").unwrap_err();
        assert_eq!(bad.reason, BadReason::Undecodable);
        assert!(bad.detail.contains("not UTF-8"), "{bad}");
        let json = Format::<BTreeMap<String, u32>>::json();
        assert_eq!(json.decode(br#"{"a":1}"#).unwrap()["a"], 1);
        assert_eq!(
            json.decode(b"{").unwrap_err().reason,
            BadReason::InvalidJson
        );
        assert_eq!(
            json.decode(br#"{"a":1.5}"#).unwrap_err().reason,
            BadReason::SchemaMismatch
        );
        assert_eq!(
            json.decode(br#"{"a":"12"}"#).unwrap_err().reason,
            BadReason::SchemaMismatch
        );
    }

    #[test]
    fn json_values_past_the_limits_are_bad_not_a_crash() {
        let mut config = KafkaSourceConfig::new("b:9092", &["t"], "g");
        config.max_record_bytes = 100;
        config.max_nesting_depth = 4;
        let json = Format::<serde_json::Value>::json().with_limits(&config);
        let deep = |d: usize| format!("{}{}", "[".repeat(d), "]".repeat(d));
        assert!(json.decode(deep(4).as_bytes()).is_ok());
        assert_eq!(
            json.decode(deep(5).as_bytes()).unwrap_err().reason,
            BadReason::TooDeep
        );
        assert_eq!(
            json.decode(&[b' '; 101]).unwrap_err().reason,
            BadReason::TooLarge
        );
        assert_eq!(
            Format::bytes()
                .with_limits(&config)
                .decode(&[0; 101])
                .unwrap_err()
                .reason,
            BadReason::TooLarge
        );
        // 100000 levels, with the default limits and with the largest
        // allowed: bad, and the process lives.
        for depth in [
            KafkaSourceConfig::DEFAULT_MAX_NESTING_DEPTH,
            KafkaSourceConfig::MAX_NESTING_DEPTH,
        ] {
            config.max_record_bytes = KafkaSourceConfig::DEFAULT_MAX_RECORD_BYTES;
            config.max_nesting_depth = depth;
            let json = Format::<serde_json::Value>::json().with_limits(&config);
            let bad = json.decode(deep(100_000).as_bytes()).unwrap_err();
            assert_eq!(bad.reason, BadReason::TooDeep, "{bad}");
        }
    }

    #[test]
    fn limits_are_validated() {
        let mut config = KafkaSourceConfig::new("b:9092", &["t"], "g");
        assert!(config.validate_limits().is_ok());
        config.max_nesting_depth = KafkaSourceConfig::MAX_NESTING_DEPTH + 1;
        assert!(matches!(
            config.validate_limits(),
            Err(StreamError::Config {
                key: "source.max_nesting_depth",
                ..
            })
        ));
        config.max_nesting_depth = 1;
        config.max_record_bytes = 0;
        assert!(matches!(
            config.validate_limits(),
            Err(StreamError::Config {
                key: "source.max_record_bytes",
                ..
            })
        ));
    }
}
