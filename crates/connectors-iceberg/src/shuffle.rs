//! Hash distribution of rows over the writers by their table partition
//! (Flink's `write.distribution-mode = hash`): every row of a partition
//! reaches the same writer subtask, so each writer keeps one open file per
//! partition it owns instead of one per partition of the table, and writes
//! files per checkpoint in proportion to its share of the partitions.
//!
//! The route is a hash of the row's partition values, computed the way the
//! table computes them (iceberg's transform functions on the source
//! columns, found by name: the batches are not fitted to the table yet).
//! Routing only decides where a row is written, never what: a batch whose
//! partition values cannot be computed here (a missing column, a type the
//! writer will refuse or widen) goes round-robin, and the writer reports or
//! fits it as it would have anyway. The partition spec is the one the job
//! declares for the table (from the first batch on), then the table's own
//! as the writers load it; without a declared spec, batches sent before a
//! writer loaded the table (the first of a run) go round-robin too.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_select::take::take_record_batch;
use iceberg::spec::{PartitionSpec, Schema};
use iceberg::transform::{BoxedTransformFunction, create_transform_function};
use tinyflow_api::StreamResult;
use tinyflow_api::engine::{AnyBatch, Partitioner};

/// How rows reach the writer subtasks (`sink.distribution`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Distribution {
    /// By a hash of the row's table partition (the default): a writer
    /// writes only its share of the partitions. Unpartitioned tables get
    /// batches round-robin, as with `None`.
    #[default]
    Hash,
    /// Batches round-robin over the writers, whatever their partitions:
    /// every writer may open a file for every partition.
    None,
}

impl Distribution {
    /// Parses the job file's value (`hash` or `none`).
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "hash" => Ok(Distribution::Hash),
            "none" => Ok(Distribution::None),
            other => Err(format!("`{other}`: expected `hash` or `none`")),
        }
    }
}

/// One partition field as routing computes it.
struct Field {
    /// The source column's name in the table.
    column: String,
    transform: BoxedTransformFunction,
}

/// The table's partition fields, as set by the first writer to load it.
#[derive(Default)]
pub(crate) struct Routing {
    /// `None` until a writer loaded the table; empty when unpartitioned.
    fields: RwLock<Option<Arc<Vec<Field>>>>,
}

impl Routing {
    /// Takes the table's default partition spec (every writer of a run
    /// calls it with the same; a later run's writers with the spec then).
    pub(crate) fn set(&self, schema: &Schema, spec: &PartitionSpec) {
        let fields: Option<Vec<Field>> = spec
            .fields()
            .iter()
            .map(|f| {
                let column = schema.name_by_field_id(f.source_id)?.to_owned();
                let transform = create_transform_function(&f.transform).ok()?;
                Some(Field { column, transform })
            })
            .collect();
        // A transform iceberg cannot compute here: round-robin, as before
        // the spec was known.
        let Some(fields) = fields else {
            tracing::warn!(
                spec = %spec.spec_id(),
                "a partition transform cannot be computed for routing; rows go to the writers round-robin"
            );
            return;
        };
        *self
            .fields
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(fields));
    }

    /// Takes the partition fields a job declares for the table it creates,
    /// so that rows are routed from the first batch on (the writers set the
    /// table's own spec once they load it).
    pub(crate) fn declare(&self, partition: &[crate::config::PartitionField]) {
        let fields: Option<Vec<Field>> = partition
            .iter()
            .map(|p| {
                let transform = p.transform.parse::<iceberg::spec::Transform>().ok()?;
                Some(Field {
                    column: p.column.clone(),
                    transform: create_transform_function(&transform).ok()?,
                })
            })
            .collect();
        if let Some(fields) = fields {
            *self
                .fields
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(fields));
        }
    }

    fn fields(&self) -> Option<Arc<Vec<Field>>> {
        self.fields
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The partitioner on the edge into the writers.
pub(crate) struct ByPartition {
    pub(crate) routing: Arc<Routing>,
    /// The round-robin fallback's next target.
    pub(crate) next: AtomicUsize,
}

impl ByPartition {
    fn round_robin(&self, batches: Vec<RecordBatch>, targets: usize) -> Vec<(usize, AnyBatch)> {
        let at = self.next.fetch_add(1, Ordering::Relaxed) % targets;
        vec![(at, AnyBatch::new(batches))]
    }
}

impl Partitioner for ByPartition {
    fn partition(
        &self,
        batch: AnyBatch,
        _max_parallelism: u16,
        targets: usize,
    ) -> StreamResult<Vec<(usize, AnyBatch)>> {
        let batches: Vec<RecordBatch> = match batch.downcast() {
            Ok(b) => b,
            // Not record batches: the graph would not build; pass it on
            // whole for the writer to name the mismatch.
            Err(other) => return Ok(vec![(0, other)]),
        };
        let fields = match self.routing.fields() {
            Some(f) if !f.is_empty() && targets > 1 => f,
            _ => return Ok(self.round_robin(batches, targets.max(1))),
        };
        let mut out: Vec<Vec<RecordBatch>> = vec![Vec::new(); targets];
        let mut unrouted = Vec::new();
        for batch in batches {
            match split(&batch, &fields, targets) {
                Some(parts) => {
                    for (at, part) in parts {
                        out[at].push(part);
                    }
                }
                None => unrouted.push(batch),
            }
        }
        let mut routed: Vec<(usize, AnyBatch)> = out
            .into_iter()
            .enumerate()
            .filter(|(_, v)| !v.is_empty())
            .map(|(at, v)| (at, AnyBatch::new(v)))
            .collect();
        if !unrouted.is_empty() {
            routed.extend(self.round_robin(unrouted, targets));
        }
        Ok(routed)
    }
}

/// `batch` split by target: the rows of each target's partitions, in
/// their order; `None` when its partition values cannot be computed.
fn split(
    batch: &RecordBatch,
    fields: &[Field],
    targets: usize,
) -> Option<Vec<(usize, RecordBatch)>> {
    let rows = batch.num_rows();
    let mut hashes = vec![FNV_OFFSET; rows];
    for field in fields {
        let values = match batch.column_by_name(&field.column) {
            Some(column) => field.transform.transform(Arc::clone(column)).ok()?,
            // A missing optional column is null in every row: one route.
            None => {
                for h in &mut hashes {
                    *h = mix(*h, &[0xfe]);
                }
                continue;
            }
        };
        hash_into(&values, &mut hashes)?;
    }
    let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); targets];
    for (row, h) in hashes.iter().enumerate() {
        let at = (fmix64(*h) % targets as u64) as usize;
        rows_of[at].push(u32::try_from(row).ok()?);
    }
    if let Some(at) = rows_of.iter().position(|r| r.len() == rows) {
        return Some(vec![(at, batch.clone())]);
    }
    rows_of
        .into_iter()
        .enumerate()
        .filter(|(_, r)| !r.is_empty())
        .map(|(at, r)| {
            let indices = arrow_array::UInt32Array::from(r);
            take_record_batch(batch, &indices).ok().map(|b| (at, b))
        })
        .collect()
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn mix(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // A field separator, so that ("ab", "c") and ("a", "bc") differ.
    h ^ 0xff
}

