//! From a parsed job file to a job graph, a runtime configuration and a
//! checkpoint store: every check that needs more than TOML syntax.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};

use tinyflow_api::{JobBuilder, JobGraph, JobId, OperatorContext, StreamError, Worker};
use tinyflow_checkpoint::{CheckpointConfig, CheckpointStore, LocalDirStore};
use tinyflow_connectors_iceberg::{
    BadRecords, CatalogConfig, Column, ColumnType, CommitCadence, Compression, Distribution,
    IcebergSink, IcebergSinkConfig, Layout, PartitionField, TableSpec, is_s3_location,
    table_layout, worker_start,
};
#[cfg(feature = "chaos")]
use tinyflow_connectors_iceberg::{CommitStep, Fault, FaultHook};
use tinyflow_connectors_kafka::{
    BadRecordPolicy, BytesAs, Coercion, EventTime, Evolution, JsonArrow, KafkaArrowSource,
    KafkaSourceConfig, SchemaEvolution, StartPosition, offsets_of_positions,
};
use tinyflow_runtime::{JobReport, JobRunner, RestartStrategy, RuntimeConfig, StopHandle};

use crate::checkpoint_storage::is_object_location;
use crate::jobfile::{BytesColumn, CatalogSection, JobFile, RestartSection, SourceSection};
use crate::transform::{TRANSFORMS_NODE, TransformOperator, Transforms};
use crate::{Endpoint, JobFileError, parse_duration};

/// The source's node name, which keys its positions.
const SOURCE_NODE: &str = "kafka";

/// Where a worker of a job spread over processes stands: which worker, in
/// which layout of the table, committing with which sink id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// This worker.
    pub worker: Worker,
    /// The table's layout it belongs to.
    pub layout: Layout,
    /// The job's base sink id (`sink.sink_id`, or the job's name).
    pub base_sink: String,
    /// This worker's sink id ([`Layout::sink_id`]).
    pub sink_id: String,
}

/// Checkpoints on object storage: the location (a worker's own prefix
/// under `checkpoint.dir`) and the storage's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectCheckpoints {
    /// `s3://bucket/prefix[/<worker sink id>]`.
    pub location: String,
    /// `checkpoint.storage`, else the catalog's `properties`.
    pub properties: HashMap<String, String>,
}

/// Where a plan's checkpoints are kept (`checkpoint.dir`; a worker's under
/// its own sink id in it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checkpoints {
    /// A local directory.
    Dir(PathBuf),
    /// Object storage (`s3://bucket/prefix`).
    Object(ObjectCheckpoints),
}

impl std::fmt::Display for Checkpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Checkpoints::Dir(d) => write!(f, "{}", d.display()),
            Checkpoints::Object(o) => f.write_str(&o.location),
        }
    }
}

/// A checked job file, ready to run.
#[derive(Debug)]
pub struct JobPlan {
    /// The job's id.
    pub job_id: JobId,
    /// The source's output schema (with metadata columns).
    pub source_schema: SchemaRef,
    /// What the sink receives.
    pub output_schema: SchemaRef,
    /// How it runs.
    pub runtime: RuntimeConfig,
    /// Where checkpoints go.
    pub checkpoints: Checkpoints,
    /// Checkpoints kept.
    pub retained: usize,
    /// The Prometheus endpoint, if any.
    pub metrics_address: Option<SocketAddr>,
    /// How long the endpoint stays up after the job ended by itself.
    pub metrics_linger: Duration,
    /// How long an attempt runs before the restart budget starts afresh.
    pub restart_reset_after: Duration,
    /// The sink's configuration (catalog, table).
    pub sink: IcebergSinkConfig,
    /// The sink in the graph (one claim of the table per run).
    pub(crate) iceberg: IcebergSink,
    /// The worker it runs as (`None`: the job in one process).
    pub placement: Option<Placement>,
    graph: JobGraph,
    /// What it was planned from, to plan it again with another start.
    file: JobFile,
}

fn err(key: &str, message: impl Into<String>) -> JobFileError {
    JobFileError::new(key, message)
}

fn duration(key: &str, value: &str) -> Result<Duration, JobFileError> {
    parse_duration(value).map_err(|m| err(key, m))
}

fn arrow_type(key: &str, ty: &str, avro: bool) -> Result<DataType, JobFileError> {
    let parsed: ColumnType = ty.parse().map_err(|m: String| err(key, m))?;
    arrow_of(&parsed, avro).map_err(|m| err(key, m))
}

/// The Arrow type a JSON (or, `avro`, an Avro) field of type `ty` decodes
/// into: struct fields, list elements and map values nullable unless
/// declared `not null`; list elements and map entries named as Iceberg
/// names them. Binary and decimal columns only take Avro values.
pub(crate) fn arrow_of(ty: &ColumnType, avro: bool) -> Result<DataType, String> {
    let field = |name: &str, ty: &ColumnType, required: bool| -> Result<Field, String> {
        Ok(Field::new(name, arrow_of(ty, avro)?, !required))
    };
    Ok(match ty {
        ColumnType::Boolean => DataType::Boolean,
        ColumnType::Int => DataType::Int32,
        ColumnType::Long => DataType::Int64,
        ColumnType::Float => DataType::Float32,
        ColumnType::Double => DataType::Float64,
        ColumnType::String => DataType::Utf8,
        ColumnType::Date => DataType::Date32,
        ColumnType::Timestamp => DataType::Timestamp(TimeUnit::Microsecond, None),
        ColumnType::Timestamptz => {
            DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into()))
        }
        ColumnType::Binary if avro => DataType::Binary,
        ColumnType::Decimal { precision, scale } if avro => {
            match (u8::try_from(*precision), i8::try_from(*scale)) {
                (Ok(p @ 1..=38), Ok(s)) if s as u8 <= p => DataType::Decimal128(p, s),
                _ => {
                    return Err(format!(
                        "{ty:?}: expected a precision of 1 to 38 and a scale of at most the precision"
                    ));
                }
            }
        }
        ColumnType::Binary | ColumnType::Decimal { .. } => {
            return Err(format!(
                "{ty:?} is not a type JSON fields take; expected one of boolean, int, long, \
                 float, double, string, date, timestamp, timestamptz, or struct<name: type, ...>, \
                 list<type>, map<string, type> of them"
            ));
        }
        ColumnType::Struct(columns) => DataType::Struct(
            columns
                .iter()
                .map(|c| field(&c.name, &c.ty, c.required))
                .collect::<Result<Vec<_>, _>>()?
                .into(),
        ),
        ColumnType::List {
            element,
            element_required,
        } => DataType::List(Arc::new(field("element", element, *element_required)?)),
        ColumnType::Map {
            key,
            value,
            value_required,
        } => {
            if **key != ColumnType::String {
                return Err("a map's keys are strings: map<string, type>".to_owned());
            }
            let entries = DataType::Struct(
                vec![
                    field("key", key, true)?,
                    field("value", value, *value_required)?,
                ]
                .into(),
            );
            DataType::Map(Arc::new(Field::new("key_value", entries, false)), false)
        }
    })
}

/// The Iceberg column type of an Arrow type the transforms can output.
pub(crate) fn column_type(field: &Field) -> Result<ColumnType, String> {
    Ok(match field.data_type() {
        DataType::Boolean => ColumnType::Boolean,
        DataType::Int8 | DataType::Int16 | DataType::Int32 => ColumnType::Int,
        DataType::Int64 => ColumnType::Long,
        DataType::Float32 => ColumnType::Float,
        DataType::Float64 => ColumnType::Double,
        DataType::Utf8 | DataType::LargeUtf8 => ColumnType::String,
        DataType::Binary | DataType::LargeBinary => ColumnType::Binary,
        // Avro's enums and UUIDs (as text), fixed and decimals.
        DataType::Dictionary(_, v) if **v == DataType::Utf8 => ColumnType::String,
        DataType::FixedSizeBinary(16)
            if field.extension_type_name() == Some("arrow.uuid")
                || field.metadata().get("logicalType").map(String::as_str) == Some("uuid") =>
        {
            ColumnType::String
        }
        DataType::FixedSizeBinary(_) => ColumnType::Binary,
        DataType::Decimal128(p, s) if *s >= 0 => ColumnType::Decimal {
            precision: u32::from(*p),
            scale: *s as u32,
        },
        DataType::Date32 => ColumnType::Date,
        DataType::Timestamp(TimeUnit::Nanosecond, _) => {
            return Err(format!(
                "column `{}` holds nanoseconds, which no Iceberg v2 timestamp takes",
                field.name()
            ));
        }
        DataType::Timestamp(_, None) => ColumnType::Timestamp,
        DataType::Timestamp(_, Some(_)) => ColumnType::Timestamptz,
        DataType::Struct(fields) => ColumnType::Struct(
            fields
                .iter()
                .map(|f| {
                    Ok(Column {
                        name: f.name().clone(),
                        ty: column_type(f)?,
                        required: !f.is_nullable(),
                    })
                })
                .collect::<Result<_, String>>()?,
        ),
        DataType::List(element) | DataType::LargeList(element) => ColumnType::List {
            element: Box::new(column_type(element)?),
            element_required: !element.is_nullable(),
        },
        DataType::Map(entries, _) => match entries.data_type() {
            DataType::Struct(kv) if kv.len() == 2 => ColumnType::Map {
                key: Box::new(column_type(&kv[0])?),
                value: Box::new(column_type(&kv[1])?),
                value_required: !kv[1].is_nullable(),
            },
            other => return Err(format!("map entries of {other}")),
        },
        other => {
            return Err(format!(
                "column `{}` is {other}, which has no Iceberg type here",
                field.name()
            ));
        }
    })
}

