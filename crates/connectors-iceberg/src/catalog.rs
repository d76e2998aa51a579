//! Opening the catalog, finding or creating the table, reading what a sink
//! committed, and the catalog wrapper that runs the "already committed?"
//! check inside every commit attempt.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use iceberg::io::{FileIO, FileIOBuilder, StorageFactory};
use iceberg::spec::{
    ListType, MapType, NestedField, PrimitiveType, Schema, StructType, Transform, Type,
    UnboundPartitionSpec,
};
use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use iceberg::{
    Catalog, CatalogBuilder, ErrorKind, Namespace, NamespaceIdent, TableCommit, TableCreation,
    TableIdent,
};
use iceberg_catalog_rest::{
    REST_CATALOG_PROP_URI, REST_CATALOG_PROP_WAREHOUSE, RestCatalogBuilder,
};
use iceberg_catalog_sql::{SqlBindStyle, SqlCatalogBuilder};
use iceberg_storage_opendal::OpenDalResolvingStorageFactory;
use tinyflow_api::{CheckpointId, JobPositions, StreamError, StreamResult};
use tokio::sync::OnceCell;

use crate::local_storage::{PendingSyncs, SyncedLocalStorageFactory};

use crate::config::{
    CatalogConfig, Column, ColumnType, CommitStep, Fault, FaultHook, IcebergSinkConfig, TableSpec,
};

/// Snapshot summary key: the sink that committed the snapshot.
pub const SUMMARY_SINK_ID: &str = "tinyflow.sink-id";
/// Snapshot summary key: the checkpoint id the snapshot commits up to.
pub const SUMMARY_CHECKPOINT_ID: &str = "tinyflow.checkpoint-id";
/// Snapshot summary key: the event-time watermark (ms since the epoch) the
/// committed data is complete up to.
pub const SUMMARY_WATERMARK: &str = "tinyflow.watermark";
/// Snapshot summary key: where the job's sources stood at the committed
/// checkpoint, as JSON: `{"<source>": {"<topic>/<partition>": "<next
/// offset>", ...}, ...}` for Kafka sources. The committed data holds every
/// record before these positions (and none after, for this sink).
pub const SUMMARY_SOURCE_POSITIONS: &str = "tinyflow.source-positions";
/// Snapshot summary key: the epoch of the run that made the snapshot (its
/// claim, or a commit of its data).
pub const SUMMARY_EPOCH: &str = "tinyflow.epoch";
/// Snapshot summary key of an epoch claim: the sink that claimed. A claim's
/// snapshot adds no files.
pub const SUMMARY_EPOCH_CLAIM: &str = "tinyflow.epoch-claim";

/// The table property holding the epoch of the run that owns `sink_id`.
pub fn epoch_property(sink_id: &str) -> String {
    format!("tinyflow.sink.{sink_id}.epoch")
}

/// The table property saying which process claimed `sink_id`'s epoch, and
/// when (`pid N on HOST at UNIX-SECONDS`).
pub fn epoch_owner_property(sink_id: &str) -> String {
    format!("tinyflow.sink.{sink_id}.epoch-owner")
}

