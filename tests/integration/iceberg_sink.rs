//! The Iceberg sink against a real sqlite SQL catalog on a local warehouse,
//! read back by iceberg-rust's scan and by pyiceberg (an independent
//! reader, installed by `cargo xtask py-setup`, which `cargo xtask ci`
//! runs).
//!
//! The commit path is driven step by step (writer -> flush on a barrier ->
//! committer state -> commit) with crashes injected at every step of the
//! commit: before it reaches the catalog, after the catalog accepted it
//! but before anything learned of it, during the retry after a real
//! conflict, and a lost catalog answer. After each, a committer restored
//! from the checkpoint must leave every record in the table exactly once.
//! Then whole jobs through the runtime, with panics at random moments, on
//! the sqlite catalog and on a PostgreSQL one (`TINYFLOW_POSTGRES_URL`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow_array::types::Decimal128Type;
use arrow_array::{
    ArrayRef, BooleanArray, Date32Array, Decimal128Array, Float64Array, Int32Array, Int64Array,
    PrimitiveArray, RecordBatch, StringArray, TimestampMicrosecondArray,
};
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use tinyflow_api::testing::VecSource;

use tinyflow_api::{
    CheckpointId, JobBuilder, JobId, OperatorContext, Sink, SinkFactory, SinkRestore, Writer,
    WriterFactory,
};
use tinyflow_checkpoint::CheckpointConfig;
use tinyflow_checkpoint::testing::MemoryCheckpointStore;
use tinyflow_connectors_iceberg::{
    BadRecords, CatalogConfig, Column, ColumnType, CommitCadence, CommitStep, Compression,
    DataFileMeta, Fault, FaultHook, IcebergSink, IcebergSinkConfig, PartitionField,
    SUMMARY_CHECKPOINT_ID, SUMMARY_EPOCH, SUMMARY_EPOCH_CLAIM, SUMMARY_SINK_ID,
    SUMMARY_SOURCE_POSITIONS, TableSpec, committed_id, load_table, open_catalog, scan_longs,
};
use tinyflow_runtime::{JobRunner, RestartStrategy, RuntimeConfig, StopHandle};
use tinyflow_tests::ms;

pub(crate) const NS: &str = "db";
pub(crate) const TABLE: &str = "events";
/// 2026-01-01T00:00:00Z in microseconds.
const T0: i64 = 1_767_225_600_000_000;
const HOUR: i64 = 3_600_000_000;

/// Every type the sink maps; partitioned by identity, day and bucket.
pub(crate) fn table_spec() -> TableSpec {
    TableSpec {
        columns: vec![
            Column::required("id", ColumnType::Long),
            Column::required("part", ColumnType::Int),
            Column::required("ts", ColumnType::Timestamptz),
            Column::optional("name", ColumnType::String),
            Column::optional("score", ColumnType::Double),
            Column::optional("ok", ColumnType::Boolean),
            Column::optional("day", ColumnType::Date),
            Column::optional(
                "amount",
                ColumnType::Decimal {
                    precision: 12,
                    scale: 2,
                },
            ),
        ],
        partition: vec![
            PartitionField::new("part", "identity"),
            PartitionField::new("ts", "day"),
            PartitionField::new("id", "bucket[4]"),
        ],
    }
}

/// Rows `ids`: part = id % 3, ts = T0 + (id % 48) hours (two days).
pub(crate) fn batch(ids: std::ops::Range<i64>) -> RecordBatch {
    let ids: Vec<i64> = ids.collect();
    let amount: PrimitiveArray<Decimal128Type> =
        Decimal128Array::from(ids.iter().map(|i| i128::from(*i) * 101).collect::<Vec<_>>())
            .with_precision_and_scale(12, 2)
            .unwrap();
    RecordBatch::try_from_iter(vec![
        ("id", Arc::new(Int64Array::from(ids.clone())) as ArrayRef),
        (
            "part",
            Arc::new(Int32Array::from(
                ids.iter().map(|i| (i % 3) as i32).collect::<Vec<_>>(),
            )),
        ),
        (
            "ts",
            Arc::new(
                TimestampMicrosecondArray::from(
                    ids.iter().map(|i| T0 + (i % 48) * HOUR).collect::<Vec<_>>(),
                )
                .with_timezone("UTC"),
            ),
        ),
        (
            "name",
            Arc::new(StringArray::from(
                ids.iter().map(|i| format!("n{i}")).collect::<Vec<_>>(),
            )),
        ),
        (
            "score",
            Arc::new(Float64Array::from(
                ids.iter().map(|i| *i as f64 / 2.0).collect::<Vec<_>>(),
            )),
        ),
        (
            "ok",
            Arc::new(BooleanArray::from(
                ids.iter().map(|i| i % 2 == 0).collect::<Vec<_>>(),
            )),
        ),
        (
            "day",
            Arc::new(Date32Array::from(
                ids.iter()
                    .map(|i| 20_000 + (i % 5) as i32)
                    .collect::<Vec<_>>(),
            )),
        ),
        ("amount", Arc::new(amount)),
    ])
    .unwrap()
}

/// Checkpoints every 40 ms and up to 20 restarts 20 ms apart, for jobs
/// whose failures are injected.
pub(crate) fn quick_restarts() -> RuntimeConfig {
    RuntimeConfig {
        checkpoint: CheckpointConfig {
            interval: Some(ms(40)),
            timeout: ms(20_000),
            ..CheckpointConfig::default()
        },
        restart: RestartStrategy::FixedDelay {
            delay: ms(20),
            max_attempts: 20,
        },
        channel_capacity: 4,
        chaining: true,
    }
}

pub(crate) fn config(dir: &Path, sink_id: &str) -> IcebergSinkConfig {
    config_on(CatalogConfig::sqlite(dir), sink_id)
}

pub(crate) fn config_on(catalog: CatalogConfig, sink_id: &str) -> IcebergSinkConfig {
    let mut c = IcebergSinkConfig::new(catalog, NS, TABLE, sink_id).create_if_missing(table_spec());
    c.retry_backoff = ms(10);
    c.orphan_min_age = None;
    c
}

pub(crate) fn ctx(name: &str, parallelism: usize) -> OperatorContext {
    OperatorContext {
        name: name.to_owned(),
        subtask: 0,
        parallelism,
        max_parallelism: 128,
    }
}

/// A fault hook that answers `fault` at `step`, once, and records every
/// step it saw.
#[derive(Clone, Default)]
pub(crate) struct Faults {
    plan: Arc<Mutex<Vec<(CommitStep, Fault)>>>,
    seen: Arc<Mutex<Vec<CommitStep>>>,
}

impl Faults {
    pub(crate) fn at(&self, step: CommitStep, fault: Fault) {
        self.plan.lock().unwrap().push((step, fault));
    }

    pub(crate) fn seen(&self) -> Vec<CommitStep> {
        self.seen.lock().unwrap().clone()
    }

