//! Where the checkpoint coordinator's driver runs. On a multi-thread runtime
//! it has a thread of its own, so that triggers and completions do not queue
//! behind tasks that poll for long stretches; on a current-thread runtime it
//! runs in place, on that runtime's (possibly paused) clock. The store's
//! `persist` is polled by the driver, so the thread that polls it tells
//! where the driver runs. A committer behind parallel writers shares that
//! thread (its commits then start as soon as a checkpoint completes); any
//! other sink runs on the job's workers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tinyflow_api::testing::{CollectingSink, VecSource};

use tinyflow_api::{
    CheckpointId, JobBuilder, JobId, OperatorContext, Sink, SinkFactory, SinkRestore, StreamResult,
    Writer, WriterFactory,
};
use tinyflow_checkpoint::testing::MemoryCheckpointStore;
use tinyflow_checkpoint::{CheckpointStore, CompletedCheckpoint};
use tinyflow_runtime::{Error, JobRunner, RestartStrategy, RuntimeConfig};
use tinyflow_tests::{ms, run_in_memory};

const INJECTED: &str = "injected failure";
const EXPLODED: &str = "injected: the store exploded";

/// A memory store that notes the thread each write runs on, and can panic.
#[derive(Debug, Clone, Default)]
struct NotingStore {
    inner: MemoryCheckpointStore,
    threads: Arc<Mutex<Vec<String>>>,
    panic: bool,
}

impl NotingStore {
    fn threads(&self) -> Vec<String> {
        self.threads.lock().unwrap().clone()
    }
}

#[async_trait::async_trait]
impl CheckpointStore for NotingStore {
    async fn persist(&self, checkpoint: &CompletedCheckpoint) -> StreamResult<()> {
        let name = std::thread::current()
            .name()
            .unwrap_or("<unnamed>")
            .to_owned();
        self.threads.lock().unwrap().push(name);
        assert!(!self.panic, "{EXPLODED}");
        self.inner.persist(checkpoint).await
    }

    async fn latest(&self) -> StreamResult<Option<CompletedCheckpoint>> {
        self.inner.latest().await
    }

    async fn highest_id(&self) -> StreamResult<Option<CheckpointId>> {
        self.inner.highest_id().await
    }
}

/// Numbers through a map (that panics once, at record 3,000, when `fail`)
/// into a committing sink; checkpoints every 5 ms.
async fn run_job(
    store: &NotingStore,
    restart: RestartStrategy,
    fail: bool,
) -> (
    Result<tinyflow_runtime::JobReport, Error>,
    CollectingSink<u64>,
) {
    let sink = CollectingSink::<u64>::new();
    let failed = Arc::new(AtomicBool::new(!fail));
    let job = JobBuilder::new(JobId::new("driver-thread").unwrap());
    job.source(
        "numbers",
        2,
        VecSource::new(vec![(0..5_000u64).collect(), (5_000..10_000u64).collect()]).batch_size(100),
    )
    .map("fails-once", move |n: u64| {
        if n == 3_000 && !failed.swap(true, Ordering::SeqCst) {
            panic!("{INJECTED} at record {n}");
        }
        n
    })
    .rebalance()
    .sink("out", 1, sink.clone());
    let mut config = RuntimeConfig {
        channel_capacity: 2,
        restart,
        ..RuntimeConfig::default()
    };
    config.checkpoint.interval = Some(ms(5));
    let report = JobRunner::new(job.build().unwrap(), Arc::new(store.clone()), config)
        .run()
        .await;
    (report, sink)
}

