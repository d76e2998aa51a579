//! The checkpoint coordinator end to end, with a simulated source and a
//! simulated transactional sink, run as `cargo xtask demo` (or
//! `cargo run --release -p tinyflow-checkpoint --example checkpoint_demo`).
//!
//! A source task emits the numbers `0..records`; a committer task stages
//! them per checkpoint and commits a checkpoint's rows to a "table" only when
//! the coordinator says it is durable. In the first attempt the committer
//! crashes right after it learns that checkpoint 3 completed and before it
//! commits it: the coordinator fails the attempt, the demo restarts the job
//! from the local checkpoint directory, recovery commits the restored pending
//! rows, the source resumes from its checkpointed offset, and a final
//! checkpoint commits the tail. At the end the table must hold every number
//! exactly once.
//!
//! Options: `--records N` (default 1000000, sent at about 500k/s), `--interval-ms N` (default 200),
//! `--dir PATH` (default `.tinyflow/demo`, wiped at start).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tinyflow_api::{
    CheckpointId, FromTask, JobId, StateHandle, SystemWallClock, TaskId, TaskRole, ToTask,
};
use tinyflow_checkpoint::{
    CheckpointConfig, CoordinatorDriver, CoordinatorHandle, DriverConfig, LocalDirStore, Outcome,
};
use tokio::sync::mpsc;

const SOURCE: TaskId = TaskId::new(0);
const COMMITTER: TaskId = TaskId::new(1);
const BATCH: u64 = 1_000;

/// The external system: rows and the last checkpoint committed into it, as
/// an Iceberg table keeps them in its snapshot summaries.
#[derive(Debug, Default)]
struct Table {
    rows: Vec<u64>,
    last_committed: Option<CheckpointId>,
    commits: usize,
}

impl Table {
    /// Commits `pending` checkpoints up to `upto` in one transaction; the
    /// "already committed?" check is part of the commit itself.
    fn commit(
        &mut self,
        pending: &mut BTreeMap<CheckpointId, Vec<(u64, u64)>>,
        upto: CheckpointId,
    ) {
        let rest = pending.split_off(&upto.next());
        let due = std::mem::replace(pending, rest);
        let mut rows = 0;
        for (id, ranges) in due {
            if self.last_committed.is_some_and(|last| id <= last) {
                continue; // committed before a crash: dedupe by checkpoint id
            }
            for (start, end) in ranges {
                self.rows.extend(start..end);
                rows += end - start;
            }
        }
        if self.last_committed < Some(upto) {
            self.last_committed = Some(upto);
            self.commits += 1;
            tracing::info!(checkpoint = %upto, rows, "committed to the table");
        }
    }
}

enum Data {
    Rows(u64, u64),
    Barrier(CheckpointId),
}

struct Args {
    records: u64,
    interval: Duration,
    dir: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        records: 1_000_000,
        interval: Duration::from_millis(200),
        dir: ".tinyflow/demo".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value:?}: {e}"))
        };
        match flag.as_str() {
            "--records" => args.records = number()?,
            "--interval-ms" => args.interval = Duration::from_millis(number()?.max(1)),
            "--dir" => args.dir = value.clone().into(),
            other => {
                return Err(format!(
                    "unknown option {other}; expected --records, --interval-ms or --dir"
                ));
            }
        }
    }
    Ok(args)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tinyflow_checkpoint=info".into()),
        )
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let args = parse_args()?;
    if args.dir.exists() {
        std::fs::remove_dir_all(&args.dir)?;
    }
    let job = JobId::new("checkpoint-demo")?;
    let table = Arc::new(Mutex::new(Table::default()));
    let mut attempt = 0;
    loop {
        attempt += 1;
        let crash_at = (attempt == 1).then_some(CheckpointId::new(3));
        let store =
            Arc::new(LocalDirStore::open(args.dir.join("checkpoints"), job.clone(), 3).await?);
        let mut config = DriverConfig::new(
            job.clone(),
            CheckpointConfig {
                interval: Some(args.interval),
                ..CheckpointConfig::default()
            },
        );
        config.has_transactional_sink = true;
        config.sinks_committed = lock(&table).last_committed;
        tracing::info!(attempt, "starting job attempt");
        match run_attempt(config, store, &args, Arc::clone(&table), crash_at).await {
            Ok(Outcome::Finished { final_checkpoint }) => {
                tracing::info!(attempt, ?final_checkpoint, "job finished");
                break;
            }
            Ok(Outcome::Shutdown) => return Err("coordinator shut down unexpectedly".into()),
            Err(e) if e.is_retryable() && attempt < 3 => {
                tracing::warn!(attempt, error = %e, "job attempt failed, restarting from the last checkpoint");
            }
            Err(e) => return Err(e.into()),
        }
    }
    let table = lock(&table);
    let mut sorted = table.rows.clone();
    sorted.sort_unstable();
    sorted.dedup();
    let duplicates = table.rows.len() - sorted.len();
    let missing = args.records - sorted.len() as u64;
    let exact =
        duplicates == 0 && missing == 0 && sorted.last().is_none_or(|l| *l + 1 == args.records);
    let summary = format!(
        "records produced: {}\nrows in table: {}\ncommits: {}\nlast committed checkpoint: {:?}\njob attempts: {attempt}\n\
         duplicates: {duplicates}\nmissing: {missing}\nexactly once: {}",
        args.records,
        table.rows.len(),
        table.commits,
        table.last_committed.map(CheckpointId::get),
        if exact { "yes" } else { "NO" },
    );
    tracing::info!("summary\n{summary}");
    if exact {
        Ok(())
    } else {
        Err("the table does not hold every record exactly once".into())
    }
}

