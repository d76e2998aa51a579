//! Table upkeep for a streaming sink: snapshot expiry, the deletion of the
//! files only expired snapshots referenced, and of old metadata files. A
//! [`Maintenance`] policy, one round of it ([`IcebergSink::maintain`], and
//! in the job after commits, [`Scheduler`]) and its [`MaintenanceReport`].
//!
//! iceberg-rust 0.10.1 leaves all of the files to its caller:
//! `ExpireSnapshotsAction` only removes snapshots from the table's metadata
//! (it deletes nothing), and its SQL catalog never deletes a metadata file:
//! each commit trims the metadata log to `write.metadata.previous-versions-max`
//! (100 by default) but `write.metadata.delete-after-commit.enabled` is not
//! read, so the files that fell out of the log stay. A round does the rest:
//!
//! 1. It plans the expiry on the table as it is, committing nothing (the
//!    transaction applied in memory: iceberg's own selection of snapshots),
//!    and commits it, with the two metadata properties when they differ,
//!    only when that changes something.
//! 2. On the table loaded again after that commit, it deletes the manifest
//!    lists, manifests and data (and delete) files that the expired
//!    snapshots referenced and no remaining snapshot does. A data file
//!    counts as referenced while a remaining manifest lists it as live.
//! 3. It deletes the table's metadata files older than the oldest its
//!    metadata log keeps (listed under `<location>/metadata`; a file counts
//!    as the table's only when its first bytes name the table's uuid).
//!
//! Nothing is deleted before the commit that made it unreferenced succeeded,
//! and a file whose references could not all be read is kept: a failed
//! round may leave files behind, it never removes one a snapshot needs.
//! Concurrent commits (the job's, other workers') only add snapshots on top
//! of the current one, which expiry always keeps, so what is unreferenced
//! after the expiry commit stays unreferenced. The dedupe markers are table
//! properties, which expiry does not touch.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{FutureExt as _, StreamExt as _};
use iceberg::spec::{ManifestFile, SnapshotRef, TableProperties};
use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use iceberg::{Catalog, TableCommit, TableIdent};
use tinyflow_api::{StreamError, StreamResult};

use crate::IcebergSink;
use crate::catalog::{external, is_conflict, is_s3_location, pause_after_conflict};
use crate::orphans::{Listed, list_local, list_s3};
use crate::table::SinkTable;

/// The table property by which Iceberg engines delete the metadata files
/// that fall out of the metadata log at a commit (Java's catalogs do;
/// iceberg-rust's do not, so a round deletes them).
pub const DELETE_AFTER_COMMIT: &str = "write.metadata.delete-after-commit.enabled";
/// The table property bounding the metadata log: previous metadata files
/// kept.
pub const PREVIOUS_VERSIONS_MAX: &str = TableProperties::PROPERTY_METADATA_PREVIOUS_VERSIONS_MAX;

/// Requests in flight at once when a round reads manifest lists and
/// manifests or asks for file sizes.
const CONCURRENCY: usize = 16;
/// Paths per delete request (S3 deletes up to 1000 keys in one request).
const DELETE_CHUNK: usize = 500;
/// Bytes of a metadata file read to find the table's uuid (`format-version`
/// and `table-uuid` come first in what iceberg-rust and Java write).
const HEAD_BYTES: u64 = 4096;

/// Table maintenance: snapshot expiry and metadata upkeep.
///
/// [`Default`] is what `tinyflow` runs in a job unless
/// `[sink.maintenance]` says otherwise: snapshots older than an hour
/// expire, the newest 10 are kept whatever their age, 20 previous metadata
/// files are kept, a round a minute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Maintenance {
    /// Expire snapshots older than this (at least [`Self::retain_last`]
    /// remain). `None`: no snapshot expires.
    pub expire_older_than: Option<Duration>,
    /// Snapshots of each branch kept whatever their age (at least 1; the
    /// current one is always kept).
    pub retain_last: usize,
    /// Previous metadata files kept: the table's
    /// `write.metadata.previous-versions-max` is set to it (with
    /// `write.metadata.delete-after-commit.enabled`), and older metadata
    /// files are deleted. `None`: metadata files are left alone.
    pub metadata_versions_max: Option<usize>,
    /// In a job: the pause between the starts of two rounds (a round runs
    /// after a commit, in the background, at most one at a time; the first
    /// after the first commit).
    pub every: Duration,
}

