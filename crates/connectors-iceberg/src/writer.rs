//! The parallel writer: Arrow record batches in, Parquet data files out,
//! through iceberg's writer stack (Parquet writer, rolling file writer,
//! data file writer), one open file per partition.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, new_null_array};
use arrow_schema::{DataType, SchemaRef};
use iceberg::arrow::schema_to_arrow_schema;
use iceberg::io::FileIO;
use iceberg::spec::{DataFile, DataFileFormat, PartitionKey, Struct, StructType};
use iceberg::writer::base_writer::data_file_writer::{DataFileWriter, DataFileWriterBuilder};
use iceberg::writer::file_writer::ParquetWriterBuilder;
use iceberg::writer::file_writer::location_generator::{
    DefaultFileNameGenerator, DefaultLocationGenerator,
};
use iceberg::writer::file_writer::rolling_writer::RollingFileWriterBuilder;
use iceberg::writer::{CurrentFileStatus, IcebergWriter, IcebergWriterBuilder};
use parquet::file::properties::WriterPropertiesBuilder;
use parquet::schema::types::ColumnPath;
use serde::{Deserialize, Serialize};
use tinyflow_api::{
    CheckpointId, OperatorContext, StreamError, StreamResult, Writer, WriterFactory,
};

use crate::catalog::{external, external_unless};
use crate::config::BadRecords;
use crate::split::Splitter;
use crate::table::SinkTable;

/// A data file written but not committed: what a writer sends its committer
/// on a barrier, and what the committer keeps in checkpoint state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataFileMeta {
    /// Where the file is.
    pub path: String,
    /// The partition spec it was written with.
    pub spec_id: i32,
    /// Rows in it.
    pub records: u64,
    /// Its size.
    pub bytes: u64,
    /// Its full Iceberg metadata (partition values, column stats) as JSON.
    pub json: String,
}

type Stack =
    DataFileWriterBuilder<ParquetWriterBuilder, DefaultLocationGenerator, DefaultFileNameGenerator>;
type OpenWriter =
    DataFileWriter<ParquetWriterBuilder, DefaultLocationGenerator, DefaultFileNameGenerator>;

/// Creates a writer subtask's [`IcebergFileWriter`].
pub(crate) struct IcebergWriterFactory {
    pub(crate) table: Arc<SinkTable>,
}

#[async_trait::async_trait]
impl WriterFactory<RecordBatch, DataFileMeta> for IcebergWriterFactory {
    async fn create(
        &self,
        ctx: &OperatorContext,
    ) -> StreamResult<Box<dyn Writer<RecordBatch, DataFileMeta>>> {
        let table = self.table.load().await?;
        let label = format!(
            "{} writer {}/{}",
            self.table.label(),
            ctx.subtask,
            ctx.parallelism
        );
        let fail = |action: &str, e: iceberg::Error| external(&label, action, e);
        let metadata = table.metadata();
        let schema = metadata.current_schema().clone();
        let spec = metadata.default_partition_spec().clone();
        let arrow_schema = Arc::new(
            schema_to_arrow_schema(&schema).map_err(|e| fail("mapping the schema to Arrow", e))?,
        );
        let partition_type = spec
            .partition_type(&schema)
            .map_err(|e| fail("reading the partition spec", e))?;
        let config = &self.table.config;
        self.table.routing.set(&schema, &spec);
        if !spec.is_unpartitioned()
            && config.distribution == crate::shuffle::Distribution::Hash
            && config
                .table_spec
                .as_ref()
                .is_some_and(|t| t.partition.is_empty())
        {
            tracing::warn!(writer = %label, "the table is partitioned but the job declares it unpartitioned: rows reach the writers as they come, not by partition");
        }
        let splitter = if spec.is_unpartitioned() {
            None
        } else {
            Some(
                Splitter::try_new(schema.clone(), spec.as_ref().clone())
                    .map_err(|e| fail("preparing the partition splitter", e))?,
            )
        };
        let props = config.writer_properties()?;
        let location = DefaultLocationGenerator::new(metadata)
            .map_err(|e| fail("reading the table location", e))?;
        // Unique per writer instance: a restarted writer must never reuse a
        // name, or it could overwrite a committed file.
        let id = uuid::Uuid::new_v4().simple().to_string();
        let prefix = format!("{}-{}-{id}", config.sink_id, ctx.subtask);
        let names = DefaultFileNameGenerator::new(prefix, None, DataFileFormat::Parquet);
        let parts = StackParts {
            props,
            schema: schema.clone(),
            target_file_size: config.target_file_size,
            file_io: self.table.writer_file_io(table.file_io()),
            location,
            names,
        };
        Ok(Box::new(IcebergFileWriter {
            _id: WriterId {
                id,
                table: Arc::clone(&self.table),
            },
            table: Arc::clone(&self.table),
            label,
            arrow_schema,
            splitter,
            stack: None,
            parts: Some(parts),
            open: HashMap::new(),
            gathered: Gathered::default(),
            tick: 0,
            max_open: config.max_open_writers,
            max_memory: config.max_writer_memory,
            memory: 0,
            row_group_rows: config.row_group_rows as u64,
            closed: Vec::new(),
            partition_type,
            spec_id: spec.spec_id(),
            format_version: metadata.format_version(),
            bad_records: config.bad_records,
            bad: metrics::counter!("tinyflow_iceberg_bad_records_total", "sink" => config.sink_id.clone()),
            files: metrics::counter!("tinyflow_iceberg_files_written_total", "sink" => config.sink_id.clone()),
            rows: metrics::counter!("tinyflow_iceberg_rows_written_total", "sink" => config.sink_id.clone()),
            evictions: metrics::counter!("tinyflow_iceberg_writer_evictions_total", "sink" => config.sink_id.clone(), "reason" => "open_files"),
            spills: metrics::counter!("tinyflow_iceberg_writer_evictions_total", "sink" => config.sink_id.clone(), "reason" => "memory"),
            buffered: metrics::gauge!("tinyflow_iceberg_writer_buffered_bytes", "sink" => config.sink_id.clone(), "subtask" => ctx.subtask.to_string()),
            open_files: metrics::gauge!("tinyflow_iceberg_writer_open_files", "sink" => config.sink_id.clone(), "subtask" => ctx.subtask.to_string()),
        }))
    }
}

