//! JSON records decoded into Arrow record batches (feature `arrow`).

use std::sync::Arc;

use arrow_array::{
    Array, ArrayRef, BinaryArray, Int32Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray, TimestampMillisecondArray, TimestampNanosecondArray,
    TimestampSecondArray,
};
use arrow_json::reader::{Decoder, ReaderBuilder};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use rdkafka::message::Message;
use tinyflow_api::{OperatorContext, Source, SourceFactory, StreamError, StreamResult};

use crate::bad_record::{BadReason, BadRecord};
use crate::config::{EventTime, KafkaSourceConfig, TimeFrom};
use crate::decode::{Decode, Outcome, Polled};
use crate::reader::open;
use crate::scan::{Allow, Columns, Kind, Limits, Shape, scan};

/// The columns [`JsonArrow::with_metadata_columns`] appends.
pub const METADATA_COLUMNS: [&str; 4] = [
    "_kafka_topic",
    "_kafka_partition",
    "_kafka_offset",
    "_kafka_timestamp",
];

/// A lossy conversion a [`JsonArrow`] format can be told to allow with
/// [`JsonArrow::coerce`]. By default a value that does not fit its column
/// exactly makes its record bad ([`BadReason::LossyConversion`]), where
/// arrow-json alone would convert it silently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Coercion {
    /// A number with a fraction into an integer, date or timestamp column,
    /// truncated toward zero (`1.5` -> 1). `1.0` and `1.5e1` are exact and
    /// need no coercion. Out of range stays bad.
    FractionToInteger,
    /// A string holding a number into an integer or float column, parsed
    /// (`"12"` -> 12).
    StringToNumber,
    /// A timestamp string more precise than its column, the extra digits
    /// dropped (nanoseconds into a microsecond column); a date-time string
    /// into a date column, the date of its UTC instant kept.
    TruncateTime,
}

impl Coercion {
    /// Every coercion.
    pub const ALL: [Coercion; 3] = [
        Coercion::FractionToInteger,
        Coercion::StringToNumber,
        Coercion::TruncateTime,
    ];

    /// Its name in job files: `fraction-to-integer`, `string-to-number`,
    /// `truncate-time`.
    pub fn name(self) -> &'static str {
        match self {
            Coercion::FractionToInteger => "fraction-to-integer",
            Coercion::StringToNumber => "string-to-number",
            Coercion::TruncateTime => "truncate-time",
        }
    }

    /// The coercion of this [`name`](Coercion::name).
    pub fn from_name(name: &str) -> Option<Self> {
        Coercion::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// How bytes of a record (its key, a header, or its whole value with
/// [`JsonArrow::raw`]) become a column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BytesAs {
    /// A UTF-8 string column; bytes that are not UTF-8 make the record bad
    /// ([`BadReason::Undecodable`]).
    String,
    /// A binary column, the bytes as they are.
    Binary,
}

impl BytesAs {
    /// Its name in job files: `string` or `binary`.
    pub fn name(self) -> &'static str {
        match self {
            BytesAs::String => "string",
            BytesAs::Binary => "binary",
        }
    }

    /// The one of this [`name`](BytesAs::name).
    pub fn from_name(name: &str) -> Option<Self> {
        [BytesAs::String, BytesAs::Binary]
            .into_iter()
            .find(|b| b.name() == name)
    }

    fn data_type(self) -> DataType {
        match self {
            BytesAs::String => DataType::Utf8,
            BytesAs::Binary => DataType::Binary,
        }
    }

    /// A column of `values` (null where `None`); `None` if a string is not
    /// UTF-8 (checked before, by [`BytesAs::check`]).
    fn column<'a>(self, values: impl Iterator<Item = Option<&'a [u8]>>) -> Option<ArrayRef> {
        Some(match self {
            BytesAs::String => Arc::new(
                values
                    .map(|v| v.map(std::str::from_utf8).transpose())
                    .collect::<Result<StringArray, _>>()
                    .ok()?,
            ),
            BytesAs::Binary => Arc::new(values.collect::<BinaryArray>()),
        })
    }

    /// Why `bytes`, the record's `what` (named only when bad), cannot be a
    /// value of this column.
    fn check(self, what: impl FnOnce() -> String, bytes: Option<&[u8]>) -> Option<BadRecord> {
        match (self, bytes) {
            (BytesAs::String, Some(b)) => std::str::from_utf8(b).err().map(|e| {
                BadRecord::new(
                    BadReason::Undecodable,
                    format!("{} is not UTF-8: {e}", what()),
                )
            }),
            _ => None,
        }
    }
}

/// What a record's value is decoded as.
#[derive(Debug, Clone)]
enum Value {
    /// A JSON object, into the declared columns.
    Json,
    /// The bytes as they are, in one column (null for a tombstone).
    Raw(BytesAs),
    /// Avro in the Confluent wire format, writer schemas from this
    /// registry, into the declared columns.
    #[cfg(feature = "avro")]
    Avro {
        registry: crate::registry::RegistryConfig,
        cache: crate::avro::SchemaCache,
        evolution: Option<crate::avro::Evolution>,
    },
    /// Protobuf in the Confluent wire format, schemas from this registry,
    /// into the declared columns (through JSON: see `protobuf.rs`).
    #[cfg(feature = "protobuf")]
    Protobuf {
        registry: crate::registry::RegistryConfig,
        cache: crate::avro::SchemaCache,
    },
}

/// A header taken into a column.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HeaderColumn {
    header: String,
    column: String,
    ty: BytesAs,
}

