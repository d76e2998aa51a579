//! The committer: one subtask that keeps the writers' files by checkpoint id
//! as its state and adds them to the table in one transaction per commit.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use iceberg::transaction::{ApplyTransactionAction, Transaction};
use serde::{Deserialize, Serialize};
use tinyflow_api::{
    CheckpointId, JobPositions, OperatorContext, Sink, SinkFactory, SinkRestore, StreamError,
    StreamResult, merge_positions,
};

use crate::catalog::{GuardedCatalog, external, external_unless};
use crate::dedupe::{
    Expect, Observed, SUMMARY_CHECKPOINT_ID, SUMMARY_EPOCH, SUMMARY_SINK_ID,
    SUMMARY_SOURCE_POSITIONS, SUMMARY_WATERMARK, committed_id, committed_positions, observe, owned,
};
use crate::identity::{self, Identity, Mismatch, WAYS_OUT};
use crate::merge::{self, Merged};
use crate::table::SinkTable;
use crate::writer::DataFileMeta;

/// Files of one completed-or-pending checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Staged {
    pub(crate) files: Vec<DataFileMeta>,
    /// The combined watermark of the inputs when the barrier arrived.
    pub(crate) watermark: Option<i64>,
    /// Where the sources stood at the barrier.
    pub(crate) positions: JobPositions,
}

/// The committer's checkpoint state.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct State {
    pub(crate) pending: BTreeMap<u64, Staged>,
    /// The table it was written for and what it knew of the table's
    /// commits (`None` in states of earlier layouts).
    pub(crate) identity: Option<Identity>,
}

/// What starts a versioned committer state: ten bytes of 0xFF, which no
/// state of the first layout can start with (it starts with the length of
/// its map as a varint, and a varint's tenth byte never has its high bit
/// set), then the layout's version.
const VERSIONED: [u8; 10] = [0xFF; 10];
/// The layout [`State`] is written in.
const STATE_VERSION: u8 = 3;

/// The second layout (source positions, no identity).
#[derive(Debug, Deserialize)]
struct StateV2 {
    pending: BTreeMap<u64, Staged>,
}

/// The first layout (before source positions), which checkpoints taken by
/// earlier versions hold.
#[derive(Debug, Deserialize)]
struct StateV1 {
    pending: BTreeMap<u64, StagedV1>,
}

#[derive(Debug, Deserialize)]
struct StagedV1 {
    files: Vec<DataFileMeta>,
    watermark: Option<i64>,
}

impl State {
    fn encode(&self) -> Result<Vec<u8>, postcard::Error> {
        let mut out = VERSIONED.to_vec();
        out.push(STATE_VERSION);
        postcard::to_extend(self, out)
    }

    /// Decodes a state of any layout this version knows.
    pub(crate) fn decode(bytes: &[u8]) -> Result<State, String> {
        let Some(rest) = bytes.strip_prefix(&VERSIONED[..]) else {
            let v1: StateV1 = postcard::from_bytes(bytes).map_err(|e| e.to_string())?;
            let pending = v1
                .pending
                .into_iter()
                .map(|(id, s)| {
                    let staged = Staged {
                        files: s.files,
                        watermark: s.watermark,
                        positions: JobPositions::new(),
                    };
                    (id, staged)
                })
                .collect();
            return Ok(State {
                pending,
                identity: None,
            });
        };
        match rest.split_first() {
            Some((&STATE_VERSION, body)) => postcard::from_bytes(body).map_err(|e| e.to_string()),
            Some((2, body)) => postcard::from_bytes::<StateV2>(body)
                .map(|v2| State {
                    pending: v2.pending,
                    identity: None,
                })
                .map_err(|e| e.to_string()),
            Some((v, _)) => Err(format!(
                "layout version {v}, written by a newer tinyflow; this one reads up to {STATE_VERSION}"
            )),
            None => Err("no layout version after the marker".to_owned()),
        }
    }
}

/// Creates the committer (parallelism 1).
pub(crate) struct CommitterFactory {
    pub(crate) table: Arc<SinkTable>,
}