impl Default for Maintenance {
    fn default() -> Self {
        Maintenance {
            expire_older_than: Some(Duration::from_secs(3600)),
            retain_last: 10,
            metadata_versions_max: Some(20),
            every: Duration::from_secs(60),
        }
    }
}

impl Maintenance {
    /// Checks the settings; the error names the key.
    pub fn validate(&self) -> StreamResult<()> {
        if self.retain_last == 0 {
            return Err(StreamError::Config {
                key: "sink.maintenance.retain_last",
                message: "expected at least 1 (the current snapshot is always kept)".to_owned(),
            });
        }
        if self.metadata_versions_max == Some(0) {
            return Err(StreamError::Config {
                key: "sink.maintenance.metadata_versions_max",
                message: "expected at least 1".to_owned(),
            });
        }
        Ok(())
    }

    /// The table properties this policy sets.
    pub fn table_properties(&self) -> Vec<(String, String)> {
        match self.metadata_versions_max {
            Some(max) => vec![
                (DELETE_AFTER_COMMIT.to_owned(), "true".to_owned()),
                (PREVIOUS_VERSIONS_MAX.to_owned(), max.to_string()),
            ],
            None => Vec::new(),
        }
    }
}

/// What a round did (or, dry, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MaintenanceReport {
    /// Nothing was changed: the report says what a round would do.
    pub dry_run: bool,
    /// Snapshots expired.
    pub snapshots_expired: usize,
    /// Snapshots the table has after the round.
    pub snapshots_kept: usize,
    /// Manifest lists deleted (one per expired snapshot).
    pub manifest_lists: usize,
    /// Manifests deleted.
    pub manifests: usize,
    /// Data and delete files deleted.
    pub data_files: usize,
    /// Metadata files (`*.metadata.json`) deleted.
    pub metadata_files: usize,
    /// Bytes of the deleted files.
    pub bytes: u64,
    /// Table properties set.
    pub properties_set: Vec<(String, String)>,
    /// The deleted files' locations: data files, manifests, manifest lists,
    /// metadata files, in that order.
    pub files: Vec<String>,
    /// What the round could not do (a file it could not read, so what it
    /// would have shown unreferenced was kept; a failed delete). Nothing
    /// referenced was deleted.
    pub problems: Vec<String>,
}

impl MaintenanceReport {
    /// Files deleted, of every kind.
    pub fn files_deleted(&self) -> usize {
        self.manifest_lists + self.manifests + self.data_files + self.metadata_files
    }

    /// One line for people: `expired 3 snapshots (10 kept); deleted 3
    /// manifest lists, 0 manifests, 0 data files, 5 metadata files (1.2 MiB)`.
    pub fn summary(&self) -> String {
        let (expired, deleted) = if self.dry_run {
            ("would expire", "would delete")
        } else {
            ("expired", "deleted")
        };
        let mut line = format!(
            "{expired} {} snapshots ({} kept); {deleted} {} manifest lists, {} manifests, {} data files, {} metadata files ({})",
            self.snapshots_expired,
            self.snapshots_kept,
            self.manifest_lists,
            self.manifests,
            self.data_files,
            self.metadata_files,
            bytes_text(self.bytes)
        );
        if !self.properties_set.is_empty() {
            let set: Vec<String> = self
                .properties_set
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let verb = if self.dry_run { "would set" } else { "set" };
            line.push_str(&format!("; {verb} {}", set.join(", ")));
        }
        line
    }
}

