//! Splitting a record batch by table partition, for the writers.
//!
//! iceberg's `RecordBatchPartitionSplitter` makes a `Literal` struct per
//! row, groups rows in a hash map of them, and then builds a mask and
//! filters the whole batch once per partition: its cost grows with rows
//! times partitions (a 64k-row batch over 128 partitions: 128 filters of
//! 64k rows). This one computes the partition values with iceberg's own
//! calculator, sorts the rows by them (stably: rows keep their order within
//! a partition), takes the batch once in that order and cuts it into one
//! slice per partition; only the first row of each partition is made a
//! `Literal`. Rows go to the same partitions as with iceberg's splitter,
//! except that float partition values are told apart by their bits: `-0.0`
//! and `0.0` (and NaNs of different bits) are separate parts, each keyed by
//! its own value, where iceberg's merges them under the first one seen.
//! Should the sort or the comparison refuse a partition value's type (no
//! transform result known today), iceberg's splitter does the split.

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{ArrayRef, RecordBatch, UInt32Array};
use arrow_ord::partition::partition;
use arrow_ord::sort::{SortColumn, lexsort_to_indices};
use arrow_select::take::{take, take_record_batch};
use iceberg::arrow::{
    PartitionValueCalculator, RecordBatchPartitionSplitter, arrow_struct_to_literal,
};
use iceberg::spec::{Literal, PartitionKey, PartitionSpec, SchemaRef};
use iceberg::{Error, ErrorKind};

/// Splits batches by the partition spec of a table.
pub(crate) struct Splitter {
    calculator: PartitionValueCalculator,
    spec: PartitionSpec,
    schema: SchemaRef,
    /// iceberg's, for partition values the sort does not take.
    fallback: RecordBatchPartitionSplitter,
}

impl Splitter {
    /// A splitter for tables of `spec` (partitioned) over `schema`.
    pub(crate) fn try_new(schema: SchemaRef, spec: PartitionSpec) -> iceberg::Result<Self> {
        let calculator = PartitionValueCalculator::try_new(&spec, &schema)?;
        let fallback = RecordBatchPartitionSplitter::try_new_with_computed_values(
            Arc::clone(&schema),
            Arc::new(spec.clone()),
        )?;
        Ok(Self {
            calculator,
            spec,
            schema,
            fallback,
        })
    }

    /// `batch`'s rows by partition, in the order of their partition values;
    /// the rows of each in the order they came.
    pub(crate) fn split(
        &self,
        batch: &RecordBatch,
    ) -> iceberg::Result<Vec<(PartitionKey, RecordBatch)>> {
        let rows = batch.num_rows();
        if rows == 0 {
            return Ok(Vec::new());
        }
        let values = self.calculator.calculate(batch)?;
        let Some(values) = values.as_struct_opt() else {
            return Err(Error::new(
                ErrorKind::Unexpected,
                "partition values are not a struct",
            ));
        };
        // One partition (a `day` table fed in real time): no copy.
        match partition(values.columns()) {
            Ok(ranges) if ranges.len() == 1 => {
                return Ok(vec![(self.key(values, 0)?, batch.clone())]);
            }
            Ok(_) => {}
            Err(_) => return self.fallback.split(batch),
        }
        let Ok(rows_u32) = u32::try_from(rows) else {
            return self.fallback.split(batch);
        };
        // The row number last: a stable sort.
        let mut keys: Vec<SortColumn> = values
            .columns()
            .iter()
            .map(|c| SortColumn {
                values: Arc::clone(c),
                options: None,
            })
            .collect();
        keys.push(SortColumn {
            values: Arc::new(UInt32Array::from_iter_values(0..rows_u32)),
            options: None,
        });
        let Ok(order) = lexsort_to_indices(&keys, None) else {
            // A partition value type the sort does not take.
            return self.fallback.split(batch);
        };
        let sorted_values: Vec<ArrayRef> = values
            .columns()
            .iter()
            .map(|c| take(c.as_ref(), &order, None))
            .collect::<Result<_, _>>()
            .map_err(arrow_error)?;
        let Ok(ranges) = partition(&sorted_values) else {
            return self.fallback.split(batch);
        };
        let sorted = take_record_batch(batch, &order).map_err(arrow_error)?;
        let sorted_struct =
            arrow_array::StructArray::try_new(values.fields().clone(), sorted_values, None)
                .map_err(arrow_error)?;
        ranges
            .ranges()
            .into_iter()
            .map(|range| {
                Ok((
                    self.key(&sorted_struct, range.start)?,
                    sorted.slice(range.start, range.len()),
                ))
            })
            .collect()
    }