    /// `config(dir, sink_id)` with this hook.
    pub(crate) fn config(&self, dir: &Path, sink_id: &str) -> IcebergSinkConfig {
        let mut c = config(dir, sink_id);
        c.fault_hook = Some(self.hook());
        c
    }

    pub(crate) fn hook(&self) -> FaultHook {
        let me = self.clone();
        Arc::new(move |step| {
            me.seen.lock().unwrap().push(step);
            let mut plan = me.plan.lock().unwrap();
            let fault = match plan.iter().position(|(s, _)| *s == step) {
                Some(i) => plan.remove(i).1,
                None => Fault::Proceed,
            };
            Box::pin(async move { fault })
        })
    }
}

/// Drives one sink's writer and committer by hand, the way the runtime
/// does, keeping the committer's state per checkpoint.
/// What stands in for a dropped committer or writer.
struct Gone;

#[async_trait::async_trait]
impl Sink<DataFileMeta> for Gone {
    async fn write(&mut self, _: Vec<DataFileMeta>) -> tinyflow_api::StreamResult<()> {
        unreachable!("gone")
    }
    async fn prepare_commit(&mut self, _: CheckpointId) -> tinyflow_api::StreamResult<Vec<u8>> {
        unreachable!("gone")
    }
    async fn commit(&mut self, _: CheckpointId) -> tinyflow_api::StreamResult<()> {
        unreachable!("gone")
    }
}

#[async_trait::async_trait]
impl Writer<RecordBatch, DataFileMeta> for Gone {
    async fn write(&mut self, _: Vec<RecordBatch>) -> tinyflow_api::StreamResult<()> {
        unreachable!("gone")
    }
    async fn flush(&mut self, _: CheckpointId) -> tinyflow_api::StreamResult<Vec<DataFileMeta>> {
        unreachable!("gone")
    }
}

pub(crate) struct Driver {
    pub(crate) sink: IcebergSink,
    pub(crate) writer: Box<dyn Writer<RecordBatch, DataFileMeta>>,
    pub(crate) committer: Box<dyn Sink<DataFileMeta>>,
    pub(crate) states: BTreeMap<u64, Vec<u8>>,
}

impl Driver {
    pub(crate) async fn new(config: IcebergSinkConfig) -> Self {
        Driver::with_sink(IcebergSink::new(config).unwrap()).await
    }

    /// A driver of `sink` (a run that may have claimed the sink already).
    pub(crate) async fn with_sink(sink: IcebergSink) -> Self {
        let writer = sink.writers().create(&ctx("w", 1)).await.unwrap();
        let committer = sink.committer().create(&ctx("c", 1), None).await.unwrap();
        Driver {
            sink,
            writer,
            committer,
            states: BTreeMap::new(),
        }
    }

    /// Writes `ids`, then barrier `id`: the writer's files go to the
    /// committer, whose state is kept as checkpoint `id`'s.
    pub(crate) async fn checkpoint(&mut self, id: u64, ids: std::ops::Range<i64>) {
        self.checkpoint_in(id, ids, usize::MAX).await;
    }

    /// As `checkpoint`, written in batches of `rows` rows.
    pub(crate) async fn checkpoint_in(&mut self, id: u64, ids: std::ops::Range<i64>, rows: usize) {
        let all: Vec<i64> = ids.collect();
        for chunk in all.chunks(rows.min(all.len()).max(1)) {
            let (first, last) = (chunk[0], chunk[chunk.len() - 1]);
            self.writer
                .write(vec![batch(first..last + 1)])
                .await
                .unwrap();
        }
        let files = self.writer.flush(CheckpointId::new(id)).await.unwrap();
        assert!(!files.is_empty());
        self.committer.write(files).await.unwrap();
        let state = self
            .committer
            .prepare_commit(CheckpointId::new(id))
            .await
            .unwrap();
        self.states.insert(id, state);
    }

    pub(crate) async fn commit(&mut self, id: u64) -> tinyflow_api::StreamResult<()> {
        self.committer.commit(CheckpointId::new(id)).await
    }

    /// The process died: a new committer restored from checkpoint `id`.
    pub(crate) async fn restore(&mut self, id: u64) {
        self.try_restore(id).await.unwrap();
    }

    /// As `restore`, which the sink may refuse.
    pub(crate) async fn try_restore(&mut self, id: u64) -> tinyflow_api::StreamResult<()> {
        let states = [self.states[&id].clone()];
        self.committer = self
            .sink
            .committer()
            .create(
                &ctx("c", 1),
                Some(SinkRestore {
                    checkpoint: CheckpointId::new(id),
                    states: &states,
                }),
            )
            .await?;
        self.writer = self.sink.writers().create(&ctx("w", 1)).await?;
        Ok(())
    }

    /// A crashed attempt restarted in the same process, from checkpoint
    /// `id`: the runtime drops the attempt's committer and writer before it
    /// creates the next attempt's.
    pub(crate) async fn restart_attempt(&mut self, id: u64) -> tinyflow_api::StreamResult<()> {
        self.committer = Box::new(Gone);
        self.writer = Box::new(Gone);
        self.try_restore(id).await
    }

    pub(crate) async fn table(&self) -> iceberg::table::Table {
        self.sink.load_table().await.unwrap()
    }
}

/// Every id in the table, sorted, read with iceberg-rust's scan.
pub(crate) async fn ids(table: &iceberg::table::Table) -> Vec<i64> {
    let mut ids = scan_longs(table, "id", None).await.unwrap();
    ids.sort_unstable();
    ids
}

pub(crate) fn range(r: std::ops::Range<i64>) -> Vec<i64> {
    r.collect()
}

/// Snapshots that commit data (a run's claim of a sink adds one without).
pub(crate) fn snapshots(table: &iceberg::table::Table) -> usize {
    table
        .metadata()
        .snapshots()
        .filter(|s| {
            s.summary()
                .additional_properties
                .contains_key(SUMMARY_SINK_ID)
        })
        .count()
}

#[tokio::test]
async fn a_crash_before_the_commit_then_recovery_commits_once() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Faults::default();
    faults.at(
        CommitStep::BeforeUpdate { attempt: 0 },
        Fault::Crash("before".into()),
    );
    let mut d = Driver::new(faults.config(dir.path(), "s")).await;
    d.checkpoint(1, 0..100).await;
    let err = d.commit(1).await.unwrap_err().to_string();
    assert!(err.contains("injected crash"), "{err}");
    assert_eq!(ids(&d.table().await).await, Vec::<i64>::new());

    d.restore(1).await;
    let table = d.table().await;
    assert_eq!(ids(&table).await, range(0..100));
    assert_eq!(committed_id(&table, "s"), Some(1));
    // A second crash and restore from the same checkpoint changes nothing.
    d.restore(1).await;
    let again = d.table().await;
    assert_eq!(ids(&again).await, range(0..100));
    assert_eq!(snapshots(&again), snapshots(&table));
}

