//! The job file as written: TOML sections, checked by serde for unknown
//! keys and types (`toml` names the key and line); what needs the source
//! schema is checked by [`JobFile::plan`](crate::JobFile::plan).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::JobFileError;

/// A whole job file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    /// `[job]`
    pub job: JobSection,
    /// `[source]`
    pub source: SourceSection,
    /// `[[transforms]]`, applied in order.
    #[serde(default)]
    pub transforms: Vec<TransformSection>,
    /// `[sink]`
    pub sink: SinkSection,
    /// `[checkpoint]`
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    /// `[restart]`
    #[serde(default)]
    pub restart: RestartSection,
    /// `[metrics]`
    #[serde(default)]
    pub metrics: MetricsSection,
    /// With `sink.schema_evolution`: the source's columns, shared by every
    /// plan made from this file (a restart plans again).
    #[serde(skip)]
    pub columns: crate::LiveColumns,
    /// The worker this plan runs as, once its place in the table's layout
    /// is known (`tinyflow run --worker I/N`); `None`: the job in one process.
    #[serde(skip)]
    pub placement: Option<crate::plan::Placement>,
}

/// `[job]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    /// The job's id: names its checkpoints, and is the default consumer
    /// group and sink id.
    pub name: String,
    /// Subtasks of the source, transforms and writers unless a section says
    /// otherwise (default 1).
    #[serde(default = "one")]
    pub parallelism: usize,
}

fn one() -> usize {
    1
}

/// `[source]`: a Kafka source of JSON records.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSection {
    /// `host:port[,host:port]`
    pub bootstrap_servers: String,
    /// Topics to read.
    pub topics: Vec<String>,
    /// Consumer group (offsets committed for lag monitoring only); default
    /// the job name.
    pub group_id: Option<String>,
    /// `earliest` (default), `latest`, `committed` or `timestamp:<ms>`.
    pub start: Option<String>,
    /// `json` (default: the declared `fields`), `avro` (the Confluent wire
    /// format, schemas from `[source.registry]`) or `raw` (the value as it
    /// is, in the one column `value` names).
    pub format: Option<String>,
    /// `[source.registry]`: the schema registry of `avro` values.
    pub registry: Option<RegistrySection>,
    /// `raw` only: the value's column (default `value`, `string`).
    pub value: Option<BytesColumn>,
    /// The record's key as a column (default: not kept); `type = "avro"`
    /// decodes it with the value's registry into a struct column.
    pub key: Option<BytesColumn>,
    /// Headers kept as columns: `[[source.headers]]`.
    #[serde(default)]
    pub headers: Vec<HeaderSection>,
    /// Every header in one map column, name to value:
    /// `{ column = "headers", type = "string" }` (or `"binary"`).
    pub all_headers: Option<BytesColumn>,
    /// `fail` (default), `skip` or `dead-letter:<topic>`.
    pub bad_records: Option<String>,
    /// Read up to the partitions' end offsets at start, then take a final
    /// checkpoint, commit and end (default false: run until stopped).
    #[serde(default)]
    pub bounded: bool,
    /// Unknown JSON fields make a record bad (default false: ignored).
    #[serde(default)]
    pub strict: bool,
    /// Adds `_kafka_topic`, `_kafka_partition`, `_kafka_offset`,
    /// `_kafka_timestamp` columns.
    #[serde(default)]
    pub metadata_columns: bool,
    /// Source subtasks (default `job.parallelism`).
    pub parallelism: Option<usize>,
    /// Records per batch (default 1024).
    pub batch_size: Option<usize>,
    /// How often to look for partitions added to the topics (default
    /// `30s`, or `off`).
    pub partition_discovery: Option<String>,
    /// How long a partition behind may make no progress before it is
    /// reported (default `60s`).
    pub stall_warn: Option<String>,
    /// How long a source subtask may make no progress while behind before
    /// it fails (default `10m`, or `off`).
    pub stall_fail: Option<String>,
    /// librdkafka settings passed through (`security.protocol`, ...).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// The record schema: `[[source.fields]]`, in column order (`json`;
    /// with `avro`, the columns taken from each record, by name; when
    /// absent, every field of the subject's latest schema).
    #[serde(default)]
    pub fields: Vec<FieldSection>,
    /// With `avro` and no `fields`: the subject's latest schema, as
    /// [`JobFile::resolve_schema`] fetched it.
    #[serde(skip)]
    pub registry_schema: Option<arrow_schema::SchemaRef>,
    /// With an Avro key: the latest schema of subject `<topic>-key`, as
    /// [`JobFile::resolve_schema`] fetched it.
    #[serde(skip)]
    pub registry_key_schema: Option<arrow_schema::SchemaRef>,
    /// `[source.event_time]`
    pub event_time: Option<EventTimeSection>,
    /// A larger record value is bad (`too_large`); default 8 MiB.
    pub max_record_bytes: Option<usize>,
    /// A JSON value nested deeper is bad (`too_deep`); default 64, at most
    /// 1024.
    pub max_nesting_depth: Option<usize>,
    /// Lossy conversions allowed: `fraction-to-integer`,
    /// `string-to-number`, `truncate-time` (default none: such a value is a
    /// bad record, `lossy_conversion`).
    #[serde(default)]
    pub coerce: Vec<String>,
}

