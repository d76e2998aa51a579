//! Schema evolution where an Avro source meets the Iceberg sink
//! (`sink.schema_evolution = "add-columns"`): the source's columns, shared
//! by every subtask and every attempt of a run, grown with the table.
//!
//! At start the columns are the declared ones (or the registry's) plus the
//! table's columns they lack (a column someone else added is picked up) with
//! the table's type where it is wider. When a writer schema brings more, the
//! table takes it in a schema commit of its own (see the Iceberg
//! connector's `evolve`), the columns become the table's, and the job
//! restarts with them.

use std::collections::HashSet;
use std::sync::{Arc, OnceLock, RwLock};

use arrow_schema::{Field, Schema, SchemaRef};
use tinyflow_api::{StreamError, StreamResult};
use tinyflow_connectors_iceberg::{Column, IcebergSink};
use tinyflow_connectors_kafka::ColumnsEvolver;

/// The columns of a run, grown as the table's schema evolves. Clones share
/// them.
#[derive(Debug, Clone, Default)]
pub struct LiveColumns(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    columns: RwLock<Option<SchemaRef>>,
    sink: OnceLock<IcebergSink>,
    /// The key, header and metadata columns: the table has them, but they
    /// are not the value's.
    not_value: OnceLock<HashSet<String>>,
}

impl LiveColumns {
    /// Starts with `declared` unless it started already (a restart plans
    /// again with the columns it has); `not_value` names the table's columns
    /// the source fills from elsewhere than the value.
    pub(crate) fn start(&self, declared: &SchemaRef, not_value: HashSet<String>) {
        let mut c = self.0.columns.write().unwrap_or_else(|p| p.into_inner());
        if c.is_none() {
            *c = Some(Arc::clone(declared));
        }
        let _ = self.0.not_value.set(not_value);
    }

    /// The sink whose table the columns follow.
    pub(crate) fn bind(&self, sink: &IcebergSink) {
        let _ = self.0.sink.set(sink.clone());
    }

    fn sink(&self) -> StreamResult<&IcebergSink> {
        self.0.sink.get().ok_or_else(|| StreamError::Config {
            key: "sink.schema_evolution",
            message: "the columns are not bound to the sink (a planning error)".to_owned(),
        })
    }

    fn get(&self) -> Option<SchemaRef> {
        self.0
            .columns
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Takes the table's columns the value columns lack, and the table's
    /// types where wider (at the start of a run); with `add`, first makes
    /// the table take the value columns it lacks.
    pub(crate) async fn follow_table(&self, add: bool) -> StreamResult<()> {
        let Some(current) = self.get() else {
            return Ok(());
        };
        if add {
            // Columns declared (or in the registry's schema) that the table
            // lacks: it takes them now, as it would from a record.
            let change = self.evolve(Arc::clone(&current)).await?;
            tracing::info!(change = %change, "the table takes the declared columns");
        }
        let current = self.get().unwrap_or(current);
        let table = self.sink()?.table_columns().await?;
        let merged = self.merged(&current, &table)?;
        if merged.fields() != current.fields() {
            let added: Vec<&str> = merged
                .fields()
                .iter()
                .filter(|f| current.field_with_name(f.name()).is_err())
                .map(|f| f.name().as_str())
                .collect();
            tracing::info!(added = ?added, "the table has columns or wider types beyond the declared ones: the job reads into them");
        }
        *self.0.columns.write().unwrap_or_else(|p| p.into_inner()) = Some(merged);
        Ok(())
    }

    /// `value` grown by the table's `table` columns (those that are not
    /// the key's, headers' or metadata's).
    fn merged(&self, value: &SchemaRef, table: &[Column]) -> StreamResult<SchemaRef> {
        let skip = self.0.not_value.get();
        let fields: Vec<Field> = table
            .iter()
            .filter(|c| !skip.is_some_and(|s| s.contains(&c.name)))
            .map(|c| {
                Ok(Field::new(
                    &c.name,
                    crate::plan::arrow_of(&c.ty, true).map_err(|m| StreamError::Config {
                        key: "sink.schema_evolution",
                        message: format!("the table's column `{}`: {m}", c.name),
                    })?,
                    !c.required,
                ))
            })
            .collect::<StreamResult<_>>()?;
        let table = arrow_schema::Fields::from(fields);
        match tinyflow_connectors_kafka::grow_columns(value.fields(), &table) {
            Ok(Some(grown)) => Ok(Arc::new(Schema::new(grown))),
            Ok(None) => Ok(Arc::clone(value)),
            Err(e) => Err(StreamError::Config {
                key: "sink.schema_evolution",
                message: format!("the table's columns do not fit the declared ones: {e}"),
            }),
        }
    }
}

#[async_trait::async_trait]
impl ColumnsEvolver for LiveColumns {
    fn columns(&self) -> SchemaRef {
        self.get().unwrap_or_else(|| Arc::new(Schema::empty()))
    }

    async fn evolve(&self, wanted: SchemaRef) -> StreamResult<String> {
        if let Some(skip) = self.0.not_value.get()
            && let Some(f) = wanted.fields().iter().find(|f| skip.contains(f.name()))
        {
            return Err(StreamError::Config {
                key: "sink.schema_evolution",
                message: format!(
                    "the records' field `{}` has the name of the key's, a header's or a metadata column: rename that column (source.key.column, source.headers[].column, source.all_headers.column) or the field",
                    f.name()
                ),
            });
        }
        let columns = wanted
            .fields()
            .iter()
            .map(|f| {
                Ok(Column {
                    name: f.name().clone(),
                    ty: crate::plan::column_type(f).map_err(|m| StreamError::Config {
                        key: "sink.schema_evolution",
                        message: m,
                    })?,
                    required: !f.is_nullable(),
                })
            })
            .collect::<StreamResult<Vec<_>>>()?;
        let sink = self.sink()?;
        let (change, _) = sink.evolve_columns(&columns).await?;
        let table = sink.table_columns().await?;
        let merged = self.merged(&wanted, &table)?;
        *self.0.columns.write().unwrap_or_else(|p| p.into_inner()) = Some(merged);
        Ok(if change.is_empty() {
            "columns the table already had".to_owned()
        } else {
            let mut parts = Vec::new();
            if !change.added.is_empty() {
                parts.push(format!("new columns {:?}", change.added));
            }
            for (path, from, to) in &change.widened {
                parts.push(format!("`{path}` widened from {from} to {to}"));
            }
            parts.join(", ")
        })
    }
}
