//! tinyflow's Iceberg sink: exactly-once appends of Arrow record batches
//! to an Iceberg table.
//!
//! The sink is two stages (steps 4-7 of `exactly-once.md`):
//!
//! - **Writers** (parallel): turn record batches into Parquet data files
//!   through iceberg's writer stack, a file per partition of the table's
//!   partition spec, rolled at a target size, at most `max_open_writers`
//!   open at once. On barrier N they close every file and send the files'
//!   metadata to the committer ahead of the barrier.
//! - **Committer** (one subtask): keeps the files by checkpoint id as its
//!   checkpoint state. When checkpoint N is durable it commits every pending
//!   file of every checkpoint `<= N` in one transaction: a fast append whose
//!   snapshot summary carries `tinyflow.sink-id`, `tinyflow.checkpoint-id`,
//!   `tinyflow.watermark` and `tinyflow.source-positions`, plus the table property
//!   `tinyflow.sink.<sink-id>.checkpoint-id`, which survives snapshot expiry.
//!
//! Dedupe is keyed on the configured sink id (stable across runs) and runs
//! on the table as refreshed *inside* each commit attempt, including retries
//! after a conflict (see `catalog::GuardedCatalog`). On recovery the
//! committer commits the restored checkpoints the table does not hold yet
//! and drops the others; files of checkpoints that never completed are
//! orphans, deleted by [`IcebergSink::delete_orphans`] (and on recovery,
//! past a minimum age).
//!
//! Table upkeep ([`Maintenance`]: snapshot expiry, the files only expired
//! snapshots referenced, old metadata files) runs in the job when
//! `IcebergSinkConfig::maintenance` is set, or once with
//! [`IcebergSink::maintain`].
//!
//! Feature `testing` (tests only, never the product): the commit fault hook,
//! `FaultHook`, `CommitStep` and `Fault` at the crate root and
//! `IcebergSinkConfig::fault_hook`, which crashes or interferes at each step
//! of a commit.
//!
//! ```no_run
//! # use tinyflow_api::{JobBuilder, JobId, Stream};
//! # use tinyflow_connectors_iceberg::*;
//! # fn build(batches: Stream<arrow_array::RecordBatch>) -> tinyflow_api::StreamResult<()> {
//! let config = IcebergSinkConfig::new(
//!     CatalogConfig::sqlite(std::path::Path::new("/var/lib/tinyflow")),
//!     "analytics",
//!     "bids",
//!     "bids-sink",
//! )
//! .create_if_missing(TableSpec {
//!     columns: vec![
//!         Column::required("auction", ColumnType::Long),
//!         Column::required("price", ColumnType::Long),
//!         Column::required("ts", ColumnType::Timestamptz),
//!     ],
//!     partition: vec![PartitionField::new("ts", "hour")],
//! });
//! IcebergSink::new(config)?.attach(batches, "bids", 2);
//! # Ok(())
//! # }
//! ```

mod catalog;
mod committer;
mod config;
mod dedupe;
mod evolve;
#[cfg(feature = "testing")]
mod fault;
pub mod identity;
mod layout;
mod local_storage;
mod maintenance;
mod merge;
mod object_files;
mod orphans;
mod read;
mod shuffle;
mod split;
mod table;
mod writer;

use std::sync::Arc;
use std::time::Duration;

use arrow_array::RecordBatch;
use tinyflow_api::{CheckpointId, JobPositions, SinkFactory, Stream, StreamResult, WriterFactory};

pub use catalog::{is_s3_location, open_catalog};
pub use config::{
    BadRecords, CatalogConfig, Column, ColumnType, CommitCadence, Compression, IcebergSinkConfig,
    PartitionField, TableSpec,
};
pub use dedupe::{
    SUMMARY_CHECKPOINT_ID, SUMMARY_EPOCH, SUMMARY_EPOCH_CLAIM, SUMMARY_SINK_ID,
    SUMMARY_SOURCE_POSITIONS, SUMMARY_WATERMARK, committed_id, committed_positions, epoch_owner,
    epoch_property, positions_property, retired, retired_property, table_epoch,
};
pub use evolve::SchemaChange;
#[cfg(feature = "testing")]
pub use fault::{CommitStep, Fault, FaultHook};
pub use layout::{
    Joined, Layout, LayoutRecord, SUMMARY_LAYOUT_SWITCH, layout_property, layout_start,
    layout_start_property, table_layout, worker_start,
};
pub use maintenance::{DELETE_AFTER_COMMIT, Maintenance, MaintenanceReport, PREVIOUS_VERSIONS_MAX};
pub use object_files::ObjectFiles;
pub use orphans::OrphanReport;
pub use read::{TableReader, load_table, scan_longs, total_records};
pub use shuffle::Distribution;
pub use table::iceberg_schema;
pub use writer::{DataFileMeta, conform, plain_columns};

use crate::table::SinkTable;

/// An exactly-once Iceberg sink; [`IcebergSink::attach`] adds it to a job.
#[derive(Clone)]
pub struct IcebergSink {
    table: Arc<SinkTable>,
}

impl std::fmt::Debug for IcebergSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IcebergSink")
            .field("config", &self.table.config)
            .finish()
    }
}

