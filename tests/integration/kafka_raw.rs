//! Records that are not JSON, and what rides beside the value: the raw
//! format (each value as it is, in one string or binary column), the key
//! and chosen headers as columns, against the real broker. Tombstones,
//! records without a key or a header, a header sent twice and a header
//! without a value each have a defined column value; bytes that are not
//! UTF-8 for a string column make the record bad, and the bad-record
//! policy decides (here: skip).

use std::collections::BTreeMap;

use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;
use tinyflow_api::{OperatorContext, SourceFactory, StreamError};
use tinyflow_connectors_kafka::testing::{ToProduce, bootstrap, create_topic, produce_records};
use tinyflow_connectors_kafka::{BadRecordPolicy, BytesAs, JsonArrow, KafkaArrowSource};

use crate::kafka_source::{fresh_topic, source_config};

/// What a row should hold: value, key, `trace-id` header, `blob` header.
type Row = (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<Vec<u8>>,
);

/// Record `i`: every fifth without a key, every seventh a tombstone, the
/// `trace-id` header on odd ones (sent twice on multiples of three: the last
/// counts; without a value on multiples of eleven), `blob` on even ones.
fn record(i: u32) -> (ToProduce, Row) {
    let key = (!i.is_multiple_of(5)).then(|| format!("k{i}"));
    let value = (!i.is_multiple_of(7)).then(|| format!("value {i}: not JSON {{"));
    let mut headers = Vec::new();
    let mut trace = None;
    if !i.is_multiple_of(2) {
        if i.is_multiple_of(3) {
            headers.push(("trace-id".to_owned(), Some(b"first".to_vec())));
        }
        let t = (!i.is_multiple_of(11)).then(|| format!("t-{i}"));
        headers.push(("trace-id".to_owned(), t.clone().map(String::into_bytes)));
        trace = t;
    }
    let blob = (i.is_multiple_of(2)).then(|| vec![0xff, 0x00, i as u8]);
    if let Some(b) = &blob {
        headers.push(("blob".to_owned(), Some(b.clone())));
    }
    headers.push(("other".to_owned(), Some(b"ignored".to_vec())));
    (
        ToProduce {
            partition: (i % 2) as i32,
            key: key.clone().map(String::into_bytes),
            value: value.clone().map(String::into_bytes),
            headers,
        },
        (value, key, trace, blob),
    )
}

fn format() -> JsonArrow {
    JsonArrow::raw("value", BytesAs::String)
        .with_key_column("key", BytesAs::String)
        .with_header_column("trace-id", "trace_id", BytesAs::String)
        .with_header_column("blob", "blob", BytesAs::Binary)
        .with_metadata_columns()
}