#[tokio::test]
async fn a_crash_after_the_commit_before_anyone_learns_of_it_is_not_committed_twice() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Faults::default();
    faults.at(
        CommitStep::AfterUpdate { attempt: 0 },
        Fault::Crash("after".into()),
    );
    let mut d = Driver::new(faults.config(dir.path(), "s")).await;
    d.checkpoint(1, 0..100).await;
    assert!(d.commit(1).await.is_err());
    let committed = d.table().await;
    assert_eq!(ids(&committed).await, range(0..100), "the commit landed");

    d.restore(1).await;
    let table = d.table().await;
    assert_eq!(ids(&table).await, range(0..100));
    assert_eq!(
        snapshots(&table),
        snapshots(&committed),
        "no second snapshot"
    );
    // The job goes on: the next checkpoint commits normally.
    d.checkpoint(2, 100..150).await;
    d.commit(2).await.unwrap();
    assert_eq!(ids(&d.table().await).await, range(0..150));
}

/// The catalog committed but its answer was lost: the transaction retries
/// as after a conflict. The dedupe check runs on the table refreshed for
/// the retry, so the retry stops; a check before the commit (on the table
/// as it was) would have let the retry append the files again.
#[tokio::test]
async fn a_lost_answer_is_caught_by_the_check_inside_the_retried_commit() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Faults::default();
    faults.at(CommitStep::AfterUpdate { attempt: 0 }, Fault::LoseResponse);
    let mut d = Driver::new(faults.config(dir.path(), "s")).await;
    d.checkpoint(1, 0..100).await;
    d.commit(1).await.unwrap();
    assert!(
        faults
            .seen()
            .contains(&CommitStep::Refreshed { attempt: 1 }),
        "the commit was retried: {:?}",
        faults.seen()
    );
    let table = d.table().await;
    assert_eq!(ids(&table).await, range(0..100));
    assert_eq!(snapshots(&table), 1);
}

/// The same commit path on iceberg's in-memory catalog: a crash before the
/// commit, a lost answer, and a crash after it, each followed by recovery.
#[tokio::test]
async fn the_commit_path_holds_on_the_memory_catalog_too() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Faults::default();
    faults.at(
        CommitStep::BeforeUpdate { attempt: 0 },
        Fault::Crash("before".into()),
    );
    let mut c = IcebergSinkConfig::new(
        CatalogConfig::Memory {
            name: "mem".into(),
            warehouse: format!("file://{}", dir.path().display()),
        },
        NS,
        TABLE,
        "s",
    )
    .create_if_missing(table_spec());
    c.orphan_min_age = None;
    c.fault_hook = Some(faults.hook());
    let mut d = Driver::new(c).await;
    d.checkpoint(1, 0..30).await;
    assert!(d.commit(1).await.is_err());
    d.restore(1).await;
    assert_eq!(ids(&d.table().await).await, range(0..30));

    faults.at(CommitStep::AfterUpdate { attempt: 0 }, Fault::LoseResponse);
    d.checkpoint(2, 30..60).await;
    d.commit(2).await.unwrap();
    assert_eq!(ids(&d.table().await).await, range(0..60));

    faults.at(
        CommitStep::AfterUpdate { attempt: 0 },
        Fault::Crash("after".into()),
    );
    d.checkpoint(3, 60..90).await;
    assert!(d.commit(3).await.is_err());
    d.restore(3).await;
    let table = d.table().await;
    assert_eq!(ids(&table).await, range(0..90));
    assert_eq!(snapshots(&table), 3);
}

/// Another sink appends between our refresh and our update: a real
/// compare-and-swap conflict. The process dies during the retry; recovery
/// commits our files once and keeps the other sink's.
#[tokio::test]
async fn a_crash_during_the_retry_after_a_conflict_then_recovery_commits_once() {
    let dir = tempfile::tempdir().unwrap();
    crash_during_the_retry_after_a_conflict(CatalogConfig::sqlite(dir.path())).await;
}

/// The same through the REST catalog server: there the conflict is the
/// server refusing the commit's requirements (HTTP 409).
#[tokio::test]
async fn a_crash_during_the_retry_after_a_rest_conflict_then_recovery_commits_once() {
    let _serial = REST_TABLE.lock().await;
    crash_during_the_retry_after_a_conflict(fresh_rest_catalog().await).await;
}

/// The REST tests share one server and this module's table name: one at a
/// time.
static REST_TABLE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The REST catalog server of the tests, without this module's table (the
/// server outlives test runs).
async fn fresh_rest_catalog() -> CatalogConfig {
    let catalog = CatalogConfig::Rest {
        name: "rest".into(),
        uri: tinyflow_tests::rest_catalog_url(),
        warehouse: None,
        properties: Default::default(),
    };
    let opened = open_catalog(&catalog, ms(10_000)).await.unwrap();
    let ident = iceberg::TableIdent::from_strs([NS, TABLE]).unwrap();
    if opened.table_exists(&ident).await.unwrap() {
        opened.drop_table(&ident).await.unwrap();
    }
    catalog
}

async fn crash_during_the_retry_after_a_conflict(catalog: CatalogConfig) {
    let mut other = Driver::new(config_on(catalog.clone(), "other")).await;
    other.checkpoint(1, 1_000..1_010).await;
    let other = Arc::new(tokio::sync::Mutex::new(other));

    let faults = Faults::default();
    faults.at(
        CommitStep::Refreshed { attempt: 1 },
        Fault::Crash("in retry".into()),
    );
    let inner = faults.hook();
    let interfere: FaultHook = Arc::new(move |step| {
        let fault = inner(step);
        let other = Arc::clone(&other);
        Box::pin(async move {
            if step == (CommitStep::BeforeUpdate { attempt: 0 }) {
                other.lock().await.commit(1).await.unwrap();
            }
            fault.await
        })
    });
    let mut c = config_on(catalog, "s");
    c.fault_hook = Some(interfere);
    let mut d = Driver::new(c).await;
    d.checkpoint(1, 0..100).await;
    let err = d.commit(1).await.unwrap_err().to_string();
    assert!(err.contains("in retry"), "{err}");
    assert!(
        faults
            .seen()
            .contains(&CommitStep::Refreshed { attempt: 1 })
    );
    assert_eq!(ids(&d.table().await).await, range(1_000..1_010));

    d.restore(1).await;
    let table = d.table().await;
    let mut want = range(0..100);
    want.extend(1_000..1_010);
    assert_eq!(ids(&table).await, want);
    assert_eq!(committed_id(&table, "s"), Some(1));
    assert_eq!(committed_id(&table, "other"), Some(1));
}

