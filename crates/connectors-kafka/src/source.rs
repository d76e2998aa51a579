//! The source: partition assignment, positions, reading, decoding.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tinyflow_api::{
    CheckpointId, OperatorContext, Source, SourceFactory, SourcePositions, SourceWatermark,
    StreamError, StreamResult,
};
use tokio::time::Instant;

use crate::bad_record::{BadReason, BadRecord, BadRecords};
use crate::config::{
    BadRecordPolicy, DEFAULT_CLIENT_SETTINGS, EventTime, Format, KafkaSourceConfig, StartPosition,
    TimeFrom, is_secret,
};
use crate::dead_letter::DeadLetter;

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

pub(crate) type Partition = (Arc<str>, i32);

/// The consumer's context: passes librdkafka's logs to `tracing` and keeps
/// the last warning or error (connection refused, authentication failed),
/// so an error that surfaces as a time-out or a transport failure can say
/// why.
pub(crate) struct SourceContext {
    last_error: std::sync::Mutex<Option<String>>,
    /// `tinyflow_kafka_consumer_lag`: records in the subtask's partitions
    /// not read yet, from librdkafka's statistics (once a second).
    lag: metrics::Gauge,
}

impl Default for SourceContext {
    fn default() -> Self {
        SourceContext {
            last_error: std::sync::Mutex::new(None),
            lag: metrics::Gauge::noop(),
        }
    }
}

/// The last client error `consumer` logged, as a suffix for an error
/// message. Logs arrive as events on the consumer's queue: before the
/// partitions are assigned, polling serves them and returns no records.
fn why(consumer: &KafkaConsumer) -> String {
    let _ = consumer.poll(Duration::from_millis(100));
    for _ in 0..100 {
        if consumer.poll(Duration::ZERO).is_none() {
            break;
        }
    }
    match &*consumer
        .context()
        .last_error
        .lock()
        .unwrap_or_else(|p| p.into_inner())
    {
        Some(e) => format!(" (last client error: {e})"),
        None => String::new(),
    }
}

impl ClientContext for SourceContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        if (level as i32) <= (RDKafkaLogLevel::Warning as i32) {
            tracing::warn!(facility = fac, "librdkafka: {message}");
            *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(message.to_owned());
        } else {
            tracing::debug!(facility = fac, "librdkafka: {message}");
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(%error, reason, "kafka client error");
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(format!("{error}: {reason}"));
    }

    fn stats(&self, statistics: rdkafka::Statistics) {
        // Partitions the consumer does not fetch report a lag of -1.
        let lag: i64 = statistics
            .topics
            .values()
            .flat_map(|t| t.partitions.values())
            .filter(|p| p.partition >= 0 && p.consumer_lag >= 0)
            .map(|p| p.consumer_lag)
            .sum();
        self.lag.set(lag as f64);
    }
}

impl ConsumerContext for SourceContext {}

type KafkaConsumer = BaseConsumer<SourceContext>;