/// The id in a writer's file names; retired with the sink when the writer
/// is dropped, which makes its unreferenced files orphans on the next
/// recovery whatever their age.
struct WriterId {
    id: String,
    table: Arc<SinkTable>,
}

impl Drop for WriterId {
    fn drop(&mut self) {
        self.table.retire_writer(std::mem::take(&mut self.id));
    }
}

struct Open {
    writer: OpenWriter,
    /// Its partition's path (for messages; two partitions may share one:
    /// a null and the string `null` print alike).
    path: String,
    last_used: u64,
    /// Rows written to the file being written (the writer rolls to a new
    /// file past the target size).
    rows: u64,
    /// Its bytes written and buffered when last seen.
    size: usize,
    /// What it buffers in memory, as last estimated (see [`buffered`]).
    memory: usize,
}

/// What an open file holds in memory: its row group in progress. iceberg's
/// writer tells only bytes flushed plus buffered (`size`); the buffered
/// part is that share of it which the rows past the last full row group
/// are of all its rows, since the Parquet writer flushes a row group at
/// exactly `row_group_rows` rows.
fn buffered(rows: u64, size: usize, row_group_rows: u64) -> usize {
    if rows <= row_group_rows || rows == 0 {
        return size;
    }
    let in_progress = rows % row_group_rows.max(1);
    usize::try_from(size as u128 * u128::from(in_progress) / u128::from(rows)).unwrap_or(size)
}

/// Rows of a partitioned table waiting to be split by partition. Splitting
/// each incoming batch would hand every open file a slice of a few rows per
/// batch (a 1,024-row batch over 128 partitions: 8 rows each), and the
/// Parquet writer's cost per write call (levels, statistics, lookups per
/// column) then outweighs its cost per row; gathering up to
/// [`GATHER_ROWS`] rows first and splitting them once gives each file one
/// write of all its rows among them. Gathered rows count against the memory
/// budget (while they are split, the writer holds them once more: the copy
/// sorted by partition) and are written before any file closes at a
/// checkpoint.
#[derive(Default)]
struct Gathered {
    batches: Vec<RecordBatch>,
    rows: usize,
    /// Their Arrow buffers' size.
    bytes: usize,
}

/// At most this many rows are gathered before they are split by partition:
/// a Parquet row group at the default `row_group_rows`.
const GATHER_ROWS: usize = 64 * 1024;

