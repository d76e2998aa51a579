//! JSON records decoded into Arrow record batches (feature `arrow`).

use std::sync::Arc;

use arrow_array::{
    Array, ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray,
    TimestampMillisecondArray, TimestampNanosecondArray, TimestampSecondArray,
};
use arrow_json::reader::{Decoder, ReaderBuilder};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use rdkafka::message::Message;
use tinyflow_api::{OperatorContext, Source, SourceFactory, StreamError, StreamResult};

use crate::bad_record::{BadReason, BadRecord};
use crate::config::{EventTime, KafkaSourceConfig, TimeFrom};
use crate::source::{Decode, Outcome, Polled, open};

/// The columns [`JsonArrow::with_metadata_columns`] appends.
pub const METADATA_COLUMNS: [&str; 4] = [
    "_kafka_topic",
    "_kafka_partition",
    "_kafka_offset",
    "_kafka_timestamp",
];

/// JSON objects decoded into Arrow batches of a declared schema
/// (arrow-json): each poll of up to `batch_size` records becomes one batch.
#[derive(Debug, Clone)]
pub struct JsonArrow {
    schema: SchemaRef,
    strict: bool,
    metadata: bool,
}

impl JsonArrow {
    /// Decodes into `schema`: fields missing from a record are null (an
    /// error for a non-nullable field), fields the schema lacks are
    /// ignored.
    pub fn new(schema: SchemaRef) -> Self {
        JsonArrow {
            schema,
            strict: false,
            metadata: false,
        }
    }

    /// A record with a field the schema lacks is a bad record.
    pub fn strict(mut self) -> Self {
        self.strict = true;
        self
    }

    /// Appends the record's topic (utf8), partition (int32), offset (int64)
    /// and timestamp (int64 ms, nullable) as [`METADATA_COLUMNS`].
    pub fn with_metadata_columns(mut self) -> Self {
        self.metadata = true;
        self
    }

    /// The schema of the batches the source emits.
    pub fn output_schema(&self) -> SchemaRef {
        if !self.metadata {
            return Arc::clone(&self.schema);
        }
        let mut fields: Vec<Field> = self.schema.fields().iter().map(|f| (**f).clone()).collect();
        fields.push(Field::new(METADATA_COLUMNS[0], DataType::Utf8, false));
        fields.push(Field::new(METADATA_COLUMNS[1], DataType::Int32, false));
        fields.push(Field::new(METADATA_COLUMNS[2], DataType::Int64, false));
        fields.push(Field::new(METADATA_COLUMNS[3], DataType::Int64, true));
        Arc::new(Schema::new_with_metadata(
            fields,
            self.schema.metadata().clone(),
        ))
    }

    /// A decoder for up to `rows` rows (one more, to see a record with two).
    fn decoder(&self, rows: usize) -> Result<Decoder, String> {
        ReaderBuilder::new(Arc::clone(&self.schema))
            .with_batch_size(rows + 1)
            .with_strict_mode(self.strict)
            .build_decoder()
            .map_err(|e| e.to_string())
    }
}

impl EventTime<RecordBatch> {
    /// Event time is this column of the decoded batch: an integer (ms since
    /// the epoch) or a timestamp of any unit.
    pub fn column(name: impl Into<String>) -> Self {
        EventTime {
            from: TimeFrom::Column(name.into()),
            ..EventTime::record_timestamp()
        }
    }
}

/// A Kafka source of Arrow record batches decoded from JSON values; reads,
/// positions, event time and bad records as [`KafkaSource`](crate::KafkaSource).
#[derive(Debug, Clone)]
pub struct KafkaArrowSource {
    config: KafkaSourceConfig,
    format: JsonArrow,
    event_time: Option<EventTime<RecordBatch>>,
}

impl KafkaArrowSource {
    /// A source with `config`, decoding values with `format`.
    pub fn new(config: KafkaSourceConfig, format: JsonArrow) -> Self {
        KafkaArrowSource {
            config,
            format,
            event_time: None,
        }
    }

    /// Tracks event time (see [`EventTime`]; [`EventTime::column`] reads a
    /// column of the batch).
    pub fn with_event_time(mut self, event_time: EventTime<RecordBatch>) -> Self {
        self.event_time = Some(event_time);
        self
    }

    /// The schema of the batches it emits.
    pub fn output_schema(&self) -> SchemaRef {
        self.format.output_schema()
    }

