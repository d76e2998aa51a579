//! Exactly-once through the runtime, with failures injected at generated
//! points: a panic at the k-th record, a panic at a random moment (which
//! lands anywhere: mid-batch, during barrier alignment, during a snapshot),
//! and commits that fail after a checkpoint completed (between completion
//! and notify's effect). Whatever the schedule, the committed output equals
//! the expected output as a multiset. Keyed state survives restore, also
//! with a different parallelism.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::Config;
use tinyflow_api::testing::{CollectingSink, VecSource};

use tinyflow_api::{JobBuilder, JobId};
use tinyflow_checkpoint::CheckpointConfig;
use tinyflow_checkpoint::testing::MemoryCheckpointStore;
use tinyflow_runtime::{Error, JobRunner, RestartStrategy, RuntimeConfig, StopHandle};
use tinyflow_tests::{ms, run_in_memory};
use tokio::time::Instant;

const INJECTED: &str = "injected failure";

/// Where the next injected panic fires; each fires once.
#[derive(Debug, Default)]
struct FailPlan {
    seen: AtomicU64,
    at_record: Vec<u64>,
    at_time: Vec<Duration>,
    fired: Vec<AtomicBool>,
    start: std::sync::OnceLock<Instant>,
}

impl FailPlan {
    fn new(at_record: Vec<u64>, at_time: Vec<Duration>) -> Arc<Self> {
        let fired = (0..at_record.len() + at_time.len())
            .map(|_| AtomicBool::new(false))
            .collect();
        Arc::new(FailPlan {
            at_record,
            at_time,
            fired,
            ..FailPlan::default()
        })
    }

    /// Called for every record the failing operator processes.
    fn check(&self) {
        let n = self.seen.fetch_add(1, Ordering::SeqCst) + 1;
        let elapsed = self.start.get_or_init(Instant::now).elapsed();
        let due = self
            .at_record
            .iter()
            .map(|k| n >= *k)
            .chain(self.at_time.iter().map(|t| elapsed >= *t));
        for (i, due) in due.enumerate() {
            if due && !self.fired[i].swap(true, Ordering::SeqCst) {
                panic!("{INJECTED} #{i} at record {n}, {elapsed:?}");
            }
        }
    }
}

fn quiet_injected_panics() {
    tinyflow_tests::quiet_panics_containing(INJECTED);
}

fn config(interval_ms: u64) -> RuntimeConfig {
    RuntimeConfig {
        checkpoint: CheckpointConfig {
            interval: Some(ms(interval_ms)),
            timeout: ms(10_000),
            ..CheckpointConfig::default()
        },
        restart: RestartStrategy::FixedDelay {
            delay: ms(10),
            max_attempts: 20,
        },
        channel_capacity: 2,
        chaining: true,
    }
}

fn partitions(n: usize, per: u64) -> Vec<Vec<u64>> {
    (0..n as u64)
        .map(|p| (p * per..(p + 1) * per).collect())
        .collect()
}

#[derive(Debug, Clone)]
struct Scenario {
    sources: usize,
    maps: usize,
    sinks: usize,
    per_partition: u64,
    batch: usize,
    interval_ms: u64,
    at_record: Vec<u64>,
    at_time_ms: Vec<u64>,
    failed_commits: u32,
    chaining: bool,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        (1usize..4, 1usize..4, 1usize..3),
        (20u64..300, 1usize..16, 3u64..40),
        (
            prop::collection::vec(1u64..1_500, 0..3),
            prop::collection::vec(1u64..200, 0..3),
            0u32..3,
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (sources, maps, sinks),
                (per_partition, batch, interval_ms),
                (at_record, at_time_ms, failed_commits, chaining),
            )| {
                Scenario {
                    sources,
                    maps,
                    sinks,
                    per_partition,
                    batch,
                    interval_ms,
                    at_record,
                    at_time_ms,
                    failed_commits,
                    chaining,
                }
            },
        )
}

