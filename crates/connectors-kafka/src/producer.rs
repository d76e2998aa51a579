//! A small idempotent producer (feature `embedded`), for feeding a topic
//! from a program that should not name rdkafka itself: the CLI's demo
//! writes its bids with it.
//!
//! It is not a sink: nothing here takes part in checkpoints. Records are
//! sent in the background; [`RecordProducer::send`] waits only while the
//! client's queue is full, and [`RecordProducer::flush`] says how many
//! records the cluster refused. The delivery reports and the wait for room
//! are the dead-letter producer's (`dead_letter::Deliveries`,
//! `send_with_room`).

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use tinyflow_api::{StreamError, StreamResult};

use crate::dead_letter::{Deliveries, send_with_room};

/// An idempotent producer to one cluster.
pub struct RecordProducer {
    producer: BaseProducer<Deliveries>,
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
        let producer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("linger.ms", linger.as_millis().to_string())
            .set("enable.idempotence", "true")
            .create_with_context::<_, BaseProducer<Deliveries>>(Deliveries::default())
            .map_err(|e| failed(format!("creating a producer to {bootstrap}"), e))?;
        Ok(RecordProducer { producer, sent: 0 })
    }

    /// Queues one record; blocks the thread while the client's queue is
    /// full.
    pub fn send(&mut self, topic: &str, key: &[u8], payload: &[u8]) -> StreamResult<()> {
        let record = BaseRecord::to(topic).key(key).payload(payload);
        send_with_room(&self.producer, record)
            .map_err(|e| failed(format!("producing record {} to {topic}", self.sent), e))?;
        self.sent += 1;
        // Serve the delivery reports that are in.
        self.producer.poll(Duration::ZERO);
        Ok(())
    }

    /// Waits up to `timeout` for every queued record to be delivered, and
    /// returns how many of all sent the cluster refused (logging the last
    /// reason).
    pub fn flush(&self, timeout: Duration) -> StreamResult<u64> {
        self.producer
            .flush(timeout)
            .map_err(|e| failed("flushing the producer".to_owned(), e))?;
        let deliveries = self.producer.context();
        let refused = deliveries.failed();
        if refused > 0 {
            tracing::error!(
                refused,
                sent = self.sent,
                last_error = deliveries.last_error().unwrap_or_default(),
                "records were not delivered"
            );
        }
        Ok(refused)
    }
}