fn restarts() -> RestartStrategy {
    RestartStrategy::FixedDelay {
        delay: ms(10),
        max_attempts: 5,
    }
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_multi_thread_runtime_the_driver_has_a_thread_of_its_own() {
    tinyflow_tests::quiet_panics_containing(INJECTED);
    let store = NotingStore::default();
    let (report, sink) = run_job(&store, restarts(), true).await;
    let report = report.unwrap();
    // The injected panic failed the first attempt; the second finished, with
    // its own driver once the first one had ended.
    assert_eq!(report.attempts, 2);
    assert_eq!(sorted(sink.committed()), (0..10_000).collect::<Vec<_>>());
    let threads = store.threads();
    assert!(!threads.is_empty());
    assert!(
        threads.iter().all(|t| t == "tinyflow-coordinator"),
        "{threads:?}"
    );
    let ids = store.inner.attempted_ids();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
}

#[tokio::test]
async fn on_a_current_thread_runtime_the_driver_runs_in_place() {
    tinyflow_tests::quiet_panics_containing(INJECTED);
    let here = std::thread::current().name().unwrap().to_owned();
    let store = NotingStore::default();
    let (report, sink) = run_job(&store, restarts(), true).await;
    assert_eq!(report.unwrap().attempts, 2);
    assert_eq!(sorted(sink.committed()), (0..10_000).collect::<Vec<_>>());
    let threads = store.threads();
    assert!(!threads.is_empty());
    assert!(threads.iter().all(|t| *t == here), "{here}: {threads:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_on_the_driver_thread_fails_the_attempt_with_its_message() {
    tinyflow_tests::quiet_panics_containing(EXPLODED);
    let store = NotingStore {
        panic: true,
        ..NotingStore::default()
    };
    let (report, _) = run_job(&store, RestartStrategy::None, false).await;
    let Err(Error::JobFailed { cause, .. }) = report else {
        panic!("expected the job to fail, got {report:?}");
    };
    match *cause {
        Error::Panic { task, message } => {
            assert_eq!(task, "checkpoint coordinator");
            assert!(message.contains(EXPLODED), "{message}");
        }
        other => panic!("expected the driver's panic, got {other:?}"),
    }
}

fn thread_name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("<unnamed>")
        .to_owned()
}

/// A sink factory that notes the thread of each commit of its sinks.
#[derive(Clone)]
struct NotingSink<T> {
    inner: CollectingSink<T>,
    threads: Arc<Mutex<Vec<String>>>,
}

struct Noted<T> {
    inner: Box<dyn Sink<T>>,
    threads: Arc<Mutex<Vec<String>>>,
}

#[async_trait::async_trait]
impl<T: tinyflow_api::StateValue> SinkFactory<T> for NotingSink<T> {
    async fn create(
        &self,
        ctx: &OperatorContext,
        restored: Option<SinkRestore<'_>>,
    ) -> StreamResult<Box<dyn Sink<T>>> {
        Ok(Box::new(Noted {
            inner: self.inner.create(ctx, restored).await?,
            threads: Arc::clone(&self.threads),
        }))
    }
}

#[async_trait::async_trait]
impl<T: tinyflow_api::Data> Sink<T> for Noted<T> {
    async fn write(&mut self, batch: Vec<T>) -> StreamResult<()> {
        self.inner.write(batch).await
    }

    async fn prepare_commit(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>> {
        self.inner.prepare_commit(id).await
    }

    async fn commit(&mut self, id: CheckpointId) -> StreamResult<()> {
        self.threads.lock().unwrap().push(thread_name());
        self.inner.commit(id).await
    }
}

/// Buffers records and hands each checkpoint's on as one committable.
struct Buffering;

struct Buffer(Vec<u64>);

#[async_trait::async_trait]
impl WriterFactory<u64, Vec<u64>> for Buffering {
    async fn create(&self, _ctx: &OperatorContext) -> StreamResult<Box<dyn Writer<u64, Vec<u64>>>> {
        Ok(Box::new(Buffer(Vec::new())))
    }
}

#[async_trait::async_trait]
impl Writer<u64, Vec<u64>> for Buffer {
    async fn write(&mut self, batch: Vec<u64>) -> StreamResult<()> {
        self.0.extend(batch);
        Ok(())
    }

    async fn flush(&mut self, _id: CheckpointId) -> StreamResult<Vec<Vec<u64>>> {
        Ok(if self.0.is_empty() {
            Vec::new()
        } else {
            vec![std::mem::take(&mut self.0)]
        })
    }
}

/// Numbers into a committing sink, through two parallel writers when
/// `writers`; checkpoints every 5 ms. Returns the records committed and
/// the threads each commit ran on.
async fn run_sink_job(writers: bool) -> (Vec<u64>, Vec<String>) {
    let numbers =
        VecSource::new(vec![(0..5_000u64).collect(), (5_000..10_000u64).collect()]).batch_size(100);
    let job = JobBuilder::new(JobId::new("committer-thread").unwrap());
    let stream = job.source("numbers", 2, numbers);
    let threads = Arc::new(Mutex::new(Vec::new()));
    let committed = if writers {
        let sink = NotingSink {
            inner: CollectingSink::<Vec<u64>>::new(),
            threads: Arc::clone(&threads),
        };
        stream
            .write("buffer", 2, Buffering)
            .rebalance()
            .sink("committer", 1, sink.clone());
        run_collecting(job).await;
        sink.inner.committed().into_iter().flatten().collect()
    } else {
        let sink = NotingSink {
            inner: CollectingSink::<u64>::new(),
            threads: Arc::clone(&threads),
        };
        stream.rebalance().sink("out", 1, sink.clone());
        run_collecting(job).await;
        sink.inner.committed()
    };
    let threads = threads.lock().unwrap().clone();
    (sorted(committed), threads)
}

async fn run_collecting(job: JobBuilder) {
    let mut config = RuntimeConfig::default();
    config.checkpoint.interval = Some(ms(5));
    run_in_memory(job, config).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committer_behind_parallel_writers_commits_on_the_coordinators_thread() {
    let (committed, threads) = run_sink_job(true).await;
    assert_eq!(committed, (0..10_000).collect::<Vec<_>>());
    assert!(!threads.is_empty());
    assert!(
        threads.iter().all(|t| t == "tinyflow-coordinator"),
        "{threads:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_that_takes_records_runs_on_the_jobs_workers() {
    let (committed, threads) = run_sink_job(false).await;
    assert_eq!(committed, (0..10_000).collect::<Vec<_>>());
    assert!(!threads.is_empty());
    assert!(
        threads.iter().all(|t| t != "tinyflow-coordinator"),
        "{threads:?}"
    );
}