/// And at most this many bytes: a string column's values in one Arrow
/// array must stay under 2 GiB, and a budget this large is rare.
const GATHER_BYTES: usize = 1 << 30;

/// What a writer's file stack is built from once its first batch has
/// shown which columns should get a Parquet dictionary.
struct StackParts {
    props: WriterPropertiesBuilder,
    schema: iceberg::spec::SchemaRef,
    target_file_size: usize,
    file_io: FileIO,
    location: DefaultLocationGenerator,
    names: DefaultFileNameGenerator,
}

impl StackParts {
    /// The stack, with dictionary encoding off for the columns whose values
    /// in `first` are [mostly distinct](mostly_distinct); returns their names.
    fn build(self, first: &RecordBatch) -> (Stack, Vec<String>) {
        let mut props = self.props;
        let plain = plain_columns(first);
        for name in &plain {
            props = props.set_column_dictionary_enabled(ColumnPath::from(name.as_str()), false);
        }
        let rolling = RollingFileWriterBuilder::new(
            ParquetWriterBuilder::new(props.build(), self.schema),
            self.target_file_size,
            self.file_io,
            self.location,
            self.names,
        );
        (DataFileWriterBuilder::new(rolling), plain)
    }
}

/// The columns of `first` that the sink writes without a Parquet dictionary:
/// those whose values are mostly distinct (see `mostly_distinct`). Public so that
/// benchmarks can give a bare Parquet writer the same settings.
pub fn plain_columns(first: &RecordBatch) -> Vec<String> {
    first
        .schema()
        .fields()
        .iter()
        .zip(first.columns())
        .filter(|(_, column)| mostly_distinct(column))
        .map(|(field, _)| field.name().clone())
        .collect()
}

/// Whether most non-null values among the first rows of `column` differ
/// (ids, prices, timestamps, free text). A dictionary then costs write time
/// and file size for nothing: parquet-java's writer falls back to plain
/// encoding after the first page for such a column, but arrow-rs's only once
/// the dictionary passes its size limit, which a 64k-row group of distinct
/// longs never does. On Nexmark bids, dictionaries on the low-cardinality
/// columns only write smaller files faster than on all
/// (`docs/performance.md`).
/// Types other than fixed-width primitives and strings or binaries keep the
/// writer's default.
fn mostly_distinct(column: &ArrayRef) -> bool {
    const SAMPLE: usize = 4096;
    let sample = column.slice(0, column.len().min(SAMPLE));
    let values = sample.len() - sample.null_count();
    if values < 64 {
        return false; // too few to tell
    }
    let distinct = if let Some(strings) = sample.as_string_opt::<i32>() {
        strings.iter().flatten().collect::<HashSet<_>>().len()
    } else if let Some(strings) = sample.as_string_opt::<i64>() {
        strings.iter().flatten().collect::<HashSet<_>>().len()
    } else if let Some(bytes) = sample.as_binary_opt::<i32>() {
        bytes.iter().flatten().collect::<HashSet<_>>().len()
    } else if let Some(width) = sample.data_type().primitive_width() {
        let data = sample.to_data();
        let Some(buffer) = data.buffers().first() else {
            return false;
        };
        let start = data.offset() * width;
        let Some(bytes) = buffer.as_slice().get(start..start + data.len() * width) else {
            return false;
        };
        bytes
            .chunks_exact(width)
            .enumerate()
            .filter(|(i, _)| sample.is_valid(*i))
            .map(|(_, v)| v)
            .collect::<HashSet<_>>()
            .len()
    } else {
        return false;
    };
    distinct * 2 > values
}

/// One writer subtask: keeps a file open per partition, at most `max_open`
/// of them (closing the least recently used) and at most `max_memory` of
/// buffered rows (closing the largest), and closes all on a barrier.
pub(crate) struct IcebergFileWriter {
    _id: WriterId,
    table: Arc<SinkTable>,
    label: String,
    arrow_schema: SchemaRef,
    splitter: Option<Splitter>,
    /// Built from `parts` on the first batch.
    stack: Option<Stack>,
    parts: Option<StackParts>,
    /// By partition value (`None` when the table is unpartitioned).
    open: HashMap<Option<Struct>, Open>,
    /// Rows of a partitioned table gathered since they were last split by
    /// partition (see [`Gathered`]).
    gathered: Gathered,
    tick: u64,
    max_open: usize,
    max_memory: usize,
    /// What the open files buffer, as estimated (the sum of their `memory`).
    memory: usize,
    row_group_rows: u64,
    closed: Vec<DataFile>,
    partition_type: StructType,
    /// The partition spec every file is written with (the default).
    spec_id: i32,
    format_version: iceberg::spec::FormatVersion,
    bad_records: BadRecords,
    files: metrics::Counter,
    /// Rows taken to be written (gathered or handed to the file writers;
    /// committed or not yet).
    rows: metrics::Counter,
    evictions: metrics::Counter,
    spills: metrics::Counter,
    buffered: metrics::Gauge,
    open_files: metrics::Gauge,
    bad: metrics::Counter,
}