    /// Checks the schema and the event-time column without connecting.
    pub fn validate(&self) -> StreamResult<()> {
        self.format.decoder(1).map_err(|e| StreamError::Config {
            key: "source.schema",
            message: format!("the JSON decoder rejects the declared schema: {e}"),
        })?;
        if let Some(EventTime {
            from: TimeFrom::Column(c),
            ..
        }) = &self.event_time
        {
            let field = self
                .format
                .schema
                .field_with_name(c)
                .map_err(|_| StreamError::Config {
                    key: "source.event_time",
                    message: format!(
                        "event-time column {c:?} is not in the schema (columns: {})",
                        self.format
                            .schema
                            .fields()
                            .iter()
                            .map(|f| f.name().as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })?;
            if !matches!(
                field.data_type(),
                DataType::Int64 | DataType::Timestamp(_, _)
            ) {
                return Err(StreamError::Config {
                    key: "source.event_time",
                    message: format!(
                        "event-time column {c:?} is {}; expected int64 (ms since the epoch) or a timestamp",
                        field.data_type()
                    ),
                });
            }
        }
        Ok(())
    }
}

impl SourceFactory<RecordBatch> for KafkaArrowSource {
    fn create(
        &self,
        ctx: &OperatorContext,
        restored: &[Vec<u8>],
    ) -> StreamResult<Box<dyn Source<RecordBatch>>> {
        self.validate()?;
        let decoder = ArrowDecoder {
            format: self.format.clone(),
            output: self.format.output_schema(),
            from: self.event_time.as_ref().map(|e| e.from.clone()),
            bad: Vec::new(),
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

struct ArrowDecoder {
    format: JsonArrow,
    output: SchemaRef,
    from: Option<TimeFrom<RecordBatch>>,
    /// Per polled record of the current batch: why it is bad, if it is.
    bad: Vec<Option<BadRecord>>,
}

impl ArrowDecoder {
    /// Feeds the records not known bad to a fresh decoder. A record that is
    /// not exactly one complete JSON value is marked bad and `false` is
    /// returned: the decoder is spoilt, start again.
    fn feed(&mut self, polled: &[Polled<'_>], decoder: &mut Decoder) -> bool {
        for (i, p) in polled.iter().enumerate() {
            if self.bad[i].is_some() {
                continue;
            }
            let payload = p.msg.payload().unwrap_or_default();
            let before = decoder.len();
            let problem = match decoder.decode(payload) {
                Err(e) => Some(format!("{e}")),
                Ok(used) if used < payload.len() => Some("more than one JSON value".to_owned()),
                Ok(_) if decoder.has_partial_record() => Some("incomplete value".to_owned()),
                Ok(_) if decoder.len() == before => {
                    Some("empty value, expected a JSON object".to_owned())
                }
                Ok(_) if decoder.len() > before + 1 => Some("more than one JSON value".to_owned()),
                Ok(_) => None,
            };
            if let Some(problem) = problem {
                self.bad[i] = Some(BadRecord::new(BadReason::InvalidJson, problem));
                return false;
            }
        }
        true
    }

    /// Finds the records a whole-batch decode failed on: each alone.
    fn isolate(&mut self, polled: &[Polled<'_>]) -> Result<usize, String> {
        let mut found = 0;
        for (i, p) in polled.iter().enumerate() {
            if self.bad[i].is_some() {
                continue;
            }
            let mut one = self.format.decoder(1)?;
            let result = one
                .decode(p.msg.payload().unwrap_or_default())
                .and_then(|_| one.flush());
            if let Err(e) = result {
                self.bad[i] = Some(BadRecord::new(BadReason::SchemaMismatch, e.to_string()));
                found += 1;
            }
        }
        Ok(found)
    }

    fn with_metadata(
        &self,
        batch: RecordBatch,
        good: &[&Polled<'_>],
    ) -> Result<RecordBatch, String> {
        if !self.format.metadata {
            return Ok(batch);
        }
        let mut columns: Vec<ArrayRef> = batch.columns().to_vec();
        columns.push(Arc::new(StringArray::from_iter_values(
            good.iter().map(|p| &*p.topic),
        )));
        columns.push(Arc::new(Int32Array::from_iter_values(
            good.iter().map(|p| p.msg.partition()),
        )));
        columns.push(Arc::new(Int64Array::from_iter_values(
            good.iter().map(|p| p.msg.offset()),
        )));
        columns.push(Arc::new(Int64Array::from_iter(
            good.iter().map(|p| p.msg.timestamp().to_millis()),
        )));
        RecordBatch::try_new(Arc::clone(&self.output), columns).map_err(|e| e.to_string())
    }
}

/// Event time in ms of each row of `column`.
fn times(column: &dyn Array) -> Vec<Option<i64>> {
    fn of<A: Array + 'static, T: Copy>(
        c: &dyn Array,
        f: impl Fn(&A, usize) -> T,
    ) -> Vec<Option<T>> {
        let a = c
            .as_any()
            .downcast_ref::<A>()
            .expect("type checked in validate");
        (0..a.len())
            .map(|i| a.is_valid(i).then(|| f(a, i)))
            .collect()
    }
    match column.data_type() {
        DataType::Int64 => of::<Int64Array, _>(column, |a, i| a.value(i)),
        DataType::Timestamp(TimeUnit::Second, _) => {
            of::<TimestampSecondArray, _>(column, |a, i| a.value(i).saturating_mul(1000))
        }
        DataType::Timestamp(TimeUnit::Millisecond, _) => {
            of::<TimestampMillisecondArray, _>(column, |a, i| a.value(i))
        }
        DataType::Timestamp(TimeUnit::Microsecond, _) => {
            of::<TimestampMicrosecondArray, _>(column, |a, i| a.value(i) / 1000)
        }
        DataType::Timestamp(TimeUnit::Nanosecond, _) => {
            of::<TimestampNanosecondArray, _>(column, |a, i| a.value(i) / 1_000_000)
        }
        _ => vec![None; column.len()],
    }
}

impl Decode for ArrowDecoder {
    type Out = RecordBatch;

    fn decode(
        &mut self,
        polled: &[Polled<'_>],
        out: &mut Vec<RecordBatch>,
        outcomes: &mut Vec<Outcome>,
    ) {
        self.bad.clear();
        self.bad.resize(polled.len(), None);
        let batch = loop {
            let mut decoder = match self.format.decoder(polled.len()) {
                Ok(d) => d,
                Err(e) => {
                    // Checked at create; cannot happen with the same schema.
                    let bad = BadRecord::new(BadReason::SchemaMismatch, e);
                    self.bad.iter_mut().for_each(|b| *b = Some(bad.clone()));
                    break None;
                }
            };
            if !self.feed(polled, &mut decoder) {
                continue;
            }
            match decoder.flush() {
                Ok(batch) => break batch,
                // A value that does not fit the schema: find which.
                Err(e) => match self.isolate(polled) {
                    Ok(0) => {
                        let bad = BadRecord::new(
                            BadReason::SchemaMismatch,
                            format!(
                                "the batch does not decode, though each record alone does: {e}"
                            ),
                        );
                        self.bad.iter_mut().for_each(|b| *b = Some(bad.clone()));
                        break None;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        let bad = BadRecord::new(BadReason::SchemaMismatch, e);
                        self.bad.iter_mut().for_each(|b| *b = Some(bad.clone()));
                        break None;
                    }
                },
            }
        };
        let good: Vec<&Polled<'_>> = polled
            .iter()
            .zip(&self.bad)
            .filter(|(_, b)| b.is_none())
            .map(|(p, _)| p)
            .collect();
        let mut row_times: Vec<Option<i64>> = match &self.from {
            Some(TimeFrom::Column(_)) => Vec::new(),
            Some(_) => good.iter().map(|p| p.msg.timestamp().to_millis()).collect(),
            None => vec![None; good.len()],
        };
        if let Some(batch) = batch {
            if let Some(TimeFrom::Column(c)) = &self.from
                && let Some(column) = batch.column_by_name(c)
            {
                row_times = times(column.as_ref());
            }
            match self.with_metadata(batch, &good) {
                Ok(batch) => out.push(batch),
                Err(e) => {
                    // Cannot happen: the columns are built to the schema.
                    let bad = BadRecord::new(BadReason::SchemaMismatch, e);
                    self.bad.iter_mut().for_each(|b| *b = Some(bad.clone()));
                }
            }
        }
        row_times.resize(good.len(), None);
        let mut row = row_times.into_iter();
        for bad in self.bad.drain(..) {
            outcomes.push(match bad {
                Some(reason) => Err(reason),
                None => Ok(row.next().flatten()),
            });
        }
    }
}