/// JSON objects decoded into Arrow batches of a declared schema
/// (arrow-json): each poll of up to `batch_size` records becomes one batch.
///
/// Each payload is first scanned once (bounded by the source's
/// `max_record_bytes` and `max_nesting_depth`): the value of every
/// top-level field whose column is an integer, float, date or timestamp
/// must fit it exactly, unless a [`Coercion`] allows otherwise. Values of
/// other types, and nested values, are checked by arrow-json alone.
#[derive(Debug, Clone)]
pub struct JsonArrow {
    schema: SchemaRef,
    strict: bool,
    metadata: bool,
    allow: Allow,
    value: Value,
    key: Option<(String, BytesAs)>,
    headers: Vec<HeaderColumn>,
    /// Every header in one map column.
    all_headers: Option<(String, BytesAs)>,
    /// The key decoded as Avro (with the value's registry) into a struct
    /// column of these fields.
    #[cfg(feature = "avro")]
    avro_key: Option<(String, SchemaRef)>,
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
            allow: Allow::default(),
            value: Value::Json,
            key: None,
            headers: Vec::new(),
            all_headers: None,
            #[cfg(feature = "avro")]
            avro_key: None,
        }
    }

    /// Not JSON: each record's value as it is, in one nullable column
    /// `column` (null for a record without a value, a tombstone). Larger
    /// than the source's `max_record_bytes` is still bad (`too_large`).
    pub fn raw(column: &str, ty: BytesAs) -> Self {
        JsonArrow {
            value: Value::Raw(ty),
            ..JsonArrow::new(Arc::new(Schema::new(vec![Field::new(
                column,
                ty.data_type(),
                true,
            )])))
        }
    }

    /// Avro values in the Confluent wire format (a zero byte, the writer
    /// schema's id, the datum), decoded with their writer schema (fetched
    /// from `registry` by id, once) into `schema`'s columns by name: a
    /// column the writer lacks is null (a required one makes the record
    /// bad), a field the schema lacks is ignored (bad under
    /// [`strict`](Self::strict)), and a value converts only without loss
    /// (int to long or double, float to double, a timestamp to a finer
    /// unit, a decimal to a greater precision, an enum or a UUID to a
    /// string, fixed to binary). Feature `avro`.
    #[cfg(feature = "avro")]
    pub fn avro(schema: SchemaRef, registry: crate::registry::RegistryConfig) -> Self {
        JsonArrow {
            value: Value::Avro {
                registry,
                cache: crate::avro::SchemaCache::default(),
                evolution: None,
            },
            ..JsonArrow::new(schema)
        }
    }

    /// Protobuf values in the Confluent wire format (a zero byte, the
    /// writer schema's id, the message indexes, the message), each message
    /// decoded with its writer schema (fetched from `registry` by id, once)
    /// and taken into `schema`'s columns by field name as a JSON object
    /// would be, with the same checks: a column the message lacks is null
    /// (a required one makes the record bad), a value converts only
    /// exactly. Feature `protobuf`.
    #[cfg(feature = "protobuf")]
    pub fn protobuf(schema: SchemaRef, registry: crate::registry::RegistryConfig) -> Self {
        JsonArrow {
            value: Value::Protobuf {
                registry,
                cache: crate::avro::SchemaCache::default(),
            },
            ..JsonArrow::new(schema)
        }
    }

    /// Schema evolution for Avro values (see [`SchemaEvolution`](crate::SchemaEvolution)):
    /// the columns come from `evolution`'s evolver, which may grow them;
    /// columns it adds come after the key, header and metadata columns, so
    /// those keep their places. No effect on other formats.
    #[cfg(feature = "avro")]
    pub fn with_evolution(mut self, e: crate::avro::Evolution) -> Self {
        if let Value::Avro { evolution, .. } = &mut self.value {
            *evolution = Some(e);
        }
        self
    }

    /// Appends the record's key as the nullable column `column` (null for
    /// a record without a key), after the value's columns.
    pub fn with_key_column(mut self, column: &str, ty: BytesAs) -> Self {
        self.key = Some((column.to_owned(), ty));
        self
    }

    /// Appends the value of the record's header `header` as the nullable
    /// column `column`, after the key's (null when the record lacks the
    /// header or it has no value; the last one when it has the header
    /// more than once, as a map of headers would keep).
    pub fn with_header_column(mut self, header: &str, column: &str, ty: BytesAs) -> Self {
        self.headers.push(HeaderColumn {
            header: header.to_owned(),
            column: column.to_owned(),
            ty,
        });
        self
    }

    /// Appends the record's key, Avro in the Confluent wire format
    /// (writer schemas from the value's registry), as the nullable struct
    /// column `column` of `fields` (null for a record without a key),
    /// where [`with_key_column`](Self::with_key_column) puts a key. A key
    /// that does not decode makes its record bad. Only with Avro values.
    #[cfg(feature = "avro")]
    pub fn with_avro_key_column(mut self, column: &str, fields: SchemaRef) -> Self {
        self.key = None;
        self.avro_key = Some((column.to_owned(), fields));
        self
    }

    /// Appends every header of the record as the map column `column`,
    /// name to value, after the single headers' columns (empty for a
    /// record without headers; a header without a value maps to null; a
    /// name sent twice keeps its last value, so keys are unique).
    pub fn with_all_headers(mut self, column: &str, ty: BytesAs) -> Self {
        self.all_headers = Some((column.to_owned(), ty));
        self
    }

    /// The type of the map column of all headers.
    fn headers_map_type(ty: BytesAs) -> DataType {
        DataType::Map(
            Arc::new(Field::new(
                "key_value",
                DataType::Struct(
                    vec![
                        Field::new("key", DataType::Utf8, false),
                        Field::new("value", ty.data_type(), true),
                    ]
                    .into(),
                ),
                false,
            )),
            false,
        )
    }

    /// The columns after the value's, in order: the key, the headers, the
    /// map of all headers, the metadata columns.
    fn extra_fields(&self) -> Vec<Field> {
        let mut fields = Vec::new();
        if let Some((name, ty)) = &self.key {
            fields.push(Field::new(name, ty.data_type(), true));
        }
        #[cfg(feature = "avro")]
        if let Some((name, key)) = &self.avro_key {
            fields.push(Field::new(
                name,
                DataType::Struct(key.fields().clone()),
                true,
            ));
        }
        for h in &self.headers {
            fields.push(Field::new(&h.column, h.ty.data_type(), true));
        }
        if let Some((name, ty)) = &self.all_headers {
            fields.push(Field::new(name, Self::headers_map_type(*ty), false));
        }
        if self.metadata {
            fields.push(Field::new(METADATA_COLUMNS[0], DataType::Utf8, false));
            fields.push(Field::new(METADATA_COLUMNS[1], DataType::Int32, false));
            fields.push(Field::new(METADATA_COLUMNS[2], DataType::Int64, false));
            fields.push(Field::new(METADATA_COLUMNS[3], DataType::Int64, true));
        }
        fields
    }

    /// A column named twice among the value's, key, header and metadata
    /// columns.
    fn duplicate_column(&self) -> Option<String> {
        let fields = self.output_schema();
        let mut seen = std::collections::HashSet::new();
        fields
            .fields()
            .iter()
            .map(|f| f.name())
            .find(|n| !seen.insert(n.as_str()))
            .cloned()
    }

    /// Allows one lossy conversion (see [`Coercion`]); call once for each.
    pub fn coerce(mut self, coercion: Coercion) -> Self {
        match coercion {
            Coercion::FractionToInteger => self.allow.fraction_to_integer = true,
            Coercion::StringToNumber => self.allow.string_to_number = true,
            Coercion::TruncateTime => self.allow.truncate_time = true,
        }
        self
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
        self.output_for(&self.value_columns())
    }

    /// The value's columns now: the declared ones, or (with schema
    /// evolution) the evolver's.
    fn value_columns(&self) -> SchemaRef {
        #[cfg(feature = "avro")]
        if let Value::Avro {
            evolution: Some(e), ..
        } = &self.value
        {
            return e.evolver.columns();
        }
        Arc::clone(&self.schema)
    }

    /// The output schema for these value columns: the declared ones, the
    /// key, header and metadata columns, then value columns added since.
    fn output_for(&self, value: &SchemaRef) -> SchemaRef {
        let extra = self.extra_fields();
        if extra.is_empty() {
            return Arc::clone(value);
        }
        let declared = self.schema.fields().len().min(value.fields().len());
        let mut fields: Vec<Field> = value.fields()[..declared]
            .iter()
            .map(|f| (**f).clone())
            .collect();
        fields.extend(extra);
        fields.extend(value.fields()[declared..].iter().map(|f| (**f).clone()));
        Arc::new(Schema::new_with_metadata(fields, value.metadata().clone()))
    }

    /// A decoder for up to `rows` rows (one more, to see a record with two).
    fn decoder(&self, rows: usize) -> Result<Decoder, String> {
        ReaderBuilder::new(Arc::clone(&self.schema))
            .with_batch_size(rows + 1)
            .with_strict_mode(self.strict)
            .build_decoder()
            .map_err(|e| e.to_string())
    }

    /// The columns the pre-scan checks, with what each takes (inside
    /// structs, lists and maps too).
    fn columns(&self) -> Columns {
        fields_shapes(self.schema.fields(), self.allow)
    }
}

