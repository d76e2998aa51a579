//! What an Iceberg sink is configured with: the catalog, the table (and how
//! to create it), the writers' file settings and the commit cadence.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use tinyflow_api::{StreamError, StreamResult};

#[cfg(feature = "testing")]
use crate::fault::FaultHook;

/// Where the table's catalog lives.
#[derive(Clone)]
pub enum CatalogConfig {
    /// A SQL catalog (sqlite, the embedded default, or Postgres) over a
    /// warehouse location.
    Sql {
        /// The catalog's name. Readers must use the same name (it is a
        /// column of the catalog's tables).
        name: String,
        /// `sqlite:<path>?mode=rwc` or `postgres://user:password@host/db`.
        uri: String,
        /// Where table data lives, e.g. `file:///var/lib/tinyflow/warehouse`.
        warehouse: String,
        /// Further catalog properties, passed through.
        properties: HashMap<String, String>,
    },
    /// An Iceberg REST catalog server (Apache Polaris, Lakekeeper, Gravitino,
    /// a cloud's REST endpoint, Iceberg's own `RESTCatalogServer`).
    Rest {
        /// The catalog's name, as this process calls it (the server does not
        /// see it).
        name: String,
        /// The server's base URI, e.g. `http://localhost:8181`.
        uri: String,
        /// The warehouse to ask the server for, when it serves several; the
        /// server chooses table locations.
        warehouse: Option<String>,
        /// Further REST client properties, passed through: `prefix`,
        /// `credential` or `token` for OAuth2, `header.<name>` for headers.
        properties: HashMap<String, String>,
    },
    /// An in-memory catalog: tables vanish with the process (tests only).
    Memory {
        /// The catalog's name.
        name: String,
        /// Where table data lives.
        warehouse: String,
    },
}

impl CatalogConfig {
    /// A sqlite catalog in `dir/catalog.db` over the warehouse
    /// `dir/warehouse`, named `tinyflow`.
    pub fn sqlite(dir: &Path) -> Self {
        CatalogConfig::Sql {
            name: "tinyflow".to_owned(),
            uri: format!("sqlite:{}?mode=rwc", dir.join("catalog.db").display()),
            warehouse: format!("file://{}", dir.join("warehouse").display()),
            properties: HashMap::new(),
        }
    }

    /// The catalog's name.
    pub fn name(&self) -> &str {
        match self {
            CatalogConfig::Sql { name, .. }
            | CatalogConfig::Rest { name, .. }
            | CatalogConfig::Memory { name, .. } => name,
        }
    }

    /// The warehouse location or name, when this configuration gives one (a
    /// REST server may choose it).
    pub fn warehouse(&self) -> Option<&str> {
        match self {
            CatalogConfig::Sql { warehouse, .. } | CatalogConfig::Memory { warehouse, .. } => {
                Some(warehouse)
            }
            CatalogConfig::Rest { warehouse, .. } => warehouse.as_deref(),
        }
    }

    /// A description safe to log: a password in the URI is replaced.
    pub fn describe(&self) -> String {
        match self {
            CatalogConfig::Sql { name, uri, .. } => {
                format!("sql catalog {name} at {}", redact(uri))
            }
            CatalogConfig::Rest { name, uri, .. } => {
                format!("REST catalog {name} at {}", redact(uri))
            }
            CatalogConfig::Memory { name, .. } => format!("memory catalog {name}"),
        }
    }
}

impl fmt::Debug for CatalogConfig {
    // Never prints secrets: the URI's password and every property value
    // whose key looks like a credential are replaced.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CatalogConfig::Sql {
                name,
                uri,
                warehouse,
                properties,
            } => f
                .debug_struct("Sql")
                .field("name", name)
                .field("uri", &redact(uri))
                .field("warehouse", warehouse)
                .field("properties", &redact_properties(properties))
                .finish(),
            CatalogConfig::Rest {
                name,
                uri,
                warehouse,
                properties,
            } => f
                .debug_struct("Rest")
                .field("name", name)
                .field("uri", &redact(uri))
                .field("warehouse", warehouse)
                .field("properties", &redact_properties(properties))
                .finish(),
            CatalogConfig::Memory { name, warehouse } => f
                .debug_struct("Memory")
                .field("name", name)
                .field("warehouse", warehouse)
                .finish(),
        }
    }
}