pub(crate) fn external(
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

/// The start offsets a Kafka source's [`Source::positions`] name (as a
/// sink recorded them, e.g. in an Iceberg table): `topic/partition` ->
/// next offset, for [`StartPosition::Offsets`](crate::StartPosition).
/// The error quotes the entry that is not of that form.
pub fn offsets_of_positions(
    positions: &SourcePositions,
) -> Result<BTreeMap<(String, i32), i64>, String> {
    positions
        .iter()
        .map(|(name, offset)| {
            name.rsplit_once('/')
                .and_then(|(topic, partition)| {
                    Some((
                        (topic.to_owned(), partition.parse().ok()?),
                        offset.parse().ok()?,
                    ))
                })
                .ok_or_else(|| format!("`{name}: {offset}`, expected `topic/partition: offset`"))
        })
        .collect()
}

/// The positions (topic, partition, next offset) in a Kafka source's
/// checkpoint state, for tools that inspect checkpoints.
pub fn decode_positions(bytes: &[u8]) -> StreamResult<Vec<(String, i32, i64)>> {
    crate::state::decode(bytes)
        .map(|s| s.positions)
        .map_err(|e| StreamError::State {
            operator: "kafka source".into(),
            action: "decoded",
            message: e.to_string(),
        })
}

impl KafkaSourceConfig {
    /// The client settings every client of the source shares: the
    /// bootstrap servers, `fixed`, then the pass-through properties.
    pub(crate) fn client_config(&self, fixed: &[(&str, &str)]) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &self.bootstrap_servers);
        for (k, v) in fixed {
            cc.set(*k, *v);
        }
        for (k, v) in &self.properties {
            cc.set(k, v);
        }
        cc
    }

    /// The error for settings the client rejected, secrets masked.
    pub(crate) fn rejected(
        &self,
        name: &str,
        client: &str,
        e: impl std::fmt::Display,
    ) -> StreamError {
        let shown: Vec<String> = self
            .properties
            .iter()
            .map(|(k, v)| format!("{k}={}", if is_secret(k) { "***" } else { v }))
            .collect();
        StreamError::Config {
            key: "source.properties",
            message: format!(
                "{name}: the kafka {client} rejected its configuration ({}): {e}",
                shown.join(", ")
            ),
        }
    }

    fn consumer(&self, name: &str, lag: metrics::Gauge) -> StreamResult<KafkaConsumer> {
        let mut fixed = vec![
            ("statistics.interval.ms", "1000"),
            ("group.id", self.group_id.as_str()),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            // Positions come from checkpoints; a missing offset must show.
            ("auto.offset.reset", "error"),
            ("enable.partition.eof", "false"),
        ];
        fixed.extend_from_slice(DEFAULT_CLIENT_SETTINGS);
        self.client_config(&fixed)
            .create_with_context::<_, KafkaConsumer>(SourceContext {
                lag,
                ..SourceContext::default()
            })
            .map_err(|e| self.rejected(name, "consumer", e))
    }

    /// Every partition of the configured topics, sorted.
    fn partitions(&self, consumer: &KafkaConsumer, name: &str) -> StreamResult<Vec<Partition>> {
        let mut all = Vec::new();
        for topic in &self.topics {
            let md = consumer
                .fetch_metadata(Some(topic), self.request_timeout)
                .map_err(|e| {
                    external(
                        name,
                        format!(
                            "fetching metadata of topic {topic:?} from {}",
                            self.bootstrap_servers
                        ),
                        format!("{e}{}", why(consumer)),
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
        consumer: &KafkaConsumer,
        name: &str,
        owned: &[Partition],
    ) -> StreamResult<BTreeMap<Partition, i64>> {
        let timeout = self.request_timeout;
        let watermarks = |(t, p): &Partition| {
            consumer.fetch_watermarks(t, *p, timeout).map_err(|e| {
                let why = why(consumer);
                external(
                    name,
                    format!("fetching offsets of {t}/{p}"),
                    format!("{e}{why}"),
                    true,
                )
            })
        };
        let mut out = BTreeMap::new();
        match &self.start {
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
                    let offset = match self.start {
                        StartPosition::Timestamp(ts) => Offset::Offset(ts),
                        _ => Offset::Invalid,
                    };
                    tpl.add_partition_offset(t, *p, offset)
                        .map_err(|e| external(name, "building the partition list", e, false))?;
                }
                let found = if let StartPosition::Timestamp(_) = self.start {
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
                        Ok(if matches!(self.start, StartPosition::Timestamp(_)) {
                            high
                        } else {
                            low
                        })
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
        let decoder = RecordDecoder {
            format: self.format.clone(),
            from: self.event_time.as_ref().map(|e| e.from.clone()),
        };
        open(
            &self.config,
            self.event_time.as_ref(),
            decoder,
            ctx,
            restored,
        )
    }
}

/// One polled record, with its partition's shared topic name.
pub(crate) struct Polled<'c> {
    pub(crate) topic: Arc<str>,
    pub(crate) msg: BorrowedMessage<'c>,
}

/// What a decoder made of one polled record: `Ok(event time)` or why it is
/// bad.
pub(crate) type Outcome = Result<Option<i64>, BadRecord>;

/// Turns the records of one poll into output items.
pub(crate) trait Decode: Send + 'static {
    type Out: tinyflow_api::Data;

    /// Decodes `polled`, appending items to `out` and one outcome per
    /// polled record to `outcomes` (cleared by the caller).
    fn decode(
        &mut self,
        polled: &[Polled<'_>],
        out: &mut Vec<Self::Out>,
        outcomes: &mut Vec<Outcome>,
    );
}

/// Record by record, with a [`Format`].
struct RecordDecoder<V> {
    format: Format<V>,
    from: Option<TimeFrom<V>>,
}

impl<V: tinyflow_api::Data> Decode for RecordDecoder<V> {
    type Out = KafkaRecord<V>;

    fn decode(
        &mut self,
        polled: &[Polled<'_>],
        out: &mut Vec<KafkaRecord<V>>,
        outcomes: &mut Vec<Outcome>,
    ) {
        for Polled { topic, msg } in polled {
            match (self.format.decode)(msg.payload().unwrap_or_default()) {
                Ok(value) => {
                    let time = match &self.from {
                        None => None,
                        Some(TimeFrom::Field(f)) => f(&value),
                        Some(_) => msg.timestamp().to_millis(),
                    };
                    out.push(KafkaRecord {
                        topic: Arc::clone(topic),
                        partition: msg.partition(),
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
                    });
                    outcomes.push(Ok(time));
                }
                Err(detail) => outcomes.push(Err(BadRecord::new(BadReason::Undecodable, detail))),
            }
        }
    }
}

/// How watermarks follow event time (the part of [`EventTime`] the reader
/// needs; where time is read is the decoder's business).
#[derive(Debug, Clone, Copy)]
struct Timing {
    max_out_of_orderness: i64,
    idle_timeout: Option<Duration>,
}

impl Timing {
    fn of<V>(e: &EventTime<V>) -> Self {
        Timing {
            max_out_of_orderness: e.max_out_of_orderness,
            idle_timeout: e.idle_timeout,
        }
    }
}

/// Connects, assigns this subtask's partitions at their restored or start
/// positions, and returns the reader.
pub(crate) fn open<D: Decode, V>(
    config: &KafkaSourceConfig,
    event_time: Option<&EventTime<V>>,
    decoder: D,
    ctx: &OperatorContext,
    restored: &[Vec<u8>],
) -> StreamResult<Box<dyn Source<D::Out>>> {
    let name = format!("{}[{}]", ctx.name, ctx.subtask);
    let labels = [
        ("operator", ctx.name.clone()),
        ("subtask", ctx.subtask.to_string()),
    ];
    let consumer = config.consumer(
        &name,
        metrics::gauge!("tinyflow_kafka_consumer_lag", &labels),
    )?;
    let all = config.partitions(&consumer, &name)?;
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
    let mut positions = config.start_offsets(&consumer, &name, &fresh)?;
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
    // Wake the reader when records arrive, instead of polling on a timer.
    let arrived = Arc::new(tokio::sync::Notify::new());
    let mut consumer = consumer;
    {
        let arrived = Arc::clone(&arrived);
        consumer.set_nonempty_callback(move || arrived.notify_one());
    }
    let stop = if config.bounded {
        let mut stop = BTreeMap::new();
        for p in &owned {
            let (_, high) = consumer
                .fetch_watermarks(&p.0, p.1, config.request_timeout)
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
        bounded = config.bounded,
        "kafka source assigned"
    );
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
    let dead_letter = match &config.bad_records {
        BadRecordPolicy::DeadLetter { topic } => {
            Some(DeadLetter::new(config, topic, &name, ctx, restored)?)
        }
        _ => None,
    };
    Ok(Box::new(Reader {
        topics,
        consumer: DropAside::new(consumer),
        arrived,
        decoder,
        positions,
        taken: VecDeque::new(),
        stop,
        batch_size: config.batch_size.max(1),
        commit_offsets: config.commit_offsets,
        bad: BadRecords::new(
            name,
            config.bad_records.clone(),
            labels.clone(),
            dead_letter,
            config.request_timeout,
        ),
        timing: event_time.map(Timing::of),
        times,
        outcomes: Vec::new(),
        read: metrics::counter!("tinyflow_kafka_records_read_total", &labels),
    }))
}

/// A source subtask: its consumer, positions and decoder.
pub(crate) struct Reader<D> {
    topics: Vec<Arc<str>>,
    consumer: DropAside<KafkaConsumer>,
    /// Notified by librdkafka when the consumer's queue becomes non-empty.
    arrived: Arc<tokio::sync::Notify>,
    decoder: D,
    /// Next offset to read, per owned partition.
    positions: BTreeMap<Partition, i64>,
    /// The positions of the checkpoints taken and not completed yet, oldest
    /// first: the consumer-group commit on completion of checkpoint N uses
    /// N's, never positions read past it.
    taken: VecDeque<(CheckpointId, BTreeMap<Partition, i64>)>,
    /// End offsets of a bounded read.
    stop: Option<BTreeMap<Partition, i64>>,
    batch_size: usize,
    commit_offsets: bool,
    bad: BadRecords,
    timing: Option<Timing>,
    /// Event time per owned partition.
    times: BTreeMap<Partition, PartitionTime>,
    outcomes: Vec<Outcome>,
    /// Records read (good and bad).
    read: metrics::Counter,
}

/// The event time read from one partition.
struct PartitionTime {
    /// The highest event time read.
    max: i64,
    /// When its last record (good or bad) arrived, or the source started.
    last_record: Instant,
}

impl<D> Reader<D> {
    fn done(&self) -> bool {
        self.stop
            .as_ref()
            .is_some_and(|stop| stop.iter().all(|(p, end)| self.partition_done(p, *end)))
    }

    fn partition_done(&self, p: &Partition, end: i64) -> bool {
        self.positions.get(p).is_some_and(|o| *o >= end)
    }
}

/// Checkpoints taken and not completed that a source keeps positions of
/// for its consumer-group commits.
const MAX_TAKEN: usize = 64;

/// How long an idle source waits for records at most before returning an
/// empty batch (so the runtime can check idleness and event time).
const IDLE_WAIT: Duration = Duration::from_millis(20);

#[async_trait::async_trait]
impl<D: Decode> Source<D::Out> for Reader<D> {
    async fn next_batch(&mut self) -> StreamResult<Option<Vec<D::Out>>> {
        if self.done() {
            self.bad.flush()?;
            return Ok(None);
        }
        // After a restore, the dead-letter topic is read back first.
        if !self.bad.ready().await? {
            return Ok(Some(Vec::new()));
        }
        let mut polled = Vec::with_capacity(self.batch_size.min(4096));
        let polled_at = Instant::now();
        while polled.len() < self.batch_size {
            let Some(next) = self.consumer.poll(Duration::ZERO) else {
                break;
            };
            let msg = match next {
                Ok(m) => m,
                // librdkafka reconnects by itself (broker restarts, leader
                // changes); these are reports, not lost data.
                Err(e) => {
                    tracing::warn!(source = %self.bad.name, error = %e, "kafka consumer reported an error; retrying");
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
            if self.timing.is_some()
                && let Some(time) = self.times.get_mut(&partition)
            {
                time.last_record = polled_at;
            }
            if let Some(stop) = &self.stop
                && stop.get(&partition).is_some_and(|end| msg.offset() >= *end)
            {
                continue; // past the bounded end
            }
            polled.push(Polled {
                topic: partition.0,
                msg,
            });
        }
        self.read.increment(polled.len() as u64);
        let mut out = Vec::new();
        self.outcomes.clear();
        self.decoder.decode(&polled, &mut out, &mut self.outcomes);
        for (p, outcome) in polled.iter().zip(self.outcomes.drain(..)) {
            match outcome {
                Ok(Some(t)) => {
                    if self.timing.is_some()
                        && let Some(time) = self
                            .times
                            .get_mut(&(Arc::clone(&p.topic), p.msg.partition()))
                    {
                        time.max = time.max.max(t);
                    }
                }
                Ok(None) => {}
                Err(reason) => self.bad.handle(p, reason)?,
            }
        }
        if polled.is_empty() {
            drop(polled);
            if self.done() {
                self.bad.flush()?;
                return Ok(None);
            }
            // Cancel safe: nothing was taken from the consumer, and a
            // wake-up that comes while nobody waits is kept for the next.
            let _ = tokio::time::timeout(IDLE_WAIT, self.arrived.notified()).await;
        }
        Ok(Some(out))
    }

    fn snapshot(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>> {
        // Dead letters first (committed): the positions below cover them.
        self.bad.flush()?;
        let dead_letter = self.bad.checkpoint_state(&self.positions);
        if self.commit_offsets {
            // Aborted checkpoints never complete; a later completion drops
            // them. Bounded in case completions stop coming.
            if self.taken.len() >= MAX_TAKEN {
                self.taken.pop_front();
            }
            self.taken.push_back((id, self.positions.clone()));
        }
        let positions: Vec<(&str, i32, i64)> = self
            .positions
            .iter()
            .map(|((t, p), o)| (&**t, *p, *o))
            .collect();
        crate::state::encode(&positions, dead_letter.as_ref()).map_err(|e| StreamError::State {
            operator: self.bad.name.clone(),
            action: "encoded",
            message: e.to_string(),
        })
    }

    fn positions(&self) -> SourcePositions {
        self.positions
            .iter()
            .map(|((t, p), o)| (format!("{t}/{p}"), o.to_string()))
            .collect()
    }

    fn watermark(&self) -> SourceWatermark {
        let Some(timing) = &self.timing else {
            return SourceWatermark::None;
        };
        let now = Instant::now();
        let active = self.times.iter().filter(|(p, time)| {
            let finished = self
                .stop
                .as_ref()
                .and_then(|stop| stop.get(*p))
                .is_some_and(|end| self.partition_done(p, *end));
            let idle = timing
                .idle_timeout
                .is_some_and(|t| now.duration_since(time.last_record) >= t);
            !finished && !idle
        });
        match active.map(|(_, time)| time.max).min() {
            Some(min) => SourceWatermark::At(min.saturating_sub(timing.max_out_of_orderness)),
            None => SourceWatermark::Idle,
        }
    }

    async fn checkpoint_complete(&mut self, id: CheckpointId) -> StreamResult<()> {
        // The newest checkpoint taken up to `id`: a completion covers every
        // lower id whose notification was coalesced.
        let mut completed = None;
        while self.taken.front().is_some_and(|(taken, _)| *taken <= id) {
            completed = self.taken.pop_front().map(|(_, at)| at);
        }
        let Some(completed) = completed.filter(|at| !at.is_empty()) else {
            return Ok(());
        };
        let mut tpl = TopicPartitionList::new();
        for ((t, p), o) in &completed {
            tpl.add_partition_offset(t, *p, Offset::Offset(*o))
                .map_err(|e| external(&self.bad.name, "building the offset commit", e, false))?;
        }
        // For monitoring only: a failed commit is logged, never fatal.
        if let Err(e) = self.consumer.commit(&tpl, CommitMode::Async) {
            tracing::warn!(source = %self.bad.name, checkpoint = %id, error = %e, "committing offsets to the consumer group failed");
        }
        Ok(())
    }
}

/// Owns a Kafka client whose drop may block (a consumer leaving its group,
/// a producer flushing) for as long as the broker is unreachable: it is
/// dropped on a thread of its own, so a task that ends while the broker is
/// down does not hang the runtime that drops it.
pub(crate) struct DropAside<T: Send + 'static>(Option<T>);

impl<T: Send + 'static> DropAside<T> {
    pub(crate) fn new(client: T) -> Self {
        DropAside(Some(client))
    }
}

impl<T: Send + 'static> std::ops::Deref for DropAside<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0.as_ref().expect("present until dropped")
    }
}

impl<T: Send + 'static> std::ops::DerefMut for DropAside<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_mut().expect("present until dropped")
    }
}

impl<T: Send + 'static> Drop for DropAside<T> {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            let spawned = std::thread::Builder::new()
                .name("kafka-close".into())
                .spawn(move || {
                    let started = std::time::Instant::now();
                    drop(client);
                    let took = started.elapsed();
                    if took > Duration::from_secs(1) {
                        tracing::info!(
                            secs = took.as_secs_f64(),
                            "kafka client closed late (broker unreachable meanwhile?)"
                        );
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "no thread to close a kafka client on; it is leaked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn offsets_read_back_from_positions_and_bad_entries_are_named() {
        let positions = SourcePositions::from([
            ("bids/0".to_owned(), "12".to_owned()),
            ("a/b/3".to_owned(), "7".to_owned()),
        ]);
        let offsets = offsets_of_positions(&positions).unwrap();
        assert_eq!(
            offsets,
            BTreeMap::from([(("a/b".to_owned(), 3), 7), (("bids".to_owned(), 0), 12)])
        );
        let bad = SourcePositions::from([("bids".to_owned(), "12".to_owned())]);
        let err = offsets_of_positions(&bad).unwrap_err();
        assert!(err.contains("`bids: 12`"), "{err}");
    }
}
