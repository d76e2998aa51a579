//! The table is the truth: what a committer's checkpoint records about the
//! table it was written for, the checks that refuse a table that is not
//! that table or not in the state the checkpoint saw, and the check that a
//! recovered checkpoint's data files are still there.
//!
//! A checkpoint's committer state carries an [`Identity`]: the table's
//! uuid, the sink id, the epoch of the run, and the last commit of the sink
//! the committer knew of (checkpoint id, snapshot id, source positions).
//! At recovery, before anything is committed, [`check`] compares it with
//! the table; at every commit the guard compares the uuid and the epoch on
//! the table each commit attempt is built on (see `catalog::GuardedCatalog`).

use std::collections::BTreeMap;

use iceberg::table::Table;
use serde::{Deserialize, Serialize};
use tinyflow_api::{JobPositions, StreamError, StreamResult};

use crate::catalog::external;
use crate::dedupe::{committed_id, committed_positions, newest_sink_snapshot};
use crate::writer::DataFileMeta;

/// The table a committer's checkpoint was written for, and the last commit
/// of the sink it knew of when the checkpoint was taken.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The table's uuid (from its metadata; a table created again under
    /// the same name has another).
    pub table_uuid: String,
    /// The sink id.
    pub sink_id: String,
    /// The epoch the run that took the checkpoint had claimed.
    pub epoch: u64,
    /// The highest checkpoint id of the sink in the table, as known.
    pub committed: Option<u64>,
    /// The snapshot that committed it, when this lineage made it.
    pub committed_snapshot: Option<i64>,
    /// The source positions that commit recorded.
    pub committed_positions: JobPositions,
}

/// Why a restored checkpoint does not fit the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// Another table under the same name: dropped and created again, or a
    /// new catalog.
    Replaced {
        /// The uuid the checkpoint was written for.
        expected: String,
        /// The table's uuid.
        found: String,
    },
    /// The table lost commits the checkpoint saw: restored from an older
    /// backup, or its history rolled back.
    Behind {
        /// The sink's last checkpoint in the table.
        table: Option<u64>,
        /// The sink's last commit the checkpoint saw.
        seen: u64,
    },
    /// The table holds a commit of the sink that the checkpoint neither
    /// made nor holds: another run of the sink wrote it.
    Ahead {
        /// The sink's last checkpoint in the table.
        table: u64,
        /// The checkpoint being restored.
        restored: u64,
    },
    /// The table's last commit of the sink is not the one the checkpoint
    /// recorded under that id (other source positions, another snapshot):
    /// another run committed under the same checkpoint id.
    Diverged {
        /// The checkpoint id both claim.
        checkpoint: u64,
        /// What differs.
        what: String,
    },
}

impl Mismatch {
    /// What differs, for an operator, without the ways out.
    pub fn describe(&self, table: &str) -> String {
        match self {
            Mismatch::Replaced { expected, found } => format!(
                "{table} is not the table the checkpoint was written for: its uuid is {found}, the checkpoint's table was {expected} (the table was dropped and created again, or the catalog was replaced); committing the checkpoint's files would write again what the old table held"
            ),
            Mismatch::Behind { table: t, seen } => format!(
                "{table} lost commits of this sink: the checkpoint saw checkpoint {seen} committed, the table's last is {} (the catalog or the table was restored from an older backup); the data of the lost commits is no longer in the table",
                t.map_or_else(|| "none".to_owned(), |t| t.to_string())
            ),
            Mismatch::Ahead { table: t, restored } => format!(
                "{table} holds checkpoint {t} of this sink, which checkpoint {restored} being restored neither committed nor holds: another run of the sink wrote to the table after this checkpoint was taken"
            ),
            Mismatch::Diverged { checkpoint, what } => format!(
                "{table}'s commit of checkpoint {checkpoint} of this sink is not the one the checkpoint recorded ({what}): another run of the sink committed under the same checkpoint id"
            ),
        }
    }
}

/// What a user can do about a job whose state disagrees with its table.
pub const WAYS_OUT: &str = "nothing was committed. Ways out: `tinyflow reset JOB.toml` starts the job again from what the table holds (its sources from the positions of the table's last commit of this sink, or from source.start when it has none; `tinyflow inspect JOB.toml` shows both sides first), or a new sink id with an empty checkpoint directory writes the table anew from source.start";