/// Properties with every secret value replaced (the one rule of
/// [`tinyflow_api::secrets::is_secret_key`]).
fn redact_properties(properties: &HashMap<String, String>) -> HashMap<&str, &str> {
    properties
        .iter()
        .map(|(k, v)| (k.as_str(), tinyflow_api::secrets::shown(k, v)))
        .collect()
}

/// `scheme://user:password@host` -> `scheme://user:***@host`.
fn redact(uri: &str) -> String {
    let Some((scheme, rest)) = uri.split_once("://") else {
        return uri.to_owned();
    };
    let Some((auth, host)) = rest.split_once('@') else {
        return uri.to_owned();
    };
    match auth.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => uri.to_owned(),
    }
}

/// A column type of a declared table schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColumnType {
    /// `boolean`
    Boolean,
    /// `int` (32 bits)
    Int,
    /// `long` (64 bits)
    Long,
    /// `float` (32 bits)
    Float,
    /// `double` (64 bits)
    Double,
    /// `string` (UTF-8)
    String,
    /// `binary`
    Binary,
    /// `date` (days since 1970-01-01)
    Date,
    /// `timestamp` (microseconds, no time zone)
    Timestamp,
    /// `timestamptz` (microseconds, UTC)
    Timestamptz,
    /// `decimal(precision, scale)`
    Decimal {
        /// Digits in all.
        precision: u32,
        /// Digits after the point.
        scale: u32,
    },
    /// `struct<name: type, ...>`: named fields, in order; a field is
    /// optional unless `not null` follows its type.
    Struct(Vec<Column>),
    /// `list<type>`: elements are optional unless `list<type not null>`.
    List {
        /// The elements' type.
        element: Box<ColumnType>,
        /// Whether no element may be null.
        element_required: bool,
    },
    /// `map<key type, value type>`: keys are never null; values are
    /// optional unless `not null` follows their type.
    Map {
        /// The keys' type.
        key: Box<ColumnType>,
        /// The values' type.
        value: Box<ColumnType>,
        /// Whether no value may be null.
        value_required: bool,
    },
}

/// The primitive type names, for messages.
const TYPE_NAMES: &str = "boolean, int, long, float, double, string, binary, date, timestamp, \
                          timestamptz, decimal(P,S), struct<name: type, ...>, list<type>, map<key, value>";

impl FromStr for ColumnType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (ty, required) = parse_type(s)?;
        if required {
            return Err(format!(
                "`{s}`: `not null` belongs to a field, list element or map value inside a type"
            ));
        }
        Ok(ty)
    }
}

/// `type` or `type not null`.
fn parse_type(s: &str) -> Result<(ColumnType, bool), String> {
    let text = s.trim();
    let lower = text.to_ascii_lowercase();
    let (text, required) = match lower.strip_suffix("not null") {
        Some(rest) if rest.ends_with(char::is_whitespace) => (text[..rest.len()].trim(), true),
        _ => (text, false),
    };
    let lower = text.to_ascii_lowercase();
    let nested = |prefix: &str| -> Option<&str> {
        lower
            .starts_with(prefix)
            .then(|| text[prefix.len()..].trim_start())
            .and_then(|r| r.strip_prefix('<'))
            .and_then(|r| r.strip_suffix('>'))
    };
    let ty = if let Some(inner) = nested("struct") {
        let mut fields: Vec<Column> = Vec::new();
        for part in split_top_level(inner)? {
            let (name, ty) = part
                .split_once(':')
                .ok_or_else(|| format!("`{part}` in `{s}`: expected `name: type`"))?;
            let name = name.trim();
            if name.is_empty() {
                return Err(format!("`{part}` in `{s}`: a struct field needs a name"));
            }
            if fields.iter().any(|f| f.name == name) {
                return Err(format!("`{s}`: field `{name}` is declared twice"));
            }
            let (ty, required) = parse_type(ty)?;
            fields.push(Column {
                name: name.to_owned(),
                ty,
                required,
            });
        }
        if fields.is_empty() {
            return Err(format!("`{s}`: a struct needs at least one field"));
        }
        ColumnType::Struct(fields)
    } else if let Some(inner) = nested("list") {
        let (element, element_required) = parse_type(inner)?;
        ColumnType::List {
            element: Box::new(element),
            element_required,
        }
    } else if let Some(inner) = nested("map") {
        let parts = split_top_level(inner)?;
        let [key, value] = parts.as_slice() else {
            return Err(format!("`{s}`: expected map<key type, value type>"));
        };
        let (key, _) = parse_type(key)?;
        let (value, value_required) = parse_type(value)?;
        ColumnType::Map {
            key: Box::new(key),
            value: Box::new(value),
            value_required,
        }
    } else {
        primitive(text)?
    };
    Ok((ty, required))
}

