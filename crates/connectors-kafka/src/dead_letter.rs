//! The dead-letter producer of the `dead-letter` bad-record policy:
//! transactional, so each bad record lands in the dead-letter topic once.
//!
//! A transaction begins with the first dead letter after a checkpoint and
//! is committed in the source's `snapshot`, before the positions are
//! taken: a checkpoint's positions only cover bad records whose dead
//! letters are committed. The `transactional.id` is the consumer group's,
//! the operator's and the subtask's, stable across restarts, so a restarted
//! subtask's `init_transactions` aborts what its predecessor left open.
//!
//! What remains is a checkpoint that failed after its snapshot committed
//! dead letters: the restart reads those bad records again. So the
//! checkpoint state holds, per dead-letter partition, a floor below which
//! no dead letter matters to a restore of it (`DeadLetterState`); a
//! restored subtask reads the topic (`read_committed`, on a thread of its
//! own, before the source reads) from the lowest floor of all old subtasks
//! up to the end offsets seen at start, collects the origins
//! (`tinyflow.source.*` headers, same `tinyflow.group`) found there, and
//! sends no bad record whose origin is among them. Without such a
//! checkpoint (a restart before the first one completed), the floor is
//! where the topic ended at the job's first start, kept as the committed
//! offsets of a consumer group of its own.
//!
//! A dead letter larger than the topic's `max.message.bytes` (or the
//! producer's `message.max.bytes`) is sent with its value truncated to fit
//! and headers `tinyflow.truncated=true` and `tinyflow.original.bytes`.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use tinyflow_api::{OperatorContext, StreamError, StreamResult, Worker};

use crate::client::{DropAside, Partition, external};
use crate::config::KafkaSourceConfig;
use crate::state::{self, DeadLetterState};

/// Counts deliveries that failed, keeping the last reason.
#[derive(Default)]
pub(crate) struct Deliveries {
    failed: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl Deliveries {
    /// How many deliveries failed so far.
    pub(crate) fn failed(&self) -> u64 {
        self.failed.load(Ordering::SeqCst)
    }

    /// The reason of the last failed delivery.
    pub(crate) fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((e, _)) = result {
            self.failed.fetch_add(1, Ordering::SeqCst);
            *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        }
    }
}

/// Queues `record`, serving delivery reports and waiting while the
/// producer's queue is full.
pub(crate) fn send_with_room<C: ProducerContext>(
    producer: &BaseProducer<C>,
    mut record: BaseRecord<'_, [u8], [u8], C::DeliveryOpaque>,
) -> Result<(), KafkaError> {
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                producer.poll(Duration::from_millis(10));
                record = r;
            }
            Err((e, _)) => return Err(e),
        }
    }
}

/// The producer's `message.max.bytes` when `properties` do not set it
/// (librdkafka's default).
const DEFAULT_MESSAGE_MAX_BYTES: usize = 1_000_000;

/// Bytes a record batch of one record takes besides key, value and headers
/// (61 bytes of batch header, the record's varints), rounded up.
const RECORD_OVERHEAD: usize = 128;

/// Bytes one header takes besides its key and value (varints), rounded up.
const HEADER_OVERHEAD: usize = 8;

/// How long a restored subtask reads the dead-letter topic for the dead
/// letters written before it at most: longer than librdkafka's default
/// `transaction.timeout.ms` (60 s), after which a transaction left open by
/// a process that died no longer holds back `read_committed` readers.
const SCAN_TIMEOUT: Duration = Duration::from_secs(120);

/// The shortest time `init_transactions` gets: it waits until the
/// transaction a predecessor left open is aborted.
const MIN_INIT_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether a producer error says a newer producer with the same
/// `transactional.id` took over: Kafka's own epoch fencing, which a newer
/// run of the job (its `init_transactions`) sets off.
fn is_fenced(code: Option<RDKafkaErrorCode>) -> bool {
    matches!(
        code,
        Some(
            RDKafkaErrorCode::Fenced
                | RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
        )
    )
}