/// The epoch of the run that owns `sink_id` in `table` (0: never claimed).
pub fn table_epoch(table: &Table, sink_id: &str) -> u64 {
    table
        .metadata()
        .properties()
        .get(&epoch_property(sink_id))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Who claimed the epoch of `sink_id` in `table`, if anyone.
pub fn epoch_owner(table: &Table, sink_id: &str) -> Option<String> {
    table
        .metadata()
        .properties()
        .get(&epoch_owner_property(sink_id))
        .cloned()
}

pub(crate) fn external(
    operator: &str,
    action: impl Into<String>,
    e: &iceberg::Error,
) -> StreamError {
    StreamError::External {
        operator: operator.to_owned(),
        system: "iceberg",
        action: action.into(),
        message: e.to_string(),
        retryable: e.retryable(),
    }
}

/// Opens the configured catalog; no answer within `timeout` counts as
/// unreachable (retryable).
pub async fn open_catalog(
    config: &CatalogConfig,
    timeout: std::time::Duration,
) -> StreamResult<Arc<dyn Catalog>> {
    match tokio::time::timeout(timeout, open(config)).await {
        Ok(opened) => opened,
        Err(_) => Err(StreamError::External {
            operator: "iceberg".to_owned(),
            system: "iceberg",
            action: format!("opening the {}", config.describe()),
            message: format!("no answer within {timeout:?}"),
            retryable: true,
        }),
    }
}

/// Whether `location` is on S3 (`s3://`, or Hadoop's `s3a://` and `s3n://`
/// spellings), where the sink reads, writes and cleans up through OpenDAL.
pub fn is_s3_location(location: &str) -> bool {
    ["s3://", "s3a://", "s3n://"]
        .iter()
        .any(|scheme| location.starts_with(scheme))
}

/// How the catalog's tables read and write files: for a `file://` warehouse
/// (the default, and the fastest) local files written off the runtime's
/// workers and synced ([`SyncedLocalStorage`](crate::local_storage::SyncedLocalStorage)), else
/// OpenDAL's, which picks S3 or local files by each path's scheme and takes
/// the `s3.*` catalog properties (endpoint, region, keys; without keys, the
/// usual AWS environment variables and profiles).
fn storage_factory(config: &CatalogConfig) -> Arc<dyn StorageFactory> {
    match config.warehouse() {
        Some(w) if is_local_warehouse(w) => Arc::new(SyncedLocalStorageFactory::default()),
        _ => Arc::new(OpenDalResolvingStorageFactory::new()),
    }
}

fn is_local_warehouse(warehouse: &str) -> bool {
    warehouse.starts_with("file:") || warehouse.starts_with('/')
}

async fn open(config: &CatalogConfig) -> StreamResult<Arc<dyn Catalog>> {
    // Output scrubbed with `secrets::scrub` never shows these, even where a
    // catalog client quotes its URI or a property back.
    match config {
        CatalogConfig::Sql {
            uri, properties, ..
        }
        | CatalogConfig::Rest {
            uri, properties, ..
        } => {
            tinyflow_api::secrets::register_settings(
                properties
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .chain([("uri", uri.as_str())]),
            );
        }
        CatalogConfig::Memory { .. } => {}
    }
    let storage = storage_factory(config);
    if let Some(dir) = config.warehouse().and_then(|w| w.strip_prefix("file://")) {
        std::fs::create_dir_all(dir).map_err(|source| StreamError::Io {
            action: "creating the warehouse directory",
            path: dir.into(),
            source,
        })?;
    }
    let opened: iceberg::Result<Arc<dyn Catalog>> = match config {
        CatalogConfig::Sql {
            name,
            uri,
            warehouse,
            properties,
        } => {
            if let Some(path) = uri.strip_prefix("sqlite:") {
                let file = path.split('?').next().unwrap_or(path);
                if let Some(parent) = std::path::Path::new(file).parent()
                    && !parent.as_os_str().is_empty()
                {
                    std::fs::create_dir_all(parent).map_err(|source| StreamError::Io {
                        action: "creating the catalog directory",
                        path: parent.into(),
                        source,
                    })?;
                }
            }
            let bind = if uri.starts_with("sqlite:") {
                SqlBindStyle::QMark
            } else {
                SqlBindStyle::DollarNumeric
            };
            SqlCatalogBuilder::default()
                .uri(uri.clone())
                .warehouse_location(warehouse.clone())
                .sql_bind_style(bind)
                .props(properties.clone())
                .with_storage_factory(storage)
                .load(name.clone(), HashMap::new())
                .await
                .map(|c| Arc::new(c) as Arc<dyn Catalog>)
        }
        CatalogConfig::Rest {
            name,
            uri,
            warehouse,
            properties,
        } => {
            let mut props = properties.clone();
            props.insert(REST_CATALOG_PROP_URI.to_owned(), uri.clone());
            if let Some(warehouse) = warehouse {
                props.insert(REST_CATALOG_PROP_WAREHOUSE.to_owned(), warehouse.clone());
            }
            let catalog = RestCatalogBuilder::default()
                .with_storage_factory(storage)
                .load(name.clone(), props)
                .await;
            // The builder only checks its arguments; a first request shows
            // whether the server answers, so an unreachable catalog fails at
            // start rather than at the first commit.
            match catalog {
                Ok(catalog) => catalog
                    .list_namespaces(None)
                    .await
                    .map(|_| Arc::new(catalog) as Arc<dyn Catalog>),
                Err(e) => Err(e),
            }
        }
        CatalogConfig::Memory { name, warehouse } => {
            iceberg::memory::MemoryCatalogBuilder::default()
                .with_storage_factory(storage)
                .load(
                    name.clone(),
                    HashMap::from([(
                        iceberg::memory::MEMORY_CATALOG_WAREHOUSE.to_owned(),
                        warehouse.clone(),
                    )]),
                )
                .await
                .map(|c| Arc::new(c) as Arc<dyn Catalog>)
        }
    };
    opened.map_err(|e| StreamError::External {
        operator: "iceberg".to_owned(),
        system: "iceberg",
        action: format!("opening the {}", config.describe()),
        message: e.to_string(),
        retryable: true,
    })
}

/// A sink's catalog, opened once and shared by its writers and committer,
/// and its table, created once when missing.
pub(crate) struct SinkTable {
    pub(crate) config: IcebergSinkConfig,
    pub(crate) ident: TableIdent,
    catalog: OnceCell<Arc<dyn Catalog>>,
    /// The table's uuid once found or created (and whether this process
    /// created it).
    ensured: OnceCell<(uuid::Uuid, bool)>,
    /// This run's claim of the sink (one per `SinkTable`, that is per run).
    claimed: OnceCell<Claim>,
    /// Data files the writers closed whose syncs the committer has not yet
    /// waited for (local warehouses only).
    pub(crate) syncs: Arc<PendingSyncs>,
    /// The ids (the uuid in their file names) of this process's writers of
    /// the sink that are gone: their unreferenced files are orphans
    /// whatever their age (see `orphans::delete_orphans`).
    retired: Mutex<HashSet<String>>,
}

impl SinkTable {
    pub(crate) fn new(config: IcebergSinkConfig) -> StreamResult<Self> {
        config.validate()?;
        let ns = NamespaceIdent::from_vec(config.namespace.clone()).map_err(|e| {
            StreamError::Config {
                key: "sink.namespace",
                message: e.to_string(),
            }
        })?;
        let ident = TableIdent::new(ns, config.table.clone());
        Ok(SinkTable {
            config,
            ident,
            catalog: OnceCell::new(),
            ensured: OnceCell::new(),
            claimed: OnceCell::new(),
            syncs: Arc::default(),
            retired: Mutex::default(),
        })
    }

    fn retired_lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        // A panic elsewhere while holding the lock leaves a usable set.
        self.retired
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes that the writer with this id is gone (dropped: its task ended
    /// or was aborted with its attempt).
    pub(crate) fn retire_writer(&self, id: String) {
        self.retired_lock().insert(id);
    }

    /// The ids of the writers that are gone.
    pub(crate) fn retired_writers(&self) -> HashSet<String> {
        self.retired_lock().clone()
    }

    /// Forgets retired writers whose files have all been dealt with.
    pub(crate) fn forget_writers(&self, ids: &HashSet<String>) {
        self.retired_lock().retain(|id| !ids.contains(id));
    }

    /// The storage the writers write data files through: for a local
    /// warehouse, one whose syncs go to [`Self::syncs`] for the committer
    /// to wait for; else the table's own.
    pub(crate) fn writer_file_io(&self, table: &FileIO) -> FileIO {
        match self.config.catalog.warehouse() {
            Some(w) if is_local_warehouse(w) => {
                FileIOBuilder::new(Arc::new(SyncedLocalStorageFactory {
                    defer: Some(Arc::clone(&self.syncs)),
                }))
                .with_props(table.config().props().clone())
                .build()
            }
            _ => table.clone(),
        }
    }

    pub(crate) fn label(&self) -> String {
        format!(
            "iceberg sink {} ({})",
            self.config.sink_id,
            self.table_name()
        )
    }

    pub(crate) fn table_name(&self) -> String {
        format!(
            "{}.{}",
            self.ident.namespace().to_url_string(),
            self.ident.name()
        )
    }

    pub(crate) async fn catalog(&self) -> StreamResult<&Arc<dyn Catalog>> {
        self.catalog
            .get_or_try_init(|| open_catalog(&self.config.catalog, self.config.connect_timeout))
            .await
    }

    /// The table as the catalog has it now; created on first use when
    /// missing and a spec is declared, and checked against the spec.
    pub(crate) async fn load(&self) -> StreamResult<Table> {
        let catalog = self.catalog().await?;
        let (uuid, _) = *self
            .ensured
            .get_or_try_init(|| async {
                let (table, created) =
                    ensure_table(catalog.as_ref(), &self.ident, &self.config).await?;
                if let Some(spec) = &self.config.table_spec {
                    let schema = table.metadata().current_schema();
                    if self.config.schema_evolution {
                        // What evolution mends (a column the table lacks, a
                        // type it can widen) is mended on the first evolve.
                        if let Some(m) = crate::evolve::conflicts(schema, &spec.columns) {
                            return Err(StreamError::Config {
                                key: "sink.schema",
                                message: format!("table {}: {m}", self.table_name()),
                            });
                        }
                    } else {
                        check_fits(spec, schema, &self.table_name())?;
                    }
                }
                Ok::<_, StreamError>((table.metadata().uuid(), created))
            })
            .await?;
        match catalog.load_table(&self.ident).await {
            Ok(table) => Ok(table),
            // Found or created at start, gone now: not something a retry
            // mends, and not something to create again behind the job's back.
            Err(e) if e.kind() == ErrorKind::TableNotFound => Err(StreamError::StateMismatch {
                operator: self.label(),
                target: format!("table {}", self.table_name()),
                message: format!(
                    "the table (uuid {uuid}) was dropped while the job ran: {e}; a new run creates it again (when its schema is declared) and refuses the checkpoints written for the old one"
                ),
            }),
            Err(e) => Err(external(&self.label(), "loading the table", &e)),
        }
    }

    /// Whether this process created the table (it was missing at start).
    pub(crate) fn created_here(&self) -> bool {
        self.ensured.get().is_some_and(|(_, created)| *created)
    }

    /// This run's claim of the sink, made on first use: a commit that
    /// raises the table's `tinyflow.sink.<id>.epoch` and adds a snapshot
    /// without files (so that any commit built on the table before it
    /// conflicts: a property alone would not move the branch, and Iceberg
    /// has no requirement on properties). From then on, commits of older
    /// runs of the sink are refused inside their commit attempts.
    pub(crate) async fn claim(&self) -> StreamResult<&Claim> {
        self.claimed.get_or_try_init(|| self.claim_epoch()).await
    }

    async fn claim_epoch(&self) -> StreamResult<Claim> {
        let label = self.label();
        let sink = &self.config.sink_id;
        // Two runs claiming at once: the loser sees the winner's epoch on
        // its refresh and claims above it (the newest claim wins).
        for _ in 0..10 {
            let table = self.load().await?;
            let current = table_epoch(&table, sink);
            let mine = current + 1;
            let uuid = table.metadata().uuid().to_string();
            let at = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let owner = format!("{} at {at}", tinyflow_api::util::this_process());
            let tx = Transaction::new(&table);
            let append = tx.fast_append().set_snapshot_properties(HashMap::from([
                (SUMMARY_EPOCH_CLAIM.to_owned(), sink.clone()),
                (SUMMARY_EPOCH.to_owned(), mine.to_string()),
            ]));
            let tx = append
                .apply(tx)
                .map_err(|e| external(&label, "building the epoch claim", &e))?;
            let tx = tx
                .update_table_properties()
                .set(epoch_property(sink), mine.to_string())
                .set(epoch_owner_property(sink), owner.clone())
                .apply(tx)
                .map_err(|e| external(&label, "building the epoch claim", &e))?;
            let catalog = self.catalog().await?;
            let guard = GuardedCatalog::new(catalog.as_ref(), sink, None, None).expecting(Expect {
                uuid: uuid.clone(),
                epoch: current,
            });
            match tx.commit(&guard).await {
                Ok(_) => {
                    tracing::info!(sink = %label, epoch = mine, previous = current, %owner, "claimed the sink: commits of older runs are refused from now on");
                    return Ok(Claim { epoch: mine, uuid });
                }
                Err(e) => match guard.observed() {
                    Some(Observed::Fenced { .. }) => {
                        tracing::info!(sink = %label, epoch = mine, "another run claimed the sink at the same time; claiming above it");
                    }
                    Some(Observed::Replaced(found)) => {
                        return Err(StreamError::StateMismatch {
                            operator: label,
                            target: format!("table {}", self.table_name()),
                            message: format!(
                                "the table was replaced while this run claimed it (uuid {uuid}, now {found})"
                            ),
                        });
                    }
                    _ => return Err(external(&label, "claiming the sink's epoch", &e)),
                },
            }
        }
        Err(StreamError::External {
            operator: label,
            system: "iceberg",
            action: "claiming the sink's epoch".to_owned(),
            message: "other runs claimed it ten times in a row while this one tried".to_owned(),
            retryable: true,
        })
    }

    /// The highest checkpoint id this sink committed to the table.
    pub(crate) async fn committed(&self) -> StreamResult<Option<CheckpointId>> {
        let table = self.load().await?;
        Ok(committed_id(&table, &self.config.sink_id).map(CheckpointId::new))
    }

    /// The source positions of the last checkpoint this sink committed.
    pub(crate) async fn committed_positions(&self) -> StreamResult<Option<JobPositions>> {
        let table = self.load().await?;
        committed_positions(&table, &self.config.sink_id)
    }
}

/// Opens `catalog` and loads the table `namespace.table` (namespace levels
/// separated by dots), for tools and tests that read a table tinyflow
/// writes once. To read it again and again, open a [`TableReader`].
pub async fn load_table(
    catalog: &CatalogConfig,
    namespace: &str,
    table: &str,
) -> StreamResult<Table> {
    TableReader::open(catalog, namespace, table)
        .await?
        .load()
        .await
}

/// A table read again and again (a tool polling for commits): the catalog
/// is opened once, and each [`TableReader::load`] reads the table's current
/// metadata through it.
pub struct TableReader {
    catalog: Arc<dyn Catalog>,
    ident: TableIdent,
    /// `namespace.table from the <catalog>`, for errors.
    label: String,
}

impl std::fmt::Debug for TableReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableReader")
            .field("table", &self.label)
            .finish_non_exhaustive()
    }
}