#[async_trait::async_trait]
impl SinkFactory<DataFileMeta> for CommitterFactory {
    async fn create(
        &self,
        ctx: &OperatorContext,
        restored: Option<SinkRestore<'_>>,
    ) -> StreamResult<Box<dyn Sink<DataFileMeta>>> {
        if ctx.parallelism != 1 {
            return Err(StreamError::Graph {
                message: format!(
                    "{}: the committer must run with parallelism 1, not {}",
                    self.table.label(),
                    ctx.parallelism
                ),
            });
        }
        let table = &self.table;
        let label = table.label();
        let mut committer = Committer::new(Arc::clone(table));
        let mut restored_identity = None;
        if let Some(restore) = &restored {
            let mut identities = Vec::new();
            for bytes in restore.states {
                let state = State::decode(bytes).map_err(|message| StreamError::State {
                    operator: ctx.name.clone(),
                    action: "decoded",
                    message,
                })?;
                for (id, staged) in state.pending {
                    let entry = committer.pending.entry(id).or_default();
                    entry.files.extend(staged.files);
                    entry.watermark = entry.watermark.max(staged.watermark);
                    merge_positions(&mut entry.positions, staged.positions);
                }
                identities.extend(state.identity);
            }
            // One committer, one state; should there be more, the one that
            // saw the most is the one to hold the table to.
            restored_identity = identities.into_iter().max_by_key(|i| i.committed);
            match &restored_identity {
                // Checked before this run claims the sink, so that a stale
                // run refused here does not fence the run that owns it now.
                Some(identity) => {
                    let before = table.load().await?;
                    committer.check_restored(&before, identity, restore.checkpoint.get())?
                }
                None => tracing::warn!(
                    sink = %label,
                    checkpoint = %restore.checkpoint,
                    "the checkpoint was written by an earlier tinyflow and records no table identity: the table is not checked against it this time"
                ),
            }
        }
        let claim = table.claim().await?.clone();
        let now = table.load().await?;
        let mut identity = Identity {
            table_uuid: claim.uuid.clone(),
            sink_id: table.config.sink_id.clone(),
            epoch: claim.epoch,
            committed: committed_id(&now, &table.config.sink_id),
            committed_snapshot: None,
            committed_positions: committed_positions(&now, &table.config.sink_id)
                .ok()
                .flatten()
                .unwrap_or_default(),
        };
        identity.committed_snapshot = identity
            .committed
            .and_then(|c| identity::sink_snapshot(&now, &table.config.sink_id, c));
        if let Some(restore) = restored {
            if let Some(old) = &restored_identity {
                // Again on the table as claimed: nothing can change it now
                // but this run.
                committer.check_restored(&now, old, restore.checkpoint.get())?;
            }
            committer.identity = identity;
            let files: usize = committer.pending.values().map(|s| s.files.len()).sum();
            tracing::info!(
                sink = %label,
                checkpoint = %restore.checkpoint,
                pending_checkpoints = committer.pending.len(),
                files,
                epoch = claim.epoch,
                "restoring: committing what the checkpoint holds and the table does not"
            );
            // The files of the checkpoints to commit must all be there.
            let above = committed_id(&now, &table.config.sink_id).unwrap_or(0);
            let started = Instant::now();
            let to_verify: Vec<(u64, &DataFileMeta)> = committer
                .pending
                .iter()
                .filter(|(id, _)| **id > above && **id <= restore.checkpoint.get())
                .flat_map(|(id, s)| s.files.iter().map(|f| (*id, f)))
                .collect();
            let verified = identity::verify_files(&now, &label, to_verify).await?;
            tracing::debug!(sink = %label, files = verified, verify_ms = started.elapsed().as_millis() as u64, "restored data files verified");
            // Recovery step 3: commit every restored checkpoint above what the
            // table holds; drop the rest (the guard tells which).
            committer
                .commit_upto(restore.checkpoint.get(), None)
                .await?;
        } else {
            committer.identity = identity;
        }
        // Recovery step 4: files of checkpoints that never completed.
        if let Some(min_age) = table.config.orphan_min_age {
            match crate::orphans::delete_orphans(table, min_age, true).await {
                Ok(report) if report.deleted > 0 => tracing::info!(
                    sink = %self.table.label(),
                    deleted = report.deleted,
                    bytes = report.bytes,
                    "deleted orphan data files"
                ),
                Ok(_) => {}
                // Orphans waste space but harm no one: log and go on.
                Err(e) => {
                    tracing::warn!(sink = %self.table.label(), error = %e, "orphan cleanup failed")
                }
            }
        }
        Ok(Box::new(committer))
    }

    async fn last_committed(&self) -> StreamResult<Option<CheckpointId>> {
        self.table.committed().await
    }
}

/// How long merging pauses after a merge failed or was abandoned.
const MERGE_PAUSE: Duration = Duration::from_secs(300);

/// A merge before a commit, running.
struct Merging {
    /// The newest checkpoint it merges.
    upto: u64,
    /// Small files it merges.
    files: usize,
    started: Instant,
    task: merge::Task<Merged>,
}

/// A failed commit try.
struct Failed {
    error: StreamError,
    /// A fault hook crashed it, or a newer run fenced it: no retry.
    #[cfg(feature = "testing")]
    crashed: bool,
}

/// What a commit try did.
enum Tried {
    /// It committed, with this snapshot.
    Committed(Option<i64>),
    /// The guard found the table holds some or all of the checkpoints.
    Seen(Observed),
}

impl From<StreamError> for Failed {
    fn from(error: StreamError) -> Self {
        Failed {
            error,
            #[cfg(feature = "testing")]
            crashed: false,
        }
    }
}