/// Checks a restored committer state against the table: the same table
/// (uuid), and the sink's last commit in the table one the checkpoint knows
/// (the one it saw, or one of its pending checkpoints, committed after it
/// was taken), with the same source positions and snapshot.
///
/// `pending` holds the restored pending checkpoints' source positions by
/// id, `restored` is the checkpoint being restored.
pub fn check(
    table: &Table,
    identity: &Identity,
    pending: &BTreeMap<u64, JobPositions>,
    restored: u64,
) -> Result<(), Mismatch> {
    let found = table.metadata().uuid().to_string();
    if found != identity.table_uuid {
        return Err(Mismatch::Replaced {
            expected: identity.table_uuid.clone(),
            found,
        });
    }
    let sink = identity.sink_id.as_str();
    let in_table = committed_id(table, sink);
    let seen = identity.committed.unwrap_or(0);
    let t = in_table.unwrap_or(0);
    if t < seen {
        return Err(Mismatch::Behind {
            table: in_table,
            seen,
        });
    }
    if t == 0 {
        return Ok(());
    }
    let recorded = if t == seen {
        &identity.committed_positions
    } else {
        match pending.get(&t) {
            Some(positions) if t <= restored => positions,
            _ => return Err(Mismatch::Ahead { table: t, restored }),
        }
    };
    // Positions are what a commit is about: equal positions mean the table
    // holds exactly the records the checkpoint expects it to.
    if !recorded.is_empty()
        && let Ok(Some(positions)) = committed_positions(table, sink)
        && positions != *recorded
    {
        return Err(Mismatch::Diverged {
            checkpoint: t,
            what: format!(
                "source positions {} in the table, {} in the checkpoint",
                positions_text(&positions),
                positions_text(recorded)
            ),
        });
    }
    if t == seen
        && let Some(expected) = identity.committed_snapshot
        && let Some(snapshot) = sink_snapshot(table, sink, t)
        && snapshot != expected
    {
        return Err(Mismatch::Diverged {
            checkpoint: t,
            what: format!("snapshot {snapshot} in the table, {expected} in the checkpoint"),
        });
    }
    Ok(())
}

/// The id of the newest snapshot in the current branch's history that
/// `sink_id` committed, when it committed checkpoint `checkpoint` (`None`
/// when expired).
pub(crate) fn sink_snapshot(table: &Table, sink_id: &str, checkpoint: u64) -> Option<i64> {
    newest_sink_snapshot(table, sink_id)
        .filter(|(_, c)| *c == Some(checkpoint))
        .map(|(id, _)| id)
}

/// `topic/partition@offset, ...` over every source.
pub fn positions_text(positions: &JobPositions) -> String {
    let parts: Vec<String> = positions
        .values()
        .flat_map(|p| p.iter().map(|(k, v)| format!("{k}@{v}")))
        .collect();
    if parts.is_empty() {
        "none".to_owned()
    } else {
        parts.join(", ")
    }
}

/// Checks that every file exists with the size it was written with: one
/// metadata request per file (a `stat`, or an S3 `HEAD`), before a
/// recovered checkpoint's files are committed. A missing or changed file is
/// a [`StreamError::StateMismatch`] naming it: committing it would leave a
/// table no engine can read. Trouble reaching the storage is retryable.
pub(crate) async fn verify_files<'a>(
    table: &Table,
    label: &str,
    files: impl IntoIterator<Item = (u64, &'a DataFileMeta)>,
) -> StreamResult<usize> {
    let io = table.file_io();
    let mut checked = 0;
    for (checkpoint, f) in files {
        let input = io
            .new_input(&f.path)
            .map_err(|e| external(label, format!("checking data file {}", f.path), e))?;
        let problem = match input.metadata().await {
            Ok(m) if m.size == f.bytes => None,
            Ok(m) => Some(format!(
                "is {} bytes, but was written with {}",
                m.size, f.bytes
            )),
            Err(e) => match io.exists(&f.path).await {
                Ok(false) => Some(format!(
                    "is missing (it was written with {} bytes)",
                    f.bytes
                )),
                Ok(true) | Err(_) => {
                    return Err(external(label, format!("checking data file {}", f.path), e));
                }
            },
        };
        if let Some(problem) = problem {
            return Err(StreamError::StateMismatch {
                operator: label.to_owned(),
                target: format!("table {}", table.identifier()),
                message: format!(
                    "data file {} of checkpoint {checkpoint} {problem}: the warehouse lost it after the checkpoint was taken, and committing it would leave a table no engine can read; {WAYS_OUT}",
                    f.path
                ),
            });
        }
        checked += 1;
    }
    Ok(checked)
}

/// A committer's checkpoint state as tools show it (`tinyflow inspect`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitterView {
    /// The table it was written for (`None`: written by an earlier
    /// tinyflow, before identities).
    pub identity: Option<Identity>,
    /// Its pending checkpoints by id.
    pub pending: BTreeMap<u64, PendingView>,
}

/// One pending checkpoint of a committer's state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingView {
    /// Data files.
    pub files: usize,
    /// Where they are.
    pub paths: Vec<String>,
    /// Rows in them.
    pub records: u64,
    /// Where the sources stood at its barrier.
    pub positions: JobPositions,
}

impl CommitterView {
    /// Decodes the committer's state from a checkpoint.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let state = crate::committer::State::decode(bytes)?;
        let pending = state
            .pending
            .into_iter()
            .map(|(id, s)| {
                let view = PendingView {
                    files: s.files.len(),
                    paths: s.files.iter().map(|f| f.path.clone()).collect(),
                    records: s.files.iter().map(|f| f.records).sum(),
                    positions: s.positions,
                };
                (id, view)
            })
            .collect();
        Ok(CommitterView {
            identity: state.identity,
            pending,
        })
    }

    /// Whether restoring it as checkpoint `checkpoint` would be refused by
    /// `table`, and why (what the committer checks at recovery; a state
    /// without identity is not checked).
    pub fn check(&self, table: &Table, checkpoint: u64) -> Result<(), Mismatch> {
        let Some(identity) = &self.identity else {
            return Ok(());
        };
        let positions = self
            .pending
            .iter()
            .map(|(id, p)| (*id, p.positions.clone()))
            .collect();
        check(table, identity, &positions, checkpoint)
    }
}