/// A transaction step's error: [`StreamError::Fenced`] (for good: a restart
/// would fence the newer run's producer in turn) when a newer run took the
/// producer's `transactional.id` over, else retryable.
fn transaction_error(name: &str, action: String, e: &KafkaError) -> StreamError {
    if is_fenced(e.rdkafka_error_code()) {
        StreamError::Fenced {
            operator: name.to_owned(),
            message: format!(
                "a newer run of the job took over its dead-letter producer while {action} ({e}); this run stops for good"
            ),
        }
    } else {
        external(name, action, e.clone(), true)
    }
}

/// The `transactional.id` of a source subtask's dead-letter producer; a
/// worker of several has its own (worker `0/1` keeps the id of a job in one
/// process).
fn transactional_id(group: &str, operator: &str, worker: Worker, subtask: usize) -> String {
    if worker.is_single() {
        format!("tinyflow-dead-letter.{group}.{operator}.{subtask}")
    } else {
        format!(
            "tinyflow-dead-letter.{group}.{operator}.w{}of{}.{subtask}",
            worker.index(),
            worker.count()
        )
    }
}

/// An offset per partition of the dead-letter topic.
type Offsets = BTreeMap<i32, i64>;

/// (topic, partition, offset) of a bad record.
type Origin = (String, i32, i64);

/// What a restored subtask knows of the dead letters written before it.
struct Restored {
    /// Where to start reading, per dead-letter partition: the lowest floor
    /// of the restored states.
    floors: BTreeMap<i32, i64>,
    /// The reading of the topic, while it goes on.
    reading: Option<ReadBack>,
    /// Origins of dead letters in the topic that this subtask may read
    /// again and must not send twice; complete once `reading` is `None`.
    present: BTreeSet<Origin>,
}

/// The topic read back on a thread of its own, from the subtask's start: it
/// may have to wait for transactions that other subtasks of the job opened
/// meanwhile to commit at their next checkpoint, which must not wait for
/// it in turn (a blocked runtime worker could be the one they need).
struct ReadBack {
    result: std::sync::mpsc::Receiver<StreamResult<BTreeSet<Origin>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ReadBack {
    fn start(
        reader: ClientConfig,
        topic: String,
        group: String,
        floors: Offsets,
        ends: Offsets,
        name: String,
    ) -> StreamResult<Self> {
        let (tx, result) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let subtask = name.clone();
        let thread = std::thread::Builder::new()
            .name("dead-letter-read-back".into())
            .spawn(move || {
                let _ = tx.send(read_back(
                    &reader, &topic, &group, &floors, &ends, &subtask, &stopped,
                ));
            })
            .map_err(|e| {
                external(
                    &name,
                    "starting to read the dead-letter topic back",
                    e,
                    true,
                )
            })?;
        Ok(ReadBack {
            result,
            stop,
            thread: Some(thread),
        })
    }

    /// The origins found, once the reading is over; `None` while it goes
    /// on.
    fn poll(&mut self, name: &str) -> Option<StreamResult<BTreeSet<Origin>>> {
        use std::sync::mpsc::TryRecvError;
        let out = match self.result.try_recv() {
            Ok(r) => r,
            Err(TryRecvError::Empty) => return None,
            Err(TryRecvError::Disconnected) => Err(external(
                name,
                "reading the dead-letter topic back",
                "the reading thread ended without a result",
                true,
            )),
        };
        self.join();
        Some(out)
    }

    /// Waits for the result on this thread.
    fn wait(&mut self, name: &str) -> StreamResult<BTreeSet<Origin>> {
        let out = self.result.recv().unwrap_or_else(|_| {
            Err(external(
                name,
                "reading the dead-letter topic back",
                "the reading thread ended without a result",
                true,
            ))
        });
        self.join();
        out
    }

    fn join(&mut self) {
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::warn!("the thread reading the dead-letter topic back panicked");
        }
    }
}

