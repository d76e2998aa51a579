//! The source: partition assignment, positions, reading, decoding.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tinyflow_api::{
    CheckpointId, OperatorContext, Source, SourceFactory, SourceWatermark, StreamError,
    StreamResult,
};
use tokio::time::Instant;

use crate::config::{
    BadRecordPolicy, EventTime, Format, KafkaSourceConfig, StartPosition, is_secret,
};

/// One Kafka record with its decoded value.
#[derive(Debug, Clone, PartialEq)]
pub struct KafkaRecord<V> {
    /// Topic.
    pub topic: Arc<str>,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Record timestamp (ms since the Unix epoch), if the broker has one.
    pub timestamp: Option<i64>,
    /// Key bytes.
    pub key: Option<Vec<u8>>,
    /// Headers, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The decoded value.
    pub value: V,
}

/// A Kafka source of `KafkaRecord<V>`; see the crate docs.
#[derive(Debug, Clone)]
pub struct KafkaSource<V> {
    config: KafkaSourceConfig,
    format: Format<V>,
    event_time: Option<EventTime<V>>,
}

impl<V> KafkaSource<V> {
    /// A source with `config`, decoding values with `format`, tracking no
    /// event time.
    pub fn new(config: KafkaSourceConfig, format: Format<V>) -> Self {
        KafkaSource {
            config,
            format,
            event_time: None,
        }
    }

    /// Tracks event time and reports per-partition watermarks, combined by
    /// minimum (see [`EventTime`]).
    pub fn with_event_time(mut self, event_time: EventTime<V>) -> Self {
        self.event_time = Some(event_time);
        self
    }
}

type Partition = (Arc<str>, i32);

fn external(
    operator: &str,
    action: impl Into<String>,
    e: impl std::fmt::Display,
    retryable: bool,
) -> StreamError {
    StreamError::External {
        operator: operator.to_owned(),
        system: "kafka",
        action: action.into(),
        message: e.to_string(),
        retryable,
    }
}

fn decode_positions(bytes: &[u8]) -> StreamResult<Vec<(String, i32, i64)>> {
    postcard::from_bytes(bytes).map_err(|e| StreamError::State {
        operator: "kafka source".into(),
        action: "decoded",
        message: e.to_string(),
    })
}

impl<V: tinyflow_api::Data> KafkaSource<V> {
    fn consumer(&self, name: &str) -> StreamResult<BaseConsumer> {
        let c = &self.config;
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &c.bootstrap_servers)
            .set("group.id", &c.group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // Positions come from checkpoints; a missing offset must show.
            .set("auto.offset.reset", "error")
            .set("enable.partition.eof", "false");
        for (k, v) in &c.properties {
            cc.set(k, v);
        }
        cc.create::<BaseConsumer>().map_err(|e| {
            let shown: Vec<String> = c
                .properties
                .iter()
                .map(|(k, v)| format!("{k}={}", if is_secret(k) { "***" } else { v }))
                .collect();
            StreamError::Config {
                key: "source.properties",
                message: format!(
                    "{name}: kafka client rejected its configuration ({}): {e}",
                    shown.join(", ")
                ),
            }
        })
    }

    /// Every partition of the configured topics, sorted.
    fn partitions(&self, consumer: &BaseConsumer, name: &str) -> StreamResult<Vec<Partition>> {
        let mut all = Vec::new();
        for topic in &self.config.topics {
            let md = consumer
                .fetch_metadata(Some(topic), self.config.request_timeout)
                .map_err(|e| {
                    external(
                        name,
                        format!(
                            "fetching metadata of topic {topic:?} from {}",
                            self.config.bootstrap_servers
                        ),
                        e,
                        true,
                    )
                })?;
            let t = md.topics().iter().find(|t| t.name() == topic);
            match t {
                Some(t) if t.error().is_none() && !t.partitions().is_empty() => {
                    let name: Arc<str> = Arc::from(topic.as_str());
                    all.extend(t.partitions().iter().map(|p| (Arc::clone(&name), p.id())));
                }
                Some(t) => {
                    return Err(StreamError::Config {
                        key: "source.topics",
                        message: format!(
                            "{name}: topic {topic:?} is not available ({:?})",
                            t.error()
                        ),
                    });
                }
                None => {
                    return Err(StreamError::Config {
                        key: "source.topics",
                        message: format!("{name}: topic {topic:?} does not exist"),
                    });
                }
            }
        }
        all.sort();
        Ok(all)
    }