impl TableReader {
    /// Opens `catalog` for the table `namespace.table` (namespace levels
    /// separated by dots); the table need not exist yet.
    pub async fn open(catalog: &CatalogConfig, namespace: &str, table: &str) -> StreamResult<Self> {
        let c = open_catalog(catalog, std::time::Duration::from_secs(10)).await?;
        let ident = NamespaceIdent::from_strs(namespace.split('.'))
            .map(|ns| TableIdent::new(ns, table.to_owned()))
            .map_err(|e| external("iceberg", format!("naming {namespace}.{table}"), &e))?;
        Ok(TableReader {
            catalog: c,
            ident,
            label: format!("{namespace}.{table} from the {}", catalog.describe()),
        })
    }

    /// The table as the catalog has it now.
    pub async fn load(&self) -> StreamResult<Table> {
        self.catalog
            .load_table(&self.ident)
            .await
            .map_err(|e| external("iceberg", format!("loading {}", self.label), &e))
    }
}

/// Rows in the table's current snapshot: its summary's `total-records`
/// (0 before the first snapshot).
pub fn total_records(table: &Table) -> u64 {
    table
        .metadata()
        .current_snapshot()
        .and_then(|s| s.summary().additional_properties.get("total-records"))
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

/// The table property holding `sink_id`'s last committed checkpoint id.
pub fn committed_property(sink_id: &str) -> String {
    format!("tinyflow.sink.{sink_id}.checkpoint-id")
}

/// Every non-null value of the `long` column `column`, read through
/// iceberg-rust's scan of the current snapshot, or of snapshot `snapshot_id`
/// (in file order; empty before the first commit). For tools and tests that
/// check what a table holds.
pub async fn scan_longs(
    table: &Table,
    column: &str,
    snapshot_id: Option<i64>,
) -> StreamResult<Vec<i64>> {
    use futures_util::TryStreamExt;
    let label = format!("{}", table.identifier());
    if snapshot_id.is_none() && table.metadata().current_snapshot().is_none() {
        return Ok(Vec::new());
    }
    let mut scan = table.scan().select([column]);
    if let Some(id) = snapshot_id {
        scan = scan.snapshot_id(id);
    }
    let what = format!("scanning column {column}");
    let batches: Vec<arrow_array::RecordBatch> = scan
        .build()
        .map_err(|e| external(&label, what.clone(), &e))?
        .to_arrow()
        .await
        .map_err(|e| external(&label, what.clone(), &e))?
        .try_collect()
        .await
        .map_err(|e| external(&label, what.clone(), &e))?;
    let mut values = Vec::new();
    for b in &batches {
        let longs = b
            .column(0)
            .as_any()
            .downcast_ref::<arrow_array::Int64Array>()
            .ok_or_else(|| StreamError::External {
                operator: label.clone(),
                system: "iceberg",
                action: what.clone(),
                message: format!("the column is {}, not long", b.column(0).data_type()),
                retryable: false,
            })?;
        values.extend(longs.iter().flatten());
    }
    Ok(values)
}

/// The table property holding the source positions (JSON, as in
/// [`SUMMARY_SOURCE_POSITIONS`]) of the last checkpoint `sink_id`
/// committed; set in the same transaction as [`committed_property`], so it
/// survives snapshot expiry too.
pub fn positions_property(sink_id: &str) -> String {
    format!("tinyflow.sink.{sink_id}.source-positions")
}

/// The source positions of the last checkpoint `sink_id` committed to
/// `table` (from [`positions_property`]); `None` when the sink committed
/// none with positions.
pub fn committed_positions(table: &Table, sink_id: &str) -> StreamResult<Option<JobPositions>> {
    let key = positions_property(sink_id);
    let Some(json) = table.metadata().properties().get(&key) else {
        return Ok(None);
    };
    serde_json::from_str(json)
        .map(Some)
        .map_err(|e| StreamError::External {
            operator: sink_id.to_owned(),
            system: "iceberg",
            action: format!("reading the table property {key}"),
            message: format!("not the JSON of source positions ({e}): {json}"),
            retryable: false,
        })
}

/// What `table` holds of the checkpoints `low..=high` of `sink_id`: all
/// of them, some of them, or none (`None`).
pub(crate) fn observe(table: &Table, sink_id: &str, low: u64, high: u64) -> Option<Observed> {
    match committed_id(table, sink_id) {
        Some(c) if c >= high => Some(Observed::AlreadyCommitted(c)),
        Some(c) if c >= low => Some(Observed::Partly(c)),
        _ => None,
    }
}

/// The highest checkpoint id `sink_id` committed to `table`: the larger of
/// the table property (which survives snapshot expiry) and the newest
/// snapshot of the sink in the current branch's history.
pub fn committed_id(table: &Table, sink_id: &str) -> Option<u64> {
    let metadata = table.metadata();
    let from_property = metadata
        .properties()
        .get(&committed_property(sink_id))
        .and_then(|v| v.parse::<u64>().ok());
    let from_history = newest_sink_snapshot(table, sink_id).and_then(|(_, checkpoint)| checkpoint);
    from_property.max(from_history)
}

/// The newest snapshot `sink_id` committed in the current branch's history
/// (`None` when expired or never made): its id and the checkpoint id its
/// summary names.
pub(crate) fn newest_sink_snapshot(table: &Table, sink_id: &str) -> Option<(i64, Option<u64>)> {
    let metadata = table.metadata();
    let mut next = metadata.current_snapshot().cloned();
    while let Some(snapshot) = next {
        let props = &snapshot.summary().additional_properties;
        if props.get(SUMMARY_SINK_ID).map(String::as_str) == Some(sink_id) {
            let checkpoint = props
                .get(SUMMARY_CHECKPOINT_ID)
                .and_then(|v| v.parse::<u64>().ok());
            return Some((snapshot.snapshot_id(), checkpoint));
        }
        next = snapshot
            .parent_snapshot_id()
            .and_then(|id| metadata.snapshot_by_id(id).cloned());
    }
    None
}

/// The Iceberg type of `ty`; fields inside it take ids from `next_id` on.
pub(crate) fn iceberg_type(ty: &ColumnType, next_id: &mut i32) -> Type {
    let mut id = || {
        let id = *next_id;
        *next_id += 1;
        id
    };
    Type::Primitive(match ty {
        ColumnType::Boolean => PrimitiveType::Boolean,
        ColumnType::Int => PrimitiveType::Int,
        ColumnType::Long => PrimitiveType::Long,
        ColumnType::Float => PrimitiveType::Float,
        ColumnType::Double => PrimitiveType::Double,
        ColumnType::String => PrimitiveType::String,
        ColumnType::Binary => PrimitiveType::Binary,
        ColumnType::Date => PrimitiveType::Date,
        ColumnType::Timestamp => PrimitiveType::Timestamp,
        ColumnType::Timestamptz => PrimitiveType::Timestamptz,
        ColumnType::Decimal { precision, scale } => PrimitiveType::Decimal {
            precision: *precision,
            scale: *scale,
        },
        ColumnType::Struct(fields) => {
            // As Iceberg's Java assigns fresh ids: a struct's own fields
            // first, then what is nested in them.
            let ids: Vec<i32> = fields.iter().map(|_| id()).collect();
            let fields = fields
                .iter()
                .zip(ids)
                .map(|(c, id)| Arc::new(field(id, c, next_id)))
                .collect();
            return Type::Struct(StructType::new(fields));
        }
        ColumnType::List {
            element,
            element_required,
        } => {
            let element_id = id();
            let element = iceberg_type(element, next_id);
            return Type::List(ListType::new(Arc::new(NestedField::list_element(
                element_id,
                element,
                *element_required,
            ))));
        }
        ColumnType::Map {
            key,
            value,
            value_required,
        } => {
            let (key_id, value_id) = (id(), id());
            let key = iceberg_type(key, next_id);
            let value = iceberg_type(value, next_id);
            return Type::Map(MapType::new(
                Arc::new(NestedField::map_key_element(key_id, key)),
                Arc::new(NestedField::map_value_element(
                    value_id,
                    value,
                    *value_required,
                )),
            ));
        }
    })
}

/// The field `id` for column `c`; fields nested in it take ids from
/// `next_id` on.
fn field(id: i32, c: &Column, next_id: &mut i32) -> NestedField {
    let ty = iceberg_type(&c.ty, next_id);
    if c.required {
        NestedField::required(id, &c.name, ty)
    } else {
        NestedField::optional(id, &c.name, ty)
    }
}

/// The Iceberg schema of a declared table: top-level field ids from 1,
/// then the nested fields' ids.
pub fn iceberg_schema(spec: &TableSpec) -> StreamResult<Schema> {
    let mut next_id = spec.columns.len() as i32 + 1;
    let fields: Vec<_> = spec
        .columns
        .iter()
        .enumerate()
        .map(|(i, c)| Arc::new(field(i as i32 + 1, c, &mut next_id)))
        .collect();
    Schema::builder()
        .with_schema_id(0)
        .with_fields(fields)
        .build()
        .map_err(|e| StreamError::Config {
            key: "sink.schema",
            message: e.to_string(),
        })
}

/// Why a column declared `declared` does not fit the table's `actual`
/// type (ids aside), if it does not.
fn misfit(declared: &ColumnType, actual: &Type) -> Option<String> {
    match (declared, actual) {
        (ColumnType::Struct(fields), Type::Struct(s)) => {
            let names: Vec<&str> = fields.iter().map(|f| f.name.as_str()).collect();
            let theirs: Vec<&str> = s.fields().iter().map(|f| f.name.as_str()).collect();
            if names != theirs {
                return Some(format!(
                    "declared fields {names:?}, the table's struct has {theirs:?}"
                ));
            }
            fields.iter().zip(s.fields()).find_map(|(c, f)| {
                let what = format!("field `{}`", c.name);
                misfit(&c.ty, &f.field_type)
                    .map(|m| format!("{what}: {m}"))
                    .or_else(|| optional_where_required(&what, c.required, f.required))
            })
        }
        (
            ColumnType::List {
                element,
                element_required,
            },
            Type::List(l),
        ) => misfit(element, &l.element_field.field_type)
            .map(|m| format!("list element: {m}"))
            .or_else(|| {
                optional_where_required(
                    "the list element",
                    *element_required,
                    l.element_field.required,
                )
            }),
        (
            ColumnType::Map {
                key,
                value,
                value_required,
            },
            Type::Map(m),
        ) => misfit(key, &m.key_field.field_type)
            .map(|e| format!("map key: {e}"))
            .or_else(|| misfit(value, &m.value_field.field_type).map(|e| format!("map value: {e}")))
            .or_else(|| {
                optional_where_required("the map value", *value_required, m.value_field.required)
            }),
        // A primitive, or a nested type against another kind: ids aside,
        // any difference shows in the types themselves.
        (declared, actual) => {
            let declared = iceberg_type(declared, &mut 0);
            (declared != *actual).then(|| format!("declared {declared}, the table has {actual}"))
        }
    }
}

/// `what` declared optional where the table requires a value.
fn optional_where_required(what: &str, declared: bool, table: bool) -> Option<String> {
    (table && !declared).then(|| format!("{what} declared optional, the table requires a value"))
}

fn partition_spec(spec: &TableSpec, schema: &Schema) -> StreamResult<UnboundPartitionSpec> {
    let mut builder = UnboundPartitionSpec::builder().with_spec_id(0);
    for p in &spec.partition {
        let bad = |message: String| StreamError::Config {
            key: "sink.partition",
            message,
        };
        let field = schema
            .field_by_name(&p.column)
            .ok_or_else(|| bad(format!("`{}` is not a column", p.column)))?;
        let transform = Transform::from_str(&p.transform)
            .map_err(|e| bad(format!("`{}`: {e}", p.transform)))?;
        let name = match transform {
            Transform::Identity => p.column.clone(),
            Transform::Bucket(n) => format!("{}_bucket_{n}", p.column),
            Transform::Truncate(w) => format!("{}_trunc_{w}", p.column),
            other => format!("{}_{}", p.column, other.to_string().to_lowercase()),
        };
        builder = builder
            .add_partition_field(field.id, name, transform)
            .map_err(|e| bad(format!("`{}` by {}: {e}", p.column, p.transform)))?;
    }
    Ok(builder.build())
}

/// Loads the table, creating it (and its namespace) from the declared spec
/// when missing; `true` with it when this call created it.
async fn ensure_table(
    catalog: &dyn Catalog,
    ident: &TableIdent,
    config: &IcebergSinkConfig,
) -> StreamResult<(Table, bool)> {
    let what = format!("{}.{}", ident.namespace().to_url_string(), ident.name());
    let label = format!("iceberg sink {}", config.sink_id);
    // Some catalogs (the in-memory one) answer "no such namespace" rather
    // than "no such table".
    let ns_exists = catalog
        .namespace_exists(ident.namespace())
        .await
        .map_err(|e| external(&label, "looking up the namespace", &e))?;
    let exists = ns_exists
        && catalog
            .table_exists(ident)
            .await
            .map_err(|e| external(&label, format!("looking up table {what}"), &e))?;
    if exists {
        return catalog
            .load_table(ident)
            .await
            .map(|t| (t, false))
            .map_err(|e| external(&label, format!("loading table {what}"), &e));
    }
    let Some(spec) = &config.table_spec else {
        return Err(StreamError::Config {
            key: "sink.table",
            message: format!(
                "table {what} does not exist in the {} and no schema is declared to create it",
                config.catalog.describe()
            ),
        });
    };
    let schema = iceberg_schema(spec)?;
    let partition = partition_spec(spec, &schema)?;
    let ns = ident.namespace();
    if !ns_exists {
        match catalog.create_namespace(ns, HashMap::new()).await {
            Ok(Namespace { .. }) => {}
            Err(e) if e.kind() == ErrorKind::NamespaceAlreadyExists => {}
            Err(e) => return Err(external(&label, "creating the namespace", &e)),
        }
    }
    let creation = TableCreation::builder()
        .name(ident.name().to_owned())
        .schema(schema)
        .partition_spec(partition)
        .properties(config.compression.table_properties())
        .build();
    match catalog.create_table(ns, creation).await {
        Ok(t) => {
            tracing::info!(table = %what, sink = %config.sink_id, uuid = %t.metadata().uuid(), "created table");
            Ok((t, true))
        }
        // Another sink created it meanwhile.
        Err(e) if e.kind() == ErrorKind::TableAlreadyExists => catalog
            .load_table(ident)
            .await
            .map(|t| (t, false))
            .map_err(|e| external(&label, format!("loading table {what}"), &e)),
        Err(e) => Err(external(&label, format!("creating table {what}"), &e)),
    }
}

/// Checks that the declared columns fit the table's schema; the error
/// names the first column that does not.
fn check_fits(spec: &TableSpec, schema: &Schema, table: &str) -> StreamResult<()> {
    for c in &spec.columns {
        let bad = |message: String| StreamError::Config {
            key: "sink.schema",
            message: format!("column `{}` does not fit table {table}: {message}", c.name),
        };
        let Some(field) = schema.field_by_name(&c.name) else {
            return Err(bad("the table has no such column".to_owned()));
        };
        if let Some(m) = misfit(&c.ty, &field.field_type) {
            return Err(bad(m));
        }
        if field.required && !c.required {
            return Err(bad(
                "declared optional, the table requires a value".to_owned()
            ));
        }
    }
    for field in schema.as_struct().fields() {
        if field.required && !spec.columns.iter().any(|c| c.name == field.name) {
            return Err(StreamError::Config {
                key: "sink.schema",
                message: format!(
                    "table {table} requires column `{}`, which is not declared",
                    field.name
                ),
            });
        }
    }
    Ok(())
}

/// What the guard saw on the table refreshed for a commit attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Observed {
    /// The sink already committed up to here, at or above the target: the
    /// commit is done.
    AlreadyCommitted(u64),
    /// The sink committed up to here, inside the pending range: drop the
    /// pending checkpoints up to it and commit the rest.
    Partly(u64),
    /// A fault hook crashed the commit.
    Crashed,
    /// A newer run claimed the sink: its epoch, and who claimed it.
    Fenced {
        /// The table's epoch.
        epoch: u64,
        /// The claim's owner, as the table says.
        owner: Option<String>,
    },
    /// The table under the name is another one: its uuid.
    Replaced(String),
}