pub(crate) struct Committer {
    table: Arc<SinkTable>,
    /// Files received since the last barrier.
    current: Vec<DataFileMeta>,
    /// The source positions that came with the barrier being handled.
    positions: JobPositions,
    /// Files of checkpoints not committed yet, by checkpoint id.
    pending: BTreeMap<u64, Staged>,
    watermark: i64,
    /// Completed checkpoints not committed yet (for the cadence).
    uncommitted: u32,
    /// The table this committer writes, its epoch, and its last commit.
    identity: Identity,
    /// The newest checkpoint notified complete in this attempt (0: none).
    notified: u64,
    /// When the cadence last decided to commit: its interval counts from
    /// there, so neither the commit's nor its merge's duration delays the
    /// next one.
    decided: Instant,
    /// The merge under way before a commit, if any.
    merging: Option<Merging>,
    /// No merging before this (after a failed merge).
    merge_resumes: Option<Instant>,
    /// `job_finished` was called: the job ends after this commit.
    finishing: bool,
    merges: metrics::Counter,
    merge_failures: metrics::Counter,
    merge_seconds: metrics::Histogram,
    merged_files: metrics::Counter,
    /// When table maintenance runs (`IcebergSinkConfig::maintenance`).
    maintenance: crate::maintenance::Scheduler,
    commits: metrics::Counter,
    commit_seconds: metrics::Histogram,
    last_committed: metrics::Gauge,
}

impl Committer {
    fn new(table: Arc<SinkTable>) -> Self {
        let sink = table.config.sink_id.clone();
        Committer {
            current: Vec::new(),
            positions: JobPositions::new(),
            pending: BTreeMap::new(),
            watermark: i64::MIN,
            uncommitted: 0,
            identity: Identity::default(),
            notified: 0,
            decided: Instant::now(),
            merging: None,
            merge_resumes: None,
            finishing: false,
            merges: metrics::counter!("tinyflow_iceberg_merges_total", "sink" => sink.clone()),
            merge_failures: metrics::counter!("tinyflow_iceberg_merge_failures_total", "sink" => sink.clone()),
            merge_seconds: metrics::histogram!("tinyflow_iceberg_merge_seconds", "sink" => sink.clone()),
            merged_files: metrics::counter!("tinyflow_iceberg_merged_files_total", "sink" => sink.clone()),
            maintenance: crate::maintenance::Scheduler::default(),
            commits: metrics::counter!("tinyflow_iceberg_commits_total", "sink" => sink.clone()),
            commit_seconds: metrics::histogram!("tinyflow_iceberg_commit_seconds", "sink" => sink.clone()),
            last_committed: metrics::gauge!("tinyflow_iceberg_last_committed_checkpoint", "sink" => sink),
            table,
        }
    }

    /// Refuses a restored state that `table` disagrees with (see
    /// [`identity::check`]).
    fn check_restored(
        &self,
        table: &iceberg::table::Table,
        restored: &Identity,
        checkpoint: u64,
    ) -> StreamResult<()> {
        let positions: BTreeMap<u64, JobPositions> = self
            .pending
            .iter()
            .map(|(id, s)| (*id, s.positions.clone()))
            .collect();
        match identity::check(table, restored, &positions, checkpoint) {
            Ok(()) => Ok(()),
            Err(mismatch) => {
                let mut what = mismatch.describe(&format!("table {}", self.table.table_name()));
                if matches!(mismatch, Mismatch::Replaced { .. }) && self.table.created_here() {
                    what.push_str("; this run created it, as it was missing");
                }
                tracing::error!(sink = %self.table.label(), checkpoint, %what, "refusing to restore: the table disagrees with the checkpoint");
                Err(StreamError::StateMismatch {
                    operator: self.table.label(),
                    target: format!("table {}", self.table.table_name()),
                    message: format!("checkpoint {checkpoint}: {what}; {WAYS_OUT}"),
                })
            }
        }
    }

    /// Notes that the table holds the sink's checkpoints up to `id`.
    fn note_committed(&mut self, id: u64, snapshot: Option<i64>) {
        if self.identity.committed >= Some(id) {
            return;
        }
        self.identity.committed = Some(id);
        self.identity.committed_snapshot = snapshot;
        self.identity.committed_positions = self
            .pending
            .get(&id)
            .map(|s| s.positions.clone())
            .unwrap_or_default();
    }

    fn pending_bytes(&self) -> u64 {
        self.pending
            .values()
            .flat_map(|s| &s.files)
            .map(|f| f.bytes)
            .sum()
    }