/// The catalog fails commits: the sink retries with backoff, succeeds when
/// the catalog comes back, and after `commit_attempts` failures fails the
/// task with the catalog's error, the files safe in the checkpoint.
#[tokio::test]
async fn an_unavailable_catalog_is_retried_then_fails_with_the_data_safe_in_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Faults::default();
    for _ in 0..2 {
        faults.at(CommitStep::BeforeUpdate { attempt: 0 }, Fault::Unavailable);
    }
    let mut c = faults.config(dir.path(), "s");
    c.commit_attempts = 3;
    let mut d = Driver::new(c).await;
    d.checkpoint(1, 0..10).await;
    d.commit(1).await.unwrap();
    assert_eq!(ids(&d.table().await).await, range(0..10));

    for _ in 0..3 {
        faults.at(CommitStep::BeforeUpdate { attempt: 0 }, Fault::Unavailable);
    }
    d.checkpoint(2, 10..20).await;
    let err = d.commit(2).await.unwrap_err();
    assert!(err.to_string().contains("unreachable"), "{err}");
    assert!(
        err.is_retryable(),
        "a restart may find the catalog back: {err:?}"
    );
    assert_eq!(ids(&d.table().await).await, range(0..10));
    d.restore(2).await;
    assert_eq!(ids(&d.table().await).await, range(0..20));
}

/// Two sinks on one table with the same checkpoint ids: each keeps its own
/// exactly-once. Were dedupe keyed on anything shared (the table, a job
/// id), one sink's commit would make the other's data look committed.
#[tokio::test]
async fn two_sinks_with_their_own_ids_share_a_table_each_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = Driver::new(config(dir.path(), "a")).await;
    let mut b = Driver::new(config(dir.path(), "b")).await;
    a.checkpoint(1, 0..50).await;
    b.checkpoint(1, 500..520).await;
    a.commit(1).await.unwrap();
    a.checkpoint(2, 50..80).await;
    a.commit(2).await.unwrap();
    // b dies before its commit; a dies after its second and restores an
    // older checkpoint whose pending work holds checkpoint 1 and 2 files.
    b.restore(1).await;
    a.restore(2).await;
    // An older checkpoint than the table holds is refused (the runtime's
    // coordinator refuses it first; the committer does not rely on that).
    assert!(matches!(
        a.try_restore(1).await,
        Err(tinyflow_api::StreamError::StateMismatch { .. })
    ));
    let table = a.table().await;
    let mut want = range(0..80);
    want.extend(500..520);
    assert_eq!(ids(&table).await, want);
    assert_eq!(committed_id(&table, "a"), Some(2));
    assert_eq!(committed_id(&table, "b"), Some(1));
    let sinks: Vec<String> = table
        .metadata()
        .snapshots()
        .filter_map(|s| {
            s.summary()
                .additional_properties
                .get(SUMMARY_SINK_ID)
                .cloned()
        })
        .collect();
    assert_eq!(sinks.iter().filter(|s| *s == "a").count(), 2);
    assert_eq!(sinks.iter().filter(|s| *s == "b").count(), 1);
}

/// The sink's snapshots expire before it recovers: the history no longer
/// shows what it committed, the table property still does.
#[tokio::test]
async fn snapshot_expiry_before_recovery_does_not_break_dedupe() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Faults::default();
    faults.at(
        CommitStep::AfterUpdate { attempt: 0 },
        Fault::Crash("after".into()),
    );
    let mut a = Driver::new(faults.config(dir.path(), "a")).await;
    a.checkpoint(1, 0..40).await;
    assert!(a.commit(1).await.is_err());
    let mut b = Driver::new(config(dir.path(), "b")).await;
    b.checkpoint(1, 100..110).await;
    b.commit(1).await.unwrap();

    // Expire every snapshot but the current one (b's).
    let table = a.table().await;
    let current = table.metadata().current_snapshot_id().unwrap();
    let old: Vec<i64> = table
        .metadata()
        .snapshots()
        .map(|s| s.snapshot_id())
        .filter(|id| *id != current)
        .collect();
    assert_eq!(old.len(), 3, "a's claim, a's commit, b's claim");
    let tx = Transaction::new(&table);
    let tx = tx
        .expire_snapshots()
        .expire_snapshot_ids(old)
        .apply(tx)
        .unwrap();
    let catalog =
        tinyflow_connectors_iceberg::open_catalog(&CatalogConfig::sqlite(dir.path()), ms(5_000))
            .await
            .unwrap();
    tx.commit(catalog.as_ref()).await.unwrap();
    let expired = a.table().await;
    assert_eq!(snapshots(&expired), 1);
    assert!(
        expired.metadata().snapshots().all(|s| s
            .summary()
            .additional_properties
            .get(SUMMARY_SINK_ID)
            .map(String::as_str)
            != Some("a")),
        "a's snapshot is gone from the history"
    );

    a.restore(1).await;
    let table = a.table().await;
    let mut want = range(0..40);
    want.extend(100..110);
    assert_eq!(ids(&table).await, want);
}

#[tokio::test]
async fn a_commit_cadence_of_three_checkpoints_commits_every_third() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), "s");
    c.cadence = CommitCadence {
        every_checkpoints: Some(3),
        ..CommitCadence::default()
    };
    // Merging (the default) commits after a merge beside the checkpoints;
    // this counts commits (iceberg_merge tests merging).
    c.merge_pending = false;
    let mut d = Driver::new(c).await;
    for id in 1..=7u64 {
        let from = (id as i64 - 1) * 10;
        d.checkpoint(id, from..from + 10).await;
        d.commit(id).await.unwrap();
    }
    let table = d.table().await;
    assert_eq!(snapshots(&table), 2);
    assert_eq!(ids(&table).await, range(0..60));
    assert_eq!(committed_id(&table, "s"), Some(6));
    // Checkpoint 7's files are in its state: a restore commits them.
    d.restore(7).await;
    assert_eq!(ids(&d.table().await).await, range(0..70));
}

/// The data files the table's current snapshot added.
fn added_data_files(table: &iceberg::table::Table) -> usize {
    table
        .metadata()
        .current_snapshot()
        .unwrap()
        .summary()
        .additional_properties
        .get("added-data-files")
        .unwrap()
        .parse()
        .unwrap()
}

/// Every transform Iceberg defines makes a table the sink writes and reads
/// back; files roll at the target size within a checkpoint.
#[tokio::test]
async fn every_partition_transform_works_and_files_roll_at_the_target_size() {
    for (column, transform, partitions) in [
        ("ts", "year", 1),
        ("ts", "month", 1),
        ("ts", "hour", 48),
        ("name", "truncate[2]", 10),
        ("day", "identity", 5),
        ("amount", "bucket[3]", 3),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = table_spec();
        spec.partition = vec![PartitionField::new(column, transform)];
        let mut c = IcebergSinkConfig::new(CatalogConfig::sqlite(dir.path()), NS, TABLE, "s")
            .create_if_missing(spec);
        c.orphan_min_age = None;
        c.target_file_size = 1024;
        c.row_group_rows = 500;
        let mut d = Driver::new(c).await;
        d.checkpoint_in(1, 0..3_000, 100).await;
        d.commit(1).await.unwrap();
        let table = d.table().await;
        assert_eq!(
            ids(&table).await,
            range(0..3_000),
            "{column} by {transform}"
        );
        let files = added_data_files(&table);
        assert!(
            files > partitions,
            "{column} by {transform}: {files} files for {partitions} partitions: 1 KiB files roll"
        );
    }
}