fn lock(table: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    table.lock().expect("table lock poisoned")
}

async fn run_attempt(
    config: DriverConfig,
    store: Arc<LocalDirStore>,
    args: &Args,
    table: Arc<Mutex<Table>>,
    crash_at: Option<CheckpointId>,
) -> tinyflow_checkpoint::Result<Outcome> {
    let (driver, handle, restored) =
        CoordinatorDriver::start(config, store, Arc::new(SystemWallClock)).await?;
    let state = |task| {
        restored
            .checkpoint
            .as_ref()
            .and_then(|c| c.task_states.get(&task))
            .cloned()
    };
    // Recovery: the source seeks to its checkpointed offset; the committer
    // commits every restored pending checkpoint not yet in the table.
    let offset = state(SOURCE).map_or(0, |s| decode_offset(&s));
    let mut pending = state(COMMITTER)
        .map(|s| decode_pending(&s))
        .unwrap_or_default();
    if let Some(cp) = &restored.checkpoint {
        tracing::info!(checkpoint = %cp.id, offset, pending = pending.len(), "restored");
        lock(&table).commit(&mut pending, cp.id);
    }
    let (source_tx, source_rx) = mpsc::channel(4);
    let (committer_tx, committer_rx) = mpsc::channel(4);
    handle
        .register(SOURCE, TaskRole::Source, source_tx)
        .await
        .expect("driver not started yet");
    handle
        .register(COMMITTER, TaskRole::Committer, committer_tx)
        .await
        .expect("driver not started yet");
    let (data_tx, data_rx) = mpsc::channel(16);
    let source = tokio::spawn(run_source(
        source_rx,
        data_tx,
        handle.clone(),
        offset,
        args.records,
    ));
    let committer = tokio::spawn(run_committer(
        committer_rx,
        data_rx,
        handle,
        pending,
        table,
        crash_at,
    ));
    let outcome = driver.run(std::future::pending()).await;
    // The driver is gone, so the tasks' control channels close and they end.
    let _ = source.await;
    let _ = committer.await;
    outcome
}

async fn run_source(
    mut control: mpsc::Receiver<ToTask>,
    data: mpsc::Sender<Data>,
    coordinator: CoordinatorHandle,
    mut offset: u64,
    records: u64,
) {
    let mut ended = false;
    loop {
        tokio::select! {
            biased;
            msg = control.recv() => match msg {
                Some(ToTask::TriggerCheckpoint { id, .. }) => {
                    // The barrier goes after every row before `offset`.
                    if data.send(Data::Barrier(id)).await.is_err() { return }
                    let state = StateHandle::from(offset.to_le_bytes().to_vec());
                    if coordinator.send(FromTask::Ack { task: SOURCE, id, state }).await.is_err() { return }
                }
                Some(_) => {}
                None => return,
            },
            permit = data.reserve(), if offset < records => {
                let Ok(permit) = permit else { return };
                let end = (offset + BATCH).min(records);
                permit.send(Data::Rows(offset, end));
                offset = end;
                // Pace the source so the demo shows a few checkpoints.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            () = std::future::ready(()), if offset == records && !ended => {
                ended = true;
                if coordinator.send(FromTask::EndOfInput { task: SOURCE }).await.is_err() { return }
            }
        }
    }
}

async fn run_committer(
    mut control: mpsc::Receiver<ToTask>,
    mut data: mpsc::Receiver<Data>,
    coordinator: CoordinatorHandle,
    mut pending: BTreeMap<CheckpointId, Vec<(u64, u64)>>,
    table: Arc<Mutex<Table>>,
    crash_at: Option<CheckpointId>,
) {
    let mut staged = Vec::new();
    let mut data_open = true;
    loop {
        tokio::select! {
            biased;
            msg = control.recv() => match msg {
                Some(ToTask::NotifyComplete { id }) => {
                    if crash_at.is_some_and(|c| id >= c) {
                        tracing::warn!(checkpoint = %id, "committer crashes before committing (simulated)");
                        return;
                    }
                    lock(&table).commit(&mut pending, id);
                }
                // Aborted checkpoints keep their rows pending: a later
                // checkpoint commits them.
                Some(_) => {}
                None => return,
            },
            item = data.recv(), if data_open => match item {
                Some(Data::Rows(start, end)) => staged.push((start, end)),
                Some(Data::Barrier(id)) => {
                    pending.insert(id, std::mem::take(&mut staged));
                    let state = StateHandle::from(encode_pending(&pending));
                    if coordinator.send(FromTask::Ack { task: COMMITTER, id, state }).await.is_err() { return }
                }
                None => data_open = false,
            },
        }
    }
}

fn decode_offset(state: &StateHandle) -> u64 {
    state
        .as_bytes()
        .try_into()
        .map(u64::from_le_bytes)
        .expect("source state is 8 bytes")
}

fn encode_pending(pending: &BTreeMap<CheckpointId, Vec<(u64, u64)>>) -> Vec<u8> {
    let mut out = Vec::new();
    for (id, ranges) in pending {
        for (start, end) in ranges {
            for n in [id.get(), *start, *end] {
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
    }
    out
}

fn decode_pending(state: &StateHandle) -> BTreeMap<CheckpointId, Vec<(u64, u64)>> {
    let mut pending: BTreeMap<_, Vec<_>> = BTreeMap::new();
    let words: Vec<u64> = state
        .as_bytes()
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
        .collect();
    for triple in words.chunks_exact(3) {
        pending
            .entry(CheckpointId::new(triple[0]))
            .or_default()
            .push((triple[1], triple[2]));
    }
    pending
}
