//! A job's state beside its table, shown and changed deliberately:
//! `tinyflow inspect JOB.toml` and `tinyflow reset JOB.toml`.
//!
//! The checkpoint directory holds where the job's sources stand and the
//! files its committer has not committed yet; the table holds what was
//! committed, the sink's epoch, and the source positions of the last
//! commit. `inspect` shows both and whether a run would accept them (the
//! committer's own check, [`CommitterView::check`]); `reset` sets the
//! checkpoints aside (moved, never deleted), claims the sink, and leaves a
//! reset file saying where the next run starts.

#![allow(clippy::print_stdout, reason = "the commands' output")]

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tinyflow_checkpoint::LocalDirStore;
use tinyflow_connectors_iceberg::identity::{CommitterView, positions_text};
use tinyflow_connectors_iceberg::{
    committed_id, committed_positions, epoch_owner, layout_start, load_table, table_epoch,
    table_layout,
};
use tinyflow_connectors_kafka::{StartPosition, decode_positions};
use tinyflow_runtime::state::{NodeState, TaskSnapshot};

use crate::{Checkpoints, JobPlan, Placement};

/// The reset file's name in the checkpoint directory.
pub const RESET_FILE: &str = "reset.json";

/// Where `tinyflow reset` told the next run to start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetFile {
    /// The sink's last checkpoint in the table at the reset: the file holds
    /// only while the table is still there (a later run's commits make it
    /// stale, and it is ignored).
    pub table_committed: Option<u64>,
    /// When (seconds since the Unix epoch).
    pub at: u64,
    /// Where the source starts.
    pub start: ResetStart,
}

/// A start position a reset can set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResetStart {
    /// Explicit offsets, `topic/partition` -> next offset (partitions not
    /// named start at the earliest).
    Offsets(BTreeMap<String, i64>),
    /// The first record at or after this time (ms since the Unix epoch).
    TimestampMs(i64),
}

impl ResetStart {
    /// As the Kafka source takes it.
    pub fn position(&self) -> StartPosition {
        match self {
            ResetStart::Offsets(offsets) => StartPosition::Offsets(
                offsets
                    .iter()
                    .filter_map(|(k, v)| {
                        let (topic, partition) = k.rsplit_once('/')?;
                        Some(((topic.to_owned(), partition.parse().ok()?), *v))
                    })
                    .collect(),
            ),
            ResetStart::TimestampMs(ms) => StartPosition::Timestamp(*ms),
        }
    }
}

impl fmt::Display for ResetStart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResetStart::Offsets(offsets) => {
                let parts: Vec<String> = offsets.iter().map(|(k, v)| format!("{k}@{v}")).collect();
                write!(f, "offsets {}", parts.join(", "))
            }
            ResetStart::TimestampMs(ms) => write!(f, "the first records at or after {ms} ms"),
        }
    }
}