#[tokio::test]
async fn files_carry_the_configured_compression_and_dictionaries_only_where_values_repeat() {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    for (compression, codec, level) in [
        (Compression::default(), "ZSTD", Some("1")),
        (Compression::Zstd(7), "ZSTD", Some("7")),
        (Compression::Snappy, "SNAPPY", None),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(dir.path(), "s");
        c.compression = compression;
        let mut d = Driver::new(c).await;
        d.checkpoint_in(1, 0..1_000, 100).await;
        d.commit(1).await.unwrap();
        let table = d.table().await;
        let props = table.metadata().properties();
        assert_eq!(
            props
                .get("write.parquet.compression-codec")
                .map(String::as_str),
            Some(codec.to_ascii_lowercase().as_str()),
            "{compression:?}"
        );
        assert_eq!(
            props
                .get("write.parquet.compression-level")
                .map(String::as_str),
            level,
            "{compression:?}"
        );
        let files = data_files(&table).await;
        assert!(!files.is_empty());
        for f in files {
            let path = f.strip_prefix("file://").unwrap_or(&f);
            let reader = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
            for group in reader.metadata().row_groups() {
                for column in group.columns() {
                    // Distinct ids get no dictionary; the partition column does.
                    let name = column.column_path().string();
                    if name == "id" || name == "part" {
                        assert_eq!(
                            column.dictionary_page_offset().is_some(),
                            name == "part",
                            "{name} in {path}: dictionary page at {:?}",
                            column.dictionary_page_offset()
                        );
                    }
                    // The file records the codec, not the level.
                    let found = format!("{:?}", column.compression());
                    assert!(
                        found.starts_with(codec),
                        "{compression:?}: {} in {path} is {found}",
                        column.column_path()
                    );
                }
            }
        }
    }
}

#[tokio::test]
async fn open_files_are_capped_and_the_least_recently_used_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), "s");
    c.max_open_writers = 2;
    // Rows are split by partition every 100 (a row group), so each batch
    // is split as it comes and the partitions of the next one reopen.
    c.row_group_rows = 100;
    let sink = IcebergSink::new(c).unwrap();
    let mut w = sink.writers().create(&ctx("w", 1)).await.unwrap();
    // 3 parts x 2 days x 4 buckets: up to 24 partitions in each batch.
    for k in 0..4 {
        w.write(vec![batch(k * 100..(k + 1) * 100)]).await.unwrap();
    }
    let files = w.flush(CheckpointId::new(1)).await.unwrap();
    let partitions: std::collections::HashSet<String> = files
        .iter()
        .map(|f| Path::new(&f.path).parent().unwrap().display().to_string())
        .collect();
    assert!(partitions.len() >= 20, "{} partitions", partitions.len());
    assert!(
        files.len() > partitions.len(),
        "with 2 open files, partitions are reopened: {} files for {} partitions",
        files.len(),
        partitions.len()
    );
    assert_eq!(files.iter().map(|f| f.records).sum::<u64>(), 400);
}

/// A partitioned writer gathers rows across batches before it splits them
/// by partition: rows still gathered at a barrier are written into that
/// checkpoint's files, one per partition, and none moves to the next.
#[tokio::test]
async fn rows_gathered_across_batches_are_written_at_their_checkpoint_one_file_per_partition() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), "s");
    // Two open files: split batch by batch, the 24 partitions would reopen
    // over and over; split once at the barrier, each opens once.
    c.max_open_writers = 2;
    let mut d = Driver::new(c).await;
    // 600 rows in batches of 7 over the 24 partitions (3 parts x 2 days x
    // 4 buckets): far fewer than a split's 64k, so all are gathered until
    // the barrier.
    d.checkpoint_in(1, 0..600, 7).await;
    d.commit(1).await.unwrap();
    let table = d.table().await;
    assert_eq!(ids(&table).await, range(0..600));
    assert_eq!(added_data_files(&table), 24, "one file per partition");
    d.checkpoint_in(2, 600..650, 3).await;
    d.commit(2).await.unwrap();
    let table = d.table().await;
    assert_eq!(ids(&table).await, range(0..650));
    let files = added_data_files(&table);
    assert!(files <= 24, "{files} files");
}

/// Partitions whose paths print alike (a null and the string `null` by
/// identity) are written to files of their own, each with its own value.
#[tokio::test]
async fn a_null_and_the_string_null_are_different_partitions() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = table_spec();
    spec.partition = vec![PartitionField::new("name", "identity")];
    let mut c = IcebergSinkConfig::new(CatalogConfig::sqlite(dir.path()), NS, TABLE, "s")
        .create_if_missing(spec);
    c.orphan_min_age = None;
    let sink = IcebergSink::new(c).unwrap();
    let mut w = sink.writers().create(&ctx("w", 1)).await.unwrap();
    let b = batch(0..10);
    let mut columns = b.columns().to_vec();
    // Rows 0, 2, 4, 6, 8 have no name; the others are named "null".
    columns[3] = Arc::new(StringArray::from(
        (0..10)
            .map(|i| (i % 2 == 1).then_some("null"))
            .collect::<Vec<_>>(),
    ));
    let b = RecordBatch::try_new(Arc::new(arrow_schema_nullable_id(&b)), columns).unwrap();
    w.write(vec![b]).await.unwrap();
    let files = w.flush(CheckpointId::new(1)).await.unwrap();
    assert_eq!(files.len(), 2, "{files:?}");
    // The string's file names it in its partition value; the null's does not.
    let mut by_value: Vec<(u64, bool)> = files
        .iter()
        .map(|f| (f.records, f.json.contains("\"null\"")))
        .collect();
    by_value.sort_unstable();
    assert_eq!(by_value, vec![(5, false), (5, true)], "{files:?}");
}

#[tokio::test]
async fn a_declared_schema_that_does_not_fit_the_table_fails_at_start_naming_the_column() {
    let dir = tempfile::tempdir().unwrap();
    Driver::new(config(dir.path(), "s")).await;
    let mut spec = table_spec();
    spec.columns[4].ty = ColumnType::Float;
    let c = IcebergSinkConfig::new(CatalogConfig::sqlite(dir.path()), NS, TABLE, "t")
        .create_if_missing(spec);
    let err = IcebergSink::new(c)
        .unwrap()
        .load_table()
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("`score`") && err.contains("double"), "{err}");
    // And a record batch of the wrong type fails at the writer, naming it.
    let sink = IcebergSink::new(config(dir.path(), "s")).unwrap();
    let mut w = sink.writers().create(&ctx("w", 1)).await.unwrap();
    let wrong = RecordBatch::try_from_iter(vec![(
        "id",
        Arc::new(StringArray::from(vec!["1"])) as ArrayRef,
    )])
    .unwrap();
    let err = w.write(vec![wrong]).await.unwrap_err().to_string();
    assert!(err.contains("field `id`"), "{err}");
}