impl Drop for ReadBack {
    /// Stops the reading (it checks every 100 ms) and joins it.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.join();
    }
}

/// Sends bad records to a topic, in transactions; see the module docs and
/// [`BadRecordPolicy::DeadLetter`](crate::BadRecordPolicy::DeadLetter).
pub(crate) struct DeadLetter {
    /// The job's consumer group, in the `tinyflow.group` header: only dead
    /// letters of the same group count as written already.
    group: String,
    pub(crate) topic: String,
    producer: DropAside<BaseProducer<Deliveries>>,
    /// Whether a transaction is open (it holds `sent` dead letters).
    in_transaction: bool,
    sent: u64,
    /// The largest dead letter the topic and the producer accept.
    max_bytes: usize,
    /// End offsets of the dead-letter partitions after `init_transactions`:
    /// every later dead letter of this subtask lands at or after them.
    ends: BTreeMap<i32, i64>,
    restored: Option<Restored>,
}

impl DeadLetter {
    /// Connects, checks that `topic` exists, aborts what earlier attempts
    /// left open, and learns the topic's end offsets and message limit.
    pub(crate) fn new(
        config: &KafkaSourceConfig,
        topic: &str,
        name: &str,
        ctx: &OperatorContext,
        restored: &[Vec<u8>],
    ) -> StreamResult<Self> {
        let init_timeout = config.request_timeout.max(MIN_INIT_TIMEOUT);
        let id = transactional_id(&config.group_id, &ctx.name, config.worker, ctx.subtask);
        let max_bytes = max_message_bytes(config, topic, name);
        let producer = transactional_producer(config, topic, name, &id, max_bytes)?;
        // A missing topic would only show when a bad record comes, as a
        // delivery timeout; say it at start.
        let md = producer
            .client()
            .fetch_metadata(Some(topic), config.request_timeout)
            .map_err(|e| {
                external(
                    name,
                    format!("fetching metadata of dead-letter topic {topic:?}"),
                    e,
                    true,
                )
            })?;
        let found = md.topics().iter().find(|t| t.name() == topic);
        let partitions: Vec<i32> = match found {
            Some(t) if t.error().is_none() && !t.partitions().is_empty() => {
                t.partitions().iter().map(|p| p.id()).collect()
            }
            _ => {
                return Err(StreamError::Config {
                    key: "source.bad_records",
                    message: format!(
                        "{name}: dead-letter topic {topic:?} does not exist on {} ({:?}); create it first",
                        config.bootstrap_servers,
                        found.and_then(|t| t.error())
                    ),
                });
            }
        };
        // Aborts the transaction this subtask's predecessor left open.
        producer.init_transactions(init_timeout).map_err(|e| {
            external(
                name,
                format!("initializing transactions of dead-letter producer {id:?}"),
                e,
                true,
            )
        })?;
        let mut floors: Option<BTreeMap<i32, i64>> = None;
        for s in restored {
            let s = state::decode(s).map_err(|e| StreamError::State {
                operator: name.to_owned(),
                action: "decoded",
                message: e.to_string(),
            })?;
            if let Some(dl) = s.dead_letter.filter(|dl| dl.topic == topic) {
                let floors = floors.get_or_insert_with(BTreeMap::new);
                for (p, o) in dl.floors {
                    floors.entry(p).and_modify(|f| *f = o.min(*f)).or_insert(o);
                }
            }
        }
        if floors.is_some() {
            // Fewer subtasks than before: the ids no subtask owns any more
            // may hold open transactions that would hold back the readers
            // of the topic until they time out. Subtask i aborts those of
            // the old subtasks j > parallelism with j % parallelism == i.
            for j in
                (ctx.parallelism..restored.len()).filter(|j| j % ctx.parallelism == ctx.subtask)
            {
                let old = transactional_id(&config.group_id, &ctx.name, config.worker, j);
                let orphan = transactional_producer(config, topic, name, &old, max_bytes)?;
                orphan.init_transactions(init_timeout).map_err(|e| {
                    external(
                        name,
                        format!("aborting what dead-letter producer {old:?} left open"),
                        e,
                        true,
                    )
                })?;
                drop(DropAside::new(orphan));
            }
        }
        let first_start = first_start_group(&config.group_id, &ctx.name);
        let (ends, first_floors) = end_offsets(config, topic, name, &partitions, &first_start)?;
        // Without a checkpoint that knows the topic (a restart before the
        // first checkpoint completed, or a lost checkpoint directory), an
        // earlier attempt may have committed dead letters anywhere after
        // the topic's end at the job's first start.
        let floors = floors.or(first_floors);
        let mut reader = config.client_config(&[
            ("group.id", &format!("{id}.restore")),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            ("auto.offset.reset", "earliest"),
            ("enable.partition.eof", "false"),
        ]);
        reader.set("isolation.level", "read_committed");
        let restored = floors
            .map(|floors| -> StreamResult<Restored> {
                Ok(Restored {
                    reading: Some(ReadBack::start(
                        reader,
                        topic.to_owned(),
                        config.group_id.clone(),
                        floors.clone(),
                        ends.clone(),
                        name.to_owned(),
                    )?),
                    floors,
                    present: BTreeSet::new(),
                })
            })
            .transpose()?;
        Ok(DeadLetter {
            group: config.group_id.clone(),
            topic: topic.to_owned(),
            producer: DropAside::new(producer),
            in_transaction: false,
            sent: 0,
            max_bytes,
            ends,
            restored,
        })
    }

