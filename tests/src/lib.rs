//! Shared helpers for tinyflow's integration tests: a harness that runs a
//! checkpoint coordinator under tokio's paused clock with fake tasks, and a
//! small seeded random generator for deterministic scenarios, and
//! [`broker::OwnBroker`], a Kafka broker a test may stop and restart.
//!
//! The harness is deliberately thin: tests play the tasks themselves by
//! reading each task's control receiver and sending acks through the
//! coordinator handle, so every step a test asserts is visible in the test.

pub mod broker;
pub mod registry;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tinyflow_api::{CheckpointId, JobId, TaskId};
use tinyflow_checkpoint::testing::{ManualWallClock, MemoryCheckpointStore, control_channel};
use tinyflow_checkpoint::{
    CheckpointConfig, CoordinatorDriver, CoordinatorHandle, DriverConfig, Outcome, Restored,
};
use tinyflow_checkpoint::{CheckpointStore, FromTask, StateHandle, TaskRole, ToTask};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Slack added to waits for a message, see [`Harness::expect`].
pub const GRACE: Duration = Duration::from_millis(1);

/// Milliseconds as a `Duration`.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Checkpoints every `interval_ms` with a generous (60 s) timeout.
pub fn every(interval_ms: u64) -> CheckpointConfig {
    CheckpointConfig {
        interval: Some(ms(interval_ms)),
        timeout: ms(60_000),
        ..CheckpointConfig::default()
    }
}

/// A checkpoint id.
pub fn cid(n: u64) -> CheckpointId {
    CheckpointId::new(n)
}

/// A task id.
pub fn tid(n: u32) -> TaskId {
    TaskId::new(n)
}

/// The job id every test uses.
pub fn job_id() -> JobId {
    JobId::new("test-job").expect("valid job id")
}

/// A fake task as the test sees it.
#[derive(Debug)]
pub struct FakeTask {
    /// Its id.
    pub id: TaskId,
    /// Its control receiver; drop it to simulate a crash.
    pub rx: Option<mpsc::Receiver<ToTask>>,
}

/// How to set up one fake task.
#[derive(Debug, Clone, Copy)]
pub struct TaskSpec {
    /// Its id.
    pub id: u32,
    /// Its role.
    pub role: TaskRole,
    /// Its control channel's capacity.
    pub capacity: usize,
}

impl TaskSpec {
    /// A task of `role` with a roomy channel.
    pub fn new(id: u32, role: TaskRole) -> Self {
        TaskSpec {
            id,
            role,
            capacity: 16,
        }
    }

    /// The same with a channel of `capacity`.
    pub fn capacity(self, capacity: usize) -> Self {
        TaskSpec { capacity, ..self }
    }
}

/// A running coordinator with fake tasks, under the paused clock.
#[derive(Debug)]
pub struct Harness {
    /// How tasks talk to the coordinator.
    pub handle: CoordinatorHandle,
    /// The driver's task; yields its result.
    pub job: JoinHandle<tinyflow_checkpoint::Result<Outcome>>,
    /// The fake tasks, by id.
    pub tasks: BTreeMap<TaskId, FakeTask>,
    /// When the driver started (triggers fall at start + k * interval).
    pub start: Instant,
    /// What the driver found in the store at start.
    pub restored: Restored,
    shutdown: Option<oneshot::Sender<()>>,
    stop: Option<oneshot::Sender<()>>,
}

impl Harness {
    /// Starts a coordinator over `store` and registers `specs`, all at the
    /// same instant.
    pub async fn start(
        config: DriverConfig,
        store: Arc<dyn CheckpointStore>,
        specs: &[TaskSpec],
    ) -> tinyflow_checkpoint::Result<Harness> {
        let clock = Arc::new(ManualWallClock::new(1_700_000_000_000));
        let (driver, handle, restored) = CoordinatorDriver::start(config, store, clock).await?;
        let start = Instant::now();
        let mut tasks = BTreeMap::new();
        for spec in specs {
            let (tx, rx) = control_channel(spec.capacity);
            handle
                .register(tid(spec.id), spec.role, tx)
                .await
                .expect("coordinator running");
            tasks.insert(
                tid(spec.id),
                FakeTask {
                    id: tid(spec.id),
                    rx: Some(rx),
                },
            );
        }
        let (shutdown, shut) = oneshot::channel::<()>();
        let (stop, stopped) = oneshot::channel::<()>();
        let job = tokio::spawn(driver.run_until_stopped(
            async move {
                let _ = shut.await;
            },
            async move {
                // A dropped sender (the harness gone) is no stop request.
                if stopped.await.is_err() {
                    std::future::pending::<()>().await;
                }
            },
        ));
        Ok(Harness {
            handle,
            job,
            tasks,
            start,
            restored,
            shutdown: Some(shutdown),
            stop: Some(stop),
        })
    }

