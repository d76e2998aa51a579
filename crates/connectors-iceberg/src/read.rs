//! Reading a table back, for tools and tests: loading it by name once,
//! polling it with a [`TableReader`], counting its rows, scanning a `long`
//! column. The sink itself never reads through here. These stay in the
//! product because the CLI uses each of them (`tinyflow demo` polls and
//! scans the table, `tinyflow inspect` loads it).

use std::sync::Arc;

use iceberg::table::Table;
use iceberg::{Catalog, NamespaceIdent, TableIdent};
use tinyflow_api::{StreamError, StreamResult};

use crate::catalog::{external, open_catalog};
use crate::config::CatalogConfig;

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
            .map_err(|e| external("iceberg", format!("naming {namespace}.{table}"), e))?;
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
            .map_err(|e| external("iceberg", format!("loading {}", self.label), e))
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
        .map_err(|e| external(&label, what.clone(), e))?
        .to_arrow()
        .await
        .map_err(|e| external(&label, what.clone(), e))?
        .try_collect()
        .await
        .map_err(|e| external(&label, what.clone(), e))?;
    let mut values = Vec::new();
    for b in &batches {
        let longs = b
            .column(0)
            .as_any()
            .downcast_ref::<arrow_array::Int64Array>()
            .ok_or_else(|| {
                StreamError::external(
                    label.clone(),
                    "iceberg",
                    what.clone(),
                    format!("the column is {}, not long", b.column(0).data_type()),
                    false,
                )
            })?;
        values.extend(longs.iter().flatten());
    }
    Ok(values)
}
