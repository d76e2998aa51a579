//! Kafka source decoding benchmarks: the JSON of one poll into one Arrow
//! batch, as `KafkaArrowSource` does it.
//!
//! - `decode/arrow-json/batch=1024`: the decoding before the pre-scan: a
//!   fresh arrow-json decoder per poll, each payload fed and checked to be
//!   one JSON value, one flush.
//! - `decode/json-arrow-decoder/batch=1024`: `JsonArrowDecoder` with the
//!   default limits: the pre-scan of each payload (size, depth, exact
//!   values), then the same decoding.
//!
//! Inputs: the first 1024 Nexmark bids of the fixed-seed generator
//! (`tinyflow_cli::nexmark::bids`, about 260 bytes each), schema of the
//! job file's `BID_FIELDS` (`long` as int64, `string` as utf8).

use std::hint::black_box;
use std::sync::Arc;

use arrow_json::ReaderBuilder;
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tinyflow_cli::nexmark::{BID_FIELDS, bids};
use tinyflow_connectors_kafka::{JsonArrow, JsonArrowDecoder, KafkaSourceConfig};

const BATCH: usize = 1024;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(
        BID_FIELDS
            .iter()
            .map(|(name, ty)| {
                let ty = if *ty == "long" {
                    DataType::Int64
                } else {
                    DataType::Utf8
                };
                Field::new(*name, ty, true)
            })
            .collect::<Vec<_>>(),
    ))
}

fn payloads() -> Vec<Vec<u8>> {
    bids()
        .take(BATCH)
        .map(|b| serde_json::to_vec(&b).expect("a bid serialises"))
        .collect()
}

fn decode(c: &mut Criterion) {
    let payloads = payloads();
    let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
    let schema = schema();
    let mut group = c.benchmark_group("decode");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function(format!("arrow-json/batch={BATCH}"), |b| {
        b.iter(|| {
            let mut decoder = ReaderBuilder::new(Arc::clone(&schema))
                .with_batch_size(BATCH + 1)
                .build_decoder()
                .expect("the schema decodes");
            for p in &refs {
                let before = decoder.len();
                let used = decoder.decode(p).expect("a bid is JSON");
                assert!(used == p.len() && !decoder.has_partial_record());
                assert_eq!(decoder.len(), before + 1);
            }
            black_box(decoder.flush().expect("bids fit").expect("a batch"))
        });
    });
    let mut decoder = JsonArrowDecoder::new(
        &JsonArrow::new(Arc::clone(&schema)),
        KafkaSourceConfig::DEFAULT_MAX_RECORD_BYTES,
        KafkaSourceConfig::DEFAULT_MAX_NESTING_DEPTH,
    );
    group.bench_function(format!("json-arrow-decoder/batch={BATCH}"), |b| {
        b.iter(|| {
            let (batch, bad) = decoder.decode(&refs);
            assert!(bad.iter().all(Option::is_none));
            black_box(batch.expect("a batch"))
        });
    });
    group.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