    /// Starts with a fresh in-memory store.
    pub async fn with_memory(
        config: CheckpointConfig,
        specs: &[TaskSpec],
    ) -> (Harness, MemoryCheckpointStore) {
        let store = MemoryCheckpointStore::new();
        let h = Harness::start(
            DriverConfig::new(job_id(), config),
            Arc::new(store.clone()),
            specs,
        )
        .await
        .expect("coordinator starts");
        (h, store)
    }

    /// Time since the driver started.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// The next message for `task`, failing the test if none comes within
    /// `within` (virtual time). A message due exactly at the limit counts:
    /// the wait ends 1 ms later, since under the paused clock the test's
    /// timer and the coordinator's fire at the same instant in either order.
    /// Tests assert exact times with [`elapsed`](Self::elapsed).
    pub async fn expect(&mut self, task: u32, within: Duration) -> ToTask {
        let rx = self.rx(task);
        match tokio::time::timeout(within + GRACE, rx.recv()).await {
            Ok(Some(msg)) => msg,
            Ok(None) => panic!("{} control channel closed", tid(task)),
            Err(_) => panic!("no message for {} within {within:?}", tid(task)),
        }
    }

    /// Asserts `task` receives nothing for `period` (virtual time).
    pub async fn expect_silence(&mut self, task: u32, period: Duration) {
        let rx = self.rx(task);
        if let Ok(msg) = tokio::time::timeout(period, rx.recv()).await {
            panic!(
                "{} received {msg:?} during {period:?} of expected silence",
                tid(task)
            );
        }
    }

    /// Waits for a trigger on `task` and returns its id.
    pub async fn expect_trigger(&mut self, task: u32, within: Duration) -> CheckpointId {
        match self.expect(task, within).await {
            ToTask::TriggerCheckpoint { id, .. } => id,
            other => panic!("{} expected a trigger, got {other:?}", tid(task)),
        }
    }

    /// Expects `NotifyComplete { id }` as the next message of each of
    /// `tasks`, within a millisecond.
    pub async fn expect_notified(&mut self, tasks: &[u32], id: CheckpointId) {
        for &task in tasks {
            assert_eq!(
                self.expect(task, ms(1)).await,
                ToTask::NotifyComplete { id },
                "task {task}"
            );
        }
    }

    /// Acks `id` as `task` with `state`.
    pub async fn ack(&self, task: u32, id: CheckpointId, state: &[u8]) {
        self.send(FromTask::Ack {
            task: tid(task),
            id,
            state: StateHandle::from(state),
        })
        .await;
    }

    /// Sends a task message.
    pub async fn send(&self, msg: FromTask) {
        self.handle.send(msg).await.expect("coordinator running");
    }

    /// Drops `task`'s receiver, as a crash would.
    pub fn crash(&mut self, task: u32) {
        let t = self.tasks.get_mut(&tid(task)).expect("known task");
        t.rx = None;
    }

    /// The receiver of `task`.
    pub fn rx(&mut self, task: u32) -> &mut mpsc::Receiver<ToTask> {
        self.tasks
            .get_mut(&tid(task))
            .and_then(|t| t.rx.as_mut())
            .unwrap_or_else(|| panic!("{} has no receiver", tid(task)))
    }

    /// Asks the job to stop with a final checkpoint (as `tinyflow run` does
    /// on SIGTERM).
    pub fn request_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Stops the driver and returns how it ended.
    pub async fn shutdown(mut self) -> tinyflow_checkpoint::Result<Outcome> {
        if let Some(stop) = self.shutdown.take() {
            let _ = stop.send(());
        }
        self.job.await.expect("driver task did not panic")
    }

    /// Waits for the driver to end on its own.
    pub async fn outcome(self) -> tinyflow_checkpoint::Result<Outcome> {
        let Harness {
            job,
            shutdown,
            stop,
            ..
        } = self;
        let outcome = job.await.expect("driver task did not panic");
        drop((shutdown, stop));
        outcome
    }
}

/// Runs `job` with a fresh in-memory checkpoint store: what most runtime
/// and connector scenarios need.
pub async fn run_in_memory(
    job: tinyflow_api::JobBuilder,
    config: tinyflow_runtime::RuntimeConfig,
) -> Result<tinyflow_runtime::JobReport, tinyflow_runtime::Error> {
    let graph = job.build().expect("the scenario's job graph is valid");
    tinyflow_runtime::JobRunner::new(graph, Arc::new(MemoryCheckpointStore::new()), config)
        .run()
        .await
}

