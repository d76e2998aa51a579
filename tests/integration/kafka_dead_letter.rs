//! The dead-letter topic against a real Apache Kafka broker
//! (`KAFKA_BOOTSTRAP`): each bad record lands there exactly once
//! (`read_committed`) across checkpoints that failed after their dead
//! letters were committed, crashes with a transaction open, a rescale that
//! leaves a transactional id without owner, and restarts of a job; a bad
//! record larger than the topic takes is sent truncated, saying so.

use std::time::Duration;

use tinyflow_api::testing::CollectingSink;

use tinyflow_api::{CheckpointId, JobBuilder, JobId, OperatorContext, Source, SourceFactory};
use tinyflow_checkpoint::testing::MemoryCheckpointStore;
use tinyflow_connectors_kafka::testing::{
    ReadBack, bootstrap, create_topic, create_topic_with, produce, read_topic,
};
use tinyflow_connectors_kafka::{
    BadRecordPolicy, Format, KafkaRecord, KafkaSource, KafkaSourceConfig,
};
use tinyflow_runtime::RestartStrategy;
use tinyflow_tests::run_in_memory;
use tokio::time::Instant;

use crate::kafka_source::{Rec, fresh_topic, run_ids, runtime_config, sorted, source_config};

/// `n` records over `partitions`, ids as JSON, except every `every`-th
/// (from the 5th), which is not JSON: (topic, positions of the bad ones,
/// ids of the good ones).
async fn topic_with_bad_records(
    name: &str,
    partitions: i32,
    n: u64,
    every: u64,
) -> (String, Vec<(i32, i64)>, Vec<u64>) {
    let topic = fresh_topic(name);
    create_topic(&bootstrap(), &topic, partitions)
        .await
        .unwrap();
    let mut records = Vec::new();
    let mut bad = Vec::new();
    let mut good = Vec::new();
    let mut next = vec![0i64; partitions as usize];
    for i in 0..n {
        let p = (i % partitions as u64) as i32;
        let value = if i % every == 4 {
            bad.push((p, next[p as usize]));
            format!("{{not json {i}").into_bytes()
        } else {
            good.push(i);
            serde_json::to_vec(&Rec { id: i }).unwrap()
        };
        next[p as usize] += 1;
        records.push((p, i.to_string().into_bytes(), value));
    }
    produce(&bootstrap(), &topic, &records).unwrap();
    bad.sort_unstable();
    (topic, bad, good)
}

fn dead_letter_config(topic: &str, group: &str, dlq: &str) -> KafkaSourceConfig {
    let mut config = source_config(topic, group);
    config.bad_records = BadRecordPolicy::DeadLetter {
        topic: dlq.to_owned(),
    };
    config
}

fn ctx(subtask: usize, parallelism: usize) -> OperatorContext {
    OperatorContext {
        name: "kafka".into(),
        subtask,
        parallelism,
        max_parallelism: 128,
    }
}

type Reader = Box<dyn Source<KafkaRecord<Rec>>>;

/// Reads until at least `n` more good records came, or the bounded end.
async fn read_good(reader: &mut Reader, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut got = 0;
    while got < n {
        assert!(Instant::now() < deadline, "{got} records after 60 s");
        match reader.next_batch().await.unwrap() {
            Some(batch) => got += batch.len(),
            None => return,
        }
    }
}

/// Reads to the bounded end.
async fn read_to_end(reader: &mut Reader) {
    read_good(reader, usize::MAX).await;
}

/// The dead letters in `dlq` (`read_committed`): waits for `expected` of
/// them, then a while longer for any extra.
fn dead_letters(dlq: &str, expected: usize) -> Vec<ReadBack> {
    let letters = read_topic(&bootstrap(), dlq, expected, Duration::from_secs(60)).unwrap();
    assert_eq!(letters.len(), expected, "dead letters after 60 s");
    // Anything more would be a duplicate: give it time to show.
    read_topic(&bootstrap(), dlq, expected + 1, Duration::from_secs(5)).unwrap()
}

/// The origin (partition, offset) each dead letter names, sorted, after
/// checking it names `topic`.
fn origins(letters: &[ReadBack], topic: &str) -> Vec<(i32, i64)> {
    let mut out: Vec<(i32, i64)> = letters
        .iter()
        .map(|l| {
            assert_eq!(
                l.header("tinyflow.source.topic").as_deref(),
                Some(topic),
                "{l:?}"
            );
            (
                l.header("tinyflow.source.partition")
                    .unwrap()
                    .parse()
                    .unwrap(),
                l.header("tinyflow.source.offset").unwrap().parse().unwrap(),
            )
        })
        .collect();
    out.sort_unstable();
    out
}

