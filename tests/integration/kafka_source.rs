//! The Kafka source against a real Apache Kafka broker (started by
//! `cargo xtask ci`, address in `KAFKA_BOOTSTRAP`): exactly-once replay
//! from checkpoint offsets across failures, rescaling over partitions, bad
//! records, unknown topics, and consumer-group offsets for monitoring.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tinyflow_api::testing::{CollectingSink, MemoryCheckpointStore};
use tinyflow_api::{JobBuilder, JobId, StreamError};
use tinyflow_checkpoint::CheckpointConfig;
use tinyflow_connectors_kafka::testing::{bootstrap, committed_offsets, create_topic, produce};
use tinyflow_connectors_kafka::{
    BadRecordPolicy, Format, KafkaRecord, KafkaSource, KafkaSourceConfig,
};
use tinyflow_runtime::{Error, JobRunner, RestartStrategy, RuntimeConfig};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Rec {
    id: u64,
}

/// A topic name no earlier run used.
fn fresh_topic(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{nanos}")
}

/// `n` records `{"id": i}` spread round-robin over `partitions`.
async fn topic_with_ids(name: &str, partitions: i32, n: u64) -> String {
    let topic = fresh_topic(name);
    create_topic(&bootstrap(), &topic, partitions)
        .await
        .unwrap();
    let records: Vec<_> = (0..n)
        .map(|i| {
            (
                (i % partitions as u64) as i32,
                i.to_string().into_bytes(),
                serde_json::to_vec(&Rec { id: i }).unwrap(),
            )
        })
        .collect();
    produce(&bootstrap(), &topic, &records).unwrap();
    topic
}

fn source_config(topic: &str, group: &str) -> KafkaSourceConfig {
    let mut c = KafkaSourceConfig::new(bootstrap(), &[topic], group);
    c.bounded = true;
    c.batch_size = 50;
    c
}

fn runtime_config(restart: RestartStrategy) -> RuntimeConfig {
    RuntimeConfig {
        checkpoint: CheckpointConfig {
            interval: Some(Duration::from_millis(50)),
            ..CheckpointConfig::default()
        },
        restart,
        channel_capacity: 2,
        chaining: true,
    }
}