/// source -> map (fails as planned) -> filter -> rebalance -> sink.
async fn run_stateless(s: &Scenario) -> Result<(Vec<u64>, Vec<u64>, u32), Error> {
    let plan = FailPlan::new(
        s.at_record.clone(),
        s.at_time_ms.iter().map(|t| ms(*t)).collect(),
    );
    let sink = CollectingSink::<u64>::new();
    sink.fail_next_commits(s.failed_commits);
    let job = JobBuilder::new(JobId::new("eo-stateless").unwrap());
    let input = partitions(s.sources * 2, s.per_partition);
    job.source(
        "numbers",
        s.sources,
        VecSource::new(input.clone())
            .batch_size(s.batch)
            .pause(ms(1)),
    )
    .map("triple", move |n: u64| {
        plan.check();
        n * 3
    })
    .parallelism(s.maps)
    .filter("not-div-7", |n: &u64| !n.is_multiple_of(7))
    .rebalance()
    .sink("out", s.sinks, sink.clone());
    let report = run_in_memory(
        job,
        RuntimeConfig {
            chaining: s.chaining,
            ..config(s.interval_ms)
        },
    )
    .await?;
    let mut expected: Vec<u64> = input
        .into_iter()
        .flatten()
        .map(|n| n * 3)
        .filter(|n| !n.is_multiple_of(7))
        .collect();
    expected.sort_unstable();
    let mut got = sink.committed();
    got.sort_unstable();
    Ok((got, expected, report.attempts))
}

fn cases() -> u32 {
    std::env::var("RUNTIME_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(Config { cases: cases(), ..Config::default() })]

    /// I1 through the runtime: whatever fails and whenever, every record is
    /// committed exactly once.
    #[test]
    fn committed_output_is_exactly_the_input_whatever_fails(s in scenario()) {
        quiet_injected_panics();
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        let (got, expected, attempts) = rt.block_on(run_stateless(&s)).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        prop_assert_eq!(got.len(), expected.len(), "attempts {}", attempts);
        prop_assert!(got == expected, "committed output differs from the input (attempts {attempts})");
        let injected = (s.at_record.len() + s.at_time_ms.len()) as u32 + s.failed_commits;
        prop_assert!(attempts <= injected + 1, "{attempts} attempts for {injected} injected failures");
    }
}

/// (key, running count, running sum) per key, from a single source so the
/// order per key, and therefore every emitted value, is deterministic.
async fn run_keyed(
    store: &MemoryCheckpointStore,
    sink: &CollectingSink<(u64, u64, u64)>,
    reducers: usize,
    plan: Arc<FailPlan>,
    restart: RestartStrategy,
) -> Result<u32, Error> {
    let job = JobBuilder::new(JobId::new("eo-keyed").unwrap());
    job.source(
        "numbers",
        1,
        VecSource::new(vec![(0..3_000u64).collect()])
            .batch_size(7)
            .pause(ms(1)),
    )
    .map("tag", move |n: u64| {
        plan.check();
        (n % 13, 1u64, n)
    })
    .key_by(|(k, _, _): &(u64, u64, u64)| *k)
    .reduce("count-and-sum", |acc: &mut (u64, u64, u64), (_, c, n)| {
        acc.1 += c;
        acc.2 += n;
    })
    .parallelism(reducers)
    .sink("out", 2, sink.clone());
    let mut cfg = config(20);
    cfg.restart = restart;
    let report = JobRunner::new(job.build().unwrap(), Arc::new(store.clone()), cfg)
        .run()
        .await?;
    Ok(report.attempts)
}

fn sorted(mut v: Vec<(u64, u64, u64)>) -> Vec<(u64, u64, u64)> {
    v.sort_unstable();
    v
}

fn final_values(v: &[(u64, u64, u64)]) -> BTreeMap<u64, (u64, u64)> {
    let mut last = BTreeMap::new();
    for (k, c, s) in v {
        let e = last.entry(*k).or_insert((0, 0));
        if *c > e.0 {
            *e = (*c, *s);
        }
    }
    last
}

#[tokio::test(start_paused = true)]
async fn keyed_state_survives_failures_with_the_same_output() {
    quiet_injected_panics();
    let undisturbed = CollectingSink::new();
    let attempts = run_keyed(
        &MemoryCheckpointStore::new(),
        &undisturbed,
        2,
        FailPlan::new(vec![], vec![]),
        RestartStrategy::None,
    )
    .await
    .unwrap();
    assert_eq!(attempts, 1);
    let expected = sorted(undisturbed.committed());
    assert_eq!(expected.len(), 3_000);
    let totals = final_values(&expected);
    assert_eq!(totals.len(), 13);
    assert_eq!(totals.values().map(|(c, _)| c).sum::<u64>(), 3_000);
    assert_eq!(
        totals.values().map(|(_, s)| s).sum::<u64>(),
        (0..3_000u64).sum::<u64>()
    );

    let disturbed = CollectingSink::new();
    disturbed.fail_next_commits(1);
    let plan = FailPlan::new(vec![400, 1_700], vec![ms(150)]);
    let attempts = run_keyed(
        &MemoryCheckpointStore::new(),
        &disturbed,
        2,
        plan,
        RestartStrategy::FixedDelay {
            delay: ms(5),
            max_attempts: 10,
        },
    )
    .await
    .unwrap();
    assert!(
        attempts >= 4,
        "three panics and a failed commit, {attempts} attempts"
    );
    assert_eq!(sorted(disturbed.committed()), expected);
}

#[tokio::test(start_paused = true)]
async fn keyed_state_is_redistributed_when_parallelism_changes() {
    quiet_injected_panics();
    let expected = {
        let sink = CollectingSink::new();
        run_keyed(
            &MemoryCheckpointStore::new(),
            &sink,
            1,
            FailPlan::new(vec![], vec![]),
            RestartStrategy::None,
        )
        .await
        .unwrap();
        sorted(sink.committed())
    };
    // Two reducers, failing for good half-way; then the same job with three.
    let store = MemoryCheckpointStore::new();
    let sink = CollectingSink::new();
    let err = run_keyed(
        &store,
        &sink,
        2,
        FailPlan::new(vec![1_500], vec![]),
        RestartStrategy::None,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, Error::JobFailed { attempts: 1, .. }),
        "{err:?}"
    );
    assert!(
        !store.persisted_ids().is_empty(),
        "no checkpoint before the failure"
    );
    let committed_before = sink.committed().len();
    assert!(committed_before < 3_000);
    let attempts = run_keyed(
        &store,
        &sink,
        3,
        FailPlan::new(vec![], vec![]),
        RestartStrategy::None,
    )
    .await
    .unwrap();
    assert_eq!(attempts, 1);
    assert_eq!(sorted(sink.committed()), expected);
}

