//! The source: partition assignment, positions, reading, decoding.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
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

use crate::bad_record::{BadRecord, BadRecords};
use crate::config::{
    BadRecordPolicy, DEFAULT_CLIENT_SETTINGS, EventTime, Format, KafkaSourceConfig, StartPosition,
    TimeFrom,
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
    /// The last error that says the security settings do not fit the
    /// broker (see [`security_problem`]): retrying never mends it.
    security: std::sync::Mutex<Option<(String, Certainty)>>,
    /// (committed end, log end) per partition the consumer fetches, from
    /// librdkafka's statistics (once a second): the last stable offset and
    /// the high watermark.
    ends: std::sync::Mutex<HashMap<(String, i32), (i64, i64)>>,
    /// `tinyflow_kafka_consumer_lag`: records in the subtask's partitions
    /// not read yet, from librdkafka's statistics (once a second).
    lag: metrics::Gauge,
}

impl Default for SourceContext {
    fn default() -> Self {
        SourceContext {
            last_error: std::sync::Mutex::new(None),
            security: std::sync::Mutex::new(None),
            ends: std::sync::Mutex::new(HashMap::new()),
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
    last_client_error(consumer)
}

impl ClientContext for SourceContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        if (level as i32) <= (RDKafkaLogLevel::Warning as i32) {
            tracing::warn!(facility = fac, "librdkafka: {message}");
            // A protocol mismatch comes as a log line only (the error is a
            // plain transport failure).
            if message.contains("incorrect security.protocol") {
                *self.security.lock().unwrap_or_else(|p| p.into_inner()) = Some((
                    format!("{PROTOCOL_MISMATCH}: {message}"),
                    Certainty::IfItLasts,
                ));
            }
            *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(message.to_owned());
        } else {
            tracing::debug!(facility = fac, "librdkafka: {message}");
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(%error, reason, "kafka client error");
        if let Some((what, certainty)) = security_problem(&error, reason) {
            *self.security.lock().unwrap_or_else(|p| p.into_inner()) =
                Some((format!("{what}: {reason}"), certainty));
        }
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
        let mut ends = self.ends.lock().unwrap_or_else(|p| p.into_inner());
        for (topic, t) in &statistics.topics {
            for p in t.partitions.values() {
                if p.partition >= 0 && p.ls_offset >= 0 && p.hi_offset >= 0 {
                    ends.insert((topic.clone(), p.partition), (p.ls_offset, p.hi_offset));
                }
            }
        }
    }
}

impl ConsumerContext for SourceContext {}

/// Whether the listener at `host:port` answers a TLS hello with a TLS
/// record (a handshake or an alert): a TLS listener, which a plaintext
/// client would wait on forever. A plaintext Kafka listener takes the hello
/// for the start of a long request and says nothing.
fn speaks_tls(address: &str) -> bool {
    use std::io::{Read, Write};
    use std::net::ToSocketAddrs;
    let Some(addr) = address.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return false;
    };
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    // A TLS 1.2 ClientHello: one cipher suite, no extensions. Whether the
    // listener accepts it does not matter; that it answers in TLS does.
    let mut hello = vec![0x03, 0x03];
    hello.extend_from_slice(&[0x5a; 32]); // random
    hello.push(0); // no session id
    hello.extend_from_slice(&[0x00, 0x02, 0xc0, 0x2f]); // ECDHE-RSA-AES128-GCM-SHA256
    hello.extend_from_slice(&[0x01, 0x00]); // no compression
    let mut handshake = vec![0x01, 0x00];
    handshake.extend_from_slice(&(hello.len() as u16).to_be_bytes());
    handshake.extend_from_slice(&hello);
    let mut record = vec![0x16, 0x03, 0x01];
    record.extend_from_slice(&(handshake.len() as u16).to_be_bytes());
    record.extend_from_slice(&handshake);
    if stream.write_all(&record).is_err() {
        return false;
    }
    let mut answer = [0u8; 2];
    matches!(stream.read_exact(&mut answer), Ok(()) if matches!(answer, [0x15 | 0x16, 0x03]))
}

