//! Merge before commit: when a commit takes the files of several
//! checkpoints (the commit cadence held some back), each partition's small
//! files are rewritten into files near `target_file_size`, and the commit
//! adds those instead (as Flink's file sink compacts pending files before
//! it commits).
//!
//! Exactly-once across a crash at any step:
//!
//! - The small files stay the source of truth until the commit: the
//!   committer's checkpoint state names them, never a merged file, so a
//!   restore commits what the state holds (or drops it when the table
//!   already has it) as without merging.
//! - A merged file is named `<sink>-m<epoch>-<uuid>-<n>.parquet`: the run
//!   (epoch) that made it, and an id retired when its merge is done with.
//!   Only that run can commit it, so on recovery the orphan cleanup deletes
//!   any merged file no snapshot references that an older run or a gone
//!   attempt made, whatever its age (`orphans::delete_orphans`).
//! - The commit is the one transaction it always was; the dedupe guard
//!   decides as before. Merged files replace exactly the files they were
//!   made from, and only when the commit covers exactly the checkpoints
//!   they came from; else the commit takes the small files.
//! - The replaced small files are deleted only after a commit known to hold
//!   the merged files; after a crash in between they are orphans the
//!   cleanup finds (no snapshot references them).
//!
//! A merge that fails (a full disk, an unreadable file, rows that do not
//! add up) commits the small files as they are, with a warning and
//! `tinyflow_iceberg_merge_failures_total`: it never loses or holds back
//! data.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use arrow_array::RecordBatch;
use iceberg::arrow::schema_to_arrow_schema;
use iceberg::spec::{DataFileFormat, PartitionKey};
use iceberg::writer::base_writer::data_file_writer::DataFileWriterBuilder;
use iceberg::writer::file_writer::ParquetWriterBuilder;
use iceberg::writer::file_writer::location_generator::{
    DefaultFileNameGenerator, DefaultLocationGenerator,
};
use iceberg::writer::file_writer::rolling_writer::RollingFileWriterBuilder;
use iceberg::writer::{IcebergWriter, IcebergWriterBuilder};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::schema::types::ColumnPath;
use tinyflow_api::{StreamError, StreamResult};

use crate::catalog::external;
use crate::committer::Staged;
use crate::table::SinkTable;
use crate::writer::{DataFileMeta, conform, data_file_meta, plain_columns};

/// Files of one partition (of one spec) to merge into one file or a few.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Group {
    pub(crate) spec_id: i32,
    pub(crate) files: Vec<DataFileMeta>,
}

/// What to merge among the files of `staged`: per partition, runs of
/// consecutive small files that together stay within `target` bytes, two
/// files or more each. Files of half the target or more are left as they
/// are, and so is a partition with one file.
pub(crate) fn plan(staged: &BTreeMap<u64, Staged>, target: u64) -> Vec<Group> {
    let mut by_partition: BTreeMap<(i32, String), Vec<&DataFileMeta>> = BTreeMap::new();
    for file in staged.values().flat_map(|s| &s.files) {
        by_partition
            .entry((file.spec_id, partition_of(&file.json)))
            .or_default()
            .push(file);
    }
    let mut groups = Vec::new();
    for ((spec_id, _), files) in by_partition {
        let mut bin: Vec<DataFileMeta> = Vec::new();
        let mut bytes = 0u64;
        let mut close = |bin: &mut Vec<DataFileMeta>| {
            if bin.len() >= 2 {
                groups.push(Group {
                    spec_id,
                    files: std::mem::take(bin),
                });
            } else {
                bin.clear();
            }
        };
        for file in files {
            if file.bytes >= target / 2 {
                continue;
            }
            if bytes + file.bytes > target {
                close(&mut bin);
                bytes = 0;
            }
            bytes += file.bytes;
            bin.push(file.clone());
        }
        close(&mut bin);
    }
    groups
}

/// The partition values in a data file's JSON metadata, as text (files
/// of the same partition have the same).
fn partition_of(json: &str) -> String {
    serde_json::from_str::<serde_json::Value>(json)
        .ok()
        .and_then(|v| v.get("partition").map(ToString::to_string))
        .unwrap_or_default()
}