#[tokio::test(start_paused = true)]
async fn job_fails_with_the_root_cause_when_restarts_run_out() {
    quiet_injected_panics();
    let sink = CollectingSink::<u64>::new();
    let job = JobBuilder::new(JobId::new("always-fails").unwrap());
    job.source(
        "numbers",
        1,
        VecSource::new(vec![(0..100u64).collect()]).pause(ms(1)),
    )
    .map("boom", |n: u64| -> u64 {
        panic!("{INJECTED}: always, at {n}")
    })
    .sink("out", 1, sink.clone());
    let mut cfg = config(10);
    cfg.restart = RestartStrategy::FixedDelay {
        delay: ms(100),
        max_attempts: 2,
    };
    let started = Instant::now();
    let err = run_in_memory(job, cfg).await.unwrap_err();
    let Error::JobFailed { attempts, cause } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*attempts, 3);
    assert!(
        matches!(&**cause, Error::Panic { task, message } if task == "numbers->boom->out[0]" && message.contains("always")),
        "{cause:?}"
    );
    assert!(started.elapsed() >= ms(200), "two restart delays of 100 ms");
    assert!(sink.committed().is_empty());
}

/// The restart budget bounds failures in a row, not over a job's life: an
/// attempt that ran longer than the reset period before it failed gives the
/// budget back. Two quick failures, one after a long run, two quick ones,
/// then success: six attempts with `max_attempts = 3`, which without the
/// reset fail the job at its fourth attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_stable_run_gives_the_restart_budget_back() {
    quiet_injected_panics();
    for reset in [Some(ms(300)), None] {
        let plan = Arc::new(std::sync::Mutex::new((0u32, None::<Instant>)));
        let sink = CollectingSink::<u64>::new();
        let job = JobBuilder::new(JobId::new("budget").unwrap());
        let p = Arc::clone(&plan);
        job.source(
            "numbers",
            1,
            VecSource::new(vec![(0..400u64).collect()])
                .batch_size(1)
                .pause(ms(5)),
        )
        .map("flaky", move |n: u64| -> u64 {
            let mut guard = p.lock().unwrap();
            let (failed, since) = &mut *guard;
            let started = *since.get_or_insert_with(Instant::now);
            let fail = match *failed {
                // Quick failures.
                0 | 1 | 3 | 4 => true,
                // A long, stable attempt, then a failure.
                2 => started.elapsed() >= ms(600),
                _ => false,
            };
            if fail {
                *failed += 1;
                *since = None;
                drop(guard);
                panic!("{INJECTED}: a planned failure at {n}");
            }
            n
        })
        .sink("out", 1, sink.clone());
        let mut cfg = config(10);
        cfg.restart = RestartStrategy::FixedDelay {
            delay: ms(10),
            max_attempts: 3,
        };
        let ran = JobRunner::new(
            job.build().unwrap(),
            Arc::new(MemoryCheckpointStore::new()),
            cfg,
        )
        .with_restart_budget_reset(reset)
        .run()
        .await;
        match reset {
            Some(_) => {
                let report = ran.unwrap();
                assert_eq!(report.attempts, 6, "{report:?}");
                let mut got = sink.committed();
                got.sort_unstable();
                assert_eq!(got, (0..400).collect::<Vec<_>>());
            }
            None => {
                let Err(Error::JobFailed { attempts, .. }) = ran else {
                    panic!("without the reset the job should fail: {ran:?}")
                };
                assert_eq!(attempts, 4, "the 4th failure is past 3 restarts");
            }
        }
    }
}

