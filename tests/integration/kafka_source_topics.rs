//! The Kafka source on topics as production has them, against a real
//! broker (`KAFKA_BOOTSTRAP`): written by transactional producers
//! (committed, aborted and open transactions, commit markers last), still
//! being written during a bounded run, growing partitions while a job
//! runs and while it is down, records deleted under the reader, a topic
//! deleted while read, and a reader that stalls while behind. Every
//! scenario checks that each committed record is read once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tinyflow_api::testing::CollectingSink;

use tinyflow_api::{JobBuilder, JobId, OperatorContext, Source, SourceFactory, StreamError};
use tinyflow_checkpoint::CheckpointConfig;
use tinyflow_checkpoint::testing::MemoryCheckpointStore;
use tinyflow_connectors_kafka::testing::{
    TxProducer, add_partitions, bootstrap, create_topic, create_topic_with, delete_records_before,
    delete_topic, produce, produce_in_batches_of, produce_stream,
};
use tinyflow_connectors_kafka::{
    Format, KafkaRecord, KafkaSource, KafkaSourceConfig, StartPosition,
};
use tinyflow_runtime::{JobRunner, RestartStrategy, RuntimeConfig, StopHandle};
use tinyflow_tests::broker::OwnBroker;
use tokio::time::Instant;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Rec {
    pub(crate) id: u64,
}

use crate::kafka_source::fresh_topic as fresh;

pub(crate) fn rec(id: u64) -> Vec<u8> {
    serde_json::to_vec(&Rec { id }).unwrap()
}

/// (partition, key, value) of ids `ids`, round-robin over `partitions`.
fn records(ids: std::ops::Range<u64>, partitions: i32) -> Vec<(i32, Vec<u8>, Vec<u8>)> {
    ids.map(|i| {
        (
            (i % partitions as u64) as i32,
            i.to_string().into_bytes(),
            rec(i),
        )
    })
    .collect()
}

fn runtime() -> RuntimeConfig {
    RuntimeConfig {
        checkpoint: CheckpointConfig {
            interval: Some(Duration::from_millis(100)),
            ..CheckpointConfig::default()
        },
        restart: RestartStrategy::None,
        channel_capacity: 2,
        chaining: true,
    }
}

/// Runs Kafka -> ids -> sink with `config` from `store` until the source
/// ends (bounded) or `stop` is requested; `slow` stretches the run.
async fn run(
    config: KafkaSourceConfig,
    parallelism: usize,
    store: &MemoryCheckpointStore,
    sink: &CollectingSink<u64>,
    stop: StopHandle,
    slow: bool,
) {
    let job = JobBuilder::new(JobId::new("kafka-topics").unwrap());
    job.source(
        "kafka",
        parallelism,
        KafkaSource::new(config, Format::<Rec>::json()),
    )
    .map("id", move |r: KafkaRecord<Rec>| {
        if slow && r.offset % 10 == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        r.value.id
    })
    .rebalance()
    .sink("out", 1, sink.clone());
    tokio::time::timeout(
        Duration::from_secs(120),
        JobRunner::new(job.build().unwrap(), Arc::new(store.clone()), runtime())
            .with_stop(stop)
            .run(),
    )
    .await
    .expect("the job ends within 120 s")
    .expect("the job succeeds");
}

/// An unbounded run until `done`, then a stop.
async fn run_until(
    config: KafkaSourceConfig,
    store: &MemoryCheckpointStore,
    sink: &CollectingSink<u64>,
    done: impl Fn() -> bool + Send + 'static,
    meanwhile: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let stop = StopHandle::new();
    let watcher = {
        let stop = stop.clone();
        tokio::spawn(async move {
            meanwhile.await;
            let deadline = Instant::now() + Duration::from_secs(60);
            while !done() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            stop.stop();
        })
    };
    run(config, 2, store, sink, stop, false).await;
    watcher.await.unwrap();
}

