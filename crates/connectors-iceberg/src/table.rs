//! A sink's table: the [`SinkTable`] its writers and committer share (the
//! catalog opened once, the table found or created once and checked
//! against the declared columns, this run's claim of the sink, the
//! writers' pending syncs and retired ids), and the Iceberg schema and
//! partition spec of a declared [`TableSpec`]. Opening catalogs is
//! `catalog`'s, the markers a commit leaves are `dedupe`'s, committing data
//! is the committer's; schema evolution (`evolve`) adds its methods to
//! [`SinkTable`].

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use iceberg::io::{FileIO, FileIOBuilder};
use iceberg::spec::{
    ListType, MapType, NestedField, PrimitiveType, Schema, StructType, Transform, Type,
    UnboundPartitionSpec,
};
use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use iceberg::{Catalog, ErrorKind, Namespace, NamespaceIdent, TableCreation, TableIdent};
use tinyflow_api::{CheckpointId, JobPositions, StreamError, StreamResult};
use tokio::sync::OnceCell;

use crate::catalog::{
    GuardedCatalog, external, is_conflict, is_local_warehouse, open_catalog, pause_after_conflict,
};
use crate::config::{Column, ColumnType, IcebergSinkConfig, TableSpec};
use crate::dedupe::{
    Claim, Expect, Observed, SUMMARY_EPOCH, SUMMARY_EPOCH_CLAIM, committed_id, committed_positions,
    epoch_owner_property, epoch_property, retired, table_epoch,
};
use crate::local_storage::{PendingSyncs, SyncedLocalStorageFactory};

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
    /// The table's partition fields for routing rows to the writers (set
    /// by the writers as they load the table).
    pub(crate) routing: Arc<crate::shuffle::Routing>,
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
            routing: Arc::default(),
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

    /// The storage merged files are written through: synced as each file
    /// closes (a merged file is committed right after, with no checkpoint
    /// in between to wait for its sync).
    pub(crate) fn merge_file_io(&self, table: &FileIO) -> FileIO {
        match self.config.catalog.warehouse() {
            Some(w) if is_local_warehouse(w) => {
                FileIOBuilder::new(Arc::new(SyncedLocalStorageFactory { defer: None }))
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
            Err(e) => Err(external(&self.label(), "loading the table", e)),
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
        // its refresh and claims above it (the newest claim wins). Other
        // sinks' commits (other workers) only delay it.
        for round in 0..10u32 {
            let table = self.load().await?;
            if let Some(by) = retired(&table, sink) {
                return Err(StreamError::Fenced {
                    operator: label,
                    message: format!(
                        "sink {sink} of table {} was retired by a rescale ({by}): a worker of an old layout never commits again; start the workers of the current layout instead",
                        self.table_name()
                    ),
                });
            }
            let current = table_epoch(&table, sink);
            let mine = current + 1;
            let uuid = table.metadata().uuid().to_string();
            let owner = crate::dedupe::stamp();
            let tx = Transaction::new(&table);
            let append = tx.fast_append().set_snapshot_properties(HashMap::from([
                (SUMMARY_EPOCH_CLAIM.to_owned(), sink.clone()),
                (SUMMARY_EPOCH.to_owned(), mine.to_string()),
            ]));
            let tx = append
                .apply(tx)
                .map_err(|e| external(&label, "building the epoch claim", e))?;
            let tx = tx
                .update_table_properties()
                .set(epoch_property(sink), mine.to_string())
                .set(epoch_owner_property(sink), owner.clone())
                .apply(tx)
                .map_err(|e| external(&label, "building the epoch claim", e))?;
            let catalog = self.catalog().await?;
            let guard = GuardedCatalog::new(catalog.as_ref(), sink, None).expecting(Expect {
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
                    None if is_conflict(&e) => {
                        pause_after_conflict(round, &label, "claiming").await;
                    }
                    _ => return Err(external(&label, "claiming the sink's epoch", e)),
                },
            }
        }
        Err(StreamError::external(
            label,
            "iceberg",
            "claiming the sink's epoch".to_owned(),
            "other runs claimed it ten times in a row while this one tried".to_owned(),
            true,
        ))
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
        .map_err(|e| external(&label, "looking up the namespace", e))?;
    let exists = ns_exists
        && catalog
            .table_exists(ident)
            .await
            .map_err(|e| external(&label, format!("looking up table {what}"), e))?;
    if exists {
        return catalog
            .load_table(ident)
            .await
            .map(|t| (t, false))
            .map_err(|e| external(&label, format!("loading table {what}"), e));
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
            // Another process created it meanwhile (the SQL catalog says so
            // only as a failed unique constraint).
            Err(_) if catalog.namespace_exists(ns).await.unwrap_or(false) => {}
            Err(e) => return Err(external(&label, "creating the namespace", e)),
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
        Err(e) => {
            // Another sink, or another worker of this one, created it
            // meanwhile (the SQL catalog says so only as a failed unique
            // constraint, not as `TableAlreadyExists`).
            if e.kind() == ErrorKind::TableAlreadyExists
                || catalog.table_exists(ident).await.unwrap_or(false)
            {
                tracing::info!(table = %what, sink = %config.sink_id, "another process created the table at the same time; using it");
                return catalog
                    .load_table(ident)
                    .await
                    .map(|t| (t, false))
                    .map_err(|e| external(&label, format!("loading table {what}"), e));
            }
            Err(external(&label, format!("creating table {what}"), e))
        }
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
