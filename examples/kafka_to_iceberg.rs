//! Kafka to Iceberg with a custom operator in between, through the Rust API.
//!
//! Reads JSON bids `{"auction": 1, "bidder": 2, "price": 1234, "date_time":
//! 1767225600000}` from a Kafka topic into Arrow batches, keeps the bids of
//! at least `min_price` cents and adds a `price_eur` column (a custom
//! operator on record batches), and appends them exactly once to an Iceberg
//! table `demo.bids` in a sqlite catalog under `dir`, partitioned by day.
//!
//! `cargo run -p tinyflow-examples --example kafka_to_iceberg -- BOOTSTRAP TOPIC DIR [MIN_PRICE]`
//! (stop it with Ctrl-C; run it again and it goes on from its last
//! checkpoint in `DIR/checkpoints`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{ArrayRef, BooleanArray, Float64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use arrow_select::filter::filter_record_batch;
use tinyflow_api::prelude::*;
use tinyflow_connectors_iceberg::{
    CatalogConfig, Column, ColumnType, IcebergSink, IcebergSinkConfig, PartitionField, TableSpec,
};
use tinyflow_connectors_kafka::{EventTime, JsonArrow, KafkaArrowSource, KafkaSourceConfig};
use tinyflow_runtime::{
    CheckpointConfig, JobRunner, LocalDirStore, RestartStrategy, RuntimeConfig,
};

/// Keeps bids of at least `min_price` cents and adds `price_eur`: an
/// operator from record batches to record batches, one per subtask.
struct PriceFilter {
    name: String,
    min_price: i64,
    output: SchemaRef,
}

impl PriceFilter {
    fn apply(&self, batch: &RecordBatch) -> Result<RecordBatch, String> {
        let price = batch
            .column_by_name("price")
            .and_then(|c| c.as_primitive_opt::<Int64Type>())
            .ok_or("no int64 column `price`")?;
        let keep = BooleanArray::from_iter(
            price
                .iter()
                .map(|p| Some(p.is_some_and(|p| p >= self.min_price))),
        );
        let kept = filter_record_batch(batch, &keep).map_err(|e| e.to_string())?;
        let cents = kept
            .column_by_name("price")
            .and_then(|c| c.as_primitive_opt::<Int64Type>())
            .ok_or("no int64 column `price`")?;
        let eur: Float64Array = cents.iter().map(|c| c.map(|c| c as f64 / 100.0)).collect();
        let mut columns: Vec<ArrayRef> = kept.columns().to_vec();
        columns.push(Arc::new(eur));
        RecordBatch::try_new(Arc::clone(&self.output), columns).map_err(|e| e.to_string())
    }
}

impl Operator<RecordBatch, RecordBatch> for PriceFilter {
    fn process(
        &mut self,
        batches: Vec<RecordBatch>,
        out: &mut Output<'_, RecordBatch>,
    ) -> StreamResult<()> {
        let mut kept = Vec::with_capacity(batches.len());
        for b in &batches {
            // A batch that does not have the bid schema is a bug upstream.
            let filtered = self.apply(b).map_err(|message| StreamError::User {
                operator: self.name.clone(),
                message,
            })?;
            if filtered.num_rows() > 0 {
                kept.push(filtered);
            }
        }
        out.emit(kept);
        Ok(())
    }
}

fn bid_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("auction", DataType::Int64, false),
        Field::new("bidder", DataType::Int64, false),
        Field::new("price", DataType::Int64, false),
        Field::new("date_time", DataType::Int64, false),
    ]))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [bootstrap, topic, dir, rest @ ..] = args.as_slice() else {
        anyhow::bail!("usage: kafka_to_iceberg BOOTSTRAP TOPIC DIR [MIN_PRICE]");
    };
    let min_price: i64 = match rest.first() {
        Some(p) => p
            .parse()
            .context("MIN_PRICE: expected cents as an integer")?,
        None => 0,
    };
    let dir = PathBuf::from(dir);

    let input = bid_schema();
    let mut fields: Vec<Field> = input.fields().iter().map(|f| (**f).clone()).collect();
    fields.push(Field::new("price_eur", DataType::Float64, true));
    let output: SchemaRef = Arc::new(Schema::new(fields));

    let job = JobBuilder::new(JobId::new("kafka-to-iceberg")?);
    let source = KafkaArrowSource::new(
        KafkaSourceConfig::new(bootstrap.as_str(), &[topic.as_str()], "kafka-to-iceberg"),
        JsonArrow::new(Arc::clone(&input)),
    )
    .with_event_time(EventTime::column("date_time").max_out_of_orderness(Duration::from_secs(5)));
    let filtered =
        job.source("kafka", 2, source)
            .transform("price-filter", move |ctx: &OperatorContext| {
                Ok(PriceFilter {
                    name: format!("{}[{}]", ctx.name, ctx.subtask),
                    min_price,
                    output: Arc::clone(&output),
                })
            });
    let sink = IcebergSink::new(
        IcebergSinkConfig::new(
            CatalogConfig::sqlite(&dir),
            "demo",
            "bids",
            "kafka-to-iceberg",
        )
        .create_if_missing(TableSpec {
            columns: vec![
                Column::required("auction", ColumnType::Long),
                Column::required("bidder", ColumnType::Long),
                Column::required("price", ColumnType::Long),
                Column::required("date_time", ColumnType::Long),
                Column::optional("price_eur", ColumnType::Double),
            ],
            partition: vec![PartitionField::new("auction", "bucket[8]")],
        }),
    )?;
    sink.attach(filtered, "bids", 2);

    let store =
        LocalDirStore::open(dir.join("checkpoints"), JobId::new("kafka-to-iceberg")?, 3).await?;
    let config = RuntimeConfig {
        checkpoint: CheckpointConfig {
            interval: Some(Duration::from_secs(1)),
            ..CheckpointConfig::default()
        },
        restart: RestartStrategy::FixedDelay {
            delay: Duration::from_secs(1),
            max_attempts: 10,
        },
        ..RuntimeConfig::default()
    };
    let report = JobRunner::new(job.build()?, Arc::new(store), config)
        .run()
        .await?;
    tracing::info!(attempts = report.attempts, "job ended");
    Ok(())
}