    /// Commits every pending checkpoint up to `upto` in one transaction,
    /// unless the table already has them: the check runs on the table as
    /// refreshed for each attempt (see [`GuardedCatalog`]). With `merged`,
    /// the commit takes the merged files instead of those they replace,
    /// when it takes exactly the checkpoints they came from.
    async fn commit_upto(&mut self, upto: u64, merged: Option<Merged>) -> StreamResult<()> {
        let table = Arc::clone(&self.table);
        let config = &table.config;
        let label = self.table.label();
        let mut backoff = config.retry_backoff;
        let mut failures = 0u32;
        let mut merged = merged;
        loop {
            let ids: Vec<u64> = self.pending.range(..=upto).map(|(id, _)| *id).collect();
            let (Some(&low), Some(&high)) = (ids.first(), ids.last()) else {
                return Ok(());
            };
            let started = Instant::now();
            let mut staged: BTreeMap<u64, Staged> = ids
                .iter()
                .map(|id| (*id, self.pending[id].clone()))
                .collect();
            let using = match merged.take() {
                Some(m) if m.checkpoints == ids => {
                    m.apply(&mut staged);
                    Some(m)
                }
                Some(m) => {
                    tracing::info!(sink = %label, from = low, to = high, merged = ?m.checkpoints, "the commit takes other checkpoints than the merge did: committing their files unmerged");
                    self.discard(m);
                    None
                }
                None => None,
            };
            let result =
                on_commit_thread(&label, Self::try_commit(Arc::clone(&self.table), staged)).await;
            match result {
                Ok(Tried::Committed(snapshot)) => {
                    let files: usize = ids.iter().map(|id| self.pending[id].files.len()).sum();
                    let records: u64 = ids
                        .iter()
                        .flat_map(|id| &self.pending[id].files)
                        .map(|f| f.records)
                        .sum();
                    self.note_committed(high, snapshot);
                    self.pending.retain(|id, _| *id > high);
                    self.uncommitted = 0;
                    self.commits.increment(1);
                    self.commit_seconds.record(started.elapsed().as_secs_f64());
                    self.last_committed.set(high as f64);
                    self.maintenance.after_commit(&self.table);
                    let merged_into = using.as_ref().map_or(0, |m| m.files.len());
                    tracing::info!(
                        sink = %label,
                        checkpoint = high,
                        from = low,
                        files,
                        merged_into,
                        records,
                        commit_ms = started.elapsed().as_millis() as u64,
                        "committed"
                    );
                    if let Some(m) = using {
                        self.merged_away(m).await?;
                    }
                    return Ok(());
                }
                Ok(Tried::Seen(Observed::AlreadyCommitted(c))) => {
                    tracing::info!(sink = %label, checkpoint = high, table_has = c, "already committed; dropping");
                    self.note_committed(c, None);
                    self.pending.retain(|id, _| *id > high);
                    self.uncommitted = 0;
                    self.last_committed.set(c as f64);
                    return Ok(());
                }
                Ok(Tried::Seen(Observed::Partly(c))) => {
                    tracing::info!(sink = %label, from = low, to = high, table_has = c, "partly committed already; committing the rest");
                    // Another run committed some of them: none of this
                    // call's attempts (each of the whole range) landed.
                    if let Some(m) = using {
                        self.discard(m);
                    }
                    self.note_committed(c, None);
                    self.pending.retain(|id, _| *id > c);
                }
                #[cfg(feature = "testing")]
                Ok(Tried::Seen(Observed::Crashed)) => unreachable!("crashes are errors"),
                Ok(Tried::Seen(Observed::Fenced { epoch, owner })) => {
                    let owner = owner.map_or_else(String::new, |o| format!(" ({o})"));
                    let message = format!(
                        "a newer run of sink {} claimed table {} with epoch {epoch}{owner}, above this run's {}; checkpoints {low}..={high} stay uncommitted, and this run stops for good (the newer run goes on from what the table holds)",
                        config.sink_id,
                        self.table.table_name(),
                        self.identity.epoch
                    );
                    tracing::error!(sink = %label, epoch = self.identity.epoch, newer = epoch, "fenced: {message}");
                    return Err(StreamError::Fenced {
                        operator: label,
                        message,
                    });
                }
                Ok(Tried::Seen(Observed::Moved(why))) => {
                    // The committer's guard sets no precondition.
                    return Err(StreamError::external(
                        label,
                        "iceberg",
                        format!("committing checkpoints {low}..={high}"),
                        format!("unexpected precondition failure: {why}"),
                        true,
                    ));
                }
                Ok(Tried::Seen(Observed::Replaced(found))) => {
                    let mismatch = Mismatch::Replaced {
                        expected: self.identity.table_uuid.clone(),
                        found,
                    };
                    return Err(StreamError::StateMismatch {
                        operator: label,
                        target: format!("table {}", self.table.table_name()),
                        message: format!(
                            "while committing checkpoints {low}..={high}: {}; {WAYS_OUT}",
                            mismatch.describe(&format!("table {}", self.table.table_name()))
                        ),
                    });
                }
                Err(Failed {
                    error: e,
                    #[cfg(feature = "testing")]
                    crashed,
                }) => {
                    // Only the fault hook crashes a commit.
                    #[cfg(not(feature = "testing"))]
                    let crashed = false;
                    failures += 1;
                    if crashed || !e.is_retryable() || failures >= config.commit_attempts {
                        tracing::error!(sink = %label, checkpoint = high, failures, error = %e, "commit failed; the data stays in the checkpoint");
                        return Err(e);
                    }
                    tracing::warn!(sink = %label, checkpoint = high, failures, retry_in_ms = backoff.as_millis() as u64, error = %e, "commit failed; retrying");
                    merged = using;
                    // Jittered: workers that conflicted retry apart.
                    tokio::time::sleep(crate::catalog::jitter(backoff)).await;
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
            }
        }
    }

    /// Deletes the merged files of a merge no commit took (in the
    /// background): no snapshot holds them.
    fn discard(&self, m: Merged) {
        let table = Arc::clone(&self.table);
        merge::spawn(async move {
            let paths: Vec<String> = m.files.iter().map(|f| f.path.clone()).collect();
            let deleted = merge::delete_files(&table, paths.iter()).await;
            tracing::debug!(sink = %table.label(), deleted, "deleted the files of a merge no commit took");
            Ok(())
        })
        .detach();
    }

    /// Starts merging the small files of the pending checkpoints up to
    /// `upto` in the background, when merging is on, the commit takes
    /// several checkpoints and some partition has small files to merge;
    /// returns whether it did (the commit then follows the merge).
    fn start_merge(&mut self, upto: u64) -> bool {
        let config = &self.table.config;
        // With a commit per checkpoint, several are pending only after a
        // failed commit: commit them at once rather than merge first.
        if !config.merge_pending || !config.cadence.holds_back() || self.merging.is_some() {
            return false;
        }
        if self.merge_resumes.is_some_and(|at| Instant::now() < at) {
            return false;
        }
        let staged: BTreeMap<u64, Staged> = self
            .pending
            .range(..=upto)
            .map(|(id, s)| (*id, s.clone()))
            .collect();
        if staged.len() < 2 {
            return false;
        }
        let groups = merge::plan(&staged, config.target_file_size as u64);
        if groups.is_empty() {
            return false;
        }
        let files: usize = groups.iter().map(|g| g.files.len()).sum();
        tracing::debug!(sink = %self.table.label(), upto, checkpoints = staged.len(), partitions = groups.len(), files, "merging pending files before the commit");
        let task = merge::start(
            Arc::clone(&self.table),
            staged.keys().copied().collect(),
            groups,
            self.identity.epoch,
        );
        self.merging = Some(Merging {
            upto,
            files,
            started: Instant::now(),
            task,
        });
        true
    }

    /// Waits for the merge under way, if any, and commits its checkpoints:
    /// with the merged files, or, when the merge failed, with the small
    /// files as they are.
    async fn finish_merge(&mut self) -> StreamResult<()> {
        let Some(merging) = self.merging.take() else {
            return Ok(());
        };
        let label = self.table.label();
        let patience = self
            .table
            .config
            .merge_timeout
            .saturating_sub(merging.started.elapsed());
        let Ok(result) = tokio::time::timeout(patience, merging.task.join()).await else {
            // A merge that does not end (a storage that hangs) must not
            // hold the data back: commit the small files.
            self.merge_failed();
            tracing::warn!(sink = %label, upto = merging.upto, files = merging.files, waited_s = merging.started.elapsed().as_secs(), "merging takes too long; abandoning it and committing the small files as they are");
            return self.commit_upto(merging.upto, None).await;
        };
        let merge_ms = merging.started.elapsed().as_millis() as u64;
        match result {
            Ok(mut merged) => {
                merged.id.disarm();
                self.merges.increment(1);
                self.merge_seconds
                    .record(merging.started.elapsed().as_secs_f64());
                tracing::info!(
                    sink = %label,
                    upto = merging.upto,
                    files = merged.replaced.len(),
                    bytes = merged.replaced_bytes,
                    merged_into = merged.files.len(),
                    merge_ms,
                    "merged pending files"
                );
                self.commit_upto(merging.upto, Some(merged)).await
            }
            Err(e) => {
                self.merge_failed();
                tracing::warn!(sink = %label, upto = merging.upto, files = merging.files, merge_ms, error = %e, pause_s = MERGE_PAUSE.as_secs(), "merging failed; committing the small files as they are, and not merging for a while");
                self.commit_upto(merging.upto, None).await
            }
        }
    }

    /// Counts a failed or abandoned merge and pauses merging for
    /// [`MERGE_PAUSE`], so that a storage in trouble (a full disk) is not
    /// given more to write at every commit.
    fn merge_failed(&mut self) {
        self.merge_failures.increment(1);
        self.merge_resumes = Some(Instant::now() + MERGE_PAUSE);
    }

    /// After a commit that took the merged files `m`: deletes the files
    /// they replace (in the background unless the job is ending; what it
    /// misses, the orphan cleanup finds).
    async fn merged_away(&mut self, m: Merged) -> StreamResult<()> {
        self.merged_files.increment(m.replaced.len() as u64);
        #[cfg(feature = "testing")]
        if let Some(hook) = &self.table.config.fault_hook
            && let crate::fault::Fault::Crash(why) =
                hook(crate::fault::CommitStep::MergeCommitted).await
        {
            return Err(StreamError::external(
                self.table.label(),
                "iceberg",
                "deleting merged-away files".to_owned(),
                format!("injected crash: {why}"),
                true,
            ));
        }
        let table = Arc::clone(&self.table);
        let deleting = merge::spawn(async move {
            let deleted = merge::delete_files(&table, m.replaced.iter()).await;
            tracing::debug!(sink = %table.label(), deleted, "deleted the files a merge replaced");
            Ok(())
        });
        if self.watermark == i64::MAX || self.finishing {
            // The job is about to end: the deletion ends before it does.
            deleting.join().await?;
        } else {
            deleting.detach();
        }
        Ok(())
    }

    /// One commit try of the `staged` checkpoints, by the run holding
    /// `claim`.
    async fn try_commit(
        sink: Arc<SinkTable>,
        staged: BTreeMap<u64, Staged>,
    ) -> Result<Tried, Failed> {
        let config = &sink.config;
        let label = sink.label();
        let (Some(&low), Some(&high)) = (staged.keys().next(), staged.keys().next_back()) else {
            return Ok(Tried::Committed(None));
        };
        let expect = Expect::from(sink.claim().await?);
        let table = sink.load().await?;
        // Fast checks first: no transaction needed when this run no longer
        // owns the table, or all is committed.
        if let Some(seen) = owned(&table, &config.sink_id, &expect) {
            return Ok(Tried::Seen(seen));
        }
        if let Some(seen) = observe(&table, &config.sink_id, low, high) {
            return Ok(Tried::Seen(seen));
        }
        let metadata = table.metadata();
        let schema = metadata.current_schema();
        let mut files = Vec::new();
        for checkpoint in staged.values() {
            for f in &checkpoint.files {
                let spec = metadata.partition_spec_by_id(f.spec_id).ok_or_else(|| {
                    StreamError::external(
                        label.clone(),
                        "iceberg",
                        format!("committing {}", f.path),
                        format!("the table has no partition spec {}", f.spec_id),
                        false,
                    )
                })?;
                let partition_type = spec
                    .partition_type(schema)
                    .map_err(|e| external(&label, "reading the partition spec", e))?;
                let file = iceberg::spec::deserialize_data_file_from_json(
                    &f.json,
                    f.spec_id,
                    &partition_type,
                    schema,
                )
                .map_err(|e| external(&label, format!("decoding metadata of {}", f.path), e))?;
                files.push(file);
            }
        }
        let mut summary = HashMap::from([
            (SUMMARY_SINK_ID.to_owned(), config.sink_id.clone()),
            (SUMMARY_CHECKPOINT_ID.to_owned(), high.to_string()),
            (SUMMARY_EPOCH.to_owned(), expect.epoch.to_string()),
        ]);
        if let Some(w) = staged[&high].watermark
            && w > i64::MIN
            && w < i64::MAX
        {
            summary.insert(SUMMARY_WATERMARK.to_owned(), w.to_string());
        }
        let positions = &staged[&high].positions;
        let positions = if positions.is_empty() {
            None
        } else {
            let json = serde_json::to_string(positions).map_err(|e| StreamError::State {
                operator: label.clone(),
                action: "encoded",
                message: format!("source positions: {e}"),
            })?;
            summary.insert(SUMMARY_SOURCE_POSITIONS.to_owned(), json.clone());
            Some(json)
        };
        let tx = Transaction::new(&table);
        // iceberg's own duplicate-file check reads every manifest of the
        // table on every attempt (cost grows with the table's history); the
        // guard's check reads one property of the refreshed table instead.
        let append = tx
            .fast_append()
            .with_check_duplicate(false)
            .add_data_files(files)
            .set_snapshot_properties(summary);
        let tx = append
            .apply(tx)
            .map_err(|e| external(&label, "building the commit", e))?;
        let mut props = tx
            .update_table_properties()
            .set(config.committed_property(), high.to_string());
        if let Some(json) = positions {
            props = props.set(config.positions_property(), json);
        }
        let tx = props
            .apply(tx)
            .map_err(|e| external(&label, "building the commit", e))?;
        let catalog = sink.catalog().await?;
        let guard = GuardedCatalog::new(catalog.as_ref(), &config.sink_id, Some((low, high)))
            .expecting(expect);
        #[cfg(feature = "testing")]
        let guard = guard.with_hook(config.fault_hook.as_ref());
        match tx.commit(&guard).await {
            Ok(table) => Ok(Tried::Committed(table.metadata().current_snapshot_id())),
            Err(e) => match guard.observed() {
                #[cfg(feature = "testing")]
                Some(Observed::Crashed) => Err(Failed {
                    error: StreamError::external(
                        label,
                        "iceberg",
                        format!("committing checkpoint {high}"),
                        format!("injected crash: {e}"),
                        // As after a real crash: a restart recovers.
                        true,
                    ),
                    crashed: true,
                }),
                Some(seen) => Ok(Tried::Seen(seen)),
                // I/O and catalog trouble may pass: a restart recovers the
                // files from the checkpoint and tries again. Invalid data or
                // an unsupported feature would fail again.
                None => Err(external_unless(
                    &label,
                    format!("committing checkpoints {low}..={high}"),
                    e,
                    &[
                        iceberg::ErrorKind::Unexpected,
                        iceberg::ErrorKind::CatalogCommitConflicts,
                    ],
                )
                .into()),
            },
        }
    }
}

/// Runs a commit on a runtime of its own, one thread shared by every sink
/// of the process, and waits for it there.
///
/// A commit is a chain of short steps (load the table, write a manifest, a
/// manifest list and a metadata file, update the catalog), each an await.
/// On the job's runtime, with sources and writers keeping every worker
/// busy, each step would wait behind their polls, and every record would
/// wait that much longer to become visible (`docs/performance.md` has the
/// measured difference). The kernel schedules a thread of its own fairly
/// against the workers.
///
/// Dropping the returned future (the committer's task aborted) aborts the
/// commit at its next await, as dropping it in place would. A panic in the
/// commit goes on in the caller.
async fn on_commit_thread<T: Send + 'static>(
    label: &str,
    commit: impl Future<Output = Result<T, Failed>> + Send + 'static,
) -> Result<T, Failed> {
    static RUNTIME: std::sync::OnceLock<Option<tokio::runtime::Runtime>> =
        std::sync::OnceLock::new();
    let Some(runtime) = crate::catalog::own_thread(&RUNTIME, "tinyflow-commit") else {
        return commit.await;
    };
    struct AbortOnDrop(tokio::task::AbortHandle);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let task = runtime.spawn(commit);
    let _abort = AbortOnDrop(task.abort_handle());
    match task.await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(Failed::from(StreamError::external(
            label.to_owned(),
            "iceberg",
            "committing".to_owned(),
            format!("the commit thread dropped the commit: {e}"),
            true,
        ))),
    }
}

