//! Helpers for tests against a real broker (feature `testing`): create a
//! topic, produce records to given partitions.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

use crate::dead_letter::send_with_room;

/// The broker address for tests: `KAFKA_BOOTSTRAP`, as `cargo xtask kafka
/// start` prints it (and `cargo xtask ci` exports it).
///
/// # Panics
/// When it is not set: a test that needs the broker fails loudly rather
/// than skipping.
pub fn bootstrap() -> String {
    std::env::var("KAFKA_BOOTSTRAP").unwrap_or_else(|_| {
        panic!(
            "KAFKA_BOOTSTRAP is not set: these tests need a real Kafka broker. \
             Run `cargo xtask ci` (it starts one), or `cargo xtask kafka start` and export the line it prints"
        )
    })
}

/// The broker's secured listener (SASL_SSL): what `cargo xtask kafka start
/// --secured` prints and `cargo xtask ci` exports.
#[derive(Debug, Clone)]
pub struct Secured {
    /// `host:port` of the SASL_SSL listener (`KAFKA_SASL_SSL_BOOTSTRAP`).
    pub bootstrap: String,
    /// The PEM file of the CA that signed the broker's certificate
    /// (`KAFKA_SSL_CA`).
    pub ca: String,
    /// A SCRAM-SHA-256/512 (and PLAIN) user (`KAFKA_SASL_USERNAME`).
    pub username: String,
    /// Its password (`KAFKA_SASL_PASSWORD`).
    pub password: String,
}

/// The secured listener of the test broker.
///
/// # Panics
/// When a variable is not set: a test that needs it fails loudly rather
/// than skipping.
pub fn secured() -> Secured {
    let var = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!(
                "{name} is not set: these tests need the broker's SASL_SSL listener. \
                 Run `cargo xtask ci` (it starts the broker with one), or `cargo xtask kafka start --secured` and export the lines it prints"
            )
        })
    };
    Secured {
        bootstrap: var("KAFKA_SASL_SSL_BOOTSTRAP"),
        ca: var("KAFKA_SSL_CA"),
        username: var("KAFKA_SASL_USERNAME"),
        password: var("KAFKA_SASL_PASSWORD"),
    }
}

/// The OpenID Connect identity provider whose tokens the secured listener
/// takes (OAUTHBEARER): what `cargo xtask keycloak start` prints and
/// `cargo xtask ci` exports.
#[derive(Debug, Clone)]
pub struct Oidc {
    /// The issuer, e.g. `http://127.0.0.1:8380/realms/tinyflow`
    /// (`TINYFLOW_OIDC_ISSUER`).
    pub issuer: String,
    /// A confidential client with the client-credentials grant
    /// (`TINYFLOW_OIDC_CLIENT_ID`).
    pub client_id: String,
    /// Its secret (`TINYFLOW_OIDC_CLIENT_SECRET`).
    pub client_secret: String,
}

impl Oidc {
    /// The issuer's token endpoint (Keycloak's layout).
    pub fn token_endpoint(&self) -> String {
        format!("{}/protocol/openid-connect/token", self.issuer)
    }
}

/// The identity provider of the test broker's OAUTHBEARER.
///
/// # Panics
/// When a variable is not set: a test that needs it fails loudly rather
/// than skipping.
pub fn oidc() -> Oidc {
    let var = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!(
                "{name} is not set: these tests need an OpenID Connect provider whose tokens the broker takes. \
                 Run `cargo xtask ci` (it starts both), or `cargo xtask keycloak start`, export the lines it prints, \
                 and start the broker with `cargo xtask kafka start --secured` after that"
            )
        })
    };
    Oidc {
        issuer: var("TINYFLOW_OIDC_ISSUER"),
        client_id: var("TINYFLOW_OIDC_CLIENT_ID"),
        client_secret: var("TINYFLOW_OIDC_CLIENT_SECRET"),
    }
}

/// Creates `topic` with `partitions` partitions (replication 1).
pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) -> Result<(), String> {
    create_topic_with(bootstrap, topic, partitions, &[]).await
}

/// Creates `topic` with `partitions` partitions (replication 1) and topic
/// settings `config`, such as `("max.message.bytes", "2048")`.
pub async fn create_topic_with(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    config: &[(&str, &str)],
) -> Result<(), String> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .map_err(|e| e.to_string())?;
    let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    for (k, v) in config {
        new = new.set(k, v);
    }
    let results = admin
        .create_topics(
            [&new],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .map_err(|e| e.to_string())?;
    for r in results {
        r.map_err(|(t, e)| format!("creating {t}: {e}"))?;
    }
    Ok(())
}

/// Produces `records` as (partition, key, value) and waits until all are
/// acknowledged.
pub fn produce(
    bootstrap: &str,
    topic: &str,
    records: &[(i32, Vec<u8>, Vec<u8>)],
) -> Result<(), String> {
    produce_in_batches_of(bootstrap, topic, DEFAULT_BATCH_BYTES, records)
}

/// librdkafka's default `batch.size`.
const DEFAULT_BATCH_BYTES: usize = 1_000_000;