fn bytes_text(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

impl IcebergSink {
    /// Runs one round of table maintenance under `policy` (see the
    /// `maintenance` module): expires snapshots, deletes the files only they
    /// referenced and the metadata files past `metadata_versions_max`. With
    /// `dry_run` nothing changes and the report says what would go. The
    /// expiry commits through the catalog's optimistic concurrency, so a
    /// job writing the table meanwhile is not disturbed (a conflict is
    /// tried again). The table must exist (it is never created here).
    pub async fn maintain(
        &self,
        policy: &Maintenance,
        dry_run: bool,
    ) -> StreamResult<MaintenanceReport> {
        policy.validate()?;
        let started = tokio::time::Instant::now();
        let result = run_round(&self.table, policy, now_ms(), dry_run).await;
        if !dry_run {
            record(&self.table.config.sink_id, &result, started.elapsed());
        }
        result
    }
}

/// Milliseconds since the Unix epoch, now (the expiry cutoff's base).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Counts a round in the metrics.
fn record(sink: &str, result: &StreamResult<MaintenanceReport>, took: Duration) {
    let sink = sink.to_owned();
    metrics::counter!("tinyflow_iceberg_maintenance_rounds_total", "sink" => sink.clone())
        .increment(1);
    metrics::histogram!("tinyflow_iceberg_maintenance_seconds", "sink" => sink.clone())
        .record(took.as_secs_f64());
    let report = match result {
        Ok(report) => report,
        Err(_) => {
            metrics::counter!("tinyflow_iceberg_maintenance_failures_total", "sink" => sink)
                .increment(1);
            return;
        }
    };
    if !report.problems.is_empty() {
        metrics::counter!("tinyflow_iceberg_maintenance_failures_total", "sink" => sink.clone())
            .increment(1);
    }
    metrics::counter!("tinyflow_iceberg_maintenance_snapshots_expired_total", "sink" => sink.clone())
        .increment(report.snapshots_expired as u64);
    for (kind, n) in [
        ("data", report.data_files),
        ("manifest", report.manifests),
        ("manifest_list", report.manifest_lists),
        ("metadata", report.metadata_files),
    ] {
        metrics::counter!("tinyflow_iceberg_maintenance_files_deleted_total", "sink" => sink.clone(), "kind" => kind)
            .increment(n as u64);
    }
    metrics::counter!("tinyflow_iceberg_maintenance_bytes_deleted_total", "sink" => sink)
        .increment(report.bytes);
}

/// Runs the committer's maintenance rounds: after a commit, when the
/// policy's `every` has passed since the last round started and none is
/// running, a round starts in the background, on a thread of its own
/// shared by the process's sinks (`tinyflow-maintenance`), so that
/// checkpoints and commits never wait for it. A failed round is logged and
/// counted, never fatal: the next one tries again. Dropping the scheduler
/// (the committer's attempt ended) stops a running round at its next await,
/// which at worst leaves files undeleted.
#[derive(Debug, Default)]
pub(crate) struct Scheduler {
    /// When the last round started.
    last: Option<tokio::time::Instant>,
    running: Option<tokio::task::JoinHandle<()>>,
}

impl Scheduler {
    /// Starts a round when one is due (see [`Scheduler`]).
    pub(crate) fn after_commit(&mut self, table: &Arc<SinkTable>) {
        let Some(policy) = table.config.maintenance.clone() else {
            return;
        };
        if let Some(running) = self.running.take() {
            if !running.is_finished() {
                self.running = Some(running);
                return;
            }
            if let Some(Err(e)) = running.now_or_never() {
                tracing::error!(sink = %table.label(), error = %e, "a maintenance round panicked");
            }
        }
        let now = tokio::time::Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < policy.every)
        {
            return;
        }
        self.last = Some(now);
        let table = Arc::clone(table);
        let round = async move {
            let started = tokio::time::Instant::now();
            let result = run_round(&table, &policy, now_ms(), false).await;
            let took = started.elapsed();
            record(&table.config.sink_id, &result, took);
            log(&table.label(), &result, took);
        };
        self.running = Some(match runtime() {
            Some(rt) => rt.spawn(round),
            None => tokio::spawn(round),
        });
    }

    /// Waits for a running round to end (the job ends).
    pub(crate) async fn finish(&mut self) {
        if let Some(running) = self.running.take()
            && let Err(e) = running.await
        {
            tracing::error!(error = %e, "a maintenance round panicked");
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        if let Some(running) = &self.running {
            running.abort();
        }
    }
}

/// The maintenance thread's runtime (`None` when no thread could be made:
/// rounds then run on the job's runtime).
fn runtime() -> Option<&'static tokio::runtime::Runtime> {
    static RUNTIME: std::sync::OnceLock<Option<tokio::runtime::Runtime>> =
        std::sync::OnceLock::new();
    crate::catalog::own_thread(&RUNTIME, "tinyflow-maintenance")
}

