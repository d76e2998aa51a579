//! The Kafka source against a real Apache Kafka broker (started by
//! `cargo xtask ci`, address in `KAFKA_BOOTSTRAP`): exactly-once replay
//! from checkpoint offsets across failures, rescaling over partitions, bad
//! records, unknown topics, consumer-group offsets for monitoring, and
//! per-partition watermarks with an idle partition; JSON into Arrow
//! batches under each bad-record policy (fail, skip, dead-letter topic); a
//! broker of the test's own killed (SIGKILL) and restarted mid-run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arrow_array::{Array, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use serde::{Deserialize, Serialize};
use tinyflow_api::testing::CollectingSink;

use tinyflow_api::{
    JobBuilder, JobId, OperatorContext, Source, SourceFactory, SourceWatermark, StreamError,
};
use tinyflow_checkpoint::CheckpointConfig;
use tinyflow_checkpoint::testing::MemoryCheckpointStore;
use tinyflow_connectors_kafka::testing::{
    bootstrap, committed_offsets, create_topic, produce, produce_in_batches_of, produce_timed,
    read_topic,
};
use tinyflow_connectors_kafka::{
    BadRecordPolicy, EmbeddedKafka, EventTime, Format, JsonArrow, KafkaArrowSource, KafkaRecord,
    KafkaSource, KafkaSourceConfig,
};
use tinyflow_runtime::{Error, JobRunner, RestartStrategy, RuntimeConfig};
use tinyflow_tests::broker::OwnBroker;
use tinyflow_tests::run_in_memory;
use tokio::time::Instant;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Rec {
    pub(crate) id: u64,
}