    /// Queues `msg` with `reason` and its origin in headers, in the open
    /// transaction; `false` when its dead letter is in the topic already
    /// (written before a restart).
    pub(crate) fn send(
        &mut self,
        msg: &BorrowedMessage<'_>,
        reason: &str,
        name: &str,
    ) -> StreamResult<bool> {
        if let Some(restored) = &mut self.restored {
            // The source waits for the reading before it reads (`ready`);
            // this is for a caller that did not.
            if let Some(mut reading) = restored.reading.take() {
                restored.present = reading.wait(name)?;
            }
            let origin = (msg.topic().to_owned(), msg.partition(), msg.offset());
            if restored.present.remove(&origin) {
                return Ok(false);
            }
        }
        if !self.in_transaction {
            self.producer.begin_transaction().map_err(|e| {
                transaction_error(
                    name,
                    format!(
                        "beginning a transaction on dead-letter topic {:?}",
                        self.topic
                    ),
                    &e,
                )
            })?;
            self.in_transaction = true;
        }
        let partition = msg.partition().to_string();
        let offset = msg.offset().to_string();
        let timestamp = msg.timestamp().to_millis().map(|t| t.to_string());
        let ours = [
            ("tinyflow.error", Some(reason)),
            ("tinyflow.group", Some(self.group.as_str())),
            ("tinyflow.source.topic", Some(msg.topic())),
            ("tinyflow.source.partition", Some(partition.as_str())),
            ("tinyflow.source.offset", Some(offset.as_str())),
            ("tinyflow.source.timestamp", timestamp.as_deref()),
        ];
        let payload = msg.payload();
        let fit = fit(self.max_bytes, msg, &ours);
        let mut headers = OwnedHeaders::new();
        // The record's own headers (none when a header name is not UTF-8,
        // which rdkafka cannot hand over; see `headers_of`).
        if fit.keep_key_and_headers {
            for (key, value) in crate::decode::headers_of(msg).unwrap_or_default() {
                headers = headers.insert(Header { key, value });
            }
        }
        for (key, value) in ours {
            if let Some(value) = value {
                headers = headers.insert(Header {
                    key,
                    value: Some(value),
                });
            }
        }
        let original = payload.map_or(0, <[u8]>::len).to_string();
        if fit.truncated {
            for (key, value) in [
                ("tinyflow.truncated", "true"),
                ("tinyflow.original.bytes", original.as_str()),
            ] {
                headers = headers.insert(Header {
                    key,
                    value: Some(value),
                });
            }
        }
        let mut record = BaseRecord::<[u8], [u8]>::to(&self.topic).headers(headers);
        if fit.keep_key_and_headers
            && let Some(key) = msg.key()
        {
            record = record.key(key);
        }
        if let Some(payload) = payload {
            record = record.payload(&payload[..fit.value_bytes.min(payload.len())]);
        }
        send_with_room(&self.producer, record).map_err(|e| {
            transaction_error(
                name,
                format!("sending a bad record to dead-letter topic {:?}", self.topic),
                &e,
            )
        })?;
        if fit.truncated {
            tracing::debug!(source = %name, topic = msg.topic(), partition = msg.partition(), offset = msg.offset(), bytes = %original, max_bytes = self.max_bytes, "bad record larger than the dead-letter topic takes: sent truncated");
        }
        self.sent += 1;
        self.producer.poll(Duration::ZERO);
        Ok(true)
    }