#[async_trait::async_trait]
impl Sink<DataFileMeta> for Committer {
    async fn write(&mut self, batch: Vec<DataFileMeta>) -> StreamResult<()> {
        self.current.extend(batch);
        Ok(())
    }

    async fn prepare_commit(&mut self, id: CheckpointId) -> StreamResult<Vec<u8>> {
        // The writers closed this checkpoint's files before they forwarded
        // its barrier; the checkpoint names them only once they are durable.
        // A failed sync (a full or failing disk) may pass: a restart retries.
        let started = Instant::now();
        let synced = self.table.syncs.wait().await.map_err(|e| {
            StreamError::external(
                self.table.label(),
                "iceberg",
                format!("syncing checkpoint {id}'s data files to disk"),
                e,
                true,
            )
        })?;
        tracing::debug!(
            sink = %self.table.label(),
            checkpoint = %id,
            files = synced,
            wait_ms = started.elapsed().as_millis() as u64,
            "data files synced"
        );
        let positions = std::mem::take(&mut self.positions);
        if !self.current.is_empty() {
            self.pending.insert(
                id.get(),
                Staged {
                    files: std::mem::take(&mut self.current),
                    watermark: Some(self.watermark),
                    positions,
                },
            );
        }
        let state = State {
            pending: self.pending.clone(),
            identity: Some(self.identity.clone()),
        };
        state.encode().map_err(|e| StreamError::State {
            operator: self.table.label(),
            action: "encoded",
            message: e.to_string(),
        })
    }