/// murmur3's finaliser: spreads nearby values (consecutive buckets, days).
fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// Mixes each row's value of `values` into its hash; `None` for a type
/// routing does not hash (transform results are ints, dates, strings,
/// binaries, decimals and timestamps, all of which it does).
fn hash_into(values: &ArrayRef, hashes: &mut [u64]) -> Option<()> {
    let null = |i: usize| values.is_null(i);
    if let Some(strings) = values.as_string_opt::<i32>() {
        for (i, h) in hashes.iter_mut().enumerate() {
            *h = if null(i) {
                mix(*h, &[0xfe])
            } else {
                mix(*h, strings.value(i).as_bytes())
            };
        }
    } else if let Some(strings) = values.as_string_opt::<i64>() {
        for (i, h) in hashes.iter_mut().enumerate() {
            *h = if null(i) {
                mix(*h, &[0xfe])
            } else {
                mix(*h, strings.value(i).as_bytes())
            };
        }
    } else if let Some(bytes) = values.as_binary_opt::<i32>() {
        for (i, h) in hashes.iter_mut().enumerate() {
            *h = if null(i) {
                mix(*h, &[0xfe])
            } else {
                mix(*h, bytes.value(i))
            };
        }
    } else if let Some(bytes) = values.as_binary_opt::<i64>() {
        for (i, h) in hashes.iter_mut().enumerate() {
            *h = if null(i) {
                mix(*h, &[0xfe])
            } else {
                mix(*h, bytes.value(i))
            };
        }
    } else if let Some(bools) = values.as_boolean_opt() {
        for (i, h) in hashes.iter_mut().enumerate() {
            *h = if null(i) {
                mix(*h, &[0xfe])
            } else {
                mix(*h, &[u8::from(bools.value(i))])
            };
        }
    } else if let Some(width) = values.data_type().primitive_width() {
        let data = values.to_data();
        let buffer = data.buffers().first()?;
        let start = data.offset() * width;
        let bytes = buffer.as_slice().get(start..start + data.len() * width)?;
        for (i, (h, value)) in hashes.iter_mut().zip(bytes.chunks_exact(width)).enumerate() {
            *h = if null(i) {
                mix(*h, &[0xfe])
            } else {
                mix(*h, value)
            };
        }
    } else {
        return None;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use std::collections::{HashMap, HashSet};

    use arrow_array::{Int64Array, StringArray, TimestampMicrosecondArray};
    use iceberg::spec::{NestedField, PrimitiveType, Transform, Type};

    use super::*;

    fn schema() -> Schema {
        Schema::builder()
            .with_fields(vec![
                NestedField::required(1, "auction", Type::Primitive(PrimitiveType::Long)).into(),
                NestedField::optional(2, "channel", Type::Primitive(PrimitiveType::String)).into(),
                NestedField::required(3, "ts", Type::Primitive(PrimitiveType::Timestamptz)).into(),
            ])
            .build()
            .unwrap()
    }

    fn spec(schema: &Schema, fields: &[(&str, Transform)]) -> PartitionSpec {
        let mut b = PartitionSpec::builder(Arc::new(schema.clone()));
        for (column, transform) in fields {
            b = b
                .add_partition_field(*column, format!("{column}_p"), *transform)
                .unwrap();
        }
        b.build().unwrap()
    }

    fn batch(n: i64) -> RecordBatch {
        let day_us = 86_400_000_000i64;
        RecordBatch::try_from_iter([
            (
                "auction",
                Arc::new(Int64Array::from_iter_values(0..n)) as ArrayRef,
            ),
            (
                "channel",
                Arc::new(StringArray::from_iter(
                    (0..n).map(|i| (i % 5 != 0).then(|| format!("c{}", i % 3))),
                )),
            ),
            (
                "ts",
                Arc::new(
                    TimestampMicrosecondArray::from_iter_values(
                        (0..n).map(|i| (i % 30) * day_us + i),
                    )
                    .with_timezone("+00:00"),
                ),
            ),
        ])
        .unwrap()
    }

    fn route(p: &ByPartition, b: RecordBatch, targets: usize) -> Vec<(usize, RecordBatch)> {
        p.partition(AnyBatch::new(vec![b]), 128, targets)
            .unwrap()
            .into_iter()
            .flat_map(|(at, any)| {
                any.downcast::<RecordBatch>()
                    .unwrap()
                    .into_iter()
                    .map(move |b| (at, b))
            })
            .collect()
    }

    /// Every row arrives once, and every partition value at one writer
    /// only, for each transform a table is partitioned by.
    #[test]
    fn each_partition_reaches_one_writer_and_every_row_arrives_once() {
        let schema = schema();
        for fields in [
            vec![("auction", Transform::Bucket(256))],
            vec![("ts", Transform::Day)],
            vec![
                ("channel", Transform::Identity),
                ("auction", Transform::Truncate(10)),
            ],
            vec![("ts", Transform::Hour), ("auction", Transform::Bucket(16))],
        ] {
            let spec = spec(&schema, &fields);
            let routing = Arc::new(Routing::default());
            routing.set(&schema, &spec);
            let p = ByPartition {
                routing,
                next: AtomicUsize::new(0),
            };
            let mut owner: HashMap<String, usize> = HashMap::new();
            let mut seen = HashSet::new();
            let mut per_target = vec![0usize; 3];
            for round in 0..4 {
                let b = batch(2_000);
                for (at, part) in route(&p, b, 3) {
                    per_target[at] += part.num_rows();
                    let auctions = part
                        .column(0)
                        .as_primitive::<arrow_array::types::Int64Type>();
                    for row in 0..part.num_rows() {
                        assert!(
                            seen.insert((round, auctions.value(row))),
                            "{fields:?}: a row twice"
                        );
                        // The partition key as iceberg computes it.
                        let key: Vec<String> = fields
                            .iter()
                            .map(|(c, t)| {
                                let col = part.column_by_name(c).unwrap().slice(row, 1);
                                let v = create_transform_function(t)
                                    .unwrap()
                                    .transform(col)
                                    .unwrap();
                                arrow_cast::display::array_value_to_string(&v, 0).unwrap()
                            })
                            .collect();
                        let key = key.join("/");
                        let first = *owner.entry(key.clone()).or_insert(at);
                        assert_eq!(first, at, "{fields:?}: partition {key} at two writers");
                    }
                }
            }
            assert_eq!(seen.len(), 8_000, "{fields:?}: rows lost");
            assert!(
                per_target.iter().all(|n| *n > 0),
                "{fields:?}: a writer got nothing: {per_target:?}"
            );
        }
    }

    #[test]
    fn before_the_spec_is_known_and_for_unroutable_batches_it_is_round_robin() {
        let schema = schema();
        let routing = Arc::new(Routing::default());
        let p = ByPartition {
            routing: Arc::clone(&routing),
            next: AtomicUsize::new(0),
        };
        let targets: Vec<usize> = (0..4).map(|_| route(&p, batch(10), 2)[0].0).collect();
        assert_eq!(
            targets,
            vec![0, 1, 0, 1],
            "round-robin before the spec is known"
        );

        routing.set(
            &schema,
            &spec(&schema, &[("auction", Transform::Bucket(8))]),
        );
        // A column of a type the bucket transform does not take: whole.
        let odd = RecordBatch::try_from_iter([(
            "auction",
            Arc::new(arrow_array::Float32Array::from(vec![1.0, 2.0, 3.0])) as ArrayRef,
        )])
        .unwrap();
        let routed = route(&p, odd, 2);
        assert_eq!(routed.len(), 1);
        assert_eq!(routed[0].1.num_rows(), 3);
    }
}