impl IcebergFileWriter {
    async fn write_part(
        &mut self,
        key: Option<PartitionKey>,
        batch: RecordBatch,
    ) -> StreamResult<()> {
        self.tick += 1;
        let part = key.as_ref().map(|k| k.data().clone());
        if !self.open.contains_key(&part) {
            let path = key.as_ref().map(PartitionKey::to_path).unwrap_or_default();
            if self.open.len() >= self.max_open {
                self.evict().await?;
            }
            // Files closed but not yet synced hold a descriptor too: the
            // cap counts them (local warehouses defer syncs).
            let room = self.max_open.saturating_sub(self.open.len() + 1).max(1);
            let syncs = Arc::clone(&self.table.syncs);
            syncs.wait_until(room).await;
            let Some(stack) = &self.stack else {
                unreachable!("write() builds the stack before the first part")
            };
            let writer = stack
                .build(key)
                .await
                .map_err(|e| file_error(&self.label, "opening a data file", e))?;
            self.open.insert(
                part.clone(),
                Open {
                    writer,
                    path,
                    last_used: 0,
                    rows: 0,
                    size: 0,
                    memory: 0,
                },
            );
            self.open_files.set(self.open.len() as f64);
        }
        let Some(open) = self.open.get_mut(&part) else {
            unreachable!("inserted above")
        };
        open.last_used = self.tick;
        let rows = batch.num_rows() as u64;
        open.writer.write(batch).await.map_err(|e| {
            file_error(&self.label, format!("writing {}", part_name(&open.path)), e)
        })?;
        let size = open.writer.current_written_size();
        // Smaller than before: the writer rolled to a new file.
        open.rows = if size < open.size {
            rows
        } else {
            open.rows + rows
        };
        open.size = size;
        let memory = buffered(open.rows, size, self.row_group_rows);
        self.memory = self.memory - open.memory + memory;
        open.memory = memory;
        if self.memory > self.max_memory {
            self.spill().await?;
        }
        Ok(())
    }

    /// Splits the gathered rows by partition and writes each partition's
    /// rows to its file in one call.
    async fn write_gathered(&mut self) -> StreamResult<()> {
        let mut batches = std::mem::take(&mut self.gathered).batches;
        let batch = match batches.len() {
            0 => return Ok(()),
            1 => batches.swap_remove(0),
            _ => {
                arrow_select::concat::concat_batches(&self.arrow_schema, &batches).map_err(|e| {
                    external(
                        &self.label,
                        "gathering rows to split by partition",
                        crate::split::arrow_error(e),
                    )
                })?
            }
        };
        // The gathered batches are in `batch` now: not held twice while
        // their parts are written.
        drop(batches);
        let Some(splitter) = &self.splitter else {
            unreachable!("only partitioned tables gather rows")
        };
        let parts = splitter
            .split(&batch)
            .map_err(|e| external(&self.label, "computing partition values", e))?;
        drop(batch);
        for (key, part) in parts {
            self.write_part(Some(key), part).await?;
        }
        Ok(())
    }

    /// Closes the files buffering the most until the writer is at three
    /// quarters of its memory budget: each becomes a file as large as the
    /// budget allows, instead of a small file per batch, and the quarter
    /// left keeps room for rows to gather (a writer kept at the brim would
    /// split nearly every batch as it came).
    async fn spill(&mut self) -> StreamResult<()> {
        let low = self.max_memory / 4 * 3;
        while self.memory > low {
            let Some(part) = self
                .open
                .iter()
                .max_by_key(|(_, o)| o.memory)
                .map(|(p, _)| p.clone())
            else {
                self.memory = 0;
                return Ok(());
            };
            self.spills.increment(1);
            tracing::debug!(writer = %self.label, partition = %self.open[&part].path, buffered = self.memory, budget = self.max_memory, "closing the largest file: over the memory budget");
            self.close_open(&part).await?;
        }
        Ok(())
    }

