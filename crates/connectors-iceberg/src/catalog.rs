//! Opening a sink's catalog (SQL, REST or in-memory, over local or S3
//! storage), the mapping of the catalog client's errors, and
//! [`GuardedCatalog`], the catalog every commit goes through, which runs
//! the "already committed?" and "still the owner?" checks on the table each
//! commit attempt is built on. This module talks to the catalog client;
//! what the markers on the table mean is `dedupe`'s, which table a sink
//! writes and how it is created is `table`'s.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[cfg(feature = "testing")]
use futures_util::future::BoxFuture;
use iceberg::io::StorageFactory;
use iceberg::table::Table;
use iceberg::{Catalog, CatalogBuilder, ErrorKind, TableCommit, TableIdent};
use iceberg_catalog_rest::{
    REST_CATALOG_PROP_URI, REST_CATALOG_PROP_WAREHOUSE, RestCatalogBuilder,
};
use iceberg_catalog_sql::{SqlBindStyle, SqlCatalogBuilder};
use iceberg_storage_opendal::OpenDalResolvingStorageFactory;
use tinyflow_api::{StreamError, StreamResult};

use crate::config::CatalogConfig;
use crate::dedupe::{Expect, Observed, observe, owned};
#[cfg(feature = "testing")]
use crate::fault::{CommitStep, Fault, FaultHook};
use crate::local_storage::SyncedLocalStorageFactory;

/// An iceberg client error as a [`StreamError`], retryable when iceberg
/// says so.
pub(crate) fn external(
    operator: &str,
    action: impl Into<String>,
    e: iceberg::Error,
) -> StreamError {
    external_unless(operator, action, e, &[])
}

/// [`external`], also retryable for the error kinds in `passing` (what the
/// caller knows a restart mends at its step, such as I/O trouble).
pub(crate) fn external_unless(
    operator: &str,
    action: impl Into<String>,
    e: iceberg::Error,
    passing: &[iceberg::ErrorKind],
) -> StreamError {
    let retryable = e.retryable() || passing.contains(&e.kind());
    StreamError::external(operator, "iceberg", action, e, retryable)
}

/// `base` stretched by a random factor in 0.5..1.5, so that workers that
/// conflicted on one commit do not retry in step.
pub(crate) fn jitter(base: std::time::Duration) -> std::time::Duration {
    let r = uuid::Uuid::new_v4().as_u128() as u64;
    base.mul_f64(0.5 + (r % 1_000_000) as f64 / 1_000_000.0)
}

/// Waits before trying again a commit that lost a race in round `round`
/// (from 0): 50 ms doubling up to 3.2 s, jittered; says why at info.
pub(crate) async fn pause_after_conflict(round: u32, sink: &str, doing: &str) {
    let pause = jitter(std::time::Duration::from_millis(50) * 2u32.pow(round.min(6)));
    tracing::info!(sink = %sink, pause_ms = pause.as_millis() as u64, "other commits went first; {doing} again");
    tokio::time::sleep(pause).await;
}

/// Whether `e` is a commit that lost a race with another commit (after
/// iceberg's own retries, as many as the table's `commit.retry.*` allow).
pub(crate) fn is_conflict(e: &iceberg::Error) -> bool {
    e.kind() == ErrorKind::CatalogCommitConflicts
}

/// Opens the configured catalog; no answer within `timeout` counts as
/// unreachable (retryable).
pub async fn open_catalog(
    config: &CatalogConfig,
    timeout: std::time::Duration,
) -> StreamResult<Arc<dyn Catalog>> {
    match tokio::time::timeout(timeout, open(config)).await {
        Ok(opened) => opened,
        Err(_) => Err(StreamError::external(
            "iceberg".to_owned(),
            "iceberg",
            format!("opening the {}", config.describe()),
            format!("no answer within {timeout:?}"),
            true,
        )),
    }
}

/// Whether `location` is on S3 (`s3://`, or Hadoop's `s3a://` and `s3n://`
/// spellings), where the sink reads, writes and cleans up through OpenDAL.
pub fn is_s3_location(location: &str) -> bool {
    ["s3://", "s3a://", "s3n://"]
        .iter()
        .any(|scheme| location.starts_with(scheme))
}

/// How the catalog's tables read and write files: for a `file://` warehouse
/// (the default, and the fastest) local files written off the runtime's
/// workers and synced ([`SyncedLocalStorage`](crate::local_storage::SyncedLocalStorage)), else
/// OpenDAL's, which picks S3 or local files by each path's scheme and takes
/// the `s3.*` catalog properties (endpoint, region, keys; without keys, the
/// usual AWS environment variables and profiles).
fn storage_factory(config: &CatalogConfig) -> Arc<dyn StorageFactory> {
    match config.warehouse() {
        Some(w) if is_local_warehouse(w) => Arc::new(SyncedLocalStorageFactory::default()),
        _ => Arc::new(OpenDalResolvingStorageFactory::new()),
    }
}