/// What a plaintext client on a TLS listener (or the other way round) is
/// told.
const PROTOCOL_MISMATCH: &str = "the broker's listener speaks another protocol: check security.protocol (SSL or SASL_SSL for a TLS listener)";

/// How librdkafka begins an error of getting an OAUTHBEARER token.
const TOKEN_FAILURE: &str = "Failed to acquire SASL OAUTHBEARER token";
/// The identity provider answered the token request with an OAuth error.
const OIDC_REFUSED: &str = "the identity provider refused the token request: check sasl.oauthbearer.client.id, sasl.oauthbearer.client.secret and sasl.oauthbearer.token.endpoint.url";
/// The token request got no OAuth answer.
const OIDC_UNREACHABLE: &str = "no token from the identity provider: check sasl.oauthbearer.token.endpoint.url (and https.ca.location for an https endpoint)";
/// The broker refused a token the client had.
const TOKEN_REFUSED: &str = "the broker refused the OAUTHBEARER token: check sasl.oauthbearer.scope, and that the broker expects the token's issuer and audience";

/// How sure a security problem is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Certainty {
    /// The broker or the identity provider said so (credentials or a
    /// token refused, a certificate not trusted): fail at once.
    Now,
    /// Could be a passing fault (a TLS handshake cut short by a broker
    /// restarting): fail only if the broker never answered until the
    /// request's time-out.
    IfItLasts,
}

/// Whether a client error says the security settings do not fit the
/// broker, what to check, and how sure it is: wrong credentials, a token
/// request the identity provider refused, a token the broker refused and a
/// certificate not trusted are certain; a TLS handshake that fails, a hint
/// of a plaintext client on a TLS listener, or an identity provider that
/// does not answer, only if it lasts until the request's time-out.
/// Retrying never mends these, so they fail the job for good.
pub(crate) fn security_problem(
    error: &KafkaError,
    reason: &str,
) -> Option<(&'static str, Certainty)> {
    use rdkafka::types::RDKafkaErrorCode as C;
    match error.rdkafka_error_code() {
        // The client could not get a token from the identity provider
        // (OAUTHBEARER with OIDC): librdkafka passes on the provider's
        // OAuth error (RFC 6749 5.2, a JSON object with an `error`), or
        // curl's words when the provider was not reached.
        Some(C::Authentication) if reason.contains(TOKEN_FAILURE) => {
            if reason.contains("\"error\"") {
                Some((OIDC_REFUSED, Certainty::Now))
            } else {
                Some((OIDC_UNREACHABLE, Certainty::IfItLasts))
            }
        }
        // The broker's answer to a token it refuses (RFC 7628 3.2.2).
        Some(C::Authentication | C::SaslAuthenticationFailed)
            if reason.contains("\"status\":\"invalid_token\"") =>
        {
            Some((TOKEN_REFUSED, Certainty::Now))
        }
        Some(C::Authentication | C::SaslAuthenticationFailed) => Some((
            "authentication failed: check sasl.mechanism, sasl.username and sasl.password",
            Certainty::Now,
        )),
        Some(C::SSL) if reason.contains("certificate verify failed") => Some((
            "the broker's certificate is not trusted: check ssl.ca.location (the CA that signed it)",
            Certainty::Now,
        )),
        Some(C::SSL) => Some((
            "the TLS handshake with the broker failed: check security.protocol and the listener's port",
            Certainty::IfItLasts,
        )),
        _ if reason.contains("incorrect security.protocol") => {
            Some((PROTOCOL_MISMATCH, Certainty::IfItLasts))
        }
        _ => None,
    }
}