/// Logs the outcome of a round of the job's.
fn log(sink: &str, result: &StreamResult<MaintenanceReport>, took: Duration) {
    let took_ms = took.as_millis() as u64;
    match result {
        Ok(r) => {
            for problem in &r.problems {
                tracing::warn!(sink = %sink, problem = %problem, "table maintenance left files behind");
            }
            if r.snapshots_expired > 0 || r.files_deleted() > 0 || !r.properties_set.is_empty() {
                tracing::info!(
                    sink = %sink,
                    snapshots_expired = r.snapshots_expired,
                    snapshots_kept = r.snapshots_kept,
                    manifest_lists = r.manifest_lists,
                    manifests = r.manifests,
                    data_files = r.data_files,
                    metadata_files = r.metadata_files,
                    bytes = r.bytes,
                    properties_set = r.properties_set.len(),
                    took_ms,
                    "table maintenance"
                );
            } else {
                tracing::debug!(sink = %sink, snapshots_kept = r.snapshots_kept, took_ms, "table maintenance: nothing to do");
            }
        }
        Err(e) => tracing::warn!(
            sink = %sink,
            error = %tinyflow_api::error_chain(e),
            took_ms,
            "table maintenance failed; the next round tries again"
        ),
    }
}

/// One round on `table` (see the module documentation); `now_ms` is the
/// wall clock the expiry cutoff is taken from.
pub(crate) async fn run_round(
    table: &SinkTable,
    policy: &Maintenance,
    now_ms: i64,
    dry_run: bool,
) -> StreamResult<MaintenanceReport> {
    let label = table.label();
    let catalog = table.catalog().await?;
    let mut report = MaintenanceReport {
        dry_run,
        ..MaintenanceReport::default()
    };
    let before = table.load().await?;
    let mut seen = vec![before.clone()];
    // Planned on the table as it is, in memory: what iceberg would expire.
    let planned = match build(&before, policy, now_ms) {
        Ok(Some(tx)) => {
            let dry = Recording::new(catalog.as_ref(), true);
            Some(
                tx.commit(&dry)
                    .await
                    .map_err(|e| external(&label, "planning the snapshot expiry", e))?,
            )
        }
        Ok(None) => None,
        Err(e) => return Err(external(&label, "planning the snapshot expiry", e)),
    };
    let changes = planned.as_ref().is_some_and(|p| {
        p.metadata().snapshots().len() != before.metadata().snapshots().len()
            || !changed_properties(&before, policy).is_empty()
    });
    report.properties_set = changed_properties(&before, policy);
    let after = match planned {
        Some(planned) if changes && dry_run => planned,
        _ if !changes => before.clone(),
        _ => {
            commit_expiry(table, catalog.as_ref(), policy, now_ms, &mut seen, &label).await?;
            // Retained is what the table holds now: anything committed
            // since builds on the current snapshot, which stays.
            table.load().await?
        }
    };
    let retained: HashSet<i64> = after
        .metadata()
        .snapshots()
        .map(|s| s.snapshot_id())
        .collect();
    report.snapshots_kept = retained.len();
    let mut expired: HashMap<i64, (SnapshotRef, Table)> = HashMap::new();
    for t in &seen {
        for s in t.metadata().snapshots() {
            if !retained.contains(&s.snapshot_id()) {
                expired
                    .entry(s.snapshot_id())
                    .or_insert_with(|| (Arc::clone(s), t.clone()));
            }
        }
    }
    report.snapshots_expired = expired.len();
    let mut doomed = Doomed::default();
    if !expired.is_empty() {
        unreferenced(&after, &expired, &mut doomed, &mut report.problems).await;
    }
    if policy.metadata_versions_max.is_some() {
        old_metadata(&after, &label, &mut doomed, &mut report.problems).await;
    }
    report.data_files = doomed.data.len();
    report.manifests = doomed.manifests.len();
    report.manifest_lists = doomed.lists.len();
    report.metadata_files = doomed.metadata.len();
    report.bytes = doomed.bytes;
    report.files = doomed.all();
    if !dry_run && !report.files.is_empty() {
        let deleted = delete(&after, &report.files).await;
        if let Err((done, e)) = deleted {
            report.problems.push(format!(
                "deleting: {} of {} files deleted, then {e}",
                done,
                report.files.len()
            ));
        }
    }
    Ok(report)
}

