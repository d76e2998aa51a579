//! Event-time windows through the runtime: results match a direct
//! computation, late records go to the side output (within the allowed
//! lateness they update their window instead), and window results survive
//! failures and restore unchanged. An idle source subtask does not hold
//! event time back.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tinyflow_api::testing::{CollectingSink, VecSource};

use tinyflow_api::{
    CheckpointId, JobBuilder, JobId, OperatorContext, Sink, SinkFactory, SinkRestore, Source,
    SourceFactory, SourceWatermark, StreamResult, TumblingWindows,
};
use tinyflow_checkpoint::CheckpointConfig;
use tinyflow_runtime::{RestartStrategy, RuntimeConfig};
use tinyflow_tests::{SplitMix64, ms, run_in_memory};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Event {
    key: u64,
    ts: i64,
    value: u64,
}

type Row = (u64, i64, u64, u64); // key, window start, count, sum

/// Events with time moving forward by 0-9 ms each, shuffled by up to
/// `disorder` ms.
fn events(n: usize, keys: u64, disorder: i64, seed: u64) -> Vec<Event> {
    let mut rng = SplitMix64::new(seed);
    let mut t = 1_700_000_000_000i64;
    (0..n)
        .map(|_| {
            t += rng.below(10) as i64;
            let jitter = if disorder > 0 {
                rng.below(disorder as u64) as i64
            } else {
                0
            };
            Event {
                key: rng.below(keys),
                ts: t - jitter,
                value: rng.below(100),
            }
        })
        .collect()
}

fn config() -> RuntimeConfig {
    RuntimeConfig {
        checkpoint: CheckpointConfig {
            interval: Some(ms(25)),
            ..CheckpointConfig::default()
        },
        restart: RestartStrategy::FixedDelay {
            delay: ms(5),
            max_attempts: 10,
        },
        channel_capacity: 2,
        chaining: true,
    }
}

struct Run {
    results: CollectingSink<Row>,
    late: CollectingSink<Event>,
    attempts: u32,
}

async fn run(
    input: Vec<Vec<Event>>,
    bound: Duration,
    lateness: Duration,
    reducers: usize,
    fail_at: Vec<u64>,
    batch: usize,
) -> Run {
    let results = CollectingSink::<Row>::new();
    let late = CollectingSink::<Event>::new();
    let seen = Arc::new(AtomicU64::new(0));
    let job = JobBuilder::new(JobId::new("windows").unwrap());
    let (main, side) = job
        .source(
            "events",
            input.len(),
            VecSource::new(input).batch_size(batch).pause(ms(1)),
        )
        .map("maybe-fail", move |e: Event| {
            let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
            if fail_at.contains(&n) {
                panic!("injected failure at record {n}");
            }
            e
        })
        .watermarks("event-time", |e: &Event| e.ts, bound)
        .key_by(|e: &Event| e.key)
        .window_aggregate(
            "count-and-sum",
            TumblingWindows::of(ms(100), |e: &Event| e.ts).allowed_lateness(lateness),
            || (0u64, 0u64),
            |acc, e| {
                acc.0 += 1;
                acc.1 += e.value;
            },
            |key, w, acc| (*key, w.start, acc.0, acc.1),
        )
        .parallelism(reducers)
        .split("results", "late");
    main.sink("results-out", 1, results.clone());
    side.sink("late-out", 1, late.clone());
    let report = run_in_memory(job, config()).await.unwrap();
    Run {
        results,
        late,
        attempts: report.attempts,
    }
}

fn expected(events: &[Event]) -> Vec<Row> {
    let mut windows: BTreeMap<(u64, i64), (u64, u64)> = BTreeMap::new();
    for e in events {
        let w = windows
            .entry((e.key, e.ts - e.ts.rem_euclid(100)))
            .or_default();
        w.0 += 1;
        w.1 += e.value;
    }
    windows
        .into_iter()
        .map(|((k, s), (c, v))| (k, s, c, v))
        .collect()
}

fn sorted<T: Ord>(mut v: Vec<T>) -> Vec<T> {
    v.sort();
    v
}

#[tokio::test(start_paused = true)]
async fn window_results_match_a_direct_computation() {
    let input: Vec<Vec<Event>> = (0..3).map(|p| events(2_000, 7, 30, p)).collect();
    let all: Vec<Event> = input.iter().flatten().cloned().collect();
    // The bound covers the disorder inside a partition; partitions run at
    // different speeds, but the combined watermark is their minimum.
    let r = run(input, ms(50), ms(0), 3, vec![], 16).await;
    assert_eq!(r.attempts, 1);
    assert!(
        r.late.committed().is_empty(),
        "{} late records",
        r.late.committed().len()
    );
    assert_eq!(sorted(r.results.committed()), expected(&all));
}