impl IcebergSink {
    /// Checks the configuration; the catalog is opened when the job starts.
    pub fn new(config: IcebergSinkConfig) -> StreamResult<Self> {
        Ok(IcebergSink {
            table: Arc::new(SinkTable::new(config)?),
        })
    }

    /// Adds the sink to a job: `parallelism` writers named `<name>-writer`,
    /// fed by table partition (`distribution`, unless the declared table
    /// is unpartitioned) or as the stream is, then one committer named
    /// `<name>-committer`.
    pub fn attach(&self, stream: Stream<RecordBatch>, name: &str, parallelism: usize) {
        let config = &self.table.config;
        let unpartitioned = config
            .table_spec
            .as_ref()
            .is_some_and(|spec| spec.partition.is_empty());
        let stream = if config.distribution == Distribution::Hash && !unpartitioned {
            if let Some(spec) = &config.table_spec {
                self.table.routing.declare(&spec.partition);
            }
            stream.partition_custom(Arc::new(shuffle::ByPartition {
                routing: Arc::clone(&self.table.routing),
                next: std::sync::atomic::AtomicUsize::new(0),
            }))
        } else {
            stream
        };
        stream
            .write(&format!("{name}-writer"), parallelism, self.writers())
            .rebalance()
            .sink(&format!("{name}-committer"), 1, self.committer());
    }

    /// The writer stage alone (what [`IcebergSink::attach`] adds first), for
    /// jobs that wire the stages themselves, and for tests that drive them.
    pub fn writers(&self) -> impl WriterFactory<RecordBatch, DataFileMeta> + 'static {
        writer::IcebergWriterFactory {
            table: Arc::clone(&self.table),
        }
    }

    /// The committer stage alone; it must run with parallelism 1.
    pub fn committer(&self) -> impl SinkFactory<DataFileMeta> + 'static {
        committer::CommitterFactory {
            table: Arc::clone(&self.table),
        }
    }

    /// Opens the catalog and loads the table (creating it when missing and
    /// declared); a declared schema that does not fit fails here, naming
    /// the column.
    pub async fn load_table(&self) -> StreamResult<iceberg::table::Table> {
        self.table.load().await
    }

    /// Claims the sink for this run (once; later calls return the same
    /// epoch): raises the table's `tinyflow.sink.<id>.epoch` in a commit of
    /// its own, after which commits of older runs of the sink are refused
    /// (they stop with [`StreamError::Fenced`](tinyflow_api::StreamError)).
    /// The committer claims when it starts; a tool that reads the table to
    /// decide where the job starts (`tinyflow run` without a checkpoint)
    /// claims first, so that no older run commits after it read.
    pub async fn claim(&self) -> StreamResult<u64> {
        Ok(self.table.claim().await?.epoch)
    }

    /// Finds or makes worker `worker`'s place in the layout of the job
    /// whose base sink id is this sink's (see the `layout` module): joins
    /// the table's layout when it has as many workers; switches the table
    /// to a new layout when it has none yet or `rescale_from` names its
    /// layout (`N@G`), retiring (fencing) the old sink ids and recording where
    /// the new workers start; else refuses with a `Config` error that names
    /// the conflict. The worker then runs a sink with [`Joined::sink_id`].
    pub async fn join_layout(
        &self,
        worker: tinyflow_api::Worker,
        rescale_from: Option<tinyflow_api::RescaleFrom>,
    ) -> StreamResult<Joined> {
        self.table.join_layout(worker, rescale_from).await
    }

    /// The highest checkpoint id this sink committed to the table.
    pub async fn last_committed(&self) -> StreamResult<Option<CheckpointId>> {
        self.table.committed().await
    }

    /// Where the sources stood at the last checkpoint this sink committed
    /// to the table: the table holds every record before these positions
    /// and, from this sink, none after. A job that lost its checkpoints can
    /// start its sources there and stay exactly once (`tinyflow run` does).
    pub async fn committed_positions(&self) -> StreamResult<Option<JobPositions>> {
        self.table.committed_positions().await
    }

    /// The table's columns now, as declared columns (those of types a job
    /// file cannot declare left out); the table is created first when it
    /// is missing and declared.
    pub async fn table_columns(&self) -> StreamResult<Vec<crate::config::Column>> {
        self.table.columns().await
    }

    /// Schema evolution: makes the table take `wanted` in a commit of its
    /// own, adding the columns it lacks (as optional columns, nested ones
    /// too) and widening types where Iceberg allows; renames, drops and
    /// narrowing are never done (an error names the column). Idempotent:
    /// returns what it changed (nothing when the table took them already)
    /// and the table's schema after, as Arrow with field ids.
    pub async fn evolve_columns(
        &self,
        wanted: &[crate::config::Column],
    ) -> StreamResult<(SchemaChange, arrow_schema::SchemaRef)> {
        self.table.evolve(wanted).await
    }

    /// Deletes this sink's data files that no snapshot references and that
    /// are older than `min_age` (local warehouses). `min_age` must exceed
    /// the longest time a written file waits for its commit (the commit
    /// cadence), or files of a running job could go.
    pub async fn delete_orphans(&self, min_age: Duration) -> StreamResult<OrphanReport> {
        orphans::delete_orphans(&self.table, min_age, false).await
    }
}