/// This run's claim of a sink: its epoch in the table with that uuid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) epoch: u64,
    pub(crate) uuid: String,
}

/// What a commit attempt requires of the table it is built on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Expect {
    pub(crate) uuid: String,
    pub(crate) epoch: u64,
}

impl From<&Claim> for Expect {
    fn from(claim: &Claim) -> Self {
        Expect {
            uuid: claim.uuid.clone(),
            epoch: claim.epoch,
        }
    }
}

/// Whether `table` is the one `expect` names, owned by its epoch.
pub(crate) fn owned(table: &Table, sink_id: &str, expect: &Expect) -> Option<Observed> {
    let uuid = table.metadata().uuid().to_string();
    if uuid != expect.uuid {
        return Some(Observed::Replaced(uuid));
    }
    let epoch = table_epoch(table, sink_id);
    (epoch != expect.epoch).then(|| Observed::Fenced {
        epoch,
        owner: epoch_owner(table, sink_id),
    })
}

/// A catalog that runs the "already committed?" check, and the check that
/// the table is still the one this run owns (uuid and epoch), on the table
/// each commit attempt is built on.
///
/// `Transaction::commit` reloads the table through `load_table`, re-applies
/// its actions on it and sends the result to `update_table` with the
/// requirement that the branch head is still the one it reloaded; a conflict
/// repeats all of that. Checking the sink's committed id on exactly that
/// reloaded table means no attempt, first or retried, can append a
/// checkpoint the table already holds: anything committed after the check
/// moves the head and fails the requirement. The same holds for the owner
/// check: a newer run's claim adds a snapshot, so it moves the head too.
pub(crate) struct GuardedCatalog<'a> {
    pub(crate) inner: &'a dyn Catalog,
    pub(crate) sink_id: &'a str,
    /// The lowest and highest checkpoint ids of this commit (none for a
    /// claim).
    pub(crate) range: Option<(u64, u64)>,
    /// The table and epoch the attempt must be built on.
    pub(crate) expect: Option<Expect>,
    pub(crate) hook: Option<&'a FaultHook>,
    pub(crate) observed: Mutex<Option<Observed>>,
    pub(crate) attempts: std::sync::atomic::AtomicU32,
}