/// The value's format: `json` (the declared fields) or `raw` (one column).
fn value_format(s: &SourceSection) -> Result<JsonArrow, JobFileError> {
    let (avro, protobuf) = match s.format.as_deref().map(str::trim) {
        None | Some("json") => (false, false),
        Some("avro") => (true, false),
        Some("protobuf") => (false, true),
        Some("raw") => {
            let what = "with format = \"raw\" the value is one column (source.value)";
            if !s.fields.is_empty() {
                return Err(err("source.fields", format!("not taken: {what}")));
            }
            if s.strict {
                return Err(err("source.strict", format!("not taken: {what}")));
            }
            if !s.coerce.is_empty() {
                return Err(err("source.coerce", format!("not taken: {what}")));
            }
            let value = s.value.clone().unwrap_or_default();
            let (column, ty) = bytes_column("source.value", &value, "value")?;
            return Ok(JsonArrow::raw(&column, ty));
        }
        Some(other) => {
            return Err(err(
                "source.format",
                format!("`{other}`: expected json, avro, protobuf or raw"),
            ));
        }
    };
    if s.value.is_some() {
        return Err(err(
            "source.value",
            "only with format = \"raw\"; a JSON, Avro or Protobuf value's columns are source.fields",
        ));
    }
    if avro {
        if !s.coerce.is_empty() {
            return Err(err(
                "source.coerce",
                "not taken with format = \"avro\": Avro values convert only without loss",
            ));
        }
        let registry = registry_config(s)?;
        let schema = if s.fields.is_empty() {
            let Some(fetched) = &s.registry_schema else {
                return Err(err(
                    "source.fields",
                    "absent, and the registry's schema was not fetched (JobFile::resolve_schema)",
                ));
            };
            table_schema(fetched).map_err(|m| err("source.registry", m))?
        } else {
            Arc::new(Schema::new(declared_fields(s, true)?))
        };
        let mut format = JsonArrow::avro(schema, registry);
        if s.strict {
            format = format.strict();
        }
        return Ok(format);
    }
    let registry = if protobuf {
        Some(registry_config(s)?)
    } else if s.registry.is_some() {
        return Err(err(
            "source.registry",
            "only with format = \"avro\" or \"protobuf\"",
        ));
    } else {
        None
    };
    if let (Some(registry), true) = (&registry, s.fields.is_empty()) {
        let Some(fetched) = &s.registry_schema else {
            return Err(err(
                "source.fields",
                "absent, and the registry's schema was not fetched (JobFile::resolve_schema)",
            ));
        };
        let schema = table_schema(fetched).map_err(|m| err("source.registry", m))?;
        let mut format = JsonArrow::protobuf(schema, registry.clone());
        if s.strict {
            format = format.strict();
        }
        return Ok(format);
    }
    if s.fields.is_empty() {
        return Err(err(
            "source.fields",
            "expected at least one [[source.fields]]",
        ));
    }
    let declared = Arc::new(Schema::new(declared_fields(s, protobuf)?));
    let mut format = match registry {
        Some(registry) => JsonArrow::protobuf(declared, registry),
        None => JsonArrow::new(declared),
    };
    if s.strict {
        format = format.strict();
    }
    for (i, name) in s.coerce.iter().enumerate() {
        let Some(c) = Coercion::from_name(name.trim()) else {
            return Err(err(
                &format!("source.coerce[{i}]"),
                format!(
                    "`{name}`: expected one of {}",
                    Coercion::ALL.map(Coercion::name).join(", ")
                ),
            ));
        };
        format = format.coerce(c);
    }
    Ok(format)
}

/// The `[[source.fields]]` as Arrow fields.
fn declared_fields(s: &SourceSection, avro: bool) -> Result<Vec<Field>, JobFileError> {
    let mut fields = Vec::with_capacity(s.fields.len());
    for (i, f) in s.fields.iter().enumerate() {
        if f.name.is_empty() {
            return Err(err(&format!("source.fields[{i}].name"), "expected a name"));
        }
        if fields.iter().any(|g: &Field| g.name() == &f.name) {
            return Err(err(
                &format!("source.fields[{i}].name"),
                format!("`{}` is declared twice", f.name),
            ));
        }
        let ty = arrow_type(&format!("source.fields[{i}].type"), &f.ty, avro)?;
        fields.push(Field::new(&f.name, ty, !f.required));
    }
    Ok(fields)
}

/// `[source.registry]` as the client's settings.
fn registry_config(
    s: &SourceSection,
) -> Result<tinyflow_connectors_kafka::registry::RegistryConfig, JobFileError> {
    let Some(r) = &s.registry else {
        return Err(err(
            "source.registry",
            "format = \"avro\" needs [source.registry] with its url",
        ));
    };
    let mut c = tinyflow_connectors_kafka::registry::RegistryConfig::new(r.url.trim());
    match (&r.username, &r.password) {
        (Some(u), Some(p)) => c = c.basic_auth(u, p),
        (None, None) => {}
        _ => {
            return Err(err(
                "source.registry",
                "username and password go together (HTTP basic authentication)",
            ));
        }
    }
    if let Some(ca) = &r.ca_location {
        c = c.ca_location(ca);
    }
    if let Some(t) = &r.timeout {
        c.timeout = duration("source.registry.timeout", t)?;
    }
    // The settings alone (URL, CA file), without a connection.
    tinyflow_connectors_kafka::registry::Registry::new(c.clone())
        .map_err(|e| err("source.registry", e.to_string()))?;
    Ok(c)
}

/// The subject whose latest schema makes the columns.
fn subject_of(s: &SourceSection) -> Result<String, JobFileError> {
    use tinyflow_connectors_kafka::registry::SubjectStrategy;
    let strategy = match s
        .registry
        .as_ref()
        .and_then(|r| r.subject.as_deref())
        .map(str::trim)
    {
        None | Some("topic") => SubjectStrategy::Topic,
        Some(other) => match other.split_once(':') {
            Some(("record", r)) if !r.trim().is_empty() => {
                SubjectStrategy::Record(r.trim().to_owned())
            }
            Some(("topic-record", r)) if !r.trim().is_empty() => {
                SubjectStrategy::TopicRecord(r.trim().to_owned())
            }
            _ => {
                return Err(err(
                    "source.registry.subject",
                    format!(
                        "`{other}`: expected topic, record:<full record name> or topic-record:<full record name>"
                    ),
                ));
            }
        },
    };
    let topic = s.topics.first().ok_or_else(|| {
        err(
            "source.topics",
            "expected at least one non-empty topic name",
        )
    })?;
    Ok(strategy.subject(topic))
}

/// The columns of a table for values of the registry's schema (decoded
/// by arrow-avro into `decoded`): enums and UUIDs as strings, fixed as
/// binary, timestamps in microseconds, lists and maps named as Iceberg
/// names them.
fn table_schema(decoded: &SchemaRef) -> Result<SchemaRef, String> {
    let mut fields = Vec::with_capacity(decoded.fields().len());
    for f in decoded.fields() {
        let ty = column_type(f)?;
        fields.push(Field::new(f.name(), arrow_of(&ty, true)?, f.is_nullable()));
    }
    Ok(Arc::new(Schema::new(fields)))
}

/// A `{ column, type }` at `key` (the column named `default` unless given).
fn bytes_column(
    key: &str,
    c: &BytesColumn,
    default: &str,
) -> Result<(String, BytesAs), JobFileError> {
    let column = c.column.clone().unwrap_or_else(|| default.to_owned());
    if column.is_empty() {
        return Err(err(&format!("{key}.column"), "expected a column name"));
    }
    Ok((column, bytes_type(&format!("{key}.type"), c.ty.as_deref())?))
}