/// Two subtasks commit dead letters in a checkpoint that then fails and
/// crash with a transaction open; the job comes back from the checkpoint
/// before at parallelism 1 (so one transactional id has no owner any more),
/// commits dead letters in another failed checkpoint and crashes again with
/// a transaction open; then at parallelism 2 it reads to the end. Each bad
/// record is in the topic once, with its value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_land_once_across_failed_checkpoints_crashes_and_a_rescale() {
    // Every 9th: bad records in both partitions.
    let (topic, bad, _) = topic_with_bad_records("dl-crashes", 2, 800, 9).await;
    assert_eq!(bad.len(), 89);
    let dlq = fresh_topic("dl-crashes-dlq");
    create_topic(&bootstrap(), &dlq, 2).await.unwrap();
    let config = dead_letter_config(&topic, &fresh_topic("group"), &dlq);
    let source = KafkaSource::new(config, Format::<Rec>::json());
    let id = CheckpointId::new;

    // Attempt 1, two subtasks: checkpoint 1 at the start completes;
    // checkpoint 2 commits dead letters, then fails; both crash with more
    // dead letters in open transactions.
    let mut a: Vec<Reader> = (0..2)
        .map(|s| source.create(&ctx(s, 2), &[]).unwrap())
        .collect();
    let checkpoint_1: Vec<Vec<u8>> = a.iter_mut().map(|r| r.snapshot(id(1)).unwrap()).collect();
    for r in &mut a {
        read_good(r, 90).await;
        r.snapshot(id(2)).unwrap();
        read_good(r, 45).await;
    }
    // Let the open transactions' dead letters reach the broker: then they
    // hold back read_committed readers until aborted.
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(a);

    // Attempt 2 restores checkpoint 1 at parallelism 1: subtask 0 aborts
    // what id 1 left open, or reading the topic back would wait for the
    // transaction to time out. Checkpoint 3 completes, 4 commits dead
    // letters and fails, and it crashes with a transaction open.
    let mut b = source.create(&ctx(0, 1), &checkpoint_1).unwrap();
    read_good(&mut b, 200).await;
    let checkpoint_3 = vec![b.snapshot(id(3)).unwrap()];
    read_good(&mut b, 150).await;
    b.snapshot(id(4)).unwrap();
    read_good(&mut b, 60).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(b);

    // Attempt 3 restores checkpoint 3 at parallelism 2 and reads to the end.
    let mut c: Vec<Reader> = (0..2)
        .map(|s| source.create(&ctx(s, 2), &checkpoint_3).unwrap())
        .collect();
    for r in &mut c {
        read_to_end(r).await;
        r.snapshot(id(5)).unwrap();
    }
    drop(c);

    let letters = dead_letters(&dlq, bad.len());
    assert_eq!(origins(&letters, &topic), bad, "each bad record once");
    for l in &letters {
        let offset = l.header("tinyflow.source.offset").unwrap();
        let value = String::from_utf8(l.value.clone().unwrap()).unwrap();
        assert!(value.starts_with("{not json "), "{value:?} at {offset}");
        assert_eq!(l.header("tinyflow.truncated"), None);
    }
}

/// A job with the dead-letter policy, failing at several points and
/// restarted from its checkpoints: every good record once in the sink,
/// every bad record once in the dead-letter topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_land_once_through_the_restarts_of_a_job() {
    // Every 19th: bad records in all four partitions.
    let (topic, bad, good) = topic_with_bad_records("dl-restarts", 4, 3_000, 19).await;
    assert_eq!(bad.len(), 158);
    let dlq = fresh_topic("dl-restarts-dlq");
    create_topic(&bootstrap(), &dlq, 3).await.unwrap();
    let config = dead_letter_config(&topic, &fresh_topic("group"), &dlq);

    let sink = CollectingSink::new();
    let attempts = run_ids(
        config,
        2,
        |n| [400, 1_100, 1_900, 2_600].contains(&n),
        &MemoryCheckpointStore::new(),
        &sink,
        RestartStrategy::FixedDelay {
            delay: Duration::from_millis(50),
            max_attempts: 10,
        },
    )
    .await
    .unwrap();
    // Four injected panics: a failed attempt each, or fewer when two fire
    // in both subtasks of one attempt.
    assert!((2..=5).contains(&attempts), "{attempts} attempts");
    assert_eq!(sorted(sink.committed()), good);
    let letters = dead_letters(&dlq, bad.len());
    assert_eq!(origins(&letters, &topic), bad, "each bad record once");
}