/// A topic name no earlier run used.
pub(crate) fn fresh_topic(name: &str) -> String {
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

pub(crate) fn source_config(topic: &str, group: &str) -> KafkaSourceConfig {
    let mut c = KafkaSourceConfig::new(bootstrap(), &[topic], group);
    c.bounded = true;
    c.batch_size = 50;
    c
}

pub(crate) fn runtime_config(restart: RestartStrategy) -> RuntimeConfig {
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

/// Kafka with `config` -> (fails at the given record counts, once each)
/// -> ids -> sink.
pub(crate) async fn run_ids(
    config: KafkaSourceConfig,
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
        KafkaSource::new(config, Format::<Rec>::json()),
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

pub(crate) fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_from_checkpoint_offsets_has_no_duplicate_and_no_gap() {
    let topic = topic_with_ids("replay", 4, 3_000).await;
    let sink = CollectingSink::new();
    let group = fresh_topic("group");
    let attempts = run_ids(
        source_config(&topic, &group),
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

/// Consumer-group offsets are those of the completed checkpoint, never
/// positions the source read past it: a new job started from `committed`
/// would skip records otherwise. The source is driven by hand, as the
/// runtime would: read, snapshot, read on, complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_offsets_are_those_of_the_completed_checkpoint() {
    let topic = topic_with_ids("group-offsets", 1, 1_000).await;
    let group = fresh_topic("group");
    let mut config = source_config(&topic, &group);
    config.bounded = false;
    let ctx = OperatorContext {
        name: "kafka".into(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 128,
    };
    let mut reader = KafkaSource::new(config, Format::<Rec>::json())
        .create(&ctx, &[])
        .unwrap();
    let offset = |reader: &dyn Source<KafkaRecord<Rec>>| -> i64 {
        reader.positions()[&format!("{topic}/0")].parse().unwrap()
    };
    // Reads at least `n` more records.
    async fn read(reader: &mut Box<dyn Source<KafkaRecord<Rec>>>, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut got = 0;
        while got < n {
            assert!(Instant::now() < deadline, "{got} records after 20 s");
            got += reader.next_batch().await.unwrap().unwrap().len();
        }
    }
    // Waits until the group's offset is `expected` (commits are async).
    let group_reaches = |expected: i64| {
        let (topic, group) = (topic.clone(), group.clone());
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let now = committed_offsets(&bootstrap(), &group, &topic, 1).unwrap()[0];
                if now == Some(expected) {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "group offset {now:?}, expected {expected}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let id = tinyflow_api::CheckpointId::new;

    read(&mut reader, 100).await;
    reader.snapshot(id(1)).unwrap();
    let at_1 = offset(reader.as_ref());
    read(&mut reader, 100).await;
    assert!(offset(reader.as_ref()) > at_1);
    reader.checkpoint_complete(id(1)).await.unwrap();
    group_reaches(at_1).await;

    // Checkpoint 2 aborts (never completes); completing 3 covers it.
    reader.snapshot(id(2)).unwrap();
    read(&mut reader, 100).await;
    reader.snapshot(id(3)).unwrap();
    let at_3 = offset(reader.as_ref());
    read(&mut reader, 100).await;
    reader.checkpoint_complete(id(3)).await.unwrap();
    group_reaches(at_3).await;
    assert!(offset(reader.as_ref()) > at_3);
}

/// Each barrier carries the positions of the sources to the sink, merged
/// over the source subtasks; the last one holds the end of every partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barriers_carry_the_source_positions_to_the_sink() {
    let topic = topic_with_ids("positions", 4, 2_000).await;
    let group = fresh_topic("group");
    let job = PacedJob::spawn(
        "kafka-positions",
        source_config(&topic, &group),
        20,
        Duration::from_millis(2),
        Duration::from_millis(50),
    );
    let sink = job.sink.clone();
    let (_, ids) = job.finish(Duration::from_secs(60)).await;
    assert_eq!(ids, (0..2_000).collect::<Vec<_>>());
    let last = sink.last_positioned(0).expect("the sink saw barriers");
    let expected: std::collections::BTreeMap<String, String> = (0..4)
        .map(|p| (format!("{topic}/{p}"), "500".to_owned()))
        .collect();
    assert_eq!(sink.positions(last, 0).unwrap()["kafka"], expected);
    // Positions only grow from barrier to barrier.
    let mut before: std::collections::BTreeMap<String, i64> = Default::default();
    for c in 1..=last.get() {
        let Some(at) = sink.positions(tinyflow_api::CheckpointId::new(c), 0) else {
            continue;
        };
        for (name, offset) in &at["kafka"] {
            let offset: i64 = offset.parse().unwrap();
            let was = before.insert(name.clone(), offset).unwrap_or(0);
            assert!(
                offset >= was,
                "{name}: {was} then {offset} at checkpoint {c}"
            );
        }
    }
    assert_eq!(
        committed_offsets(&bootstrap(), &group, &topic, 4).unwrap(),
        vec![Some(500); 4]
    );
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
        if n <= 600 || fired.load(Ordering::SeqCst) {
            return false;
        }
        if checkpoints.persisted_ids().is_empty() {
            // Slow down until a checkpoint completes, so that a loaded
            // machine cannot read the whole topic before the failure fires.
            std::thread::sleep(Duration::from_millis(20));
            return false;
        }
        !fired.swap(true, Ordering::SeqCst)
    };
    let err = run_ids(
        source_config(&topic, &group),
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
        source_config(&topic, &group),
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
    let report = run_in_memory(
        job,
        runtime_config(RestartStrategy::FixedDelay {
            delay: Duration::from_millis(10),
            max_attempts: 2,
        }),
    )
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Timed {
    id: u64,
    ts: i64,
}

/// What one subtask reading a topic reports about event time.
struct Watch {
    reader: Box<dyn Source<KafkaRecord<Timed>>>,
    started: Instant,
    read: usize,
}

impl Watch {
    /// Reads until `stop` holds for the records read and the watermark (or
    /// 20 s pass), checking
    /// `invariant` on every (seconds since start, watermark) seen.
    async fn until(
        &mut self,
        stop: impl Fn(usize, SourceWatermark) -> bool,
        invariant: impl Fn(f64, SourceWatermark) -> Result<(), String>,
    ) -> SourceWatermark {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let batch = self.reader.next_batch().await.unwrap().unwrap();
            self.read += batch.len();
            let w = self.reader.watermark();
            invariant(self.started.elapsed().as_secs_f64(), w).unwrap();
            if stop(self.read, w) {
                return w;
            }
            assert!(Instant::now() < deadline, "still at {w:?} after 20 s");
        }
    }
}

/// Two partitions, one quiet: the watermark waits for the quiet one until
/// the idle timeout, then follows the other; once both have data it is
/// their minimum; once both are quiet the subtask reports itself idle.
/// The records' Kafka timestamps are an hour ahead of their `ts` field, so
/// the two ways of reading event time give different watermarks.
async fn quiet_partition_scenario(event_time: EventTime<Timed>, uses_field: bool) {
    const IDLE: Duration = Duration::from_secs(1);
    const LATE: i64 = 10;
    let shift = 3_600_000i64;
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
        - 2 * shift;
    // The event time the source should see for a record of field time `ts`.
    let seen = |ts: i64| if uses_field { ts } else { ts + shift };
    let record = |id: u64, p: i32, ts: i64| {
        (
            p,
            ts + shift,
            serde_json::to_vec(&Timed { id, ts }).unwrap(),
        )
    };
    let topic = fresh_topic("event-time");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();

    let mut config = KafkaSourceConfig::new(bootstrap(), &[&topic], fresh_topic("group"));
    config.commit_offsets = false;
    let source = KafkaSource::new(config, Format::<Timed>::json()).with_event_time(
        event_time
            .max_out_of_orderness(Duration::from_millis(LATE as u64))
            .idle_timeout(Some(IDLE)),
    );
    let started = Instant::now();
    let ctx = OperatorContext {
        name: "kafka".into(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 128,
    };
    let mut watch = Watch {
        reader: source.create(&ctx, &[]).unwrap(),
        started,
        read: 0,
    };
    // Partition 0's records come a while after the start, so it is still
    // active when partition 1 goes idle (idle timeouts count from the start
    // for partitions without records).
    tokio::time::sleep(Duration::from_millis(400)).await;
    let first: Vec<_> = (0..100).map(|i| record(i, 0, base + i as i64)).collect();
    produce_timed(&bootstrap(), &topic, &first).unwrap();
    // Partition 1 holds the watermark at its start until it is idle.
    let after_idle = watch
        .until(
            |_, w| w == SourceWatermark::At(seen(base + 99) - LATE),
            |secs, w| {
                if secs < IDLE.as_secs_f64() && w != SourceWatermark::At(i64::MIN) {
                    return Err(format!("{w:?} at {secs:.3} s, before partition 1 was idle"));
                }
                Ok(())
            },
        )
        .await;
    assert_eq!(watch.read, 100);
    assert!(started.elapsed() >= IDLE, "{after_idle:?} too early");

    // Both partitions get data: the watermark is their minimum.
    let second = vec![record(100, 0, base + 2_000), record(101, 1, base + 1_500)];
    produce_timed(&bootstrap(), &topic, &second).unwrap();
    let both = watch.until(|read, _| read == 102, |_, _| Ok(())).await;
    assert_eq!(both, SourceWatermark::At(seen(base + 1_500) - LATE));
    // Both quiet: the subtask is idle.
    watch
        .until(|_, w| w == SourceWatermark::Idle, |_, _| Ok(()))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watermarks_per_partition_with_an_idle_partition() {
    quiet_partition_scenario(EventTime::record_timestamp(), false).await;
    quiet_partition_scenario(EventTime::field(|t: &Timed| Some(t.ts)), true).await;
}

/// JSON records of a topic with five kinds of bad record among 300 good
/// ones, over 2 partitions: (topic, bad positions).
async fn topic_of_json_rows() -> (String, Vec<(i32, i64)>) {
    let topic = fresh_topic("json-rows");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    let bad_values: [&[u8]; 5] = [
        b"{not json",
        br#"{"id": "abc", "name": "x", "ts": 1}"#,
        br#"{"name": "no id", "ts": 1}"#,
        br#"{"id": 1, "ts": 1}{"id": 2, "ts": 2}"#,
        b"",
    ];
    let mut records = Vec::new();
    let mut bad = Vec::new();
    let mut next = [0i64; 2];
    let mut good = 0u64;
    let mut b = 0;
    for i in 0..305u64 {
        let p = (i % 2) as i32;
        let value = if i % 61 == 30 && b < bad_values.len() {
            bad.push((p, next[p as usize]));
            b += 1;
            bad_values[b - 1].to_vec()
        } else {
            good += 1;
            serde_json::to_vec(&serde_json::json!({
                "id": good - 1, "name": format!("n{}", good - 1), "ts": 1_000 + (good - 1) as i64, "extra": true
            }))
            .unwrap()
        };
        next[p as usize] += 1;
        records.push((p, format!("k{i}").into_bytes(), value));
    }
    assert_eq!((good, bad.len()), (300, 5));
    produce(&bootstrap(), &topic, &records).unwrap();
    (topic, bad)
}

fn row_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, true),
        Field::new("ts", DataType::Int64, false),
    ]))
}

/// (id, partition, offset) of each row of a batch with metadata columns.
fn rows_of(batch: RecordBatch) -> Vec<(u64, i32, i64)> {
    assert_eq!(batch.num_columns(), 7, "3 declared + 4 metadata columns");
    let col = |name: &str| batch.column_by_name(name).unwrap().clone();
    let ids = col("id");
    let ids = ids.as_any().downcast_ref::<Int64Array>().unwrap();
    let parts = col("_kafka_partition");
    let parts = parts.as_any().downcast_ref::<Int32Array>().unwrap();
    let offsets = col("_kafka_offset");
    let offsets = offsets.as_any().downcast_ref::<Int64Array>().unwrap();
    let names = col("name");
    let names = names.as_any().downcast_ref::<StringArray>().unwrap();
    (0..batch.num_rows())
        .map(|i| {
            assert_eq!(names.value(i), format!("n{}", ids.value(i)));
            (ids.value(i) as u64, parts.value(i), offsets.value(i))
        })
        .collect()
}

/// Reads `topic` into Arrow batches with `policy` through the runtime;
/// returns the ids and (partition, offset) of the rows read.
async fn run_arrow(topic: &str, policy: BadRecordPolicy) -> Result<Vec<(u64, i32, i64)>, Error> {
    let mut config = source_config(topic, &fresh_topic("group"));
    config.bad_records = policy;
    let sink = CollectingSink::<(u64, i32, i64)>::new();
    let job = JobBuilder::new(JobId::new("kafka-arrow").unwrap());
    let format = JsonArrow::new(row_schema()).with_metadata_columns();
    job.source("kafka", 2, KafkaArrowSource::new(config, format))
        .flat_map("rows", rows_of)
        .rebalance()
        .sink("out", 1, sink.clone());
    run_in_memory(
        job,
        runtime_config(RestartStrategy::FixedDelay {
            delay: Duration::from_millis(10),
            max_attempts: 2,
        }),
    )
    .await?;
    let mut rows = sink.committed();
    rows.sort_unstable();
    Ok(rows)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_into_arrow_batches_under_each_bad_record_policy() {
    let (topic, bad) = topic_of_json_rows().await;

    // Skip: every good row once, none of the bad, no position twice.
    let rows = run_arrow(&topic, BadRecordPolicy::Skip).await.unwrap();
    assert_eq!(
        rows.iter().map(|r| r.0).collect::<Vec<_>>(),
        (0..300).collect::<Vec<_>>()
    );
    let mut positions: Vec<(i32, i64)> = rows.iter().map(|r| (r.1, r.2)).collect();
    positions.sort_unstable();
    positions.dedup();
    assert_eq!(positions.len(), 300);
    assert!(
        bad.iter().all(|b| !positions.contains(b)),
        "a bad record's position was emitted"
    );

    // Dead letter: the same rows, and the five bad records in the topic
    // with reason and origin.
    let dlq = fresh_topic("dead-letters");
    create_topic(&bootstrap(), &dlq, 1).await.unwrap();
    let rows_dl = run_arrow(&topic, BadRecordPolicy::DeadLetter { topic: dlq.clone() })
        .await
        .unwrap();
    assert_eq!(rows_dl, rows);
    let letters = read_topic(&bootstrap(), &dlq, 5, Duration::from_secs(30)).unwrap();
    let mut origins: Vec<(i32, i64)> = letters
        .iter()
        .map(|l| {
            assert_eq!(
                l.header("tinyflow.source.topic").as_deref(),
                Some(topic.as_str())
            );
            assert!(
                l.header("tinyflow.error").is_some_and(|e| !e.is_empty()),
                "{l:?}"
            );
            assert!(l.key.as_ref().is_some_and(|k| k.starts_with(b"k")), "{l:?}");
            (
                l.header("tinyflow.source.partition")
                    .unwrap()
                    .parse()
                    .unwrap(),
                l.header("tinyflow.source.offset").unwrap().parse().unwrap(),
            )
        })
        .collect();
    origins.sort_unstable();
    let mut expected = bad.clone();
    expected.sort_unstable();
    assert_eq!(origins, expected);
    let reasons: Vec<String> = letters
        .iter()
        .filter_map(|l| l.header("tinyflow.error"))
        .collect();
    for needle in [
        "invalid JSON",
        "more than one JSON value",
        "empty value",
        "id",
    ] {
        assert!(
            reasons.iter().any(|r| r.contains(needle)),
            "no reason with {needle:?}: {reasons:?}"
        );
    }
    // The value of a bad record arrives unchanged.
    assert!(
        letters
            .iter()
            .any(|l| l.value.as_deref() == Some(&b"{not json"[..]))
    );

    // A dead-letter topic that does not exist fails at start, named.
    let missing = fresh_topic("no-such-dlq");
    let mut config = source_config(&topic, "g");
    config.bad_records = BadRecordPolicy::DeadLetter {
        topic: missing.clone(),
    };
    config
        .properties
        .insert("allow.auto.create.topics".into(), "false".into());
    let ctx = OperatorContext {
        name: "kafka".into(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 128,
    };
    let err = KafkaArrowSource::new(config, JsonArrow::new(row_schema()))
        .create(&ctx, &[])
        .err()
        .expect("a missing dead-letter topic is an error");
    assert!(err.to_string().contains(&missing), "{err}");

    // Fail: the first bad record read stops the job, named.
    let err = run_arrow(&topic, BadRecordPolicy::Fail).await.unwrap_err();
    let text = tinyflow_api::error_chain(&err);
    assert!(
        bad.iter()
            .any(|(p, o)| text.contains(&format!("{topic}/{p}@{o}"))),
        "{text}"
    );
}

/// The bad values of `hostile_and_lossy_values_are_bad_records_with_their_reason`
/// and the text of their reason in the error (`BadRecord`'s display).
fn hostile_values() -> Vec<(Vec<u8>, &'static str)> {
    let depth = 100_000;
    vec![
        (
            br#"{"id": 1.5, "name": "fraction", "ts": 1}"#.to_vec(),
            "not exactly representable in its column",
        ),
        (
            br#"{"id": 3, "name": "numeric string", "ts": "12"}"#.to_vec(),
            "not exactly representable in its column",
        ),
        (
            format!(
                r#"{{"id": {}{}, "name": "deep", "ts": 1}}"#,
                "[".repeat(depth),
                "]".repeat(depth)
            )
            .into_bytes(),
            "nested too deep",
        ),
        (
            format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth)).into_bytes(),
            "nested too deep",
        ),
        (
            format!(r#"{{"id": 4, "name": "{}", "ts": 1}}"#, "x".repeat(700_000)).into_bytes(),
            "record too large",
        ),
        (
            br#"{"id": 1e999999, "name": "huge", "ts": 1}"#.to_vec(),
            "not exactly representable in its column",
        ),
    ]
}

/// Reads `topic` (one partition) into Arrow batches with `policy` and a
/// 650 kB record limit (above the deep values, below the large one, below
/// the broker's 1 MB); returns the ids read.
async fn run_limited(topic: &str, policy: BadRecordPolicy) -> Result<Vec<u64>, Error> {
    let mut config = source_config(topic, &fresh_topic("group"));
    config.bad_records = policy;
    config.max_record_bytes = 650_000;
    let sink = CollectingSink::<u64>::new();
    let job = JobBuilder::new(JobId::new("kafka-hostile").unwrap());
    job.source(
        "kafka",
        1,
        KafkaArrowSource::new(config, JsonArrow::new(row_schema())),
    )
    .flat_map("ids", |batch: RecordBatch| {
        let ids = batch.column_by_name("id").unwrap().clone();
        let ids = ids.as_any().downcast_ref::<Int64Array>().unwrap().clone();
        ids.values().iter().map(|i| *i as u64).collect::<Vec<_>>()
    })
    .sink("out", 1, sink.clone());
    run_in_memory(job, runtime_config(RestartStrategy::None)).await?;
    let mut ids = sink.committed();
    ids.sort_unstable();
    Ok(ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_and_lossy_values_are_bad_records_with_their_reason() {
    let topic = fresh_topic("hostile");
    create_topic(&bootstrap(), &topic, 1).await.unwrap();
    let hostile = hostile_values();
    // 20 good rows around each bad value; offsets are positions.
    let mut records = Vec::new();
    let mut bad_offsets = Vec::new();
    let mut good = 0u64;
    for (bad, _) in &hostile {
        for _ in 0..20 {
            let value = serde_json::json!({"id": good, "name": format!("n{good}"), "ts": 1_000});
            records.push((0, Vec::new(), serde_json::to_vec(&value).unwrap()));
            good += 1;
        }
        bad_offsets.push(records.len() as i64);
        records.push((0, Vec::new(), bad.clone()));
    }
    produce(&bootstrap(), &topic, &records).unwrap();

    // Skip: every good row arrives, once, and the process lives.
    let ids = run_limited(&topic, BadRecordPolicy::Skip).await.unwrap();
    assert_eq!(ids, (0..good).collect::<Vec<_>>());

    // Dead letter: each bad value with its reason.
    let dlq = fresh_topic("hostile-dead-letters");
    create_topic(&bootstrap(), &dlq, 1).await.unwrap();
    let ids_dl = run_limited(&topic, BadRecordPolicy::DeadLetter { topic: dlq.clone() })
        .await
        .unwrap();
    assert_eq!(ids_dl, ids);
    let letters = read_topic(&bootstrap(), &dlq, hostile.len(), Duration::from_secs(30)).unwrap();
    assert_eq!(letters.len(), hostile.len());
    for l in &letters {
        let offset: i64 = l.header("tinyflow.source.offset").unwrap().parse().unwrap();
        let i = bad_offsets
            .iter()
            .position(|o| *o == offset)
            .unwrap_or_else(|| panic!("a dead letter from offset {offset}, not a bad one"));
        let error = l.header("tinyflow.error").unwrap();
        assert!(
            error.starts_with(hostile[i].1),
            "offset {offset}: {error:.300}"
        );
        assert!(error.len() <= 1100, "{} bytes of reason", error.len());
        assert_eq!(l.value.as_deref(), Some(&hostile[i].0[..]));
    }

    // Fail: the first bad record stops the job, named with its reason.
    let err = run_limited(&topic, BadRecordPolicy::Fail)
        .await
        .unwrap_err();
    let text = tinyflow_api::error_chain(&err);
    assert!(
        text.contains(&format!("{topic}/0@{}", bad_offsets[0])) && text.contains(hostile[0].1),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrow_event_time_from_a_column() {
    let topic = fresh_topic("arrow-time");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    // Partition 0 up to ts 1_198, partition 1 up to 1_099.
    let records: Vec<_> = (0..200i64)
        .map(|i| {
            let p = (i % 2) as i32;
            let ts = if p == 0 { 1_000 + i } else { 1_000 + i / 2 };
            let value = serde_json::json!({"id": i, "name": "n", "ts": ts});
            (p, Vec::new(), serde_json::to_vec(&value).unwrap())
        })
        .collect();
    produce(&bootstrap(), &topic, &records).unwrap();
    let mut config = source_config(&topic, "g");
    config.bounded = false;
    let source = KafkaArrowSource::new(config, JsonArrow::new(row_schema()))
        .with_event_time(EventTime::column("ts").idle_timeout(None));
    let ctx = OperatorContext {
        name: "kafka".into(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 128,
    };
    let mut reader = source.create(&ctx, &[]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut rows = 0;
    while rows < 200 {
        assert!(Instant::now() < deadline, "{rows} rows after 20 s");
        let batches = reader.next_batch().await.unwrap().unwrap();
        rows += batches.iter().map(RecordBatch::num_rows).sum::<usize>();
    }
    assert_eq!(rows, 200);
    // The minimum over the partitions of their highest `ts`.
    assert_eq!(reader.watermark(), SourceWatermark::At(1_099));

    // A column that is not there, or not a time, is named at start.
    for (column, needle) in [("nope", "not in the schema"), ("name", "expected int64")] {
        let err = KafkaArrowSource::new(source_config(&topic, "g"), JsonArrow::new(row_schema()))
            .with_event_time(EventTime::column(column))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains(column) && err.contains(needle), "{err}");
    }
}

/// `n` records `{"id": i, "pad": <1000 bytes>}` round-robin over 4
/// partitions: large enough that a small client queue holds few of them.
fn padded_ids(n: u64) -> Vec<(i32, Vec<u8>, Vec<u8>)> {
    let pad = "x".repeat(1_000);
    (0..n)
        .map(|i| {
            let value = serde_json::to_vec(&serde_json::json!({"id": i, "pad": pad})).unwrap();
            ((i % 4) as i32, Vec::new(), value)
        })
        .collect()
}

/// A running job `config` -> 2 source subtasks -> a map that pauses for
/// `pause` every `every` records -> ids -> sink, for outages mid-run.
struct PacedJob {
    run: tokio::task::JoinHandle<Result<tinyflow_runtime::JobReport, Error>>,
    seen: Arc<AtomicU64>,
    sink: CollectingSink<u64>,
}

impl PacedJob {
    fn spawn(
        name: &str,
        config: KafkaSourceConfig,
        every: u64,
        pause: Duration,
        restart_delay: Duration,
    ) -> PacedJob {
        let seen = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&seen);
        let sink = CollectingSink::new();
        let job = JobBuilder::new(JobId::new(name).unwrap());
        job.source("kafka", 2, KafkaSource::new(config, Format::<Rec>::json()))
            .map("id", move |r: KafkaRecord<Rec>| {
                if counted.fetch_add(1, Ordering::SeqCst).is_multiple_of(every) {
                    std::thread::sleep(pause);
                }
                r.value.id
            })
            .rebalance()
            .sink("out", 1, sink.clone());
        let runner = JobRunner::new(
            job.build().unwrap(),
            Arc::new(MemoryCheckpointStore::new()),
            runtime_config(RestartStrategy::FixedDelay {
                delay: restart_delay,
                max_attempts: 20,
            }),
        );
        PacedJob {
            run: tokio::spawn(async move { runner.run().await }),
            seen,
            sink,
        }
    }

    fn read(&self) -> u64 {
        self.seen.load(Ordering::SeqCst)
    }

    /// Waits until `n` records were read; panics if the job ended first.
    async fn wait_for(&mut self, n: u64) {
        while self.read() < n {
            if self.run.is_finished() {
                panic!(
                    "the job ended before the outage: {:?}",
                    (&mut self.run).await
                );
            }
            // Not tokio's timer: the slow map keeps the runtime's workers
            // busy, and this thread would wake late.
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for the job to end (within `limit`); returns what it committed.
    async fn finish(self, limit: Duration) -> (tinyflow_runtime::JobReport, Vec<u64>) {
        let report = tokio::time::timeout(limit, self.run)
            .await
            .expect("the job did not finish in time after the outage")
            .unwrap()
            .unwrap();
        (report, sorted(self.sink.committed()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_and_restarted_mid_run_loses_nothing() {
    const N: u64 = 10_000;
    let broker = OwnBroker::start();
    let topic = fresh_topic("restart");
    create_topic(&broker.bootstrap, &topic, 4).await.unwrap();
    // 1 KB values, so the client's 64 KB queue per partition holds few, in
    // small producer batches: a fetch returns at least one whole batch, and
    // the client must not hold the topic before the broker stops.
    produce_in_batches_of(&broker.bootstrap, &topic, 16_384, &padded_ids(N)).unwrap();

    let mut config = KafkaSourceConfig::new(&broker.bootstrap, &[&topic], fresh_topic("group"));
    config.bounded = true;
    config.batch_size = 100;
    // A small fetch queue: the records must come from the broker during
    // the whole run, not from what the client fetched before the stop.
    for (k, v) in [
        ("queued.max.messages.kbytes", "64"),
        ("max.partition.fetch.bytes", "16384"),
        ("reconnect.backoff.max.ms", "500"),
    ] {
        config.properties.insert(k.into(), v.into());
    }
    // About 20 s for the whole topic.
    let mut job = PacedJob::spawn(
        "kafka-restart",
        config,
        10,
        Duration::from_millis(20),
        Duration::from_millis(500),
    );
    job.wait_for(1_000).await;
    let broker = Arc::new(broker);
    let b = Arc::clone(&broker);
    let stopping = Instant::now();
    tokio::task::spawn_blocking(move || b.kill()).await.unwrap();
    tracing::info!(secs = stopping.elapsed().as_secs_f64(), "broker killed");
    let at_stop = job.read();
    std::thread::sleep(Duration::from_secs(2));
    let while_down = job.read() - at_stop;
    let b = Arc::clone(&broker);
    tokio::task::spawn_blocking(move || b.resume())
        .await
        .unwrap();
    // Records remained to be read from the broker after it came back, and
    // while it was down reading stalled once the client's small queue and
    // the job's channels were drained.
    assert!(
        at_stop + while_down < N - 1_000 && !job.run.is_finished(),
        "{at_stop} read when the broker stopped, {while_down} more while down: the restart tested nothing"
    );
    assert!(
        while_down < 2_000,
        "{while_down} records read while the broker was down: not from the broker"
    );
    let (report, ids) = job.finish(Duration::from_secs(120)).await;
    assert_eq!(ids, (0..N).collect::<Vec<_>>());
    tracing::info!(
        attempts = report.attempts,
        at_stop,
        while_down,
        "broker restart survived"
    );
}

/// Runs a one-source job with `config` that must fail; returns the error
/// text and the attempts made.
async fn failing_run(config: KafkaSourceConfig) -> (String, u32) {
    let sink = CollectingSink::new();
    let job = JobBuilder::new(JobId::new("kafka-faults").unwrap());
    job.source("kafka", 1, KafkaSource::new(config, Format::<Rec>::json()))
        .map("id", |r: KafkaRecord<Rec>| r.value.id)
        .sink("out", 1, sink);
    let err = run_in_memory(
        job,
        runtime_config(RestartStrategy::FixedDelay {
            delay: Duration::from_millis(10),
            max_attempts: 2,
        }),
    )
    .await
    .expect_err("the job must fail");
    let Error::JobFailed { attempts, .. } = &err else {
        panic!("{err:?}")
    };
    (tinyflow_api::error_chain(&err), *attempts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_broker_and_failed_authentication_are_clear_errors() {
    // Nothing listens on port 1: retried (it may come up), then a failure
    // naming the address and what the client saw.
    let mut config = KafkaSourceConfig::new("127.0.0.1:1", &["t"], "g");
    config.request_timeout = Duration::from_secs(2);
    let (text, attempts) = failing_run(config).await;
    assert!(attempts > 1, "not retried: {text}");
    assert!(
        text.contains("127.0.0.1:1") && text.contains("last client error"),
        "{text}"
    );

    // SASL against the plaintext listener: refused security settings fail
    // at once, for good, saying what to check; the password never appears.
    let mut config = KafkaSourceConfig::new(bootstrap(), &["t"], "g");
    config.request_timeout = Duration::from_secs(2);
    for (k, v) in [
        ("security.protocol", "SASL_PLAINTEXT"),
        ("sasl.mechanism", "PLAIN"),
        ("sasl.username", "tinyflow"),
        ("sasl.password", "hunter2"),
    ] {
        config.properties.insert(k.into(), v.into());
    }
    let (text, attempts) = failing_run(config).await;
    assert!(!text.contains("hunter2"), "{text}");
    assert_eq!(attempts, 1, "retried: {text}");
    assert!(
        text.contains(&bootstrap()) && text.contains("authentication failed: check sasl.mechanism"),
        "{text}"
    );
}

/// The embedded cluster (librdkafka's mock, what the demo runs on) feeds
/// the source, and its brokers going down and up mid-run lose nothing.
/// Only reading is shown here: the mock's transactions are fake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_cluster_feeds_the_source_through_an_outage() {
    const N: u64 = 4_000;
    let kafka = EmbeddedKafka::start(1).unwrap();
    let bootstrap = kafka.bootstrap_servers();
    kafka.create_topic("bids", 4).unwrap();
    produce_in_batches_of(&bootstrap, "bids", 4_096, &padded_ids(N)).unwrap();

    let mut config = KafkaSourceConfig::new(&bootstrap, &["bids"], "demo");
    config.bounded = true;
    config.batch_size = 50;
    config
        .properties
        .insert("max.partition.fetch.bytes".into(), "4096".into());
    config
        .properties
        .insert("queued.max.messages.kbytes".into(), "16".into());
    let mut job = PacedJob::spawn(
        "kafka-embedded",
        config,
        5,
        Duration::from_millis(10),
        Duration::from_millis(100),
    );
    job.wait_for(500).await;
    kafka.broker_down(-1).unwrap();
    let at_down = job.read();
    std::thread::sleep(Duration::from_secs(1));
    let while_down = job.read() - at_down;
    kafka.broker_up(-1).unwrap();
    assert!(
        at_down + while_down < N && !job.run.is_finished(),
        "{at_down} read before the outage, {while_down} during: it tested nothing"
    );
    // The pace allows about 1000 a second: reading stalled while down.
    assert!(
        while_down < 500,
        "{while_down} read while every broker was down"
    );
    let (_, ids) = job.finish(Duration::from_secs(60)).await;
    assert_eq!(ids, (0..N).collect::<Vec<_>>());
}