/// One field of the source schema.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldSection {
    /// The JSON key and column name.
    pub name: String,
    /// `boolean`, `int`, `long`, `float`, `double`, `string`, `date`,
    /// `timestamp` or `timestamptz`.
    #[serde(rename = "type")]
    pub ty: String,
    /// A record without it (or with null) is bad (default false).
    #[serde(default)]
    pub required: bool,
}

/// `[source.registry]`: a Confluent-compatible schema registry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistrySection {
    /// `http://host:8081` or `https://...`.
    pub url: String,
    /// HTTP basic authentication (an API key and secret).
    pub username: Option<String>,
    pub password: Option<String>,
    /// A PEM file of CA certificates for an `https` registry.
    pub ca_location: Option<String>,
    /// How long one request may take (default `10s`).
    pub timeout: Option<String>,
    /// The subject whose latest schema makes the columns when `fields` is
    /// absent: `topic` (`<topic>-value`, the default), `record:<full
    /// name>` or `topic-record:<full name>`, as the producers'
    /// `subject.name.strategy`.
    pub subject: Option<String>,
    /// Protobuf: the message (full name) whose fields make the columns
    /// when `fields` is absent (default the schema's first message).
    pub message: Option<String>,
}

/// Bytes of a record (its value with `format = "raw"`, its key) as a
/// column: `{ column = "key", type = "string" }`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BytesColumn {
    /// The column's name (default `value` or `key`).
    pub column: Option<String>,
    /// `string` (UTF-8; other bytes make the record bad; the default) or
    /// `binary`.
    #[serde(rename = "type")]
    pub ty: Option<String>,
}

/// One `[[source.headers]]`: a record header kept as a column.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderSection {
    /// The header's name.
    pub name: String,
    /// The column's name (default: the header's, with each character other
    /// than a letter, digit or `_` made `_`).
    pub column: Option<String>,
    /// `string` (the default) or `binary`.
    #[serde(rename = "type")]
    pub ty: Option<String>,
}

/// `[source.event_time]`: where event time comes from.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventTimeSection {
    /// A `long` (ms since the epoch) or timestamp column of the source.
    pub column: Option<String>,
    /// Use the Kafka record timestamp instead.
    #[serde(default)]
    pub record_timestamp: bool,
    /// How late records may arrive (default `0s`).
    pub max_out_of_orderness: Option<String>,
    /// A partition quiet this long does not hold event time back (default
    /// `10s`; `off` to never call it idle).
    pub idle_timeout: Option<String>,
}

/// One `[[transforms]]` step: exactly one of its keys.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransformSection {
    /// Keep these columns, in this order.
    pub select: Option<Vec<String>>,
    /// Rename columns: `{ old = "new" }`.
    pub rename: Option<BTreeMap<String, String>>,
    /// Keep rows where `<column> <op> <literal>` holds (`op` one of `==`,
    /// `!=`, `<`, `<=`, `>`, `>=`), or `<column> is null` / `is not null`.
    pub filter: Option<String>,
    /// Add (or replace) a column computed from `<operand> <op> <operand>`.
    pub compute: Option<ComputeSection>,
}

/// A computed column.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeSection {
    /// The new column's name.
    pub column: String,
    /// `a + b`, `a - b`, `a * b`, `a / b` over columns and number literals,
    /// or a single column or literal.
    pub expr: String,
}