/// Bad-record policy `skip`: rows with a null in a required column and
/// batches that do not fit are dropped; good rows next to them are written.
#[tokio::test]
async fn records_that_cannot_be_written_are_skipped_and_good_ones_next_to_them_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), "s");
    c.bad_records = BadRecords::Skip;
    let sink = IcebergSink::new(c).unwrap();
    let mut w = sink.writers().create(&ctx("w", 1)).await.unwrap();
    // ids 0..10 with ids 3 and 7 missing (null in the required `id`).
    let good = batch(0..10);
    let mut columns = good.columns().to_vec();
    columns[0] = Arc::new(Int64Array::from(
        (0..10i64)
            .map(|i| (i != 3 && i != 7).then_some(i))
            .collect::<Vec<_>>(),
    ));
    let schema = Arc::new(arrow_schema_nullable_id(&good));
    let with_nulls = RecordBatch::try_new(schema, columns).unwrap();
    let wrong_type = RecordBatch::try_from_iter(vec![(
        "id",
        Arc::new(StringArray::from(vec!["100", "101"])) as ArrayRef,
    )])
    .unwrap();
    w.write(vec![with_nulls, wrong_type, batch(10..20)])
        .await
        .unwrap();
    let files = w.flush(CheckpointId::new(1)).await.unwrap();
    let mut committer = sink.committer().create(&ctx("c", 1), None).await.unwrap();
    committer.write(files).await.unwrap();
    committer
        .prepare_commit(CheckpointId::new(1))
        .await
        .unwrap();
    committer.commit(CheckpointId::new(1)).await.unwrap();
    let mut want: Vec<i64> = (0..20).filter(|i| *i != 3 && *i != 7).collect();
    want.sort_unstable();
    assert_eq!(ids(&sink.load_table().await.unwrap()).await, want);
}

/// `batch`'s schema with `id` nullable (a source that may produce nulls).
fn arrow_schema_nullable_id(b: &RecordBatch) -> arrow_schema::Schema {
    let fields: Vec<arrow_schema::Field> = b
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone().with_nullable(true))
        .collect();
    arrow_schema::Schema::new(fields)
}

#[tokio::test]
async fn an_unreachable_catalog_is_a_clear_error() {
    let mut c = IcebergSinkConfig::new(
        CatalogConfig::Sql {
            name: "c".into(),
            uri: "postgres://tf:secret@127.0.0.1:1/catalog".into(),
            warehouse: "file:///tmp/tinyflow-unreachable".into(),
            properties: Default::default(),
        },
        NS,
        TABLE,
        "s",
    );
    c.connect_timeout = ms(500);
    let err = load_error(c).await;
    assert!(
        err.contains("127.0.0.1:1") && !err.contains("secret"),
        "{err}"
    );
}

#[tokio::test]
async fn orphans_of_checkpoints_that_never_completed_are_deleted_and_committed_files_kept() {
    let dir = tempfile::tempdir().unwrap();
    orphans_are_deleted(CatalogConfig::sqlite(dir.path())).await;
}

/// The same with the table on S3, listed through S3's API.
#[tokio::test]
async fn orphans_on_s3_storage_are_deleted_and_committed_files_kept() {
    let dir = tempfile::tempdir().unwrap();
    orphans_are_deleted(tinyflow_tests::s3_catalog(dir.path())).await;
}

async fn orphans_are_deleted(catalog: CatalogConfig) {
    let mut d = Driver::new(config_on(catalog, "s")).await;
    d.checkpoint(1, 0..60).await;
    d.commit(1).await.unwrap();
    // Checkpoint 2's files are written, then the process dies before the
    // checkpoint completes.
    d.writer.write(vec![batch(60..90)]).await.unwrap();
    let orphans = d.writer.flush(CheckpointId::new(2)).await.unwrap();
    d.restore(1).await;
    let report = d.sink.delete_orphans(Duration::ZERO).await.unwrap();
    assert_eq!(report.deleted, orphans.len(), "{report:?}");
    let io = d.table().await.file_io().clone();
    for f in &orphans {
        assert!(report.files.contains(&f.path), "{report:?}");
        assert!(!io.exists(&f.path).await.unwrap(), "{} is left", f.path);
    }
    assert!(report.referenced > 0);
    assert_eq!(report.referenced, report.listed - report.deleted);
    for f in data_files(&d.table().await).await {
        assert!(io.exists(&f).await.unwrap(), "committed {f} is gone");
    }
    assert_eq!(ids(&d.table().await).await, range(0..60));
    // A minimum age keeps young files.
    d.writer.write(vec![batch(90..95)]).await.unwrap();
    d.writer.flush(CheckpointId::new(3)).await.unwrap();
    let young = d
        .sink
        .delete_orphans(Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(young.deleted, 0);
    assert!(young.too_young > 0);
}

// ---- through the runtime, read back by pyiceberg ----

pub(crate) const INJECTED: &str = "injected iceberg job failure";

pub(crate) fn quiet_injected_panics() {
    tinyflow_tests::quiet_panics_containing(INJECTED);
}

/// Runs source -> map (panics at the given batch counts) -> iceberg sink.
async fn run_job(
    catalog: &CatalogConfig,
    store: Arc<MemoryCheckpointStore>,
    batches: Vec<Vec<RecordBatch>>,
    panic_at: Vec<u64>,
    writers: usize,
    fault_hook: Option<FaultHook>,
) -> tinyflow_runtime::JobReport {
    quiet_injected_panics();
    let seen = Arc::new(AtomicU64::new(0));
    let fired: Arc<Vec<AtomicBool>> =
        Arc::new(panic_at.iter().map(|_| AtomicBool::new(false)).collect());
    let job = JobBuilder::new(JobId::new("iceberg-e2e").unwrap());
    let stream = job
        .source(
            "batches",
            2,
            VecSource::new(batches).batch_size(1).pause(ms(2)),
        )
        .map("check", move |b: RecordBatch| {
            let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
            for (i, at) in panic_at.iter().enumerate() {
                if n >= *at && !fired[i].swap(true, Ordering::SeqCst) {
                    panic!("{INJECTED} at batch {n}");
                }
            }
            b
        });
    let mut c = config_on(catalog.clone(), "e2e");
    c.fault_hook = fault_hook;
    IcebergSink::new(c)
        .unwrap()
        .attach(stream, "events", writers);
    JobRunner::new(job.build().unwrap(), store, quick_restarts())
        .run()
        .await
        .unwrap()
}

pub(crate) fn batches(
    partitions: usize,
    per: usize,
    rows: i64,
    offset: i64,
) -> Vec<Vec<RecordBatch>> {
    (0..partitions)
        .map(|p| {
            (0..per)
                .map(|k| {
                    let start = offset + ((p * per + k) as i64) * rows;
                    batch(start..start + rows)
                })
                .collect()
        })
        .collect()
}

/// A job stopped on request (what `tinyflow run` does on SIGTERM), whose
/// commit cadence holds commits back for 1000 checkpoints: the checkpoints
/// up to the final one are committed anyway, in one snapshot; the next run
/// commits the rest, each row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_job_commits_what_its_cadence_held_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryCheckpointStore::new());
    let catalog = CatalogConfig::sqlite(dir.path());
    let runner = |stop: StopHandle| {
        let job = JobBuilder::new(JobId::new("iceberg-stop").unwrap());
        // 2 partitions of 100 batches of 10 rows, 10 ms apart: 1 s of input.
        let stream = job.source(
            "batches",
            2,
            VecSource::new(batches(2, 100, 10, 0))
                .batch_size(1)
                .pause(ms(10)),
        );
        let mut c = config_on(catalog.clone(), "stop");
        c.cadence = CommitCadence {
            every_checkpoints: Some(1_000),
            ..CommitCadence::default()
        };
        IcebergSink::new(c).unwrap().attach(stream, "events", 2);
        let config = RuntimeConfig {
            checkpoint: CheckpointConfig {
                interval: Some(ms(50)),
                timeout: ms(20_000),
                ..CheckpointConfig::default()
            },
            ..RuntimeConfig::default()
        };
        JobRunner::new(job.build().unwrap(), store.clone(), config).with_stop(stop)
    };
    let stop = StopHandle::new();
    let first = runner(stop.clone());
    let run = tokio::spawn(async move { first.run().await });
    tokio::time::sleep(ms(400)).await;
    stop.stop();
    let report = run.await.unwrap().unwrap();
    let last = report.final_checkpoint.unwrap();
    let sink = IcebergSink::new(config_on(catalog.clone(), "stop")).unwrap();
    let table = sink.load_table().await.unwrap();
    // The final checkpoint, or the newest before it that had rows (a
    // checkpoint without rows adds no snapshot).
    let committed = committed_id(&table, "stop").expect("the stop committed");
    assert!(committed <= last.get(), "{committed} > {last}");
    assert_eq!(
        snapshots(&table),
        1,
        "one commit: the cadence held the rest"
    );
    let ids_then = ids(&table).await;
    let n = ids_then.len();
    assert!((1..2_000).contains(&n), "{n} rows after the stop");
    let mut unique = ids_then.clone();
    unique.dedup();
    assert_eq!(unique.len(), n, "no row twice");

    let report = runner(StopHandle::new()).run().await.unwrap();
    assert!(report.final_checkpoint.unwrap() > last);
    let table = sink.load_table().await.unwrap();
    assert_eq!(ids(&table).await, range(0..2_000));
}

