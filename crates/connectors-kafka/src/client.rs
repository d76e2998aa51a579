//! The source's Kafka clients: building them from the configuration (the
//! bootstrap servers, fixed settings, then the pass-through properties,
//! their secrets registered for masking), the consumer's context
//! (librdkafka's logs to `tracing`, the last client error, the lag and the
//! partition ends from the statistics), the diagnosis of security settings
//! that do not fit the broker (`security_problem`, a TLS probe of the
//! listener), the metadata and offset requests (partitions, start offsets,
//! the ends of a bounded read), what client errors become ([`external`],
//! [`classify`]), and [`DropAside`], which closes a client on a thread of
//! its own.
//!
//! Boundary: this module asks the cluster and reports what it answered; it
//! decides nothing about what a subtask reads. Assignment, positions,
//! checkpoints and retries are the reader's (`reader.rs`). The dead-letter
//! producer is built in `dead_letter.rs`, from
//! [`KafkaSourceConfig::client_config`] and
//! [`KafkaSourceConfig::rejected`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tinyflow_api::{BoxError, StreamError, StreamResult};
use tokio::time::Instant;

use crate::config::{DEFAULT_CLIENT_SETTINGS, KafkaSourceConfig, StartPosition};

/// A topic partition: the topic's shared name and the partition.
pub(crate) type Partition = (Arc<str>, i32);

pub(crate) type KafkaConsumer = BaseConsumer<SourceContext>;

pub(crate) fn external(
    operator: &str,
    action: impl Into<String>,
    e: impl Into<BoxError>,
    retryable: bool,
) -> StreamError {
    StreamError::external(operator, "kafka", action, e, retryable)
}

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
enum Certainty {
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
fn security_problem(error: &KafkaError, reason: &str) -> Option<(&'static str, Certainty)> {
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
    fn security(&self) -> Option<(String, Certainty)> {
        self.security
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// (committed end, log end) per partition, as last reported.
    pub(crate) fn ends(&self) -> HashMap<(String, i32), (i64, i64)> {
        self.ends.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
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

    pub(crate) fn consumer(&self, name: &str, lag: metrics::Gauge) -> StreamResult<KafkaConsumer> {
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
    pub(crate) fn partitions(
        &self,
        consumer: &KafkaConsumer,
        name: &str,
    ) -> StreamResult<Vec<Partition>> {
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
    pub(crate) fn start_offsets(
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

/// The end offsets of a bounded read of `owned`: the committed end of each
/// partition at start (the last stable offset: records of transactions
/// still open then, and anything after them, are left to a later run). A
/// partition held back by an open transaction is reported.
pub(crate) fn bounded_ends(
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

/// What a consumer error means for the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorClass {
    /// Never heals by retrying: the attempt fails, not retryable.
    Fatal,
    /// A topic or partition the broker does not know: deleted, or a broker
    /// that just restarted; the metadata decides.
    UnknownTopic,
    /// Retried after a pause (connections, leader changes, time-outs).
    Transient,
}

/// The class of a consumer error (see [`ErrorClass`]).
pub(crate) fn classify(e: &KafkaError) -> ErrorClass {
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
pub(crate) fn last_client_error(consumer: &KafkaConsumer) -> String {
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
}