/// A bad record larger than the dead-letter topic's `max.message.bytes`
/// goes there truncated, with headers that say so and where the original
/// is; the job goes on. A small one in the same run arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_record_too_large_for_the_dead_letter_topic_is_sent_truncated() {
    let topic = fresh_topic("dl-large");
    create_topic(&bootstrap(), &topic, 1).await.unwrap();
    let large = format!("{{not json {}", "x".repeat(10_000)).into_bytes();
    let mut records: Vec<(i32, Vec<u8>, Vec<u8>)> = (0..20u64)
        .map(|i| (0, Vec::new(), serde_json::to_vec(&Rec { id: i }).unwrap()))
        .collect();
    records[7].2 = large.clone();
    records[12].2 = b"{small".to_vec();
    produce(&bootstrap(), &topic, &records).unwrap();
    let dlq = fresh_topic("dl-large-dlq");
    create_topic_with(&bootstrap(), &dlq, 1, &[("max.message.bytes", "2048")])
        .await
        .unwrap();

    let sink = CollectingSink::new();
    let job = JobBuilder::new(JobId::new("kafka-dead-letter-large").unwrap());
    let config = dead_letter_config(&topic, &fresh_topic("group"), &dlq);
    job.source("kafka", 1, KafkaSource::new(config, Format::<Rec>::json()))
        .map("id", |r: KafkaRecord<Rec>| r.value.id)
        .sink("out", 1, sink.clone());
    let report = run_in_memory(job, runtime_config(RestartStrategy::None))
        .await
        .unwrap();
    assert_eq!(report.attempts, 1);
    assert_eq!(
        sorted(sink.committed()),
        (0..20).filter(|i| ![7, 12].contains(i)).collect::<Vec<_>>()
    );

    let letters = dead_letters(&dlq, 2);
    let by_offset = |o: &str| {
        letters
            .iter()
            .find(|l| l.header("tinyflow.source.offset").as_deref() == Some(o))
            .unwrap_or_else(|| panic!("no dead letter of offset {o}: {letters:?}"))
    };
    let cut = by_offset("7");
    assert_eq!(cut.header("tinyflow.truncated").as_deref(), Some("true"));
    assert_eq!(
        cut.header("tinyflow.original.bytes"),
        Some(large.len().to_string())
    );
    assert_eq!(
        cut.header("tinyflow.source.topic").as_deref(),
        Some(topic.as_str())
    );
    assert_eq!(
        cut.header("tinyflow.source.partition").as_deref(),
        Some("0")
    );
    assert!(cut.header("tinyflow.error").is_some(), "{cut:?}");
    let value = cut.value.clone().unwrap();
    assert!(
        !value.is_empty() && value.len() < 2048,
        "{} bytes",
        value.len()
    );
    assert!(large.starts_with(&value), "a prefix of the original");
    let whole = by_offset("12");
    assert_eq!(whole.header("tinyflow.truncated"), None);
    assert_eq!(whole.value.as_deref(), Some(&b"{small"[..]));
}

/// Two live runs of one job with a dead-letter topic: the newer run's
/// dead-letter producer takes the `transactional.id` over (Kafka's own
/// epoch), and the older run's next dead-letter transaction is refused with
/// `Fenced`, not retryable, so that the older run stops instead of taking
/// the id back on a restart (and fencing the newer in turn).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_run_whose_dead_letter_producer_a_newer_run_took_over_stops_for_good() {
    let (topic, _, _) = topic_with_bad_records("dl-fenced", 1, 400, 7).await;
    let dlq = fresh_topic("dl-fenced-dlq");
    create_topic(&bootstrap(), &dlq, 1).await.unwrap();
    let config = dead_letter_config(&topic, &fresh_topic("group"), &dlq);
    let source = KafkaSource::new(config, Format::<Rec>::json());
    let mut older = source.create(&ctx(0, 1), &[]).unwrap();
    read_good(&mut older, 100).await;
    older.snapshot(CheckpointId::new(1)).unwrap();
    // The newer run starts on another machine.
    let mut newer = source.create(&ctx(0, 1), &[]).unwrap();
    read_good(&mut older, 100).await;
    let err = older.snapshot(CheckpointId::new(2)).unwrap_err();
    assert!(
        matches!(err, tinyflow_api::StreamError::Fenced { .. }),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("took over"), "{err}");
    // The newer run's dead letters go on.
    read_to_end(&mut newer).await;
    newer.snapshot(CheckpointId::new(3)).unwrap();
}
