//! Schema evolution of a sink's table: columns the records bring are added
//! as optional columns (at the top level, in structs, in the structs of
//! lists and maps), and types are widened where Iceberg allows (int to
//! long, float to double, a decimal's precision up), in a commit of its own.
//!
//! The commit holds no data and is idempotent: it adds what the table lacks
//! *now* and widens what is narrower *now*, so a run that crashes after it
//! and does it again changes nothing, and a column someone else added is
//! kept as it is (and taken by the records when they have it). Data files
//! written before it stay valid (Iceberg reads columns by field id: a file
//! without a column reads null there, an int column reads as long), so the
//! schema commit and the data commits cannot disagree whatever their order
//! after a crash. Renames, drops and narrowing are never done: a type the
//! table cannot widen into is an error naming the column.
//!
//! iceberg-rust 0.10.1's `UpdateSchemaAction` adds columns but has no type
//! promotion, and a catalog commit cannot be built outside that crate. A
//! widening is therefore made by the same action run on the table as the
//! catalog has it *but with the promoted types in its current schema* (same
//! schema id, so the action's requirement, "the current schema is still
//! this one", is checked against the real table): the action writes that
//! schema, with any additions, as the new current schema.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_schema::SchemaRef;
use iceberg::spec::{
    ListType, MapType, NestedField, NestedFieldRef, PrimitiveType, Schema, StructType,
    TableMetadata, Type,
};
use iceberg::table::Table;
use iceberg::transaction::{AddColumn, ApplyTransactionAction, Transaction};
use iceberg::{Catalog, TableCommit, TableIdent};
use tinyflow_api::{StreamError, StreamResult};

use crate::catalog::external;
use crate::config::{Column, ColumnType};
use crate::table::{SinkTable, iceberg_type};

/// How often a schema commit is tried when another commit got in first.
const ATTEMPTS: u32 = 5;

/// What a schema commit changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchemaChange {
    /// Columns added, as dotted paths (`buyer.address.zip`).
    pub added: Vec<String>,
    /// Columns widened: path, from, to.
    pub widened: Vec<(String, String, String)>,
}

impl SchemaChange {
    /// Whether it changed nothing.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.widened.is_empty()
    }
}

/// The table's columns as declared columns; those of types tinyflow does
/// not declare (time, uuid, fixed, nanosecond timestamps) are left out.
pub(crate) fn columns_of(schema: &Schema) -> Vec<Column> {
    schema
        .as_struct()
        .fields()
        .iter()
        .filter_map(|f| column_of(f))
        .collect()
}

fn column_of(f: &NestedField) -> Option<Column> {
    Some(Column {
        name: f.name.clone(),
        ty: column_type_of(&f.field_type)?,
        required: f.required,
    })
}

fn column_type_of(ty: &Type) -> Option<ColumnType> {
    Some(match ty {
        Type::Primitive(p) => match p {
            PrimitiveType::Boolean => ColumnType::Boolean,
            PrimitiveType::Int => ColumnType::Int,
            PrimitiveType::Long => ColumnType::Long,
            PrimitiveType::Float => ColumnType::Float,
            PrimitiveType::Double => ColumnType::Double,
            PrimitiveType::String => ColumnType::String,
            PrimitiveType::Binary => ColumnType::Binary,
            PrimitiveType::Date => ColumnType::Date,
            PrimitiveType::Timestamp => ColumnType::Timestamp,
            PrimitiveType::Timestamptz => ColumnType::Timestamptz,
            PrimitiveType::Decimal { precision, scale } => ColumnType::Decimal {
                precision: *precision,
                scale: *scale,
            },
            _ => return None,
        },
        Type::Struct(s) => ColumnType::Struct(
            s.fields()
                .iter()
                .map(|f| column_of(f))
                .collect::<Option<Vec<_>>>()?,
        ),
        Type::List(l) => ColumnType::List {
            element: Box::new(column_type_of(&l.element_field.field_type)?),
            element_required: l.element_field.required,
        },
        Type::Map(m) => ColumnType::Map {
            key: Box::new(column_type_of(&m.key_field.field_type)?),
            value: Box::new(column_type_of(&m.value_field.field_type)?),
            value_required: m.value_field.required,
        },
    })
}