/// The transaction of a round on `table`: the expiry and the properties
/// that differ (`None`: nothing to do).
fn build(table: &Table, policy: &Maintenance, now_ms: i64) -> iceberg::Result<Option<Transaction>> {
    let mut tx = Transaction::new(table);
    let mut any = false;
    if let Some(age) = policy.expire_older_than {
        let age = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
        tx = tx
            .expire_snapshots()
            .expire_older_than_ms(now_ms.saturating_sub(age))
            .retain_last(policy.retain_last)
            .apply(tx)?;
        any = true;
    }
    let props = changed_properties(table, policy);
    if !props.is_empty() {
        let mut action = tx.update_table_properties();
        for (k, v) in props {
            action = action.set(k, v);
        }
        tx = action.apply(tx)?;
        any = true;
    }
    Ok(any.then_some(tx))
}

/// The policy's table properties that `table` does not have yet.
fn changed_properties(table: &Table, policy: &Maintenance) -> Vec<(String, String)> {
    let now = table.metadata().properties();
    policy
        .table_properties()
        .into_iter()
        .filter(|(k, v)| now.get(k) != Some(v))
        .collect()
}

/// Commits the round's transaction, again on the table as it is when
/// another commit went first (iceberg retries conflicts itself, as the
/// table's `commit.retry.*` allow, then this does, up to 5 times). Every
/// table an attempt was built on goes into `seen`: the snapshots it
/// expired are among theirs.
async fn commit_expiry(
    table: &SinkTable,
    catalog: &dyn Catalog,
    policy: &Maintenance,
    now_ms: i64,
    seen: &mut Vec<Table>,
    label: &str,
) -> StreamResult<()> {
    const ROUNDS: u32 = 5;
    for round in 0..ROUNDS {
        let current = table.load().await?;
        seen.push(current.clone());
        let Some(tx) = build(&current, policy, now_ms)
            .map_err(|e| external(label, "expiring snapshots", e))?
        else {
            return Ok(());
        };
        let recording = Recording::new(catalog, false);
        let result = tx.commit(&recording).await;
        seen.extend(recording.take());
        match result {
            Ok(_) => return Ok(()),
            Err(e) if is_conflict(&e) && round + 1 < ROUNDS => {
                pause_after_conflict(round, label, "expiring snapshots").await;
            }
            Err(e) => return Err(external(label, "committing the snapshot expiry", e)),
        }
    }
    Ok(())
}

/// Files a round deletes, by kind.
#[derive(Debug, Default)]
struct Doomed {
    data: Vec<String>,
    manifests: Vec<String>,
    lists: Vec<String>,
    metadata: Vec<String>,
    bytes: u64,
}

impl Doomed {
    fn all(&self) -> Vec<String> {
        [&self.data, &self.manifests, &self.lists, &self.metadata]
            .into_iter()
            .flatten()
            .cloned()
            .collect()
    }
}