/// Passes records through; panics while taking its `at`-th snapshot, that
/// is right after aligning the barriers of its three inputs, once.
struct FailOnSnapshot {
    fired: Arc<AtomicBool>,
    at: u64,
    taken: u64,
}

impl tinyflow_api::Operator<u64, u64> for FailOnSnapshot {
    fn process(
        &mut self,
        batch: Vec<u64>,
        out: &mut tinyflow_api::Output<'_, u64>,
    ) -> tinyflow_api::StreamResult<()> {
        out.emit(batch);
        Ok(())
    }

    fn snapshot(&mut self) -> tinyflow_api::StreamResult<tinyflow_api::OperatorState> {
        self.taken += 1;
        if self.taken == self.at && !self.fired.swap(true, Ordering::SeqCst) {
            panic!("{INJECTED} while snapshotting after alignment");
        }
        Ok(tinyflow_api::OperatorState::default())
    }
}

struct FailOnSnapshotFactory {
    fired: Arc<AtomicBool>,
    at: u64,
}

impl tinyflow_api::OperatorFactory<u64, u64> for FailOnSnapshotFactory {
    fn create(
        &self,
        _ctx: &tinyflow_api::OperatorContext,
    ) -> tinyflow_api::StreamResult<Box<dyn tinyflow_api::Operator<u64, u64>>> {
        Ok(Box::new(FailOnSnapshot {
            fired: Arc::clone(&self.fired),
            at: self.at,
            taken: 0,
        }))
    }
}