    async fn commit(&mut self, id: CheckpointId) -> StreamResult<()> {
        self.notified = self.notified.max(id.get());
        self.uncommitted += 1;
        // After the end of input (the final watermark) every checkpoint
        // commits: the job is about to finish.
        let ended = self.watermark == i64::MAX;
        if let Some(merging) = &self.merging {
            let waited = merging.started.elapsed();
            if !ended && !merging.task.is_finished() && waited < self.table.config.merge_timeout {
                // Checkpoints go on at their interval; the commit waits
                // for the merge.
                return Ok(());
            }
            self.finish_merge().await?;
        }
        if ended
            || self.table.config.cadence.due(
                self.uncommitted,
                self.decided.elapsed(),
                self.pending_bytes(),
            )
        {
            self.decided = Instant::now();
            if self.start_merge(id.get()) {
                if ended {
                    self.finish_merge().await?;
                }
                return Ok(());
            }
            self.commit_upto(id.get(), None).await?;
        }
        Ok(())
    }

    fn on_watermark(&mut self, watermark: i64) {
        self.watermark = self.watermark.max(watermark);
    }

    async fn job_finished(&mut self) -> StreamResult<()> {
        self.finishing = true;
        self.finish_merge().await?;
        // Checkpoints the cadence held back: every notified one is complete.
        if self.pending.range(..=self.notified).next().is_some() {
            tracing::info!(sink = %self.table.label(), upto = self.notified, "the job ends: committing the checkpoints the commit cadence held back");
            self.commit_upto(self.notified, None).await?;
        }
        // A maintenance round under way ends with the job, not cut short.
        self.maintenance.finish().await;
        Ok(())
    }