    /// Closes the open file of partition `part`.
    async fn close_open(&mut self, part: &Option<Struct>) -> StreamResult<()> {
        if let Some(mut open) = self.open.remove(part) {
            self.memory -= open.memory;
            let files = open.writer.close().await.map_err(|e| {
                file_error(&self.label, format!("closing {}", part_name(&open.path)), e)
            })?;
            self.closed.extend(files);
            self.open_files.set(self.open.len() as f64);
        }
        Ok(())
    }

    /// Bad-record policy `skip`: the batch without its rows that have a null
    /// in a required column, fitted to the table; `None` when nothing of it
    /// fits (a field of the wrong type or unknown to the table spoils every
    /// row). Dropped rows are counted and the reason logged.
    fn salvage(&self, batch: &RecordBatch) -> Option<RecordBatch> {
        let mut keep: Option<arrow_buffer::BooleanBuffer> = None;
        for field in self
            .arrow_schema
            .fields()
            .iter()
            .filter(|f| !f.is_nullable())
        {
            if let Some(nulls) = batch
                .column_by_name(field.name())
                .and_then(|c| c.logical_nulls())
            {
                let valid = nulls.inner().clone();
                keep = Some(match keep {
                    Some(k) => &k & &valid,
                    None => valid,
                });
            }
        }
        let rows = batch.num_rows();
        let filtered = match keep {
            Some(mask) if mask.count_set_bits() < rows => {
                let dropped = rows - mask.count_set_bits();
                self.bad.increment(dropped as u64);
                tracing::warn!(writer = %self.label, dropped, "skipping records with a null in a required column");
                match arrow_select::filter::filter_record_batch(
                    batch,
                    &BooleanArray::new(mask, None),
                ) {
                    Ok(b) => b,
                    Err(e) => {
                        self.bad.increment((rows - dropped) as u64);
                        tracing::warn!(writer = %self.label, error = %e, rows, "skipping a batch that could not be filtered");
                        return None;
                    }
                }
            }
            _ => batch.clone(),
        };
        if filtered.num_rows() == 0 {
            return None;
        }
        match conform(&filtered, &self.arrow_schema, &self.label) {
            Ok(b) => Some(b),
            Err(e) => {
                self.bad.increment(filtered.num_rows() as u64);
                tracing::warn!(writer = %self.label, rows = filtered.num_rows(), error = %e, "skipping a batch that does not fit the table");
                None
            }
        }
    }

    /// Closes the least recently used open file.
    async fn evict(&mut self) -> StreamResult<()> {
        let Some(part) = self
            .open
            .iter()
            .min_by_key(|(_, o)| o.last_used)
            .map(|(p, _)| p.clone())
        else {
            return Ok(());
        };
        self.evictions.increment(1);
        tracing::debug!(writer = %self.label, partition = %self.open[&part].path, "closing least recently used file");
        self.close_open(&part).await
    }
}

#[async_trait::async_trait]
impl Writer<RecordBatch, DataFileMeta> for IcebergFileWriter {
    async fn write(&mut self, batches: Vec<RecordBatch>) -> StreamResult<()> {
        for batch in batches {
            if batch.num_rows() == 0 {
                continue;
            }
            let batch = match self.bad_records {
                BadRecords::Fail => conform(&batch, &self.arrow_schema, &self.label)?,
                BadRecords::Skip => match self.salvage(&batch) {
                    Some(good) => good,
                    None => continue,
                },
            };
            self.rows.increment(batch.num_rows() as u64);
            if let Some(parts) = self.parts.take() {
                let (stack, plain) = parts.build(&batch);
                tracing::debug!(writer = %self.label, columns = ?plain, "no Parquet dictionary for these mostly distinct columns");
                self.stack = Some(stack);
            }
            if self.splitter.is_none() {
                self.write_part(None, batch).await?;
                continue;
            }
            self.gathered.rows += batch.num_rows();
            self.gathered.bytes += batch.get_array_memory_size();
            self.gathered.batches.push(batch);
            if self.gathered.rows >= GATHER_ROWS.min(self.row_group_rows as usize).max(1)
                || self.gathered.bytes >= GATHER_BYTES
                || self.memory + self.gathered.bytes > self.max_memory
            {
                self.write_gathered().await?;
            }
        }
        self.buffered
            .set((self.memory + self.gathered.bytes) as f64);
        Ok(())
    }