/// `[sink]`: an Iceberg table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkSection {
    /// `[sink.catalog]`
    pub catalog: CatalogSection,
    /// The table's namespace, dot-separated.
    pub namespace: String,
    /// The table's name.
    pub table: String,
    /// Creates the table from the transforms' output schema when missing
    /// (default true).
    #[serde(default = "yes")]
    pub create_if_missing: bool,
    /// The partition spec of a created table.
    #[serde(default)]
    pub partition: Vec<PartitionSection>,
    /// Identifies this job's commits in the table (default the job name).
    pub sink_id: Option<String>,
    /// Writer subtasks (default `job.parallelism`).
    pub parallelism: Option<usize>,
    /// Roll files at this many bytes (default 128 MiB); merged files are
    /// made near this size too.
    pub target_file_size: Option<u64>,
    /// How rows reach the writer subtasks: `hash` (default) by table
    /// partition, so each writer writes a share of the partitions; `none`
    /// as they come (round-robin).
    pub distribution: Option<String>,
    /// Bytes of rows a writer subtask may buffer in its open files
    /// (default 256 MiB); past it, it closes its largest files.
    pub max_writer_memory: Option<u64>,
    /// Files a writer subtask may hold open (default 256); past it, it
    /// closes the least recently used.
    pub max_open_files: Option<u64>,
    /// `zstd(LEVEL)` (default `zstd(1)`), `zstd` (level 3), `snappy` or `none`.
    pub compression: Option<String>,
    /// Rows that do not fit the table: `fail` (default) or `skip`.
    pub bad_records: Option<String>,
    /// When Avro records bring fields the table lacks: `ignore` (default:
    /// they are not read), `add-columns` (the table takes them as optional
    /// columns, and wider types) or `fail` (the job stops).
    pub schema_evolution: Option<String>,
    /// `[sink.commit]`
    #[serde(default)]
    pub commit: CommitSection,
    /// `[sink.maintenance]`
    #[serde(default)]
    pub maintenance: MaintenanceSection,
}

fn yes() -> bool {
    true
}

/// `[sink.catalog]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogSection {
    /// `sqlite` (catalog and warehouse in `dir`), `sql` (any SQL catalog
    /// URI, e.g. Postgres, with a `warehouse`) or `rest` (an Iceberg REST
    /// catalog server at `uri`).
    #[serde(rename = "type")]
    pub kind: String,
    /// `sqlite`: the directory holding `catalog.db` and `warehouse/`.
    pub dir: Option<String>,
    /// `sql`: `postgres://user:password@host/db` or `sqlite:<path>`;
    /// `rest`: the server's base URI, `http://host:8181`.
    pub uri: Option<String>,
    /// `sql`: where table data lives, `file:///...` or `s3://bucket/path`
    /// (with `s3.*` properties); `rest` (optional): the warehouse to ask
    /// the server for.
    pub warehouse: Option<String>,
    /// The catalog's name (default `tinyflow`); readers must use the same.
    pub name: Option<String>,
    /// Further catalog properties (for `rest`: `credential`, `token`,
    /// `prefix`, `header.<name>`; for S3 storage: `s3.endpoint`,
    /// `s3.region`, `s3.access-key-id`, `s3.secret-access-key`,
    /// `s3.path-style-access`).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

/// One partition field: `{ column = "auction", transform = "bucket[8]" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartitionSection {
    /// The source column.
    pub column: String,
    /// `identity`, `bucket[N]`, `truncate[W]`, `year`, `month`, `day` or
    /// `hour`.
    pub transform: String,
}

/// `[sink.commit]`: when the committer commits (default: at every
/// completed checkpoint).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitSection {
    /// Once this many completed checkpoints are uncommitted.
    pub every_checkpoints: Option<u32>,
    /// Once this long passed since the previous commit.
    pub interval: Option<String>,
    /// Once the uncommitted files hold this many bytes.
    pub max_pending_bytes: Option<u64>,
    /// Merge the small files of the checkpoints a commit takes, per
    /// partition, into files near `sink.target_file_size` before
    /// committing (default true).
    pub merge: Option<bool>,
    /// How long a commit waits for its merge (default `2m`); past it the
    /// merge is abandoned and the small files are committed.
    pub merge_timeout: Option<String>,
}

/// `[sink.maintenance]`: table upkeep, in the job (on unless `enabled =
/// false`) and by `tinyflow maintain`: snapshot expiry, the files only
/// expired snapshots referenced, old metadata files.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MaintenanceSection {
    /// Whether the job runs it (default true); `tinyflow maintain` runs
    /// the policy either way.
    pub enabled: Option<bool>,
    /// Expire snapshots older than this (default `1h`); `off`: none expire.
    pub expire_older_than: Option<String>,
    /// Snapshots kept whatever their age (default 10, at least 1).
    pub retain_last: Option<usize>,
    /// Previous metadata files kept, older ones deleted (default 20); `off`:
    /// metadata files are left alone.
    pub metadata_versions_max: Option<CountOrOff>,
    /// Between the starts of two rounds in the job (default `1m`).
    pub every: Option<String>,
}