#[tokio::test(start_paused = true)]
async fn failure_right_after_alignment_loses_and_duplicates_nothing() {
    quiet_injected_panics();
    for at in 1..=4 {
        let sink = CollectingSink::<u64>::new();
        let fired = Arc::new(AtomicBool::new(false));
        let job = JobBuilder::new(JobId::new("fail-at-alignment").unwrap());
        let input = partitions(3, 400);
        job.source(
            "numbers",
            3,
            VecSource::new(input.clone()).batch_size(5).pause(ms(1)),
        )
        .rebalance()
        .transform::<u64>(
            "fails-on-snapshot",
            FailOnSnapshotFactory {
                fired: Arc::clone(&fired),
                at,
            },
        )
        .parallelism(2)
        .sink("out", 1, sink.clone());
        let report = run_in_memory(job, config(10)).await.unwrap();
        assert!(fired.load(Ordering::SeqCst), "snapshot {at} never happened");
        assert_eq!(report.attempts, 2);
        let mut got = sink.committed();
        got.sort_unstable();
        assert_eq!(
            got,
            input.into_iter().flatten().collect::<Vec<_>>(),
            "failing at snapshot {at}"
        );
    }
}

/// A sink that is not transactional: it counts records as they arrive.
#[derive(Clone, Default)]
struct CountingSink(Arc<AtomicU64>);

struct Counter(Arc<AtomicU64>);

#[async_trait::async_trait]
impl tinyflow_api::SinkFactory<u64> for CountingSink {
    async fn create(
        &self,
        _ctx: &tinyflow_api::OperatorContext,
        _restored: Option<tinyflow_api::SinkRestore<'_>>,
    ) -> tinyflow_api::StreamResult<Box<dyn tinyflow_api::Sink<u64>>> {
        Ok(Box::new(Counter(Arc::clone(&self.0))))
    }

    fn is_transactional(&self) -> bool {
        false
    }
}