/// `a, b<c, d>, e` -> [`a`, `b<c, d>`, `e`].
fn split_top_level(s: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '<' | '(' => depth += 1,
            '>' | ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
        if depth < 0 {
            return Err(format!("`{s}`: unbalanced `>`"));
        }
    }
    if depth != 0 {
        return Err(format!("`{s}`: unbalanced `<`"));
    }
    let last = s[start..].trim();
    if !last.is_empty() || !parts.is_empty() {
        parts.push(last);
    }
    if parts.iter().any(|p| p.is_empty()) {
        return Err(format!("`{s}`: an empty type between commas"));
    }
    Ok(parts)
}

fn primitive(s: &str) -> Result<ColumnType, String> {
    let t = s.trim().to_ascii_lowercase();
    Ok(match t.as_str() {
        "boolean" | "bool" => ColumnType::Boolean,
        "int" | "integer" => ColumnType::Int,
        "long" | "bigint" => ColumnType::Long,
        "float" => ColumnType::Float,
        "double" => ColumnType::Double,
        "string" => ColumnType::String,
        "binary" => ColumnType::Binary,
        "date" => ColumnType::Date,
        "timestamp" => ColumnType::Timestamp,
        "timestamptz" => ColumnType::Timestamptz,
        _ => {
            let inner = t
                .strip_prefix("decimal(")
                .and_then(|r| r.strip_suffix(')'))
                .ok_or_else(|| format!("unknown type `{s}`; expected one of {TYPE_NAMES}"))?;
            let (p, sc) = inner
                .split_once(',')
                .ok_or_else(|| format!("`{s}`: expected decimal(precision,scale)"))?;
            let precision: u32 = p
                .trim()
                .parse()
                .map_err(|_| format!("`{s}`: precision is not a number"))?;
            let scale: u32 = sc
                .trim()
                .parse()
                .map_err(|_| format!("`{s}`: scale is not a number"))?;
            if precision == 0 || precision > 38 || scale > precision {
                return Err(format!(
                    "`{s}`: expected 1 <= precision <= 38 and scale <= precision"
                ));
            }
            ColumnType::Decimal { precision, scale }
        }
    })
}

/// One column of a declared table schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Its name.
    pub name: String,
    /// Its type.
    pub ty: ColumnType,
    /// Whether every record must have a value.
    pub required: bool,
}

impl Column {
    /// A required column.
    pub fn required(name: &str, ty: ColumnType) -> Self {
        Column {
            name: name.to_owned(),
            ty,
            required: true,
        }
    }

    /// An optional (nullable) column.
    pub fn optional(name: &str, ty: ColumnType) -> Self {
        Column {
            name: name.to_owned(),
            ty,
            required: false,
        }
    }
}

/// One field of a partition spec: a column and a transform (`identity`,
/// `year`, `month`, `day`, `hour`, `bucket[N]`, `truncate[W]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionField {
    /// The source column.
    pub column: String,
    /// The transform, as Iceberg spells it.
    pub transform: String,
}

impl PartitionField {
    /// `column` partitioned by `transform`.
    pub fn new(column: &str, transform: &str) -> Self {
        PartitionField {
            column: column.to_owned(),
            transform: transform.to_owned(),
        }
    }
}

