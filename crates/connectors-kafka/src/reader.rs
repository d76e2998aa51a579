//! The source and its subtasks: [`KafkaSource`], and the reader each
//! subtask runs (the [`Source`] implementation, generic over a
//! [`Decode`]). Which partitions a subtask owns ([`KafkaSourceConfig::reads`]), where it
//! starts (checkpointed positions, the configured start, partitions added
//! since), polling batches, moving positions and pausing at a bounded end,
//! the positions in checkpoints and the consumer-group commits after them,
//! event time and watermarks, retries after consumer errors, and partition
//! discovery.
//!
//! Boundary: the clients, their requests and what their errors mean are
//! `client.rs`'s; decoding is a [`Decode`]'s (`decode.rs`); bad records go
//! to the subtask's bad-record policy (`policy.rs`); stalls are watched by
//! `progress.rs`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use tinyflow_api::{
    CheckpointId, OperatorContext, Source, SourceFactory, SourcePositions, SourceWatermark,
    StreamError, StreamResult,
};
use tokio::time::Instant;

use crate::client::{
    DropAside, ErrorClass, KafkaConsumer, Partition, bounded_ends, classify, external,
    last_client_error,
};
use crate::config::{BadRecordPolicy, EventTime, Format, KafkaSourceConfig, StartPosition};
use crate::dead_letter::DeadLetter;
use crate::decode::{Decode, KafkaRecord, Outcome, Polled, RecordDecoder};
use crate::policy::BadRecords;
use crate::progress::Progress;

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