#[async_trait::async_trait]
impl tinyflow_api::Sink<u64> for Counter {
    async fn write(&mut self, batch: Vec<u64>) -> tinyflow_api::StreamResult<()> {
        // A slow sink: the sources end long before it has seen everything.
        tokio::time::sleep(ms(1)).await;
        self.0.fetch_add(batch.len() as u64, Ordering::SeqCst);
        Ok(())
    }
    async fn prepare_commit(
        &mut self,
        _id: tinyflow_api::CheckpointId,
    ) -> tinyflow_api::StreamResult<Vec<u8>> {
        Ok(Vec::new())
    }
    async fn commit(&mut self, _id: tinyflow_api::CheckpointId) -> tinyflow_api::StreamResult<()> {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn with_checkpointing_off_a_job_drains_everything_before_it_ends() {
    for chaining in [true, false] {
        let sink = CountingSink::default();
        let job = JobBuilder::new(JobId::new("no-checkpoints").unwrap());
        job.source(
            "numbers",
            3,
            VecSource::new(partitions(3, 1_000)).batch_size(7),
        )
        .map("slow", |n: u64| n + 1)
        .rebalance()
        .filter("all", |_: &u64| true)
        .parallelism(2)
        .sink("count", 1, sink.clone());
        let mut config = config(10);
        config.checkpoint.interval = None;
        config.channel_capacity = 1;
        config.chaining = chaining;
        let report = run_in_memory(job, config).await.unwrap();
        assert_eq!(report.final_checkpoint, None);
        assert_eq!(sink.0.load(Ordering::SeqCst), 3_000, "chaining {chaining}");
    }
}

#[tokio::test(start_paused = true)]
async fn with_checkpointing_off_a_transactional_sink_is_refused() {
    let job = JobBuilder::new(JobId::new("no-checkpoints").unwrap());
    job.source("numbers", 1, VecSource::new(partitions(1, 10)))
        .sink("out", 1, CollectingSink::<u64>::new());
    let mut config = config(10);
    config.checkpoint.interval = None;
    config.restart = RestartStrategy::None;
    let err = run_in_memory(job, config).await.unwrap_err();
    let text = tinyflow_api::error_chain(&err);
    assert!(
        text.contains("checkpoint.interval") && text.contains("transactional sink"),
        "{text}"
    );
    assert!(matches!(err, Error::JobFailed { attempts: 1, .. }));
}

/// A source whose later subtasks take a while to set up (as a Kafka source
/// fetching metadata does), while the first ends at once.
struct SlowSetup(VecSource<u64>);

impl tinyflow_api::SourceFactory<u64> for SlowSetup {
    fn create(
        &self,
        ctx: &tinyflow_api::OperatorContext,
        restored: &[Vec<u8>],
    ) -> tinyflow_api::StreamResult<Box<dyn tinyflow_api::Source<u64>>> {
        if ctx.subtask > 0 {
            std::thread::sleep(std::time::Duration::from_millis(150));
        }
        self.0.create(ctx, restored)
    }
}

/// Regression (found against the real Kafka broker): while tasks were still
/// being set up, the coordinator triggered checkpoints that left them out,
/// and took "every registered source ended" for "every source ended",
/// finishing the job before the slow sources had read anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_wait_until_every_task_is_set_up() {
    let sink = CollectingSink::<u64>::new();
    let job = JobBuilder::new(JobId::new("slow-setup").unwrap());
    // Subtask 0 reads partition 0 (empty); subtask 1 reads partition 1.
    let input = vec![Vec::new(), (0..2_000u64).collect()];
    job.source(
        "numbers",
        2,
        SlowSetup(VecSource::new(input).batch_size(10)),
    )
    .rebalance()
    .sink("out", 1, sink.clone());
    let mut config = RuntimeConfig {
        channel_capacity: 2,
        ..RuntimeConfig::default()
    };
    config.checkpoint.interval = Some(ms(20));
    config.restart = RestartStrategy::None;
    let report = run_in_memory(job, config).await.unwrap();
    assert!(report.final_checkpoint.is_some());
    assert_eq!(sorted_u64(sink.committed()), (0..2_000).collect::<Vec<_>>());
}

fn sorted_u64(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

/// Regression (found by the Nexmark bench): a source that always has data,
/// chained into a sink that never waits, never yielded, so on a
/// current-thread runtime no periodic checkpoint was taken until the end of
/// input.
#[test]
fn a_busy_chained_source_does_not_starve_periodic_checkpoints() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let store = MemoryCheckpointStore::new();
    let sink = CollectingSink::<u64>::new();
    let started = std::time::Instant::now();
    rt.block_on(async {
        let job = JobBuilder::new(JobId::new("busy").unwrap());
        job.source(
            "numbers",
            1,
            VecSource::new(vec![(0..4_000_000u64).collect()]).batch_size(1_000),
        )
        .map("same", |n: u64| n)
        .sink("out", 1, sink.clone());
        let mut config = RuntimeConfig::default();
        config.checkpoint.interval = Some(ms(5));
        JobRunner::new(job.build().unwrap(), Arc::new(store.clone()), config)
            .run()
            .await
            .unwrap();
    });
    let took = started.elapsed();
    assert_eq!(sink.committed().len(), 4_000_000);
    // At least one periodic checkpoint besides the final one.
    assert!(
        store.persisted_ids().len() >= 2,
        "only {:?} in {took:?} with a 5 ms interval",
        store.persisted_ids()
    );
}

/// A writer that buffers records and hands each checkpoint's records on as
/// one committable: the runtime side of a parallel-writer sink.
struct Buffering;

struct Buffer(Vec<u64>);

#[async_trait::async_trait]
impl tinyflow_api::WriterFactory<u64, Vec<u64>> for Buffering {
    async fn create(
        &self,
        _ctx: &tinyflow_api::OperatorContext,
    ) -> tinyflow_api::StreamResult<Box<dyn tinyflow_api::Writer<u64, Vec<u64>>>> {
        Ok(Box::new(Buffer(Vec::new())))
    }
}

#[async_trait::async_trait]
impl tinyflow_api::Writer<u64, Vec<u64>> for Buffer {
    async fn write(&mut self, batch: Vec<u64>) -> tinyflow_api::StreamResult<()> {
        self.0.extend(batch);
        Ok(())
    }

