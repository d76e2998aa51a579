//! Checkpoint subsystem benchmarks.
//!
//! - `coordinator/ack/tasks=N`: acks handled per second by the pure
//!   [`Coordinator`](tinyflow_checkpoint::Coordinator) with N tasks. One
//!   iteration is one whole checkpoint (trigger on a tick, one ack per task,
//!   store durable, notifications), so the figure is the steady-state cost of
//!   a checkpoint divided by its acks.
//! - `store/persist/bytes=N`: latency of `LocalDirStore::persist` for a
//!   checkpoint of N state bytes over four tasks, in a temporary directory,
//!   retention at three files; includes both fsyncs and the retention sweep.
//!
//! Inputs come from a fixed seed (see `tinyflow_benches`).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tinyflow_api::CheckpointId;
use tinyflow_benches::{AckRounds, bench_job, checkpoint_of_size};
use tinyflow_checkpoint::CheckpointStore;
use tinyflow_checkpoint::LocalDirStore;

const TASK_COUNTS: [u32; 3] = [1, 64, 1024];
const PERSIST_BYTES: [usize; 2] = [1024, 1024 * 1024];
const PERSIST_TASKS: u32 = 4;

fn coordinator_acks(c: &mut Criterion) {
    let mut group = c.benchmark_group("coordinator/ack");
    for tasks in TASK_COUNTS {
        let mut rounds = AckRounds::new(tasks);
        let acks = u64::try_from(rounds.tasks()).expect("task count fits in u64");
        group.throughput(Throughput::Elements(acks));
        group.bench_function(format!("tasks={tasks}"), |b| {
            b.iter(|| black_box(rounds.round()));
        });
    }
    group.finish();
}

fn store_persist(c: &mut Criterion) {
    // The store runs its file I/O on `spawn_blocking`, which needs a runtime.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("building a current-thread tokio runtime");
    let job = bench_job();
    let mut group = c.benchmark_group("store/persist");
    for bytes in PERSIST_BYTES {
        let dir = tempfile::tempdir().expect("creating a temporary directory");
        let store = runtime
            .block_on(LocalDirStore::open(dir.path(), job.clone(), 3))
            .expect("opening the checkpoint store");
        let mut checkpoint = checkpoint_of_size(&job, CheckpointId::FIRST, PERSIST_TASKS, bytes);
        group.throughput(Throughput::Bytes(
            u64::try_from(bytes).expect("size fits in u64"),
        ));
        group.bench_function(format!("bytes={bytes}"), |b| {
            b.iter(|| {
                runtime
                    .block_on(store.persist(&checkpoint))
                    .expect("persisting a checkpoint");
                // Ids grow as in a running job, so retention deletes one file
                // per persist once three are kept.
                checkpoint.id = checkpoint.id.next();
            });
        });
        drop(store);
        dir.close().expect("removing the temporary directory");
    }
    group.finish();
}

criterion_group!(benches, coordinator_acks, store_persist);
criterion_main!(benches);
