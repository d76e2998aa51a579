//! Batches decoded with a writer's schema made into the table's columns: by
//! name (at every level of structs), with only the conversions that lose
//! nothing, a column the writer lacks null (if optional), and rows that
//! would put a null into a required column set apart as bad.
//!
//! This is Avro's schema resolution done on Arrow batches instead of on
//! each datum: the decoder decodes each writer schema as it is, so fields a
//! table lacks are seen (and refused under `strict`), not silently dropped.

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type};
use arrow_array::{
    Array, ArrayRef, BooleanArray, FixedSizeBinaryArray, ListArray, MapArray, RecordBatch,
    RecordBatchOptions, StringArray, StructArray, new_null_array,
};
use arrow_schema::{DataType, Field, FieldRef, Fields, SchemaRef, TimeUnit};

/// `batch` (decoded with a writer's schema) as a batch of `target`: the
/// batch of the good rows and the positions (in `batch`) of the rows that
/// have a null where `target` requires a value, with why. `Err` when no row
/// can fit (a column of a type that does not convert, a required column the
/// writer lacks, under `strict` a field the table lacks).
pub(crate) fn conform(
    batch: &RecordBatch,
    target: &SchemaRef,
    strict: bool,
) -> Result<(RecordBatch, Vec<(usize, String)>), String> {
    let source = batch.schema();
    if strict && let Some(extra) = extras(source.fields(), target.fields(), "") {
        return Err(format!("field `{extra}` is not a column of the table"));
    }
    let rows = batch.num_rows();
    // Every column first checked for type, so a bad type is reported even
    // when no row has a value.
    for t in target.fields() {
        match source.field_with_name(t.name()) {
            Ok(s) => convertible(s.data_type(), t.data_type(), t.name())?,
            Err(_) if t.is_nullable() => {}
            Err(_) => return Err(format!("required column `{}` is missing", t.name())),
        }
    }
    let mut bad = vec![None; rows];
    for t in target.fields() {
        if let Some(c) = batch.column_by_name(t.name()) {
            mark_nulls(c.as_ref(), t, t.name(), &mut |row, path| {
                bad[row].get_or_insert_with(|| format!("`{path}` is null; the column is required"));
            });
            // A cast that turns a value into null (a timestamp past the
            // range of a finer unit) loses it: that row is bad.
            let from = c.data_type();
            if from != t.data_type() && !from.is_nested() && !t.data_type().is_nested() {
                let cast = convert(c, t, t.name())?;
                if cast.null_count() > c.null_count() {
                    for (row, b) in bad.iter_mut().enumerate() {
                        if c.is_valid(row) && cast.is_null(row) {
                            b.get_or_insert_with(|| {
                                format!("`{}`: the value is out of the column's range", t.name())
                            });
                        }
                    }
                }
            }
        }
    }
    let bad: Vec<(usize, String)> = bad
        .into_iter()
        .enumerate()
        .filter_map(|(i, b)| Some((i, b?)))
        .collect();
    let batch = if bad.is_empty() {
        batch.clone()
    } else {
        let mut keep = vec![true; rows];
        for (i, _) in &bad {
            keep[*i] = false;
        }
        arrow_select::filter::filter_record_batch(batch, &BooleanArray::from(keep))
            .map_err(|e| e.to_string())?
    };
    let columns = target
        .fields()
        .iter()
        .map(|t| match batch.column_by_name(t.name()) {
            Some(c) => convert(c, t, t.name()),
            None => Ok(new_null_array(t.data_type(), batch.num_rows())),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let out = RecordBatch::try_new_with_options(
        Arc::clone(target),
        columns,
        &RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
    )
    .map_err(|e| e.to_string())?;
    Ok((out, bad))
}

/// The first field of `source` (at any level of structs) that `target`
/// lacks, as a dotted path.
pub(crate) fn extras(source: &Fields, target: &Fields, prefix: &str) -> Option<String> {
    for s in source {
        let path = format!("{prefix}{}", s.name());
        let Some((_, t)) = target.find(s.name()) else {
            return Some(path);
        };
        if let (DataType::Struct(sf), DataType::Struct(tf)) = (s.data_type(), t.data_type())
            && let Some(e) = extras(sf, tf, &format!("{path}."))
        {
            return Some(e);
        }
    }
    None
}

/// Whether values of `from` convert into `to` without loss.
fn convertible(from: &DataType, to: &DataType, path: &str) -> Result<(), String> {
    use DataType as D;
    let ok = match (from, to) {
        (a, b) if a == b && a.is_primitive() => true,
        (D::Boolean, D::Boolean)
        | (D::Utf8, D::Utf8)
        | (D::Binary, D::Binary)
        | (D::Int32, D::Int64 | D::Float64)
        | (D::Float32, D::Float64)
        | (D::Date32, D::Date32)
        | (D::FixedSizeBinary(_), D::Binary)
        | (D::FixedSizeBinary(16), D::Utf8) => true,
        (D::Dictionary(_, v), D::Utf8) => **v == D::Utf8,
        (D::Timestamp(f, ftz), D::Timestamp(t, ttz)) => {
            ftz.is_some() == ttz.is_some() && unit_rank(*f) <= unit_rank(*t)
        }
        (D::Decimal128(fp, fs), D::Decimal128(tp, ts)) => fs == ts && fp <= tp,
        (D::Struct(sf), D::Struct(tf)) => {
            for t in tf {
                match sf.find(t.name()) {
                    Some((_, s)) => convertible(
                        s.data_type(),
                        t.data_type(),
                        &format!("{path}.{}", t.name()),
                    )?,
                    None if t.is_nullable() => {}
                    None => {
                        return Err(format!("required field `{path}.{}` is missing", t.name()));
                    }
                }
            }
            true
        }
        (D::List(s), D::List(t)) => {
            return convertible(s.data_type(), t.data_type(), &format!("{path}[]"));
        }
        (D::Map(s, _), D::Map(t, _)) => {
            let (D::Struct(skv), D::Struct(tkv)) = (s.data_type(), t.data_type()) else {
                return Err(format!("`{path}` is a map without key and value"));
            };
            convertible(
                skv[0].data_type(),
                tkv[0].data_type(),
                &format!("{path}.key"),
            )?;
            return convertible(
                skv[1].data_type(),
                tkv[1].data_type(),
                &format!("{path}.value"),
            );
        }
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{path}` is {from} in the writer's schema and cannot become the column's {to} without loss"
        ))
    }
}

fn unit_rank(u: TimeUnit) -> u8 {
    match u {
        TimeUnit::Second => 0,
        TimeUnit::Millisecond => 1,
        TimeUnit::Microsecond => 2,
        TimeUnit::Nanosecond => 3,
    }
}

/// Calls `bad(row, path)` for each row of `array` that holds a null where
/// `target` requires a value (at any depth; a null struct or list hides
/// what is under it).
fn mark_nulls(array: &dyn Array, target: &Field, path: &str, bad: &mut dyn FnMut(usize, &str)) {
    if !target.is_nullable() && array.null_count() > 0 {
        for i in 0..array.len() {
            if array.is_null(i) {
                bad(i, path);
            }
        }
    }
    let valid = |i: usize| array.is_valid(i);
    match (array.data_type(), target.data_type()) {
        (DataType::Struct(_), DataType::Struct(tf)) => {
            let s = array.as_struct();
            for t in tf {
                if let Some(child) = s.column_by_name(t.name()) {
                    mark_nulls(
                        child.as_ref(),
                        t,
                        &format!("{path}.{}", t.name()),
                        &mut |row, p| {
                            if valid(row) {
                                bad(row, p);
                            }
                        },
                    );
                }
            }
        }
        (DataType::List(_), DataType::List(t)) => {
            let l = array.as_list::<i32>();
            let offsets = l.value_offsets();
            mark_nulls(l.values().as_ref(), t, &format!("{path}[]"), &mut |e, p| {
                let row = offsets.partition_point(|o| *o as usize <= e) - 1;
                if valid(row) {
                    bad(row, p);
                }
            });
        }
        (DataType::Map(_, _), DataType::Map(t, _)) => {
            let m = array.as_map();
            let offsets = m.value_offsets();
            let DataType::Struct(tkv) = t.data_type() else {
                return;
            };
            mark_nulls(
                m.values().as_ref(),
                &tkv[1],
                &format!("{path}.value"),
                &mut |e, p| {
                    let row = offsets.partition_point(|o| *o as usize <= e) - 1;
                    if valid(row) {
                        bad(row, p);
                    }
                },
            );
        }
        _ => {}
    }
}

/// `array` as values of `target` (checked by [`convertible`]).
fn convert(array: &ArrayRef, target: &FieldRef, path: &str) -> Result<ArrayRef, String> {
    let to = target.data_type();
    Ok(match (array.data_type(), to) {
        (DataType::Struct(_), DataType::Struct(tf)) => {
            let s = array.as_struct();
            let children = tf
                .iter()
                .map(|t| match s.column_by_name(t.name()) {
                    Some(c) => convert(c, t, &format!("{path}.{}", t.name())),
                    None => Ok(new_null_array(t.data_type(), s.len())),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Arc::new(
                StructArray::try_new(tf.clone(), children, s.nulls().cloned())
                    .map_err(|e| format!("`{path}`: {e}"))?,
            )
        }
        (DataType::List(_), DataType::List(t)) => {
            let l = array.as_list::<i32>();
            let values = convert(l.values(), t, &format!("{path}[]"))?;
            Arc::new(
                ListArray::try_new(
                    Arc::clone(t),
                    l.offsets().clone(),
                    values,
                    l.nulls().cloned(),
                )
                .map_err(|e| format!("`{path}`: {e}"))?,
            )
        }
        (DataType::Map(_, _), DataType::Map(t, sorted)) => {
            let m = array.as_map();
            let DataType::Struct(tkv) = t.data_type() else {
                return Err(format!("`{path}` is a map without key and value"));
            };
            let keys = convert(m.keys(), &tkv[0], &format!("{path}.key"))?;
            let values = convert(m.values(), &tkv[1], &format!("{path}.value"))?;
            let entries = StructArray::try_new(tkv.clone(), vec![keys, values], None)
                .map_err(|e| format!("`{path}`: {e}"))?;
            Arc::new(
                MapArray::try_new(
                    Arc::clone(t),
                    m.offsets().clone(),
                    entries,
                    m.nulls().cloned(),
                    *sorted,
                )
                .map_err(|e| format!("`{path}`: {e}"))?,
            )
        }
        (DataType::FixedSizeBinary(16), DataType::Utf8) => {
            // A UUID: its canonical text.
            let b: &FixedSizeBinaryArray = array.as_fixed_size_binary();
            Arc::new(b.iter().map(|v| v.map(uuid_text)).collect::<StringArray>())
        }
        (from, to) if from == to => Arc::clone(array),
        (DataType::Int32, DataType::Int64) => Arc::new(
            array
                .as_primitive::<Int32Type>()
                .unary::<_, Int64Type>(i64::from),
        ),
        _ => arrow_cast::cast(array.as_ref(), to).map_err(|e| format!("`{path}`: {e}"))?,
    })
}

fn uuid_text(b: &[u8]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// `field` (as arrow-avro decodes a writer's field) with the type a table
/// column of it takes: enums and UUIDs as strings, fixed as binary,
/// timestamps in microseconds, list elements named `element` and map
/// entries `key_value` (`key`, `value`) as Iceberg names them. An error for
/// a type no Iceberg column takes here (time of day, nanosecond
/// timestamps, durations).
pub(crate) fn table_field(field: &Field) -> Result<Field, String> {
    use DataType as D;
    let named = |name: &str, f: &Field| -> Result<FieldRef, String> {
        Ok(Arc::new(
            table_field(f)?
                .with_name(name)
                .with_metadata(Default::default()),
        ))
    };
    let ty = match field.data_type() {
        D::Dictionary(_, v) if **v == D::Utf8 => D::Utf8,
        D::FixedSizeBinary(16)
            if field.extension_type_name() == Some("arrow.uuid")
                || field.metadata().get("logicalType").map(String::as_str) == Some("uuid") =>
        {
            D::Utf8
        }
        D::FixedSizeBinary(_) | D::LargeBinary => D::Binary,
        D::LargeUtf8 => D::Utf8,
        D::Timestamp(TimeUnit::Nanosecond, _) => {
            return Err(format!(
                "`{}` holds nanoseconds, which no Iceberg v2 timestamp takes",
                field.name()
            ));
        }
        D::Timestamp(_, tz) => D::Timestamp(TimeUnit::Microsecond, tz.clone()),
        t @ (D::Boolean
        | D::Int32
        | D::Int64
        | D::Float32
        | D::Float64
        | D::Utf8
        | D::Binary
        | D::Date32
        | D::Decimal128(_, _)) => t.clone(),
        D::Struct(fields) => D::Struct(
            fields
                .iter()
                .map(|f| Ok(Arc::new(table_field(f)?.with_metadata(Default::default()))))
                .collect::<Result<Vec<FieldRef>, String>>()?
                .into(),
        ),
        D::List(e) | D::LargeList(e) => D::List(named("element", e)?),
        D::Map(entries, _) => match entries.data_type() {
            D::Struct(kv) if kv.len() == 2 => D::Map(
                Arc::new(Field::new(
                    "key_value",
                    D::Struct(vec![named("key", &kv[0])?, named("value", &kv[1])?].into()),
                    false,
                )),
                false,
            ),
            other => return Err(format!("`{}` is a map of {other}", field.name())),
        },
        other => {
            return Err(format!(
                "`{}` is {other}, which no Iceberg column takes here",
                field.name()
            ));
        }
    };
    Ok(Field::new(field.name(), ty, field.is_nullable()))
}

/// `target` grown to take records of `writer` (a writer schema as
/// arrow-avro decodes it): the fields it lacks added as nullable fields at
/// the end (of the columns, or of their struct, also inside lists and
/// maps), types widened where the writer's is wider and Iceberg allows
/// (int to long, float to double, a decimal's precision up). `None` when
/// `target` takes them as it is; an error naming the field when a type
/// neither converts nor widens.
pub fn grow(target: &Fields, writer: &Fields) -> Result<Option<Fields>, String> {
    let mut out: Vec<FieldRef> = target.iter().cloned().collect();
    let mut changed = false;
    for w in writer {
        let w = Arc::new(table_field(w)?);
        match out.iter().position(|t| t.name() == w.name()) {
            None => {
                out.push(Arc::new(w.as_ref().clone().with_nullable(true)));
                changed = true;
            }
            Some(i) => {
                if let Some(ty) = grow_type(out[i].data_type(), w.data_type(), w.name())? {
                    out[i] = Arc::new(out[i].as_ref().clone().with_data_type(ty));
                    changed = true;
                }
            }
        }
    }
    Ok(changed.then(|| out.into()))
}

fn grow_type(t: &DataType, w: &DataType, path: &str) -> Result<Option<DataType>, String> {
    use DataType as D;
    Ok(match (t, w) {
        (D::Struct(tf), D::Struct(wf)) => grow(tf, wf)
            .map_err(|e| format!("{path}.{e}"))?
            .map(D::Struct),
        (D::List(te), D::List(we)) => {
            grow_type(te.data_type(), we.data_type(), &format!("{path}[]"))?
                .map(|ty| D::List(Arc::new(te.as_ref().clone().with_data_type(ty))))
        }
        (D::Map(te, sorted), D::Map(we, _)) => {
            let (D::Struct(tkv), D::Struct(wkv)) = (te.data_type(), we.data_type()) else {
                return Err(format!("`{path}` is a map without key and value"));
            };
            grow_type(
                tkv[1].data_type(),
                wkv[1].data_type(),
                &format!("{path}.value"),
            )?
            .map(|ty| {
                let kv: Fields = vec![
                    Arc::clone(&tkv[0]),
                    Arc::new(tkv[1].as_ref().clone().with_data_type(ty)),
                ]
                .into();
                D::Map(
                    Arc::new(te.as_ref().clone().with_data_type(D::Struct(kv))),
                    *sorted,
                )
            })
        }
        (t, w) if convertible(w, t, path).is_ok() => None,
        (D::Int32, D::Int64) | (D::Float32, D::Float64) => Some(w.clone()),
        (D::Decimal128(tp, ts), D::Decimal128(wp, ws)) if ts == ws && wp > tp => Some(w.clone()),
        (t, w) => {
            return Err(format!(
                "`{path}` is {w} in the writer's schema; the column is {t}, which neither takes it without loss nor widens into it"
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use arrow_array::{Int32Array, Int64Array};
    use arrow_schema::Schema;

    use super::*;

    fn schema(fields: Vec<Field>) -> SchemaRef {
        Arc::new(Schema::new(fields))
    }

    #[test]
    fn columns_are_matched_by_name_widened_and_missing_optional_ones_are_null() {
        let source = RecordBatch::try_new(
            schema(vec![
                Field::new("b", DataType::Int32, true),
                Field::new("a", DataType::Int64, false),
            ]),
            vec![
                Arc::new(Int32Array::from(vec![Some(1), None])),
                Arc::new(Int64Array::from(vec![10, 20])),
            ],
        )
        .expect("a valid batch");
        let target = schema(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("b", DataType::Int64, true),
            Field::new("c", DataType::Utf8, true),
        ]);
        let (out, bad) = conform(&source, &target, false).expect("fits");
        assert!(bad.is_empty());
        assert_eq!(out.schema(), target);
        assert_eq!(
            out.column(0).as_primitive::<Int64Type>().values(),
            &[10, 20]
        );
        assert_eq!(out.column(1).as_primitive::<Int64Type>().value(0), 1);
        assert!(out.column(1).is_null(1));
        assert_eq!(out.column(2).null_count(), 2);
    }

    #[test]
    fn a_null_in_a_required_column_makes_only_its_row_bad() {
        let inner = Fields::from(vec![Field::new("city", DataType::Utf8, true)]);
        let source = RecordBatch::try_new(
            schema(vec![Field::new(
                "addr",
                DataType::Struct(inner.clone()),
                true,
            )]),
            vec![Arc::new(
                StructArray::try_new(
                    inner,
                    vec![Arc::new(StringArray::from(vec![Some("x"), None, None]))],
                    Some(vec![true, true, false].into()),
                )
                .expect("a valid struct"),
            )],
        )
        .expect("a valid batch");
        let target_inner = Fields::from(vec![Field::new("city", DataType::Utf8, false)]);
        let target = schema(vec![Field::new(
            "addr",
            DataType::Struct(target_inner),
            true,
        )]);
        let (out, bad) = conform(&source, &target, false).expect("fits");
        // Row 1 has a null city in a present address; row 2 has no address.
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].0, 1);
        assert!(bad[0].1.contains("`addr.city` is null"), "{}", bad[0].1);
        assert_eq!(out.num_rows(), 2);
    }

    #[test]
    fn lossy_conversions_missing_required_columns_and_strict_extras_fit_no_row() {
        let source = RecordBatch::try_new(
            schema(vec![Field::new("a", DataType::Int64, false)]),
            vec![Arc::new(Int64Array::from(vec![1]))],
        )
        .expect("a valid batch");
        let narrower = schema(vec![Field::new("a", DataType::Int32, false)]);
        let e = conform(&source, &narrower, false).unwrap_err();
        assert!(
            e.contains("`a` is Int64") && e.contains("without loss"),
            "{e}"
        );
        let more = schema(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("b", DataType::Int64, false),
        ]);
        let e = conform(&source, &more, false).unwrap_err();
        assert!(e.contains("required column `b` is missing"), "{e}");
        let fewer = schema(vec![Field::new("z", DataType::Int64, true)]);
        assert!(conform(&source, &fewer, false).is_ok());
        let e = conform(&source, &fewer, true).unwrap_err();
        assert!(e.contains("field `a` is not a column"), "{e}");
    }

    #[test]
    fn a_writer_schema_grows_the_columns_by_new_fields_and_wider_types_only() {
        let addr = Fields::from(vec![Field::new("city", DataType::Utf8, true)]);
        let target = Fields::from(vec![
            Field::new("id", DataType::Int32, false),
            Field::new("addr", DataType::Struct(addr.clone()), true),
        ]);
        // The same fields: nothing to grow.
        assert_eq!(grow(&target, &target).unwrap(), None);
        let waddr = Fields::from(vec![
            Field::new("city", DataType::Utf8, true),
            Field::new("zip", DataType::Utf8, false),
        ]);
        let writer = Fields::from(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("addr", DataType::Struct(waddr), true),
            Field::new(
                "at",
                DataType::Timestamp(TimeUnit::Millisecond, Some("+00:00".into())),
                false,
            ),
        ]);
        let grown = grow(&target, &writer).unwrap().unwrap();
        assert_eq!(grown[0].data_type(), &DataType::Int64);
        let DataType::Struct(a) = grown[1].data_type() else {
            panic!("a struct")
        };
        assert_eq!(a.len(), 2);
        assert_eq!(a[1].name(), "zip");
        assert_eq!(grown[2].name(), "at");
        assert!(grown[2].is_nullable(), "new columns are optional");
        assert_eq!(
            grown[2].data_type(),
            &DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into()))
        );
        // A writer narrower than the column needs nothing.
        let narrow = Fields::from(vec![Field::new("id", DataType::Int32, false)]);
        assert_eq!(grow(&grown, &narrow).unwrap(), None);
        // A change that is no widening is refused, naming the field.
        let other = Fields::from(vec![Field::new("id", DataType::Utf8, false)]);
        let e = grow(&target, &other).unwrap_err();
        assert!(e.contains("`id` is Utf8"), "{e}");
    }

    #[test]
    fn a_timestamp_past_the_range_of_a_finer_unit_makes_only_its_row_bad() {
        use arrow_array::TimestampMillisecondArray;
        let tz: Option<Arc<str>> = Some("+00:00".into());
        let source = RecordBatch::try_new(
            schema(vec![Field::new(
                "at",
                DataType::Timestamp(TimeUnit::Millisecond, tz.clone()),
                true,
            )]),
            vec![Arc::new(
                TimestampMillisecondArray::from(vec![Some(1), Some(i64::MAX), None])
                    .with_timezone_opt(tz.clone()),
            )],
        )
        .expect("a valid batch");
        let target = schema(vec![Field::new(
            "at",
            DataType::Timestamp(TimeUnit::Microsecond, tz),
            true,
        )]);
        let (out, bad) = conform(&source, &target, false).expect("fits");
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].0, 1);
        assert!(
            bad[0].1.contains("out of the column's range"),
            "{}",
            bad[0].1
        );
        assert_eq!(out.num_rows(), 2);
    }

    #[test]
    fn a_uuid_becomes_its_canonical_text() {
        assert_eq!(
            uuid_text(&[
                0x12, 0x3e, 0x45, 0x67, 0xe8, 0x9b, 0x12, 0xd3, 0xa4, 0x56, 0x42, 0x66, 0x14, 0x17,
                0x40, 0x00
            ]),
            "123e4567-e89b-12d3-a456-426614174000"
        );
    }
}
