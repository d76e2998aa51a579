//! The commit fault hook, a test seam compiled only with the crate's
//! `testing` feature: a [`FaultHook`] set in `IcebergSinkConfig::fault_hook`
//! is called at each [`CommitStep`] of every commit attempt (inside the
//! guarded catalog, `catalog::GuardedCatalog`) and answers with a [`Fault`]:
//! go on, crash, lose the catalog's answer, or be unreachable. The product
//! build has none of it: no hook, no calls, no injected errors.

use std::sync::Arc;

use futures_util::future::BoxFuture;

/// A step of the commit path, where fault-injection tests can fail or act.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitStep {
    /// The table was refreshed for commit attempt `attempt` (0-based), the
    /// "already committed?" check is about to run against it.
    Refreshed {
        /// The attempt.
        attempt: u32,
    },
    /// The commit of attempt `attempt` is about to reach the catalog.
    BeforeUpdate {
        /// The attempt.
        attempt: u32,
    },
    /// The catalog accepted attempt `attempt`; nothing else knows yet.
    AfterUpdate {
        /// The attempt.
        attempt: u32,
    },
    /// A merge of pending files is about to write its first file.
    MergePlanned,
    /// A merge wrote the files of its first partition, others to go.
    MergeWriting,
    /// A merge wrote every merged file; the commit has not started.
    MergeWritten,
    /// The commit with the merged files is done; the small files they
    /// replace are about to be deleted.
    MergeCommitted,
}

/// What a fault hook does at a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Go on.
    Proceed,
    /// Fail the commit as a crash would: nothing is retried, the sink
    /// reports the error and the job restarts from its last checkpoint.
    Crash(String),
    /// Only at `AfterUpdate`: the catalog's answer is lost; the commit
    /// retries as after a conflict.
    LoseResponse,
    /// Only at `BeforeUpdate`: the catalog is unreachable this time; the
    /// sink's own retries (`commit_attempts`) apply.
    Unavailable,
}

/// A fault-injection hook on the commit path (tests).
pub type FaultHook = Arc<dyn Fn(CommitStep) -> BoxFuture<'static, Fault> + Send + Sync>;
