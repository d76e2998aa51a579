//! Runtime benchmarks: the cost of checkpoint barriers meeting at one task.
//!
//! The job: N source subtasks (one batch of 16 records each, then idle
//! without ending) feeding one sink subtask through a rebalance edge, so the
//! sink has N input channels and aligns N barriers per checkpoint.
//! Checkpoints every millisecond, on a current-thread tokio runtime whose
//! clock is paused: the runtime jumps to the next trigger as soon as the job
//! is idle, so wall time is spent only on checkpoint work, never on waiting.
//! The job is started once per benchmark and advanced by each sample; only
//! steady-state checkpoints are timed.
//!
//! Marks are taken with `std::time::Instant` in user code: each source's
//! `snapshot` (called right before it sends its barrier), the sink's
//! `prepare_commit` (called once the last of its N barriers arrived:
//! alignment done) and the sink's `commit` (the checkpoint is complete).
//! One iteration is one checkpoint, timed as:
//!
//! - `runtime/alignment/inputs=N`: last source snapshot to `prepare_commit`:
//!   the last source's barrier send and ack, then the sink's wake-up and its
//!   handling of the N barriers queued on its N inputs. This is the aligning
//!   task's own cost, plus a constant.
//! - `runtime/fan_in/inputs=N`: first source snapshot to `prepare_commit`:
//!   the above plus every other source's trigger handling (snapshot, barrier
//!   send, ack), which on one thread runs before the sink's.
//! - `runtime/checkpoint/inputs=N`: commit to commit: a whole checkpoint in
//!   steady state (trigger to N + 1 tasks, fan-in, N + 1 acks, persist in
//!   memory, N + 1 notifications, the sink's commit).
//!
//! The runtime's own `tinyflow_alignment_seconds` metric is not used: it is
//! timed on tokio's clock, which is paused here.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tinyflow_api::{
    CheckpointId, JobBuilder, JobId, OperatorContext, Sink, SinkFactory, SinkRestore, Source,
    SourceFactory, StreamResult,
};
use tinyflow_benches::pipeline::{AtEnd, CyclicSource, LatestStore};
use tinyflow_checkpoint::CheckpointConfig;
use tinyflow_runtime::{JobRunner, RuntimeConfig};
use tokio::sync::watch;

const INPUTS: [usize; 3] = [2, 8, 64];
const RECORDS_PER_SOURCE: u64 = 16;
const INTERVAL: Duration = Duration::from_millis(1);

/// Wall-clock marks shared by the probed sources and sink of one job.
#[derive(Debug)]
struct Probe {
    marks: Mutex<Marks>,
    /// Checkpoints aligned at the sink so far.
    aligned: watch::Sender<u64>,
    /// Checkpoints committed at the sink so far.
    committed: watch::Sender<u64>,
    /// How the job ended, should it ever.
    ended: watch::Sender<Option<String>>,
}

#[derive(Debug, Default)]
struct Marks {
    /// First and last source snapshot of the checkpoint being aligned.
    first_barrier: Option<Instant>,
    last_barrier: Option<Instant>,
    /// Sums over aligned checkpoints since the last reset.
    from_first: Duration,
    from_last: Duration,
}

impl Probe {
    fn new() -> Self {
        Probe {
            marks: Mutex::default(),
            aligned: watch::Sender::new(0),
            committed: watch::Sender::new(0),
            ended: watch::Sender::new(None),
        }
    }

    fn marks(&self) -> std::sync::MutexGuard<'_, Marks> {
        self.marks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn barrier_sent(&self) {
        let now = Instant::now();
        let mut marks = self.marks();
        marks.first_barrier.get_or_insert(now);
        marks.last_barrier = Some(now);
    }

    fn aligned(&self) {
        let now = Instant::now();
        {
            let mut marks = self.marks();
            let first = marks
                .first_barrier
                .take()
                .expect("a source snapshotted before the sink aligned");
            let last = marks.last_barrier.take().unwrap_or(first);
            marks.from_first += now - first;
            marks.from_last += now - last;
        }
        self.aligned.send_modify(|n| *n += 1);
    }

    /// Takes the sums of windows (from the first, from the last barrier)
    /// since the last call.
    fn take_windows(&self) -> (Duration, Duration) {
        let mut marks = self.marks();
        (
            std::mem::take(&mut marks.from_first),
            std::mem::take(&mut marks.from_last),
        )
    }
}

/// Wraps a source so that its snapshots mark the start of a barrier window.
struct ProbedSource<F> {
    inner: F,
    probe: Arc<Probe>,
}

impl<F: SourceFactory<u64>> SourceFactory<u64> for ProbedSource<F> {
    fn create(
        &self,
        ctx: &OperatorContext,
        restored: &[Vec<u8>],
    ) -> StreamResult<Box<dyn Source<u64>>> {
        Ok(Box::new(ProbedReader {
            inner: self.inner.create(ctx, restored)?,
            probe: Arc::clone(&self.probe),
        }))
    }
}

struct ProbedReader {
    inner: Box<dyn Source<u64>>,
    probe: Arc<Probe>,
}

#[async_trait::async_trait]
impl Source<u64> for ProbedReader {
    async fn next_batch(&mut self) -> StreamResult<Option<Vec<u64>>> {
        self.inner.next_batch().await
    }