/// [`jobs_with_failures_then_a_wiped_store`] on the embedded sqlite catalog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_with_failures_leave_every_record_once_as_pyiceberg_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    jobs_with_failures_then_a_wiped_store(CatalogConfig::sqlite(dir.path())).await;
}

/// The same on the SQL catalog in PostgreSQL (a real server, which
/// `cargo xtask ci` starts), as in production.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_with_failures_leave_every_record_once_on_a_postgres_catalog() {
    let dir = tempfile::tempdir().unwrap();
    // A catalog name of its own: the server outlives test runs, and the
    // SQL catalog keeps each catalog's tables apart by name.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let catalog = CatalogConfig::Sql {
        name: format!("pg-{nanos}"),
        uri: tinyflow_tests::postgres_url(),
        warehouse: format!("file://{}", dir.path().join("warehouse").display()),
        properties: Default::default(),
    };
    jobs_with_failures_then_a_wiped_store(catalog).await;
}

/// The same through Apache Iceberg's REST catalog server (a real server,
/// which `cargo xtask ci` starts): the commit's requirements are checked by
/// the server, and pyiceberg reads the table through the same server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_with_failures_leave_every_record_once_on_a_rest_catalog() {
    let _serial = REST_TABLE.lock().await;
    jobs_with_failures_then_a_wiped_store(fresh_rest_catalog().await).await;
}

/// The same with the table's files on S3: a sqlite catalog whose warehouse
/// is a bucket of a real S3 server (S3Proxy, which `cargo xtask ci` starts),
/// written through OpenDAL's S3 client with signed requests; pyiceberg reads
/// the files back through pyarrow's own S3 client. Nothing lands on local
/// disk but the catalog database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_with_failures_leave_every_record_once_on_s3_storage() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = tinyflow_tests::s3_catalog(dir.path());
    let warehouse = catalog.warehouse().unwrap().to_owned();
    jobs_with_failures_then_a_wiped_store(catalog.clone()).await;
    let table = load_table(&catalog, NS, TABLE).await.unwrap();
    let location = table.metadata().location();
    assert!(location.starts_with(&warehouse), "{location}");
    let files = data_files(&table).await;
    assert!(
        !files.is_empty() && files.iter().all(|f| f.starts_with(&warehouse)),
        "{files:?}"
    );
    let local: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(local, ["catalog.db"], "only the catalog is local");
}

/// An S3 store that cannot be reached, or refuses the keys, fails the start
/// with the store's answer and the catalog named; the secret never shows.
#[tokio::test]
async fn an_unreachable_or_refusing_s3_store_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let CatalogConfig::Sql {
        name,
        uri,
        warehouse,
        mut properties,
    } = tinyflow_tests::s3_catalog(dir.path())
    else {
        unreachable!("s3_catalog() is a SQL catalog")
    };
    properties.insert("s3.secret-access-key".into(), "not-the-secret".into());
    let refused = CatalogConfig::Sql {
        name: name.clone(),
        uri: uri.clone(),
        warehouse: warehouse.clone(),
        properties: properties.clone(),
    };
    let err = load_error(config_on(refused, "s")).await;
    assert!(
        err.contains("creating table") && err.contains("403") && !err.contains("not-the-secret"),
        "{err}"
    );
    properties.insert("s3.endpoint".into(), "http://127.0.0.1:1".into());
    let unreachable = CatalogConfig::Sql {
        name,
        uri,
        warehouse,
        properties,
    };
    let err = load_error(config_on(unreachable, "s")).await;
    assert!(
        err.contains("creating table") && err.contains("127.0.0.1:1"),
        "{err}"
    );
}

/// Every data file of the table's current snapshot.
pub(crate) async fn data_files(table: &iceberg::table::Table) -> Vec<String> {
    use futures_util::TryStreamExt;
    table
        .scan()
        .build()
        .unwrap()
        .plan_files()
        .await
        .unwrap()
        .map_ok(|task| task.data_file_path)
        .try_collect()
        .await
        .unwrap()
}