/// As [`produce`], in producer batches of at most `batch_bytes` (a fetch
/// returns at least one whole batch: small ones keep a consumer from
/// holding much of a topic at once).
pub fn produce_in_batches_of(
    bootstrap: &str,
    topic: &str,
    batch_bytes: usize,
    records: &[(i32, Vec<u8>, Vec<u8>)],
) -> Result<(), String> {
    send_all(
        bootstrap,
        topic,
        &[("batch.size", &batch_bytes.to_string())],
        FLUSH_WITHIN,
        records
            .iter()
            .map(|(p, k, v)| (*p, Some(k.as_slice()), None, Some(v.as_slice()), None)),
    )
    .map(|_| ())
}

/// Produces `records` as (partition, timestamp in ms, value) and waits until
/// all are acknowledged.
pub fn produce_timed(
    bootstrap: &str,
    topic: &str,
    records: &[(i32, i64, Vec<u8>)],
) -> Result<(), String> {
    send_all(
        bootstrap,
        topic,
        &[],
        FLUSH_WITHIN,
        records
            .iter()
            .map(|(p, t, v)| (*p, None::<&[u8]>, Some(*t), Some(v.as_slice()), None)),
    )
    .map(|_| ())
}

/// One record for [`produce_records`]: any of key, value and headers may be
/// missing, and a header may have no value.
#[derive(Debug, Clone, Default)]
pub struct ToProduce {
    /// The partition.
    pub partition: i32,
    /// The key, if any.
    pub key: Option<Vec<u8>>,
    /// The value, if any (none: a tombstone).
    pub value: Option<Vec<u8>>,
    /// The headers, in order; the same name may come more than once.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

/// Produces `records` and waits until all are acknowledged.
pub fn produce_records(bootstrap: &str, topic: &str, records: &[ToProduce]) -> Result<(), String> {
    send_all(
        bootstrap,
        topic,
        &[],
        FLUSH_WITHIN,
        records.iter().map(|r| {
            let headers = r.headers.iter().fold(OwnedHeaders::new(), |h, (k, v)| {
                h.insert(Header {
                    key: k,
                    value: v.as_deref(),
                })
            });
            (
                r.partition,
                r.key.as_deref(),
                None,
                r.value.as_deref(),
                Some(headers),
            )
        }),
    )
    .map(|_| ())
}

/// Produces (partition, value) pairs as `records` yields them, with
/// producer `settings` over the defaults, and waits until all are
/// acknowledged; returns how many. For inputs too large to hold at once.
pub fn produce_stream(
    bootstrap: &str,
    topic: &str,
    settings: &[(&str, &str)],
    records: impl Iterator<Item = (i32, Vec<u8>)>,
) -> Result<u64, String> {
    send_all(
        bootstrap,
        topic,
        settings,
        STREAM_FLUSH_WITHIN,
        records.map(|(p, v)| (p, None::<&[u8]>, None, Some(v), None)),
    )
}

/// How long the producers here wait for the last acknowledgements.
const FLUSH_WITHIN: Duration = Duration::from_secs(60);
/// The same for [`produce_stream`], whose inputs are large.
const STREAM_FLUSH_WITHIN: Duration = Duration::from_secs(300);

fn send_all<K: AsRef<[u8]>, V: AsRef<[u8]>>(
    bootstrap: &str,
    topic: &str,
    settings: &[(&str, &str)],
    flush_within: Duration,
    records: impl Iterator<Item = (i32, Option<K>, Option<i64>, Option<V>, Option<OwnedHeaders>)>,
) -> Result<u64, String> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "5")
        .set("enable.idempotence", "true");
    for (k, v) in settings {
        config.set(*k, *v);
    }
    let producer: BaseProducer = config.create().map_err(|e| e.to_string())?;
    let mut sent = 0u64;
    for (partition, key, timestamp, value, headers) in records {
        let mut record = BaseRecord::<[u8], [u8]>::to(topic).partition(partition);
        if let Some(value) = &value {
            record = record.payload(value.as_ref());
        }
        if let Some(headers) = headers {
            record = record.headers(headers);
        }
        if let Some(key) = &key {
            record = record.key(key.as_ref());
        }
        if let Some(t) = timestamp {
            record = record.timestamp(t);
        }
        send_with_room(&producer, record)
            .map_err(|e| format!("producing record {sent} to {topic}: {e}"))?;
        sent += 1;
        producer.poll(Duration::ZERO);
    }
    producer.flush(flush_within).map_err(|e| e.to_string())?;
    Ok(sent)
}

/// The offsets `group` committed for `topic`'s partitions `0..partitions`
/// (`None` where it committed nothing).
pub fn committed_offsets(
    bootstrap: &str,
    group: &str,
    topic: &str,
    partitions: i32,
) -> Result<Vec<Option<i64>>, String> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .create()
        .map_err(|e| e.to_string())?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let found = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    Ok((0..partitions)
        .map(
            |p| match found.find_partition(topic, p).map(|e| e.offset()) {
                Some(rdkafka::Offset::Offset(o)) => Some(o),
                _ => None,
            },
        )
        .collect())
}