/// What only the expired snapshots referenced: their manifest lists, the
/// manifests in no remaining list, and the data files those list that no
/// remaining manifest lists as live. `after` is the table after the
/// expiry; `expired` each expired snapshot with a table that holds it.
async fn unreferenced(
    after: &Table,
    expired: &HashMap<i64, (SnapshotRef, Table)>,
    doomed: &mut Doomed,
    problems: &mut Vec<String>,
) {
    let io = after.file_io();
    let kept_lists: HashSet<&str> = after
        .metadata()
        .snapshots()
        .map(|s| s.manifest_list())
        .collect();
    let lists: Vec<String> = expired
        .values()
        .map(|(s, _)| s.manifest_list().to_owned())
        .filter(|l| !l.is_empty() && !kept_lists.contains(l.as_str()))
        .collect();
    // Their sizes, for the report (a missing one is gone already).
    let sizes = futures_util::stream::iter(lists.iter().cloned())
        .map(|path| async move {
            let size = match io.new_input(&path) {
                Ok(input) => input.metadata().await.map(|m| m.size).ok(),
                Err(_) => None,
            };
            (path, size)
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<_>>()
        .await;
    for (path, size) in sizes {
        doomed.bytes += size.unwrap_or(0);
        doomed.lists.push(path);
    }
    doomed.lists.sort();

    // Manifests the expired snapshots listed.
    let owned: Vec<(SnapshotRef, Table)> = expired.values().cloned().collect();
    let read = futures_util::stream::iter(owned)
        .map(|(snapshot, table)| async move {
            let list = table.manifest_list_reader(&snapshot).load().await;
            (snapshot.manifest_list().to_owned(), list)
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<_>>()
        .await;
    let mut candidates: HashMap<String, ManifestFile> = HashMap::new();
    for (path, list) in read {
        match list {
            Ok(list) => {
                for m in list.consume_entries() {
                    candidates.entry(m.manifest_path.clone()).or_insert(m);
                }
            }
            Err(e) => problems.push(format!(
                "reading expired manifest list {path}: {e}; the manifests only it named are kept"
            )),
        }
    }
    if candidates.is_empty() {
        return;
    }
    // Manifests the remaining snapshots list: the current snapshot's first
    // (after fast appends it lists every manifest, and nothing is left).
    let mut kept: HashMap<String, ManifestFile> = HashMap::new();
    let mut remaining: Vec<SnapshotRef> = after.metadata().snapshots().cloned().collect();
    let current = after.metadata().current_snapshot_id();
    remaining.sort_by_key(|s| Some(s.snapshot_id()) != current);
    let mut all_read = true;
    for (i, chunk) in remaining.chunks(CONCURRENCY).enumerate() {
        if i > 0 && candidates.keys().all(|p| kept.contains_key(p)) {
            break;
        }
        let read = futures_util::stream::iter(chunk.to_vec())
            .map(|snapshot| async move {
                (
                    snapshot.manifest_list().to_owned(),
                    after.manifest_list_reader(&snapshot).load().await,
                )
            })
            .buffer_unordered(CONCURRENCY)
            .collect::<Vec<_>>()
            .await;
        for (path, list) in read {
            match list {
                Ok(list) => {
                    for m in list.consume_entries() {
                        kept.entry(m.manifest_path.clone()).or_insert(m);
                    }
                }
                Err(e) => {
                    all_read = false;
                    problems.push(format!(
                        "reading manifest list {path} of a remaining snapshot: {e}; no manifest or data file is deleted this round"
                    ));
                }
            }
        }
    }
    if !all_read {
        return;
    }
    candidates.retain(|path, _| !kept.contains_key(path));
    if candidates.is_empty() {
        return;
    }
    // Their data files, unless a remaining manifest lists them as live.
    let mut data: HashMap<String, u64> = HashMap::new();
    let read = load_manifests(candidates.into_values(), io).await;
    for (m, manifest) in read {
        match manifest {
            Ok(manifest) => {
                for entry in manifest.entries() {
                    data.insert(
                        entry.data_file().file_path().to_owned(),
                        entry.file_size_in_bytes(),
                    );
                }
            }
            Err(e) => problems.push(format!(
                "reading expired manifest {}: {e}; the data files only it named are kept",
                m.manifest_path
            )),
        }
        doomed.bytes += u64::try_from(m.manifest_length).unwrap_or(0);
        doomed.manifests.push(m.manifest_path.clone());
    }
    doomed.manifests.sort();
    if data.is_empty() {
        return;
    }
    // Proving a data file unreferenced takes every remaining manifest
    // (`kept` holds them all: the lists were read to the end, or no
    // manifest would be left to delete). That cost comes only after a
    // rewrite: after fast appends alone no manifest goes.
    let read = load_manifests(kept.into_values(), io).await;
    for (m, manifest) in read {
        match manifest {
            Ok(manifest) => {
                for entry in manifest.entries().iter().filter(|e| e.is_alive()) {
                    data.remove(entry.data_file().file_path());
                }
            }
            Err(e) => {
                problems.push(format!(
                    "reading manifest {} of a remaining snapshot: {e}; no data file is deleted this round",
                    m.manifest_path
                ));
                return;
            }
        }
    }
    let mut data: Vec<(String, u64)> = data.into_iter().collect();
    data.sort();
    for (path, bytes) in data {
        doomed.bytes += bytes;
        doomed.data.push(path);
    }
}

/// Each of `manifests` with its entries read, at most [`CONCURRENCY`] at a
/// time.
async fn load_manifests(
    manifests: impl IntoIterator<Item = ManifestFile>,
    io: &iceberg::io::FileIO,
) -> Vec<(ManifestFile, iceberg::Result<iceberg::spec::Manifest>)> {
    futures_util::stream::iter(manifests)
        .map(|m| async move {
            let manifest = m.load_manifest(io).await;
            (m, manifest)
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await
}

/// The version of a metadata file from its name,
/// `<version>-<uuid>.metadata.json` (`None`: another name, or a compressed
/// file, whose uuid cannot be checked in its first bytes).
fn metadata_version(location: &str) -> Option<u64> {
    let name = location.rsplit('/').next()?;
    let stem = name.strip_suffix(".metadata.json")?;
    let (version, rest) = stem.split_once('-')?;
    if rest.contains('.') || version.is_empty() || !version.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    version.parse().ok()
}

/// The table uuid in the first bytes of a metadata file, if there.
fn uuid_in(head: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(head);
    let at = text.find("\"table-uuid\"")? + "\"table-uuid\"".len();
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
    let rest = rest.strip_prefix('"')?;
    Some(rest[..rest.find('"')?].to_ascii_lowercase())
}

/// Metadata files of the table older than the oldest its metadata log
/// keeps: listed under `<location>/metadata` (local or S3 warehouses; other
/// storage is not listed), of a lower version than every file the log
/// names, and naming the table's uuid. A commit under way writes a version
/// above the current one, so it is never among them.
async fn old_metadata(after: &Table, label: &str, doomed: &mut Doomed, problems: &mut Vec<String>) {
    let metadata = after.metadata();
    let logged: Vec<&str> = metadata
        .metadata_log()
        .iter()
        .map(|l| l.metadata_file.as_str())
        .chain(after.metadata_location())
        .collect();
    let Some(floor) = logged.iter().filter_map(|l| metadata_version(l)).min() else {
        return;
    };
    let keep: HashSet<&str> = logged.iter().copied().collect();
    let location = metadata.location().trim_end_matches('/').to_owned();
    let listed = if let Some(root) = location
        .strip_prefix("file://")
        .or_else(|| location.starts_with('/').then_some(location.as_str()))
    {
        list_local(&location, root, "metadata")
    } else if is_s3_location(&location) {
        list_s3(
            &location,
            "metadata",
            after.file_io().config().props(),
            label,
        )
        .await
    } else {
        return;
    };
    let listed = match listed {
        Ok(l) => l,
        Err(e) => {
            problems.push(format!(
                "listing the metadata files: {}; none is deleted this round",
                tinyflow_api::error_chain(&e)
            ));
            return;
        }
    };
    let old: Vec<Listed> = listed
        .into_iter()
        .filter(|f| !keep.contains(f.location.as_str()))
        .filter(|f| metadata_version(&f.location).is_some_and(|v| v < floor))
        .collect();
    let uuid = metadata.uuid().to_string().to_ascii_lowercase();
    let io = after.file_io();
    let checked = futures_util::stream::iter(old)
        .map(|f| async move {
            let head = async {
                let input = io.new_input(&f.location)?;
                let reader = input.reader().await?;
                reader.read(0..f.bytes.min(HEAD_BYTES)).await
            }
            .await;
            (f, head)
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<_>>()
        .await;
    let mut found: Vec<(String, u64)> = Vec::new();
    for (f, head) in checked {
        match head {
            Ok(head) if uuid_in(&head).as_deref() == Some(uuid.as_str()) => {
                found.push((f.location, f.bytes));
            }
            // Another table's (a table dropped and created again at the
            // same location), or not what it seems: not this round's.
            Ok(_) => {
                tracing::debug!(file = %f.location, "an old metadata file that does not name the table's uuid is left alone");
            }
            Err(e) => problems.push(format!(
                "reading old metadata file {}: {e}; it is kept",
                f.location
            )),
        }
    }
    found.sort();
    for (path, bytes) in found {
        doomed.bytes += bytes;
        doomed.metadata.push(path);
    }
}

/// Deletes `files` in batches (one request per batch on S3); on failure,
/// how many went before it.
async fn delete(table: &Table, files: &[String]) -> Result<usize, (usize, iceberg::Error)> {
    let io = table.file_io();
    let mut done = 0;
    for chunk in files.chunks(DELETE_CHUNK) {
        io.delete_stream(futures_util::stream::iter(chunk.to_vec()))
            .await
            .map_err(|e| (done, e))?;
        done += chunk.len();
    }
    Ok(done)
}

/// A catalog that remembers every table it loads (a commit's refreshes),
/// and, `dry`, applies a commit in memory instead of sending it: the table
/// it returns is what the commit would make, and nothing is written.
#[derive(Debug)]
struct Recording<'a> {
    inner: &'a dyn Catalog,
    dry: bool,
    seen: Mutex<Vec<Table>>,
}

impl<'a> Recording<'a> {
    fn new(inner: &'a dyn Catalog, dry: bool) -> Self {
        Recording {
            inner,
            dry,
            seen: Mutex::new(Vec::new()),
        }
    }

    fn take(&self) -> Vec<Table> {
        std::mem::take(
            &mut *self
                .seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

crate::catalog::catalog_around_inner!(Recording<'_> {
    async fn load_table(&self, ident: &TableIdent) -> iceberg::Result<Table> {
        let table = self.inner.load_table(ident).await?;
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(table.clone());
        Ok(table)
    }

    async fn update_table(&self, commit: TableCommit) -> iceberg::Result<Table> {
        if self.dry {
            let current = self.inner.load_table(commit.identifier()).await?;
            return commit.apply(current);
        }
        self.inner.update_table(commit).await
    }
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_versions_come_from_the_file_name() {
        let uuid = "2cd22b57-5127-4198-92ba-e4e67c79821b";
        assert_eq!(
            metadata_version(&format!(
                "file:///w/db/t/metadata/00042-{uuid}.metadata.json"
            )),
            Some(42)
        );
        assert_eq!(
            metadata_version(&format!("s3://b/t/metadata/1234567-{uuid}.metadata.json")),
            Some(1_234_567)
        );
        // Compressed files and other files of the directory are not taken.
        assert_eq!(
            metadata_version(&format!("/t/metadata/00001-{uuid}.gz.metadata.json")),
            None
        );
        assert_eq!(
            metadata_version(&format!("/t/metadata/snap-1-1-{uuid}.avro")),
            None
        );
        assert_eq!(metadata_version("/t/metadata/v3.metadata.json"), None);
    }

    #[test]
    fn the_table_uuid_is_read_from_the_head_of_a_metadata_file() {
        let head = br#"{"format-version":2,"table-uuid":"0B5E1C44-2f5a-4b0c-9d55-0e6f4a8c3a11","location":"file:///w"#;
        assert_eq!(
            uuid_in(head).as_deref(),
            Some("0b5e1c44-2f5a-4b0c-9d55-0e6f4a8c3a11")
        );
        let java = b"{\n  \"format-version\" : 2,\n  \"table-uuid\" : \"abc\",\n";
        assert_eq!(uuid_in(java).as_deref(), Some("abc"));
        assert_eq!(uuid_in(br#"{"format-version":2,"location":"x"#), None);
        assert_eq!(uuid_in(br#"{"table-uuid":"cut"#), None);
    }

    #[test]
    fn policies_are_checked_and_set_the_metadata_properties() {
        let mut p = Maintenance::default();
        assert!(p.validate().is_ok());
        assert_eq!(
            p.table_properties(),
            vec![
                (DELETE_AFTER_COMMIT.to_owned(), "true".to_owned()),
                (
                    "write.metadata.previous-versions-max".to_owned(),
                    "20".to_owned()
                ),
            ]
        );
        p.retain_last = 0;
        let err = p.validate().unwrap_err().to_string();
        assert!(err.contains("sink.maintenance.retain_last"), "{err}");
        p.retain_last = 1;
        p.metadata_versions_max = Some(0);
        let err = p.validate().unwrap_err().to_string();
        assert!(err.contains("metadata_versions_max"), "{err}");
        p.metadata_versions_max = None;
        assert!(p.table_properties().is_empty());
    }

    #[test]
    fn a_report_reads_as_one_line() {
        let r = MaintenanceReport {
            snapshots_expired: 3,
            snapshots_kept: 10,
            manifest_lists: 3,
            metadata_files: 5,
            bytes: 3 * 1024 * 1024 / 2,
            ..MaintenanceReport::default()
        };
        assert_eq!(
            r.summary(),
            "expired 3 snapshots (10 kept); deleted 3 manifest lists, 0 manifests, 0 data files, 5 metadata files (1.5 MiB)"
        );
        let dry = MaintenanceReport {
            dry_run: true,
            properties_set: vec![(DELETE_AFTER_COMMIT.to_owned(), "true".to_owned())],
            ..r
        };
        assert!(
            dry.summary().starts_with("would expire 3")
                && dry
                    .summary()
                    .ends_with("would set write.metadata.delete-after-commit.enabled=true"),
            "{}",
            dry.summary()
        );
        assert_eq!(bytes_text(12), "12 B");
    }
}
