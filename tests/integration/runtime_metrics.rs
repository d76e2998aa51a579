//! Observability: a job reports per-operator records in and out, alignment
//! and checkpoint figures through the `metrics` facade.

use std::collections::HashMap;
use std::sync::Arc;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tinyflow_api::testing::{CollectingSink, MemoryCheckpointStore, VecSource};
use tinyflow_api::{JobBuilder, JobId};
use tinyflow_checkpoint::CheckpointConfig;
use tinyflow_runtime::{JobRunner, RuntimeConfig};
use tinyflow_tests::ms;

#[test]
fn job_reports_records_checkpoints_and_alignment() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let sink = CollectingSink::<u64>::new();
            let job = JobBuilder::new(JobId::new("observed").unwrap());
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
            let config = RuntimeConfig {
                checkpoint: CheckpointConfig {
                    interval: Some(ms(10)),
                    ..CheckpointConfig::default()
                },
                ..RuntimeConfig::default()
            };
            JobRunner::new(
                job.build().unwrap(),
                Arc::new(MemoryCheckpointStore::new()),
                config,
            )
            .run()
            .await
            .unwrap();
            assert_eq!(sink.committed().len(), 500);
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