/// What the table must change to take `wanted`.
#[derive(Debug, Default)]
struct Plan {
    adds: Vec<(Option<String>, Column)>,
    /// Paths (dotted, list elements and map values by their own names) to
    /// the promoted type.
    widen: Widen,
    change: SchemaChange,
}

/// Whether a value of `from` reads as `to` without loss, by Iceberg's
/// promotion rules.
fn promotion(from: &PrimitiveType, to: &ColumnType) -> Option<PrimitiveType> {
    match (from, to) {
        (PrimitiveType::Int, ColumnType::Long) => Some(PrimitiveType::Long),
        (PrimitiveType::Float, ColumnType::Double) => Some(PrimitiveType::Double),
        (
            PrimitiveType::Decimal { precision, scale },
            ColumnType::Decimal {
                precision: p,
                scale: s,
            },
        ) if s == scale && p > precision => Some(PrimitiveType::Decimal {
            precision: *p,
            scale: *s,
        }),
        _ => None,
    }
}

/// Whether the table's `have` already takes values of `want` (the same,
/// or wider).
fn takes(have: &PrimitiveType, want: &ColumnType) -> bool {
    matches!(
        (have, want),
        (PrimitiveType::Boolean, ColumnType::Boolean)
            | (PrimitiveType::Int, ColumnType::Int)
            | (PrimitiveType::Long, ColumnType::Long | ColumnType::Int)
            | (PrimitiveType::Float, ColumnType::Float)
            | (
                PrimitiveType::Double,
                ColumnType::Double | ColumnType::Float
            )
            | (PrimitiveType::String, ColumnType::String)
            | (PrimitiveType::Binary, ColumnType::Binary)
            | (PrimitiveType::Date, ColumnType::Date)
            | (PrimitiveType::Timestamp, ColumnType::Timestamp)
            | (PrimitiveType::Timestamptz, ColumnType::Timestamptz)
    ) || matches!(
        (have, want),
        (PrimitiveType::Decimal { precision, scale }, ColumnType::Decimal { precision: p, scale: s })
            if s == scale && p <= precision
    )
}

fn plan(
    fields: &[NestedFieldRef],
    wanted: &[Column],
    parent: Option<&str>,
    out: &mut Plan,
) -> Result<(), String> {
    for c in wanted {
        let path = parent.map_or_else(|| c.name.clone(), |p| format!("{p}.{}", c.name));
        let Some(f) = fields.iter().find(|f| f.name == c.name) else {
            out.adds.push((
                parent.map(str::to_owned),
                Column {
                    required: false,
                    ..c.clone()
                },
            ));
            out.change.added.push(path);
            continue;
        };
        plan_type(&f.field_type, &c.ty, &path, out)?;
    }
    Ok(())
}

fn plan_type(have: &Type, want: &ColumnType, path: &str, out: &mut Plan) -> Result<(), String> {
    match (have, want) {
        (Type::Struct(s), ColumnType::Struct(cs)) => plan(s.fields(), cs, Some(path), out),
        (Type::List(l), ColumnType::List { element, .. }) => {
            let inner = format!("{path}.element");
            match (l.element_field.field_type.as_ref(), element.as_ref()) {
                // Fields added to a list's structs go under the list.
                (Type::Struct(s), ColumnType::Struct(cs)) => plan(s.fields(), cs, Some(path), out),
                (t, e) => plan_type(t, e, &inner, out),
            }
        }
        (Type::Map(m), ColumnType::Map { value, .. }) => {
            match (m.value_field.field_type.as_ref(), value.as_ref()) {
                (Type::Struct(s), ColumnType::Struct(cs)) => plan(s.fields(), cs, Some(path), out),
                (t, v) => plan_type(t, v, &format!("{path}.value"), out),
            }
        }
        (Type::Primitive(p), w) if takes(p, w) => Ok(()),
        (Type::Primitive(p), w) => match promotion(p, w) {
            Some(to) => {
                out.change
                    .widened
                    .push((path.to_owned(), p.to_string(), to.to_string()));
                out.widen.insert(path.to_owned(), (p.clone(), to));
                Ok(())
            }
            None => Err(format!(
                "column `{path}` is {have} in the table and {want:?} in the records: not a widening Iceberg allows (int to long, float to double, a decimal's precision up); renames, drops and narrowing are never done automatically"
            )),
        },
        (have, want) => Err(format!(
            "column `{path}` is {have} in the table and {want:?} in the records; renames, drops and other type changes are never done automatically"
        )),
    }
}