    fn on_positions(&mut self, _id: CheckpointId, positions: &JobPositions) {
        self.positions = positions.clone();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn file(n: u64) -> DataFileMeta {
        DataFileMeta {
            path: format!("file:///w/f-{n}.parquet"),
            spec_id: 0,
            records: n,
            bytes: 100 * n,
            json: "{}".to_owned(),
        }
    }

    /// Checkpoints taken before source positions existed still restore.
    #[test]
    fn states_of_the_first_layout_still_decode() {
        #[derive(Serialize)]
        struct OldStaged {
            files: Vec<DataFileMeta>,
            watermark: Option<i64>,
        }
        #[derive(Serialize)]
        struct OldState {
            pending: BTreeMap<u64, OldStaged>,
        }
        let old = OldState {
            pending: BTreeMap::from([
                (
                    3,
                    OldStaged {
                        files: vec![file(1), file(2)],
                        watermark: Some(7),
                    },
                ),
                (
                    4,
                    OldStaged {
                        files: vec![file(3)],
                        watermark: None,
                    },
                ),
            ]),
        };
        let state = State::decode(&postcard::to_allocvec(&old).unwrap()).unwrap();
        assert_eq!(state.pending.len(), 2);
        assert_eq!(state.pending[&3].files, vec![file(1), file(2)]);
        assert_eq!(state.pending[&3].watermark, Some(7));
        assert!(state.pending[&4].positions.is_empty());
    }

    #[test]
    fn states_round_trip_with_positions_and_refuse_newer_layouts() {
        let positions = JobPositions::from([(
            "kafka".to_owned(),
            BTreeMap::from([("bids/0".to_owned(), "12".to_owned())]),
        )]);
        let identity = Identity {
            table_uuid: "0b5e1c44-2f5a-4b0c-9d55-0e6f4a8c3a11".to_owned(),
            sink_id: "s".to_owned(),
            epoch: 3,
            committed: Some(4),
            committed_snapshot: Some(77),
            committed_positions: positions.clone(),
        };
        let state = State {
            pending: BTreeMap::from([(
                5,
                Staged {
                    files: vec![file(4)],
                    watermark: Some(1),
                    positions: positions.clone(),
                },
            )]),
            identity: Some(identity.clone()),
        };
        let bytes = state.encode().unwrap();
        let back = State::decode(&bytes).unwrap();
        assert_eq!(back.pending[&5], state.pending[&5]);
        assert_eq!(back.pending[&5].positions, positions);
        assert_eq!(back.identity, Some(identity));
        // The second layout (no identity) still decodes, without one.
        #[derive(Serialize)]
        struct V2<'a> {
            pending: &'a BTreeMap<u64, Staged>,
        }
        let mut v2 = VERSIONED.to_vec();
        v2.push(2);
        let v2 = postcard::to_extend(
            &V2 {
                pending: &state.pending,
            },
            v2,
        )
        .unwrap();
        let back = State::decode(&v2).unwrap();
        assert_eq!(back.pending, state.pending);
        assert_eq!(back.identity, None);
        let mut newer = bytes.clone();
        newer[VERSIONED.len()] = STATE_VERSION + 1;
        let err = State::decode(&newer).unwrap_err();
        assert!(err.contains("newer tinyflow"), "{err}");
        // The empty state of either layout.
        assert!(
            State::decode(&State::default().encode().unwrap())
                .unwrap()
                .pending
                .is_empty()
        );
        assert!(
            State::decode(&postcard::to_allocvec(&BTreeMap::<u64, u8>::new()).unwrap())
                .unwrap()
                .pending
                .is_empty()
        );
    }