/// Kafka -> (fails at the given record counts, once each) -> ids -> sink.
async fn run_ids(
    topic: &str,
    group: &str,
    parallelism: usize,
    fail_at: impl Fn(u64) -> bool + Send + Sync + 'static,
    store: &MemoryCheckpointStore,
    sink: &CollectingSink<u64>,
    restart: RestartStrategy,
) -> Result<u32, Error> {
    let seen = Arc::new(AtomicU64::new(0));
    let fail_at = Arc::new(fail_at);
    let job = JobBuilder::new(JobId::new("kafka-ids").unwrap());
    job.source(
        "kafka",
        parallelism,
        KafkaSource::new(source_config(topic, group), Format::<Rec>::json()),
    )
    .map("id", move |r: KafkaRecord<Rec>| {
        let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
        if fail_at(n) {
            panic!("injected failure at record {n}");
        }
        // Stretch the run over several checkpoint intervals.
        if n.is_multiple_of(20) {
            std::thread::sleep(Duration::from_millis(5));
        }
        r.value.id
    })
    .rebalance()
    .sink("out", 1, sink.clone());
    let report = JobRunner::new(
        job.build().unwrap(),
        Arc::new(store.clone()),
        runtime_config(restart),
    )
    .run()
    .await?;
    Ok(report.attempts)
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_from_checkpoint_offsets_has_no_duplicate_and_no_gap() {
    let topic = topic_with_ids("replay", 4, 3_000).await;
    let sink = CollectingSink::new();
    let group = fresh_topic("group");
    let attempts = run_ids(
        &topic,
        &group,
        2,
        |n| n == 700 || n == 1_900,
        &MemoryCheckpointStore::new(),
        &sink,
        RestartStrategy::FixedDelay {
            delay: Duration::from_millis(50),
            max_attempts: 5,
        },
    )
    .await
    .unwrap();
    // Two injected panics: two failed attempts, or one when the second
    // fires in the other subtask before the first failure stops it.
    assert!((2..=3).contains(&attempts), "{attempts} attempts");
    assert_eq!(sorted(sink.committed()), (0..3_000).collect::<Vec<_>>());
    // Offsets reached the consumer group after the final checkpoint (for lag
    // monitoring), one per partition: 750 records each.
    let committed = committed_offsets(&bootstrap(), &group, &topic, 4).unwrap();
    assert_eq!(committed, vec![Some(750); 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_with_another_parallelism_reads_every_partition_once() {
    let topic = topic_with_ids("rescale", 6, 2_400).await;
    let store = MemoryCheckpointStore::new();
    let sink = CollectingSink::new();
    let group = fresh_topic("group");
    // Three subtasks, failing for good part-way.
    let checkpoints = store.clone();
    let fired = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fail = move |n: u64| {
        n > 600 && !checkpoints.persisted_ids().is_empty() && !fired.swap(true, Ordering::SeqCst)
    };
    let err = run_ids(
        &topic,
        &group,
        3,
        fail,
        &store,
        &sink,
        RestartStrategy::None,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, Error::JobFailed { attempts: 1, .. }),
        "{err:?}"
    );
    assert!(
        !store.persisted_ids().is_empty(),
        "no checkpoint completed before the failure"
    );
    // The same job with two subtasks picks up every partition where the
    // checkpoint left it.
    let attempts = run_ids(
        &topic,
        &group,
        2,
        |_| false,
        &store,
        &sink,
        RestartStrategy::None,
    )
    .await
    .unwrap();
    assert_eq!(attempts, 1);
    assert_eq!(sorted(sink.committed()), (0..2_400).collect::<Vec<_>>());
}

/// A topic of JSON ids with three records that are not JSON, at known
/// partitions and offsets.
async fn topic_with_bad_records() -> (String, Vec<(i32, i64)>) {
    let topic = fresh_topic("bad-records");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    let mut records = Vec::new();
    let mut bad = Vec::new();
    let mut next = [0i64; 2];
    for i in 0..200u64 {
        let p = (i % 2) as i32;
        let value = if [33, 100, 171].contains(&i) {
            bad.push((p, next[p as usize]));
            b"{not json".to_vec()
        } else {
            serde_json::to_vec(&Rec { id: i }).unwrap()
        };
        next[p as usize] += 1;
        records.push((p, Vec::new(), value));
    }
    produce(&bootstrap(), &topic, &records).unwrap();
    (topic, bad)
}

async fn run_policy(
    topic: &str,
    policy: BadRecordPolicy,
    sink: &CollectingSink<u64>,
) -> Result<u32, Error> {
    let mut config = source_config(topic, &fresh_topic("group"));
    config.bad_records = policy;
    let job = JobBuilder::new(JobId::new("kafka-bad-records").unwrap());
    job.source("kafka", 1, KafkaSource::new(config, Format::<Rec>::json()))
        .map("id", |r: KafkaRecord<Rec>| r.value.id)
        .sink("out", 1, sink.clone());
    let report = JobRunner::new(
        job.build().unwrap(),
        Arc::new(MemoryCheckpointStore::new()),
        runtime_config(RestartStrategy::FixedDelay {
            delay: Duration::from_millis(10),
            max_attempts: 2,
        }),
    )
    .run()
    .await?;
    Ok(report.attempts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_records_fail_naming_their_position_or_are_skipped() {
    let (topic, bad) = topic_with_bad_records().await;

    let failing = CollectingSink::new();
    let err = run_policy(&topic, BadRecordPolicy::Fail, &failing)
        .await
        .unwrap_err();
    // Not retryable: the record would fail again; the job fails at once.
    let Error::JobFailed { attempts: 1, cause } = &err else {
        panic!("{err:?}")
    };
    let Error::Task {
        source:
            StreamError::BadRecord {
                topic: t,
                partition,
                offset,
                reason,
                ..
            },
        ..
    } = &**cause
    else {
        panic!("{cause:?}")
    };
    assert_eq!(t, &topic);
    assert!(
        bad.contains(&(*partition, *offset)),
        "({partition}, {offset}) is not one of {bad:?}"
    );
    assert!(reason.contains("invalid JSON"), "{reason}");
    let text = tinyflow_api::error_chain(&err);
    assert!(
        text.contains(&format!("{topic}/{partition}@{offset}")),
        "{text}"
    );

    let skipping = CollectingSink::new();
    assert_eq!(
        run_policy(&topic, BadRecordPolicy::Skip, &skipping)
            .await
            .unwrap(),
        1
    );
    let expected: Vec<u64> = (0..200).filter(|i| ![33, 100, 171].contains(i)).collect();
    assert_eq!(sorted(skipping.committed()), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_topic_is_a_clear_error() {
    let topic = fresh_topic("never-created");
    let sink = CollectingSink::new();
    let err = run_policy(&topic, BadRecordPolicy::Fail, &sink)
        .await
        .unwrap_err();
    let text = tinyflow_api::error_chain(&err);
    assert!(
        text.contains(&topic) && text.contains("source.topics"),
        "{text}"
    );
    assert!(
        matches!(err, Error::JobFailed { attempts: 1, .. }),
        "not retried: {err:?}"
    );
}
