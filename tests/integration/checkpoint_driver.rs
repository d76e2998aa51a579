//! The coordinator's async driver under tokio's paused clock: exact
//! durations of interval, timeout and minimum pause; store failures;
//! failure tolerance; deregistration; outbox bounds under backpressure; and
//! determinism (same seed, same trace).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tinyflow_checkpoint::testing::MemoryCheckpointStore;
use tinyflow_checkpoint::{AbortReason, DeclineReason, FromTask, StateHandle, TaskRole, ToTask};
use tinyflow_checkpoint::{CheckpointConfig, CoordinatorHandle, DriverConfig, Error, Outcome};
use tinyflow_tests::{Harness, SplitMix64, TaskSpec, cid, every, job_id, ms, tid};

#[tokio::test(start_paused = true)]
async fn slow_acks_do_not_move_the_fixed_rate_grid() {
    let (mut h, _store) =
        Harness::with_memory(every(100), &[TaskSpec::new(0, TaskRole::Source)]).await;
    for n in 1..=5u64 {
        let id = h.expect_trigger(0, ms(100)).await;
        assert_eq!(h.elapsed(), ms(100 * n));
        tokio::time::sleep(ms(70)).await;
        h.ack(0, id, b"").await;
        h.expect_notified(&[0], id).await;
    }
    h.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn min_pause_is_kept_after_each_completion() {
    let config = CheckpointConfig {
        min_pause: ms(150),
        ..every(100)
    };
    let (mut h, _store) = Harness::with_memory(config, &[TaskSpec::new(0, TaskRole::Source)]).await;
    // Each checkpoint completes 10 ms after its trigger; the next may start
    // 150 ms after that: 100, 110+150, 270+150, 430+150.
    for expected in [100, 260, 420, 580] {
        let id = h.expect_trigger(0, ms(1_000)).await;
        assert_eq!(h.elapsed(), ms(expected));
        tokio::time::sleep(ms(10)).await;
        h.ack(0, id, b"").await;
        h.expect_notified(&[0], id).await;
    }
    h.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn store_failure_aborts_the_checkpoint_and_the_next_one_retries() {
    let (mut h, store) =
        Harness::with_memory(every(100), &[TaskSpec::new(0, TaskRole::Source)]).await;
    store.fail_next_writes(1);
    let first = h.expect_trigger(0, ms(100)).await;
    h.ack(0, first, b"a").await;
    assert_eq!(
        h.expect(0, ms(1)).await,
        ToTask::Abort {
            id: first,
            reason: AbortReason::StoreFailed
        }
    );
    let second = h.expect_trigger(0, ms(100)).await;
    assert_eq!(h.elapsed(), ms(200));
    h.ack(0, second, b"b").await;
    h.expect_notified(&[0], second).await;
    assert_eq!(store.attempted_ids(), vec![first, second]);
    assert_eq!(store.persisted_ids(), vec![second]);
    h.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn failures_past_tolerance_fail_the_job_and_a_completion_resets_the_count() {
    let config = CheckpointConfig {
        tolerable_failures: 2,
        ..every(100)
    };
    let (mut h, _store) = Harness::with_memory(config, &[TaskSpec::new(0, TaskRole::Source)]).await;
    let decline = |id| FromTask::Decline {
        task: tid(0),
        id,
        reason: DeclineReason::NotReady,
    };
    // decline, decline, complete, decline, decline: still within tolerance.
    for complete in [false, false, true, false, false] {
        let id = h.expect_trigger(0, ms(100)).await;
        if complete {
            h.ack(0, id, b"").await;
            h.expect_notified(&[0], id).await;
        } else {
            h.send(decline(id)).await;
            assert!(matches!(
                h.expect(0, ms(1)).await,
                ToTask::Abort {
                    reason: AbortReason::Declined { .. },
                    ..
                }
            ));
        }
    }
    assert!(!h.job.is_finished());
    let id = h.expect_trigger(0, ms(100)).await;
    assert_eq!(id, cid(6));
    h.send(decline(id)).await;
    let err = h.outcome().await.unwrap_err();
    match &err {
        Error::TooManyFailures {
            failures: 3,
            tolerated: 2,
            last,
            reason: AbortReason::Declined { task, .. },
        } => {
            assert_eq!((*last, *task), (cid(6), tid(0)));
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(
        err.to_string().contains("3 consecutive checkpoints failed"),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn deregistration_aborts_waiting_checkpoints_without_failing_the_job() {
    let config = CheckpointConfig {
        tolerable_failures: 0,
        ..every(100)
    };
    let specs = [
        TaskSpec::new(0, TaskRole::Source),
        TaskSpec::new(1, TaskRole::Operator),
    ];
    let (mut h, _store) = Harness::with_memory(config, &specs).await;
    let id = h.expect_trigger(0, ms(100)).await;
    h.ack(0, id, b"").await;
    h.handle.deregister(tid(1)).await.unwrap();
    assert_eq!(
        h.expect(0, ms(1)).await,
        ToTask::Abort {
            id,
            reason: AbortReason::TaskDeregistered { task: tid(1) }
        }
    );
    // Not a failure: with zero tolerance the job still runs, and the next
    // checkpoint no longer waits for task 1.
    let next = h.expect_trigger(0, ms(100)).await;
    h.ack(0, next, b"").await;
    h.expect_notified(&[0], next).await;
    h.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn reported_task_failure_fails_the_job_with_its_message() {
    let specs = [
        TaskSpec::new(0, TaskRole::Source),
        TaskSpec::new(1, TaskRole::Operator),
    ];
    let (mut h, _store) = Harness::with_memory(every(100), &specs).await;
    let id = h.expect_trigger(0, ms(100)).await;
    h.send(FromTask::Failed {
        task: tid(1),
        message: "map function panicked".into(),
    })
    .await;
    assert_eq!(
        h.expect(0, ms(1)).await,
        ToTask::Abort {
            id,
            reason: AbortReason::TaskLost { task: tid(1) }
        }
    );
    let err = h.outcome().await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "task-1 was lost: it reported: map function panicked"
    );
    assert!(err.is_retryable());
}

/// A task that never reads its channel: checkpoints expire one after the
/// other, but what waits for it stays bounded (queued triggers are dropped
/// when their checkpoint is aborted), and when it finally reads it gets a
/// short, ordered backlog.
#[tokio::test(start_paused = true)]
async fn outbox_of_a_stalled_task_stays_bounded() {
    let config = CheckpointConfig {
        timeout: ms(50),
        tolerable_failures: u32::MAX,
        ..every(100)
    };
    let specs = [TaskSpec::new(0, TaskRole::Source).capacity(1)];
    let (mut h, store) = Harness::with_memory(config, &specs).await;
    tokio::time::sleep(ms(100 * 1_000 + 10)).await;
    assert!(!h.job.is_finished());
    let mut backlog = Vec::new();
    while let Ok(Ok(Some(msg))) = tokio::time::timeout(ms(1), h.rx(0).recv())
        .await
        .map(Ok::<_, ()>)
    {
        backlog.push(msg);
    }
    // Trigger(1) filled the channel; Abort(1) waited for room; triggers 2..
    // were queued and dropped again as each expired; the trigger of the
    // checkpoint in flight now (1000, at 100 s) is all that is left.
    assert_eq!(
        backlog,
        vec![
            ToTask::TriggerCheckpoint {
                id: cid(1),
                timestamp_ms: 1_700_000_000_000
            },
            ToTask::Abort {
                id: cid(1),
                reason: AbortReason::Expired
            },
            ToTask::TriggerCheckpoint {
                id: cid(1_000),
                timestamp_ms: 1_700_000_000_000
            },
        ],
    );
    assert!(store.persisted_ids().is_empty());
    h.shutdown().await.unwrap();
}

type Trace = Vec<(Duration, u32, ToTask)>;

/// Plays `tasks` fake tasks with seeded random ack delays and declines for
/// five virtual seconds and returns what every task received, when.
async fn random_run(seed: u64) -> (Trace, Vec<u64>, Outcome) {
    let config = CheckpointConfig {
        timeout: ms(120),
        max_concurrent: 2,
        tolerable_failures: u32::MAX,
        ..every(100)
    };
    let specs: Vec<_> = (0..4)
        .map(|i| {
            TaskSpec::new(
                i,
                if i == 0 {
                    TaskRole::Source
                } else {
                    TaskRole::Operator
                },
            )
            .capacity(1 + i as usize)
        })
        .collect();
    let store = MemoryCheckpointStore::new();
    let mut h = Harness::start(
        DriverConfig::new(job_id(), config),
        Arc::new(store.clone()),
        &specs,
    )
    .await
    .unwrap();
    let trace = Arc::new(Mutex::new(Trace::new()));
    let mut players = Vec::new();
    for spec in &specs {
        let rx = h.tasks.get_mut(&tid(spec.id)).unwrap().rx.take().unwrap();
        players.push(tokio::spawn(play(
            spec.id,
            rx,
            h.handle.clone(),
            SplitMix64::new(seed ^ u64::from(spec.id) << 32),
            Arc::clone(&trace),
            h.start,
        )));
    }
    tokio::time::sleep(ms(5_000)).await;
    let outcome = h.shutdown().await.unwrap();
    for p in players {
        p.await.unwrap();
    }
    let persisted = store.attempted_ids().iter().map(|id| id.get()).collect();
    let trace = trace.lock().unwrap().clone();
    (trace, persisted, outcome)
}

async fn play(
    task: u32,
    mut rx: tokio::sync::mpsc::Receiver<ToTask>,
    handle: CoordinatorHandle,
    mut rng: SplitMix64,
    trace: Arc<Mutex<Trace>>,
    start: tokio::time::Instant,
) {
    while let Some(msg) = rx.recv().await {
        trace
            .lock()
            .unwrap()
            .push((start.elapsed(), task, msg.clone()));
        if let ToTask::TriggerCheckpoint { id, .. } = msg {
            tokio::time::sleep(ms(rng.below(150))).await;
            let reply = if rng.below(10) == 0 {
                FromTask::Decline {
                    task: tid(task),
                    id,
                    reason: DeclineReason::NotReady,
                }
            } else {
                FromTask::Ack {
                    task: tid(task),
                    id,
                    state: StateHandle::from(id.get().to_le_bytes().to_vec()),
                }
            };
            if handle.send(reply).await.is_err() {
                return;
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn same_seed_gives_the_same_trace() {
    let first = random_run(7).await;
    let again = random_run(7).await;
    assert!(
        first.0.len() > 50,
        "too little happened to compare: {} messages",
        first.0.len()
    );
    assert!(
        first.1.len() > 5,
        "too few checkpoints persisted: {:?}",
        first.1
    );
    assert_eq!(first, again);
    let other = random_run(8).await;
    assert_ne!(first.0, other.0, "a different seed should change the trace");
}

/// With `wait_for_start`, nothing is triggered and no source's end counts
/// until every task is registered: the grid starts at the start signal.
#[tokio::test(start_paused = true)]
async fn nothing_triggers_or_finishes_before_the_start_signal() {
    let store = MemoryCheckpointStore::new();
    let mut config = DriverConfig::new(job_id(), every(100));
    config.wait_for_start = true;
    let mut h = Harness::start(
        config,
        Arc::new(store.clone()),
        &[TaskSpec::new(0, TaskRole::Source)],
    )
    .await
    .unwrap();
    // The only source registered so far ends: that is not the job's end.
    h.send(FromTask::EndOfInput { task: tid(0) }).await;
    h.expect_silence(0, ms(500)).await;
    let (tx, mut rx) = tinyflow_checkpoint::testing::control_channel(8);
    h.handle
        .register(tid(1), TaskRole::Source, tx)
        .await
        .unwrap();
    h.handle.start().await.unwrap();
    // Start at 500 ms: the first grid point is one interval later.
    let id = h.expect_trigger(0, ms(100)).await;
    assert_eq!(h.elapsed(), ms(600));
    assert!(matches!(rx.recv().await, Some(ToTask::TriggerCheckpoint { id: t, .. }) if t == id));
    h.ack(0, id, b"").await;
    h.ack(1, id, b"").await;
    h.expect_notified(&[0], id).await;
    // Now the second source ends too: the final checkpoint follows at once.
    h.send(FromTask::EndOfInput { task: tid(1) }).await;
    let last = h.expect_trigger(0, ms(1)).await;
    assert!(last > id);
    h.shutdown().await.unwrap();
}

/// A stop request (what `tinyflow run` does on SIGTERM) takes a final
/// checkpoint at once, off the grid, while the sources still read; the job
/// finishes only after it is durable and every task was notified, so sinks
/// commit everything up to it before the process exits.
#[tokio::test(start_paused = true)]
async fn a_stop_request_finishes_the_job_with_a_final_checkpoint() {
    let specs = [
        TaskSpec::new(0, TaskRole::Source),
        TaskSpec::new(1, TaskRole::Committer),
    ];
    let (mut h, store) = Harness::with_memory(every(10_000), &specs).await;
    let first = h.expect_trigger(0, ms(10_000)).await;
    assert_eq!(h.expect_trigger(1, ms(1)).await, first);
    h.ack(0, first, b"s1").await;
    h.ack(1, first, b"c1").await;
    h.expect_notified(&[0, 1], first).await;
    tokio::time::sleep(ms(2_500)).await;
    h.request_stop();
    let last = h.expect_trigger(0, ms(1)).await;
    assert_eq!(
        h.elapsed(),
        ms(12_500),
        "triggered at once, not on the grid"
    );
    assert_eq!(h.expect_trigger(1, ms(1)).await, last);
    // Until it completes the job runs on: no outcome yet.
    h.expect_silence(0, ms(5_000)).await;
    assert!(!h.job.is_finished());
    h.ack(0, last, b"s2").await;
    h.ack(1, last, b"c2").await;
    h.expect_notified(&[0, 1], last).await;
    assert_eq!(
        h.outcome().await.unwrap(),
        Outcome::Finished {
            final_checkpoint: Some(last)
        }
    );
    let stored = store.get(last).expect("final checkpoint durable");
    assert!(stored.is_final);
    assert_eq!(store.persisted_ids(), vec![first, last]);
}