/// Paths (dotted; list elements and map values by their own names) to the
/// type they have when planned and the type they widen to.
type Widen = HashMap<String, (PrimitiveType, PrimitiveType)>;

/// `fields` with the types at the paths in `widen` promoted (same ids);
/// a path whose type is no longer the planned one goes to `changed`.
fn widened(
    fields: &[NestedFieldRef],
    widen: &Widen,
    changed: &mut Vec<String>,
    parent: Option<&str>,
) -> Vec<NestedFieldRef> {
    fields
        .iter()
        .map(|f| {
            let path = parent.map_or_else(|| f.name.clone(), |p| format!("{p}.{}", f.name));
            let ty = widened_type(&f.field_type, widen, &path, changed);
            Arc::new(NestedField {
                field_type: Box::new(ty),
                ..(**f).clone()
            })
        })
        .collect()
}

fn widened_type(ty: &Type, widen: &Widen, path: &str, changed: &mut Vec<String>) -> Type {
    match ty {
        Type::Primitive(now) => match widen.get(path) {
            None => ty.clone(),
            Some((from, to)) => {
                if now != from {
                    changed.push(format!("`{path}` is {now} now, {from} when planned"));
                }
                Type::Primitive(to.clone())
            }
        },
        Type::Struct(s) => Type::Struct(StructType::new(widened(
            s.fields(),
            widen,
            changed,
            Some(path),
        ))),
        Type::List(l) => {
            let e = &l.element_field;
            let inner = widened_child(&e.field_type, widen, path, "element", changed);
            Type::List(ListType::new(Arc::new(NestedField {
                field_type: Box::new(inner),
                ..(**e).clone()
            })))
        }
        Type::Map(m) => {
            let v = &m.value_field;
            let inner = widened_child(&v.field_type, widen, path, "value", changed);
            Type::Map(MapType::new(
                Arc::clone(&m.key_field),
                Arc::new(NestedField {
                    field_type: Box::new(inner),
                    ..(**v).clone()
                }),
            ))
        }
    }
}

/// The element or value type of the list or map at `path`: a struct's
/// fields are named under `path` itself, any other type as `path.<role>`.
fn widened_child(
    ty: &Type,
    widen: &Widen,
    path: &str,
    role: &str,
    changed: &mut Vec<String>,
) -> Type {
    match ty {
        Type::Struct(_) => widened_type(ty, widen, path, changed),
        other => widened_type(other, widen, &format!("{path}.{role}"), changed),
    }
}