    async fn flush(&mut self, id: CheckpointId) -> StreamResult<Vec<DataFileMeta>> {
        self.write_gathered().await?;
        let mut files = std::mem::take(&mut self.closed);
        self.memory = 0;
        self.buffered.set(0.0);
        self.open_files.set(0.0);
        for (_, mut open) in self.open.drain() {
            let closed = open.writer.close().await.map_err(|e| {
                file_error(
                    &self.label,
                    format!("closing {} at checkpoint {id}", part_name(&open.path)),
                    e,
                )
            })?;
            files.extend(closed);
        }
        self.files.increment(files.len() as u64);
        files
            .into_iter()
            .map(|f| {
                data_file_meta(
                    f,
                    self.spec_id,
                    &self.partition_type,
                    self.format_version,
                    &self.label,
                )
            })
            .collect()
    }
}

/// What the committer keeps of a written data file.
pub(crate) fn data_file_meta(
    f: DataFile,
    spec_id: i32,
    partition_type: &StructType,
    format_version: iceberg::spec::FormatVersion,
    label: &str,
) -> StreamResult<DataFileMeta> {
    let meta = DataFileMeta {
        path: f.file_path().to_owned(),
        spec_id,
        records: f.record_count(),
        bytes: f.file_size_in_bytes(),
        json: String::new(),
    };
    let json = iceberg::spec::serialize_data_file_to_json(f, partition_type, format_version)
        .map_err(|e| external(label, "encoding data file metadata", e))?;
    Ok(DataFileMeta { json, ..meta })
}

/// A failure to open, write or close a data file. Retryable unless iceberg
/// says otherwise: it is the storage's trouble (a full disk, a store that
/// does not answer, permissions), not the records', and a restart, once it
/// has passed, writes the same records again from the last checkpoint.
/// Records that cannot fit the table fail earlier, in [`conform`].
fn file_error(operator: &str, action: impl Into<String>, e: iceberg::Error) -> StreamError {
    external_unless(operator, action, e, &[iceberg::ErrorKind::Unexpected])
}

/// How errors name the file of partition `path` (empty when the table is
/// not partitioned).
fn part_name(path: &str) -> String {
    if path.is_empty() {
        "the data file".to_owned()
    } else {
        format!("the data file of partition `{path}`")
    }
}

/// Fits a record batch to the table's Arrow schema (which carries Iceberg
/// field ids): columns by name, in table order; a missing optional column
/// becomes nulls. The error names the field that does not fit.
pub fn conform(
    batch: &RecordBatch,
    target: &SchemaRef,
    operator: &str,
) -> StreamResult<RecordBatch> {
    // Not retryable: the same records would fail again after a restart.
    let bad = |message: String| {
        StreamError::external(
            operator.to_owned(),
            "iceberg",
            "fitting a record batch to the table schema".to_owned(),
            message,
            false,
        )
    };
    let schema = batch.schema();
    for field in schema.fields() {
        if target.field_with_name(field.name()).is_err() {
            return Err(bad(format!(
                "record field `{}` is not a column of the table",
                field.name()
            )));
        }
    }
    let rows = batch.num_rows();
    let columns = target
        .fields()
        .iter()
        .map(|tf| {
            let Some(col) = batch.column_by_name(tf.name()) else {
                return if tf.is_nullable() {
                    Ok(new_null_array(tf.data_type(), rows))
                } else {
                    Err(bad(format!(
                        "required column `{}` is missing from the record",
                        tf.name()
                    )))
                };
            };
            let col = fit_type(col, tf.data_type()).ok_or_else(|| {
                bad(format!(
                    "field `{}` is {}, the table column is {}",
                    tf.name(),
                    col.data_type(),
                    tf.data_type()
                ))
            })?;
            if !tf.is_nullable() && col.null_count() > 0 {
                return Err(bad(format!(
                    "required column `{}` has {} null values",
                    tf.name(),
                    col.null_count()
                )));
            }
            Ok(col)
        })
        .collect::<StreamResult<Vec<ArrayRef>>>()?;
    RecordBatch::try_new(target.clone(), columns).map_err(|e| bad(e.to_string()))
}