/// One record read back by [`read_topic`].
#[derive(Debug, Clone, PartialEq)]
pub struct ReadBack {
    /// Partition.
    pub partition: i32,
    /// Key.
    pub key: Option<Vec<u8>>,
    /// Value.
    pub value: Option<Vec<u8>>,
    /// Headers, in order (a header without value as empty bytes).
    pub headers: Vec<(String, Vec<u8>)>,
}

impl ReadBack {
    /// The value of header `key` as text.
    pub fn header(&self, key: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
}

/// Reads every record of `topic` (all partitions, from the start) until
/// `count` arrived or `timeout` passed.
pub fn read_topic(
    bootstrap: &str,
    topic: &str,
    count: usize,
    timeout: Duration,
) -> Result<Vec<ReadBack>, String> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("read-{topic}"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()
        .map_err(|e| e.to_string())?;
    consumer.subscribe(&[topic]).map_err(|e| e.to_string())?;
    let deadline = std::time::Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < count && std::time::Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => out.push(ReadBack {
                partition: m.partition(),
                key: m.key().map(<[u8]>::to_vec),
                value: m.payload().map(<[u8]>::to_vec),
                headers: m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                            .collect()
                    })
                    .unwrap_or_default(),
            }),
            Some(Err(e)) => return Err(e.to_string()),
            None => {}
        }
    }
    Ok(out)
}

fn admin(bootstrap: &str) -> Result<AdminClient<DefaultClientContext>, String> {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .map_err(|e| e.to_string())
}

fn admin_options() -> AdminOptions {
    AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)))
}

/// Grows `topic` to `total` partitions.
pub async fn add_partitions(bootstrap: &str, topic: &str, total: usize) -> Result<(), String> {
    let more = rdkafka::admin::NewPartitions::new(topic, total);
    for r in admin(bootstrap)?
        .create_partitions([&more], &admin_options())
        .await
        .map_err(|e| e.to_string())?
    {
        r.map_err(|(t, e)| format!("adding partitions to {t}: {e}"))?;
    }
    Ok(())
}

/// Deletes `topic`.
pub async fn delete_topic(bootstrap: &str, topic: &str) -> Result<(), String> {
    for r in admin(bootstrap)?
        .delete_topics(&[topic], &admin_options())
        .await
        .map_err(|e| e.to_string())?
    {
        r.map_err(|(t, e)| format!("deleting {t}: {e}"))?;
    }
    Ok(())
}

/// Deletes the records of `topic`'s `partition` before `offset` (as
/// `kafka-delete-records` does).
pub async fn delete_records_before(
    bootstrap: &str,
    topic: &str,
    partition: i32,
    offset: i64,
) -> Result<(), String> {
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, rdkafka::Offset::Offset(offset))
        .map_err(|e| e.to_string())?;
    let done = admin(bootstrap)?
        .delete_records(&tpl, &admin_options())
        .await
        .map_err(|e| e.to_string())?;
    for e in done.elements() {
        e.error()
            .map_err(|e| format!("deleting records of {topic}/{partition}: {e}"))?;
    }
    Ok(())
}

/// A transactional producer, as an exactly-once pipeline upstream writes:
/// its records are visible to `read_committed` readers only once a
/// transaction commits, and each transaction ends with a marker in every
/// partition it wrote.
pub struct TxProducer {
    producer: BaseProducer,
    topic: String,
}

impl std::fmt::Debug for TxProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxProducer")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl TxProducer {
    /// A producer of `topic` with `transactional_id`, its transactions
    /// initialised (fencing an earlier producer of the same id).
    pub fn new(bootstrap: &str, topic: &str, transactional_id: &str) -> Result<Self, String> {
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("transactional.id", transactional_id)
            .set("linger.ms", "5")
            .create()
            .map_err(|e| e.to_string())?;
        producer
            .init_transactions(FLUSH_WITHIN)
            .map_err(|e| format!("initialising transactions: {e}"))?;
        Ok(TxProducer {
            producer,
            topic: topic.to_owned(),
        })
    }

    /// Begins a transaction and sends `records` (partition, value) in it,
    /// waiting until the broker has them (still uncommitted).
    pub fn send(&self, records: &[(i32, Vec<u8>)]) -> Result<(), String> {
        self.producer
            .begin_transaction()
            .map_err(|e| format!("beginning a transaction: {e}"))?;
        for (partition, value) in records {
            let record = BaseRecord::<[u8], [u8]>::to(&self.topic)
                .partition(*partition)
                .payload(value.as_slice());
            send_with_room(&self.producer, record).map_err(|e| e.to_string())?;
            self.producer.poll(Duration::ZERO);
        }
        self.producer
            .flush(FLUSH_WITHIN)
            .map_err(|e| format!("flushing: {e}"))
    }

    /// Commits the open transaction.
    pub fn commit(&self) -> Result<(), String> {
        self.producer
            .commit_transaction(FLUSH_WITHIN)
            .map_err(|e| format!("committing: {e}"))
    }

    /// Aborts the open transaction.
    pub fn abort(&self) -> Result<(), String> {
        self.producer
            .abort_transaction(FLUSH_WITHIN)
            .map_err(|e| format!("aborting: {e}"))
    }
}