/// Every batch a bounded reader of `topic` with `format` reads.
async fn read_all(topic: &str, format: JsonArrow) -> Vec<RecordBatch> {
    let mut config = source_config(topic, &fresh_topic("group"));
    config.bad_records = BadRecordPolicy::Skip;
    let ctx = OperatorContext {
        name: "kafka".into(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 128,
    };
    let mut reader = KafkaArrowSource::new(config, format)
        .create(&ctx, &[])
        .unwrap();
    let mut batches = Vec::new();
    while let Some(mut b) = reader.next_batch().await.unwrap() {
        batches.append(&mut b);
    }
    batches
}

fn strings(batch: &RecordBatch, column: &str) -> Vec<Option<String>> {
    let c = batch.column_by_name(column).unwrap();
    assert_eq!(c.data_type(), &DataType::Utf8, "{column}");
    c.as_string::<i32>()
        .iter()
        .map(|v| v.map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_values_keys_and_headers_become_columns_each_record_once() {
    let topic = fresh_topic("raw");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    let n = 300u32;
    let (records, expected): (Vec<ToProduce>, Vec<Row>) = (0..n).map(record).unzip();
    // Bad for a string column: a value, a key and a header not UTF-8.
    let bad = [
        ToProduce {
            value: Some(vec![0xc3, 0x28]),
            ..ToProduce::default()
        },
        ToProduce {
            key: Some(vec![0xff]),
            value: Some(b"fine".to_vec()),
            ..ToProduce::default()
        },
        ToProduce {
            value: Some(b"fine".to_vec()),
            headers: vec![("trace-id".to_owned(), Some(vec![0xfe, 0xfe]))],
            ..ToProduce::default()
        },
    ];
    produce_records(&bootstrap(), &topic, &records[..150]).unwrap();
    produce_records(&bootstrap(), &topic, &bad).unwrap();
    produce_records(&bootstrap(), &topic, &records[150..]).unwrap();

    let batches = read_all(&topic, format()).await;
    let schema = format().output_schema();
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    assert_eq!(
        names,
        [
            "value",
            "key",
            "trace_id",
            "blob",
            "_kafka_topic",
            "_kafka_partition",
            "_kafka_offset",
            "_kafka_timestamp"
        ]
    );
    let mut got = BTreeMap::new();
    for b in &batches {
        assert_eq!(b.schema(), schema);
        let blobs = b.column_by_name("blob").unwrap();
        let blobs = blobs.as_binary::<i32>();
        let offsets = b.column_by_name("_kafka_offset").unwrap();
        let offsets = offsets.as_primitive::<arrow_array::types::Int64Type>();
        let partitions = b.column_by_name("_kafka_partition").unwrap();
        let partitions = partitions.as_primitive::<arrow_array::types::Int32Type>();
        let (values, keys, traces) = (
            strings(b, "value"),
            strings(b, "key"),
            strings(b, "trace_id"),
        );
        for i in 0..b.num_rows() {
            let row = (
                values[i].clone(),
                keys[i].clone(),
                traces[i].clone(),
                blobs.is_valid(i).then(|| blobs.value(i).to_vec()),
            );
            let at = (partitions.value(i), offsets.value(i));
            assert!(got.insert(at, row).is_none(), "{at:?} read twice");
        }
    }
    // Records land in produce order per partition: the good ones, the bad
    // ones skipped.
    let mut by_partition: BTreeMap<i32, Vec<Row>> = BTreeMap::new();
    for ((p, _), row) in got {
        by_partition.entry(p).or_default().push(row);
    }
    for p in 0..2 {
        let want: Vec<Row> = expected
            .iter()
            .enumerate()
            .filter(|(i, _)| (*i % 2) as i32 == p)
            .map(|(_, r)| r.clone())
            .collect();
        assert_eq!(
            by_partition.remove(&p).unwrap_or_default(),
            want,
            "partition {p}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_binary_values_are_kept_byte_for_byte() {
    let topic = fresh_topic("raw-binary");
    create_topic(&bootstrap(), &topic, 1).await.unwrap();
    let values: Vec<Option<Vec<u8>>> = (0..=255u8)
        .map(|b| (b != 7).then(|| vec![b, 0xff, 0x00, b]))
        .collect();
    let records: Vec<ToProduce> = values
        .iter()
        .map(|v| ToProduce {
            value: v.clone(),
            ..ToProduce::default()
        })
        .collect();
    produce_records(&bootstrap(), &topic, &records).unwrap();
    let batches = read_all(&topic, JsonArrow::raw("payload", BytesAs::Binary)).await;
    let got: Vec<Option<Vec<u8>>> = batches
        .iter()
        .flat_map(|b| {
            let c = b.column(0).as_binary::<i32>().clone();
            (0..c.len())
                .map(|i| c.is_valid(i).then(|| c.value(i).to_vec()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(got, values);
}

#[test]
fn a_column_named_twice_is_refused_before_connecting() {
    let format = JsonArrow::raw("value", BytesAs::String).with_key_column("value", BytesAs::Binary);
    let source = KafkaArrowSource::new(source_config("t", "g"), format);
    let err = source.validate().unwrap_err();
    assert!(matches!(err, StreamError::Config { .. }), "{err:?}");
    assert!(
        err.to_string().contains("column `value` is named twice"),
        "{err}"
    );
}

/// Every header in one map column: names to values in the order first
/// sent, a name sent twice with its last value, a header without a value
/// null, a record without headers an empty map; a value that is not UTF-8
/// for a string map makes the record bad.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_headers_become_one_map_column() {
    let topic = fresh_topic("raw-headers-map");
    create_topic(&bootstrap(), &topic, 1).await.unwrap();
    let h = |k: &str, v: Option<&str>| (k.to_owned(), v.map(|v| v.as_bytes().to_vec()));
    let records = [
        vec![h("trace-id", Some("t1")), h("tenant", Some("eu"))],
        vec![],
        vec![h("a", Some("1")), h("b", None), h("a", Some("2"))],
        vec![("bad".to_owned(), Some(vec![0xff]))],
        vec![h("z", Some(""))],
    ];
    let produce: Vec<ToProduce> = records
        .iter()
        .enumerate()
        .map(|(i, headers)| ToProduce {
            value: Some(format!("v{i}").into_bytes()),
            headers: headers.clone(),
            ..ToProduce::default()
        })
        .collect();
    produce_records(&bootstrap(), &topic, &produce).unwrap();
    let batches = read_all(
        &topic,
        JsonArrow::raw("value", BytesAs::String).with_all_headers("headers", BytesAs::String),
    )
    .await;
    let mut got = Vec::new();
    for b in &batches {
        let values = strings(b, "value");
        let maps = b.column_by_name("headers").unwrap().as_map().clone();
        for (i, value) in values.into_iter().enumerate() {
            let entries = maps.value(i);
            let keys = entries.column(0).as_string::<i32>();
            let vals = entries.column(1).as_string::<i32>();
            let pairs: Vec<(String, Option<String>)> = (0..entries.len())
                .map(|j| {
                    (
                        keys.value(j).to_owned(),
                        vals.is_valid(j).then(|| vals.value(j).to_owned()),
                    )
                })
                .collect();
            got.push((value.unwrap(), pairs));
        }
    }
    let s = |k: &str, v: Option<&str>| (k.to_owned(), v.map(str::to_owned));
    assert_eq!(
        got,
        vec![
            (
                "v0".to_owned(),
                vec![s("trace-id", Some("t1")), s("tenant", Some("eu"))]
            ),
            ("v1".to_owned(), vec![]),
            ("v2".to_owned(), vec![s("a", Some("2")), s("b", None)]),
            ("v4".to_owned(), vec![s("z", Some(""))]),
        ],
        "the record with a header not UTF-8 is skipped as bad"
    );
}