/// The merged files of a commit, and the files they replace.
pub(crate) struct Merged {
    /// The checkpoints they came from (exactly those: the commit must take
    /// exactly these for the merged files to stand in).
    pub(crate) checkpoints: Vec<u64>,
    /// Paths of the small files the merged ones hold.
    pub(crate) replaced: HashSet<String>,
    pub(crate) files: Vec<DataFileMeta>,
    /// Bytes of the replaced files.
    pub(crate) replaced_bytes: u64,
    /// Retires the merge's id (making its files orphans) when dropped,
    /// until the merged files are handed to a commit ([`MergeId::disarm`]).
    pub(crate) id: MergeId,
}

impl Merged {
    /// `staged` with the replaced files taken out and the merged ones put
    /// in (in the newest checkpoint: the commit takes them all at once).
    pub(crate) fn apply(&self, staged: &mut BTreeMap<u64, Staged>) {
        for s in staged.values_mut() {
            s.files.retain(|f| !self.replaced.contains(&f.path));
        }
        if let Some((_, newest)) = staged.iter_mut().next_back() {
            newest.files.extend(self.files.iter().cloned());
        }
    }
}

/// The id in a merge's file names; retired with the sink's writers when
/// dropped, so its uncommitted files are orphans on the next recovery.
pub(crate) struct MergeId {
    pub(crate) id: String,
    pub(crate) table: Arc<SinkTable>,
}

impl MergeId {
    /// The files are handed to a commit: from now on a commit may hold
    /// them, even one still landing after this attempt was dropped, so the
    /// cleanup must not take them for orphans whatever their age. If they
    /// are not committed, the committer deletes them; after a crash, the
    /// next run's cleanup does (an older epoch), or the age rule.
    pub(crate) fn disarm(&mut self) {
        self.id.clear();
    }
}

impl Drop for MergeId {
    fn drop(&mut self) {
        if !self.id.is_empty() {
            self.table.retire_writer(std::mem::take(&mut self.id));
        }
    }
}

/// A step of a merge, for the fault hook (tests).
#[cfg(feature = "testing")]
async fn step(table: &SinkTable, at: crate::fault::CommitStep) -> StreamResult<()> {
    use crate::fault::Fault;
    if let Some(hook) = &table.config.fault_hook
        && let Fault::Crash(why) = hook(at).await
    {
        return Err(StreamError::external(
            table.label(),
            "iceberg",
            "merging".to_owned(),
            format!("injected crash: {why}"),
            true,
        ));
    }
    Ok(())
}

/// Merges `groups` (from the checkpoints `checkpoints`) for the run of
/// epoch `epoch`, as merge `id`: writes the merged files, checks they hold every row of
/// the files they replace, and returns them. Nothing is committed here.
/// Starts [`merge`] on the merge thread with a new merge id.
pub(crate) fn start(
    table: Arc<SinkTable>,
    checkpoints: Vec<u64>,
    groups: Vec<Group>,
    epoch: u64,
) -> Task<Merged> {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let mut task = spawn(merge(
        Arc::clone(&table),
        checkpoints,
        groups,
        epoch,
        id.clone(),
    ));
    task.retire = Some(MergeId { id, table });
    task
}

async fn merge(
    table: Arc<SinkTable>,
    checkpoints: Vec<u64>,
    groups: Vec<Group>,
    epoch: u64,
    id: String,
) -> StreamResult<Merged> {
    let mut written = Vec::new();
    let result = write_merged(
        Arc::clone(&table),
        checkpoints,
        groups,
        epoch,
        id,
        &mut written,
    )
    .await;
    if result.is_err() && !written.is_empty() {
        // Nothing holds them: the merge failed before any commit saw them.
        let deleted = delete_files(&table, written.iter()).await;
        tracing::debug!(sink = %table.label(), deleted, "deleted the files of a failed merge");
    }
    result
}