/// A declared table: its columns and partition spec. The sink creates the
/// table from it when missing, and checks an existing table against it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TableSpec {
    /// The columns, in order.
    pub columns: Vec<Column>,
    /// The partition spec (empty: unpartitioned).
    pub partition: Vec<PartitionField>,
}

/// Parquet compression of the data files.
///
/// The default is zstd at level 1: on Nexmark bids it writes files barely
/// larger than zstd's own default level 3, much faster
/// (`docs/performance.md`). `"zstd"` alone means level 3, as in zstd and
/// Iceberg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// None.
    None,
    /// Snappy.
    Snappy,
    /// Zstandard at a level (1..=22).
    Zstd(i32),
}

impl Default for Compression {
    fn default() -> Self {
        Compression::Zstd(1)
    }
}

impl Compression {
    /// The Parquet writer's setting.
    ///
    /// # Errors
    ///
    /// A zstd level outside 1..=22, with what was wrong.
    pub fn to_parquet(self) -> Result<parquet::basic::Compression, String> {
        Ok(match self {
            Compression::None => parquet::basic::Compression::UNCOMPRESSED,
            Compression::Snappy => parquet::basic::Compression::SNAPPY,
            Compression::Zstd(level) => parquet::basic::Compression::ZSTD(
                parquet::basic::ZstdLevel::try_new(level).map_err(|e| e.to_string())?,
            ),
        })
    }

    /// The table properties that tell other writers of a table this sink
    /// creates to compress as it does (`write.parquet.compression-*`).
    pub(crate) fn table_properties(self) -> Vec<(String, String)> {
        let codec = |c: &str| ("write.parquet.compression-codec".to_owned(), c.to_owned());
        match self {
            Compression::None => vec![codec("uncompressed")],
            Compression::Snappy => vec![codec("snappy")],
            Compression::Zstd(level) => vec![
                codec("zstd"),
                (
                    "write.parquet.compression-level".to_owned(),
                    level.to_string(),
                ),
            ],
        }
    }
}

impl FromStr for Compression {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "uncompressed" => Ok(Compression::None),
            "snappy" => Ok(Compression::Snappy),
            "zstd" => Ok(Compression::Zstd(3)),
            other => match other
                .strip_prefix("zstd(")
                .and_then(|r| r.strip_suffix(')'))
            {
                Some(level) => level
                    .parse()
                    .ok()
                    .filter(|l| (1..=22).contains(l))
                    .map(Compression::Zstd)
                    .ok_or_else(|| format!("`{s}`: zstd level must be 1..=22")),
                None => Err(format!(
                    "unknown compression `{s}`; expected none, snappy, zstd or zstd(LEVEL)"
                )),
            },
        }
    }
}

/// What the writers do with records that cannot be written to the table
/// (a null in a required column, a field the table does not have, a type
/// that does not fit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BadRecords {
    /// Fail the job, naming the field (the default).
    #[default]
    Fail,
    /// Drop them, count them (`tinyflow_iceberg_bad_records_total`) and log
    /// why; good records in the same batch are written.
    Skip,
}

impl FromStr for BadRecords {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "fail" => Ok(BadRecords::Fail),
            "skip" => Ok(BadRecords::Skip),
            _ => Err(format!(
                "unknown bad-record policy `{s}`; expected fail or skip"
            )),
        }
    }
}

/// How much earlier than its `interval` a commit may come (a tenth of the
/// interval when that is less): checkpoints complete an interval apart give
/// or take a few milliseconds, and one completing just short of the commit
/// interval would otherwise push the commit to the next checkpoint
/// (`interval = "1s"` at 1 s checkpoints committed every other one).
pub(crate) const INTERVAL_SLACK: Duration = Duration::from_millis(100);

/// When the committer commits. With no bound set it commits on every
/// completed checkpoint; otherwise when any bound is reached (checked at
/// each completed checkpoint). Exactly-once does not depend on it: files
/// not committed yet stay in checkpoint state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitCadence {
    /// Commit once this many completed checkpoints are uncommitted.
    pub every_checkpoints: Option<u32>,
    /// Commit once this long passed since the previous commit was decided,
    /// less 100 ms (a tenth of it when shorter): a checkpoint completing a
    /// little short of it still commits.
    pub interval: Option<Duration>,
    /// Commit once the uncommitted files hold this many bytes.
    pub max_pending_bytes: Option<u64>,
}