    fn start_offsets(
        &self,
        consumer: &BaseConsumer,
        name: &str,
        owned: &[Partition],
    ) -> StreamResult<BTreeMap<Partition, i64>> {
        let timeout = self.config.request_timeout;
        let watermarks = |(t, p): &Partition| {
            consumer
                .fetch_watermarks(t, *p, timeout)
                .map_err(|e| external(name, format!("fetching offsets of {t}/{p}"), e, true))
        };
        let mut out = BTreeMap::new();
        match &self.config.start {
            StartPosition::Earliest => {
                for p in owned {
                    out.insert(p.clone(), watermarks(p)?.0);
                }
            }
            StartPosition::Latest => {
                for p in owned {
                    out.insert(p.clone(), watermarks(p)?.1);
                }
            }
            StartPosition::Offsets(offsets) => {
                for p in owned {
                    let at = offsets.get(&(p.0.to_string(), p.1)).copied();
                    out.insert(
                        p.clone(),
                        match at {
                            Some(o) => o,
                            None => watermarks(p)?.0,
                        },
                    );
                }
            }
            StartPosition::Committed | StartPosition::Timestamp(_) => {
                let mut tpl = TopicPartitionList::new();
                for (t, p) in owned {
                    let offset = match self.config.start {
                        StartPosition::Timestamp(ts) => Offset::Offset(ts),
                        _ => Offset::Invalid,
                    };
                    tpl.add_partition_offset(t, *p, offset)
                        .map_err(|e| external(name, "building the partition list", e, false))?;
                }
                let found = if let StartPosition::Timestamp(_) = self.config.start {
                    consumer.offsets_for_times(tpl, timeout)
                } else {
                    consumer.committed_offsets(tpl, timeout)
                }
                .map_err(|e| external(name, "looking up start offsets", e, true))?;
                for p in owned {
                    let at = found
                        .find_partition(&p.0, p.1)
                        .and_then(|e| match e.offset() {
                            Offset::Offset(o) => Some(o),
                            _ => None,
                        });
                    // No commit, or no record after the time: start at the
                    // end for a timestamp, at the beginning for a commit.
                    let fallback = || -> StreamResult<i64> {
                        let (low, high) = watermarks(p)?;
                        Ok(
                            if matches!(self.config.start, StartPosition::Timestamp(_)) {
                                high
                            } else {
                                low
                            },
                        )
                    };
                    out.insert(
                        p.clone(),
                        match at {
                            Some(o) => o,
                            None => fallback()?,
                        },
                    );
                }
            }
        }
        Ok(out)
    }
}