async fn write_merged(
    table: Arc<SinkTable>,
    checkpoints: Vec<u64>,
    groups: Vec<Group>,
    epoch: u64,
    id: String,
    written: &mut Vec<String>,
) -> StreamResult<Merged> {
    let label = table.label();
    let fail = |action: String, e: iceberg::Error| external(&label, action, e);
    #[cfg(feature = "testing")]
    step(&table, crate::fault::CommitStep::MergePlanned).await?;
    let loaded = table.load().await?;
    let metadata = loaded.metadata();
    let schema = metadata.current_schema().clone();
    let arrow_schema = Arc::new(
        schema_to_arrow_schema(&schema)
            .map_err(|e| fail("mapping the schema to Arrow".into(), e))?,
    );
    let config = &table.config;
    let properties = config.writer_properties()?;
    let io = table.merge_file_io(loaded.file_io());
    let merge_id = MergeId {
        id: id.clone(),
        table: Arc::clone(&table),
    };
    let names = DefaultFileNameGenerator::new(
        format!("{}-m{epoch}-{id}", config.sink_id),
        None,
        DataFileFormat::Parquet,
    );
    let location = DefaultLocationGenerator::new(metadata)
        .map_err(|e| fail("reading the table location".into(), e))?;
    let mut out = Vec::new();
    let mut replaced = HashSet::new();
    let mut replaced_bytes = 0;
    for (n, group) in groups.iter().enumerate() {
        let spec = metadata
            .partition_spec_by_id(group.spec_id)
            .ok_or_else(|| {
                StreamError::external(
                    label.clone(),
                    "iceberg",
                    "merging".to_owned(),
                    format!("the table has no partition spec {}", group.spec_id),
                    false,
                )
            })?;
        let partition_type = spec
            .partition_type(&schema)
            .map_err(|e| fail("reading the partition spec".into(), e))?;
        let first = &group.files[0];
        let data_file = iceberg::spec::deserialize_data_file_from_json(
            &first.json,
            group.spec_id,
            &partition_type,
            &schema,
        )
        .map_err(|e| fail(format!("decoding metadata of {}", first.path), e))?;
        let key = (!spec.is_unpartitioned()).then(|| {
            PartitionKey::new(
                spec.as_ref().clone(),
                schema.clone(),
                data_file.partition().clone(),
            )
        });
        let mut writer = None;
        let mut rows_in = 0u64;
        for file in &group.files {
            let bytes = io
                .new_input(&file.path)
                .map_err(|e| fail(format!("opening {}", file.path), e))?
                .read()
                .await
                .map_err(|e| fail(format!("reading {}", file.path), e))?;
            let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
                .and_then(|b| {
                    b.with_batch_size(config.row_group_rows.min(64 * 1024))
                        .build()
                })
                .map_err(|e| unreadable(&label, &file.path, e.to_string()))?;
            for batch in reader {
                let batch = batch.map_err(|e| unreadable(&label, &file.path, e.to_string()))?;
                same_field_ids(&batch, &arrow_schema, &file.path, &label)?;
                let batch: RecordBatch = conform(&batch, &arrow_schema, &label)?;
                rows_in += batch.num_rows() as u64;
                if writer.is_none() {
                    let mut props = properties.clone();
                    for name in plain_columns(&batch) {
                        props = props.set_column_dictionary_enabled(ColumnPath::from(name), false);
                    }
                    let rolling = RollingFileWriterBuilder::new(
                        ParquetWriterBuilder::new(props.build(), schema.clone()),
                        config.target_file_size,
                        io.clone(),
                        location.clone(),
                        names.clone(),
                    );
                    writer = Some(
                        DataFileWriterBuilder::new(rolling)
                            .build(key.clone())
                            .await
                            .map_err(|e| fail("opening a merged file".into(), e))?,
                    );
                }
                if let Some(w) = writer.as_mut() {
                    w.write(batch)
                        .await
                        .map_err(|e| fail("writing a merged file".into(), e))?;
                }
            }
        }
        let Some(mut writer) = writer else { continue };
        let files = writer
            .close()
            .await
            .map_err(|e| fail("closing a merged file".into(), e))?;
        written.extend(files.iter().map(|f| f.file_path().to_owned()));
        let expected: u64 = group.files.iter().map(|f| f.records).sum();
        let written: u64 = files.iter().map(|f| f.record_count()).sum();
        if rows_in != expected || written != expected {
            return Err(StreamError::external(
                label.clone(),
                "iceberg",
                "merging".to_owned(),
                format!(
                    "the merged files of {} files hold {written} rows (read {rows_in}), the files {expected}",
                    group.files.len()
                ),
                false,
            ));
        }
        for f in files {
            out.push(data_file_meta(
                f,
                group.spec_id,
                &partition_type,
                metadata.format_version(),
                &label,
            )?);
        }
        for f in &group.files {
            replaced.insert(f.path.clone());
            replaced_bytes += f.bytes;
        }
        #[cfg(feature = "testing")]
        if n == 0 && groups.len() > 1 {
            step(&table, crate::fault::CommitStep::MergeWriting).await?;
        }
        let _ = n;
    }
    #[cfg(feature = "testing")]
    step(&table, crate::fault::CommitStep::MergeWritten).await?;
    Ok(Merged {
        checkpoints,
        replaced,
        files: out,
        replaced_bytes,
        id: merge_id,
    })
}