impl ResetFile {
    /// The reset file in `dir`, if there is one.
    pub fn read(dir: &Path) -> anyhow::Result<Option<ResetFile>> {
        let path = dir.join(RESET_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .with_context(|| format!("{} is not a reset file", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let path = dir.join(RESET_FILE);
        let tmp = dir.join(format!(".{RESET_FILE}.tmp"));
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("syncing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }
}

/// Parses `--to-offsets`: `topic/partition=offset,...`.
pub fn parse_offsets(text: &str) -> anyhow::Result<BTreeMap<String, i64>> {
    text.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|entry| {
            let (at, offset) = entry
                .trim()
                .split_once('=')
                .with_context(|| format!("`{entry}`: expected topic/partition=offset"))?;
            let (topic, partition) = at
                .rsplit_once('/')
                .with_context(|| format!("`{entry}`: expected topic/partition=offset"))?;
            partition
                .parse::<i32>()
                .with_context(|| format!("`{entry}`: the partition is not a number"))?;
            let offset: i64 = offset
                .parse()
                .ok()
                .filter(|o| *o >= 0)
                .with_context(|| format!("`{entry}`: the offset is not a number >= 0"))?;
            anyhow::ensure!(!topic.is_empty(), "`{entry}`: no topic");
            Ok((at.to_owned(), offset))
        })
        .collect()
}

/// What `inspect` found: whether a run would accept the job's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agreement {
    /// A run would go on from the checkpoint (or start from the table).
    Agree,
    /// A run would refuse the checkpoint.
    Disagree,
}

/// `tinyflow inspect JOB.toml` of a job spread over workers: the table's
/// layout, then each worker's state beside the table as [`inspect`] shows
/// it. `None` when the table records no layout of the job's sink (the job
/// runs in one process).
pub async fn inspect_workers(plan: &JobPlan) -> anyhow::Result<Option<Agreement>> {
    let sink = &plan.sink;
    let Ok(table) = load_table(&sink.catalog, &sink.namespace.join("."), &sink.table).await else {
        return Ok(None);
    };
    let Some(record) = table_layout(&table, &sink.sink_id)? else {
        return Ok(None);
    };
    let layout = record.layout;
    println!(
        "job {}: {} workers (layout generation {}, set by {}; it replaced {})",
        plan.job_id,
        layout.workers,
        layout.generation,
        record.set_by,
        record.previous.map_or_else(
            || "the job in one process, or nothing".to_owned(),
            |p| format!("{} workers of generation {}", p.workers, p.generation)
        )
    );
    match layout_start(&table, &sink.sink_id)? {
        Some(p) => println!("  the layout's start positions: {}", positions_text(&p)),
        None => println!("  the layout's start positions: none (source.start)"),
    }
    let mut agreement = Agreement::Agree;
    for index in 0..layout.workers {
        let worker = tinyflow_api::Worker::new(index, layout.workers)
            .map_err(|m| anyhow::anyhow!("the table's layout: {m}"))?;
        println!();
        println!("worker {worker}:");
        let placement = Placement {
            worker,
            layout,
            base_sink: sink.sink_id.clone(),
            sink_id: layout.sink_id(&sink.sink_id, index),
        };
        if inspect(&plan.as_worker(placement)?).await? == Agreement::Disagree {
            agreement = Agreement::Disagree;
        }
    }
    Ok(Some(agreement))
}

/// `tinyflow inspect JOB.toml`.
pub async fn inspect(plan: &JobPlan) -> anyhow::Result<Agreement> {
    let sink = &plan.sink;
    let name = format!("{}.{}", sink.namespace.join("."), sink.table);
    println!(
        "job {}: sink {} writes table {name} in the {}",
        plan.job_id,
        sink.sink_id,
        sink.catalog.describe()
    );
    let table = match load_table(&sink.catalog, &sink.namespace.join("."), &sink.table).await {
        Ok(t) => Some(t),
        Err(e) => {
            println!("table: cannot be loaded: {e}");
            None
        }
    };
    let committed = table.as_ref().and_then(|t| committed_id(t, &sink.sink_id));
    if let Some(t) = &table {
        let epoch = table_epoch(t, &sink.sink_id);
        println!("table: uuid {}", t.metadata().uuid());
        match epoch {
            0 => println!("  epoch: never claimed"),
            e => println!(
                "  epoch: {e}, claimed by {}",
                epoch_owner(t, &sink.sink_id).unwrap_or_else(|| "an unknown run".to_owned())
            ),
        }
        match committed {
            Some(c) => println!("  last commit of the sink: checkpoint {c}"),
            None => println!("  last commit of the sink: none"),
        }
        match committed_positions(t, &sink.sink_id) {
            Ok(Some(p)) => println!("  source positions of that commit: {}", positions_text(&p)),
            Ok(None) => println!("  source positions of that commit: none recorded"),
            Err(e) => println!("  source positions of that commit: {e}"),
        }
    }
    let latest = match &plan.checkpoints {
        Checkpoints::Object(o) => {
            println!("checkpoints on object storage at {}", o.location);
            crate::checkpoint_storage::peek_object_latest(
                &o.location,
                &o.properties,
                plan.job_id.clone(),
            )
            .await?
        }
        Checkpoints::Dir(dir) => {
            println!("checkpoint directory {}", dir.display());
            match LocalDirStore::holder(dir) {
                Ok(Some(holder)) => println!("  held by a run: {holder}"),
                Ok(None) => println!("  no run holds it"),
                Err(e) => println!("  lock: {e}"),
            }
            if let Some(reset) = ResetFile::read(dir)? {
                let stale = reset.table_committed != committed;
                println!(
                    "  reset file: the next run without a checkpoint starts at {}{}",
                    reset.start,
                    if stale {
                        " (stale: the table moved on since; it will be ignored)"
                    } else {
                        ""
                    }
                );
            }
            LocalDirStore::peek_latest(dir, plan.job_id.clone())?
        }
    };
    let Some(checkpoint) = latest else {
        println!("  no checkpoint: a run starts from the table's positions (or source.start)");
        return Ok(Agreement::Agree);
    };
    let id = checkpoint.id.get();
    println!("  newest checkpoint: {id}");
    let mut view = None;
    for handle in checkpoint.task_states.values() {
        let snapshot = TaskSnapshot::decode(handle)?;
        for (node, state) in &snapshot.nodes {
            match state {
                NodeState::Source(bytes) => {
                    let mut at: Vec<String> = decode_positions(bytes)?
                        .into_iter()
                        .map(|(t, p, o)| format!("{t}/{p}@{o}"))
                        .collect();
                    at.sort();
                    println!(
                        "  {node}[{}] positions: {}",
                        snapshot.subtask,
                        if at.is_empty() {
                            "none".to_owned()
                        } else {
                            at.join(", ")
                        }
                    );
                }
                NodeState::Sink(bytes) => {
                    view = Some(
                        CommitterView::decode(bytes)
                            .map_err(|e| anyhow::anyhow!("the committer's state: {e}"))?,
                    );
                }
                NodeState::Operator(_) => {}
            }
        }
    }
    let Some(view) = view else {
        println!("  the checkpoint holds no committer state");
        return Ok(Agreement::Agree);
    };
    match &view.identity {
        Some(i) => println!(
            "  written for table uuid {}, epoch {}, having seen checkpoint {} committed",
            i.table_uuid,
            i.epoch,
            i.committed
                .map_or_else(|| "none".to_owned(), |c| c.to_string())
        ),
        None => println!("  written by an earlier tinyflow: no table identity recorded"),
    }
    for (pid, p) in &view.pending {
        println!(
            "  pending checkpoint {pid}: {} file(s), {} row(s), positions {}",
            p.files,
            p.records,
            positions_text(&p.positions)
        );
    }
    let Some(table) = table else {
        println!("verdict: DISAGREE: the table cannot be loaded");
        return Ok(Agreement::Disagree);
    };
    let verdict = match view.check(&table, id) {
        Err(m) => Err(m.describe(&format!("table {name}"))),
        Ok(()) if committed.is_some_and(|c| c > id) => Err(format!(
            "the table holds checkpoint {} of the sink, newer than checkpoint {id}",
            committed.unwrap_or_default()
        )),
        Ok(()) => Ok(()),
    };
    match verdict {
        Ok(()) => {
            println!("verdict: agree: a run goes on from checkpoint {id}");
            Ok(Agreement::Agree)
        }
        Err(why) => {
            println!(
                "verdict: DISAGREE: {why}\n  a run refuses this checkpoint; `tinyflow reset` starts the job again from the table"
            );
            Ok(Agreement::Disagree)
        }
    }
}

/// Where `tinyflow reset` sets the next run's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetTo {
    /// The positions of the table's last commit of the sink (`source.start`
    /// when it has none).
    Table,
    /// An explicit start.
    Start(ResetStart),
}

/// `tinyflow reset JOB.toml`: refuses while a run holds the checkpoint
/// directory; claims the sink (a run of it elsewhere is fenced at its next
/// commit); moves the checkpoints aside; writes the reset file (or removes
/// one, for `--to-table`). Returns a line per thing done.
pub async fn reset(plan: &JobPlan, to: ResetTo) -> anyhow::Result<Vec<String>> {
    // Workers start from the table by themselves; a reset of the job in
    // one process would not reach them.
    plan.check_single().await?;
    let dir = match &plan.checkpoints {
        Checkpoints::Dir(dir) => dir,
        Checkpoints::Object(o) => return reset_object(plan, o, to).await,
    };
    // Takes the directory's lock: a run holding it turns this away.
    let store = LocalDirStore::open(dir, plan.job_id.clone(), plan.retained)
        .await
        .with_context(|| format!("checkpoint.dir {}", dir.display()))?;
    let epoch = plan.iceberg.claim().await?;
    let committed = plan.iceberg.last_committed().await?.map(|c| c.get());
    let positions = plan.iceberg.committed_positions().await?;
    let at = reset_time();
    let aside = format!("reset-{at}");
    let moved = store.set_aside(&aside).await?;
    let mut done = vec![
        format!(
            "claimed sink {} of table {}.{} with epoch {epoch}: a run of it elsewhere is fenced at its next commit",
            plan.sink.sink_id,
            plan.sink.namespace.join("."),
            plan.sink.table
        ),
        format!(
            "moved {moved} checkpoint file(s) to {}",
            dir.join(&aside).display()
        ),
    ];
    let reset_path: PathBuf = dir.join(RESET_FILE);
    match to {
        ResetTo::Table => {
            if reset_path.exists() {
                std::fs::remove_file(&reset_path)
                    .with_context(|| format!("removing {}", reset_path.display()))?;
            }
            done.push(match positions {
                Some(p) => format!(
                    "the next run starts where the table's last commit of the sink ends: {}",
                    positions_text(&p)
                ),
                None if committed.is_some() => "the table's commits of the sink record no source positions: the next run starts at source.start, and may write again what the table holds".to_owned(),
                None => "the table holds no commit of the sink: the next run starts at source.start".to_owned(),
            });
        }
        ResetTo::Start(start) => {
            let file = ResetFile {
                table_committed: committed,
                at,
                start,
            };
            file.write(dir)?;
            done.push(format!(
                "the next run starts at {} (written to {})",
                file.start,
                reset_path.display()
            ));
        }
    }
    Ok(done)
}

/// The time of a reset, in seconds since the Unix epoch: it names the
/// folder the checkpoints are set aside in, `reset-<seconds>`.
fn reset_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// [`reset`] of checkpoints on object storage: claims the sink and sets the
/// checkpoints aside under `reset-<time>/`; the next run starts from the
/// table. Only `--to-table`: there is no reset file on object storage, and
/// no lock either (a run still using the store is fenced by the claim).
async fn reset_object(
    plan: &JobPlan,
    o: &crate::ObjectCheckpoints,
    to: ResetTo,
) -> anyhow::Result<Vec<String>> {
    if let ResetTo::Start(start) = to {
        return Err(crate::JobFileError::new(
            "--to-offsets/--to-timestamp",
            format!(
                "a start of {start} needs a local checkpoint.dir: with checkpoints on object storage ({}) reset starts from the table only",
                o.location
            ),
        )
        .into());
    }
    let store = crate::checkpoint_storage::open_object_store(
        &o.location,
        &o.properties,
        plan.job_id.clone(),
        plan.retained,
    )
    .await?;
    let epoch = plan.iceberg.claim().await?;
    let at = reset_time();
    let aside = format!("reset-{at}");
    let moved = store.set_aside(&aside).await?;
    Ok(vec![
        format!(
            "claimed sink {} of table {}.{} with epoch {epoch}: a run of it elsewhere is fenced at its next commit",
            plan.sink.sink_id,
            plan.sink.namespace.join("."),
            plan.sink.table
        ),
        format!("moved {moved} checkpoint(s) to {}/{aside}", o.location),
        "the next run starts where the table's last commit of the sink ends (source.start when it has none)".to_owned(),
    ])
}