    fn snapshot(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>> {
        self.probe.barrier_sent();
        self.inner.snapshot(id)
    }
}

/// A sink that discards records and marks alignment and commit.
struct ProbedSink {
    probe: Arc<Probe>,
}

#[async_trait::async_trait]
impl SinkFactory<u64> for ProbedSink {
    async fn create(
        &self,
        _ctx: &OperatorContext,
        _restored: Option<SinkRestore<'_>>,
    ) -> StreamResult<Box<dyn Sink<u64>>> {
        Ok(Box::new(ProbedWriter {
            probe: Arc::clone(&self.probe),
        }))
    }
}

struct ProbedWriter {
    probe: Arc<Probe>,
}

#[async_trait::async_trait]
impl Sink<u64> for ProbedWriter {
    async fn write(&mut self, _batch: Vec<u64>) -> StreamResult<()> {
        Ok(())
    }

    async fn prepare_commit(&mut self, _id: CheckpointId) -> StreamResult<Vec<u8>> {
        self.probe.aligned();
        Ok(Vec::new())
    }

    async fn commit(&mut self, _id: CheckpointId) -> StreamResult<()> {
        self.probe.committed.send_modify(|n| *n += 1);
        Ok(())
    }
}

/// A fan-in job of `inputs` sources into one sink, running on its own
/// paused current-thread runtime; it advances only inside `block_on`.
struct FanIn {
    runtime: tokio::runtime::Runtime,
    job: tokio::task::JoinHandle<()>,
    probe: Arc<Probe>,
}

impl FanIn {
    fn start(inputs: usize) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("building a paused current-thread tokio runtime");
        let probe = Arc::new(Probe::new());
        let job = JobBuilder::new(JobId::new("alignment").expect("valid job id"));
        let records = RECORDS_PER_SOURCE * u64::try_from(inputs).expect("inputs fit in u64");
        let events = Arc::new((0..records).collect::<Vec<u64>>());
        let source = CyclicSource::new(events, records, 1024, AtEnd::Idle);
        job.source(
            "inputs",
            inputs,
            ProbedSource {
                inner: source,
                probe: Arc::clone(&probe),
            },
        )
        .rebalance()
        .sink(
            "aligner",
            1,
            ProbedSink {
                probe: Arc::clone(&probe),
            },
        );
        let config = RuntimeConfig {
            checkpoint: CheckpointConfig {
                interval: Some(INTERVAL),
                ..CheckpointConfig::default()
            },
            ..RuntimeConfig::default()
        };
        let runner = JobRunner::new(
            job.build().expect("the fan-in job is valid"),
            Arc::new(LatestStore::new()),
            config,
        );
        let ended = Arc::clone(&probe);
        let job = runtime.spawn(async move {
            let outcome = runner.run().await;
            ended.ended.send_replace(Some(format!("{outcome:?}")));
        });
        let fan_in = FanIn {
            runtime,
            job,
            probe,
        };
        // Past start-up: the first checkpoint is committed.
        fan_in.committed_after(1);
        fan_in
    }

    /// Runs the job until `more` further checkpoints are committed.
    fn committed_after(&self, more: u64) {
        self.run_until(&self.probe.committed, more);
    }

    /// Runs the job until `more` further checkpoints are aligned at the sink.
    fn aligned_after(&self, more: u64) {
        self.run_until(&self.probe.aligned, more);
    }

    /// Runs the job until `counter` grew by `more`. Panics if the job ends:
    /// it never should, and the figures would be of something else.
    fn run_until(&self, counter: &watch::Sender<u64>, more: u64) {
        let mut count = counter.subscribe();
        let mut ended = self.probe.ended.subscribe();
        let target = *count.borrow() + more;
        self.runtime.block_on(async {
            tokio::select! {
                reached = count.wait_for(|n| *n >= target) => {
                    reached.expect("the probe outlives the job");
                }
                outcome = ended.wait_for(Option::is_some) => {
                    let outcome = outcome.expect("the probe outlives the job");
                    panic!("the fan-in job ended: {:?}", outcome.as_deref());
                }
            }
        });
    }
}

impl Drop for FanIn {
    fn drop(&mut self) {
        self.job.abort();
    }
}

/// Which barrier window an alignment benchmark sums.
#[derive(Debug, Clone, Copy)]
enum Window {
    FromFirstBarrier,
    FromLastBarrier,
}

fn barrier_windows(c: &mut Criterion, group: &str, window: Window) {
    let mut group = c.benchmark_group(group);
    for inputs in INPUTS {
        let fan_in = FanIn::start(inputs);
        group.throughput(Throughput::Elements(1));
        group.bench_function(format!("inputs={inputs}"), |b| {
            b.iter_custom(|iters| {
                // Finish the checkpoint in flight, so every window counted
                // started after the reset.
                fan_in.committed_after(1);
                fan_in.probe.take_windows();
                fan_in.aligned_after(iters);
                let (from_first, from_last) = fan_in.probe.take_windows();
                match window {
                    Window::FromFirstBarrier => from_first,
                    Window::FromLastBarrier => from_last,
                }
            });
        });
    }
    group.finish();
}

fn alignment(c: &mut Criterion) {
    barrier_windows(c, "runtime/alignment", Window::FromLastBarrier);
}

fn fan_in(c: &mut Criterion) {
    barrier_windows(c, "runtime/fan_in", Window::FromFirstBarrier);
}

fn checkpoint(c: &mut Criterion) {
    let mut group = c.benchmark_group("runtime/checkpoint");
    for inputs in INPUTS {
        let fan_in = FanIn::start(inputs);
        group.throughput(Throughput::Elements(1));
        group.bench_function(format!("inputs={inputs}"), |b| {
            b.iter_custom(|iters| {
                fan_in.committed_after(1);
                let started = Instant::now();
                fan_in.committed_after(iters);
                started.elapsed()
            });
        });
    }
    group.finish();
}

criterion_group!(benches, alignment, fan_in, checkpoint);
criterion_main!(benches);