    /// A checkpoint names data files only once they are durable: the
    /// committer's ack (what `prepare_commit` returns) waits for every sync
    /// the writers started, and a failed sync fails the checkpoint.
    #[tokio::test]
    async fn a_checkpoint_waits_for_the_syncs_of_its_files() {
        use crate::config::{CatalogConfig, IcebergSinkConfig};
        let config = IcebergSinkConfig::new(
            CatalogConfig::sqlite(std::path::Path::new("/nonexistent")),
            "db",
            "t",
            "sink",
        );
        let table = Arc::new(SinkTable::new(config).unwrap());
        let mut committer = Committer::new(Arc::clone(&table));
        committer.write(vec![file(1)]).await.unwrap();

        let (release, gate) = std::sync::mpsc::channel::<()>();
        let sync = tokio::task::spawn_blocking(move || {
            gate.recv().ok();
            Ok(())
        });
        table.syncs.push("/w/f-1.parquet".into(), sync);
        let id = CheckpointId::new(1);
        let mut prepare = Box::pin(committer.prepare_commit(id));
        let early = tokio::time::timeout(Duration::from_millis(200), &mut prepare).await;
        assert!(early.is_err(), "acked before its file was synced");
        release.send(()).unwrap();
        let state = State::decode(&prepare.await.unwrap()).unwrap();
        assert_eq!(state.pending[&1].files, vec![file(1)]);

        table.syncs.push(
            "/w/f-2.parquet".into(),
            tokio::task::spawn_blocking(|| {
                Err(iceberg::Error::new(
                    iceberg::ErrorKind::Unexpected,
                    "syncing /w/f-2.parquet: No space left on device",
                ))
            }),
        );
        let err = committer
            .prepare_commit(CheckpointId::new(2))
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("checkpoint 2")
                && text.contains("f-2.parquet")
                && text.contains("No space"),
            "{text}"
        );
        assert!(err.is_retryable());
    }

    /// A commit on the commit thread is abandoned with the committer's
    /// task, as it was in place; its panic reaches the committer's task.
    #[tokio::test]
    async fn a_dropped_commit_stops_on_the_commit_thread_and_a_panic_comes_back() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let finished = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&finished);
        let commit = on_commit_thread("test", async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            flag.store(true, Ordering::SeqCst);
            Ok(())
        });
        let dropped = tokio::time::timeout(Duration::from_millis(50), commit).await;
        assert!(dropped.is_err(), "the commit should still be sleeping");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !finished.load(Ordering::SeqCst),
            "the dropped commit ran on"
        );

        let ran = on_commit_thread("test", async { Ok(7) }).await;
        assert_eq!(ran.ok(), Some(7));

        let panicked = tokio::spawn(async {
            on_commit_thread::<()>("test", async { panic!("injected panic in a commit") })
                .await
                .is_ok()
        })
        .await
        .unwrap_err();
        let payload = panicked.into_panic();
        assert_eq!(
            payload.downcast_ref::<&str>(),
            Some(&"injected panic in a commit")
        );
    }
}
