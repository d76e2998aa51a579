//! The markers by which a sink knows what it committed: the snapshot
//! summary keys and the table properties it writes (the committed
//! checkpoint id, the source positions, the epoch of the run that owns the
//! sink and who claimed it), reading them back from a table, and what a
//! commit attempt concludes from them ([`Observed`]: all committed, partly,
//! fenced, replaced). Pure functions over a loaded table: no catalog calls
//! and no sink configuration. The guarded catalog (`catalog`), the sink's
//! table (`table`), the committer and the recovery checks (`identity`) call
//! them; `config` names its properties with them.

use iceberg::table::Table;
use tinyflow_api::{JobPositions, StreamError, StreamResult};

/// Snapshot summary key: the sink that committed the snapshot.
pub const SUMMARY_SINK_ID: &str = "tinyflow.sink-id";
/// Snapshot summary key: the checkpoint id the snapshot commits up to.
pub const SUMMARY_CHECKPOINT_ID: &str = "tinyflow.checkpoint-id";
/// Snapshot summary key: the event-time watermark (ms since the epoch) the
/// committed data is complete up to.
pub const SUMMARY_WATERMARK: &str = "tinyflow.watermark";
/// Snapshot summary key: where the job's sources stood at the committed
/// checkpoint, as JSON: `{"<source>": {"<topic>/<partition>": "<next
/// offset>", ...}, ...}` for Kafka sources. The committed data holds every
/// record before these positions (and none after, for this sink).
pub const SUMMARY_SOURCE_POSITIONS: &str = "tinyflow.source-positions";
/// Snapshot summary key: the epoch of the run that made the snapshot (its
/// claim, or a commit of its data).
pub const SUMMARY_EPOCH: &str = "tinyflow.epoch";
/// Snapshot summary key of an epoch claim: the sink that claimed. A claim's
/// snapshot adds no files.
pub const SUMMARY_EPOCH_CLAIM: &str = "tinyflow.epoch-claim";

/// Who does something to a table, and when: `pid N on HOST at UNIX-SECONDS`
/// (an epoch's owner, a layout's author).
pub(crate) fn stamp() -> String {
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("{} at {at}", tinyflow_api::util::this_process())
}

/// The JSON value of table property `key` of `table`, read as `T`
/// (`what` names it in the error; `owner` is the sink it belongs to).
pub(crate) fn json_property<T: serde::de::DeserializeOwned>(
    table: &Table,
    key: &str,
    owner: &str,
    what: &str,
) -> StreamResult<Option<T>> {
    let Some(json) = table.metadata().properties().get(key) else {
        return Ok(None);
    };
    serde_json::from_str(json).map(Some).map_err(|e| {
        StreamError::external(
            owner.to_owned(),
            "iceberg",
            format!("reading the table property {key}"),
            format!("not {what} ({e}): {json}"),
            false,
        )
    })
}

/// The table property holding the epoch of the run that owns `sink_id`.
pub fn epoch_property(sink_id: &str) -> String {
    format!("tinyflow.sink.{sink_id}.epoch")
}

/// The table property saying which process claimed `sink_id`'s epoch, and
/// when (`pid N on HOST at UNIX-SECONDS`).
pub(crate) fn epoch_owner_property(sink_id: &str) -> String {
    format!("tinyflow.sink.{sink_id}.epoch-owner")
}