pub(crate) fn is_local_warehouse(warehouse: &str) -> bool {
    warehouse.starts_with("file:") || warehouse.starts_with('/')
}

async fn open(config: &CatalogConfig) -> StreamResult<Arc<dyn Catalog>> {
    // Output scrubbed with `secrets::scrub` never shows these, even where a
    // catalog client quotes its URI or a property back.
    match config {
        CatalogConfig::Sql {
            uri, properties, ..
        }
        | CatalogConfig::Rest {
            uri, properties, ..
        } => {
            tinyflow_api::secrets::register_settings(
                properties
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .chain([("uri", uri.as_str())]),
            );
        }
        CatalogConfig::Memory { .. } => {}
    }
    let storage = storage_factory(config);
    if let Some(dir) = config.warehouse().and_then(|w| w.strip_prefix("file://")) {
        std::fs::create_dir_all(dir).map_err(|source| StreamError::Io {
            action: "creating the warehouse directory",
            path: dir.into(),
            source,
        })?;
    }
    let opened: iceberg::Result<Arc<dyn Catalog>> = match config {
        CatalogConfig::Sql {
            name,
            uri,
            warehouse,
            properties,
        } => {
            if let Some(path) = uri.strip_prefix("sqlite:") {
                let file = path.split('?').next().unwrap_or(path);
                if let Some(parent) = std::path::Path::new(file).parent()
                    && !parent.as_os_str().is_empty()
                {
                    std::fs::create_dir_all(parent).map_err(|source| StreamError::Io {
                        action: "creating the catalog directory",
                        path: parent.into(),
                        source,
                    })?;
                }
            }
            let bind = if uri.starts_with("sqlite:") {
                SqlBindStyle::QMark
            } else {
                SqlBindStyle::DollarNumeric
            };
            SqlCatalogBuilder::default()
                .uri(uri.clone())
                .warehouse_location(warehouse.clone())
                .sql_bind_style(bind)
                .props(properties.clone())
                .with_storage_factory(storage)
                .load(name.clone(), HashMap::new())
                .await
                .map(|c| Arc::new(c) as Arc<dyn Catalog>)
        }
        CatalogConfig::Rest {
            name,
            uri,
            warehouse,
            properties,
        } => {
            let mut props = properties.clone();
            props.insert(REST_CATALOG_PROP_URI.to_owned(), uri.clone());
            if let Some(warehouse) = warehouse {
                props.insert(REST_CATALOG_PROP_WAREHOUSE.to_owned(), warehouse.clone());
            }
            let catalog = RestCatalogBuilder::default()
                .with_storage_factory(storage)
                .load(name.clone(), props)
                .await;
            // The builder only checks its arguments; a first request shows
            // whether the server answers, so an unreachable catalog fails at
            // start rather than at the first commit.
            match catalog {
                Ok(catalog) => catalog
                    .list_namespaces(None)
                    .await
                    .map(|_| Arc::new(catalog) as Arc<dyn Catalog>),
                Err(e) => Err(e),
            }
        }
        CatalogConfig::Memory { name, warehouse } => {
            iceberg::memory::MemoryCatalogBuilder::default()
                .with_storage_factory(storage)
                .load(
                    name.clone(),
                    HashMap::from([(
                        iceberg::memory::MEMORY_CATALOG_WAREHOUSE.to_owned(),
                        warehouse.clone(),
                    )]),
                )
                .await
                .map(|c| Arc::new(c) as Arc<dyn Catalog>)
        }
    };
    opened.map_err(|e| {
        StreamError::external(
            "iceberg".to_owned(),
            "iceberg",
            format!("opening the {}", config.describe()),
            e,
            true,
        )
    })
}

/// A check of the table a commit attempt is built on: `Some(why)` when the
/// attempt must not go on.
pub(crate) type Precondition<'a> = dyn Fn(&Table) -> Option<String> + Send + Sync + 'a;

/// A catalog that runs the "already committed?" check, and the check that
/// the table is still the one this run owns (uuid and epoch), on the table
/// each commit attempt is built on.
///
/// `Transaction::commit` reloads the table through `load_table`, re-applies
/// its actions on it and sends the result to `update_table` with the
/// requirement that the branch head is still the one it reloaded; a conflict
/// repeats all of that. Checking the sink's committed id on exactly that
/// reloaded table means no attempt, first or retried, can append a
/// checkpoint the table already holds: anything committed after the check
/// moves the head and fails the requirement. The same holds for the owner
/// check: a newer run's claim adds a snapshot, so it moves the head too.
pub(crate) struct GuardedCatalog<'a> {
    pub(crate) inner: &'a dyn Catalog,
    pub(crate) sink_id: &'a str,
    /// The lowest and highest checkpoint ids of this commit (none for a
    /// claim).
    pub(crate) range: Option<(u64, u64)>,
    /// The table and epoch the attempt must be built on.
    pub(crate) expect: Option<Expect>,
    #[cfg(feature = "testing")]
    pub(crate) hook: Option<&'a FaultHook>,
    /// A precondition on every attempt's table: `Some(why)` stops the
    /// commit with [`Observed::Moved`].
    pub(crate) precondition: Option<&'a Precondition<'a>>,
    pub(crate) observed: Mutex<Option<Observed>>,
    #[cfg(feature = "testing")]
    pub(crate) attempts: std::sync::atomic::AtomicU32,
}