impl SourceContext {
    /// The security problem the client reported, if any.
    pub(crate) fn security(&self) -> Option<(String, Certainty)> {
        self.security
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// (committed end, log end) per partition, as last reported.
    fn ends(&self) -> HashMap<(String, i32), (i64, i64)> {
        self.ends.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

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
        // Whatever prints through `secrets::scrub` (the `tinyflow` command's
        // logs and errors) never shows these values, even where librdkafka
        // quotes them back.
        tinyflow_api::secrets::register_settings(
            self.properties
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
        );
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
            .map(|(k, v)| format!("{k}={}", tinyflow_api::secrets::shown(k, v)))
            .collect();
        StreamError::Config {
            key: "source.properties",
            message: format!(
                "{name}: the kafka {client} rejected its configuration ({}): {}",
                shown.join(", "),
                // librdkafka quotes a value it refuses.
                tinyflow_api::secrets::scrub(&e.to_string())
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

    /// The metadata of `topic`, asked for in growing tries (from a second)
    /// up to `request_timeout`, so that a security problem the client
    /// reports meanwhile (wrong credentials, an untrusted certificate, a
    /// protocol mismatch) fails at once, naming it, and for good.
    fn fetch_metadata(
        &self,
        consumer: &KafkaConsumer,
        name: &str,
        topic: &str,
    ) -> StreamResult<rdkafka::metadata::Metadata> {
        let deadline = Instant::now() + self.request_timeout;
        // Tries of 1 s, 2 s, 4 s...: a far or busy broker whose answer takes
        // longer than the first still gets it.
        let mut try_for = Duration::from_secs(1);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let tried = consumer.fetch_metadata(Some(topic), left.min(try_for));
            try_for *= 2;
            let e = match tried {
                Ok(md) => return Ok(md),
                Err(e) => e,
            };
            // Client errors arrive as events on the consumer's queue.
            let why = why(consumer);
            let out_of_time = Instant::now() >= deadline;
            if let Some((problem, certainty)) = consumer.context().security()
                && (certainty == Certainty::Now || out_of_time)
            {
                return Err(StreamError::Config {
                    key: "source.properties",
                    message: format!(
                        "{name}: cannot connect to {}: {problem}",
                        self.bootstrap_servers
                    ),
                });
            }
            if out_of_time {
                // A plaintext client on a TLS listener gets no answer at
                // all (the listener waits for the rest of a TLS record):
                // ask the listener in TLS whether it speaks it.
                let protocol = self
                    .properties
                    .get("security.protocol")
                    .map_or("plaintext", String::as_str)
                    .to_ascii_lowercase();
                if protocol.ends_with("plaintext")
                    && let Some(at) = self
                        .bootstrap_servers
                        .split(',')
                        .map(str::trim)
                        .find(|a| speaks_tls(a))
                {
                    return Err(StreamError::Config {
                        key: "source.properties",
                        message: format!(
                            "{name}: cannot connect to {}: {PROTOCOL_MISMATCH}: {at} answers in TLS, and security.protocol is {protocol}",
                            self.bootstrap_servers
                        ),
                    });
                }
                return Err(external(
                    name,
                    format!(
                        "fetching metadata of topic {topic:?} from {}",
                        self.bootstrap_servers
                    ),
                    format!("{e}{why}"),
                    true,
                ));
            }
        }
    }

    /// Every partition of the configured topics, sorted.
    fn partitions(&self, consumer: &KafkaConsumer, name: &str) -> StreamResult<Vec<Partition>> {
        let mut all = Vec::new();
        for topic in &self.topics {
            let md = self.fetch_metadata(consumer, name, topic)?;
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

    /// Where each of `owned` starts by `start`.
    fn start_offsets(
        &self,
        consumer: &KafkaConsumer,
        name: &str,
        start: &StartPosition,
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
        match start {
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
                    let offset = match start {
                        StartPosition::Timestamp(ts) => Offset::Offset(*ts),
                        _ => Offset::Invalid,
                    };
                    tpl.add_partition_offset(t, *p, offset)
                        .map_err(|e| external(name, "building the partition list", e, false))?;
                }
                let found = if let StartPosition::Timestamp(_) = start {
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
                        Ok(if matches!(start, StartPosition::Timestamp(_)) {
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

/// One polled record, with its partition's shared topic name.
pub(crate) struct Polled<'c> {
    pub(crate) topic: Arc<str>,
    pub(crate) msg: BorrowedMessage<'c>,
}

/// What a decoder made of one polled record: `Ok(event time)` or why it is
/// bad.
pub(crate) type Outcome = Result<Option<i64>, BadRecord>;

/// Turns the records of one poll into output items.
#[async_trait::async_trait]
pub(crate) trait Decode: Send + 'static {
    type Out: tinyflow_api::Data;

    /// Whether `msg` cannot be decoded until something the decoder fetches
    /// has come (an Avro writer schema): the source then reads its
    /// partition again from it, once [`ready`](Self::ready).
    fn must_wait(&mut self, _msg: &BorrowedMessage<'_>) -> bool {
        false
    }

    /// Waits up to `max` for what records wait for; `Ok(true)` when
    /// nothing is awaited any more. Cancel safe.
    async fn ready(&mut self, _max: Duration) -> StreamResult<bool> {
        Ok(true)
    }

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
            let Some(headers) = headers_of(msg) else {
                outcomes.push(Err(header_name_not_utf8()));
                continue;
            };
            match self.format.decode(msg.payload().unwrap_or_default()) {
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
                        headers: headers
                            .into_iter()
                            .map(|(k, v)| (k.to_owned(), v.unwrap_or_default().to_vec()))
                            .collect(),
                        value,
                    });
                    outcomes.push(Ok(time));
                }
                Err(bad) => outcomes.push(Err(bad)),
            }
        }
    }
}

/// A record's headers, name and value, in order; `None` when a header name
/// is not UTF-8. rdkafka's header access panics on such a name; the panic
/// is caught here, so a record a hostile producer wrote cannot crash the
/// process (it is a bad record instead).
pub(crate) fn headers_of<'m>(msg: &'m BorrowedMessage<'_>) -> Option<Vec<HeaderRef<'m>>> {
    let Some(headers) = msg.headers() else {
        return Some(Vec::new());
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        headers.iter().map(|h| (h.key, h.value)).collect()
    }))
    .ok()
}

/// A header's name and value (none for a header without one).
pub(crate) type HeaderRef<'m> = (&'m str, Option<&'m [u8]>);

/// Why a record with a header name that is not UTF-8 is bad.
pub(crate) fn header_name_not_utf8() -> BadRecord {
    BadRecord::new(crate::BadReason::Undecodable, "a header name is not UTF-8")
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
        .filter(|(t, p)| owner(t, *p, ctx.parallelism) == ctx.subtask)
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

/// The end offsets of a bounded read of `owned`: the committed end of each
/// partition at start (the last stable offset: records of transactions
/// still open then, and anything after them, are left to a later run). A
/// partition held back by an open transaction is reported.
fn bounded_ends(
    config: &KafkaSourceConfig,
    consumer: &KafkaConsumer,
    name: &str,
    owned: &[Partition],
) -> StreamResult<BTreeMap<Partition, i64>> {
    let fetch = |client: &KafkaConsumer, (t, p): &Partition| {
        client
            .fetch_watermarks(t, *p, config.request_timeout)
            .map(|(_, high)| high)
            .map_err(|e| {
                external(
                    name,
                    format!("fetching end offsets of {t}/{p}"),
                    format!("{e}{}", last_client_error(client)),
                    true,
                )
            })
    };
    // The consumer reads committed data: its end offsets are the last
    // stable offsets. A read_uncommitted client sees the log's end.
    let uncommitted = config
        .client_config(&[("isolation.level", "read_uncommitted")])
        .create_with_context::<_, KafkaConsumer>(SourceContext::default())
        .map_err(|e| config.rejected(name, "consumer", e))?;
    let mut stop = BTreeMap::new();
    for p in owned {
        let committed = fetch(consumer, p)?;
        let log_end = fetch(&uncommitted, p)?;
        if log_end > committed {
            tracing::warn!(
                source = %name,
                topic = %p.0,
                partition = p.1,
                committed_end = committed,
                log_end,
                "a transaction open since offset {committed} holds this bounded run back: it reads \
                 {}/{} up to there, and a later run reads the rest once it is committed",
                p.0,
                p.1
            );
        }
        stop.insert(p.clone(), committed);
    }
    drop(DropAside::new(uncommitted));
    Ok(stop)
}

/// A source subtask: its consumer, positions and decoder.
pub(crate) struct Reader<D> {
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
            ErrorClass::Fatal => Err(StreamError::External {
                operator: self.bad.name.clone(),
                system: "kafka",
                action: format!(
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
                message: format!(
                    "{e}{}; this does not heal by retrying",
                    last_client_error(&self.consumer)
                ),
                retryable: false,
            }),
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

/// What a consumer error means for the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ErrorClass {
    /// Never heals by retrying: the attempt fails, not retryable.
    Fatal,
    /// A topic or partition the broker does not know: deleted, or a broker
    /// that just restarted; the metadata decides.
    UnknownTopic,
    /// Retried after a pause (connections, leader changes, time-outs).
    Transient,
}

/// The class of a consumer error (see [`ErrorClass`]).
fn classify(e: &KafkaError) -> ErrorClass {
    use rdkafka::types::RDKafkaErrorCode as C;
    match e {
        KafkaError::MessageConsumptionFatal(_) => ErrorClass::Fatal,
        KafkaError::MessageConsumption(code) => match code {
            // An offset that is gone (deleted records, retention) with
            // `auto.offset.reset=error`.
            C::AutoOffsetReset | C::OffsetOutOfRange => ErrorClass::Fatal,
            C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::SaslAuthenticationFailed
            | C::Authentication => ErrorClass::Fatal,
            // A codec this build of librdkafka lacks, or data it cannot
            // decompress.
            C::NotImplemented | C::UnsupportedCompressionType | C::BadCompression => {
                ErrorClass::Fatal
            }
            C::Fatal => ErrorClass::Fatal,
            C::UnknownTopicOrPartition
            | C::UnknownTopic
            | C::UnknownPartition
            | C::UnknownTopicId => ErrorClass::UnknownTopic,
            _ => ErrorClass::Transient,
        },
        _ => ErrorClass::Transient,
    }
}

/// The last warning or error the consumer's client logged, as a suffix for
/// an error message (without polling: the reader's queue holds records).
fn last_client_error(consumer: &KafkaConsumer) -> String {
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

/// How often stalls are looked for.
const STALL_CHECK_EVERY: Duration = Duration::from_secs(1);

/// A gap between two reads longer than this is time the job held the
/// source back (backpressure, a checkpoint), not the source stalling.
const HELD_BACK: Duration = Duration::from_secs(1);

/// Progress per partition, to report partitions that make none while
/// behind and to fail a source that makes none at all.
struct Progress {
    warn: Duration,
    fail: Option<Duration>,
    /// Per partition: its position when it last moved, and when.
    moved: BTreeMap<Partition, (i64, Instant)>,
    /// Partitions reported since they last moved.
    reported: BTreeSet<Partition>,
    /// When any partition last moved.
    any_moved: Instant,
    last_call: Instant,
    /// What the source itself waited since `last_call` (retry pauses):
    /// not time the job held it back.
    own_wait: Duration,
    next_check: Instant,
}

impl Progress {
    fn new(
        positions: &BTreeMap<Partition, i64>,
        now: Instant,
        warn: Duration,
        fail: Option<Duration>,
    ) -> Self {
        Progress {
            warn,
            fail,
            moved: positions
                .iter()
                .map(|(p, o)| (p.clone(), (*o, now)))
                .collect(),
            reported: BTreeSet::new(),
            any_moved: now,
            last_call: now,
            own_wait: Duration::ZERO,
            next_check: now + STALL_CHECK_EVERY,
        }
    }

    /// A read starts: time the job held the source back does not count.
    fn called(&mut self, now: Instant) {
        let gap = now
            .duration_since(self.last_call)
            .saturating_sub(std::mem::take(&mut self.own_wait));
        if gap > HELD_BACK {
            for (_, since) in self.moved.values_mut() {
                *since += gap;
            }
            self.any_moved += gap;
        }
        self.last_call = now;
    }

    /// The source paused `d` on its own (after consumer errors).
    fn waited(&mut self, d: Duration) {
        self.own_wait += d;
    }

    fn due(&self, now: Instant) -> bool {
        now >= self.next_check
    }

    /// Reports partitions behind (committed records not read) that have
    /// not moved for `warn`, and those held back by an open transaction;
    /// fails when no partition moved for `fail` while one is behind.
    /// `ends`: (committed end, log end) per partition, from the client's
    /// statistics. Returns the number of stalled partitions.
    fn check(
        &mut self,
        name: &str,
        positions: &BTreeMap<Partition, i64>,
        stop: Option<&BTreeMap<Partition, i64>>,
        ends: &HashMap<(String, i32), (i64, i64)>,
        now: Instant,
    ) -> StreamResult<usize> {
        self.next_check = now + STALL_CHECK_EVERY;
        let mut stalled = 0;
        let mut behind = Vec::new();
        for (p, position) in positions {
            let (at, since) = self.moved.entry(p.clone()).or_insert((*position, now));
            if *at != *position {
                (*at, *since) = (*position, now);
                self.any_moved = now;
                self.reported.remove(p);
                continue;
            }
            if stop
                .and_then(|s| s.get(p))
                .is_some_and(|end| position >= end)
            {
                continue; // a bounded read that is done with it
            }
            let Some(&(committed_end, log_end)) = ends.get(&(p.0.to_string(), p.1)) else {
                continue; // no statistics yet
            };
            let still = now.duration_since(*since);
            if committed_end > *position {
                behind.push(format!(
                    "{}/{}@{position} (committed end {committed_end})",
                    p.0, p.1
                ));
                if still >= self.warn {
                    stalled += 1;
                    if self.reported.insert(p.clone()) {
                        tracing::warn!(source = %name, topic = %p.0, partition = p.1, position, committed_end, still_secs = still.as_secs(), "partition makes no progress while behind");
                    }
                }
            } else if log_end > *position && still >= self.warn && self.reported.insert(p.clone()) {
                tracing::warn!(source = %name, topic = %p.0, partition = p.1, position, log_end, still_secs = still.as_secs(), "partition held back by a transaction open since offset {position}: its records are read once it is committed or aborted");
            }
        }
        if let Some(fail) = self.fail
            && !behind.is_empty()
            && now.duration_since(self.any_moved) >= fail
        {
            return Err(StreamError::External {
                operator: name.to_owned(),
                system: "kafka",
                action: "reading".to_owned(),
                message: format!(
                    "no progress for {} s while behind on {}",
                    now.duration_since(self.any_moved).as_secs(),
                    behind.join(", ")
                ),
                retryable: true,
            });
        }
        Ok(stalled)
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
                .filter(|p| !known.contains(*p) && owner(&p.0, p.1, parallelism) == subtask)
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
    fn consumer_errors_that_never_heal_are_fatal() {
        use rdkafka::types::RDKafkaErrorCode as C;
        for code in [
            C::AutoOffsetReset,
            C::OffsetOutOfRange,
            C::TopicAuthorizationFailed,
            C::SaslAuthenticationFailed,
            C::Authentication,
            C::NotImplemented,
            C::UnsupportedCompressionType,
        ] {
            assert_eq!(
                classify(&KafkaError::MessageConsumption(code)),
                ErrorClass::Fatal,
                "{code:?}"
            );
        }
        assert_eq!(
            classify(&KafkaError::MessageConsumptionFatal(C::Fail)),
            ErrorClass::Fatal
        );
        for code in [
            C::UnknownTopicOrPartition,
            C::UnknownTopic,
            C::UnknownPartition,
        ] {
            assert_eq!(
                classify(&KafkaError::MessageConsumption(code)),
                ErrorClass::UnknownTopic
            );
        }
        for code in [
            C::BrokerTransportFailure,
            C::AllBrokersDown,
            C::NotLeaderForPartition,
            C::RequestTimedOut,
        ] {
            assert_eq!(
                classify(&KafkaError::MessageConsumption(code)),
                ErrorClass::Transient,
                "{code:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_partition_behind_without_progress_is_reported_then_fails_the_reader() {
        let p: Partition = (Arc::from("t"), 0);
        let q: Partition = (Arc::from("t"), 1);
        let mut positions = BTreeMap::from([(p.clone(), 10), (q.clone(), 5)]);
        let start = Instant::now();
        let mut progress = Progress::new(
            &positions,
            start,
            Duration::from_secs(2),
            Some(Duration::from_secs(5)),
        );
        // p is behind (committed end 20); q is at its committed end, held
        // back by an open transaction (log end 9): reported, never failed.
        let ends = HashMap::from([
            (("t".to_owned(), 0), (20, 20)),
            (("t".to_owned(), 1), (5, 9)),
        ]);
        let at = |secs: u64| start + Duration::from_secs(secs);
        for s in 1..=4 {
            let now = at(s);
            progress.called(now);
            let stalled = progress.check("src", &positions, None, &ends, now).unwrap();
            assert_eq!(stalled, usize::from(s >= 2), "at {s} s");
        }
        // Progress on p resets it, and the subtask's clock.
        positions.insert(p.clone(), 11);
        let now = at(5);
        progress.called(now);
        assert_eq!(
            progress.check("src", &positions, None, &ends, now).unwrap(),
            0
        );
        // Held back by the job for 10 s (one call after a long gap): not a
        // stall.
        let now = at(15);
        progress.called(now);
        assert_eq!(
            progress.check("src", &positions, None, &ends, now).unwrap(),
            0
        );
        // Then no progress for 5 s while behind: failed, naming p.
        for s in 16..=19 {
            let now = at(s);
            progress.called(now);
            progress.check("src", &positions, None, &ends, now).unwrap();
        }
        let now = at(20);
        progress.called(now);
        let err = progress
            .check("src", &positions, None, &ends, now)
            .unwrap_err();
        assert!(err.is_retryable());
        let text = err.to_string();
        assert!(
            text.contains("no progress for 5 s") && text.contains("t/0@11"),
            "{text}"
        );
        assert!(!text.contains("t/1"), "{text}");
        // A bounded read done with p does not count it as behind.
        let stop = BTreeMap::from([(p.clone(), 11), (q.clone(), 5)]);
        assert_eq!(
            progress
                .check("src", &positions, Some(&stop), &ends, at(21))
                .unwrap(),
            0
        );
    }

    #[tokio::test(start_paused = true)]
    async fn retry_pauses_count_towards_a_stall() {
        let p: Partition = (Arc::from("t"), 0);
        let positions = BTreeMap::from([(p.clone(), 10)]);
        let ends = HashMap::from([(("t".to_owned(), 0), (20, 20))]);
        let start = Instant::now();
        let mut progress = Progress::new(
            &positions,
            start,
            Duration::from_secs(2),
            Some(Duration::from_secs(5)),
        );
        // Errors in a row: each read pauses 1 s on its own, so reads come
        // more than HELD_BACK apart, yet the job held nothing back.
        let mut failed = None;
        for call in 1..=10u64 {
            let now = start + Duration::from_millis(1_050 * call);
            progress.called(now);
            if let Err(e) = progress.check("src", &positions, None, &ends, now) {
                failed = Some((call, e));
                break;
            }
            progress.waited(Duration::from_secs(1));
        }
        let (call, err) = failed.expect("a source pausing on errors while behind fails");
        assert!(call <= 6, "failed only at read {call}");
        assert!(err.to_string().contains("t/0@10"), "{err}");
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