impl<V: tinyflow_api::Data> SourceFactory<KafkaRecord<V>> for KafkaSource<V> {
    fn create(
        &self,
        ctx: &OperatorContext,
        restored: &[Vec<u8>],
    ) -> StreamResult<Box<dyn Source<KafkaRecord<V>>>> {
        let decoder = RecordDecoder {
            format: self.format.with_limits(&self.config),
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
        .filter(|(t, p)| config.reads(t, *p, ctx.parallelism, ctx.subtask))
        .cloned()
        .collect();
    let mut checkpointed = BTreeMap::new();
    for state in restored {
        for (t, p, o) in decode_positions(state)? {
            checkpointed.insert((Arc::<str>::from(t.as_str()), p), o);
        }
    }
    // Checkpointed positions win. A partition the checkpoint does not know
    // starts at the configured position, unless the checkpoint knows its
    // topic: then the partition was added since, and its records are new
    // to the job (`latest` would skip them for good).
    let (added, fresh): (Vec<Partition>, Vec<Partition>) = owned
        .iter()
        .filter(|p| !checkpointed.contains_key(*p))
        .cloned()
        .partition(|(t, _)| checkpointed.keys().any(|(known, _)| known == t));
    let mut positions = config.start_offsets(&consumer, &name, &config.start, &fresh)?;
    if !added.is_empty() {
        positions.extend(config.start_offsets(
            &consumer,
            &name,
            &StartPosition::Earliest,
            &added,
        )?);
        tracing::info!(
            source = %name,
            partitions = ?added.iter().map(|(t, p)| format!("{t}/{p}")).collect::<Vec<_>>(),
            "partitions added since the checkpoint start at their earliest offset"
        );
    }
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
        Some(bounded_ends(config, &consumer, &name, &owned)?)
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
    let mut topics: Vec<Arc<str>> = all.iter().map(|(t, _)| Arc::clone(t)).collect();
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
    // A client of its own: the error paths of metadata requests poll their
    // client for its logs, which must never take the reader's records.
    let metadata = config.consumer(&name, metrics::Gauge::noop())?;
    let discovery = Discovery {
        client: Arc::new(DropAside::new(metadata)),
        every: config.partition_discovery,
        // Bounded runs read what was there at start; they only watch for
        // deleted topics.
        adds: !config.bounded,
        next_at: now + config.partition_discovery.unwrap_or(NEVER),
        pending: None,
        known: all.into_iter().collect(),
        config: config.clone(),
        parallelism: ctx.parallelism,
        subtask: ctx.subtask,
        found: metrics::counter!("tinyflow_kafka_partitions_discovered_total", &labels),
    };
    let progress = Progress::new(&positions, now, config.stall_warn, config.stall_fail);
    Ok(Box::new(Reader {
        topics,
        consumer: DropAside::new(consumer),
        arrived,
        decoder,
        positions,
        taken: VecDeque::new(),
        stop,
        at_end: BTreeSet::new(),
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
        stalled: metrics::gauge!("tinyflow_kafka_stalled_partitions", &labels),
        progress,
        retry: Retry::default(),
        discovery,
    }))
}

/// A source subtask: its consumer, positions and decoder.
struct Reader<D> {
    /// The configured topics' shared names.
    topics: Vec<Arc<str>>,
    consumer: DropAside<KafkaConsumer>,
    /// Notified by librdkafka when the consumer's queue becomes non-empty.
    arrived: Arc<tokio::sync::Notify>,
    decoder: D,
    /// Next offset to read, per owned partition: every record before it
    /// was processed (or is a transaction marker or an aborted record).
    positions: BTreeMap<Partition, i64>,
    /// The positions of the checkpoints taken and not completed yet, oldest
    /// first: the consumer-group commit on completion of checkpoint N uses
    /// N's, never positions read past it.
    taken: VecDeque<(CheckpointId, BTreeMap<Partition, i64>)>,
    /// End offsets of a bounded read.
    stop: Option<BTreeMap<Partition, i64>>,
    /// Partitions paused at their bounded end.
    at_end: BTreeSet<Partition>,
    batch_size: usize,
    commit_offsets: bool,
    bad: BadRecords,
    timing: Option<Timing>,
    /// Event time per owned partition.
    times: BTreeMap<Partition, PartitionTime>,
    outcomes: Vec<Outcome>,
    /// Records read (good and bad).
    read: metrics::Counter,
    /// `tinyflow_kafka_stalled_partitions`.
    stalled: metrics::Gauge,
    progress: Progress,
    retry: Retry,
    discovery: Discovery,
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

    /// Moves positions past what librdkafka consumed without handing it
    /// over: transaction markers and aborted records (a bounded run whose
    /// last entry is a commit marker would otherwise never end). Only
    /// forward, and never past a bounded end: every record before the
    /// consumer's position was delivered, and every record delivered
    /// before the end was processed.
    fn skip_markers(&mut self) {
        let Ok(at) = self.consumer.position() else {
            return;
        };
        for e in at.elements() {
            let Offset::Offset(o) = e.offset() else {
                continue;
            };
            let Some(topic) = self.topics.iter().find(|t| ***t == *e.topic()) else {
                continue;
            };
            let p = (Arc::clone(topic), e.partition());
            let end = self.stop.as_ref().and_then(|s| s.get(&p)).copied();
            if let Some(position) = self.positions.get_mut(&p) {
                let to = end.map_or(o, |end| o.min(end));
                if to > *position {
                    *position = to;
                }
            }
        }
    }

    /// Starts reading partitions found since the start at `new` offsets.
    fn assign_new(&mut self, new: BTreeMap<Partition, i64>) -> StreamResult<()> {
        let mut tpl = TopicPartitionList::new();
        for ((t, p), o) in &new {
            tpl.add_partition_offset(t, *p, Offset::Offset(*o))
                .map_err(|e| external(&self.bad.name, "building the assignment", e, false))?;
        }
        self.consumer.incremental_assign(&tpl).map_err(|e| {
            external(
                &self.bad.name,
                "assigning partitions added to the topics",
                e,
                true,
            )
        })?;
        tracing::info!(
            source = %self.bad.name,
            partitions = ?new.iter().map(|((t, p), o)| format!("{t}/{p}@{o}")).collect::<Vec<_>>(),
            "reading partitions added to the topics, from their earliest offset"
        );
        let now = Instant::now();
        for (p, o) in new {
            self.times.insert(
                p.clone(),
                PartitionTime {
                    max: i64::MIN,
                    last_record: now,
                },
            );
            self.positions.insert(p, o);
        }
        Ok(())
    }

    /// A consumer error: fatal ones fail the attempt, transient ones are
    /// retried after a growing pause.
    fn consumer_error(&mut self, e: &KafkaError) -> StreamResult<()> {
        match classify(e) {
            ErrorClass::Fatal => Err(StreamError::external(
                self.bad.name.clone(),
                "kafka",
                format!(
                    "reading {} (positions {})",
                    self.topics
                        .iter()
                        .map(|t| format!("{t:?}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.positions
                        .iter()
                        .map(|((t, p), o)| format!("{t}/{p}@{o}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                format!(
                    "{e}{}; this does not heal by retrying",
                    last_client_error(&self.consumer)
                ),
                false,
            )),
            ErrorClass::UnknownTopic => {
                // Deleted, or not known to a broker just restarted: the
                // metadata decides, now rather than at the next round.
                self.discovery.next_at = Instant::now();
                self.retry.failed(&self.bad.name, e);
                Ok(())
            }
            ErrorClass::Transient => {
                self.retry.failed(&self.bad.name, e);
                Ok(())
            }
        }
    }
}

/// Checkpoints taken and not completed that a source keeps positions of
/// for its consumer-group commits.
const MAX_TAKEN: usize = 64;

/// Takes out of `polled` the records `decoder` cannot decode yet (see
/// [`Decode::must_wait`]) and every later one of their partitions, and
/// sends those partitions back to the first of them (`positions` and the
/// consumer), so they are read again once the decoder is ready. A seek
/// drops what the consumer fetched before it. A partition paused at its
/// bounded end in the same poll is resumed: the seek took it back before
/// its end.
fn defer_waiting<D: Decode>(
    consumer: &KafkaConsumer,
    decoder: &mut D,
    positions: &mut BTreeMap<Partition, i64>,
    at_end: &mut BTreeSet<Partition>,
    name: &str,
    polled: &mut Vec<Polled<'_>>,
) -> StreamResult<()> {
    let mut from: BTreeMap<Partition, i64> = BTreeMap::new();
    polled.retain(|p| {
        let partition = (Arc::clone(&p.topic), p.msg.partition());
        if from.contains_key(&partition) {
            return false;
        }
        if decoder.must_wait(&p.msg) {
            from.insert(partition, p.msg.offset());
            return false;
        }
        true
    });
    for ((topic, partition), offset) in from {
        consumer
            .seek(&topic, partition, Offset::Offset(offset), SEEK_TIMEOUT)
            .map_err(|e| {
                external(
                    name,
                    format!(
                        "reading {topic}/{partition} again from offset {offset}, while its schema is fetched"
                    ),
                    e,
                    true,
                )
            })?;
        tracing::debug!(source = %name, topic = %topic, partition, offset, "waiting for a schema; the partition is read again from here");
        let p = (topic, partition);
        if at_end.remove(&p) {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&p.0, p.1);
            consumer.resume(&tpl).map_err(|e| {
                external(
                    name,
                    format!("resuming {}/{} after reading it again", p.0, p.1),
                    e,
                    true,
                )
            })?;
        }
        positions.insert(p, offset);
    }
    Ok(())
}

/// How long a seek may take.
const SEEK_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an idle source waits for records at most before returning an
/// empty batch (so the runtime can check idleness and event time).
const IDLE_WAIT: Duration = Duration::from_millis(20);

#[async_trait::async_trait]
impl<D: Decode> Source<D::Out> for Reader<D> {
    async fn next_batch(&mut self) -> StreamResult<Option<Vec<D::Out>>> {
        let now = Instant::now();
        self.progress.called(now);
        // Cancel safe: the pause is kept until it has passed.
        if let Some(at) = self.retry.until {
            tokio::time::sleep_until(at).await;
            self.retry.until = None;
            // The source's own wait, not the job holding it back.
            self.progress.waited(Instant::now().duration_since(now));
        }
        if let Some(new) = self.discovery.poll(&self.bad.name).await? {
            self.assign_new(new)?;
        }
        if self.progress.due(now) {
            let ends = self.consumer.context().ends();
            let stalled = self.progress.check(
                &self.bad.name,
                &self.positions,
                self.stop.as_ref(),
                &ends,
                now,
            )?;
            self.stalled.set(stalled as f64);
        }
        if self.done() {
            self.bad.flush()?;
            return Ok(None);
        }
        // After a restore, the dead-letter topic is read back first.
        if !self.bad.ready().await? {
            return Ok(Some(Vec::new()));
        }
        // Records wait for a schema being fetched: nothing is read until
        // it has come (their partitions were sent back to them).
        if !self.decoder.ready(IDLE_WAIT).await? {
            return Ok(Some(Vec::new()));
        }
        let mut polled = Vec::with_capacity(self.batch_size.min(4096));
        let mut error = None;
        let polled_at = Instant::now();
        while polled.len() < self.batch_size {
            let Some(next) = self.consumer.poll(Duration::ZERO) else {
                break;
            };
            let msg = match next {
                Ok(m) => m,
                Err(e) => {
                    error = Some(e);
                    break;
                }
            };
            self.retry.succeeded();
            // Reuse the topic's shared name: no allocation per record.
            let Some(topic) = self.topics.iter().find(|t| ***t == *msg.topic()) else {
                continue;
            };
            let partition: Partition = (Arc::clone(topic), msg.partition());
            if let Some(stop) = &self.stop
                && stop.get(&partition).is_some_and(|end| msg.offset() >= *end)
            {
                // Past the bounded end: not read, so the position stays.
                if self.at_end.insert(partition.clone()) {
                    pause(&self.consumer, &partition, &self.bad.name);
                }
                continue;
            }
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
            polled.push(Polled {
                topic: partition.0,
                msg,
            });
        }
        defer_waiting(
            &self.consumer,
            &mut self.decoder,
            &mut self.positions,
            &mut self.at_end,
            &self.bad.name,
            &mut polled,
        )?;
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
        if let Some(e) = error {
            // After the records polled before it, which are processed.
            drop(polled);
            self.consumer_error(&e)?;
            return Ok(Some(out));
        }
        if polled.is_empty() {
            drop(polled);
            self.skip_markers();
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

/// Stops fetching a partition that reached its bounded end; what it
/// fetched past the end is left for a later run (the position stays).
fn pause(consumer: &KafkaConsumer, p: &Partition, name: &str) {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(&p.0, p.1);
    if let Err(e) = consumer.pause(&tpl) {
        tracing::debug!(source = %name, topic = %p.0, partition = p.1, error = %e, "pausing a partition at its bounded end failed");
    }
}

/// The longest pause between retries of a transient consumer error.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Pauses after transient consumer errors, growing while they come in a
/// row: 20 ms, 40 ms, ... up to [`MAX_RETRY_PAUSE`].
#[derive(Debug, Default)]
struct Retry {
    in_a_row: u32,
    until: Option<Instant>,
}

impl Retry {
    fn failed(&mut self, name: &str, e: &KafkaError) {
        self.in_a_row = self.in_a_row.saturating_add(1);
        let pause = Duration::from_millis(10u64 << self.in_a_row.min(10)).min(MAX_RETRY_PAUSE);
        // The first of a run, then at powers of two: a broker down for
        // minutes is a few lines, not thousands.
        if self.in_a_row.is_power_of_two() {
            tracing::warn!(source = %name, error = %e, in_a_row = self.in_a_row, pause_ms = pause.as_millis() as u64, "kafka consumer reported an error; retrying");
        }
        self.until = Some(Instant::now() + pause);
    }

    fn succeeded(&mut self) {
        self.in_a_row = 0;
    }
}

/// The check for deleted topics when partition discovery is off: only
/// after an error names an unknown topic.
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// Finds partitions added to the source's topics and topics deleted, on
/// tokio's blocking pool (metadata requests block for up to the request
/// time-out).
struct Discovery {
    /// The client that asks for metadata (never the reader's).
    client: Arc<DropAside<KafkaConsumer>>,
    every: Option<Duration>,
    /// Whether new partitions are read (unbounded runs), or only deleted
    /// topics watched for (bounded runs read what was there at start).
    adds: bool,
    next_at: Instant,
    pending: Option<tokio::task::JoinHandle<StreamResult<Found>>>,
    /// Every partition of the topics, as last seen.
    known: BTreeSet<Partition>,
    config: KafkaSourceConfig,
    parallelism: usize,
    subtask: usize,
    /// `tinyflow_kafka_partitions_discovered_total`.
    found: metrics::Counter,
}

/// What a discovery round found: every partition, and the earliest offsets
/// of the new ones this subtask owns.
struct Found {
    all: Vec<Partition>,
    new: BTreeMap<Partition, i64>,
}

impl Discovery {
    /// Starts a round when one is due, and returns the new partitions of a
    /// round that finished (with their start offsets). A deleted topic
    /// fails the attempt for good. Cancel safe: nothing is awaited.
    async fn poll(&mut self, name: &str) -> StreamResult<Option<BTreeMap<Partition, i64>>> {
        if let Some(pending) = &self.pending {
            if !pending.is_finished() {
                return Ok(None);
            }
            let pending = self.pending.take().expect("checked above");
            // Finished: the await returns at once.
            let found = match pending.await {
                Ok(found) => found,
                Err(e) => {
                    tracing::warn!(source = %name, error = %e, "partition discovery did not finish");
                    return Ok(None);
                }
            };
            return match found {
                Ok(found) => {
                    self.known = found.all.into_iter().collect();
                    let new = if self.adds {
                        found.new
                    } else {
                        BTreeMap::new()
                    };
                    if !new.is_empty() {
                        self.found.increment(new.len() as u64);
                    }
                    Ok(Some(new).filter(|n| !n.is_empty()))
                }
                Err(e @ StreamError::Config { .. }) => Err(e),
                Err(e) => {
                    tracing::warn!(source = %name, error = %e, "partition discovery failed; trying again later");
                    Ok(None)
                }
            };
        }
        let now = Instant::now();
        if now < self.next_at {
            return Ok(None);
        }
        self.next_at = now + self.every.unwrap_or(NEVER);
        let config = self.config.clone();
        let consumer = Arc::clone(&self.client);
        let known = self.known.clone();
        let (parallelism, subtask, adds) = (self.parallelism, self.subtask, self.adds);
        let name = name.to_owned();
        self.pending = Some(tokio::task::spawn_blocking(move || {
            let all = config.partitions(&consumer, &name).map_err(|e| match e {
                StreamError::Config { key, message } => StreamError::Config {
                    key,
                    message: format!(
                        "{message}; the job read it before, so it was deleted or made \
                         unavailable meanwhile"
                    ),
                },
                e => e,
            })?;
            let new: Vec<Partition> = all
                .iter()
                .filter(|p| !known.contains(*p) && config.reads(&p.0, p.1, parallelism, subtask))
                .cloned()
                .collect();
            let new = if adds && !new.is_empty() {
                config.start_offsets(&consumer, &name, &StartPosition::Earliest, &new)?
            } else {
                BTreeMap::new()
            };
            Ok(Found { all, new })
        }));
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use crate::config::owner;
    use tinyflow_api::Worker;

    #[test]
    fn workers_share_the_partitions_and_a_worker_s_parallelism_moves_none() {
        let topics = ["bids", "orders-v2", "a"];
        for workers in 1..=5u32 {
            // Each partition is read by exactly one subtask of one worker,
            // whatever each worker's parallelism.
            for parallelism in [1usize, 2, 3] {
                for topic in topics {
                    for p in 0..24 {
                        let readers: Vec<(u32, usize)> = (0..workers)
                            .flat_map(|w| (0..parallelism).map(move |s| (w, s)))
                            .filter(|&(w, s)| {
                                let mut c = KafkaSourceConfig::new("b", &[topic], "g");
                                c.worker = Worker::new(w, workers).unwrap();
                                c.reads(topic, p, parallelism, s)
                            })
                            .collect();
                        assert_eq!(
                            readers.len(),
                            1,
                            "{topic}/{p} over {workers}x{parallelism}: {readers:?}"
                        );
                    }
                }
            }
            // A worker's share depends on the number of workers alone, and
            // is even.
            let share = |w: u32, parallelism: usize| -> Vec<i32> {
                let mut c = KafkaSourceConfig::new("b", &["bids"], "g");
                c.worker = Worker::new(w, workers).unwrap();
                (0..12)
                    .filter(|&p| (0..parallelism).any(|s| c.reads("bids", p, parallelism, s)))
                    .collect()
            };
            let sizes: Vec<usize> = (0..workers).map(|w| share(w, 1).len()).collect();
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(max - min <= 1, "{workers} workers: {sizes:?}");
            for w in 0..workers {
                assert_eq!(share(w, 1), share(w, 3), "worker {w} of {workers}");
            }
        }
        // One worker deals exactly as a job in one process always did.
        let c = KafkaSourceConfig::new("b", &["bids"], "g");
        for p in 0..12 {
            for s in 0..3 {
                assert_eq!(c.reads("bids", p, 3, s), owner("bids", p, 3) == s);
            }
        }
    }

    #[test]
    fn partitions_are_dealt_evenly_and_a_new_one_moves_no_other() {
        for parallelism in 1..=5 {
            for topic in ["bids", "a/b", "orders-v2"] {
                let owners: Vec<usize> = (0..12).map(|p| owner(topic, p, parallelism)).collect();
                let mut counts = vec![0; parallelism];
                for o in &owners {
                    counts[*o] += 1;
                }
                let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
                assert!(max - min <= 1, "{topic} over {parallelism}: {counts:?}");
                // The owner of a partition depends on nothing but the
                // topic, the partition and the parallelism.
                assert_eq!(owners[3], owner(topic, 3, parallelism));
            }
        }
        // Topics start at different subtasks, so single-partition topics
        // spread too.
        let starts: std::collections::BTreeSet<usize> = ["a", "b", "c", "d", "e", "f"]
            .iter()
            .map(|t| owner(t, 0, 3))
            .collect();
        assert!(starts.len() > 1, "{starts:?}");
    }

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