impl std::fmt::Debug for GuardedCatalog<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardedCatalog")
            .field("sink_id", &self.sink_id)
            .field("range", &self.range)
            .field("expect", &self.expect)
            .finish()
    }
}

impl<'a> GuardedCatalog<'a> {
    pub(crate) fn new(inner: &'a dyn Catalog, sink_id: &'a str, range: Option<(u64, u64)>) -> Self {
        GuardedCatalog {
            inner,
            sink_id,
            range,
            expect: None,
            precondition: None,
            #[cfg(feature = "testing")]
            hook: None,
            observed: Mutex::new(None),
            #[cfg(feature = "testing")]
            attempts: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// Calls `hook` at each step of every attempt (tests).
    #[cfg(feature = "testing")]
    pub(crate) fn with_hook(mut self, hook: Option<&'a FaultHook>) -> Self {
        self.hook = hook;
        self
    }

    /// Requires every attempt's table to be `expect`'s.
    pub(crate) fn expecting(mut self, expect: Expect) -> Self {
        self.expect = Some(expect);
        self
    }

    /// Requires every attempt's table to meet `check` (`None`: met).
    pub(crate) fn requiring(mut self, check: &'a Precondition<'a>) -> Self {
        self.precondition = Some(check);
        self
    }

    pub(crate) fn observed(&self) -> Option<Observed> {
        self.observed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn stop(&self, seen: Observed, message: String) -> iceberg::Error {
        *self
            .observed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(seen);
        iceberg::Error::new(ErrorKind::PreconditionFailed, message).with_retryable(false)
    }

    #[cfg(feature = "testing")]
    async fn fault(&self, step: CommitStep) -> Fault {
        match self.hook {
            Some(hook) => hook(step).await,
            None => Fault::Proceed,
        }
    }

    #[cfg(feature = "testing")]
    fn attempt(&self) -> u32 {
        self.attempts.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[cfg(feature = "testing")]
fn boxed<'a, T: Send + 'a>(
    f: impl std::future::Future<Output = T> + Send + 'a,
) -> BoxFuture<'a, T> {
    Box::pin(f)
}

/// `impl Catalog for $ty` around a catalog `self.inner`: the methods given
/// (at least `load_table` and `update_table`, which the wrappers change),
/// and every other one passed to `inner` as it is.
macro_rules! catalog_around_inner {
    ($ty:ty { $($own:tt)* }) => {
        #[async_trait::async_trait]
        impl iceberg::Catalog for $ty {
            $($own)*

            async fn list_namespaces(
                &self,
                parent: Option<&iceberg::NamespaceIdent>,
            ) -> iceberg::Result<Vec<iceberg::NamespaceIdent>> {
                self.inner.list_namespaces(parent).await
            }

            async fn create_namespace(
                &self,
                namespace: &iceberg::NamespaceIdent,
                properties: std::collections::HashMap<String, String>,
            ) -> iceberg::Result<iceberg::Namespace> {
                self.inner.create_namespace(namespace, properties).await
            }

            async fn get_namespace(
                &self,
                namespace: &iceberg::NamespaceIdent,
            ) -> iceberg::Result<iceberg::Namespace> {
                self.inner.get_namespace(namespace).await
            }

            async fn namespace_exists(
                &self,
                namespace: &iceberg::NamespaceIdent,
            ) -> iceberg::Result<bool> {
                self.inner.namespace_exists(namespace).await
            }

            async fn update_namespace(
                &self,
                namespace: &iceberg::NamespaceIdent,
                properties: std::collections::HashMap<String, String>,
            ) -> iceberg::Result<()> {
                self.inner.update_namespace(namespace, properties).await
            }

            async fn drop_namespace(&self, namespace: &iceberg::NamespaceIdent) -> iceberg::Result<()> {
                self.inner.drop_namespace(namespace).await
            }

            async fn list_tables(
                &self,
                namespace: &iceberg::NamespaceIdent,
            ) -> iceberg::Result<Vec<iceberg::TableIdent>> {
                self.inner.list_tables(namespace).await
            }

            async fn create_table(
                &self,
                namespace: &iceberg::NamespaceIdent,
                creation: iceberg::TableCreation,
            ) -> iceberg::Result<iceberg::table::Table> {
                self.inner.create_table(namespace, creation).await
            }

            async fn drop_table(&self, table: &iceberg::TableIdent) -> iceberg::Result<()> {
                self.inner.drop_table(table).await
            }

            async fn purge_table(&self, table: &iceberg::TableIdent) -> iceberg::Result<()> {
                self.inner.purge_table(table).await
            }

            async fn table_exists(&self, table: &iceberg::TableIdent) -> iceberg::Result<bool> {
                self.inner.table_exists(table).await
            }

            async fn rename_table(
                &self,
                src: &iceberg::TableIdent,
                dest: &iceberg::TableIdent,
            ) -> iceberg::Result<()> {
                self.inner.rename_table(src, dest).await
            }

            async fn register_table(
                &self,
                table: &iceberg::TableIdent,
                metadata_location: String,
            ) -> iceberg::Result<iceberg::table::Table> {
                self.inner.register_table(table, metadata_location).await
            }
        }
    };
}
pub(crate) use catalog_around_inner;

crate::catalog::catalog_around_inner!(GuardedCatalog<'_> {
    /// The refresh of a commit attempt: the dedupe check runs here.
    async fn load_table(&self, ident: &TableIdent) -> iceberg::Result<Table> {
        let table = self.inner.load_table(ident).await?;
        #[cfg(feature = "testing")]
        let attempt = self.attempt();
        #[cfg(feature = "testing")]
        if let Fault::Crash(why) = boxed(self.fault(CommitStep::Refreshed { attempt })).await {
            return Err(self.stop(Observed::Crashed, why));
        }
        if let Some(expect) = &self.expect
            && let Some(seen) = owned(&table, self.sink_id, expect)
        {
            let message = format!(
                "sink {} no longer owns the table (epoch {}): {seen:?}",
                self.sink_id, expect.epoch
            );
            return Err(self.stop(seen, message));
        }
        if let Some(why) = self.precondition.and_then(|check| check(&table)) {
            return Err(self.stop(Observed::Moved(why.clone()), why));
        }
        let Some((low, high)) = self.range else {
            return Ok(table);
        };
        match observe(&table, self.sink_id, low, high) {
            Some(seen) => {
                let message = format!(
                    "sink {} already committed {seen:?} of checkpoints {low}..={high}",
                    self.sink_id
                );
                Err(self.stop(seen, message))
            }
            None => Ok(table),
        }
    }

    async fn update_table(&self, commit: TableCommit) -> iceberg::Result<Table> {
        #[cfg(feature = "testing")]
        let attempt = self
            .attempts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        #[cfg(feature = "testing")]
        match boxed(self.fault(CommitStep::BeforeUpdate { attempt })).await {
            Fault::Crash(why) => return Err(self.stop(Observed::Crashed, why)),
            Fault::Unavailable => {
                return Err(iceberg::Error::new(
                    ErrorKind::Unexpected,
                    "injected: the catalog is unreachable",
                ));
            }
            Fault::Proceed | Fault::LoseResponse => {}
        }
        let labels = [("sink", self.sink_id.to_owned())];
        metrics::counter!("tinyflow_iceberg_commit_attempts_total", &labels).increment(1);
        let table = match self.inner.update_table(commit).await {
            Ok(t) => t,
            Err(e) => {
                if is_conflict(&e) {
                    metrics::counter!("tinyflow_iceberg_commit_conflicts_total", &labels)
                        .increment(1);
                }
                return Err(e);
            }
        };
        #[cfg(feature = "testing")]
        match boxed(self.fault(CommitStep::AfterUpdate { attempt })).await {
            Fault::Proceed | Fault::Unavailable => {}
            Fault::Crash(why) => return Err(self.stop(Observed::Crashed, why)),
            Fault::LoseResponse => {
                return Err(iceberg::Error::new(
                    ErrorKind::CatalogCommitConflicts,
                    "injected: the catalog's answer was lost",
                )
                .with_retryable(true));
            }
        }
        Ok(table)
    }
});
/// A tokio runtime of one thread named `name`, made once in `cell` and
/// shared by every sink of the process: commits, merges and table
/// maintenance each run on one of their own, so that they neither queue
/// behind the job's busy workers nor hold them up. `None` when no thread
/// could be made (a process at its limit): the work then runs on the
/// job's runtime, as the warning says once.
pub(crate) fn own_thread(
    cell: &'static std::sync::OnceLock<Option<tokio::runtime::Runtime>>,
    name: &'static str,
) -> Option<&'static tokio::runtime::Runtime> {
    cell.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(name)
            .enable_all()
            .build()
            .inspect_err(|e| tracing::warn!(thread = name, error = %e, "no thread of its own; this work runs on the job's runtime"))
            .ok()
    })
    .as_ref()
}