#[tokio::test]
async fn an_unreachable_rest_catalog_is_a_clear_error() {
    let mut c = IcebergSinkConfig::new(
        CatalogConfig::Rest {
            name: "c".into(),
            uri: "http://127.0.0.1:1/catalog".into(),
            warehouse: None,
            properties: [("token".to_owned(), "secret".to_owned())].into(),
        },
        NS,
        TABLE,
        "s",
    );
    c.connect_timeout = ms(2_000);
    let err = load_error(c).await;
    assert!(
        err.contains("REST catalog c at http://127.0.0.1:1/catalog") && !err.contains("secret"),
        "{err}"
    );
}

/// Why loading the sink's table fails (it must).
async fn load_error(config: IcebergSinkConfig) -> String {
    IcebergSink::new(config)
        .unwrap()
        .load_table()
        .await
        .unwrap_err()
        .to_string()
}

/// A whole job with failures at random moments (panics in an operator and
/// crashes in commits), then a second run over a wiped checkpoint store, on
/// `catalog`: pyiceberg reads every id exactly once, the partitions, the
/// summary keys and the table properties.
#[allow(
    clippy::print_stderr,
    reason = "the seed of a failing run must show in its output"
)]
async fn jobs_with_failures_then_a_wiped_store(catalog: CatalogConfig) {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let mut rng = tinyflow_tests::SplitMix64::new(seed);
    let panic_at: Vec<u64> = (0..3).map(|_| 1 + rng.below(100)).collect();
    // Crash the commit once after it landed, once before it reached the catalog.
    let commits = Arc::new(AtomicU32::new(0));
    let crash_after = 1 + rng.below(4) as u32;
    let crash_before = crash_after + 1 + rng.below(4) as u32;
    let counter = Arc::clone(&commits);
    let hook: FaultHook = Arc::new(move |step| {
        let fault = match step {
            CommitStep::BeforeUpdate { attempt: 0 } => {
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                if n == crash_before {
                    Fault::Crash("before".into())
                } else {
                    Fault::Proceed
                }
            }
            CommitStep::AfterUpdate { attempt: 0 }
                if counter.load(Ordering::SeqCst) == crash_after =>
            {
                Fault::Crash("after".into())
            }
            _ => Fault::Proceed,
        };
        Box::pin(async move { fault })
    });
    eprintln!(
        "seed {seed}: panics at batches {panic_at:?}, commit crashes after #{crash_after}, before #{crash_before}"
    );
    let store = Arc::new(MemoryCheckpointStore::new());
    let report = run_job(
        &catalog,
        store,
        batches(4, 40, 25, 0),
        panic_at,
        2,
        Some(hook),
    )
    .await;
    assert!(report.attempts >= 2, "failures were injected: {report:?}");

    let first = IcebergSink::new(config_on(catalog.clone(), "e2e")).unwrap();
    let committed = first.last_committed().await.unwrap().unwrap();
    assert_eq!(
        ids(&first.load_table().await.unwrap()).await,
        range(0..4_000)
    );

    // A wiped checkpoint store: the next run's ids start above what the
    // table holds, so its data is not taken for committed.
    let second = run_job(
        &catalog,
        Arc::new(MemoryCheckpointStore::new()),
        batches(2, 10, 25, 4_000),
        vec![],
        1,
        None,
    )
    .await;
    assert!(second.final_checkpoint.unwrap() > committed);

    let py = tinyflow_tests::pyiceberg_read_catalog(&catalog, &format!("{NS}.{TABLE}"), &[]);
    assert_eq!(py["rows"], 4_500, "{py}");
    assert_eq!(py["distinct_ids"], 4_500);
    assert_eq!(py["id_sum"], (0..4_500i64).sum::<i64>());
    // 3 parts x 2 days x 4 buckets, with the values the transforms give.
    let mut partitions: Vec<(String, String, String)> = py["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let field = |k: &str| {
                p[k].as_str()
                    .unwrap_or_else(|| panic!("{k} in {p}"))
                    .to_owned()
            };
            (field("part"), field("ts_day"), field("id_bucket_4"))
        })
        .collect();
    partitions.sort();
    let mut want = Vec::new();
    for part in ["0", "1", "2"] {
        for day in ["2026-01-01", "2026-01-02"] {
            for bucket in ["0", "1", "2", "3"] {
                want.push((part.to_owned(), day.to_owned(), bucket.to_owned()));
            }
        }
    }
    assert_eq!(partitions, want, "{}", py["partitions"]);
    let snaps = py["snapshots"].as_array().unwrap();
    assert!(!snaps.is_empty());
    let mut last = 0u64;
    let mut epoch = 0u64;
    for s in snaps {
        let epoch_of =
            |s: &serde_json::Value| -> u64 { s[SUMMARY_EPOCH].as_str().unwrap().parse().unwrap() };
        if s.get(SUMMARY_EPOCH_CLAIM).is_some() {
            // A run's claim: epochs grow along the history.
            assert!(epoch_of(s) > epoch, "epochs increase: {py}");
            epoch = epoch_of(s);
            continue;
        }
        // Data comes only from the run holding the newest claim.
        assert_eq!(epoch_of(s), epoch, "a data commit of another epoch: {py}");
        assert_eq!(s[SUMMARY_SINK_ID], "e2e", "{s}");
        let id: u64 = s[SUMMARY_CHECKPOINT_ID].as_str().unwrap().parse().unwrap();
        assert!(
            id > last,
            "checkpoint ids increase along the history (I3): {py}"
        );
        last = id;
    }
    // Each snapshot names where the source stood: the first run's last one
    // the end of its 4 partitions (40 batches each), the second run's last
    // the end of its 2.
    let positions: Vec<serde_json::Value> = snaps
        .iter()
        .filter(|s| s.get(SUMMARY_EPOCH_CLAIM).is_none())
        .map(|s| {
            let json = s[SUMMARY_SOURCE_POSITIONS]
                .as_str()
                .unwrap_or_else(|| panic!("no source positions in {s}"));
            serde_json::from_str(json).unwrap()
        })
        .collect();
    let at = |n: usize, end: usize| {
        let partitions: serde_json::Map<String, serde_json::Value> = (0..n)
            .map(|p| (format!("partition-{p}"), end.to_string().into()))
            .collect();
        serde_json::json!({ "batches": partitions })
    };
    assert!(positions.contains(&at(4, 40)), "{positions:?}");
    assert_eq!(positions.last().unwrap(), &at(2, 10));
    // The same positions in a table property, which snapshot expiry keeps.
    let property: serde_json::Value = serde_json::from_str(
        py["properties"]["tinyflow.sink.e2e.source-positions"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(property, at(2, 10));
    // Two runs, two claims: the second run owns the sink.
    assert_eq!(py["properties"]["tinyflow.sink.e2e.epoch"], "2", "{py}");
    assert_eq!(
        py["properties"]["tinyflow.sink.e2e.checkpoint-id"]
            .as_str()
            .unwrap(),
        last.to_string()
    );
}