/// The shapes of those of `fields` that have something to check.
fn fields_shapes(fields: &arrow_schema::Fields, allow: Allow) -> Columns {
    Columns::new(
        fields
            .iter()
            .filter_map(|f| Some((f.name().clone(), shape(f.data_type(), allow)?))),
        allow,
    )
}

/// What the pre-scan checks of a value of type `ty`; `None` if nothing.
fn shape(ty: &DataType, allow: Allow) -> Option<Shape> {
    Some(Shape::Leaf(match ty {
        DataType::Int8 => int(i8::MIN, i8::MAX),
        DataType::Int16 => int(i16::MIN, i16::MAX),
        DataType::Int32 => int(i32::MIN, i32::MAX),
        DataType::Int64 => int(i64::MIN, i64::MAX),
        DataType::UInt8 => int(0, u8::MAX),
        DataType::UInt16 => int(0, u16::MAX),
        DataType::UInt32 => int(0, u32::MAX),
        DataType::UInt64 => int(0, u64::MAX),
        DataType::Float32 => Kind::Float32,
        DataType::Float64 => Kind::Float64,
        DataType::Date32 => Kind::Date,
        DataType::Timestamp(unit, _) => Kind::Timestamp {
            digits: match unit {
                TimeUnit::Second => 0,
                TimeUnit::Millisecond => 3,
                TimeUnit::Microsecond => 6,
                TimeUnit::Nanosecond => 9,
            },
        },
        DataType::Struct(fields) => {
            let columns = fields_shapes(fields, allow);
            return (!columns.is_empty()).then_some(Shape::Object(columns));
        }
        DataType::List(element) | DataType::LargeList(element) => {
            return Some(Shape::List(Box::new(shape(element.data_type(), allow)?)));
        }
        DataType::Map(entries, _) => match entries.data_type() {
            DataType::Struct(kv) if kv.len() == 2 => {
                return Some(Shape::Map(Box::new(shape(kv[1].data_type(), allow)?)));
            }
            _ => return None,
        },
        _ => return None,
    }))
}