/// SplitMix64: a tiny, seedable generator, so scenarios are reproducible
/// without pulling a random-number crate into the tests.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// The next `len` bytes of the stream.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

/// Silences panics whose message contains `marker` (failures a test injects
/// on purpose); every other panic prints as usual. Each marker is
/// registered once; the hooks chain, so modules can use markers of their
/// own.
pub fn quiet_panics_containing(marker: &'static str) {
    static MARKERS: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut markers = MARKERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if markers.contains(&marker) {
        return;
    }
    markers.push(marker);
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .unwrap_or("");
        if !msg.contains(marker) {
            default(info);
        }
    }));
}

/// pyiceberg's view of the table `table` (`namespace.name`) in the sqlite
/// catalog under `dir`: [`pyiceberg_read_catalog`] of
/// `CatalogConfig::sqlite(dir)`.
///
/// # Panics
/// As [`pyiceberg_read_catalog`].
pub fn pyiceberg_read(dir: &std::path::Path, table: &str, args: &[&str]) -> serde_json::Value {
    pyiceberg_read_catalog(
        &tinyflow_connectors_iceberg::CatalogConfig::sqlite(dir),
        table,
        args,
    )
}

/// pyiceberg's view of the table `table` (`namespace.name`) in a SQL
/// catalog (sqlite or PostgreSQL) or a REST catalog, as `tests/python/read_table.py` prints
/// it; `args` are its optional id and sum columns. The Python is
/// `TINYFLOW_PYTHON`, or the venv `cargo xtask py-setup` makes.
///
/// # Panics
/// When pyiceberg cannot run or fails, or the catalog is an in-memory one:
/// the tests that read tables back need it.
pub fn pyiceberg_read_catalog(
    catalog: &tinyflow_connectors_iceberg::CatalogConfig,
    table: &str,
    args: &[&str],
) -> serde_json::Value {
    pyiceberg_read_dumping(catalog, table, args, &[])
}

/// Every row's values of `columns` of the table `table` (`namespace.name`)
/// in the sqlite catalog under `dir`, as pyiceberg reads them: a list of
/// rows, each a list (binary values as hex strings), in table order.
///
/// # Panics
/// As [`pyiceberg_read_catalog`].
pub fn pyiceberg_rows(
    dir: &std::path::Path,
    table: &str,
    columns: &[&str],
) -> Vec<Vec<serde_json::Value>> {
    let catalog = tinyflow_connectors_iceberg::CatalogConfig::sqlite(dir);
    let rows = pyiceberg_read_dumping(&catalog, table, &[columns[0]], columns)["dump"].take();
    serde_json::from_value(rows).expect("read_table.py dumps a list of rows")
}

fn pyiceberg_read_dumping(
    catalog: &tinyflow_connectors_iceberg::CatalogConfig,
    table: &str,
    args: &[&str],
    dump: &[&str],
) -> serde_json::Value {
    use tinyflow_connectors_iceberg::CatalogConfig;
    let (name, uri, warehouse, properties) = match catalog {
        // sqlx URIs to SQLAlchemy's.
        CatalogConfig::Sql {
            name,
            uri,
            warehouse,
            properties,
        } => {
            let uri = if let Some(path) = uri.strip_prefix("sqlite:") {
                format!("sqlite:///{}", path.split('?').next().unwrap_or(path))
            } else if let Some(rest) = uri.strip_prefix("postgres://") {
                format!("postgresql+psycopg2://{rest}")
            } else {
                uri.clone()
            };
            (name, uri, warehouse.clone(), properties)
        }
        CatalogConfig::Rest {
            name,
            uri,
            warehouse,
            properties,
        } => (
            name,
            uri.clone(),
            warehouse.clone().unwrap_or_default(),
            properties,
        ),
        CatalogConfig::Memory { .. } => {
            panic!("pyiceberg cannot read an in-memory catalog: {catalog:?}")
        }
    };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let py = python();
    let out = std::process::Command::new(&py)
        .arg(root.join("python/read_table.py"))
        .args([name, &uri, &warehouse, table])
        .args(args)
        // The catalog's further properties (`s3.*` for S3 storage): pyiceberg
        // takes the same keys.
        .env(
            "TINYFLOW_CATALOG_PROPERTIES",
            serde_json::to_string(properties).expect("properties are strings"),
        )
        .env("TINYFLOW_DUMP_COLUMNS", dump.join(","))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "pyiceberg is needed: could not run {} ({e}); run `cargo xtask py-setup` \
                 or set TINYFLOW_PYTHON to a python with pyiceberg[sql-sqlite,sql-postgres,pyarrow]",
                py.display()
            )
        });
    assert!(
        out.status.success(),
        "pyiceberg failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("read_table.py prints one JSON object")
}