/// The column as the table's type: the same, or a lossless relabelling
/// (string and binary offsets, the time zone of a UTC timestamp, int to
/// long, float to double, a decimal's precision up).
fn fit_type(col: &ArrayRef, want: &DataType) -> Option<ArrayRef> {
    let have = col.data_type();
    if have == want {
        return Some(col.clone());
    }
    let castable = matches!(
        (have, want),
        (
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View,
            DataType::Utf8 | DataType::LargeUtf8
        ) | (
            DataType::Binary | DataType::LargeBinary | DataType::BinaryView,
            DataType::Binary | DataType::LargeBinary
        )
    ) || matches!(
        (have, want),
        (DataType::Timestamp(a, Some(_)), DataType::Timestamp(b, Some(_))) if a == b
    ) || matches!(
        // Iceberg's promotions: a column widened by schema evolution takes
        // the narrower values of writers still on the old schema.
        (have, want),
        (DataType::Int32, DataType::Int64) | (DataType::Float32, DataType::Float64)
    ) || matches!(
        (have, want),
        (DataType::Decimal128(p, s), DataType::Decimal128(q, t)) if s == t && p <= q
    );
    if castable {
        return arrow_cast::cast(col, want).ok();
    }
    // A struct, list or map of the same shape: the table's type carries
    // Iceberg field ids on the nested fields (and names list elements and
    // map entries its own way); relabel, without copying the values.
    if same_shape(have, want) {
        return relabel(col.to_data(), want).map(arrow_array::make_array);
    }
    None
}

/// Whether `have` and `want` are the same nested type but for field
/// metadata, nullability (the source's schema is declared with the
/// table's) and the names of list elements and map entries (struct field
/// names must match, in order).
fn same_shape(have: &DataType, want: &DataType) -> bool {
    match (have, want) {
        (DataType::Struct(a), DataType::Struct(b)) => {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|(a, b)| a.name() == b.name() && same_shape(a.data_type(), b.data_type()))
        }
        (DataType::List(a), DataType::List(b)) | (DataType::Map(a, _), DataType::Map(b, _)) => {
            same_shape(a.data_type(), b.data_type())
        }
        (a, b) => a == b,
    }
}