/// A count, or the word `off`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum CountOrOff {
    /// A count.
    Count(usize),
    /// A word; only `off` is taken.
    Word(String),
}

/// `[checkpoint]`
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Between checkpoints (default `1s`); `off` turns checkpoints (and so
    /// commits) off.
    pub interval: Option<String>,
    /// Where checkpoints are kept (default `./tinyflow-checkpoints`): a
    /// local directory, or object storage (`s3://bucket/prefix`).
    pub dir: Option<String>,
    /// The object storage's settings when `dir` is on it (`s3.endpoint`,
    /// `s3.region`, `s3.access-key-id`, ...); default the sink catalog's
    /// `properties`.
    pub storage: Option<BTreeMap<String, String>>,
    /// Completed checkpoints kept (default 3).
    pub retained: Option<usize>,
    /// A checkpoint not complete after this long is abandoned (default `60s`).
    pub timeout: Option<String>,
    /// Failed checkpoints in a row tolerated before the job restarts
    /// (default the runtime's).
    pub tolerable_failures: Option<u32>,
}

/// `[restart]`
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestartSection {
    /// `exponential` (default), `fixed` or `none`.
    pub strategy: Option<String>,
    /// Restarts allowed in a row (default 5): an attempt that ran
    /// `reset_after` before it failed gives the whole budget back.
    pub max_attempts: Option<u32>,
    /// How long an attempt must run before its failure no longer counts
    /// against `max_attempts` (default `10m`).
    pub reset_after: Option<String>,
    /// `fixed`: pause before each restart (default `1s`).
    pub delay: Option<String>,
    /// `exponential`: first pause (default `500ms`).
    pub initial: Option<String>,
    /// `exponential`: longest pause (default `30s`).
    pub max: Option<String>,
    /// `exponential`: growth factor (default 2).
    pub multiplier: Option<f64>,
}

/// `[metrics]`
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSection {
    /// Serves Prometheus metrics at `http://<address>/metrics`, e.g.
    /// `127.0.0.1:9898` (default: no endpoint).
    pub address: Option<String>,
    /// How long `tinyflow run` keeps serving `/metrics` after the job ended
    /// by itself (a bounded job), so a scraper sees the final values
    /// (default `0s`). Needs `address`.
    pub linger: Option<String>,
}

impl JobFile {
    /// Parses a job file's text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<JobFile, JobFileError> {
        Self::parse_with(text, origin, &|name| std::env::var(name).ok())
    }

    /// [`JobFile::parse`] with `env` for the environment: string values may
    /// take `${NAME}`, `${NAME:-default}` (the default when `NAME` is unset
    /// or empty) and `${file:PATH}` (the file's content, without a trailing
    /// newline), so that secrets need not sit in the file; `$${` is a
    /// literal `${`. Every value read this way under a key that looks
    /// secret is registered with [`tinyflow_api::secrets`], so no output
    /// shows it.
    pub fn parse_with(
        text: &str,
        origin: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<JobFile, JobFileError> {
        let located = |e: toml::de::Error| {
            let Some(span) = e.span() else {
                return JobFileError::new(origin, e.message());
            };
            // The line the error points at, quoted: it names the key.
            let line = text[..span.start].matches('\n').count() + 1;
            let quoted = text.lines().nth(line - 1).unwrap_or("").trim();
            JobFileError::new(
                format!("{origin}:{line}"),
                format!("`{quoted}`: {}", e.message().trim()),
            )
        };
        // The structure first, so that errors name their line.
        let file: JobFile = toml::from_str(text).map_err(located)?;
        if !text.contains("${") {
            return Ok(file);
        }
        let mut value: toml::Value = toml::from_str(text).map_err(located)?;
        crate::substitute::substitute(&mut value, "", env)?;
        value
            .try_into()
            .map_err(|e: toml::de::Error| JobFileError::new(origin, e.message().trim()))
    }

    /// Reads and parses a job file.
    pub fn load(path: &Path) -> Result<JobFile, JobFileError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| JobFileError::new(&origin, format!("cannot read the job file: {e}")))?;
        JobFile::parse(&text, &origin)
    }
}