    async fn flush(
        &mut self,
        _id: tinyflow_api::CheckpointId,
    ) -> tinyflow_api::StreamResult<Vec<Vec<u64>>> {
        Ok(if self.0.is_empty() {
            Vec::new()
        } else {
            vec![std::mem::take(&mut self.0)]
        })
    }
}

/// Writers in front of a committing sink: what a writer flushes on barrier
/// N reaches the sink before barrier N, so it is staged under N and
/// committed once, whatever fails. Anything a writer held when it died is
/// replayed from the source positions.
#[tokio::test(start_paused = true)]
async fn writer_stages_flush_ahead_of_the_barrier_and_commit_exactly_once() {
    quiet_injected_panics();
    for (writers, chaining, at_record) in [
        (2, true, vec![150, 420]),
        (2, false, vec![77]),
        (1, true, vec![10, 300, 590]),
    ] {
        let plan = FailPlan::new(at_record.clone(), vec![]);
        let sink = CollectingSink::<Vec<u64>>::new();
        let job = JobBuilder::new(JobId::new("eo-writer").unwrap());
        let input = partitions(2, 300);
        job.source(
            "numbers",
            2,
            VecSource::new(input.clone()).batch_size(7).pause(ms(1)),
        )
        .map("check", move |n: u64| {
            plan.check();
            n
        })
        .write("buffer", writers, Buffering)
        .rebalance()
        .sink("committer", 1, sink.clone());
        let report = run_in_memory(
            job,
            RuntimeConfig {
                chaining,
                ..config(20)
            },
        )
        .await
        .unwrap();
        let got = sorted_u64(sink.committed().into_iter().flatten().collect());
        assert_eq!(
            got,
            sorted_u64(input.into_iter().flatten().collect()),
            "writers {writers}, chaining {chaining}"
        );
        assert!(
            report.attempts > 1,
            "failures were injected at {at_record:?}"
        );
    }
}

/// A stop request ends a job that still has input with a final checkpoint:
/// the sink committed exactly what the sources read up to it, and a second
/// run over the same store goes on from there to the end, with nothing lost
/// or written twice.
#[tokio::test(start_paused = true)]
async fn a_stopped_job_commits_up_to_its_final_checkpoint_and_the_next_run_goes_on() {
    let sink = CollectingSink::<u64>::new();
    let store = Arc::new(MemoryCheckpointStore::new());
    let build = || {
        let job = JobBuilder::new(JobId::new("stopped").unwrap());
        job.source(
            "numbers",
            2,
            VecSource::new(partitions(2, 1_000))
                .batch_size(5)
                .pause(ms(10)),
        )
        .map("inc", |n: u64| n + 1)
        .rebalance()
        .sink("out", 2, sink.clone());
        job.build().unwrap()
    };
    // 200 batches of 5 per partition, 10 ms apart: 2 s of input.
    let stop = StopHandle::new();
    let runner = JobRunner::new(build(), store.clone(), config(100)).with_stop(stop.clone());
    let run = tokio::spawn(async move { runner.run().await });
    tokio::time::sleep(ms(650)).await;
    stop.stop();
    let report = run.await.unwrap().unwrap();
    let last = report.final_checkpoint.expect("a final checkpoint");
    assert!(store.get(last).unwrap().is_final);
    let mut first = sink.committed();
    first.sort_unstable();
    let n = first.len();
    assert!(
        (100..1_800).contains(&n),
        "about 650 ms of 2 s of input committed, got {n} records"
    );
    // A prefix of each partition, each record once.
    let expected: Vec<u64> = first.iter().map(|v| v - 1).collect();
    let per_partition: Vec<usize> = (0..2)
        .map(|p| expected.iter().filter(|v| **v / 1_000 == p).count())
        .collect();
    let prefixes: Vec<u64> = (0..2u64)
        .flat_map(|p| p * 1_000..p * 1_000 + per_partition[p as usize] as u64)
        .collect();
    assert_eq!(expected, prefixes, "committed a prefix of each partition");

    let report = JobRunner::new(build(), store.clone(), config(100))
        .run()
        .await
        .unwrap();
    assert!(report.final_checkpoint.unwrap() > last);
    let mut all = sink.committed();
    all.sort_unstable();
    assert_eq!(all, (1..=2_000).collect::<Vec<u64>>());
}