/// The epoch of the run that owns `sink_id` in `table` (0: never claimed).
pub fn table_epoch(table: &Table, sink_id: &str) -> u64 {
    table
        .metadata()
        .properties()
        .get(&epoch_property(sink_id))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Who claimed the epoch of `sink_id` in `table`, if anyone.
pub fn epoch_owner(table: &Table, sink_id: &str) -> Option<String> {
    table
        .metadata()
        .properties()
        .get(&epoch_owner_property(sink_id))
        .cloned()
}

/// The table property that marks `sink_id` retired by a rescale (which
/// layout retired it): a retired sink never claims or commits again.
pub fn retired_property(sink_id: &str) -> String {
    format!("tinyflow.sink.{sink_id}.retired")
}

/// Why `sink_id` is retired in `table`, if it is.
pub fn retired(table: &Table, sink_id: &str) -> Option<String> {
    table
        .metadata()
        .properties()
        .get(&retired_property(sink_id))
        .cloned()
}

/// The table property holding `sink_id`'s last committed checkpoint id.
pub(crate) fn committed_property(sink_id: &str) -> String {
    format!("tinyflow.sink.{sink_id}.checkpoint-id")
}

/// The table property holding the source positions (JSON, as in
/// [`SUMMARY_SOURCE_POSITIONS`]) of the last checkpoint `sink_id`
/// committed; set in the same transaction as `committed_property`, so it
/// survives snapshot expiry too.
pub fn positions_property(sink_id: &str) -> String {
    format!("tinyflow.sink.{sink_id}.source-positions")
}

/// The source positions of the last checkpoint `sink_id` committed to
/// `table` (from [`positions_property`]); `None` when the sink committed
/// none with positions.
pub fn committed_positions(table: &Table, sink_id: &str) -> StreamResult<Option<JobPositions>> {
    json_property(
        table,
        &positions_property(sink_id),
        sink_id,
        "the JSON of source positions",
    )
}

/// The highest checkpoint id `sink_id` committed to `table`: the larger of
/// the table property (which survives snapshot expiry) and the newest
/// snapshot of the sink in the current branch's history.
pub fn committed_id(table: &Table, sink_id: &str) -> Option<u64> {
    let metadata = table.metadata();
    let from_property = metadata
        .properties()
        .get(&committed_property(sink_id))
        .and_then(|v| v.parse::<u64>().ok());
    let from_history = newest_sink_snapshot(table, sink_id).and_then(|(_, checkpoint)| checkpoint);
    from_property.max(from_history)
}

/// The newest snapshot `sink_id` committed in the current branch's history
/// (`None` when expired or never made): its id and the checkpoint id its
/// summary names.
pub(crate) fn newest_sink_snapshot(table: &Table, sink_id: &str) -> Option<(i64, Option<u64>)> {
    let metadata = table.metadata();
    let mut next = metadata.current_snapshot().cloned();
    while let Some(snapshot) = next {
        let props = &snapshot.summary().additional_properties;
        if props.get(SUMMARY_SINK_ID).map(String::as_str) == Some(sink_id) {
            let checkpoint = props
                .get(SUMMARY_CHECKPOINT_ID)
                .and_then(|v| v.parse::<u64>().ok());
            return Some((snapshot.snapshot_id(), checkpoint));
        }
        next = snapshot
            .parent_snapshot_id()
            .and_then(|id| metadata.snapshot_by_id(id).cloned());
    }
    None
}

/// What `table` holds of the checkpoints `low..=high` of `sink_id`: all
/// of them, some of them, or none (`None`).
pub(crate) fn observe(table: &Table, sink_id: &str, low: u64, high: u64) -> Option<Observed> {
    match committed_id(table, sink_id) {
        Some(c) if c >= high => Some(Observed::AlreadyCommitted(c)),
        Some(c) if c >= low => Some(Observed::Partly(c)),
        _ => None,
    }
}

/// What the guard saw on the table refreshed for a commit attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Observed {
    /// The sink already committed up to here, at or above the target: the
    /// commit is done.
    AlreadyCommitted(u64),
    /// The sink committed up to here, inside the pending range: drop the
    /// pending checkpoints up to it and commit the rest.
    Partly(u64),
    /// A fault hook crashed the commit.
    #[cfg(feature = "testing")]
    Crashed,
    /// A newer run claimed the sink: its epoch, and who claimed it.
    Fenced {
        /// The table's epoch.
        epoch: u64,
        /// The claim's owner, as the table says.
        owner: Option<String>,
    },
    /// The table under the name is another one: its uuid.
    Replaced(String),
    /// The table no longer meets a precondition of the commit (why): the
    /// caller decides again on the table as it is now.
    Moved(String),
}

/// This run's claim of a sink: its epoch in the table with that uuid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) epoch: u64,
    pub(crate) uuid: String,
}

/// What a commit attempt requires of the table it is built on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Expect {
    pub(crate) uuid: String,
    pub(crate) epoch: u64,
}

impl From<&Claim> for Expect {
    fn from(claim: &Claim) -> Self {
        Expect {
            uuid: claim.uuid.clone(),
            epoch: claim.epoch,
        }
    }
}

/// Whether `table` is the one `expect` names, owned by its epoch.
pub(crate) fn owned(table: &Table, sink_id: &str, expect: &Expect) -> Option<Observed> {
    let uuid = table.metadata().uuid().to_string();
    if uuid != expect.uuid {
        return Some(Observed::Replaced(uuid));
    }
    let epoch = table_epoch(table, sink_id);
    if retired(table, sink_id).is_some() {
        return Some(Observed::Fenced {
            epoch,
            owner: epoch_owner(table, sink_id),
        });
    }
    (epoch != expect.epoch).then(|| Observed::Fenced {
        epoch,
        owner: epoch_owner(table, sink_id),
    })
}