/// `table` with its current schema's types promoted as `widen` says,
/// under the same schema id (see the module's note).
fn with_widened_schema(table: &Table, widen: &Widen) -> iceberg::Result<Table> {
    let current = table.metadata().current_schema();
    let mut changed = Vec::new();
    let fields = widened(current.as_struct().fields(), widen, &mut changed, None);
    if !changed.is_empty() {
        // Another commit changed the column since the plan (a retry of the
        // transaction reloads the table): never widen from a type that is
        // not the planned one; the caller plans again.
        return Err(iceberg::Error::new(
            iceberg::ErrorKind::DataInvalid,
            format!(
                "a column changed while its widening was committed: {}",
                changed.join(", ")
            ),
        ));
    }
    let schema = Schema::builder()
        .with_schema_id(current.schema_id())
        .with_identifier_field_ids(current.identifier_field_ids())
        .with_fields(fields)
        .build()?;
    let mut json = serde_json::to_value(table.metadata())
        .map_err(|e| iceberg::Error::new(iceberg::ErrorKind::DataInvalid, e.to_string()))?;
    let schema_json = serde_json::to_value(&schema)
        .map_err(|e| iceberg::Error::new(iceberg::ErrorKind::DataInvalid, e.to_string()))?;
    if let Some(schemas) = json.get_mut("schemas").and_then(|s| s.as_array_mut()) {
        for s in schemas {
            if s.get("schema-id").and_then(serde_json::Value::as_i64)
                == Some(i64::from(current.schema_id()))
            {
                *s = schema_json.clone();
            }
        }
    }
    let metadata: TableMetadata = serde_json::from_value(json)
        .map_err(|e| iceberg::Error::new(iceberg::ErrorKind::DataInvalid, e.to_string()))?;
    let mut builder = Table::builder()
        .metadata(metadata)
        .identifier(table.identifier().clone())
        .file_io(table.file_io().clone())
        .runtime(iceberg::Runtime::try_current()?);
    if let Some(location) = table.metadata_location() {
        builder = builder.metadata_location(location.to_owned());
    }
    builder.build()
}

/// A catalog that hands out its tables with promoted types (see
/// [`with_widened_schema`]) and passes everything else through.
#[derive(Debug)]
struct Widening<'a> {
    inner: &'a dyn Catalog,
    widen: &'a Widen,
}

crate::catalog::catalog_around_inner!(Widening<'_> {
    async fn load_table(&self, table: &TableIdent) -> iceberg::Result<Table> {
        let t = self.inner.load_table(table).await?;
        with_widened_schema(&t, self.widen)
    }

    async fn update_table(&self, commit: TableCommit) -> iceberg::Result<Table> {
        self.inner.update_table(commit).await
    }
});

/// Why the table cannot take the declared `columns` even by evolving, if
/// it cannot.
pub(crate) fn conflicts(schema: &Schema, columns: &[Column]) -> Option<String> {
    plan(
        schema.as_struct().fields(),
        columns,
        None,
        &mut Plan::default(),
    )
    .err()
}

impl SinkTable {
    /// The table's columns now (see [`columns_of`]).
    pub(crate) async fn columns(&self) -> StreamResult<Vec<Column>> {
        Ok(columns_of(self.load().await?.metadata().current_schema()))
    }