    /// The partition key of row `row` of the partition values `values`.
    fn key(&self, values: &arrow_array::StructArray, row: usize) -> iceberg::Result<PartitionKey> {
        let one: ArrayRef = Arc::new(values.slice(row, 1));
        match arrow_struct_to_literal(&one, self.calculator.partition_type())?
            .into_iter()
            .next()
        {
            Some(Some(Literal::Struct(data))) => Ok(PartitionKey::new(
                self.spec.clone(),
                Arc::clone(&self.schema),
                data,
            )),
            _ => Err(Error::new(
                ErrorKind::DataInvalid,
                "partition value is not a struct literal or is null",
            )),
        }
    }
}

/// An Arrow error while splitting or gathering, as iceberg's.
pub(crate) fn arrow_error(e: arrow_schema::ArrowError) -> Error {
    Error::new(ErrorKind::Unexpected, "splitting a batch by partition").with_source(e)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use arrow_array::{Array, Int32Array, Int64Array, StringArray, TimestampMicrosecondArray};
    use iceberg::arrow::schema_to_arrow_schema;
    use iceberg::spec::{
        NestedField, PrimitiveType, Schema, Transform, Type, UnboundPartitionSpec,
    };

    use super::*;

    fn schema() -> SchemaRef {
        Arc::new(
            Schema::builder()
                .with_fields(vec![
                    NestedField::required(1, "id", Type::Primitive(PrimitiveType::Long)).into(),
                    NestedField::optional(2, "part", Type::Primitive(PrimitiveType::Int)).into(),
                    NestedField::optional(3, "name", Type::Primitive(PrimitiveType::String)).into(),
                    NestedField::optional(4, "ts", Type::Primitive(PrimitiveType::Timestamptz))
                        .into(),
                ])
                .build()
                .unwrap(),
        )
    }

    fn spec(schema: &SchemaRef) -> PartitionSpec {
        UnboundPartitionSpec::builder()
            .add_partition_field(2, "part", Transform::Identity)
            .unwrap()
            .add_partition_field(3, "name_trunc", Transform::Truncate(1))
            .unwrap()
            .add_partition_field(4, "ts_day", Transform::Day)
            .unwrap()
            .add_partition_field(1, "id_bucket", Transform::Bucket(7))
            .unwrap()
            .build()
            .bind(Arc::clone(schema))
            .unwrap()
    }

    /// Rows with nulls in every partition source column but `id`.
    fn batch(schema: &SchemaRef, rows: i64) -> RecordBatch {
        let arrow = Arc::new(schema_to_arrow_schema(schema).unwrap());
        let ids: Vec<i64> = (0..rows).map(|i| (i * 7919) % 1000).collect();
        RecordBatch::try_new(
            arrow,
            vec![
                Arc::new(Int64Array::from(ids.clone())),
                Arc::new(Int32Array::from(
                    ids.iter()
                        .map(|i| (i % 5 != 0).then_some((i % 3) as i32))
                        .collect::<Vec<_>>(),
                )),
                Arc::new(StringArray::from(
                    ids.iter()
                        .map(|i| {
                            (i % 11 != 0).then(|| format!("{}x{i}", (b'a' + (i % 4) as u8) as char))
                        })
                        .collect::<Vec<_>>(),
                )),
                Arc::new(
                    TimestampMicrosecondArray::from(
                        ids.iter()
                            .map(|i| (i % 13 != 0).then_some(i * 3_600_000_000))
                            .collect::<Vec<_>>(),
                    )
                    .with_timezone("+00:00"),
                ),
            ],
        )
        .unwrap()
    }

    /// Each partition's ids, in their order, by its path.
    fn by_path(parts: Vec<(PartitionKey, RecordBatch)>) -> BTreeMap<String, Vec<i64>> {
        let mut out = BTreeMap::new();
        for (key, part) in parts {
            let ids = part
                .column(0)
                .as_primitive::<arrow_array::types::Int64Type>();
            let previous = out.insert(key.to_path(), ids.values().to_vec());
            assert!(previous.is_none(), "{} twice", key.to_path());
        }
        out
    }

    #[test]
    fn splits_as_icebergs_splitter_does_keeping_row_order() {
        let schema = schema();
        let spec = spec(&schema);
        let ours = Splitter::try_new(Arc::clone(&schema), spec.clone()).unwrap();
        let theirs = RecordBatchPartitionSplitter::try_new_with_computed_values(
            Arc::clone(&schema),
            Arc::new(spec),
        )
        .unwrap();
        let b = batch(&schema, 5_000);
        let ours = by_path(ours.split(&b).unwrap());
        let theirs = by_path(theirs.split(&b).unwrap());
        assert!(ours.len() > 100, "{} partitions", ours.len());
        assert!(
            ours.keys().any(|p| p.contains("null")),
            "null partition values"
        );
        assert_eq!(ours, theirs);
        // Rows keep their order within a partition.
        let all: Vec<i64> = b
            .column(0)
            .as_primitive::<arrow_array::types::Int64Type>()
            .values()
            .to_vec();
        for ids in ours.values() {
            let positions: Vec<usize> = ids
                .iter()
                .scan(0usize, |from, id| {
                    let at = *from + all[*from..].iter().position(|x| x == id)?;
                    *from = at + 1;
                    Some(at)
                })
                .collect();
            assert_eq!(positions.len(), ids.len(), "rows out of order: {ids:?}");
        }
    }

    #[test]
    fn one_partition_is_the_batch_itself() {
        let schema = schema();
        let s = Splitter::try_new(Arc::clone(&schema), spec(&schema)).unwrap();
        let b = batch(&schema, 1);
        let repeated =
            arrow_select::concat::concat_batches(&b.schema(), &[b.clone(), b.clone(), b]).unwrap();
        let parts = s.split(&repeated).unwrap();
        assert_eq!(parts.len(), 1);
        assert_eq!(parts[0].1, repeated);
        // Not copied: the same buffers.
        assert_eq!(
            parts[0].1.column(0).to_data().buffers()[0].as_ptr(),
            repeated.column(0).to_data().buffers()[0].as_ptr()
        );
    }

    /// Float partition values: every part holds one value, bit for bit, and
    /// is keyed by it; nulls are one part.
    #[test]
    fn float_partitions_hold_one_value_each() {
        let schema: SchemaRef = Arc::new(
            Schema::builder()
                .with_fields(vec![
                    NestedField::optional(1, "x", Type::Primitive(PrimitiveType::Double)).into(),
                ])
                .build()
                .unwrap(),
        );
        let spec = UnboundPartitionSpec::builder()
            .add_partition_field(1, "x", Transform::Identity)
            .unwrap()
            .build()
            .bind(Arc::clone(&schema))
            .unwrap();
        let s = Splitter::try_new(Arc::clone(&schema), spec).unwrap();
        let values = vec![
            Some(1.5),
            Some(-0.0),
            None,
            Some(0.0),
            Some(f64::NAN),
            Some(1.5),
            None,
            Some(-0.0),
        ];
        let arrow = Arc::new(schema_to_arrow_schema(&schema).unwrap());
        let b = RecordBatch::try_new(
            arrow,
            vec![Arc::new(arrow_array::Float64Array::from(values.clone()))],
        )
        .unwrap();
        let parts = s.split(&b).unwrap();
        let mut rows = 0;
        for (key, part) in &parts {
            let x = part
                .column(0)
                .as_primitive::<arrow_array::types::Float64Type>();
            let key_value = match key.data().fields().first() {
                Some(Some(Literal::Primitive(iceberg::spec::PrimitiveLiteral::Double(v)))) => {
                    Some(v.0)
                }
                Some(None) => None,
                other => panic!("{other:?}"),
            };
            for i in 0..x.len() {
                let value = x.is_valid(i).then(|| x.value(i));
                assert_eq!(
                    value.map(f64::to_bits),
                    key_value.map(f64::to_bits),
                    "{value:?} under {key_value:?}"
                );
            }
            rows += part.num_rows();
        }
        assert_eq!(rows, values.len());
        assert_eq!(parts.len(), 5, "1.5, -0.0, 0.0, NaN, null");
    }

    #[test]
    fn an_empty_batch_has_no_partitions() {
        let schema = schema();
        let s = Splitter::try_new(Arc::clone(&schema), spec(&schema)).unwrap();
        assert!(s.split(&batch(&schema, 0)).unwrap().is_empty());
    }
}