impl CommitCadence {
    /// Whether to commit now.
    /// Whether commits may take several checkpoints (a cadence other than
    /// every checkpoint): what makes merging before a commit worth it.
    pub(crate) fn holds_back(&self) -> bool {
        self.every_checkpoints.is_some_and(|n| n > 1)
            || self.interval.is_some()
            || self.max_pending_bytes.is_some()
    }

    /// Whether to commit now, `since_last` after the previous commit was
    /// decided.
    pub(crate) fn due(&self, uncommitted: u32, since_last: Duration, pending_bytes: u64) -> bool {
        if self.every_checkpoints.is_none()
            && self.interval.is_none()
            && self.max_pending_bytes.is_none()
        {
            return true;
        }
        self.every_checkpoints.is_some_and(|n| uncommitted >= n)
            || self
                .interval
                .is_some_and(|t| since_last + INTERVAL_SLACK.min(t / 10) >= t)
            || self.max_pending_bytes.is_some_and(|b| pending_bytes >= b)
    }
}

/// An Iceberg sink's configuration.
#[derive(Clone)]
pub struct IcebergSinkConfig {
    /// The catalog.
    pub catalog: CatalogConfig,
    /// The table's namespace (one or more levels).
    pub namespace: Vec<String>,
    /// The table's name.
    pub table: String,
    /// A stable name of this sink, unique among the sinks writing the table.
    /// Dedupe is keyed on it: change it and the sink forgets what it
    /// committed.
    pub sink_id: String,
    /// Create the table from this spec when missing, and check an existing
    /// table against it. `None`: the table must exist.
    pub table_spec: Option<TableSpec>,
    /// Data files roll at about this size (and at every checkpoint).
    pub target_file_size: usize,
    /// Parquet compression.
    pub compression: Compression,
    /// At most this many data files open per writer subtask (one per
    /// partition); the least recently used is closed when a new one opens,
    /// and files closed but not yet synced count too.
    pub max_open_writers: usize,
    /// What a writer subtask's open files may buffer, in bytes (their
    /// Parquet row groups in progress): past it, the writer closes its
    /// largest files until under it, instead of a file per batch.
    pub max_writer_memory: usize,
    /// How rows reach the writers: by table partition (the default), so
    /// that each writer owns a share of the partitions, or round-robin.
    pub distribution: crate::shuffle::Distribution,
    /// Rows per Parquet row group (bounds each open file's buffer).
    pub row_group_rows: usize,
    /// Records that cannot be written: fail or skip.
    pub bad_records: BadRecords,
    /// When to commit.
    pub cadence: CommitCadence,
    /// When a commit takes the files of several checkpoints (the cadence
    /// held some back), merge each partition's small files into files near
    /// `target_file_size` first (off the checkpoint path; a failed merge
    /// commits the small files as they are).
    pub merge_pending: bool,
    /// How long a commit waits for its merge; past it the merge is
    /// abandoned and the small files are committed.
    pub merge_timeout: Duration,
    /// Tries per commit when the catalog fails (unreachable, I/O), with
    /// backoff; after the last, the job fails with its data safe in the
    /// checkpoint. Conflicts are retried inside each try.
    pub commit_attempts: u32,
    /// First backoff between tries; doubles up to 30 s.
    pub retry_backoff: Duration,
    /// How long opening the catalog may take before it counts as
    /// unreachable.
    pub connect_timeout: Duration,
    /// On recovery, delete unreferenced data files of this sink older than
    /// this (orphans of checkpoints that never completed). `None`: never.
    pub orphan_min_age: Option<Duration>,
    /// Table maintenance in the job: after commits, every so often, expire
    /// snapshots and delete the files only they referenced and old metadata
    /// files (see [`crate::Maintenance`]; commit latency and the
    /// warehouse grow with the history otherwise). `None` (the default): the
    /// table's upkeep is left to the user (`IcebergSink::maintain`, `tinyflow
    /// maintain`). Dedupe does not need the history.
    pub maintenance: Option<crate::Maintenance>,
    /// Schema evolution is on: the declared columns need only not
    /// conflict with the table's (the table may lack some, or have wider
    /// types; the source evolves it), instead of fitting exactly.
    pub schema_evolution: bool,
    /// Fault injection on the commit path (tests; only with the crate's
    /// `testing` feature).
    #[cfg(feature = "testing")]
    pub fault_hook: Option<FaultHook>,
}