    /// Makes the table take `wanted` (see the module's note): the change
    /// made (empty when the table took them already) and the table's
    /// schema after, as Arrow. An error that names the column when a type
    /// cannot widen.
    pub(crate) async fn evolve(
        &self,
        wanted: &[Column],
    ) -> StreamResult<(SchemaChange, SchemaRef)> {
        let label = self.label();
        let catalog = self.catalog().await?;
        let mut last = None;
        for attempt in 1..=ATTEMPTS {
            let table = self.load().await?;
            let current = table.metadata().current_schema();
            let mut p = Plan::default();
            plan(current.as_struct().fields(), wanted, None, &mut p).map_err(|message| {
                StreamError::external(
                    label.clone(),
                    "iceberg",
                    format!("evolving table {}'s schema", self.table_name()),
                    message,
                    false,
                )
            })?;
            if p.change.is_empty() {
                let arrow = iceberg::arrow::schema_to_arrow_schema(current)
                    .map_err(|e| external(&label, "mapping the schema to Arrow", e))?;
                return Ok((SchemaChange::default(), Arc::new(arrow)));
            }
            let widening = Widening {
                inner: catalog.as_ref(),
                widen: &p.widen,
            };
            let base = if p.widen.is_empty() {
                table.clone()
            } else {
                with_widened_schema(&table, &p.widen)
                    .map_err(|e| external(&label, "promoting column types", e))?
            };
            let tx = Transaction::new(&base);
            let mut action = tx.update_schema();
            for (parent, c) in &p.adds {
                let mut next_id = 1;
                let ty = iceberg_type(&c.ty, &mut next_id);
                let add = match parent {
                    Some(parent) => AddColumn::builder()
                        .parent(parent.clone())
                        .name(c.name.clone())
                        .field_type(ty)
                        .build(),
                    None => AddColumn::optional(&c.name, ty),
                };
                action = action.add_column(add);
            }
            let result = match action.apply(tx) {
                Ok(tx) if p.widen.is_empty() => tx.commit(catalog.as_ref()).await,
                Ok(tx) => tx.commit(&widening).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(t) => {
                    let schema = t.metadata().current_schema();
                    tracing::info!(table = %self.table_name(), sink = %self.config.sink_id, added = ?p.change.added, widened = ?p.change.widened, schema_id = schema.schema_id(), "evolved the table's schema");
                    let arrow = iceberg::arrow::schema_to_arrow_schema(schema)
                        .map_err(|e| external(&label, "mapping the schema to Arrow", e))?;
                    return Ok((p.change, Arc::new(arrow)));
                }
                // Another commit (another subtask's evolution, a data
                // commit) got in first: plan again on the table as it is.
                Err(e) => {
                    tracing::debug!(table = %self.table_name(), attempt, error = %e, "a schema commit failed; planning it again");
                    last = Some(e);
                }
            }
        }
        let e = last.expect("at least one attempt");
        Err(external(
            &label,
            format!("evolving table {}'s schema", self.table_name()),
            e,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(id: i32, name: &str, ty: Type) -> NestedFieldRef {
        Arc::new(NestedField::optional(id, name, ty))
    }

    #[test]
    fn a_plan_adds_what_is_missing_widens_what_may_widen_and_refuses_the_rest() {
        let address = Type::Struct(StructType::new(vec![field(
            4,
            "city",
            Type::Primitive(PrimitiveType::String),
        )]));
        let fields = vec![
            field(1, "id", Type::Primitive(PrimitiveType::Int)),
            field(2, "price", Type::Primitive(PrimitiveType::Long)),
            field(3, "address", address),
        ];
        let wanted = vec![
            Column::required("id", ColumnType::Long),
            Column::optional("price", ColumnType::Int),
            Column::optional(
                "address",
                ColumnType::Struct(vec![
                    Column::optional("city", ColumnType::String),
                    Column::required("zip", ColumnType::String),
                ]),
            ),
            Column::optional("coupon", ColumnType::String),
        ];
        let mut p = Plan::default();
        plan(&fields, &wanted, None, &mut p).unwrap();
        assert_eq!(
            p.change.added,
            vec!["address.zip".to_owned(), "coupon".to_owned()]
        );
        assert_eq!(
            p.change.widened,
            vec![("id".to_owned(), "int".to_owned(), "long".to_owned())]
        );
        // Added columns are optional even when the records require them.
        assert!(p.adds.iter().all(|(_, c)| !c.required));
        assert_eq!(p.adds[0].0.as_deref(), Some("address"));

        let mut p = Plan::default();
        let e = plan(
            &fields,
            &[Column::optional("price", ColumnType::String)],
            None,
            &mut p,
        )
        .unwrap_err();
        assert!(
            e.contains("column `price` is long") && e.contains("never done automatically"),
            "{e}"
        );
    }

    #[test]
    fn widened_types_keep_their_field_ids() {
        let fields = vec![field(1, "id", Type::Primitive(PrimitiveType::Int))];
        let widen = HashMap::from([("id".to_owned(), (PrimitiveType::Int, PrimitiveType::Long))]);
        let mut changed = Vec::new();
        let out = widened(&fields, &widen, &mut changed, None);
        assert_eq!(out[0].id, 1);
        assert_eq!(*out[0].field_type, Type::Primitive(PrimitiveType::Long));
        assert!(changed.is_empty());
        // Planned from int, but the column is a string now: refused.
        let now = vec![field(1, "id", Type::Primitive(PrimitiveType::String))];
        widened(&now, &widen, &mut changed, None);
        assert_eq!(changed.len(), 1, "{changed:?}");
    }
}
