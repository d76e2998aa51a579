//! The dead-letter producer of the `dead-letter` bad-record policy.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdkafka::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::types::RDKafkaErrorCode;
use tinyflow_api::{StreamError, StreamResult};

use crate::config::KafkaSourceConfig;
use crate::source::{DropAside, external};

/// Counts deliveries that failed, keeping the last reason.
#[derive(Default)]
pub(crate) struct Deliveries {
    failed: AtomicU64,
    last_error: Mutex<Option<String>>,
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

/// Sends bad records to a topic; see
/// [`BadRecordPolicy::DeadLetter`](crate::BadRecordPolicy::DeadLetter).
pub(crate) struct DeadLetter {
    pub(crate) topic: String,
    producer: DropAside<BaseProducer<Deliveries>>,
    /// Sent since the last flush.
    unflushed: u64,
}

impl DeadLetter {
    pub(crate) fn new(config: &KafkaSourceConfig, topic: &str, name: &str) -> StreamResult<Self> {
        let producer = config
            .client_config(&[("enable.idempotence", "true")])
            .create_with_context::<_, BaseProducer<Deliveries>>(Deliveries::default())
            .map_err(|e| {
                config.rejected(
                    name,
                    &format!("producer for dead-letter topic {topic:?}"),
                    e,
                )
            })?;
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
        if !found.is_some_and(|t| t.error().is_none() && !t.partitions().is_empty()) {
            return Err(StreamError::Config {
                key: "source.bad_records",
                message: format!(
                    "{name}: dead-letter topic {topic:?} does not exist on {} ({:?}); create it first",
                    config.bootstrap_servers,
                    found.and_then(|t| t.error())
                ),
            });
        }
        Ok(DeadLetter {
            topic: topic.to_owned(),
            producer: DropAside::new(producer),
            unflushed: 0,
        })
    }

    /// Queues `msg` with `reason` and its origin in headers.
    pub(crate) fn send(
        &mut self,
        msg: &BorrowedMessage<'_>,
        reason: &str,
        name: &str,
    ) -> StreamResult<()> {
        let mut headers = OwnedHeaders::new();
        if let Some(h) = msg.headers() {
            for h in h.iter() {
                headers = headers.insert(h);
            }
        }
        let partition = msg.partition().to_string();
        let offset = msg.offset().to_string();
        let timestamp = msg.timestamp().to_millis().map(|t| t.to_string());
        for (key, value) in [
            ("tinyflow.error", Some(reason)),
            ("tinyflow.source.topic", Some(msg.topic())),
            ("tinyflow.source.partition", Some(partition.as_str())),
            ("tinyflow.source.offset", Some(offset.as_str())),
            ("tinyflow.source.timestamp", timestamp.as_deref()),
        ] {
            if let Some(value) = value {
                headers = headers.insert(Header {
                    key,
                    value: Some(value),
                });
            }
        }
        let mut record = BaseRecord::<[u8], [u8]>::to(&self.topic).headers(headers);
        if let Some(key) = msg.key() {
            record = record.key(key);
        }
        if let Some(payload) = msg.payload() {
            record = record.payload(payload);
        }
        send_with_room(&self.producer, record).map_err(|e| {
            external(
                name,
                format!("sending a bad record to dead-letter topic {:?}", self.topic),
                e,
                true,
            )
        })?;
        self.unflushed += 1;
        self.producer.poll(Duration::ZERO);
        Ok(())
    }

    /// Waits until everything sent is acknowledged; fails (retryably) when
    /// any dead letter was not delivered.
    pub(crate) fn flush(&mut self, name: &str, timeout: Duration) -> StreamResult<()> {
        if self.unflushed > 0 {
            self.producer.flush(timeout).map_err(|e| {
                external(
                    name,
                    format!(
                        "flushing {} dead letters to topic {:?}",
                        self.unflushed, self.topic
                    ),
                    e,
                    true,
                )
            })?;
            self.unflushed = 0;
        }
        let failed = self.producer.context().failed.load(Ordering::SeqCst);
        if failed > 0 {
            let last = self
                .producer
                .context()
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            return Err(external(
                name,
                format!("delivering dead letters to topic {:?}", self.topic),
                format!("{failed} not delivered, last: {}", last.unwrap_or_default()),
                true,
            ));
        }
        Ok(())
    }
}