#[tokio::test(start_paused = true)]
async fn late_records_go_to_the_side_output_or_update_within_lateness() {
    let t0 = 1_700_000_000_000i64;
    let e = |ts: i64, value: u64| Event {
        key: 1,
        ts: t0 + ts,
        value,
    };
    let input = vec![vec![
        e(10, 1),  // window [0, 100)
        e(250, 2), // watermark 250 - 50 = 200: window [0, 100) fires
        e(20, 4), // 180 ms behind: within the 150 ms lateness? cleanup 99 + 150 = 249 > 200: yes, re-fires
        e(500, 8), // watermark 450: window [0, 100) cleaned up (249 <= 450)
        e(30, 16), // late: side output
    ]];
    // One record per batch, so watermarks interleave with records.
    let r = run(input, ms(50), ms(150), 1, vec![], 1).await;
    let late = r.late.committed();
    assert_eq!(late, vec![e(30, 16)]);
    let results = sorted(r.results.committed());
    assert_eq!(
        results,
        vec![
            (1, t0, 1, 1),       // on time
            (1, t0, 2, 5),       // updated by the record within lateness
            (1, t0 + 200, 1, 2), // fired by the final watermark
            (1, t0 + 500, 1, 8),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn window_results_survive_failures_unchanged() {
    // One source partition: the order of records, so the watermark and every
    // emitted result, is deterministic; late records included.
    let input = vec![events(4_000, 5, 80, 42)];
    let undisturbed = run(input.clone(), ms(40), ms(20), 2, vec![], 4).await;
    assert!(
        !undisturbed.late.committed().is_empty(),
        "the scenario should have late records"
    );
    let disturbed = run(input, ms(40), ms(20), 2, vec![700, 1_900, 3_300], 4).await;
    assert_eq!(disturbed.attempts, 4);
    assert_eq!(
        sorted(disturbed.results.committed()),
        sorted(undisturbed.results.committed())
    );
    let by_ts = |v: Vec<Event>| sorted(v.into_iter().map(|e| (e.ts, e.key, e.value)).collect());
    assert_eq!(
        by_ts(disturbed.late.committed()),
        by_ts(undisturbed.late.committed())
    );
}

/// Subtask 0 reads `ts` 1..=100 and reports each as its watermark; subtask
/// 1 reads nothing and reports `quiet` until the sink saw watermark 100 or a
/// second passed.
struct QuietSource {
    quiet: SourceWatermark,
    seen: Arc<Mutex<Vec<i64>>>,
}

struct QuietReader {
    subtask: usize,
    next: i64,
    quiet: SourceWatermark,
    seen: Arc<Mutex<Vec<i64>>>,
    started: tokio::time::Instant,
}

impl SourceFactory<i64> for QuietSource {
    fn create(
        &self,
        ctx: &OperatorContext,
        _restored: &[Vec<u8>],
    ) -> StreamResult<Box<dyn Source<i64>>> {
        Ok(Box::new(QuietReader {
            subtask: ctx.subtask,
            next: 1,
            quiet: self.quiet,
            seen: Arc::clone(&self.seen),
            started: tokio::time::Instant::now(),
        }))
    }
}

#[async_trait::async_trait]
impl Source<i64> for QuietReader {
    async fn next_batch(&mut self) -> StreamResult<Option<Vec<i64>>> {
        tokio::time::sleep(ms(1)).await;
        if self.subtask == 0 {
            if self.next > 100 {
                return Ok(None);
            }
            self.next += 1;
            return Ok(Some(vec![self.next - 1]));
        }
        let reached = self.seen.lock().unwrap().contains(&100);
        if reached || self.started.elapsed() > Duration::from_secs(1) {
            return Ok(None);
        }
        Ok(Some(Vec::new()))
    }

    fn snapshot(&mut self, _id: CheckpointId) -> StreamResult<Vec<u8>> {
        Ok(Vec::new())
    }

    fn watermark(&self) -> SourceWatermark {
        if self.subtask == 0 {
            SourceWatermark::At(self.next - 1)
        } else {
            self.quiet
        }
    }
}

/// Records the watermarks it is told about.
struct WatermarkSink(Arc<Mutex<Vec<i64>>>);

#[async_trait::async_trait]
impl SinkFactory<i64> for WatermarkSink {
    async fn create(
        &self,
        _ctx: &OperatorContext,
        _restored: Option<SinkRestore<'_>>,
    ) -> StreamResult<Box<dyn Sink<i64>>> {
        Ok(Box::new(WatermarkSink(Arc::clone(&self.0))))
    }
}

#[async_trait::async_trait]
impl Sink<i64> for WatermarkSink {
    async fn write(&mut self, _batch: Vec<i64>) -> StreamResult<()> {
        Ok(())
    }
    async fn prepare_commit(&mut self, _id: CheckpointId) -> StreamResult<Vec<u8>> {
        Ok(Vec::new())
    }
    async fn commit(&mut self, _id: CheckpointId) -> StreamResult<()> {
        Ok(())
    }
    fn on_watermark(&mut self, watermark: i64) {
        self.0.lock().unwrap().push(watermark);
    }
}

/// The watermarks the sink saw before the final one, running the quiet
/// source with `quiet` through a map (chained to the source) and a shuffle.
async fn watermarks_with_a_quiet_subtask(quiet: SourceWatermark) -> Vec<i64> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let job = JobBuilder::new(JobId::new("quiet").unwrap());
    job.source(
        "numbers",
        2,
        QuietSource {
            quiet,
            seen: Arc::clone(&seen),
        },
    )
    .map("same", |x: i64| x)
    .rebalance()
    .sink("watermarks", 1, WatermarkSink(Arc::clone(&seen)));
    run_in_memory(job, config()).await.unwrap();
    let seen = seen.lock().unwrap().clone();
    seen.into_iter().filter(|w| *w != i64::MAX).collect()
}

#[tokio::test(start_paused = true)]
async fn an_idle_source_subtask_does_not_hold_event_time_back() {
    let idle = watermarks_with_a_quiet_subtask(SourceWatermark::Idle).await;
    assert_eq!(idle.last(), Some(&100), "{idle:?}");
    assert!(idle.windows(2).all(|w| w[0] < w[1]), "{idle:?}");
    // The same quiet subtask, not saying it is idle, holds the minimum.
    let silent = watermarks_with_a_quiet_subtask(SourceWatermark::At(i64::MIN)).await;
    assert!(silent.iter().all(|w| *w == i64::MIN), "{silent:?}");
}