impl fmt::Debug for IcebergSinkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("IcebergSinkConfig");
        d.field("catalog", &self.catalog)
            .field("namespace", &self.namespace)
            .field("table", &self.table)
            .field("sink_id", &self.sink_id)
            .field("table_spec", &self.table_spec)
            .field("target_file_size", &self.target_file_size)
            .field("compression", &self.compression)
            .field("max_open_writers", &self.max_open_writers)
            .field("max_writer_memory", &self.max_writer_memory)
            .field("distribution", &self.distribution)
            .field("row_group_rows", &self.row_group_rows)
            .field("bad_records", &self.bad_records)
            .field("cadence", &self.cadence)
            .field("merge_pending", &self.merge_pending)
            .field("merge_timeout", &self.merge_timeout)
            .field("commit_attempts", &self.commit_attempts)
            .field("retry_backoff", &self.retry_backoff)
            .field("connect_timeout", &self.connect_timeout)
            .field("orphan_min_age", &self.orphan_min_age)
            .field("maintenance", &self.maintenance);
        #[cfg(feature = "testing")]
        d.field("fault_hook", &self.fault_hook.as_ref().map(|_| "set"));
        d.finish()
    }
}

impl IcebergSinkConfig {
    /// A sink `sink_id` into `namespace.table` of `catalog`, with defaults:
    /// 128 MiB files, zstd(1), rows distributed to the writers by table
    /// partition, up to 256 open files and 256 MiB of buffered rows per
    /// writer, 64k-row row groups,
    /// a commit per checkpoint, 5 tries from 200 ms, 15 s to open the
    /// catalog, orphans older than an hour deleted on recovery.
    pub fn new(catalog: CatalogConfig, namespace: &str, table: &str, sink_id: &str) -> Self {
        IcebergSinkConfig {
            catalog,
            namespace: namespace.split('.').map(str::to_owned).collect(),
            table: table.to_owned(),
            sink_id: sink_id.to_owned(),
            table_spec: None,
            target_file_size: 128 << 20,
            compression: Compression::default(),
            max_open_writers: 256,
            max_writer_memory: 256 << 20,
            distribution: crate::shuffle::Distribution::Hash,
            row_group_rows: 64 * 1024,
            bad_records: BadRecords::Fail,
            cadence: CommitCadence::default(),
            merge_pending: true,
            merge_timeout: Duration::from_secs(120),
            commit_attempts: 5,
            retry_backoff: Duration::from_millis(200),
            connect_timeout: Duration::from_secs(15),
            orphan_min_age: Some(Duration::from_secs(3600)),
            maintenance: None,
            schema_evolution: false,
            #[cfg(feature = "testing")]
            fault_hook: None,
        }
    }

    /// Creates the table from `spec` when missing.
    pub fn create_if_missing(mut self, spec: TableSpec) -> Self {
        self.table_spec = Some(spec);
        self
    }

    /// The table property holding this sink's last committed checkpoint id.
    pub fn committed_property(&self) -> String {
        crate::dedupe::committed_property(&self.sink_id)
    }

    /// The table property with the source positions of the last checkpoint
    /// this sink committed.
    pub fn positions_property(&self) -> String {
        crate::dedupe::positions_property(&self.sink_id)
    }

    /// The table property holding the epoch of the run that owns this
    /// sink (see `IcebergSink::claim`).
    pub fn epoch_property(&self) -> String {
        crate::dedupe::epoch_property(&self.sink_id)
    }