/// A merge (or a deletion after one) running on the merge thread; aborted
/// when dropped, unless detached.
pub(crate) struct Task<T> {
    handle: Option<tokio::task::JoinHandle<StreamResult<T>>>,
    /// A merge's id, retired at once when the task is dropped unjoined (a
    /// crashed attempt), so that the next attempt's cleanup finds its
    /// files even before the aborted task has let go of them.
    retire: Option<MergeId>,
}

impl<T> Task<T> {
    pub(crate) fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_finished())
    }

    /// Its result; a panic in it goes on here.
    /// Dropped while it waits, it aborts the task and retires its id, as
    /// dropping the task would.
    pub(crate) async fn join(mut self) -> StreamResult<T> {
        let Some(handle) = self.handle.as_mut() else {
            return Err(StreamError::Graph {
                message: "a merge task joined twice".to_owned(),
            });
        };
        let joined = handle.await;
        self.handle = None;
        if let Some(mut id) = self.retire.take() {
            // The merge's result holds its id now, or it failed (and
            // deleted what it wrote).
            id.disarm();
        }
        match joined {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(StreamError::external(
                "merge".to_owned(),
                "iceberg",
                "merging".to_owned(),
                format!("the merge thread dropped the merge: {e}"),
                true,
            )),
        }
    }

    /// Lets it run to its end on its own.
    pub(crate) fn detach(mut self) {
        self.handle.take();
        if let Some(mut id) = self.retire.take() {
            id.disarm();
        }
    }
}

impl<T> Drop for Task<T> {
    fn drop(&mut self) {
        if let Some(h) = &self.handle {
            h.abort();
        }
    }
}

/// Runs `work` on a runtime of its own, one thread shared by every sink of
/// the process: merging decodes and encodes Parquet, CPU work that must not
/// hold up the job's tasks (checkpoints go on at their interval) nor the
/// commit thread.
pub(crate) fn spawn<T: Send + 'static>(
    work: impl Future<Output = StreamResult<T>> + Send + 'static,
) -> Task<T> {
    static RUNTIME: std::sync::OnceLock<Option<tokio::runtime::Runtime>> =
        std::sync::OnceLock::new();
    let handle = match crate::catalog::own_thread(&RUNTIME, "tinyflow-merge") {
        Some(r) => r.spawn(work),
        None => tokio::spawn(work),
    };
    Task {
        handle: Some(handle),
        retire: None,
    }
}

/// Refuses a file whose column has another field id than the table's
/// column of that name (dropped and added again): copying its values by
/// name would put them in a column where every Iceberg reader reads null.
fn same_field_ids(
    batch: &RecordBatch,
    table: &arrow_schema::Schema,
    path: &str,
    label: &str,
) -> StreamResult<()> {
    const ID: &str = "PARQUET:field_id";
    for field in batch.schema().fields() {
        let (Some(had), Ok(now)) = (
            field.metadata().get(ID),
            table.field_with_name(field.name()),
        ) else {
            continue;
        };
        if now.metadata().get(ID).is_some_and(|id| id != had) {
            return Err(StreamError::external(
                label.to_owned(),
                "iceberg",
                format!("merging {path}"),
                format!(
                    "column `{}` has field id {had} there and {} in the table (dropped and added again)",
                    field.name(),
                    now.metadata().get(ID).map_or("", String::as_str)
                ),
                false,
            ));
        }
    }
    Ok(())
}

