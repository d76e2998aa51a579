//! tinyflow's Kafka source.
//!
//! [`KafkaSource`] reads one or more topics. Their partitions are listed at
//! start, sorted by topic and partition, and dealt round-robin over the
//! source's subtasks, so every subtask knows exactly which partitions it
//! owns without a consumer-group rebalance. The position of each partition
//! (the next offset to read) is the subtask's checkpoint state; on restore
//! the source seeks to the checkpoint's offsets and nothing else, also when
//! the job comes back with a different parallelism (positions are kept per
//! partition, not per subtask). Consumer-group offsets are committed after a
//! checkpoint completes, for lag monitoring only.
//!
//! Records arrive as [`KafkaRecord`]s: the decoded value ([`Format`]: raw
//! bytes, UTF-8, or JSON into any `serde` type) with topic, partition,
//! offset, timestamp, key and headers. A record that does not decode goes to
//! the [`BadRecordPolicy`]: fail with the topic, partition, offset and
//! reason, skip it, or send it to a dead-letter topic, exactly once
//! (transactions committed with the checkpoint, read back on restore);
//! counted by reason and summed up in the log.
//!
//! With [`KafkaSource::with_event_time`] the source reads event time from
//! record timestamps or a field of the value and reports a watermark per
//! partition, combined by minimum; a partition quiet for the idle timeout
//! stops holding it back ([`EventTime`]).

#[cfg(feature = "arrow")]
mod arrow;
#[cfg(feature = "avro")]
mod avro;
mod bad_record;
mod client;
mod config;
#[cfg(feature = "avro")]
mod conform;
mod dead_letter;
mod decode;
#[cfg(feature = "embedded")]
mod embedded;
mod policy;
#[cfg(feature = "embedded")]
mod producer;
mod progress;
#[cfg(feature = "protobuf")]
mod protobuf;
mod reader;
#[cfg(feature = "avro")]
pub mod registry;
mod scan;
mod state;
#[cfg(feature = "testing")]
pub mod testing;

#[cfg(feature = "arrow")]
pub use arrow::{
    BytesAs, Coercion, JsonArrow, JsonArrowDecoder, KafkaArrowSource, METADATA_COLUMNS,
};
#[cfg(feature = "avro")]
pub use avro::{ColumnsEvolver, Evolution, SchemaEvolution, arrow_schema_of as avro_arrow_schema};
pub use bad_record::BadReason;
pub use config::{
    BadRecordPolicy, DEFAULT_CLIENT_SETTINGS, EventTime, Format, KafkaSourceConfig, StartPosition,
};
#[cfg(feature = "avro")]
pub use conform::grow as grow_columns;
pub use decode::KafkaRecord;
#[cfg(feature = "embedded")]
pub use embedded::EmbeddedKafka;
#[cfg(feature = "embedded")]
pub use producer::RecordProducer;
#[cfg(feature = "protobuf")]
pub use protobuf::arrow_schema_of as protobuf_arrow_schema;
pub use reader::{KafkaSource, decode_positions, offsets_of_positions};
