//! Observability: a job reports per-operator records in and out (rows, for
//! Arrow record batches), alignment and checkpoint figures through the
//! `metrics` facade.

use std::collections::HashMap;
use std::sync::Arc;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tinyflow_api::testing::{CollectingSink, VecSource};

use tinyflow_api::{JobBuilder, JobId};
use tinyflow_checkpoint::CheckpointConfig;
use tinyflow_runtime::RuntimeConfig;
use tinyflow_tests::{ms, run_in_memory};

/// Counters by (name, operator) and histogram sample counts by name.
type Observed = (HashMap<(String, String), u64>, HashMap<String, usize>);

/// Runs the job `build` makes to its end (10 ms checkpoints, paused clock)
/// under a recorder of its own; returns what was recorded.
fn run_observed(build: impl FnOnce(&JobBuilder)) -> Observed {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let job = JobBuilder::new(JobId::new("observed").unwrap());
            build(&job);
            let config = RuntimeConfig {
                checkpoint: CheckpointConfig {
                    interval: Some(ms(10)),
                    ..CheckpointConfig::default()
                },
                ..RuntimeConfig::default()
            };
            run_in_memory(job, config).await.unwrap();
        });
    });
    let mut counters: HashMap<(String, String), u64> = HashMap::new();
    let mut histograms: HashMap<String, usize> = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let name = key.key().name().to_owned();
        let operator = key
            .key()
            .labels()
            .find(|l| l.key() == "operator")
            .map(|l| l.value().to_owned())
            .unwrap_or_default();
        match value {
            DebugValue::Counter(n) => *counters.entry((name, operator)).or_default() += n,
            DebugValue::Histogram(v) => *histograms.entry(name).or_default() += v.len(),
            DebugValue::Gauge(_) => {}
        }
    }
    (counters, histograms)
}

#[test]
fn job_reports_records_checkpoints_and_alignment() {
    let sink = CollectingSink::<u64>::new();
    let (counters, histograms) = run_observed(|job| {
        job.source(
            "numbers",
            2,
            VecSource::new(vec![(0..500).collect(), (500..1_000).collect()])
                .batch_size(10)
                .pause(ms(1)),
        )
        .filter("even", |n: &u64| n.is_multiple_of(2))
        .rebalance()
        .sink("out", 1, sink.clone());
    });
    assert_eq!(sink.committed().len(), 500);
    let get = |name: &str, op: &str| {
        counters
            .get(&(name.to_owned(), op.to_owned()))
            .copied()
            .unwrap_or(0)
    };
    assert_eq!(get("tinyflow_records_out_total", "numbers"), 1_000);
    assert_eq!(get("tinyflow_records_in_total", "even"), 1_000);
    assert_eq!(get("tinyflow_records_out_total", "even"), 500);
    assert_eq!(get("tinyflow_records_in_total", "out"), 500);
    assert!(
        get("tinyflow_checkpoints_completed_total", "") >= 3,
        "{counters:?}"
    );
    // Every aligned checkpoint of the operator and the sink is timed.
    assert!(
        histograms
            .get("tinyflow_alignment_seconds")
            .copied()
            .unwrap_or(0)
            >= 6,
        "{histograms:?}"
    );
    assert!(
        histograms
            .get("tinyflow_checkpoint_duration_seconds")
            .copied()
            .unwrap_or(0)
            >= 3,
        "{histograms:?}"
    );
}

/// Arrow record batches count as their rows, not as one record each.
#[test]
fn arrow_batches_count_as_their_rows() {
    let batch = |rows: i64| {
        let ids = arrow_array::Int64Array::from_iter_values(0..rows);
        arrow_array::RecordBatch::try_from_iter([("id", Arc::new(ids) as arrow_array::ArrayRef)])
            .unwrap()
    };
    let sink = CollectingSink::<u64>::new();
    let (counters, _) = run_observed(|job| {
        job.source(
            "batches",
            1,
            VecSource::new(vec![(0..40).map(|_| batch(25)).collect()]).batch_size(4),
        )
        .map("count", |b: arrow_array::RecordBatch| b.num_rows() as u64)
        .sink("out", 1, sink.clone());
    });
    assert_eq!(sink.committed().iter().sum::<u64>(), 1_000);
    let get = |name: &str, op: &str| counters.get(&(name.to_owned(), op.to_owned())).copied();
    assert_eq!(get("tinyflow_records_out_total", "batches"), Some(1_000));
    assert_eq!(get("tinyflow_records_in_total", "count"), Some(1_000));
    // What leaves the map are plain numbers: one each.
    assert_eq!(get("tinyflow_records_out_total", "count"), Some(40));
    assert_eq!(get("tinyflow_records_in_total", "out"), Some(40));
}
