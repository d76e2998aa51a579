//! Decoding: what the reader hands a decoder ([`Polled`]: a record with its
//! topic's shared name), what a decoder gives back (items, and per record
//! its event time or why it is bad: [`Outcome`]), the [`Decode`] trait that
//! the record decoder here and the Arrow decoders (`arrow.rs`) implement,
//! [`KafkaRecord`] and its decoder by [`Format`], and a record's headers,
//! read without letting rdkafka panic.
//!
//! Boundary: a decoder never touches the consumer, the positions or the
//! bad-record policy. It reports a bad record as a
//! [`BadRecord`](crate::bad_record::BadRecord); the reader applies the
//! policy.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::message::{BorrowedMessage, Headers, Message};
use tinyflow_api::StreamResult;

use crate::bad_record::BadRecord;
use crate::config::{Format, TimeFrom};

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
pub(crate) struct RecordDecoder<V> {
    pub(crate) format: Format<V>,
    pub(crate) from: Option<TimeFrom<V>>,
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