    /// The Parquet settings every data file of the sink is written with
    /// (the writers' and the merges'): its compression and row groups.
    pub(crate) fn writer_properties(
        &self,
    ) -> StreamResult<parquet::file::properties::WriterPropertiesBuilder> {
        let compression = self
            .compression
            .to_parquet()
            .map_err(|message| StreamError::Config {
                key: "sink.compression",
                message,
            })?;
        Ok(parquet::file::properties::WriterProperties::builder()
            .set_compression(compression)
            .set_max_row_group_row_count(Some(self.row_group_rows)))
    }

    /// Checks every setting; the error names the key.
    pub fn validate(&self) -> StreamResult<()> {
        let bad = |key: &'static str, message: String| Err(StreamError::Config { key, message });
        if self.sink_id.is_empty()
            || !self
                .sink_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return bad(
                "sink.sink_id",
                format!(
                    "{:?}: expected a non-empty name of letters, digits, `-`, `_` or `.`",
                    self.sink_id
                ),
            );
        }
        if self.table.is_empty() {
            return bad("sink.table", "must not be empty".to_owned());
        }
        if self.namespace.is_empty() || self.namespace.iter().any(String::is_empty) {
            return bad(
                "sink.namespace",
                format!(
                    "{:?}: expected one or more non-empty levels",
                    self.namespace
                ),
            );
        }
        if self.target_file_size < 1024 {
            return bad(
                "sink.target_file_size",
                format!("{} bytes: expected at least 1024", self.target_file_size),
            );
        }
        if self.max_open_writers == 0 {
            return bad("sink.max_open_files", "expected at least 1".to_owned());
        }
        if self.max_writer_memory < 1 << 20 {
            return bad(
                "sink.max_writer_memory",
                format!("{} bytes: expected at least 1 MiB", self.max_writer_memory),
            );
        }
        if self.row_group_rows == 0 {
            return bad("sink.row_group_rows", "expected at least 1".to_owned());
        }
        if self.commit_attempts == 0 {
            return bad("sink.commit_attempts", "expected at least 1".to_owned());
        }
        if let Some(m) = &self.maintenance {
            m.validate()?;
        }
        if self.cadence.every_checkpoints == Some(0) {
            return bad(
                "sink.commit.every_checkpoints",
                "expected at least 1".to_owned(),
            );
        }
        if let Some(spec) = &self.table_spec {
            if spec.columns.is_empty() {
                return bad("sink.schema", "declares no columns".to_owned());
            }
            let mut seen = std::collections::HashSet::new();
            for c in &spec.columns {
                if !seen.insert(c.name.as_str()) {
                    return bad("sink.schema", format!("column `{}` declared twice", c.name));
                }
            }
            for p in &spec.partition {
                if !seen.contains(p.column.as_str()) {
                    return bad(
                        "sink.partition",
                        format!("partition column `{}` is not a declared column", p.column),
                    );
                }
                if iceberg::spec::Transform::from_str(&p.transform).is_err() {
                    return bad(
                        "sink.partition",
                        format!(
                            "transform `{}` of `{}`: expected identity, year, month, day, hour, \
                             bucket[N] or truncate[W]",
                            p.transform, p.column
                        ),
                    );
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_parse_and_bad_types_name_the_choices() {
        assert_eq!("LONG".parse(), Ok(ColumnType::Long));
        assert_eq!(
            "decimal(10, 2)".parse(),
            Ok(ColumnType::Decimal {
                precision: 10,
                scale: 2
            })
        );
        let err = "varchar".parse::<ColumnType>().unwrap_err();
        assert!(
            err.contains("varchar") && err.contains("timestamptz"),
            "{err}"
        );
        assert!("decimal(3,4)".parse::<ColumnType>().is_err());
    }

    #[test]
    fn nested_types_parse_with_their_nullability() {
        let ty: ColumnType = "struct<name: string not null, items: list<struct<sku: string, qty: int not null>>, tags: map<string, decimal(10, 2) not null>>"
            .parse()
            .unwrap();
        let ColumnType::Struct(fields) = &ty else {
            panic!("{ty:?}");
        };
        assert_eq!(fields[0], Column::required("name", ColumnType::String));
        assert_eq!(
            fields[1],
            Column::optional(
                "items",
                ColumnType::List {
                    element: Box::new(ColumnType::Struct(vec![
                        Column::optional("sku", ColumnType::String),
                        Column::required("qty", ColumnType::Int),
                    ])),
                    element_required: false,
                }
            )
        );
        assert_eq!(
            fields[2],
            Column::optional(
                "tags",
                ColumnType::Map {
                    key: Box::new(ColumnType::String),
                    value: Box::new(ColumnType::Decimal {
                        precision: 10,
                        scale: 2
                    }),
                    value_required: true,
                }
            )
        );
        assert_eq!(
            "list<long not null>".parse(),
            Ok(ColumnType::List {
                element: Box::new(ColumnType::Long),
                element_required: true
            })
        );
        for (bad, says) in [
            ("struct<>", "at least one field"),
            ("struct<a long>", "expected `name: type`"),
            ("struct<a: long, a: int>", "declared twice"),
            ("list<long", "unknown type"),
            ("map<string>", "expected map<key type, value type>"),
            ("list<varchar>", "unknown type `varchar`"),
            ("long not null", "belongs to a field"),
            ("struct<a: list<long>>>", "unbalanced"),
        ] {
            let err = bad.parse::<ColumnType>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn passwords_never_reach_debug_output() {
        let mut properties = HashMap::new();
        properties.insert("s3.secret-access-key".to_owned(), "hunter2".to_owned());
        let c = CatalogConfig::Sql {
            name: "c".to_owned(),
            uri: "postgres://tf:hunter2@db:5432/cat".to_owned(),
            warehouse: "s3://b/w".to_owned(),
            properties,
        };
        let shown = format!("{c:?} {}", c.describe());
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("postgres://tf:***@db:5432/cat"), "{shown}");
        let rest = CatalogConfig::Rest {
            name: "r".to_owned(),
            uri: "https://polaris.example:8181/api/catalog".to_owned(),
            warehouse: None,
            properties: HashMap::from([("credential".to_owned(), "client:hunter2".to_owned())]),
        };
        let shown = format!("{rest:?} {}", rest.describe());
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(
            shown.contains("REST catalog r at https://polaris"),
            "{shown}"
        );
    }

    #[test]
    fn cadence_defaults_to_every_checkpoint_and_any_bound_triggers() {
        let every = CommitCadence::default();
        assert!(every.due(1, Duration::ZERO, 0));
        let c = CommitCadence {
            every_checkpoints: Some(3),
            interval: Some(Duration::from_secs(10)),
            max_pending_bytes: Some(1000),
        };
        assert!(!c.due(2, Duration::from_secs(9), 999));
        assert!(c.due(3, Duration::ZERO, 0));
        assert!(c.due(1, Duration::from_secs(10), 0));
        assert!(c.due(1, Duration::ZERO, 1000));
    }

    /// A checkpoint completing a little short of the interval commits; one
    /// completing well short does not.
    #[test]
    fn an_interval_is_reached_a_little_early() {
        let every = |t: u64| CommitCadence {
            interval: Some(Duration::from_millis(t)),
            ..CommitCadence::default()
        };
        let due = |c: &CommitCadence, since: u64| c.due(1, Duration::from_millis(since), 0);
        assert!(due(&every(1_000), 950));
        assert!(due(&every(1_000), 900));
        assert!(!due(&every(1_000), 850));
        assert!(due(&every(60_000), 59_950));
        assert!(!due(&every(60_000), 59_800));
        // A tenth of a short interval.
        assert!(due(&every(200), 185));
        assert!(!due(&every(200), 170));
    }

    #[test]
    fn validation_names_the_key() {
        let mut c = IcebergSinkConfig::new(
            CatalogConfig::sqlite(Path::new("/tmp/x")),
            "db",
            "t",
            "bad id",
        );
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("sink.sink_id"), "{err}");
        c.sink_id = "ok".to_owned();
        c = c.create_if_missing(TableSpec {
            columns: vec![Column::required("id", ColumnType::Long)],
            partition: vec![PartitionField::new("id", "bucket[x]")],
        });
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("sink.partition") && err.contains("bucket[x]"),
            "{err}"
        );
    }
}