impl<V: tinyflow_api::Data> SourceFactory<KafkaRecord<V>> for KafkaSource<V> {
    fn create(
        &self,
        ctx: &OperatorContext,
        restored: &[Vec<u8>],
    ) -> StreamResult<Box<dyn Source<KafkaRecord<V>>>> {
        let name = format!("{}[{}]", ctx.name, ctx.subtask);
        let consumer = self.consumer(&name)?;
        let all = self.partitions(&consumer, &name)?;
        let owned: Vec<Partition> = all
            .iter()
            .enumerate()
            .filter(|(i, _)| i % ctx.parallelism == ctx.subtask)
            .map(|(_, p)| p.clone())
            .collect();
        let mut checkpointed = BTreeMap::new();
        for state in restored {
            for (t, p, o) in decode_positions(state)? {
                checkpointed.insert((Arc::<str>::from(t.as_str()), p), o);
            }
        }
        // Checkpointed positions win; partitions new since then start at the
        // configured position.
        let fresh: Vec<Partition> = owned
            .iter()
            .filter(|p| !checkpointed.contains_key(*p))
            .cloned()
            .collect();
        let mut positions = self.start_offsets(&consumer, &name, &fresh)?;
        for p in &owned {
            if let Some(o) = checkpointed.get(p) {
                positions.insert(p.clone(), *o);
            }
        }
        let mut tpl = TopicPartitionList::new();
        for ((t, p), o) in &positions {
            tpl.add_partition_offset(t, *p, Offset::Offset(*o))
                .map_err(|e| external(&name, "building the assignment", e, false))?;
        }
        consumer
            .assign(&tpl)
            .map_err(|e| external(&name, "assigning partitions", e, true))?;
        let stop = if self.config.bounded {
            let mut stop = BTreeMap::new();
            for p in &owned {
                let (_, high) = consumer
                    .fetch_watermarks(&p.0, p.1, self.config.request_timeout)
                    .map_err(|e| {
                        external(
                            &name,
                            format!("fetching end offsets of {}/{}", p.0, p.1),
                            e,
                            true,
                        )
                    })?;
                stop.insert(p.clone(), high);
            }
            Some(stop)
        } else {
            None
        };
        tracing::info!(
            source = %name,
            partitions = ?positions.iter().map(|((t, p), o)| format!("{t}/{p}@{o}")).collect::<Vec<_>>(),
            restored = !restored.is_empty(),
            bounded = self.config.bounded,
            "kafka source assigned"
        );
        let labels = [("operator", ctx.name.clone())];
        let mut topics: Vec<Arc<str>> = owned.iter().map(|(t, _)| Arc::clone(t)).collect();
        topics.dedup();
        let now = Instant::now();
        let times = owned
            .iter()
            .map(|p| {
                (
                    p.clone(),
                    PartitionTime {
                        max: i64::MIN,
                        last_record: now,
                    },
                )
            })
            .collect();
        Ok(Box::new(Reader {
            name,
            topics,
            consumer,
            format: self.format.clone(),
            positions,
            stop,
            batch_size: self.config.batch_size.max(1),
            policy: self.config.bad_records,
            commit_offsets: self.config.commit_offsets,
            skipped: metrics::counter!("tinyflow_bad_records_total", &labels),
            event_time: self.event_time.clone(),
            times,
        }))
    }
}

struct Reader<V> {
    name: String,
    topics: Vec<Arc<str>>,
    consumer: BaseConsumer,
    format: Format<V>,
    /// Next offset to read, per owned partition.
    positions: BTreeMap<Partition, i64>,
    /// End offsets of a bounded read.
    stop: Option<BTreeMap<Partition, i64>>,
    batch_size: usize,
    policy: BadRecordPolicy,
    commit_offsets: bool,
    skipped: metrics::Counter,
    event_time: Option<EventTime<V>>,
    /// Event time per owned partition.
    times: BTreeMap<Partition, PartitionTime>,
}

/// The event time read from one partition.
struct PartitionTime {
    /// The highest event time read.
    max: i64,
    /// When its last record (good or bad) arrived, or the source started.
    last_record: Instant,
}

impl<V> Reader<V> {
    fn done(&self) -> bool {
        self.stop
            .as_ref()
            .is_some_and(|stop| stop.iter().all(|(p, end)| self.partition_done(p, *end)))
    }

    fn partition_done(&self, p: &Partition, end: i64) -> bool {
        self.positions.get(p).is_some_and(|o| *o >= end)
    }
}

/// How long an idle source waits before polling again.
const IDLE_WAIT: Duration = Duration::from_millis(5);