/// Each of `expected` once, nothing else.
pub(crate) fn assert_once(got: Vec<u64>, expected: impl Iterator<Item = u64>, what: &str) {
    let mut counts = BTreeMap::new();
    for id in got {
        *counts.entry(id).or_insert(0u32) += 1;
    }
    let expected: Vec<u64> = expected.collect();
    let twice: Vec<_> = counts
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(id, _)| *id)
        .collect();
    let missing: Vec<_> = expected
        .iter()
        .filter(|id| !counts.contains_key(id))
        .collect();
    let extra: Vec<_> = counts.keys().filter(|id| !expected.contains(id)).collect();
    assert!(
        twice.is_empty() && missing.is_empty() && extra.is_empty(),
        "{what}: {} twice (first {:?}), {} missing (first {:?}), {} unexpected (first {:?})",
        twice.len(),
        twice.iter().take(10).collect::<Vec<_>>(),
        missing.len(),
        missing.iter().take(10).collect::<Vec<_>>(),
        extra.len(),
        extra.iter().take(10).collect::<Vec<_>>()
    );
}

pub(crate) fn config(topic: &str, bounded: bool) -> KafkaSourceConfig {
    let mut c = KafkaSourceConfig::new(bootstrap(), &[topic], fresh("group"));
    c.bounded = bounded;
    c.batch_size = 100;
    c.commit_offsets = false;
    c
}

/// Committed, aborted and open transactions, every partition ending with
/// a transaction marker: a bounded run ends at the committed data of its
/// start (before the open transaction), reads no aborted record, and
/// leaves the open transaction to a later run; once it commits, an
/// unbounded run reads it and the records written after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_runs_on_transactional_topics_end_and_lose_nothing() {
    let topic = fresh("tx");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    let values = |ids: std::ops::Range<u64>| -> Vec<(i32, Vec<u8>)> {
        ids.map(|i| ((i % 2) as i32, rec(i))).collect()
    };
    let upstream = TxProducer::new(&bootstrap(), &topic, &fresh("upstream")).unwrap();
    upstream.send(&values(0..100)).unwrap();
    upstream.commit().unwrap();
    upstream.send(&values(1_000..1_020)).unwrap();
    upstream.abort().unwrap();
    upstream.send(&values(100..150)).unwrap();
    upstream.commit().unwrap();
    // Every partition's last entry is now a commit marker: the end offset
    // is one past it, and no record is ever delivered at the marker.
    let store = MemoryCheckpointStore::new();
    let sink = CollectingSink::new();
    let cfg = config(&topic, true);
    run(cfg.clone(), 2, &store, &sink, StopHandle::new(), false).await;
    assert_once(sink.committed(), 0..150, "bounded run after commit markers");

    // A transaction open when the next bounded run starts holds it back.
    let open = TxProducer::new(&bootstrap(), &topic, &fresh("open")).unwrap();
    open.send(&values(150..180)).unwrap();
    produce(&bootstrap(), &topic, &records(180..200, 2)).unwrap();
    // One sink for all runs, as one table.
    run(cfg.clone(), 2, &store, &sink, StopHandle::new(), false).await;
    assert_once(
        sink.committed(),
        0..150,
        "bounded run held back by an open transaction",
    );

    // Committed now: an unbounded run from the checkpoints reads it and
    // what came after it, each once.
    open.commit().unwrap();
    produce(&bootstrap(), &topic, &records(200..230, 2)).unwrap();
    let done = {
        let sink = sink.clone();
        move || sink.committed().len() >= 230
    };
    run_until(config(&topic, false), &store, &sink, done, async {}).await;
    assert_once(sink.committed(), 0..230, "unbounded run after the commit");
}

