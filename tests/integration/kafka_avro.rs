//! Avro values and the schema registry at the library level, against the
//! real broker: a registry that requires HTTP basic authentication is read
//! with the right credentials, and refused credentials fail the source at
//! once, naming the registry and without the password; a registry that is
//! not there holds the records back without losing any.

use std::time::Duration;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_schema::{DataType, Field, Schema};
use serde_json::json;
use tinyflow_api::{OperatorContext, SourceFactory, StreamError};
use tinyflow_connectors_kafka::registry::RegistryConfig;
use tinyflow_connectors_kafka::testing::{bootstrap, create_topic};
use tinyflow_connectors_kafka::{JsonArrow, KafkaArrowSource};
use tinyflow_tests::registry::{SchemaRegistry, produce_avro};

use crate::kafka_source::{fresh_topic, source_config};

const SECRET: &str = "registry-secret-7f3a";

type Reader = dyn tinyflow_api::Source<arrow_array::RecordBatch>;

/// Every id a bounded reader reads, sorted.
async fn read_ids(reader: &mut Reader) -> Vec<i64> {
    let mut ids = Vec::new();
    while let Some(batches) = reader.next_batch().await.unwrap() {
        for b in batches {
            ids.extend(
                b.column(0)
                    .as_primitive::<Int64Type>()
                    .values()
                    .iter()
                    .copied(),
            );
        }
    }
    ids.sort_unstable();
    ids
}

/// The error a reader that reads nothing fails with.
async fn first_error(reader: &mut Reader) -> StreamError {
    loop {
        match reader.next_batch().await {
            Ok(Some(b)) => assert!(b.is_empty(), "records read without their schema"),
            Ok(None) => panic!("the source ended without its schema"),
            Err(e) => return e,
        }
    }
}

fn ctx() -> OperatorContext {
    OperatorContext {
        name: "kafka".into(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 128,
    }
}

fn format(registry: RegistryConfig) -> JsonArrow {
    JsonArrow::avro(
        std::sync::Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)])),
        registry,
    )
}

/// A topic of `n` Avro records `{id: i}` written through `registry`.
async fn topic(registry: &SchemaRegistry, auth: &str, n: u64) -> String {
    let topic = fresh_topic("avro-auth");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    let schema =
        json!({"type": "record", "name": "Row", "fields": [{"name": "id", "type": "long"}]});
    let mut lines = vec![json!({"avro": schema})];
    lines.extend((0..n).map(|i| json!({"value": {"id": i}, "partition": i % 2})));
    produce_avro(
        &bootstrap(),
        &topic,
        &registry.url(),
        &lines,
        &[("TINYFLOW_REGISTRY_AUTH", auth)],
    );
    topic
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_with_basic_auth_is_read_with_its_credentials_and_refuses_wrong_ones_at_once() {
    let registry = SchemaRegistry::start_with_auth(&format!("tinyflow:{SECRET}"));
    let n = 200;
    let topic = topic(&registry, &format!("tinyflow:{SECRET}"), n).await;

    let good = RegistryConfig::new(registry.url()).basic_auth("tinyflow", SECRET);
    let mut reader = KafkaArrowSource::new(source_config(&topic, &fresh_topic("g")), format(good))
        .create(&ctx(), &[])
        .unwrap();
    let ids = read_ids(reader.as_mut()).await;
    assert_eq!(ids, (0..n as i64).collect::<Vec<_>>());

    let wrong = RegistryConfig::new(registry.url()).basic_auth("tinyflow", "not-the-secret-9");
    let mut reader = KafkaArrowSource::new(source_config(&topic, &fresh_topic("g")), format(wrong))
        .create(&ctx(), &[])
        .unwrap();
    let failed = tokio::time::timeout(Duration::from_secs(30), first_error(reader.as_mut()))
        .await
        .expect("refused credentials must fail the source, not stall it");
    let text = failed.to_string();
    assert!(
        matches!(
            failed,
            StreamError::External {
                retryable: false,
                ..
            }
        ),
        "{failed:?}"
    );
    assert!(
        text.contains(&registry.url()) && text.contains("401"),
        "{text}"
    );
    assert!(!text.contains("not-the-secret-9"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_whose_registry_is_down_wait_and_are_read_once_it_answers() {
    let mut registry = SchemaRegistry::start();
    let n = 300;
    let topic = topic(&registry, "", n).await;
    registry.stop();
    let mut reader = KafkaArrowSource::new(
        source_config(&topic, &fresh_topic("g")),
        format(RegistryConfig::new(registry.url())),
    )
    .create(&ctx(), &[])
    .unwrap();
    // A while of polls with the registry down: nothing is read, nothing
    // is lost, and the source does not end.
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < until {
        let b = reader
            .next_batch()
            .await
            .unwrap()
            .expect("the source goes on");
        assert!(b.is_empty(), "records read without their schema");
    }
    registry.restart();
    let ids = read_ids(reader.as_mut()).await;
    assert_eq!(ids, (0..n as i64).collect::<Vec<_>>(), "every record once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_registry_is_read_with_its_ca_and_refused_at_once_without_it() {
    let registry = SchemaRegistry::start_tls();
    let n = 100;
    let topic = topic_via(&registry, n).await;
    let trusted = RegistryConfig::new(registry.url()).ca_location(registry.ca_pem());
    let mut reader =
        KafkaArrowSource::new(source_config(&topic, &fresh_topic("g")), format(trusted))
            .create(&ctx(), &[])
            .unwrap();
    let ids = read_ids(reader.as_mut()).await;
    assert_eq!(ids, (0..n as i64).collect::<Vec<_>>());

    let untrusted = RegistryConfig::new(registry.url());
    let mut reader =
        KafkaArrowSource::new(source_config(&topic, &fresh_topic("g")), format(untrusted))
            .create(&ctx(), &[])
            .unwrap();
    let failed = tokio::time::timeout(Duration::from_secs(30), first_error(reader.as_mut()))
        .await
        .expect("an untrusted certificate must fail the source, not stall it");
    let text = failed.to_string();
    assert!(text.contains("ca_location"), "{text}");
}

/// A topic of `n` Avro records `{id: i}` written through an HTTPS
/// `registry` (the producer trusts its CA).
async fn topic_via(registry: &SchemaRegistry, n: u64) -> String {
    let topic = fresh_topic("avro-tls");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    let schema =
        json!({"type": "record", "name": "Row", "fields": [{"name": "id", "type": "long"}]});
    let mut lines = vec![json!({"avro": schema})];
    lines.extend((0..n).map(|i| json!({"value": {"id": i}, "partition": i % 2})));
    let ca = registry.ca_pem();
    produce_avro(
        &bootstrap(),
        &topic,
        &registry.url(),
        &lines,
        &[("TINYFLOW_REGISTRY_CA", ca.to_str().unwrap())],
    );
    topic
}