fn int(min: impl Into<i128>, max: impl Into<i128>) -> Kind {
    Kind::integer(min.into(), max.into())
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

    /// Checks the schema, the limits and the event-time column without
    /// connecting.
    pub fn validate(&self) -> StreamResult<()> {
        self.config.validate_limits()?;
        #[cfg(feature = "avro")]
        if self.format.avro_key.is_some() && !matches!(self.format.value, Value::Avro { .. }) {
            return Err(StreamError::Config {
                key: "source.key",
                message: "an Avro key needs Avro values (source.format = \"avro\"): it uses their registry".to_owned(),
            });
        }
        if let Some(name) = self.format.duplicate_column() {
            return Err(StreamError::Config {
                key: "source.schema",
                message: format!(
                    "column `{name}` is named twice (among the value's columns, the key's, the headers' and the metadata columns)"
                ),
            });
        }
        match &self.format.value {
            Value::Json => {
                self.format.decoder(1).map_err(|e| StreamError::Config {
                    key: "source.schema",
                    message: format!("the JSON decoder rejects the declared schema: {e}"),
                })?;
            }
            Value::Raw(_) => {}
            #[cfg(feature = "protobuf")]
            Value::Protobuf { registry, .. } => {
                self.format.decoder(1).map_err(|e| StreamError::Config {
                    key: "source.schema",
                    message: format!("the JSON decoder rejects the declared schema: {e}"),
                })?;
                open_registry(registry)?;
            }
            #[cfg(feature = "avro")]
            Value::Avro { registry, .. } => {
                open_registry(registry)?;
            }
        }
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
        // The columns now (they may have grown since the plan).
        let value = self.format.value_columns();
        #[cfg(feature = "avro")]
        let avro_keys = match (&self.format.avro_key, &self.format.value) {
            (
                Some((_, fields)),
                Value::Avro {
                    registry, cache, ..
                },
            ) => Some(crate::avro::AvroValues::new(
                open_registry(registry)?,
                Arc::clone(fields),
                false,
                format!("{} (keys)", ctx.name),
                None,
                cache.clone(),
            )),
            _ => None,
        };
        let decoder = ArrowDecoder {
            #[cfg(feature = "avro")]
            avro_keys,
            payloads: JsonArrowDecoder::with_limits(&self.format, self.config.limits()),
            output: self.format.output_for(&value),
            #[cfg(feature = "avro")]
            key_column: None,
            declared: self.format.schema.fields().len(),
            from: self.event_time.as_ref().map(|e| e.from.clone()),
            #[cfg(feature = "avro")]
            avro: match &self.format.value {
                Value::Avro {
                    registry,
                    cache,
                    evolution,
                } => Some(crate::avro::AvroValues::new(
                    open_registry(registry)?,
                    value,
                    self.format.strict,
                    ctx.name.clone(),
                    evolution.clone(),
                    cache.clone(),
                )),
                #[cfg(feature = "protobuf")]
                Value::Protobuf { registry, cache } => Some(
                    crate::avro::AvroValues::new(
                        open_registry(registry)?,
                        value,
                        self.format.strict,
                        ctx.name.clone(),
                        None,
                        cache.clone(),
                    )
                    .protobuf(),
                ),
                _ => None,
            },
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

/// Decodes the payloads of one poll into one batch as
/// [`KafkaArrowSource`] does, without Kafka (for benches and tests): each
/// payload is scanned (limits, exact fit), the rest are decoded together,
/// and a bad one never takes a good one with it.
#[derive(Debug)]
pub struct JsonArrowDecoder {
    format: JsonArrow,
    columns: Columns,
    limits: Limits,
    /// Per payload of the current batch: why it is bad, if it is.
    bad: Vec<Option<BadRecord>>,
}

impl JsonArrowDecoder {
    /// A decoder for `format` with these limits (see
    /// [`KafkaSourceConfig::max_record_bytes`] and
    /// [`KafkaSourceConfig::max_nesting_depth`]).
    pub fn new(format: &JsonArrow, max_record_bytes: usize, max_nesting_depth: usize) -> Self {
        Self::with_limits(
            format,
            Limits {
                max_bytes: max_record_bytes,
                max_depth: max_nesting_depth,
            },
        )
    }

    fn with_limits(format: &JsonArrow, limits: Limits) -> Self {
        JsonArrowDecoder {
            format: format.clone(),
            columns: format.columns(),
            limits,
            bad: Vec::new(),
        }
    }

    /// Decodes `payloads`: the batch of the good ones, in order (without
    /// metadata columns; `None` when none is good), and per payload why it
    /// is bad, if it is.
    pub fn decode(
        &mut self,
        payloads: &[&[u8]],
    ) -> (Option<RecordBatch>, Vec<Option<(BadReason, String)>>) {
        let batch = self.decode_batch(payloads);
        let bad = self
            .bad
            .drain(..)
            .map(|b| b.map(|b| (b.reason, b.detail)))
            .collect();
        (batch, bad)
    }

    /// Decodes `payloads`, leaving in `self.bad` why each is bad.
    fn decode_batch(&mut self, payloads: &[&[u8]]) -> Option<RecordBatch> {
        self.decode_batch_after(payloads, vec![None; payloads.len()])
    }

    /// As [`decode_batch`](Self::decode_batch), the records `known` names
    /// already bad (for their key or a header) left out.
    fn decode_batch_after(
        &mut self,
        payloads: &[&[u8]],
        known: Vec<Option<BadRecord>>,
    ) -> Option<RecordBatch> {
        debug_assert_eq!(known.len(), payloads.len());
        self.bad = known;
        let mut scanned = 0;
        loop {
            let mut decoder = match self.format.decoder(payloads.len()) {
                Ok(d) => d,
                Err(e) => {
                    // Checked at create; cannot happen with the same schema.
                    self.all_bad(BadReason::SchemaMismatch, e);
                    return None;
                }
            };
            if !self.feed(payloads, &mut scanned, &mut decoder) {
                continue;
            }
            match decoder.flush() {
                Ok(batch) => return batch,
                // A value that does not fit the schema: find which.
                Err(e) => match self.isolate(payloads) {
                    Ok(0) => {
                        self.all_bad(
                            BadReason::SchemaMismatch,
                            format!(
                                "the batch does not decode, though each record alone does: {e}"
                            ),
                        );
                        return None;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        self.all_bad(BadReason::SchemaMismatch, e);
                        return None;
                    }
                },
            }
        }
    }

    fn all_bad(&mut self, reason: BadReason, detail: String) {
        let bad = BadRecord::new(reason, detail);
        self.bad.iter_mut().for_each(|b| *b = Some(bad.clone()));
    }

    /// Feeds the records not known bad to a fresh decoder, scanning each
    /// first (those from `scanned` on: a record is scanned once, just before
    /// it is fed, while its bytes are in cache). A record that is not
    /// exactly one complete JSON value is marked bad and `false` is
    /// returned: the decoder is spoilt, start again.
    fn feed(&mut self, payloads: &[&[u8]], scanned: &mut usize, decoder: &mut Decoder) -> bool {
        for (i, payload) in payloads.iter().enumerate() {
            if i >= *scanned {
                *scanned = i + 1;
                if self.bad[i].is_some() {
                    continue;
                }
                if let Err(bad) = scan(payload, &self.limits, &self.columns) {
                    self.bad[i] = Some(bad);
                }
            }
            if self.bad[i].is_some() {
                continue;
            }
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
    fn isolate(&mut self, payloads: &[&[u8]]) -> Result<usize, String> {
        let mut found = 0;
        for (i, payload) in payloads.iter().enumerate() {
            if self.bad[i].is_some() {
                continue;
            }
            let mut one = self.format.decoder(1)?;
            let result = one.decode(payload).and_then(|_| one.flush());
            if let Err(e) = result {
                self.bad[i] = Some(BadRecord::new(BadReason::SchemaMismatch, e.to_string()));
                found += 1;
            }
        }
        Ok(found)
    }
}

struct ArrowDecoder {
    payloads: JsonArrowDecoder,
    output: SchemaRef,
    /// How many value columns come before the key, header and metadata
    /// columns (the declared ones; columns added by schema evolution come
    /// after them).
    declared: usize,
    from: Option<TimeFrom<RecordBatch>>,
    /// The Avro decoder, for Avro values.
    #[cfg(feature = "avro")]
    avro: Option<crate::avro::AvroValues>,
    /// The Avro decoder of keys, for Avro keys.
    #[cfg(feature = "avro")]
    avro_keys: Option<crate::avro::AvroValues>,
    /// The key column of this poll's good records, when keys are Avro.
    #[cfg(feature = "avro")]
    key_column: Option<ArrayRef>,
}

/// The value of `msg`'s last header named `name`, if it has one with a
/// value.
fn header<'m>(msg: &'m rdkafka::message::BorrowedMessage<'_>, name: &str) -> Option<&'m [u8]> {
    crate::decode::headers_of(msg)?
        .into_iter()
        .rfind(|(k, _)| *k == name)
        .and_then(|(_, v)| v)
}

impl ArrowDecoder {
    /// Why `p`'s key or one of the headers taken into columns cannot be
    /// their column's value, if so.
    fn check_key_and_headers(&self, p: &Polled<'_>) -> Option<BadRecord> {
        let format = &self.payloads.format;
        if (!format.headers.is_empty() || format.all_headers.is_some())
            && crate::decode::headers_of(&p.msg).is_none()
        {
            return Some(crate::decode::header_name_not_utf8());
        }
        if let Some((_, ty)) = &format.key
            && let Some(bad) = ty.check(|| "the key".to_owned(), p.msg.key())
        {
            return Some(bad);
        }
        if let Some(bad) = format.headers.iter().find_map(|h| {
            h.ty.check(
                || format!("header `{}`", h.header),
                header(&p.msg, &h.header),
            )
        }) {
            return Some(bad);
        }
        let (_, ty) = format.all_headers.as_ref()?;
        crate::decode::headers_of(&p.msg)?
            .into_iter()
            .find_map(|(k, v)| ty.check(|| format!("header `{k}`"), v))
    }

    /// The raw values of the records not known bad (`self.payloads.bad`),
    /// as one column; a value too large or not UTF-8 (for a string column)
    /// makes its record bad.
    fn raw_batch(&mut self, polled: &[Polled<'_>], ty: BytesAs) -> Option<RecordBatch> {
        let limits = self.payloads.limits;
        for (p, bad) in polled.iter().zip(self.payloads.bad.iter_mut()) {
            if bad.is_some() {
                continue;
            }
            let value = p.msg.payload();
            *bad = match value.map(|v| limits.check_size(v)) {
                Some(Err(too_large)) => Some(too_large),
                _ => ty.check(|| "the value".to_owned(), value),
            };
        }
        let good = polled
            .iter()
            .zip(&self.payloads.bad)
            .filter(|(_, b)| b.is_none())
            .map(|(p, _)| p.msg.payload());
        let batch = ty
            .column(good)
            .ok_or_else(|| "a value not UTF-8 passed the check".to_owned())
            .and_then(|column| {
                RecordBatch::try_new(Arc::clone(&self.payloads.format.schema), vec![column])
                    .map_err(|e| e.to_string())
            });
        match batch {
            Ok(batch) => (batch.num_rows() > 0).then_some(batch),
            // Cannot happen: the column is built to the schema from checked
            // values. Were it to, no record may pass as read without a row.
            Err(e) => {
                self.payloads.all_bad(BadReason::SchemaMismatch, e);
                None
            }
        }
    }

    /// `batch` (the values' columns of the `good` records) with the key,
    /// header and metadata columns appended.
    fn with_metadata(
        &self,
        batch: RecordBatch,
        good: &[&Polled<'_>],
    ) -> Result<RecordBatch, String> {
        let format = &self.payloads.format;
        #[cfg(feature = "avro")]
        let avro_key = format.avro_key.is_some();
        #[cfg(not(feature = "avro"))]
        let avro_key = false;
        if format.key.is_none()
            && !avro_key
            && format.headers.is_empty()
            && format.all_headers.is_none()
            && !format.metadata
        {
            return Ok(batch);
        }
        let not_utf8 = || "a key or header not UTF-8 passed the check".to_owned();
        let declared = self.declared.min(batch.num_columns());
        let mut columns: Vec<ArrayRef> = batch.columns()[..declared].to_vec();
        if let Some((_, ty)) = &format.key {
            columns.push(
                ty.column(good.iter().map(|p| p.msg.key()))
                    .ok_or_else(not_utf8)?,
            );
        }
        #[cfg(feature = "avro")]
        if avro_key {
            columns.push(
                self.key_column
                    .clone()
                    .ok_or_else(|| "the keys of the poll were not decoded".to_owned())?,
            );
        }
        for h in &format.headers {
            columns.push(
                h.ty.column(good.iter().map(|p| header(&p.msg, &h.header)))
                    .ok_or_else(not_utf8)?,
            );
        }
        if let Some((_, ty)) = &format.all_headers {
            columns.push(headers_map(good, *ty).ok_or_else(not_utf8)?);
        }
        if format.metadata {
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
        }
        columns.extend(batch.columns()[declared..].iter().cloned());
        RecordBatch::try_new(Arc::clone(&self.output), columns).map_err(|e| e.to_string())
    }
}

/// The Avro keys of a poll: the decoded keys, and for each record the row
/// of its key (`None`: no key, or a bad one).
#[cfg(feature = "avro")]
struct DecodedKeys {
    batch: Option<RecordBatch>,
    rows: Vec<Option<u32>>,
    fields: arrow_schema::Fields,
}

#[cfg(feature = "avro")]
impl DecodedKeys {
    /// The key column of the records `bad` leaves good, in order.
    fn column_for(self, bad: &[Option<BadRecord>]) -> Option<ArrayRef> {
        let indices: arrow_array::UInt32Array = self
            .rows
            .iter()
            .zip(bad)
            .filter(|(_, b)| b.is_none())
            .map(|(r, _)| *r)
            .collect();
        let keys: ArrayRef = match self.batch {
            Some(b) => Arc::new(arrow_array::StructArray::from(b)),
            None => arrow_array::new_null_array(&DataType::Struct(self.fields.clone()), 0),
        };
        arrow_select::take::take(keys.as_ref(), &indices, None).ok()
    }
}

#[cfg(feature = "avro")]
impl ArrowDecoder {
    /// Decodes the Avro keys of `polled` (a record without a key has a
    /// null one), marking records with a bad key in `bad`.
    fn decode_avro_keys(
        &mut self,
        polled: &[Polled<'_>],
        bad: &mut [Option<BadRecord>],
    ) -> Option<DecodedKeys> {
        let fields = self.payloads.format.avro_key.as_ref()?.1.fields().clone();
        let decoder = self.avro_keys.as_mut()?;
        let with_key: Vec<usize> = (0..polled.len())
            .filter(|&i| bad[i].is_none() && polled[i].msg.key().is_some())
            .collect();
        let payloads: Vec<Option<&[u8]>> = with_key.iter().map(|&i| polled[i].msg.key()).collect();
        let mut key_bad = vec![None; with_key.len()];
        let batch = decoder.decode(&payloads, &mut key_bad);
        let mut rows = vec![None; polled.len()];
        let mut next = 0u32;
        for (k, &i) in with_key.iter().enumerate() {
            match key_bad[k].take() {
                Some(b) => {
                    bad[i] = Some(BadRecord::new(b.reason, format!("the key: {}", b.detail)));
                }
                None => {
                    rows[i] = Some(next);
                    next += 1;
                }
            }
        }
        Some(DecodedKeys {
            batch,
            rows,
            fields,
        })
    }
}

/// A client of the registry of Avro or Protobuf values; a settings error
/// names `source.registry`.
#[cfg(feature = "avro")]
fn open_registry(
    config: &crate::registry::RegistryConfig,
) -> StreamResult<crate::registry::Registry> {
    crate::registry::Registry::new(config.clone()).map_err(|e| StreamError::Config {
        key: "source.registry",
        message: e.to_string(),
    })
}

/// The values of `polled`; one larger than the limit makes its record bad
/// (in `bad`).
#[cfg(feature = "avro")]
fn sized_payloads<'a>(
    polled: &'a [Polled<'_>],
    bad: &mut [Option<BadRecord>],
    limits: Limits,
) -> Vec<Option<&'a [u8]>> {
    polled
        .iter()
        .zip(bad.iter_mut())
        .map(|(p, b)| {
            let value = p.msg.payload();
            if b.is_none()
                && let Some(Err(too_large)) = value.map(|v| limits.check_size(v))
            {
                *b = Some(too_large);
            }
            value
        })
        .collect()
}

/// Every header of each of `records` as one map column (see
/// [`JsonArrow::with_all_headers`]); `None` if a value is not UTF-8 for a
/// string map (checked before).
fn headers_map(records: &[&Polled<'_>], ty: BytesAs) -> Option<ArrayRef> {
    let mut offsets = Vec::with_capacity(records.len() + 1);
    offsets.push(0i32);
    let mut keys: Vec<&str> = Vec::new();
    let mut values: Vec<Option<&[u8]>> = Vec::new();
    let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for p in records {
        seen.clear();
        for (k, v) in crate::decode::headers_of(&p.msg)? {
            // The last value of a name sent twice.
            match seen.get(k) {
                Some(&i) => values[i] = v,
                None => {
                    seen.insert(k, keys.len());
                    keys.push(k);
                    values.push(v);
                }
            }
        }
        offsets.push(i32::try_from(keys.len()).ok()?);
    }
    let DataType::Map(entries, _) = JsonArrow::headers_map_type(ty) else {
        return None;
    };
    let DataType::Struct(kv) = entries.data_type() else {
        return None;
    };
    let key_array: ArrayRef = Arc::new(StringArray::from(keys));
    let value_array = ty.column(values.into_iter())?;
    let struct_array =
        arrow_array::StructArray::try_new(kv.clone(), vec![key_array, value_array], None).ok()?;
    arrow_array::MapArray::try_new(
        entries,
        arrow_buffer::OffsetBuffer::new(offsets.into()),
        struct_array,
        None,
        false,
    )
    .ok()
    .map(|m| Arc::new(m) as ArrayRef)
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

#[async_trait::async_trait]
impl Decode for ArrowDecoder {
    type Out = RecordBatch;

    #[cfg(feature = "avro")]
    fn must_wait(&mut self, msg: &rdkafka::message::BorrowedMessage<'_>) -> bool {
        let at = || format!("{}/{}@{}", msg.topic(), msg.partition(), msg.offset());
        let value = self
            .avro
            .as_mut()
            .is_some_and(|a| a.must_wait(msg.payload(), at));
        let key = self
            .avro_keys
            .as_mut()
            .is_some_and(|a| msg.key().is_some() && a.must_wait(msg.key(), at));
        value || key
    }

    #[cfg(feature = "avro")]
    async fn ready(&mut self, max: std::time::Duration) -> StreamResult<bool> {
        let values = match self.avro.as_mut() {
            Some(a) => a.ready(max).await?,
            None => true,
        };
        let keys = match self.avro_keys.as_mut() {
            Some(a) => a.ready(max).await?,
            None => true,
        };
        Ok(values && keys)
    }

    fn decode(
        &mut self,
        polled: &[Polled<'_>],
        out: &mut Vec<RecordBatch>,
        outcomes: &mut Vec<Outcome>,
    ) {
        let known: Vec<Option<BadRecord>> = polled
            .iter()
            .map(|p| self.check_key_and_headers(p))
            .collect();
        let batch = match &self.payloads.format.value {
            Value::Json => {
                let payloads: Vec<&[u8]> = polled
                    .iter()
                    .map(|p| p.msg.payload().unwrap_or_default())
                    .collect();
                self.payloads.decode_batch_after(&payloads, known)
            }
            Value::Raw(ty) => {
                let ty = *ty;
                self.payloads.bad = known;
                self.raw_batch(polled, ty)
            }
            #[cfg(feature = "protobuf")]
            Value::Protobuf { .. } => {
                let mut bad = known;
                let payloads = sized_payloads(polled, &mut bad, self.payloads.limits);
                let json = self
                    .avro
                    .as_mut()
                    .expect("made at create for Protobuf values")
                    .protobuf_json(&payloads, &mut bad);
                let refs: Vec<&[u8]> = json.iter().map(Vec::as_slice).collect();
                self.payloads.decode_batch_after(&refs, bad)
            }
            #[cfg(feature = "avro")]
            Value::Avro { .. } => {
                let mut bad = known;
                let keys = self.decode_avro_keys(polled, &mut bad);
                let payloads = sized_payloads(polled, &mut bad, self.payloads.limits);
                let batch = self
                    .avro
                    .as_mut()
                    .expect("made at create for Avro values")
                    .decode(&payloads, &mut bad);
                self.key_column = keys.and_then(|k| k.column_for(&bad));
                self.payloads.bad = bad;
                batch
            }
        };
        let good: Vec<&Polled<'_>> = polled
            .iter()
            .zip(&self.payloads.bad)
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
                    self.payloads.all_bad(BadReason::SchemaMismatch, e);
                }
            }
        }
        row_times.resize(good.len(), None);
        let mut row = row_times.into_iter();
        for bad in self.payloads.bad.drain(..) {
            outcomes.push(match bad {
                Some(reason) => Err(reason),
                None => Ok(row.next().flatten()),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn values_inside_structs_lists_and_maps_must_fit_exactly_too() {
        let item = DataType::Struct(vec![Field::new("qty", DataType::Int32, false)].into());
        let entries = DataType::Struct(
            vec![
                Field::new("key", DataType::Utf8, false),
                Field::new("value", DataType::Int64, true),
            ]
            .into(),
        );
        let format = JsonArrow::new(Arc::new(Schema::new(vec![
            Field::new(
                "items",
                DataType::List(Arc::new(Field::new("element", item, true))),
                true,
            ),
            Field::new(
                "tags",
                DataType::Map(Arc::new(Field::new("key_value", entries, false)), false),
                true,
            ),
        ])));
        let mut d = JsonArrowDecoder::new(&format, 1 << 20, 64);
        let (batch, bad) = d.decode(&[
            br#"{"items": [{"qty": 1}, {"qty": 2.0}], "tags": {"a": 1}}"#,
            br#"{"items": [{"qty": 1.5}]}"#,
            br#"{"tags": {"a": 1, "b": "12"}}"#,
        ]);
        assert_eq!(batch.unwrap().num_rows(), 1);
        assert!(bad[0].is_none(), "{bad:?}");
        let (reason, detail) = bad[1].clone().unwrap();
        assert_eq!(reason, BadReason::LossyConversion);
        assert!(detail.contains("\"items[].qty\""), "{detail}");
        let (reason, detail) = bad[2].clone().unwrap();
        assert_eq!(reason, BadReason::LossyConversion);
        assert!(detail.contains("\"tags.b\""), "{detail}");
    }

    /// A Nexmark bid's schema.
    fn bids() -> JsonArrow {
        JsonArrow::new(Arc::new(Schema::new(vec![
            Field::new("auction", DataType::Int64, false),
            Field::new("bidder", DataType::Int64, false),
            Field::new("price", DataType::Int64, true),
            Field::new("channel", DataType::Utf8, true),
            Field::new("url", DataType::Utf8, true),
            Field::new("date_time", DataType::Int64, false),
            Field::new("extra", DataType::Utf8, true),
        ])))
    }

    fn bid(price: &str) -> String {
        format!(
            r#"{{"auction":1000,"bidder":2001,"price":{price},"channel":"Google","url":"https://www.nexmark.com/x","date_time":1700000000000,"extra":"abc"}}"#
        )
    }

    fn decoder(format: &JsonArrow) -> JsonArrowDecoder {
        JsonArrowDecoder::new(
            format,
            KafkaSourceConfig::DEFAULT_MAX_RECORD_BYTES,
            KafkaSourceConfig::DEFAULT_MAX_NESTING_DEPTH,
        )
    }

    fn prices(batch: &RecordBatch) -> Vec<Option<i64>> {
        let c = batch.column_by_name("price").expect("a price column");
        c.as_primitive::<Int64Type>().iter().collect()
    }

    fn reasons(bad: &[Option<(BadReason, String)>]) -> Vec<Option<BadReason>> {
        bad.iter().map(|b| b.as_ref().map(|(r, _)| *r)).collect()
    }

    /// Before the pre-scan, this aborted the process ("thread has
    /// overflowed its stack"): arrow-json formats the error for a list where
    /// an integer belongs by recursing over the whole list.
    #[test]
    fn deep_nesting_is_a_bad_record_not_a_crash() {
        let mut d = decoder(&bids());
        let depth = 100_000;
        let nested = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        let objects = format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
        let good = bid("7");
        let payloads: Vec<&[u8]> = vec![
            good.as_bytes(),
            nested.as_bytes(),
            objects.as_bytes(),
            &nested.as_bytes()[..depth],
        ];
        let in_price = bid(&nested);
        let mut payloads = payloads;
        payloads.push(in_price.as_bytes());
        payloads.push(good.as_bytes());
        let (batch, bad) = d.decode(&payloads);
        assert_eq!(
            reasons(&bad),
            [
                None,
                Some(BadReason::TooDeep),
                Some(BadReason::TooDeep),
                Some(BadReason::TooDeep),
                Some(BadReason::TooDeep),
                None
            ]
        );
        assert_eq!(prices(&batch.expect("two good bids")), [Some(7), Some(7)]);
    }

    /// The deepest value the limits allow reaches arrow-json's recursive
    /// error formatting; it is a bad record, and the stack holds.
    #[test]
    fn the_deepest_allowed_value_is_decoded_or_bad() {
        let depth = KafkaSourceConfig::MAX_NESTING_DEPTH;
        let mut d = JsonArrowDecoder::new(&bids(), 1 << 20, depth);
        let inner = format!("{}{}", "[".repeat(depth - 1), "]".repeat(depth - 1));
        let payload = bid(&inner);
        let (batch, bad) = d.decode(&[payload.as_bytes()]);
        assert!(batch.is_none());
        assert_eq!(reasons(&bad), [Some(BadReason::SchemaMismatch)]);
        let too_deep = bid(&format!("[{inner}]"));
        let (_, bad) = d.decode(&[too_deep.as_bytes()]);
        assert_eq!(reasons(&bad), [Some(BadReason::TooDeep)]);
    }

    #[test]
    fn lossy_conversions_are_bad_records_and_the_rest_decode() {
        let mut d = decoder(&bids());
        let cases = [
            ("5", None),
            ("1.5", Some(BadReason::LossyConversion)),
            ("\"12\"", Some(BadReason::LossyConversion)),
            ("6.0", None),
            ("1e999999", Some(BadReason::LossyConversion)),
            ("-9223372036854775809", Some(BadReason::LossyConversion)),
            (&"9".repeat(400), Some(BadReason::LossyConversion)),
            ("\"abc\"", Some(BadReason::SchemaMismatch)),
            ("{\"x\":1}", Some(BadReason::SchemaMismatch)),
            ("7e1", None),
        ];
        let payloads: Vec<String> = cases.iter().map(|(p, _)| bid(p)).collect();
        let refs: Vec<&[u8]> = payloads.iter().map(String::as_bytes).collect();
        let (batch, bad) = d.decode(&refs);
        let expected: Vec<Option<BadReason>> = cases.iter().map(|(_, r)| *r).collect();
        assert_eq!(reasons(&bad), expected, "{bad:?}");
        assert_eq!(
            prices(&batch.expect("good bids")),
            [Some(5), Some(6), Some(70)]
        );
    }

    #[test]
    fn coercions_let_arrow_convert() {
        let format = bids()
            .coerce(Coercion::FractionToInteger)
            .coerce(Coercion::StringToNumber);
        let mut d = decoder(&format);
        let payloads = [bid("1.5"), bid("\"12\""), bid("1e999999")];
        let refs: Vec<&[u8]> = payloads.iter().map(String::as_bytes).collect();
        let (batch, bad) = d.decode(&refs);
        assert_eq!(
            reasons(&bad),
            [None, None, Some(BadReason::LossyConversion)]
        );
        assert_eq!(prices(&batch.expect("good bids")), [Some(1), Some(12)]);
        for c in Coercion::ALL {
            assert_eq!(Coercion::from_name(c.name()), Some(c));
        }
    }

    #[test]
    fn narrow_unsigned_float_and_date_columns_fit_exactly_or_are_bad() {
        let format = JsonArrow::new(Arc::new(Schema::new(vec![
            Field::new("i8", DataType::Int8, true),
            Field::new("u64", DataType::UInt64, true),
            Field::new("f32", DataType::Float32, true),
            Field::new("d", DataType::Date32, true),
        ])));
        let mut d = decoder(&format);
        let payloads = [
            r#"{"i8":-128,"u64":18446744073709551615,"f32":1.5,"d":"2024-02-29"}"#,
            r#"{"i8":128}"#,
            r#"{"i8":-129}"#,
            r#"{"u64":-1}"#,
            r#"{"u64":18446744073709551616}"#,
            r#"{"f32":1e39}"#,
            r#"{"f32":"1.5"}"#,
            r#"{"d":19782.5}"#,
            r#"{"d":19782}"#,
            r#"{"d":"2024-02-29T23:00:00-05:00"}"#,
            r#"{"i8":1e2,"f32":-0.0}"#,
        ];
        let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_bytes()).collect();
        let (batch, bad) = d.decode(&refs);
        let lossy = Some(BadReason::LossyConversion);
        assert_eq!(
            reasons(&bad),
            [
                None, lossy, lossy, lossy, lossy, lossy, lossy, lossy, None, lossy, None
            ]
        );
        let batch = batch.expect("good rows");
        let i8s: Vec<Option<i8>> = batch
            .column(0)
            .as_primitive::<arrow_array::types::Int8Type>()
            .iter()
            .collect();
        assert_eq!(i8s, [Some(-128), None, Some(100)]);
        let u64s = batch
            .column(1)
            .as_primitive::<arrow_array::types::UInt64Type>();
        assert_eq!(u64s.value(0), u64::MAX);
        let days = batch
            .column(3)
            .as_primitive::<arrow_array::types::Date32Type>();
        assert_eq!((days.value(0), days.value(1)), (19782, 19782));
    }

    #[test]
    fn timestamps_in_an_unknown_format_or_too_precise_are_bad() {
        let format = JsonArrow::new(Arc::new(Schema::new(vec![Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Microsecond, None),
            true,
        )])));
        let mut d = decoder(&format);
        let payloads = [
            r#"{"ts":"2024-01-01T10:00:00.123456Z"}"#,
            r#"{"ts":"next tuesday"}"#,
            r#"{"ts":"2024-01-01T10:00:00.1234567Z"}"#,
            r#"{"ts":1.5}"#,
            r#"{"ts":1704103200123456}"#,
        ];
        let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_bytes()).collect();
        let (batch, bad) = d.decode(&refs);
        assert_eq!(
            reasons(&bad),
            [
                None,
                Some(BadReason::SchemaMismatch),
                Some(BadReason::LossyConversion),
                Some(BadReason::LossyConversion),
                None
            ]
        );
        assert_eq!(batch.expect("good rows").num_rows(), 2);
    }

    #[test]
    fn an_oversized_record_is_bad_and_its_detail_is_short() {
        let mut d = JsonArrowDecoder::new(&bids(), 1000, 64);
        let big = bid(&format!("\"{}\"", "x".repeat(2000)));
        let (_, bad) = d.decode(&[big.as_bytes()]);
        assert_eq!(reasons(&bad), [Some(BadReason::TooLarge)]);
        // arrow-json quotes the value in its error; the detail is cut.
        let mut d = decoder(&bids());
        let huge = format!("{{\"price\":[\"{}\"]}}", "y".repeat(100_000));
        let (_, bad) = d.decode(&[huge.as_bytes()]);
        let (reason, detail) = bad[0].clone().expect("bad");
        assert_eq!(reason, BadReason::SchemaMismatch);
        assert!(
            detail.len() <= BadRecord::MAX_DETAIL + 3,
            "{}",
            detail.len()
        );
    }

    /// A price literal and what it must decode to: `Some(value)`, or `None`
    /// for a lossy conversion.
    fn price_literal() -> impl Strategy<Value = (String, Option<i64>)> {
        prop_oneof![
            any::<i64>().prop_map(|v| (v.to_string(), Some(v))),
            (-1_000_000i64..1_000_000, 1usize..4)
                .prop_map(|(v, z)| (format!("{v}.{}", "0".repeat(z)), Some(v))),
            (-1_000_000i64..1_000_000, 1u32..10, 0usize..3)
                .prop_map(|(v, f, z)| (format!("{v}.{}{f}", "0".repeat(z)), None)),
            (1i64..1000, 0u32..6).prop_map(|(v, e)| (format!("{v}e{e}"), Some(v * 10i64.pow(e)))),
            (any::<i64>(), 1i128..1000).prop_map(|(v, d)| {
                let big = if v < 0 {
                    i128::from(i64::MIN) - d
                } else {
                    i128::from(i64::MAX) + d
                };
                (big.to_string(), None)
            }),
            any::<i64>().prop_map(|v| (format!("\"{v}\""), None)),
            (1usize..500).prop_map(|n| ("9".repeat(n + 19), None)),
            (1u32..1_000_000).prop_map(|e| (
                format!("1e{e}"),
                if e < 19 { Some(10i64.pow(e)) } else { None }
            )),
        ]
    }

    /// The proptest's max_record_bytes: above the largest nesting generated.
    const LIMIT: usize = 1 << 20;

    /// How a bid's JSON is laid out: field order, whitespace, whether the
    /// price's key is escaped, and a nested decoy holding a lossy `price`.
    #[derive(Debug, Clone)]
    struct BidLayout {
        order: Vec<usize>,
        spaces: Vec<&'static str>,
        escaped_key: bool,
        decoy: bool,
    }

    impl BidLayout {
        fn payload(&self, price: &str) -> String {
            let price_key = if self.escaped_key {
                r#""pr\u0069ce""#
            } else {
                r#""price""#
            };
            let mut fields: Vec<String> = vec![
                r#""auction":1000"#.to_owned(),
                r#""bidder":2001"#.to_owned(),
                format!("{price_key}{}:{}{price}", self.spaces[0], self.spaces[1]),
                r#""channel":"price\":1.5""#.to_owned(),
                r#""url":"https://www.nexmark.com/x""#.to_owned(),
                r#""date_time":1700000000000"#.to_owned(),
                r#""extra":"abc""#.to_owned(),
            ];
            if self.decoy {
                fields.push(r#""nested":{"price":1.5,"list":[{"price":"12"}]}"#.to_owned());
            }
            let ordered: Vec<&str> = self
                .order
                .iter()
                .filter_map(|i| fields.get(*i).map(String::as_str))
                .collect();
            let sep = format!("{},{}", self.spaces[2], self.spaces[3]);
            format!(
                "{}{{{}{}}}",
                self.spaces[4],
                ordered.join(&sep),
                self.spaces[5]
            )
        }
    }

    fn bid_layout() -> impl Strategy<Value = BidLayout> {
        let space = prop::sample::select(vec!["", " ", "\n\t ", "\r\n"]);
        (
            Just((0..8).collect::<Vec<usize>>()).prop_shuffle(),
            prop::collection::vec(space, 6),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(order, spaces, escaped_key, decoy)| BidLayout {
                order,
                spaces,
                escaped_key,
                decoy,
            })
    }

    /// Payloads meant to break a decoder.
    fn adversarial() -> impl Strategy<Value = Vec<u8>> {
        // Deep enough to overflow a stack if anything recursed over it:
        // 100000 levels aborted the process before the pre-scan.
        let depth = prop_oneof![1usize..200, 200usize..5_000, 5_000usize..100_000];
        let nesting = (depth, 0u8..4, any::<bool>()).prop_map(|(depth, how, closed)| {
            let (open, close) = match how {
                0 => ("[", "]"),
                1 => (r#"{"a":"#, "}"),
                2 => (r#"{"price":["#, "]}"),
                _ => ("[{\"a\":", "}]"),
            };
            let mut s = open.repeat(depth);
            s.push('1');
            if closed {
                s.push_str(&close.repeat(depth));
            }
            s.into_bytes()
        });
        let huge_string = prop_oneof![0usize..20_000, (LIMIT - 200)..(LIMIT + 200)]
            .prop_map(|n| bid(&format!("\"{}\"", "x".repeat(n))).into_bytes());
        let huge_number = ("-?[0-9]{1,450}(\\.[0-9]{0,40})?([eE][+-]?[0-9]{1,7})?")
            .prop_map(|n| bid(&n).into_bytes());
        let invalid_utf8 = (0usize..200, 0x80u8..=0xff).prop_map(|(at, b)| {
            let mut s = bid("\"ü€x\"").into_bytes();
            let at = at % s.len();
            s[at] = b;
            s
        });
        let mutated = (prop::collection::vec((0usize..200, any::<u8>()), 1..4)).prop_map(|edits| {
            let mut s = bid("42").into_bytes();
            for (at, b) in edits {
                let at = at % s.len();
                s[at] = b;
            }
            s
        });
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..300),
            nesting,
            huge_string,
            huge_number,
            invalid_utf8,
            mutated,
        ]
    }

    proptest! {
        /// Whatever the bytes, the decoder returns: each payload is decoded
        /// or bad, alone as in a batch, and good bids around bad payloads
        /// decode.
        #[test]
        fn no_payload_crashes_the_decoder(payloads in prop::collection::vec(adversarial(), 1..4)) {
            let mut d = JsonArrowDecoder::new(&bids(), LIMIT, 64);
            let good = bid("42");
            let mut all: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
            all.push(good.as_bytes());
            let (batch, bad) = d.decode(&all);
            prop_assert_eq!(bad.len(), all.len());
            prop_assert!(bad[all.len() - 1].is_none(), "{:?}", bad);
            let good_rows = bad.iter().filter(|b| b.is_none()).count();
            prop_assert_eq!(batch.map_or(0, |b| b.num_rows()), good_rows);
            for (payload, verdict) in all.iter().zip(&bad) {
                let (one, alone) = d.decode(&[payload]);
                prop_assert_eq!(one.is_some(), alone[0].is_none());
                prop_assert_eq!(alone[0].as_ref().map(|b| b.0), verdict.as_ref().map(|b| b.0));
                if payload.len() > LIMIT {
                    prop_assert_eq!(verdict.as_ref().map(|b| b.0), Some(BadReason::TooLarge));
                }
            }
        }

        /// A price is decoded to exactly its value, or the record is bad
        /// with reason lossy_conversion.
        #[test]
        fn prices_decode_exactly_or_are_lossy(
            (literal, expected) in price_literal(),
            layout in bid_layout(),
        ) {
            let mut d = decoder(&bids());
            let payload = layout.payload(&literal);
            let (batch, bad) = d.decode(&[payload.as_bytes()]);
            match expected {
                Some(v) => {
                    prop_assert!(bad[0].is_none(), "{payload}: {:?}", bad[0]);
                    prop_assert_eq!(prices(&batch.expect("decoded")), [Some(v)]);
                }
                None => prop_assert_eq!(
                    bad[0].as_ref().map(|b| b.0),
                    Some(BadReason::LossyConversion),
                    "{}", payload
                ),
            }
        }
    }
}