/// A bounded run (a backfill) on a topic a producer keeps writing: it
/// reads up to the end offsets of its start, and the next run reads the
/// rest: nothing it fetched past its end is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_run_on_a_topic_being_written_leaves_the_rest_for_the_next_run() {
    let topic = fresh("backfill");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    produce(&bootstrap(), &topic, &records(0..20_000, 2)).unwrap();
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (topic, writing) = (topic.clone(), Arc::clone(&writing));
        std::thread::spawn(move || {
            let mut next = 20_000u64;
            while writing.load(Ordering::SeqCst) && next < 200_000 {
                // Small producer batches: fetches return little past the end.
                produce_in_batches_of(&bootstrap(), &topic, 4_096, &records(next..next + 1_000, 2))
                    .unwrap();
                next += 1_000;
            }
            next
        })
    };
    let store = MemoryCheckpointStore::new();
    let first = CollectingSink::new();
    run(
        config(&topic, true),
        2,
        &store,
        &first,
        StopHandle::new(),
        true,
    )
    .await;
    writing.store(false, Ordering::SeqCst);
    let written = writer.join().unwrap();
    // Each partition's records up to where the run began, once each: id i
    // is in partition i % 2, so per partition the ids read run from the
    // first without a gap. (The partitions' ends need not line up: the
    // producer may have written one partition's share of a batch and not
    // yet the other's when the run began.)
    for p in 0..2u64 {
        let ids: Vec<u64> = first
            .committed()
            .into_iter()
            .filter(|id| id % 2 == p)
            .collect();
        let read = ids.len() as u64;
        assert_once(
            ids,
            (0..read).map(|k| k * 2 + p),
            &format!("partition {p} of the first bounded run"),
        );
    }
    assert!(
        first.committed().len() >= 20_000,
        "read {}",
        first.committed().len()
    );
    assert!(
        (first.committed().len() as u64) < written,
        "the producer wrote nothing during the bounded run; the test proves nothing"
    );
    // The same sink, as one table, for both runs: each record once.
    run(
        config(&topic, true),
        2,
        &store,
        &first,
        StopHandle::new(),
        false,
    )
    .await;
    assert_once(first.committed(), 0..written, "two bounded runs");
}

/// Partitions added while a job runs are found and read from their
/// start; partitions added while it is down are read from their start
/// too, even with `start = latest`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_added_while_running_or_down_are_read_once() {
    let topic = fresh("growing");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    produce(&bootstrap(), &topic, &records(0..100, 2)).unwrap();
    let mut cfg = config(&topic, false);
    cfg.partition_discovery = Some(Duration::from_millis(500));
    let store = MemoryCheckpointStore::new();
    let sink = CollectingSink::new();
    let grow = {
        let (topic, sink) = (topic.clone(), sink.clone());
        async move {
            while sink.committed().len() < 100 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            add_partitions(&bootstrap(), &topic, 4).await.unwrap();
            produce(&bootstrap(), &topic, &records(100..200, 4)).unwrap();
        }
    };
    let done = {
        let sink = sink.clone();
        move || sink.committed().len() >= 200
    };
    run_until(cfg.clone(), &store, &sink, done, grow).await;
    assert_once(sink.committed(), 0..200, "partitions added mid-run");

    // Down: two more partitions, records in all six; back with `latest`.
    add_partitions(&bootstrap(), &topic, 6).await.unwrap();
    produce(&bootstrap(), &topic, &records(200..260, 6)).unwrap();
    let mut latest = cfg.clone();
    latest.start = StartPosition::Latest;
    latest.partition_discovery = None;
    let done = {
        let sink = sink.clone();
        move || sink.committed().len() >= 260
    };
    run_until(latest, &store, &sink, done, async {}).await;
    assert_once(
        sink.committed(),
        0..260,
        "partitions added while down, start = latest",
    );
}