impl std::fmt::Debug for GuardedCatalog<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardedCatalog")
            .field("sink_id", &self.sink_id)
            .field("range", &self.range)
            .field("expect", &self.expect)
            .finish()
    }
}

impl<'a> GuardedCatalog<'a> {
    pub(crate) fn new(
        inner: &'a dyn Catalog,
        sink_id: &'a str,
        range: Option<(u64, u64)>,
        hook: Option<&'a FaultHook>,
    ) -> Self {
        GuardedCatalog {
            inner,
            sink_id,
            range,
            expect: None,
            hook,
            observed: Mutex::new(None),
            attempts: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// Requires every attempt's table to be `expect`'s.
    pub(crate) fn expecting(mut self, expect: Expect) -> Self {
        self.expect = Some(expect);
        self
    }

    pub(crate) fn observed(&self) -> Option<Observed> {
        self.observed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn stop(&self, seen: Observed, message: String) -> iceberg::Error {
        *self
            .observed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(seen);
        iceberg::Error::new(ErrorKind::PreconditionFailed, message).with_retryable(false)
    }

    async fn fault(&self, step: CommitStep) -> Fault {
        match self.hook {
            Some(hook) => hook(step).await,
            None => Fault::Proceed,
        }
    }

    fn attempt(&self) -> u32 {
        self.attempts.load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn boxed<'a, T: Send + 'a>(
    f: impl std::future::Future<Output = T> + Send + 'a,
) -> BoxFuture<'a, T> {
    Box::pin(f)
}

#[async_trait::async_trait]
impl Catalog for GuardedCatalog<'_> {
    async fn list_namespaces(
        &self,
        parent: Option<&NamespaceIdent>,
    ) -> iceberg::Result<Vec<NamespaceIdent>> {
        self.inner.list_namespaces(parent).await
    }

    async fn create_namespace(
        &self,
        namespace: &NamespaceIdent,
        properties: HashMap<String, String>,
    ) -> iceberg::Result<Namespace> {
        self.inner.create_namespace(namespace, properties).await
    }

    async fn get_namespace(&self, namespace: &NamespaceIdent) -> iceberg::Result<Namespace> {
        self.inner.get_namespace(namespace).await
    }

    async fn namespace_exists(&self, namespace: &NamespaceIdent) -> iceberg::Result<bool> {
        self.inner.namespace_exists(namespace).await
    }

    async fn update_namespace(
        &self,
        namespace: &NamespaceIdent,
        properties: HashMap<String, String>,
    ) -> iceberg::Result<()> {
        self.inner.update_namespace(namespace, properties).await
    }

    async fn drop_namespace(&self, namespace: &NamespaceIdent) -> iceberg::Result<()> {
        self.inner.drop_namespace(namespace).await
    }

    async fn list_tables(&self, namespace: &NamespaceIdent) -> iceberg::Result<Vec<TableIdent>> {
        self.inner.list_tables(namespace).await
    }

    async fn create_table(
        &self,
        namespace: &NamespaceIdent,
        creation: TableCreation,
    ) -> iceberg::Result<Table> {
        self.inner.create_table(namespace, creation).await
    }

    /// The refresh of a commit attempt: the dedupe check runs here.
    async fn load_table(&self, ident: &TableIdent) -> iceberg::Result<Table> {
        let table = self.inner.load_table(ident).await?;
        let attempt = self.attempt();
        if let Fault::Crash(why) = boxed(self.fault(CommitStep::Refreshed { attempt })).await {
            return Err(self.stop(Observed::Crashed, why));
        }
        if let Some(expect) = &self.expect
            && let Some(seen) = owned(&table, self.sink_id, expect)
        {
            let message = format!(
                "sink {} no longer owns the table (epoch {}): {seen:?}",
                self.sink_id, expect.epoch
            );
            return Err(self.stop(seen, message));
        }
        let Some((low, high)) = self.range else {
            return Ok(table);
        };
        match observe(&table, self.sink_id, low, high) {
            Some(seen) => {
                let message = format!(
                    "sink {} already committed {seen:?} of checkpoints {low}..={high}",
                    self.sink_id
                );
                Err(self.stop(seen, message))
            }
            None => Ok(table),
        }
    }

    async fn drop_table(&self, table: &TableIdent) -> iceberg::Result<()> {
        self.inner.drop_table(table).await
    }

    async fn purge_table(&self, table: &TableIdent) -> iceberg::Result<()> {
        self.inner.purge_table(table).await
    }

    async fn table_exists(&self, table: &TableIdent) -> iceberg::Result<bool> {
        self.inner.table_exists(table).await
    }

    async fn rename_table(&self, src: &TableIdent, dest: &TableIdent) -> iceberg::Result<()> {
        self.inner.rename_table(src, dest).await
    }

    async fn register_table(
        &self,
        table: &TableIdent,
        metadata_location: String,
    ) -> iceberg::Result<Table> {
        self.inner.register_table(table, metadata_location).await
    }

    async fn update_table(&self, commit: TableCommit) -> iceberg::Result<Table> {
        let attempt = self
            .attempts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        match boxed(self.fault(CommitStep::BeforeUpdate { attempt })).await {
            Fault::Crash(why) => return Err(self.stop(Observed::Crashed, why)),
            Fault::Unavailable => {
                return Err(iceberg::Error::new(
                    ErrorKind::Unexpected,
                    "injected: the catalog is unreachable",
                ));
            }
            Fault::Proceed | Fault::LoseResponse => {}
        }
        let table = self.inner.update_table(commit).await?;
        match boxed(self.fault(CommitStep::AfterUpdate { attempt })).await {
            Fault::Proceed | Fault::Unavailable => Ok(table),
            Fault::Crash(why) => Err(self.stop(Observed::Crashed, why)),
            Fault::LoseResponse => Err(iceberg::Error::new(
                ErrorKind::CatalogCommitConflicts,
                "injected: the catalog's answer was lost",
            )
            .with_retryable(true)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Column, PartitionField};

    #[test]
    fn nested_fields_get_ids_after_the_top_level_ones_and_fit_their_table() {
        let spec = TableSpec {
            columns: vec![
                Column::required("id", ColumnType::Long),
                Column::optional(
                    "buyer",
                    "struct<name: string, address: struct<city: string>>"
                        .parse()
                        .unwrap(),
                ),
                Column::optional("tags", "map<string, list<long>>".parse().unwrap()),
            ],
            ..TableSpec::default()
        };
        let schema = iceberg_schema(&spec).unwrap();
        let id = |name: &str| schema.field_by_name(name).unwrap().id;
        assert_eq!((id("id"), id("buyer"), id("tags")), (1, 2, 3));
        assert_eq!((id("buyer.name"), id("buyer.address")), (4, 5));
        assert_eq!(id("buyer.address.city"), 6);
        // map key 7, value 8, the value's list element 9.
        assert_eq!(schema.highest_field_id(), 9);
        check_fits(&spec, &schema, "t").unwrap();
        let mut other = spec.clone();
        other.columns[1] = Column::optional(
            "buyer",
            "struct<name: string, address: struct<town: string>>"
                .parse()
                .unwrap(),
        );
        let err = check_fits(&other, &schema, "t").unwrap_err().to_string();
        assert!(
            err.contains("column `buyer`")
                && err.contains("field `address`")
                && err.contains("town"),
            "{err}"
        );
        other.columns[1] = Column::optional("buyer", ColumnType::String);
        let err = check_fits(&other, &schema, "t").unwrap_err().to_string();
        assert!(err.contains("declared string"), "{err}");
    }

    #[test]
    fn a_declared_column_of_another_type_is_named() {
        let table = TableSpec {
            columns: vec![
                Column::required("id", ColumnType::Long),
                Column::optional("price", ColumnType::Double),
            ],
            partition: vec![PartitionField::new("id", "bucket[4]")],
        };
        let schema = iceberg_schema(&table).unwrap();
        let declared = TableSpec {
            columns: vec![
                Column::required("id", ColumnType::Long),
                Column::optional(
                    "price",
                    ColumnType::Decimal {
                        precision: 10,
                        scale: 2,
                    },
                ),
            ],
            partition: vec![],
        };
        let err = check_fits(&declared, &schema, "db.t")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`price`") && err.contains("decimal(10, 2)"),
            "{err}"
        );
        let missing = TableSpec {
            columns: vec![Column::optional("price", ColumnType::Double)],
            partition: vec![],
        };
        let err = check_fits(&missing, &schema, "db.t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("requires column `id`"), "{err}");
        assert!(check_fits(&table, &schema, "db.t").is_ok());
        assert_eq!(partition_spec(&table, &schema).unwrap().fields().len(), 1);
    }
}