    /// Commits the open transaction, if any: every dead letter sent so far
    /// is then in the topic. Fails (retryably) when any was not delivered.
    pub(crate) fn commit(&mut self, name: &str, timeout: Duration) -> StreamResult<()> {
        if self.in_transaction {
            self.producer.commit_transaction(timeout).map_err(|e| {
                transaction_error(
                    name,
                    format!(
                        "committing {} dead letters to topic {:?}",
                        self.sent, self.topic
                    ),
                    &e,
                )
            })?;
            tracing::debug!(source = %name, dead_letter = %self.topic, letters = self.sent, "dead letters committed");
            self.in_transaction = false;
            self.sent = 0;
        }
        let failed = self.producer.context().failed();
        if failed > 0 {
            let last = self.producer.context().last_error();
            return Err(external(
                name,
                format!("delivering dead letters to topic {:?}", self.topic),
                format!("{failed} not delivered, last: {}", last.unwrap_or_default()),
                true,
            ));
        }
        Ok(())
    }

    /// The dead-letter state of a checkpoint at `positions`, taken after
    /// [`DeadLetter::commit`].
    pub(crate) fn state(&mut self, positions: &BTreeMap<Partition, i64>) -> DeadLetterState {
        let floors = match &mut self.restored {
            Some(restored) => {
                let scanned = restored.reading.is_none();
                if scanned {
                    // Dead letters of bad records this subtask has read past,
                    // or does not own, are no concern of its checkpoints.
                    let at: BTreeMap<(&str, i32), i64> = positions
                        .iter()
                        .map(|((t, p), o)| ((&**t, *p), *o))
                        .collect();
                    restored
                        .present
                        .retain(|(t, p, o)| at.get(&(t.as_str(), *p)).is_some_and(|pos| o >= pos));
                }
                if scanned && restored.present.is_empty() {
                    self.restored = None;
                    &self.ends
                } else {
                    &restored.floors
                }
            }
            None => &self.ends,
        };
        DeadLetterState {
            topic: self.topic.clone(),
            floors: floors.iter().map(|(p, o)| (*p, *o)).collect(),
        }
    }

    /// Whether the source may read: not while the topic is being read
    /// back after a restore. Waits a little for it. Cancel safe.
    pub(crate) async fn ready(&mut self, name: &str) -> StreamResult<bool> {
        let Some(restored) = &mut self.restored else {
            return Ok(true);
        };
        let Some(reading) = &mut restored.reading else {
            return Ok(true);
        };
        match reading.poll(name) {
            Some(present) => {
                restored.present = present?;
                restored.reading = None;
                Ok(true)
            }
            None => {
                tokio::time::sleep(READ_BACK_POLL).await;
                Ok(false)
            }
        }
    }
}

/// How often a source waiting for the read-back looks again.
const READ_BACK_POLL: Duration = Duration::from_millis(10);