fn unreadable(label: &str, path: &str, message: String) -> StreamError {
    StreamError::external(
        label.to_owned(),
        "iceberg",
        format!("reading {path} to merge it"),
        message,
        false,
    )
}

/// Deletes files no snapshot holds: the small files a committed merge
/// replaced, or the merged files of a merge that was not committed. A
/// failure leaves orphans for the cleanup: logged only.
pub(crate) async fn delete_files<'a>(
    table: &SinkTable,
    paths: impl Iterator<Item = &'a String>,
) -> usize {
    let label = table.label();
    let Ok(loaded) = table.load().await else {
        return 0;
    };
    let io = loaded.file_io();
    let mut deleted = 0;
    for path in paths {
        match io.delete(path).await {
            Ok(()) => deleted += 1,
            Err(e) => {
                tracing::warn!(sink = %label, file = %path, error = %e, "deleting a file no snapshot holds failed; the orphan cleanup will");
            }
        }
    }
    deleted
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn file(n: u64, partition: &str, bytes: u64) -> DataFileMeta {
        DataFileMeta {
            path: format!("file:///w/f-{n}.parquet"),
            spec_id: 0,
            records: 10,
            bytes,
            json: format!(r#"{{"partition":{partition},"file_path":"f-{n}"}}"#),
        }
    }

    fn staged(files: Vec<DataFileMeta>) -> Staged {
        Staged {
            files,
            watermark: None,
            positions: Default::default(),
        }
    }

    #[test]
    fn small_files_of_a_partition_merge_within_the_target_and_big_or_lone_ones_stay() {
        let pending = BTreeMap::from([
            (
                1,
                staged(vec![
                    file(1, "[1]", 100),
                    file(2, "[2]", 100),
                    file(3, "[3]", 900),
                    file(4, "[4]", 100),
                ]),
            ),
            (
                2,
                staged(vec![
                    file(5, "[1]", 100),
                    file(6, "[2]", 450),
                    file(7, "[3]", 100),
                ]),
            ),
            (3, staged(vec![file(8, "[1]", 100), file(9, "[2]", 450)])),
        ]);
        let groups = plan(&pending, 1000);
        let paths: Vec<Vec<&str>> = groups
            .iter()
            .map(|g| g.files.iter().map(|f| f.path.as_str()).collect())
            .collect();
        assert_eq!(
            paths,
            vec![
                // partition 1: all three.
                vec![
                    "file:///w/f-1.parquet",
                    "file:///w/f-5.parquet",
                    "file:///w/f-8.parquet"
                ],
                // partition 2: 100 + 450 + 450 = 1000 fit.
                vec![
                    "file:///w/f-2.parquet",
                    "file:///w/f-6.parquet",
                    "file:///w/f-9.parquet"
                ],
                // partition 3: the 900-byte file stays; 100 alone stays.
                // partition 4: one file stays.
            ]
        );
        // Merged files stand in for exactly the files they replace.
        let merged = Merged {
            checkpoints: vec![1, 2, 3],
            replaced: groups[0].files.iter().map(|f| f.path.clone()).collect(),
            files: vec![file(100, "[1]", 300)],
            replaced_bytes: 300,
            id: MergeId {
                id: String::new(),
                table: Arc::new(
                    SinkTable::new(crate::config::IcebergSinkConfig::new(
                        crate::config::CatalogConfig::sqlite(std::path::Path::new("/nonexistent")),
                        "db",
                        "t",
                        "s",
                    ))
                    .unwrap(),
                ),
            },
        };
        let mut applied = pending.clone();
        merged.apply(&mut applied);
        let all: Vec<&str> = applied
            .values()
            .flat_map(|s| &s.files)
            .map(|f| f.path.as_str())
            .collect();
        assert_eq!(all.len(), 9 - 3 + 1);
        assert!(all.contains(&"file:///w/f-100.parquet"));
        assert!(!all.contains(&"file:///w/f-5.parquet"));
    }

    #[test]
    fn the_partition_key_comes_from_the_metadata() {
        assert_eq!(
            partition_of(r#"{"partition":{"1000":7},"x":1}"#),
            r#"{"1000":7}"#
        );
        assert_ne!(
            partition_of(r#"{"partition":[1]}"#),
            partition_of(r#"{"partition":[2]}"#)
        );
    }
}