/// The Python the tests run their Python side with (pyiceberg, the schema
/// registry, Confluent's serializers): `TINYFLOW_PYTHON`, or the venv
/// `cargo xtask py-setup` makes.
pub fn python() -> std::path::PathBuf {
    std::env::var_os("TINYFLOW_PYTHON").map_or_else(
        || {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/pyiceberg-venv/bin/python")
        },
        std::path::PathBuf::from,
    )
}

/// The Iceberg REST catalog server for the REST catalog tests, from
/// `TINYFLOW_REST_CATALOG_URL` (`cargo xtask ci` starts one and sets it).
///
/// # Panics
/// When it is not set: those tests need a real server.
pub fn rest_catalog_url() -> String {
    std::env::var("TINYFLOW_REST_CATALOG_URL").unwrap_or_else(|_| {
        panic!(
            "TINYFLOW_REST_CATALOG_URL is not set: these tests need an Iceberg REST catalog \
             server. Run `cargo xtask ci` (it starts one), or `cargo xtask iceberg-rest start` \
             and export the line it prints"
        )
    })
}

/// The S3 server for the tests of tables on S3 storage, from
/// `TINYFLOW_S3_ENDPOINT` (`cargo xtask ci` starts one and sets it; `cargo
/// xtask s3 start` makes the bucket `tinyflow` and accepts the keys
/// [`S3_ACCESS_KEY`] and [`S3_SECRET_KEY`]).
///
/// # Panics
/// When it is not set: those tests need a real server.
pub fn s3_endpoint() -> String {
    std::env::var("TINYFLOW_S3_ENDPOINT").unwrap_or_else(|_| {
        panic!(
            "TINYFLOW_S3_ENDPOINT is not set: these tests need an S3 server. Run `cargo xtask ci` \
             (it starts one), or `cargo xtask s3 start` and export the line it prints"
        )
    })
}

/// The access key `cargo xtask s3` accepts.
pub const S3_ACCESS_KEY: &str = "tinyflow";
/// The secret key of [`S3_ACCESS_KEY`].
pub const S3_SECRET_KEY: &str = "tinyflow-secret";

/// A sqlite catalog in `dir` whose warehouse is a new prefix (the server
/// outlives test runs) of the bucket `tinyflow` on the [`s3_endpoint`]
/// server, with the `s3.*` properties to reach it.
pub fn s3_catalog(dir: &std::path::Path) -> tinyflow_connectors_iceberg::CatalogConfig {
    let tinyflow_connectors_iceberg::CatalogConfig::Sql { name, uri, .. } =
        tinyflow_connectors_iceberg::CatalogConfig::sqlite(dir)
    else {
        unreachable!("sqlite() is a SQL catalog")
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is past 1970")
        .as_nanos();
    tinyflow_connectors_iceberg::CatalogConfig::Sql {
        name,
        uri,
        warehouse: format!("s3://tinyflow/test-{nanos}/warehouse"),
        properties: s3_properties(),
    }
}

/// The `s3.*` properties that reach the [`s3_endpoint`] server with the
/// keys it accepts.
///
/// # Panics
/// When `TINYFLOW_S3_ENDPOINT` is not set.
pub fn s3_properties() -> std::collections::HashMap<String, String> {
    [
        ("s3.endpoint", s3_endpoint()),
        ("s3.region", "us-east-1".to_owned()),
        // A loopback server: no bucket host names.
        ("s3.path-style-access", "true".to_owned()),
        ("s3.access-key-id", S3_ACCESS_KEY.to_owned()),
        ("s3.secret-access-key", S3_SECRET_KEY.to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// The PostgreSQL server for the SQL catalog tests, from
/// `TINYFLOW_POSTGRES_URL` (`cargo xtask ci` starts one and sets it).
///
/// # Panics
/// When it is not set: those tests need a real server.
pub fn postgres_url() -> String {
    std::env::var("TINYFLOW_POSTGRES_URL").unwrap_or_else(|_| {
        panic!(
            "TINYFLOW_POSTGRES_URL is not set: these tests need a PostgreSQL server. Run \
             `cargo xtask ci` (it starts one), or `cargo xtask postgres start` and export the line it prints"
        )
    })
}