/// `data` as type `want` (of the same shape, see [`same_shape`]), its
/// children relabelled the same way; `None` if Arrow's checks refuse it
/// (a null where the table requires a value).
fn relabel(data: arrow_data::ArrayData, want: &DataType) -> Option<arrow_data::ArrayData> {
    let children: Vec<&DataType> = match want {
        DataType::Struct(fields) => fields.iter().map(|f| f.data_type()).collect(),
        DataType::List(f) | DataType::Map(f, _) => vec![f.data_type()],
        _ if data.data_type() == want => return Some(data),
        _ => return None,
    };
    let child_data = data
        .child_data()
        .iter()
        .zip(children)
        .map(|(c, t)| relabel(c.clone(), t))
        .collect::<Option<Vec<_>>>()?;
    data.into_builder()
        .data_type(want.clone())
        .child_data(child_data)
        .build()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Int64Array, StringArray};
    use arrow_schema::{Field, Schema};

    #[test]
    fn nested_columns_are_relabelled_to_the_tables_field_ids_without_copying() {
        use arrow_array::builder::{Int64Builder, ListBuilder};
        use std::collections::HashMap;
        let mut b = ListBuilder::new(Int64Builder::new());
        b.append_value([Some(1), None, Some(3)]);
        b.append_null();
        b.append_value([]);
        let list: ArrayRef = Arc::new(b.finish());
        let batch = RecordBatch::try_from_iter([("scores", list.clone())]).unwrap();
        let id = |n: &str| HashMap::from([("PARQUET:field_id".to_owned(), n.to_owned())]);
        let element = Field::new("element", DataType::Int64, true).with_metadata(id("2"));
        let target: SchemaRef = Arc::new(Schema::new(vec![
            Field::new("scores", DataType::List(Arc::new(element)), true).with_metadata(id("1")),
        ]));
        let fitted = conform(&batch, &target, "t").unwrap();
        assert_eq!(fitted.schema(), target);
        assert_eq!(
            fitted.column(0).to_data().buffers(),
            list.to_data().buffers()
        );
        assert_eq!(
            fitted
                .column(0)
                .as_list::<i32>()
                .value(0)
                .as_primitive::<arrow_array::types::Int64Type>()
                .values(),
            &[1, 0, 3]
        );
        // Another shape is refused, naming the column.
        let other: SchemaRef = Arc::new(Schema::new(vec![Field::new(
            "scores",
            DataType::List(Arc::new(Field::new("element", DataType::Utf8, true))),
            true,
        )]));
        let err = conform(&batch, &other, "t").unwrap_err().to_string();
        assert!(err.contains("field `scores`"), "{err}");
    }

    #[test]
    fn only_the_row_group_in_progress_counts_as_buffered() {
        // Nothing flushed yet: all of it is in memory.
        assert_eq!(buffered(1_000, 50_000, 65_536), 50_000);
        assert_eq!(buffered(65_536, 3_000_000, 65_536), 3_000_000);
        // Two full row groups flushed, a quarter of one in progress.
        let rows = 2 * 65_536 + 16_384;
        assert_eq!(buffered(rows, 9_000_000, 65_536), 1_000_000);
        // Just flushed: nothing in progress.
        assert_eq!(buffered(3 * 65_536, 9_000_000, 65_536), 0);
    }

    #[test]
    fn only_mostly_distinct_columns_lose_their_dictionary() {
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..10_000));
        assert!(mostly_distinct(&ids), "distinct longs");
        assert!(mostly_distinct(&ids.slice(5_000, 3_000)), "a slice of them");
        let few: ArrayRef = Arc::new(Int64Array::from_iter_values((0..10_000).map(|i| i % 100)));
        assert!(!mostly_distinct(&few), "100 distinct longs");
        let text: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..1_000).map(|i| format!("bid {i}")),
        ));
        assert!(mostly_distinct(&text), "distinct strings");
        let channels: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..1_000).map(|i| ["apple", "google", "facebook"][i % 3]),
        ));
        assert!(!mostly_distinct(&channels), "3 distinct strings");
        let nulls: ArrayRef = Arc::new(Int64Array::from_iter(
            (0..1_000).map(|i| (i % 50 == 0).then_some(i)),
        ));
        assert!(
            !mostly_distinct(&nulls),
            "20 values among nulls are too few to tell"
        );
        let bools: ArrayRef = Arc::new(BooleanArray::from_iter(
            (0..1_000).map(|i| Some(i % 2 == 0)),
        ));
        assert!(!mostly_distinct(&bools), "booleans keep the default");
    }

    fn target() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]))
    }

    #[test]
    fn batches_are_fitted_by_name_and_misfits_are_named() {
        let batch = RecordBatch::try_from_iter(vec![
            (
                "name",
                Arc::new(StringArray::from(vec!["a", "b"])) as ArrayRef,
            ),
            ("id", Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef),
        ])
        .unwrap();
        let fitted = conform(&batch, &target(), "w").unwrap();
        assert_eq!(fitted.schema(), target());
        let only_id = RecordBatch::try_from_iter(vec![(
            "id",
            Arc::new(Int64Array::from(vec![1])) as ArrayRef,
        )])
        .unwrap();
        assert_eq!(
            conform(&only_id, &target(), "w")
                .unwrap()
                .column(1)
                .null_count(),
            1
        );

        let wrong = RecordBatch::try_from_iter(vec![(
            "id",
            Arc::new(StringArray::from(vec!["1"])) as ArrayRef,
        )])
        .unwrap();
        let err = conform(&wrong, &target(), "w").unwrap_err().to_string();
        assert!(
            err.contains("field `id` is Utf8") && err.contains("Int64"),
            "{err}"
        );
        let extra = RecordBatch::try_from_iter(vec![
            ("id", Arc::new(Int64Array::from(vec![1])) as ArrayRef),
            ("zip", Arc::new(Int64Array::from(vec![1])) as ArrayRef),
        ])
        .unwrap();
        let err = conform(&extra, &target(), "w").unwrap_err().to_string();
        assert!(err.contains("`zip`"), "{err}");
        let nulls = RecordBatch::try_from_iter(vec![(
            "id",
            Arc::new(Int64Array::from(vec![Some(1), None])) as ArrayRef,
        )])
        .unwrap();
        let err = conform(&nulls, &target(), "w").unwrap_err().to_string();
        assert!(err.contains("required column `id` has 1 null"), "{err}");
    }
}