fn bytes_type(key: &str, ty: Option<&str>) -> Result<BytesAs, JobFileError> {
    match ty.map(str::trim) {
        None => Ok(BytesAs::String),
        Some(t) => BytesAs::from_name(t)
            .ok_or_else(|| err(key, format!("`{t}`: expected string or binary"))),
    }
}

/// A header's name as a column name: each character other than a letter,
/// digit or `_` made `_` (`trace-id` -> `trace_id`).
fn column_name(header: &str) -> String {
    header
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn source_config(s: &SourceSection, job: &str) -> Result<KafkaSourceConfig, JobFileError> {
    if s.bootstrap_servers.trim().is_empty() {
        return Err(err(
            "source.bootstrap_servers",
            "expected host:port[,host:port]",
        ));
    }
    if s.topics.is_empty() || s.topics.iter().any(|t| t.trim().is_empty()) {
        return Err(err(
            "source.topics",
            "expected at least one non-empty topic name",
        ));
    }
    let topics: Vec<&str> = s.topics.iter().map(String::as_str).collect();
    let group = s.group_id.clone().unwrap_or_else(|| job.to_owned());
    let mut c = KafkaSourceConfig::new(s.bootstrap_servers.clone(), &topics, group);
    c.start = match s.start.as_deref().map(str::trim) {
        None | Some("earliest") => StartPosition::Earliest,
        Some("latest") => StartPosition::Latest,
        Some("committed") => StartPosition::Committed,
        Some(other) => match other
            .strip_prefix("timestamp:")
            .map(|t| t.trim().parse::<i64>())
        {
            Some(Ok(ms)) => StartPosition::Timestamp(ms),
            _ => {
                return Err(err(
                    "source.start",
                    format!(
                        "`{other}`: expected earliest, latest, committed or timestamp:<ms since the epoch>"
                    ),
                ));
            }
        },
    };
    c.bounded = s.bounded;
    c.bad_records = match s.bad_records.as_deref().map(str::trim) {
        None | Some("fail") => BadRecordPolicy::Fail,
        Some("skip") => BadRecordPolicy::Skip,
        Some(other) => match other.strip_prefix("dead-letter:").map(str::trim) {
            Some(topic) if !topic.is_empty() => BadRecordPolicy::DeadLetter {
                topic: topic.to_owned(),
            },
            _ => {
                return Err(err(
                    "source.bad_records",
                    format!("`{other}`: expected fail, skip or dead-letter:<topic>"),
                ));
            }
        },
    };
    if let Some(b) = s.batch_size {
        if b == 0 {
            return Err(err("source.batch_size", "expected at least 1"));
        }
        c.batch_size = b;
    }
    let or_off = |key: &str, value: &str| -> Result<Option<Duration>, JobFileError> {
        if value == "off" {
            Ok(None)
        } else {
            duration(key, value).map(Some)
        }
    };
    if let Some(d) = &s.partition_discovery {
        c.partition_discovery = or_off("source.partition_discovery", d)?;
    }
    if let Some(d) = &s.stall_warn {
        c.stall_warn = duration("source.stall_warn", d)?;
    }
    if let Some(d) = &s.stall_fail {
        c.stall_fail = or_off("source.stall_fail", d)?;
    }
    if c.stall_fail.is_some_and(|fail| fail <= c.stall_warn) {
        return Err(err(
            "source.stall_fail",
            format!(
                "must be longer than source.stall_warn ({:?}), or `off`",
                c.stall_warn
            ),
        ));
    }
    c.properties = s.properties.clone();
    if let Some(b) = s.max_record_bytes {
        c.max_record_bytes = b;
    }
    if let Some(d) = s.max_nesting_depth {
        c.max_nesting_depth = d;
    }
    Ok(c)
}

pub(crate) fn catalog(c: &CatalogSection) -> Result<CatalogConfig, JobFileError> {
    let name = c.name.clone().unwrap_or_else(|| "tinyflow".to_owned());
    let properties: HashMap<String, String> = c.properties.clone().into_iter().collect();
    let unused = |key: &str, given: bool, what: &str| {
        if given {
            Err(err(&format!("sink.catalog.{key}"), what.to_owned()))
        } else {
            Ok(())
        }
    };
    let no_dir = || unused("dir", c.dir.is_some(), "only a sqlite catalog has `dir`");
    match c.kind.as_str() {
        "sqlite" => {
            unused(
                "uri",
                c.uri.is_some(),
                "a sqlite catalog takes `dir` only (for a URI use type = \"sql\")",
            )?;
            unused(
                "warehouse",
                c.warehouse.is_some(),
                "a sqlite catalog keeps its warehouse in `dir` (for another use type = \"sql\")",
            )?;
            let dir = c
                .dir
                .as_deref()
                .ok_or_else(|| err("sink.catalog.dir", "a sqlite catalog needs `dir`"))?;
            let dir = absolute_path(dir);
            let CatalogConfig::Sql { uri, warehouse, .. } = CatalogConfig::sqlite(&dir) else {
                unreachable!("sqlite() is a SQL catalog")
            };
            Ok(CatalogConfig::Sql {
                name,
                uri,
                warehouse,
                properties,
            })
        }
        "sql" => {
            no_dir()?;
            let uri = c
                .uri
                .clone()
                .ok_or_else(|| err("sink.catalog.uri", "a sql catalog needs `uri`"))?;
            let warehouse = c
                .warehouse
                .clone()
                .ok_or_else(|| err("sink.catalog.warehouse", "a sql catalog needs `warehouse`"))?;
            if !(warehouse.starts_with("file://") || is_s3_location(&warehouse)) {
                return Err(err(
                    "sink.catalog.warehouse",
                    format!("`{warehouse}`: expected a file:///path or s3://bucket/path location"),
                ));
            }
            Ok(CatalogConfig::Sql {
                name,
                uri,
                warehouse,
                properties,
            })
        }
        "rest" => {
            no_dir()?;
            let uri = c
                .uri
                .clone()
                .ok_or_else(|| err("sink.catalog.uri", "a rest catalog needs `uri`"))?;
            if !(uri.starts_with("http://") || uri.starts_with("https://")) {
                return Err(err(
                    "sink.catalog.uri",
                    format!("`{uri}`: a rest catalog's uri starts with http:// or https://"),
                ));
            }
            Ok(CatalogConfig::Rest {
                name,
                uri,
                warehouse: c.warehouse.clone(),
                properties,
            })
        }
        other => Err(err(
            "sink.catalog.type",
            format!("`{other}`: expected sqlite, sql or rest"),
        )),
    }
}

/// `dir` made absolute against the working directory (file URIs need it).
pub fn absolute_path(dir: &str) -> PathBuf {
    let p = PathBuf::from(dir);
    if p.is_absolute() {
        p
    } else {
        std::env::current_dir().map_or(p.clone(), |cwd| cwd.join(p))
    }
}

/// Restarts in a row by default. With the defaults, a job whose broker
/// cannot be reached at all fails within two minutes: six attempts of at
/// most `source.request_timeout` (10 s) each, and 15.5 s of pauses.
const DEFAULT_RESTARTS: u32 = 5;

fn restart(r: &RestartSection) -> Result<RestartStrategy, JobFileError> {
    let max_attempts = r.max_attempts.unwrap_or(DEFAULT_RESTARTS);
    Ok(match r.strategy.as_deref().unwrap_or("exponential") {
        "none" => RestartStrategy::None,
        "fixed" => RestartStrategy::FixedDelay {
            delay: duration("restart.delay", r.delay.as_deref().unwrap_or("1s"))?,
            max_attempts,
        },
        "exponential" => {
            let multiplier = r.multiplier.unwrap_or(2.0);
            if !(multiplier >= 1.0 && multiplier.is_finite()) {
                return Err(err("restart.multiplier", "expected a number of at least 1"));
            }
            RestartStrategy::ExponentialBackoff {
                initial: duration("restart.initial", r.initial.as_deref().unwrap_or("500ms"))?,
                max: duration("restart.max", r.max.as_deref().unwrap_or("30s"))?,
                multiplier,
                max_attempts,
            }
        }
        other => {
            return Err(err(
                "restart.strategy",
                format!("`{other}`: expected exponential, fixed or none"),
            ));
        }
    })
}

impl JobFile {
    /// `sink.schema_evolution`: `None` for `ignore` (the default), checked
    /// against the source's format and the transforms.
    fn schema_evolution(&self) -> Result<Option<SchemaEvolution>, JobFileError> {
        let key = "sink.schema_evolution";
        let mode = match self.sink.schema_evolution.as_deref().map(str::trim) {
            None | Some("ignore" | "off") => return Ok(None),
            Some("add-columns") => SchemaEvolution::AddColumns,
            Some("fail") => SchemaEvolution::Fail,
            Some(other) => {
                return Err(err(
                    key,
                    format!("`{other}`: expected ignore, add-columns or fail"),
                ));
            }
        };
        if self.source.format.as_deref().map(str::trim) != Some("avro") {
            return Err(err(
                key,
                "only with source.format = \"avro\" (a writer schema says which fields the records have)",
            ));
        }
        if let Some(i) = self.transforms.iter().position(|t| t.filter.is_none()) {
            return Err(err(
                &format!("transforms[{i}]"),
                "with sink.schema_evolution only filters are taken: select, rename and compute fix the columns the table gets",
            ));
        }
        Ok(Some(mode))
    }

    /// With `format = "avro"` and no `[[source.fields]]`, fetches the latest
    /// schema of the source's subject from the registry, whose fields
    /// become the columns ([`plan`](Self::plan) needs it then); otherwise
    /// nothing. A registry that does not answer is an error that may pass
    /// (exit 1); a subject it does not have, refused credentials or a
    /// schema without Iceberg types are the job file's (exit 2).
    pub async fn resolve_schema(mut self) -> anyhow::Result<JobFile> {
        let s = &self.source;
        let avro_key = s
            .key
            .as_ref()
            .is_some_and(|k| k.ty.as_deref().map(str::trim) == Some("avro"));
        if avro_key && s.format.as_deref().map(str::trim) == Some("avro") {
            let registry = tinyflow_connectors_kafka::registry::Registry::new(registry_config(s)?)
                .map_err(|e| err("source.registry", e.to_string()))?;
            let topic = s.topics.first().cloned().unwrap_or_default();
            let subject = format!("{topic}-key");
            let latest = match registry.latest(&subject).await {
                Ok(l) => l,
                Err(e) if e.is_transient() => return Err(anyhow::Error::new(e)),
                Err(e) => {
                    return Err(err(
                        "source.key",
                        format!("an Avro key's columns come from the latest schema of subject {subject:?}: {e}"),
                    )
                    .into());
                }
            };
            let decoded =
                tinyflow_connectors_kafka::avro_arrow_schema(&latest.schema).map_err(|m| {
                    err(
                        "source.key",
                        format!("subject {subject:?}, schema id {}: {m}", latest.id),
                    )
                })?;
            self.source.registry_key_schema = Some(decoded);
        }
        let s = &self.source;
        let format = s.format.as_deref().map(str::trim);
        if !matches!(format, Some("avro" | "protobuf")) || !s.fields.is_empty() {
            return Ok(self);
        }
        let kind = if format == Some("avro") {
            "AVRO"
        } else {
            "PROTOBUF"
        };
        let registry = tinyflow_connectors_kafka::registry::Registry::new(registry_config(s)?)
            .map_err(|e| err("source.registry", e.to_string()))?;
        let subject = subject_of(s)?;
        let latest = match registry.latest(&subject).await {
            Ok(l) => l,
            Err(e) if e.is_transient() => return Err(anyhow::Error::new(e)),
            Err(e) => {
                return Err(err(
                    "source.registry",
                    format!("the columns come from the latest schema of subject {subject:?} (no [[source.fields]]): {e}"),
                )
                .into());
            }
        };
        if latest.schema_type != kind {
            return Err(err(
                "source.registry",
                format!(
                    "the latest schema of subject {subject:?} (id {}) is {}, not {kind}",
                    latest.id, latest.schema_type
                ),
            )
            .into());
        }
        let message = s.registry.as_ref().and_then(|r| r.message.as_deref());
        let decoded = if kind == "AVRO" {
            tinyflow_connectors_kafka::avro_arrow_schema(&latest.schema)
        } else {
            tinyflow_connectors_kafka::protobuf_arrow_schema(&latest.schema, message)
        }
        .map_err(|m| {
            err(
                "source.registry",
                format!("subject {subject:?}, schema id {}: {m}", latest.id),
            )
        })?;
        tracing::info!(subject = %subject, schema_id = latest.id, registry = %registry.url(), "the columns are the fields of the subject's latest schema");
        self.source.registry_schema = Some(decoded);
        Ok(self)
    }

    /// Checks everything that does not need a connection and builds the job
    /// graph: the schema, event time, transforms against the schema, the
    /// table spec, durations, the metrics address.
    pub fn plan(&self) -> Result<JobPlan, JobFileError> {
        self.plan_starting(None, None)
    }

    /// [`JobFile::plan`], with the source starting at `start` instead of
    /// `source.start` when it has no checkpoint to restore, and the sink
    /// `reuse` (a run's sink, with its claim of the table) instead of a new one.
    fn plan_starting(
        &self,
        start: Option<StartPosition>,
        reuse: Option<&IcebergSink>,
    ) -> Result<JobPlan, JobFileError> {
        let job_id =
            JobId::new(self.job.name.clone()).map_err(|e| err("job.name", e.to_string()))?;
        // Secrets written into the file itself are kept out of all output
        // too (those from `${...}` were registered when it was read).
        tinyflow_api::secrets::register_settings(
            self.source
                .properties
                .iter()
                .chain(&self.sink.catalog.properties)
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .chain(self.sink.catalog.uri.as_deref().map(|u| ("uri", u))),
        );
        if self.job.parallelism == 0 {
            return Err(err("job.parallelism", "expected at least 1"));
        }
        let (source, evolution) = self.plan_source(start)?;
        let source_schema = source.output_schema();
        let transforms = Transforms::plan(&self.transforms, Arc::clone(&source_schema))?;
        let output_schema = transforms.output();
        let sc = self.plan_sink(&output_schema, evolution.is_some())?;
        let (runtime, retained) = self.plan_runtime()?;
        let (metrics_address, metrics_linger) = self.plan_metrics()?;
        let (s, k) = (&self.source, &self.sink);

        let sink = match reuse {
            Some(sink) => sink.clone(),
            None => IcebergSink::new(sc.clone()).map_err(|e| err("sink", e.to_string()))?,
        };
        if evolution.is_some() {
            self.columns.bind(&sink);
        }
        let job = JobBuilder::new(job_id.clone());
        let source_parallelism = s.parallelism.unwrap_or(self.job.parallelism);
        let sink_parallelism = k.parallelism.unwrap_or(self.job.parallelism);
        if source_parallelism == 0 {
            return Err(err("source.parallelism", "expected at least 1"));
        }
        if sink_parallelism == 0 {
            return Err(err("sink.parallelism", "expected at least 1"));
        }
        let stream = job.source(SOURCE_NODE, source_parallelism, source);
        let stream = if self.transforms.is_empty() {
            stream
        } else {
            let transforms = Arc::new(transforms);
            stream.transform(TRANSFORMS_NODE, move |ctx: &OperatorContext| {
                Ok(TransformOperator::new(ctx, Arc::clone(&transforms)))
            })
        };
        sink.attach(stream, "iceberg", sink_parallelism);
        let graph = job.build().map_err(|e| err("job", e.to_string()))?;
        checkpoint_check(&runtime)?;
        Ok(JobPlan {
            job_id,
            source_schema,
            output_schema,
            runtime,
            checkpoints: self.plan_checkpoints()?,
            retained,
            metrics_address,
            metrics_linger,
            restart_reset_after: duration(
                "restart.reset_after",
                self.restart.reset_after.as_deref().unwrap_or("10m"),
            )?,
            sink: sc,
            iceberg: sink,
            placement: self.placement.clone(),
            graph,
            file: self.clone(),
        })
    }

    /// The `[source]` section: the Kafka source with its value format, key,
    /// headers, event time and schema evolution.
    fn plan_source(
        &self,
        start: Option<StartPosition>,
    ) -> Result<(KafkaArrowSource, Option<SchemaEvolution>), JobFileError> {
        let s = &self.source;
        let mut format = value_format(s)?;
        let value_columns = format.output_schema();
        if let Some(key) = &s.key {
            if key.ty.as_deref().map(str::trim) == Some("avro") {
                if s.format.as_deref().map(str::trim) != Some("avro") {
                    return Err(err(
                        "source.key.type",
                        "`avro` needs Avro values (source.format = \"avro\"): the key uses their registry",
                    ));
                }
                let Some(fetched) = &s.registry_key_schema else {
                    return Err(err(
                        "source.key",
                        "the key's schema was not fetched from the registry (JobFile::resolve_schema)",
                    ));
                };
                let fields = table_schema(fetched).map_err(|m| err("source.key", m))?;
                let column = key.column.clone().unwrap_or_else(|| "key".to_owned());
                format = format.with_avro_key_column(&column, fields);
            } else {
                let (column, ty) = bytes_column("source.key", key, "key")?;
                format = format.with_key_column(&column, ty);
            }
        }
        for (i, h) in s.headers.iter().enumerate() {
            let at = format!("source.headers[{i}]");
            if h.name.is_empty() {
                return Err(err(&format!("{at}.name"), "expected a header name"));
            }
            let column = h.column.clone().unwrap_or_else(|| column_name(&h.name));
            let ty = bytes_type(&format!("{at}.type"), h.ty.as_deref())?;
            format = format.with_header_column(&h.name, &column, ty);
        }
        if let Some(all) = &s.all_headers {
            let (column, ty) = bytes_column("source.all_headers", all, "headers")?;
            format = format.with_all_headers(&column, ty);
        }
        if s.metadata_columns {
            format = format.with_metadata_columns();
        }
        let evolution = self.schema_evolution()?;
        if let Some(mode) = evolution {
            let not_value = format
                .output_schema()
                .fields()
                .iter()
                .filter(|f| value_columns.field_with_name(f.name()).is_err())
                .map(|f| f.name().clone())
                .collect();
            self.columns.start(&value_columns, not_value);
            format = format.with_evolution(Evolution {
                mode,
                evolver: Arc::new(self.columns.clone()),
            });
        }
        let mut kafka = source_config(s, &self.job.name)?;
        if let Some(p) = &self.placement {
            kafka.worker = p.worker;
        }
        if let Some(start) = start {
            kafka.start = start;
        }
        let mut source = KafkaArrowSource::new(kafka, format);
        if let Some(et) = &s.event_time {
            let mut e = match (&et.column, et.record_timestamp) {
                (Some(c), false) => EventTime::column(c.clone()),
                (None, true) => EventTime::record_timestamp(),
                _ => {
                    return Err(err(
                        "source.event_time",
                        "expected either `column` or `record_timestamp = true`",
                    ));
                }
            };
            if let Some(d) = &et.max_out_of_orderness {
                e = e.max_out_of_orderness(duration("source.event_time.max_out_of_orderness", d)?);
            }
            if let Some(d) = &et.idle_timeout {
                e = e.idle_timeout(if d == "off" {
                    None
                } else {
                    Some(duration("source.event_time.idle_timeout", d)?)
                });
            }
            source = source.with_event_time(e);
        }
        source.validate().map_err(|e| match e {
            tinyflow_api::StreamError::Config { key, message } => err(key, message),
            other => err("source", other.to_string()),
        })?;
        Ok((source, evolution))
    }

    /// The `[sink]` section, for a table of `output_schema`'s columns;
    /// `evolution`: the source evolves the table's schema.
    fn plan_sink(
        &self,
        output_schema: &SchemaRef,
        evolution: bool,
    ) -> Result<IcebergSinkConfig, JobFileError> {
        let k = &self.sink;
        let sink_id = match &self.placement {
            Some(p) => p.sink_id.clone(),
            None => k.sink_id.clone().unwrap_or_else(|| self.job.name.clone()),
        };
        let mut sc = IcebergSinkConfig::new(catalog(&k.catalog)?, &k.namespace, &k.table, &sink_id);
        sc.schema_evolution = evolution;
        if k.create_if_missing {
            let mut columns = Vec::with_capacity(output_schema.fields().len());
            for f in output_schema.fields() {
                let ty = column_type(f)
                    .map_err(|m| err("sink", format!("the transforms' output: {m}")))?;
                columns.push(if f.is_nullable() {
                    Column::optional(f.name(), ty)
                } else {
                    Column::required(f.name(), ty)
                });
            }
            let mut partition = Vec::with_capacity(k.partition.len());
            for (i, p) in k.partition.iter().enumerate() {
                if output_schema.index_of(&p.column).is_err() {
                    return Err(err(
                        &format!("sink.partition[{i}].column"),
                        format!("no column `{}` in the table", p.column),
                    ));
                }
                partition.push(PartitionField::new(&p.column, &p.transform));
            }
            sc = sc.create_if_missing(TableSpec { columns, partition });
        } else if !k.partition.is_empty() {
            return Err(err(
                "sink.partition",
                "only used to create a table; set create_if_missing = true or remove it",
            ));
        }
        if let Some(b) = k.target_file_size {
            sc.target_file_size =
                usize::try_from(b).map_err(|_| err("sink.target_file_size", "too large"))?;
        }
        if let Some(n) = k.max_open_files {
            sc.max_open_writers =
                usize::try_from(n).map_err(|_| err("sink.max_open_files", "too large"))?;
        }
        if let Some(b) = k.max_writer_memory {
            sc.max_writer_memory =
                usize::try_from(b).map_err(|_| err("sink.max_writer_memory", "too large"))?;
        }
        if let Some(d) = &k.distribution {
            sc.distribution = Distribution::parse(d).map_err(|m| err("sink.distribution", m))?;
        }
        if let Some(merge) = k.commit.merge {
            sc.merge_pending = merge;
        }
        if let Some(t) = &k.commit.merge_timeout {
            sc.merge_timeout = duration("sink.commit.merge_timeout", t)?;
        }
        if let Some(c) = &k.compression {
            sc.compression = c
                .parse::<Compression>()
                .map_err(|m| err("sink.compression", m))?;
        }
        if let Some(b) = &k.bad_records {
            sc.bad_records = b
                .parse::<BadRecords>()
                .map_err(|m| err("sink.bad_records", m))?;
        }
        sc.cadence = CommitCadence {
            every_checkpoints: k.commit.every_checkpoints,
            interval: k
                .commit
                .interval
                .as_deref()
                .map(|d| duration("sink.commit.interval", d))
                .transpose()?,
            max_pending_bytes: k.commit.max_pending_bytes,
        };
        sc.maintenance = crate::maintain::in_job(&k.maintenance, self.placement.as_ref())?;
        #[cfg(feature = "chaos")]
        {
            sc.fault_hook = chaos_commit_pause();
        }
        sc.validate().map_err(|e| match e {
            tinyflow_api::StreamError::Config { key, message } => {
                err(&format!("sink ({key})"), message)
            }
            other => err("sink", other.to_string()),
        })?;
        Ok(sc)
    }

    /// `checkpoint.dir` (and `checkpoint.storage`): a local directory, or
    /// object storage with its settings. Each worker keeps its checkpoints
    /// apart, under its sink id, so a layout's checkpoints are never
    /// restored by another.
    fn plan_checkpoints(&self) -> Result<Checkpoints, JobFileError> {
        let c = &self.checkpoint;
        let dir = c.dir.as_deref().unwrap_or("tinyflow-checkpoints");
        let worker = self.placement.as_ref().map(|p| p.sink_id.as_str());
        if !is_object_location(dir) {
            if dir.contains("://") {
                return Err(err(
                    "checkpoint.dir",
                    format!("`{dir}`: expected a local directory or s3://bucket/prefix"),
                ));
            }
            if c.storage.is_some() {
                return Err(err(
                    "checkpoint.storage",
                    "only for checkpoints on object storage (checkpoint.dir = \"s3://bucket/prefix\")",
                ));
            }
            let dir = absolute_path(dir);
            return Ok(Checkpoints::Dir(
                worker.map_or_else(|| dir.clone(), |w| dir.join(w)),
            ));
        }
        let base = dir.trim_end_matches('/');
        let location = worker.map_or_else(|| base.to_owned(), |w| format!("{base}/{w}"));
        let properties: HashMap<String, String> = match &c.storage {
            Some(s) => s.clone().into_iter().collect(),
            None => self.sink.catalog.properties.clone().into_iter().collect(),
        };
        tinyflow_api::secrets::register_settings(
            properties.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        );
        Ok(Checkpoints::Object(ObjectCheckpoints {
            location,
            properties,
        }))
    }

    /// The `[checkpoint]` and `[restart]` sections: the runtime's settings and
    /// how many checkpoints to keep.
    fn plan_runtime(&self) -> Result<(RuntimeConfig, usize), JobFileError> {
        let c = &self.checkpoint;
        let mut checkpoint = CheckpointConfig {
            interval: match c.interval.as_deref() {
                Some("off") => None,
                other => Some(duration("checkpoint.interval", other.unwrap_or("1s"))?),
            },
            timeout: duration("checkpoint.timeout", c.timeout.as_deref().unwrap_or("60s"))?,
            ..CheckpointConfig::default()
        };
        if let Some(t) = c.tolerable_failures {
            checkpoint.tolerable_failures = t;
        }
        let retained = c.retained.unwrap_or(3);
        if retained == 0 {
            return Err(err("checkpoint.retained", "expected at least 1"));
        }
        let runtime = RuntimeConfig {
            checkpoint,
            restart: restart(&self.restart)?,
            ..RuntimeConfig::default()
        };
        Ok((runtime, retained))
    }

    /// The `[metrics]` section: the endpoint's address, and how long it stays
    /// up after the job ends.
    fn plan_metrics(&self) -> Result<(Option<SocketAddr>, Duration), JobFileError> {
        let metrics_address = self
            .metrics
            .address
            .as_deref()
            .map(|a| {
                a.parse::<SocketAddr>().map_err(|e| {
                    err(
                        "metrics.address",
                        format!("`{a}`: {e}; expected host:port like 127.0.0.1:9898"),
                    )
                })
            })
            .transpose()?;
        let metrics_linger = match self.metrics.linger.as_deref() {
            None => Duration::ZERO,
            Some(_) if metrics_address.is_none() => {
                return Err(err(
                    "metrics.linger",
                    "keeps the metrics endpoint up after the job ends; set metrics.address too",
                ));
            }
            Some(l) => duration("metrics.linger", l)?,
        };
        Ok((metrics_address, metrics_linger))
    }
}

/// The chaos test's knob: with `TINYFLOW_CHAOS_COMMIT_PAUSE_MS` set, every
/// commit pauses that long just before and just after the catalog update,
/// saying so on stderr (`CHAOS commit paused before|after update`), so the
/// test can kill the process inside a commit. Nothing else changes. Only
/// in builds with the `chaos` feature (the crate's tests turn it on).
#[cfg(feature = "chaos")]
fn chaos_commit_pause() -> Option<FaultHook> {
    let ms: u64 = std::env::var("TINYFLOW_CHAOS_COMMIT_PAUSE_MS")
        .ok()?
        .parse()
        .ok()?;
    Some(Arc::new(move |step| {
        Box::pin(async move {
            let at = match step {
                CommitStep::BeforeUpdate { .. } => "commit paused before update",
                CommitStep::AfterUpdate { .. } => "commit paused after update",
                CommitStep::Refreshed { .. } => return Fault::Proceed,
                CommitStep::MergePlanned => "merge paused planned",
                CommitStep::MergeWriting => "merge paused writing",
                CommitStep::MergeWritten => "merge paused written",
                CommitStep::MergeCommitted => "merge paused committed",
            };
            #[allow(clippy::print_stderr, reason = "the chaos test watches stderr for it")]
            {
                eprintln!("CHAOS {at}");
            }
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Fault::Proceed
        })
    }))
}

fn checkpoint_check(runtime: &RuntimeConfig) -> Result<(), JobFileError> {
    runtime
        .checkpoint
        .validate(true)
        .map_err(|e| err("checkpoint", e.to_string()))
}

impl JobPlan {
    /// The plan of worker `worker` of this job (`tinyflow run --worker`):
    /// finds or makes its place in the table's layout of workers
    /// ([`IcebergSink::join_layout`]; `rescale_from`: the layout a rescale
    /// replaces) and plans the job again as that
    /// worker: its share of the partitions, its own sink id, its own
    /// checkpoint directory (`checkpoint.dir/<sink id>`).
    pub async fn for_worker(
        self,
        worker: Worker,
        rescale_from: Option<tinyflow_api::RescaleFrom>,
    ) -> anyhow::Result<JobPlan> {
        let joined = self.iceberg.join_layout(worker, rescale_from).await?;
        tracing::info!(
            worker = %worker,
            generation = joined.layout.generation,
            sink = %joined.sink_id,
            switched = joined.switched,
            "joined the table's layout of workers"
        );
        let placement = Placement {
            worker,
            layout: joined.layout,
            base_sink: self.sink.sink_id.clone(),
            sink_id: joined.sink_id,
        };
        Ok(self.as_worker(placement)?)
    }

    /// This job planned as worker `worker` of the table's current layout,
    /// without changing the table (`tinyflow reset --worker`): refused when
    /// the table's layout has another worker count.
    pub async fn as_current_worker(&self, worker: Worker) -> anyhow::Result<JobPlan> {
        let table = self.iceberg.load_table().await?;
        let base = &self.sink.sink_id;
        let layout = match table_layout(&table, base)? {
            Some(r) if r.layout.workers == worker.count() => r.layout,
            Some(r) => {
                return Err(StreamError::Config {
                    key: "--worker",
                    message: format!(
                        "worker {worker}: the table's layout of sink `{base}` is {} workers (generation {})",
                        r.layout.workers, r.layout.generation
                    ),
                }
                .into());
            }
            None => {
                return Err(StreamError::Config {
                    key: "--worker",
                    message: format!("the table has no layout of workers of sink `{base}`"),
                }
                .into());
            }
        };
        Ok(self.as_worker(Placement {
            worker,
            layout,
            base_sink: base.clone(),
            sink_id: layout.sink_id(base, worker.index()),
        })?)
    }

    /// This job planned as the worker `placement` says, without asking the
    /// table (for `tinyflow inspect`).
    pub fn as_worker(&self, placement: Placement) -> Result<JobPlan, JobFileError> {
        let mut file = self.file.clone();
        file.placement = Some(placement);
        file.plan()
    }

    /// The endpoint `metrics.address` serves, if set: `/readyz` wants a
    /// checkpoint completed within the checkpoint timeout plus two
    /// intervals.
    pub fn endpoint(&self) -> Option<Endpoint> {
        let interval = self.runtime.checkpoint.interval.unwrap_or(Duration::ZERO);
        self.metrics_address.map(|address| Endpoint {
            address,
            ready_window: self.runtime.checkpoint.timeout + interval * 2,
        })
    }

    /// The Kafka offsets the table holds this sink's data up to: the
    /// `source-positions` of its last commit; for a worker, over the start
    /// of its layout (where a rescale left the partitions it owns now).
    async fn table_offsets(&self) -> anyhow::Result<Option<BTreeMap<(String, i32), i64>>> {
        let positions = match &self.placement {
            None => self.iceberg.committed_positions().await?,
            Some(p) => {
                let table = self.iceberg.load_table().await?;
                worker_start(&table, &p.base_sink, p.layout, p.worker.index())?
            }
        };
        let Some(positions) = positions else {
            return Ok(None);
        };
        let Some(kafka) = positions.get(SOURCE_NODE) else {
            return Ok(None);
        };
        let offsets = offsets_of_positions(kafka).map_err(|m| {
            anyhow::anyhow!(
                "the table property {} has {m}",
                self.sink.positions_property()
            )
        })?;
        Ok(Some(offsets))
    }

    /// Refuses to run the job in one process on a table its workers write
    /// (the workers would go on beside it, or their data be read again).
    pub(crate) async fn check_single(&self) -> anyhow::Result<()> {
        if self.placement.is_some() {
            return Ok(());
        }
        let table = self.iceberg.load_table().await?;
        if let Some(record) = table_layout(&table, &self.sink.sink_id)? {
            let n = record.layout.workers;
            return Err(StreamError::Config {
                key: "--worker",
                message: format!(
                    "sink `{}` of this table is written by {n} workers (layout generation {g}, set by {}); run (or reset) each with --worker I/{n}, or, to run the job in one process again, --worker 0/1 --rescale-from {n}@{g}",
                    self.sink.sink_id, record.set_by, g = record.layout.generation
                ),
            }
            .into());
        }
        Ok(())
    }

    /// Runs the job until it ends or fails past its restart strategy.
    pub async fn run(self) -> anyhow::Result<JobReport> {
        self.run_until_stopped(StopHandle::new()).await
    }

    /// Like [`run`](Self::run); `stop` ends the job with a final checkpoint
    /// that the sink commits (what `tinyflow run` does on SIGTERM).
    pub async fn run_until_stopped(self, stop: StopHandle) -> anyhow::Result<JobReport> {
        let store: Arc<dyn CheckpointStore> = match &self.checkpoints {
            Checkpoints::Dir(dir) => Arc::new(
                LocalDirStore::open(dir, self.job_id.clone(), self.retained)
                    .await
                    .with_context(|| format!("checkpoint.dir {}", dir.display()))?,
            ),
            Checkpoints::Object(o) => Arc::new(
                crate::checkpoint_storage::open_object_store(
                    &o.location,
                    &o.properties,
                    self.job_id.clone(),
                    self.retained,
                )
                .await
                .with_context(|| format!("checkpoint.dir {}", o.location))?,
            ),
        };
        // No checkpoint to restore (none, or none readable).
        let fresh = store.latest().await?.is_none();
        let table = format!("{}.{}", self.sink.namespace.join("."), self.sink.table);
        tracing::info!(
            job = %self.job_id,
            checkpoints = %self.checkpoints,
            catalog = %self.sink.catalog.describe(),
            table = %table,
            sink = %self.sink.sink_id,
            worker = %self.placement.as_ref().map_or_else(|| "single process".to_owned(), |p| p.worker.to_string()),
            "running job"
        );
        self.check_single().await?;
        let mut graph = None;
        if fresh {
            // No checkpoint: where the job starts depends on the table. Claim
            // the sink first, so that no older run commits after the read.
            let epoch = self.iceberg.claim().await?;
            let committed = self.iceberg.last_committed().await?.map(|c| c.get());
            // `tinyflow reset` leaves its word in a local directory only.
            let reset = match &self.checkpoints {
                Checkpoints::Dir(dir) => crate::jobstate::ResetFile::read(dir)?,
                Checkpoints::Object(_) => None,
            };
            let start = match reset {
                Some(reset) if reset.table_committed == committed => {
                    tracing::warn!(
                        table = %table,
                        epoch,
                        start = %reset.start,
                        "no checkpoint in the checkpoint directory: the source starts where `tinyflow reset` said"
                    );
                    Some(reset.start.position())
                }
                other => {
                    if let Some(reset) = other {
                        tracing::warn!(
                            reset_at = reset.table_committed,
                            table_now = committed,
                            "ignoring the reset file: the table has moved on since the reset"
                        );
                    }
                    // No checkpoint to restore, but the table says where its
                    // data ends: start there rather than at `source.start`,
                    // which would write again what the table holds.
                    self.table_offsets().await?.map(|offsets| {
                        tracing::warn!(
                            table = %table,
                            sink = %self.sink.sink_id,
                            epoch,
                            partitions = offsets.len(),
                            offsets = ?offsets.iter().map(|((t, p), o)| format!("{t}/{p}@{o}")).collect::<Vec<_>>(),
                            "no checkpoint in the checkpoint directory: the source starts where the table's last commit of this sink ends"
                        );
                        StartPosition::Offsets(offsets)
                    })
                }
            };
            if let Some(start) = start {
                graph = Some(
                    self.file
                        .plan_starting(Some(start), Some(&self.iceberg))?
                        .graph,
                );
            }
        }
        let graph = graph.unwrap_or(self.graph);
        if let Some(mode) = self.file.schema_evolution()? {
            // The table's columns beyond the declared ones (added by an
            // earlier run, or by someone else) are read into too.
            self.file
                .columns
                .follow_table(mode == SchemaEvolution::AddColumns)
                .await?;
        }
        let report = JobRunner::new(graph, store, self.runtime)
            .with_restart_budget_reset(Some(self.restart_reset_after))
            .with_stop(stop)
            .run()
            .await?;
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use crate::JobFile;

    const EXAMPLE: &str = include_str!("../../../examples/jobs/bids.toml");

    /// The first line of `edited` that differs from `original`.
    fn first_difference(original: &str, edited: &str) -> String {
        edited
            .lines()
            .zip(original.lines())
            .find(|(e, o)| e != o)
            .map_or_else(String::new, |(e, _)| e.to_owned())
    }

    fn plan_error(edit: impl Fn(&str) -> String) -> String {
        let text = edit(EXAMPLE);
        assert_ne!(text, EXAMPLE, "the edit changed nothing");
        match JobFile::parse(&text, "job.toml").and_then(|f| f.plan()) {
            Ok(_) => panic!(
                "the edited job file was accepted: {}",
                first_difference(EXAMPLE, &text)
            ),
            Err(e) => e.to_string(),
        }
    }

    /// The secured example takes everything secret or local from the
    /// environment; a secret read so never shows in scrubbed output, and a
    /// variable that is missing is named with its key.
    #[test]
    fn the_secured_example_takes_its_settings_from_the_environment() {
        const SECURED: &str = include_str!("../../../examples/jobs/secured.toml");
        let env = |name: &str| match name {
            "KAFKA_SASL_SSL_BOOTSTRAP" => Some("broker.example:9093".to_owned()),
            "KAFKA_SASL_USERNAME" => Some("bids".to_owned()),
            "KAFKA_SASL_PASSWORD" => Some("pw-from-the-environment-1".to_owned()),
            "KAFKA_SSL_CA" => Some("/etc/kafka/ca.pem".to_owned()),
            "TINYFLOW_DATA" => Some("/var/lib/tinyflow-test".to_owned()),
            _ => None,
        };
        let plan = JobFile::parse_with(SECURED, "secured.toml", &env)
            .and_then(|f| f.plan())
            .unwrap();
        assert_eq!(
            plan.checkpoints,
            super::Checkpoints::Dir("/var/lib/tinyflow-test/checkpoints".into())
        );
        assert!(
            plan.sink
                .catalog
                .describe()
                .contains("/var/lib/tinyflow-test/catalog.db"),
            "{}",
            plan.sink.catalog.describe()
        );
        assert_eq!(
            tinyflow_api::secrets::scrub("login as bids with pw-from-the-environment-1"),
            "login as bids with ***"
        );
        let err = JobFile::parse_with(SECURED, "secured.toml", &|name| {
            (name != "KAFKA_SASL_PASSWORD").then(|| env(name)).flatten()
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("source.properties.sasl.password")
                && err.contains("`${KAFKA_SASL_PASSWORD}` is not set"),
            "{err}"
        );
    }

    #[test]
    fn the_example_job_file_plans_to_the_documented_table() {
        let plan = JobFile::parse(EXAMPLE, "bids.toml")
            .unwrap()
            .plan()
            .unwrap();
        let columns: Vec<String> = plan
            .output_schema
            .fields()
            .iter()
            .map(|f| format!("{}:{}", f.name(), f.data_type()))
            .collect();
        assert_eq!(
            columns,
            [
                "id:Int64",
                "auction:Int64",
                "bidder:Int64",
                "price:Int64",
                "channel:Utf8",
                "event_time_ms:Int64",
                "price_eur:Float64"
            ]
        );
        assert_eq!(plan.sink.table, "bids");
        assert_eq!(
            plan.runtime.checkpoint.interval,
            Some(std::time::Duration::from_secs(1))
        );
        assert_eq!(plan.metrics_address.unwrap().port(), 9898);
        assert_eq!(plan.metrics_linger, std::time::Duration::from_secs(10));
    }

    #[test]
    fn keys_and_headers_become_columns_after_the_value_and_before_the_metadata() {
        let text = EXAMPLE.replacen(
            "[[source.fields]]",
            "key = { column = \"bidder_key\" }\nmetadata_columns = true\n\n\
             [[source.headers]]\nname = \"trace-id\"\n\n\
             [[source.headers]]\nname = \"sig\"\ncolumn = \"signature\"\ntype = \"binary\"\n\n\
             [[source.fields]]",
            1,
        );
        let plan = JobFile::parse(&text, "job.toml").unwrap().plan().unwrap();
        let columns: Vec<String> = plan
            .source_schema
            .fields()
            .iter()
            .skip(6)
            .map(|f| format!("{}:{}:{}", f.name(), f.data_type(), f.is_nullable()))
            .collect();
        assert_eq!(
            columns,
            [
                "bidder_key:Utf8:true",
                "trace_id:Utf8:true",
                "signature:Binary:true",
                "_kafka_topic:Utf8:false",
                "_kafka_partition:Int32:false",
                "_kafka_offset:Int64:false",
                "_kafka_timestamp:Int64:true",
            ]
        );
    }

    #[test]
    fn metrics_linger_needs_the_endpoint_and_a_duration() {
        let e = plan_error(|t| t.replace("address = \"127.0.0.1:9898\"", "port = 1"));
        assert!(e.contains("port"), "{e}");
        let e = plan_error(|t| {
            t.replace(
                "address = \"127.0.0.1:9898\"   # Prometheus: http://127.0.0.1:9898/metrics\n",
                "",
            )
        });
        assert!(e.starts_with("metrics.linger:"), "{e}");
        let e = plan_error(|t| t.replace("linger = \"10s\"", "linger = \"10\""));
        assert!(e.starts_with("metrics.linger:"), "{e}");
    }

    #[test]
    fn the_counters_line_sums_over_subtasks_and_splits_bad_records_by_reason() {
        let text = "# TYPE tinyflow_kafka_records_read_total counter\n\
            tinyflow_kafka_records_read_total{operator=\"kafka\",subtask=\"0\"} 600\n\
            tinyflow_kafka_records_read_total{operator=\"kafka\",subtask=\"1\"} 400\n\
            tinyflow_bad_records_total{operator=\"kafka\",reason=\"invalid_json\",subtask=\"0\"} 3\n\
            tinyflow_bad_records_total{operator=\"kafka\",reason=\"invalid_json\",subtask=\"1\"} 2\n\
            tinyflow_bad_records_total{operator=\"kafka\",reason=\"schema_mismatch\",subtask=\"1\"} 1\n\
            tinyflow_iceberg_rows_written_total{sink=\"iceberg\"} 994\n\
            tinyflow_checkpoints_completed_total{job=\"bids\"} 7\n\
            tinyflow_checkpoints_failed_total{job=\"bids\",reason=\"timeout\"} 1\n\
            tinyflow_iceberg_commits_total{sink=\"iceberg\"} 7\n";
        assert_eq!(
            crate::counters_line(text),
            "records_read=1000 bad_records=6 (invalid_json=5 schema_mismatch=1) rows_written=994 \
             rows_skipped_by_sink=0 checkpoints_completed=7 checkpoints_failed=1 commits=7 \
             commit_attempts=0 commit_conflicts=0 merges=0 merge_failures=0"
        );
    }

    #[test]
    fn a_wrong_job_file_is_refused_naming_the_key() {
        for (edit, want) in [
            (
                ("retained = 3", "retaind = 3"),
                "job.toml:92: `retaind = 3`: unknown field `retaind`",
            ),
            (
                ("parallelism = 2 ", "parallelism = \"two\" "),
                "job.toml:7: `parallelism = \"two\"",
            ),
            (
                ("interval = \"1s\"", "interval = \"1 sec\""),
                "checkpoint.interval: `1 sec`: unknown unit `sec`",
            ),
            (
                ("filter = \"price >= 100\"", "filter = \"prce >= 100\""),
                "transforms[0].filter: no column `prce` at this step",
            ),
            (
                ("type = \"string\"", "type = \"text\""),
                "source.fields[4].type: unknown type `text`",
            ),
            (
                ("bad_records = \"skip\"", "bad_records = \"ignore\""),
                "source.bad_records: `ignore`: expected fail, skip or dead-letter:<topic>",
            ),
            (
                ("coerce = []", "coerce = [\"string-to-number\", \"round\"]"),
                "source.coerce[1]: `round`: expected one of fraction-to-integer, string-to-number, truncate-time",
            ),
            (
                ("max_nesting_depth = 64", "max_nesting_depth = 5000"),
                "source.max_nesting_depth: 5000: expected 1 to 1024",
            ),
            (
                ("max_record_bytes = 8388608", "max_record_bytes = 0"),
                "source.max_record_bytes: expected at least 1",
            ),
            (
                (
                    "column = \"auction\", transform",
                    "column = \"auctions\", transform",
                ),
                "sink.partition[0].column: no column `auctions`",
            ),
            (
                ("address = \"127.0.0.1:9898\"", "address = \"localhost\""),
                "metrics.address: `localhost`",
            ),
            (
                ("strategy = \"exponential\"", "strategy = \"forever\""),
                "restart.strategy: `forever`: expected exponential, fixed or none",
            ),
            (
                ("type = \"sqlite\"", "type = \"hive\""),
                "sink.catalog.type: `hive`: expected sqlite, sql or rest",
            ),
            (
                ("type = \"sqlite\"", "type = \"rest\""),
                "sink.catalog.dir: only a sqlite catalog has `dir`",
            ),
            (
                ("dir = \"tinyflow-data\"\n", "warehouse = \"file:///w\"\n"),
                "sink.catalog.warehouse: a sqlite catalog keeps its warehouse in `dir`",
            ),
            (
                ("format = \"json\"", "format = \"xml\""),
                "source.format: `xml`: expected json, avro, protobuf or raw",
            ),
            (
                ("format = \"json\"", "format = \"avro\""),
                "source.registry: format = \"avro\" needs [source.registry] with its url",
            ),
            (
                ("start = \"earliest\"", "registry = { url = \"http://r\" }"),
                "source.registry: only with format = \"avro\" or \"protobuf\"",
            ),
            (
                (
                    "format = \"json\"",
                    "format = \"avro\"\nregistry = { url = \"localhost:8081\" }",
                ),
                "source.registry: schema registry settings: the registry URL \"localhost:8081\" must start with http:// or https://",
            ),
            (
                ("[sink]", "[sink]\nschema_evolution = \"add-columns\""),
                "sink.schema_evolution: only with source.format = \"avro\"",
            ),
            (
                ("[sink]", "[sink]\nschema_evolution = \"sometimes\""),
                "sink.schema_evolution: `sometimes`: expected ignore, add-columns or fail",
            ),
            (
                ("start = \"earliest\"", "key = { type = \"avro\" }"),
                "source.key.type: `avro` needs Avro values",
            ),
            (
                ("format = \"json\"", "format = \"raw\""),
                "source.fields: not taken: with format = \"raw\" the value is one column",
            ),
            (
                ("start = \"earliest\"", "value = { column = \"v\" }"),
                "source.value: only with format = \"raw\"",
            ),
            (
                ("start = \"earliest\"", "key = { type = \"text\" }"),
                "source.key.type: `text`: expected string or binary",
            ),
            (
                ("start = \"earliest\"", "key = { column = \"price\" }"),
                "source.schema: column `price` is named twice",
            ),
            (
                (
                    "[[source.fields]]",
                    "[[source.headers]]\nname = \"\"\n\n[[source.fields]]",
                ),
                "source.headers[0].name: expected a header name",
            ),
        ] {
            let err = plan_error(|t| t.replacen(edit.0, edit.1, 1));
            assert!(err.starts_with(want), "{edit:?}: got {err}");
        }
        let rest = |t: &str, uri: &str| {
            t.replacen("type = \"sqlite\"", "type = \"rest\"", 1)
                .replacen(
                    "dir = \"tinyflow-data\"\n",
                    &format!("uri = \"{uri}\"\n"),
                    1,
                )
        };
        let err = plan_error(|t| rest(t, "").replacen("uri = \"\"\n", "", 1));
        assert!(
            err.starts_with("sink.catalog.uri: a rest catalog needs `uri`"),
            "{err}"
        );
        let err = plan_error(|t| rest(t, "localhost:8181"));
        assert!(
            err.starts_with(
                "sink.catalog.uri: `localhost:8181`: a rest catalog's uri starts with http://"
            ),
            "{err}"
        );
        let text = rest(EXAMPLE, "http://127.0.0.1:8181");
        let plan = JobFile::parse(&text, "job.toml").unwrap().plan().unwrap();
        assert!(
            matches!(
                &plan.sink.catalog,
                tinyflow_connectors_iceberg::CatalogConfig::Rest { uri, warehouse: None, .. }
                    if uri == "http://127.0.0.1:8181"
            ),
            "{:?}",
            plan.sink.catalog
        );
        let sql = |t: &str, warehouse: &str| {
            t.replacen("type = \"sqlite\"", "type = \"sql\"", 1)
                .replacen(
                    "dir = \"tinyflow-data\"\n",
                    &format!(
                        "uri = \"sqlite:c.db\"\nwarehouse = \"{warehouse}\"\n\
                     properties = {{ \"s3.endpoint\" = \"http://127.0.0.1:9190\" }}\n"
                    ),
                    1,
                )
        };
        let err = plan_error(|t| sql(t, "/var/lib/w"));
        assert!(
            err.starts_with(
                "sink.catalog.warehouse: `/var/lib/w`: expected a file:///path or s3://bucket/path"
            ),
            "{err}"
        );
        let text = sql(EXAMPLE, "s3://bucket/w");
        let plan = JobFile::parse(&text, "job.toml").unwrap().plan().unwrap();
        assert!(
            matches!(
                &plan.sink.catalog,
                tinyflow_connectors_iceberg::CatalogConfig::Sql { warehouse, properties, .. }
                    if warehouse == "s3://bucket/w"
                        && properties["s3.endpoint"] == "http://127.0.0.1:9190"
            ),
            "{:?}",
            plan.sink.catalog
        );
    }
}
