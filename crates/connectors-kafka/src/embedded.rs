//! An in-process Kafka cluster (feature `embedded`): librdkafka's mock
//! cluster, for the zero-setup demo and for fault injection.
//!
//! It is not Apache Kafka. It keeps only about 5 MiB per partition (a
//! producer that runs ahead of its consumers loses the oldest records),
//! and its transactions and `read_committed` are fake, so nothing here may
//! be taken as proof of exactly-once against a real broker: the tests that
//! prove it use the real broker.

use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use tinyflow_api::{StreamError, StreamResult};

/// A running in-process cluster; it stops when dropped. Not `Send`: keep
/// it on the thread that made it.
pub struct EmbeddedKafka {
    cluster: MockCluster<'static, DefaultProducerContext>,
}

impl std::fmt::Debug for EmbeddedKafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EmbeddedKafka({})", self.bootstrap_servers())
    }
}

fn failed(action: String, e: rdkafka::error::KafkaError) -> StreamError {
    StreamError::external("embedded kafka", "kafka", action, e, false)
}

impl EmbeddedKafka {
    /// Starts a cluster of `brokers` brokers on loopback ports.
    pub fn start(brokers: i32) -> StreamResult<Self> {
        let cluster = MockCluster::new(brokers)
            .map_err(|e| failed(format!("starting a mock cluster of {brokers} brokers"), e))?;
        Ok(EmbeddedKafka { cluster })
    }

    /// `host:port,...` for clients.
    pub fn bootstrap_servers(&self) -> String {
        self.cluster.bootstrap_servers()
    }

    /// Creates `topic` with `partitions` partitions.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> StreamResult<()> {
        self.cluster
            .create_topic(topic, partitions, 1)
            .map_err(|e| failed(format!("creating topic {topic:?}"), e))
    }

    /// Makes broker `id` (1-based; -1: all) refuse connections, as if down.
    pub fn broker_down(&self, id: i32) -> StreamResult<()> {
        self.cluster
            .broker_down(id)
            .map_err(|e| failed(format!("taking broker {id} down"), e))
    }

    /// Brings broker `id` back.
    pub fn broker_up(&self, id: i32) -> StreamResult<()> {
        self.cluster
            .broker_up(id)
            .map_err(|e| failed(format!("bringing broker {id} up"), e))
    }
}