/// Reads `topic` (`read_committed`) from `floors` up to `ends`: the
/// origins of the dead letters `group` wrote there. Gives up when `stop`
/// is set.
fn read_back(
    reader: &ClientConfig,
    topic: &str,
    group: &str,
    floors: &Offsets,
    ends: &Offsets,
    name: &str,
    stop: &AtomicBool,
) -> StreamResult<BTreeSet<Origin>> {
    let mut remaining: Offsets = ends
        .iter()
        .filter(|(p, end)| floors.get(p).is_none_or(|f| f < end))
        .map(|(p, end)| (*p, *end))
        .collect();
    let mut present = BTreeSet::new();
    if remaining.is_empty() {
        return Ok(present);
    }
    let what = || format!("reading dead-letter topic {topic:?} back after a restore");
    let consumer: BaseConsumer = reader
        .create()
        .map_err(|e| external(name, what(), e, false))?;
    let consumer = DropAside::new(consumer);
    let mut tpl = TopicPartitionList::new();
    for p in remaining.keys() {
        let from = floors.get(p).copied().unwrap_or(0);
        tpl.add_partition_offset(topic, *p, Offset::Offset(from))
            .map_err(|e| external(name, what(), e, false))?;
    }
    consumer
        .assign(&tpl)
        .map_err(|e| external(name, what(), e, true))?;
    let started = std::time::Instant::now();
    let mut read = 0u64;
    while !remaining.is_empty() {
        if stop.load(Ordering::SeqCst) {
            return Err(external(name, what(), "stopped", true));
        }
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                read += 1;
                if let Some(origin) = origin_of(&m, group) {
                    present.insert(origin);
                }
                if remaining
                    .get(&m.partition())
                    .is_some_and(|end| m.offset() + 1 >= *end)
                {
                    remaining.remove(&m.partition());
                }
            }
            Some(Err(e)) => {
                tracing::debug!(source = %name, error = %e, "reading the dead-letter topic back");
            }
            None => {
                // Transaction markers and aborted records move the
                // position without a message.
                let at = consumer
                    .position()
                    .map_err(|e| external(name, what(), e, true))?;
                for e in at.elements_for_topic(topic) {
                    if let Offset::Offset(o) = e.offset()
                        && remaining.get(&e.partition()).is_some_and(|end| o >= *end)
                    {
                        remaining.remove(&e.partition());
                    }
                }
            }
        }
        if !remaining.is_empty() && started.elapsed() > SCAN_TIMEOUT {
            return Err(external(
                name,
                what(),
                format!(
                    "not at the end offsets {remaining:?} after {} s (a transaction left open?)",
                    SCAN_TIMEOUT.as_secs()
                ),
                true,
            ));
        }
    }
    tracing::info!(source = %name, dead_letter = %topic, read, already_there = present.len(), secs = started.elapsed().as_secs_f64(), "read the dead-letter topic back after a restore: bad records found there are not sent again");
    Ok(present)
}

/// A transactional producer to `topic` with `id`.
fn transactional_producer(
    config: &KafkaSourceConfig,
    topic: &str,
    name: &str,
    id: &str,
    max_bytes: usize,
) -> StreamResult<BaseProducer<Deliveries>> {
    // The topic's limit applies to a batch: keep batches within it.
    let batch = max_bytes.to_string();
    config
        .client_config(&[
            ("enable.idempotence", "true"),
            ("transactional.id", id),
            ("batch.size", &batch),
        ])
        .create_with_context::<_, BaseProducer<Deliveries>>(Deliveries::default())
        .map_err(|e| {
            config.rejected(
                name,
                &format!("producer for dead-letter topic {topic:?}"),
                e,
            )
        })
}

/// The consumer group that keeps, as its committed offsets on the
/// dead-letter topic, where the topic ended when the job first started.
fn first_start_group(group: &str, operator: &str) -> String {
    format!("tinyflow-dead-letter.{group}.{operator}")
}