/// One source subtask reading `config`, driven by hand.
pub(crate) fn reader(config: KafkaSourceConfig) -> Box<dyn Source<KafkaRecord<Rec>>> {
    let ctx = OperatorContext {
        name: "kafka".into(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 128,
    };
    KafkaSource::new(config, Format::<Rec>::json())
        .create(&ctx, &[])
        .unwrap()
}

/// Reads until the reader fails (within `within`); returns the records
/// read and the error.
async fn read_until_error(
    reader: &mut Box<dyn Source<KafkaRecord<Rec>>>,
    within: Duration,
) -> (usize, StreamError) {
    let deadline = Instant::now() + within;
    let mut read = 0;
    loop {
        assert!(
            Instant::now() < deadline,
            "no error after {within:?} ({read} read)"
        );
        match reader.next_batch().await {
            Ok(Some(batch)) => read += batch.len(),
            Ok(None) => panic!("the source ended instead of failing"),
            Err(e) => return (read, e),
        }
    }
}

/// A reader that fetches little at a time, so the broker's state changes
/// under it while it is behind.
fn slow_fetching(topic: &str) -> KafkaSourceConfig {
    let mut c = config(topic, false);
    c.batch_size = 10;
    for (k, v) in [
        ("fetch.max.bytes", "1024"),
        ("message.max.bytes", "1024"),
        ("max.partition.fetch.bytes", "1024"),
        ("queued.max.messages.kbytes", "1"),
        ("queued.min.messages", "1"),
    ] {
        c.properties.insert(k.into(), v.into());
    }
    c
}

/// Records deleted under a reader (`kafka-delete-records`): the offset it
/// needs is gone, which fails the attempt for good, naming the topic,
/// instead of a silent stall or a silent skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_deleted_under_the_reader_fail_it_for_good() {
    let topic = fresh("deleted-records");
    create_topic(&bootstrap(), &topic, 1).await.unwrap();
    produce_in_batches_of(&bootstrap(), &topic, 512, &records(0..3_000, 1)).unwrap();
    let mut r = reader(slow_fetching(&topic));
    let mut read = 0;
    while read < 50 {
        read += r.next_batch().await.unwrap().unwrap().len();
    }
    delete_records_before(&bootstrap(), &topic, 0, 2_500)
        .await
        .unwrap();
    let started = Instant::now();
    let (_, e) = read_until_error(&mut r, Duration::from_secs(30)).await;
    let text = tinyflow_api::error_chain(&e);
    assert!(!e.is_retryable(), "retryable: {text}");
    assert!(text.contains(&topic), "{text}");
    assert!(text.to_lowercase().contains("offset"), "{text}");
    eprintln!("failed {:?} after the deletion: {text}", started.elapsed());
}

/// A topic deleted while read fails the attempt for good, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_deleted_while_read_fails_the_reader_for_good() {
    let topic = fresh("deleted-topic");
    create_topic(&bootstrap(), &topic, 2).await.unwrap();
    produce(&bootstrap(), &topic, &records(0..100, 2)).unwrap();
    let mut cfg = config(&topic, false);
    cfg.partition_discovery = Some(Duration::from_secs(1));
    let mut r = reader(cfg);
    let mut read = 0;
    while read < 100 {
        read += r.next_batch().await.unwrap().unwrap().len();
    }
    delete_topic(&bootstrap(), &topic).await.unwrap();
    let (_, e) = read_until_error(&mut r, Duration::from_secs(30)).await;
    let text = tinyflow_api::error_chain(&e);
    assert!(!e.is_retryable(), "retryable: {text}");
    assert!(text.contains(&topic) && text.contains("deleted"), "{text}");
}