#[async_trait::async_trait]
impl<V: tinyflow_api::Data> Source<KafkaRecord<V>> for Reader<V> {
    async fn next_batch(&mut self) -> StreamResult<Option<Vec<KafkaRecord<V>>>> {
        if self.done() {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(self.batch_size.min(4096));
        while out.len() < self.batch_size {
            let Some(polled) = self.consumer.poll(Duration::ZERO) else {
                break;
            };
            let msg = match polled {
                Ok(m) => m,
                // librdkafka reconnects by itself (broker restarts, leader
                // changes); these are reports, not lost data.
                Err(e) => {
                    tracing::warn!(source = %self.name, error = %e, "kafka consumer reported an error; retrying");
                    break;
                }
            };
            // Reuse the topic's shared name: no allocation per record.
            let Some(topic) = self.topics.iter().find(|t| ***t == *msg.topic()) else {
                continue;
            };
            let partition: Partition = (Arc::clone(topic), msg.partition());
            let Some(position) = self.positions.get_mut(&partition) else {
                continue;
            };
            if msg.offset() < *position {
                continue; // a duplicate delivery from before a seek
            }
            *position = msg.offset() + 1;
            if let Some(time) = self.times.get_mut(&partition) {
                time.last_record = Instant::now();
            }
            if let Some(stop) = &self.stop
                && stop.get(&partition).is_some_and(|end| msg.offset() >= *end)
            {
                continue; // past the bounded end
            }
            let payload = msg.payload().unwrap_or_default();
            match (self.format.decode)(payload) {
                Ok(value) => {
                    if let Some(et) = &self.event_time {
                        let t = match &et.from {
                            Some(from) => from(&value),
                            None => msg.timestamp().to_millis(),
                        };
                        if let (Some(t), Some(time)) = (t, self.times.get_mut(&partition)) {
                            time.max = time.max.max(t);
                        }
                    }
                    out.push(KafkaRecord {
                        topic: Arc::clone(&partition.0),
                        partition: partition.1,
                        offset: msg.offset(),
                        timestamp: msg.timestamp().to_millis(),
                        key: msg.key().map(<[u8]>::to_vec),
                        headers: msg
                            .headers()
                            .map(|h| {
                                h.iter()
                                    .map(|h| {
                                        (h.key.to_owned(), h.value.unwrap_or_default().to_vec())
                                    })
                                    .collect()
                            })
                            .unwrap_or_default(),
                        value,
                    })
                }
                Err(reason) => match self.policy {
                    BadRecordPolicy::Fail => {
                        return Err(StreamError::BadRecord {
                            operator: self.name.clone(),
                            topic: partition.0.to_string(),
                            partition: partition.1,
                            offset: msg.offset(),
                            reason,
                        });
                    }
                    BadRecordPolicy::Skip => {
                        self.skipped.increment(1);
                        tracing::debug!(source = %self.name, topic = %partition.0, partition = partition.1, offset = msg.offset(), %reason, "bad record skipped");
                    }
                },
            }
        }
        if out.is_empty() {
            if self.done() {
                return Ok(None);
            }
            // Cancel safe: nothing was taken from the consumer.
            tokio::time::sleep(IDLE_WAIT).await;
        }
        Ok(Some(out))
    }

    fn snapshot(&mut self) -> StreamResult<Vec<u8>> {
        let positions: Vec<(&str, i32, i64)> = self
            .positions
            .iter()
            .map(|((t, p), o)| (&**t, *p, *o))
            .collect();
        postcard::to_allocvec(&positions).map_err(|e| StreamError::State {
            operator: self.name.clone(),
            action: "encoded",
            message: e.to_string(),
        })
    }

    fn watermark(&self) -> SourceWatermark {
        let Some(et) = &self.event_time else {
            return SourceWatermark::None;
        };
        let now = Instant::now();
        let active = self.times.iter().filter(|(p, time)| {
            let finished = self
                .stop
                .as_ref()
                .and_then(|stop| stop.get(*p))
                .is_some_and(|end| self.partition_done(p, *end));
            let idle = et
                .idle_timeout
                .is_some_and(|t| now.duration_since(time.last_record) >= t);
            !finished && !idle
        });
        match active.map(|(_, time)| time.max).min() {
            Some(min) => SourceWatermark::At(min.saturating_sub(et.max_out_of_orderness)),
            None => SourceWatermark::Idle,
        }
    }

    async fn checkpoint_complete(&mut self, id: CheckpointId) -> StreamResult<()> {
        if !self.commit_offsets || self.positions.is_empty() {
            return Ok(());
        }
        let mut tpl = TopicPartitionList::new();
        for ((t, p), o) in &self.positions {
            tpl.add_partition_offset(t, *p, Offset::Offset(*o))
                .map_err(|e| external(&self.name, "building the offset commit", e, false))?;
        }
        // For monitoring only: a failed commit is logged, never fatal.
        if let Err(e) = self.consumer.commit(&tpl, CommitMode::Async) {
            tracing::warn!(source = %self.name, checkpoint = %id, error = %e, "committing offsets to the consumer group failed");
        }
        Ok(())
    }
}