/// The high watermarks of `partitions` of `topic` (not the last stable
/// offsets, which transactions left open would hold back), and the floors
/// of a start without checkpoint: where the topic ended when the job first
/// started, as consumer group `first_start` keeps them. At the first start
/// ever there are none: the ends are committed to the group and there is
/// nothing to read back (`None`).
fn end_offsets(
    config: &KafkaSourceConfig,
    topic: &str,
    name: &str,
    partitions: &[i32],
    first_start: &str,
) -> StreamResult<(Offsets, Option<Offsets>)> {
    let mut cc =
        config.client_config(&[("group.id", first_start), ("enable.auto.commit", "false")]);
    cc.set("isolation.level", "read_uncommitted");
    let consumer: BaseConsumer = cc
        .create()
        .map_err(|e| config.rejected(name, "consumer of the dead-letter topic", e))?;
    let mut ends = BTreeMap::new();
    for p in partitions {
        let (_, high) = consumer
            .fetch_watermarks(topic, *p, config.request_timeout)
            .map_err(|e| {
                external(
                    name,
                    format!("fetching end offsets of dead-letter topic {topic}/{p}"),
                    e,
                    true,
                )
            })?;
        ends.insert(*p, high);
    }
    let what = || {
        format!("the first-start offsets of dead-letter topic {topic:?} (group {first_start:?})")
    };
    let mut tpl = TopicPartitionList::new();
    for p in partitions {
        tpl.add_partition(topic, *p);
    }
    let committed = consumer
        .committed_offsets(tpl, config.request_timeout)
        .map_err(|e| external(name, format!("reading {}", what()), e, true))?;
    let mut floors = BTreeMap::new();
    for e in committed.elements_for_topic(topic) {
        if let Offset::Offset(o) = e.offset() {
            floors.insert(e.partition(), o);
        }
    }
    let floors = if floors.is_empty() {
        let mut tpl = TopicPartitionList::new();
        for (p, o) in &ends {
            tpl.add_partition_offset(topic, *p, Offset::Offset(*o))
                .map_err(|e| external(name, format!("committing {}", what()), e, false))?;
        }
        consumer
            .commit(&tpl, CommitMode::Sync)
            .map_err(|e| external(name, format!("committing {}", what()), e, true))?;
        None
    } else {
        Some(floors)
    };
    drop(DropAside::new(consumer));
    Ok((ends, floors))
}

/// The largest dead letter `topic` and the producer accept: the smaller of
/// the topic's `max.message.bytes` and the producer's `message.max.bytes`.
/// When the topic's setting cannot be read, the producer's, with a warning.
fn max_message_bytes(config: &KafkaSourceConfig, topic: &str, name: &str) -> usize {
    let producer_max = config
        .properties
        .get("message.max.bytes")
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_MESSAGE_MAX_BYTES);
    let topic_max = (|| -> Result<usize, String> {
        let admin: AdminClient<DefaultClientContext> = config
            .client_config(&[])
            .create()
            .map_err(|e| e.to_string())?;
        let opts = AdminOptions::new().request_timeout(Some(config.request_timeout));
        let results = block_on(admin.describe_configs([&ResourceSpecifier::Topic(topic)], &opts))
            .map_err(|e| e.to_string())?;
        let resource = results
            .into_iter()
            .next()
            .ok_or("no result")?
            .map_err(|e| e.to_string())?;
        resource
            .get("max.message.bytes")
            .and_then(|e| e.value.as_deref())
            .ok_or("no max.message.bytes")?
            .parse()
            .map_err(|e: std::num::ParseIntError| e.to_string())
    })();
    match topic_max {
        Ok(t) => t.min(producer_max),
        Err(e) => {
            tracing::warn!(source = %name, dead_letter = %topic, error = %e, max_bytes = producer_max, "cannot read the dead-letter topic's max.message.bytes; dead letters are truncated to the producer's message.max.bytes");
            producer_max
        }
    }
}

