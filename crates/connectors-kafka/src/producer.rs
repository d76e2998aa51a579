//! A small idempotent producer (feature `embedded`), for feeding a topic
//! from a program that should not name rdkafka itself: the CLI's demo
//! writes its bids with it.
//!
//! It is not a sink: nothing here takes part in checkpoints. Records are
//! sent in the background; [`RecordProducer::send`] waits only while the
//! client's queue is full, and [`RecordProducer::flush`] says how many
//! records the cluster refused.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientContext, Message};
use tinyflow_api::{StreamError, StreamResult};

/// Counts the deliveries that failed.
struct Deliveries {
    failed: Arc<AtomicU64>,
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((e, m)) = result {
            self.failed.fetch_add(1, Ordering::Relaxed);
            tracing::error!(error = %e, topic = m.topic(), partition = m.partition(), "a record was not delivered");
        }
    }
}

/// An idempotent producer to one cluster.
pub struct RecordProducer {
    producer: ThreadedProducer<Deliveries>,
    failed: Arc<AtomicU64>,
    sent: u64,
}

impl std::fmt::Debug for RecordProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecordProducer({} sent)", self.sent)
    }
}

fn failed(action: String, e: rdkafka::error::KafkaError) -> StreamError {
    StreamError::external("producer", "kafka", action, e, false)
}

impl RecordProducer {
    /// A producer to `bootstrap` (`host:port,...`), batching for up to
    /// `linger`.
    pub fn new(bootstrap: &str, linger: Duration) -> StreamResult<Self> {
        let failed_count = Arc::new(AtomicU64::new(0));
        let producer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("linger.ms", linger.as_millis().to_string())
            .set("enable.idempotence", "true")
            .create_with_context(Deliveries {
                failed: Arc::clone(&failed_count),
            })
            .map_err(|e| failed(format!("creating a producer to {bootstrap}"), e))?;
        Ok(RecordProducer {
            producer,
            failed: failed_count,
            sent: 0,
        })
    }

    /// Queues one record; blocks the thread while the client's queue is
    /// full.
    pub fn send(&mut self, topic: &str, key: &[u8], payload: &[u8]) -> StreamResult<()> {
        let mut record = BaseRecord::to(topic).key(key).payload(payload);
        loop {
            match self.producer.send(record) {
                Ok(()) => {
                    self.sent += 1;
                    return Ok(());
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err((e, _)) => {
                    return Err(failed(
                        format!("producing record {} to {topic}", self.sent),
                        e,
                    ));
                }
            }
        }
    }

    /// Waits up to `timeout` for every queued record to be delivered, and
    /// returns how many of all sent the cluster refused.
    pub fn flush(&self, timeout: Duration) -> StreamResult<u64> {
        self.producer
            .flush(timeout)
            .map_err(|e| failed("flushing the producer".to_owned(), e))?;
        Ok(self.failed.load(Ordering::Relaxed))
    }
}