/// A reader behind on a partition that cannot fetch (its broker is
/// gone) reports it, then fails after the stall limit instead of waiting
/// forever without a word; the error names the partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_stalled_while_behind_fails_after_the_limit() {
    let broker = OwnBroker::start();
    let topic = fresh("stall");
    create_topic(&broker.bootstrap, &topic, 1).await.unwrap();
    produce_in_batches_of(&broker.bootstrap, &topic, 512, &records(0..3_000, 1)).unwrap();
    let mut cfg = slow_fetching(&topic);
    cfg.bootstrap_servers = broker.bootstrap.clone();
    cfg.stall_warn = Duration::from_secs(1);
    cfg.stall_fail = Some(Duration::from_secs(4));
    let mut r = reader(cfg);
    let mut read = 0;
    // Statistics (once a second) must have reported the partition's end.
    let until = Instant::now() + Duration::from_millis(2_500);
    while read < 50 || Instant::now() < until {
        read += r.next_batch().await.unwrap().unwrap().len();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    broker.kill();
    let started = Instant::now();
    let (_, e) = read_until_error(&mut r, Duration::from_secs(40)).await;
    let text = tinyflow_api::error_chain(&e);
    assert!(e.is_retryable(), "a stall may heal on restart: {text}");
    assert!(
        text.contains("no progress") && text.contains(&format!("{topic}/0@")),
        "{text}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "failed before the limit: {text}"
    );
    drop(broker);
}

/// A bounded reader whose partition grows after its start: it reads up to
/// the end of its start and its position stays there, though it fetched
/// the records after it, so the next run reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_reader_keeps_its_position_at_the_end_of_its_start() {
    let topic = fresh("bounded-end");
    create_topic(&bootstrap(), &topic, 1).await.unwrap();
    produce(&bootstrap(), &topic, &records(0..1_000, 1)).unwrap();
    let mut cfg = config(&topic, true);
    // A poll that straddles the end.
    cfg.batch_size = 128;
    let mut r = reader(cfg);
    // Written after the start, before the first fetch: fetched with the rest.
    produce(&bootstrap(), &topic, &records(1_000..1_500, 1)).unwrap();
    let mut ids = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Some(batch) = r.next_batch().await.unwrap() {
        ids.extend(batch.into_iter().map(|rec| rec.value.id));
        assert!(Instant::now() < deadline, "no end after 30 s");
    }
    assert_once(ids, 0..1_000, "a bounded read");
    let at = r.positions();
    assert_eq!(
        at.get(&format!("{topic}/0")).map(String::as_str),
        Some("1000"),
        "{at:?}"
    );
}

/// Every codec a producer or a topic may use: records produced compressed
/// with each (and a topic the broker recompresses with zstd) are read once
/// each. Before zstd was built in, a zstd topic stalled the reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_codec_reads_every_record_once() {
    for codec in ["none", "gzip", "snappy", "lz4", "zstd"] {
        let topic = fresh(&format!("codec-{codec}"));
        create_topic(&bootstrap(), &topic, 2).await.unwrap();
        let n = 3_000u64;
        produce_stream(
            &bootstrap(),
            &topic,
            &[("compression.type", codec)],
            (0..n).map(|i| ((i % 2) as i32, rec(i))),
        )
        .unwrap();
        let ids = read_bounded(&topic).await;
        assert_once(ids, 0..n, &format!("a topic produced with {codec}"));
    }
    // The broker recompresses whatever producers send.
    let topic = fresh("codec-broker-zstd");
    create_topic_with(&bootstrap(), &topic, 1, &[("compression.type", "zstd")])
        .await
        .unwrap();
    produce(&bootstrap(), &topic, &records(0..1_000, 1)).unwrap();
    assert_once(
        read_bounded(&topic).await,
        0..1_000,
        "a topic the broker compresses with zstd",
    );
}

/// Every id a bounded reader of `topic` reads.
pub(crate) async fn read_bounded(topic: &str) -> Vec<u64> {
    read_bounded_with(config(topic, true)).await
}

/// Every id a bounded reader with `cfg` reads.
pub(crate) async fn read_bounded_with(cfg: KafkaSourceConfig) -> Vec<u64> {
    let topic = cfg.topics.join(",");
    let mut r = reader(cfg);
    let mut ids = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Some(batch) = r.next_batch().await.unwrap() {
        ids.extend(batch.into_iter().map(|rec| rec.value.id));
        assert!(Instant::now() < deadline, "{topic}: no end after 60 s");
    }
    ids
}