/// How a dead letter fits the topic's limit.
#[derive(Debug, PartialEq, Eq)]
struct Fit {
    /// Bytes of the value to send.
    value_bytes: usize,
    truncated: bool,
    /// False when the key and original headers alone do not fit: they are
    /// left out.
    keep_key_and_headers: bool,
}

/// How much of `msg` a dead letter of at most `max_bytes` with headers
/// `ours` can carry.
fn fit(max_bytes: usize, msg: &BorrowedMessage<'_>, ours: &[(&str, Option<&str>)]) -> Fit {
    let theirs: Vec<(usize, usize)> = crate::decode::headers_of(msg)
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k.len(), v.map_or(0, <[u8]>::len)))
        .collect();
    fit_sizes(
        max_bytes,
        msg.payload().map_or(0, <[u8]>::len),
        msg.key().map_or(0, <[u8]>::len),
        &theirs,
        ours.iter()
            .map(|(k, v)| k.len() + v.map_or(0, str::len) + HEADER_OVERHEAD)
            .sum(),
    )
}

/// [`fit`] on sizes: a value of `value` bytes, a key of `key` bytes, the
/// original headers' (key, value) sizes, and `ours` bytes of our headers.
fn fit_sizes(
    max_bytes: usize,
    value: usize,
    key: usize,
    theirs: &[(usize, usize)],
    ours: usize,
) -> Fit {
    let fixed = RECORD_OVERHEAD + ours;
    let kept = key
        + theirs
            .iter()
            .map(|(k, v)| k + v + HEADER_OVERHEAD)
            .sum::<usize>();
    if fixed + kept + value <= max_bytes {
        return Fit {
            value_bytes: value,
            truncated: false,
            keep_key_and_headers: true,
        };
    }
    // `tinyflow.truncated` and `tinyflow.original.bytes` with their values.
    let marks =
        2 * HEADER_OVERHEAD + "tinyflow.truncated".len() + 4 + "tinyflow.original.bytes".len() + 20;
    let keep_key_and_headers = fixed + marks + kept <= max_bytes;
    let used = fixed + marks + if keep_key_and_headers { kept } else { 0 };
    Fit {
        value_bytes: max_bytes.saturating_sub(used).min(value),
        truncated: true,
        keep_key_and_headers,
    }
}

/// The origin a dead letter's headers name, if `group` wrote it.
fn origin_of(m: &BorrowedMessage<'_>, group: &str) -> Option<Origin> {
    let headers = m.headers()?;
    let get = |key: &str| {
        headers
            .iter()
            .filter(|h| h.key == key)
            .last()
            .and_then(|h| std::str::from_utf8(h.value?).ok())
    };
    if get("tinyflow.group")? != group {
        return None;
    }
    Some((
        get("tinyflow.source.topic")?.to_owned(),
        get("tinyflow.source.partition")?.parse().ok()?,
        get("tinyflow.source.offset")?.parse().ok()?,
    ))
}

/// Runs `f` to completion on this thread: for the admin client's futures,
/// which librdkafka's own thread completes, from synchronous code.
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_too_large_is_truncated_to_fit_with_room_for_its_marks() {
        let ours = 300;
        // Fits: unchanged.
        assert_eq!(
            fit_sizes(2048, 1000, 10, &[(4, 20)], ours),
            Fit {
                value_bytes: 1000,
                truncated: false,
                keep_key_and_headers: true
            }
        );
        // Too large: the value is cut so that the whole stays within the
        // limit, marks included.
        let f = fit_sizes(2048, 10_000, 10, &[(4, 20)], ours);
        assert!(f.truncated && f.keep_key_and_headers, "{f:?}");
        assert!(f.value_bytes > 1000 && f.value_bytes < 2048 - ours, "{f:?}");
        // Key and headers that alone exceed the limit are left out.
        let f = fit_sizes(2048, 10, 5000, &[], ours);
        assert!(f.truncated && !f.keep_key_and_headers, "{f:?}");
        assert_eq!(f.value_bytes, 10);
    }
}
