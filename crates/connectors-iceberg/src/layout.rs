//! A job spread over workers (processes on any machines): the table
//! records the job's *layout* (how many workers, in which generation),
//! each worker commits with a sink id of its own, and a rescale retires the
//! old layout's sink ids in the same commit that records where the new
//! layout starts. No coordinator besides the catalog: its optimistic
//! concurrency orders the workers' commits, and the table's epochs fence.
//!
//! The markers, all table properties of the job's base sink id `S`:
//! - `tinyflow.layout.S`: the layout record (JSON: generation, workers,
//!   the layout it replaced, who set it and when);
//! - `tinyflow.layout.S.start-positions`: where the generation's workers
//!   start (JSON source positions, as a commit's): every old worker's last
//!   committed positions, merged over the previous start;
//! - `tinyflow.sink.<id>.retired`: an old sink id retired by a rescale (its
//!   epoch is raised in the same commit). A retired id never commits or
//!   claims again.
//!
//! Worker `I` of `N` in generation `G` commits as `S.wI-of-N.gG`. The
//! generation is new at every rescale, so a sink id is never reused by a
//! later layout (its old commits could otherwise be taken for the new
//! one's).

use std::collections::HashMap;

use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use serde::{Deserialize, Serialize};
use tinyflow_api::{JobPositions, RescaleFrom, StreamError, StreamResult, Worker, merge_positions};

use crate::catalog::{GuardedCatalog, external, is_conflict, pause_after_conflict};
use crate::dedupe::{
    Observed, committed_id, committed_positions, epoch_owner_property, epoch_property,
    json_property, retired_property, table_epoch,
};
use crate::table::SinkTable;

/// Snapshot summary key of a layout switch: the base sink id whose layout
/// changed. The snapshot adds no files.
pub const SUMMARY_LAYOUT_SWITCH: &str = "tinyflow.layout-switch";

/// The table property holding the layout record of the job whose base sink
/// id is `base`.
pub fn layout_property(base: &str) -> String {
    format!("tinyflow.layout.{base}")
}

/// The table property holding where the workers of the current layout
/// start (JSON source positions).
pub fn layout_start_property(base: &str) -> String {
    format!("tinyflow.layout.{base}.start-positions")
}

/// How a job is spread: `workers` workers, in generation `generation` (1
/// for the first layout, one more at each rescale).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Counts the layouts of the job, from 1.
    pub generation: u64,
    /// How many workers.
    pub workers: u32,
}

impl Layout {
    /// The sink id of worker `index` of this layout under the base `base`.
    ///
    /// ```
    /// use tinyflow_connectors_iceberg::Layout;
    /// let l = Layout { generation: 2, workers: 3 };
    /// assert_eq!(l.sink_id("bids", 1), "bids.w1-of-3.g2");
    /// ```
    pub fn sink_id(&self, base: &str, index: u32) -> String {
        format!("{base}.w{index}-of-{}.g{}", self.workers, self.generation)
    }

    /// The sink ids of all its workers.
    pub fn sink_ids(&self, base: &str) -> Vec<String> {
        (0..self.workers).map(|i| self.sink_id(base, i)).collect()
    }
}

/// The layout record a table holds (`tinyflow.layout.<base>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutRecord {
    /// The layout.
    #[serde(flatten)]
    pub layout: Layout,
    /// The layout it replaced; `None` when it replaced the job in one
    /// process (sink id `base`), or nothing.
    pub previous: Option<Layout>,
    /// Who set it, and when (`pid N on HOST at UNIX-SECONDS`).
    pub set_by: String,
}

/// The layout record of `base` in `table`, if the job was ever spread over
/// workers.
pub fn table_layout(table: &Table, base: &str) -> StreamResult<Option<LayoutRecord>> {
    json_property(table, &layout_property(base), base, "a layout record")
}

/// Where the current layout's workers of `base` start.
pub fn layout_start(table: &Table, base: &str) -> StreamResult<Option<JobPositions>> {
    json_property(
        table,
        &layout_start_property(base),
        base,
        "the JSON of source positions",
    )
}

/// Where worker `index` of `layout` starts when it has no checkpoint: its
/// own last commit's positions over the layout's start (its own win: they
/// began there).
pub fn worker_start(
    table: &Table,
    base: &str,
    layout: Layout,
    index: u32,
) -> StreamResult<Option<JobPositions>> {
    let start = layout_start(table, base)?;
    let own = committed_positions(table, &layout.sink_id(base, index))?;
    Ok(match (start, own) {
        (None, None) => None,
        (Some(p), None) | (None, Some(p)) => Some(p),
        (Some(mut start), Some(own)) => {
            merge_positions(&mut start, own);
            Some(start)
        }
    })
}

/// A worker's place in its job's layout, as [`IcebergSink::join_layout`](crate::IcebergSink::join_layout)
/// found or made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    /// The layout the worker belongs to.
    pub layout: Layout,
    /// The worker's sink id.
    pub sink_id: String,
    /// Whether this worker switched the table to the layout (a rescale, or
    /// the job's first layout).
    pub switched: bool,
    /// The sink ids this worker's switch retired.
    pub retired: Vec<String>,
}

/// What a worker does on the layout a table holds.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Decision {
    /// The table's layout is the worker's: join it.
    Join(Layout),
    /// Switch the table to a new layout, retiring these sink ids.
    Switch {
        to: Layout,
        previous: Option<Layout>,
        retire: Vec<String>,
    },
    /// Refused: why.
    Refuse(String),
}

/// What worker `worker` (started with `rescale_from`) does on `current`,
/// the table's layout of `base`; `legacy`: the job in one process (sink id
/// `base`) committed to the table.
fn decide(
    base: &str,
    current: Option<&LayoutRecord>,
    legacy: bool,
    worker: Worker,
    rescale_from: Option<RescaleFrom>,
) -> Decision {
    let n = worker.count();
    match current {
        // The table's layout is the worker's (also for the other workers of
        // a rescale, once the first switched).
        Some(record) if record.layout.workers == n => Decision::Join(record.layout),
        Some(record) => {
            let named = RescaleFrom {
                workers: record.layout.workers,
                generation: Some(record.layout.generation),
            };
            if rescale_from == Some(named) {
                return Decision::Switch {
                    to: Layout {
                        generation: record.layout.generation + 1,
                        workers: n,
                    },
                    previous: Some(record.layout),
                    retire: record.layout.sink_ids(base),
                };
            }
            let told = match rescale_from {
                Some(rf) => format!(" with --rescale-from {rf}"),
                None => String::new(),
            };
            Decision::Refuse(format!(
                "this worker was started as {worker}{told}, but the table's layout of sink `{base}` is {} workers (generation {}, set by {}); start it as I/{} like the others, or, to rescale from that layout to {n} workers, start every worker of the new layout with --rescale-from {named} (TINYFLOW_RESCALE_FROM={named})",
                record.layout.workers,
                record.layout.generation,
                record.set_by,
                record.layout.workers,
            ))
        }
        // The job in one process wrote the table: its positions move to
        // the workers; going from one process to one worker needs no word.
        None if legacy => {
            let single = RescaleFrom {
                workers: 1,
                generation: None,
            };
            if rescale_from == Some(single) || (n == 1 && rescale_from.is_none()) {
                Decision::Switch {
                    to: Layout {
                        generation: 1,
                        workers: n,
                    },
                    previous: None,
                    // Fences the run of the job in one process, if live.
                    retire: vec![base.to_owned()],
                }
            } else {
                Decision::Refuse(format!(
                    "this worker was started as {worker}, but the job ran in one process (sink `{base}`) so far; to spread it over {n} workers, start every worker with --rescale-from 1 (TINYFLOW_RESCALE_FROM=1)"
                ))
            }
        }
        // A table the job never wrote: a first layout needs no word, and a
        // rescale from a layout the table does not have is a mistake (a
        // typo in the sink id or the table would start from scratch).
        None => match rescale_from {
            None => Decision::Switch {
                to: Layout {
                    generation: 1,
                    workers: n,
                },
                previous: None,
                retire: vec![base.to_owned()],
            },
            Some(rf) => Decision::Refuse(format!(
                "this worker was started with --rescale-from {rf}, but the table has no layout of sink `{base}` and no commit of it: there is nothing to rescale from (is sink_id or the table misspelled?); a new job's workers start without --rescale-from"
            )),
        },
    }
}

impl SinkTable {
    /// Finds or makes worker `worker`'s place in the layout of this sink
    /// (whose sink id is the job's base): joins the table's layout when it
    /// has `worker.count()` workers; else, when `rescale_from` names the
    /// table's layout (or the table has no layout yet), switches the
    /// table to a new generation in one commit that retires every old sink
    /// id (raising its epoch, so an old worker still running is fenced
    /// inside its next commit) and records the new layout's start: the old
    /// workers' last committed positions merged over the old start. Else
    /// refuses with a [`StreamError::Config`] that names the conflict.
    pub(crate) async fn join_layout(
        &self,
        worker: Worker,
        rescale_from: Option<RescaleFrom>,
    ) -> StreamResult<Joined> {
        let base = self.config.sink_id.clone();
        let label = self.label();
        for round in 0..10u32 {
            let table = self.load().await?;
            let current = table_layout(&table, &base)?;
            let legacy = committed_id(&table, &base).is_some()
                || committed_positions(&table, &base)?.is_some();
            let (to, previous, retire) =
                match decide(&base, current.as_ref(), legacy, worker, rescale_from) {
                    Decision::Join(layout) => {
                        return Ok(Joined {
                            layout,
                            sink_id: layout.sink_id(&base, worker.index()),
                            switched: false,
                            retired: Vec::new(),
                        });
                    }
                    Decision::Refuse(message) => {
                        return Err(StreamError::Config {
                            key: "--worker",
                            message,
                        });
                    }
                    Decision::Switch {
                        to,
                        previous,
                        retire,
                    } => (to, previous, retire),
                };
            // The old workers' last positions, over where they started.
            let mut start = layout_start(&table, &base)?.unwrap_or_default();
            let mut seen = HashMap::new();
            for id in &retire {
                if let Some(p) = committed_positions(&table, id)? {
                    merge_positions(&mut start, p);
                }
                seen.insert(
                    id.clone(),
                    (table_epoch(&table, id), committed_id(&table, id)),
                );
            }
            let set_by = crate::dedupe::stamp();
            let record = LayoutRecord {
                layout: to,
                previous,
                set_by: set_by.clone(),
            };
            let tx = Transaction::new(&table);
            let append = tx.fast_append().set_snapshot_properties(HashMap::from([(
                SUMMARY_LAYOUT_SWITCH.to_owned(),
                base.clone(),
            )]));
            let tx = append
                .apply(tx)
                .map_err(|e| external(&label, "building the layout switch", e))?;
            let mut props = tx
                .update_table_properties()
                .set(layout_property(&base), to_json(&record))
                .set(layout_start_property(&base), to_json(&start));
            let retired_by = format!(
                "layout generation {} of {} workers, set by {set_by}",
                to.generation, to.workers
            );
            for (id, (epoch, _)) in &seen {
                props = props
                    .set(epoch_property(id), (epoch + 1).to_string())
                    .set(epoch_owner_property(id), format!("retired by {retired_by}"))
                    .set(retired_property(id), retired_by.clone());
            }
            let tx = props
                .apply(tx)
                .map_err(|e| external(&label, "building the layout switch", e))?;
            let (was, base_ref, seen_ref) = (current.clone(), &base, &seen);
            let unchanged = move |t: &Table| -> Option<String> {
                let now = table_layout(t, base_ref).ok().flatten();
                if now != was {
                    return Some(format!("the layout of sink {base_ref} changed meanwhile"));
                }
                seen_ref
                    .iter()
                    .find(|(id, (epoch, committed))| {
                        table_epoch(t, id) != *epoch || committed_id(t, id) != *committed
                    })
                    .map(|(id, _)| format!("sink {id} committed or was claimed meanwhile"))
            };
            let catalog = self.catalog().await?;
            let guard = GuardedCatalog::new(catalog.as_ref(), &base, None).requiring(&unchanged);
            #[cfg(feature = "testing")]
            let guard = guard.with_hook(self.config.fault_hook.as_ref());
            match tx.commit(&guard).await {
                Ok(_) => {
                    let mut retired: Vec<String> = seen.into_keys().collect();
                    retired.sort();
                    tracing::info!(
                        sink = %base,
                        generation = to.generation,
                        workers = to.workers,
                        previous = ?previous,
                        retired = ?retired,
                        start = %to_json(&start),
                        "switched the table to a new layout of workers: the old sink ids are retired and fenced"
                    );
                    return Ok(Joined {
                        layout: to,
                        sink_id: to.sink_id(&base, worker.index()),
                        switched: true,
                        retired,
                    });
                }
                Err(e) => match guard.observed() {
                    Some(Observed::Moved(why)) => {
                        tracing::info!(sink = %base, why = %why, "the table moved while switching its layout; deciding again");
                    }
                    None if is_conflict(&e) => {
                        pause_after_conflict(round, &base, "switching the layout").await;
                    }
                    _ => return Err(external(&label, "switching the layout of workers", e)),
                },
            }
        }
        Err(StreamError::external(
            label,
            "iceberg",
            "switching the layout of workers".to_owned(),
            "the table moved ten times in a row while this worker tried".to_owned(),
            true,
        ))
    }
}

/// JSON of a value, for a table property (serialising these plain structs
/// and maps cannot fail).
fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn record(generation: u64, workers: u32) -> LayoutRecord {
        LayoutRecord {
            layout: Layout {
                generation,
                workers,
            },
            previous: None,
            set_by: "pid 1 on h at 0".to_owned(),
        }
    }

    fn w(s: &str) -> Worker {
        s.parse().unwrap()
    }

    fn from(s: &str) -> Option<RescaleFrom> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn a_worker_joins_its_layout_switches_when_told_and_is_refused_otherwise() {
        let three = record(4, 3);
        assert_eq!(
            decide("s", Some(&three), true, w("1/3"), None),
            Decision::Join(three.layout)
        );
        // --rescale-from on a table already switched: just join.
        assert_eq!(
            decide("s", Some(&three), true, w("1/3"), from("2@3")),
            Decision::Join(three.layout)
        );
        assert_eq!(
            decide("s", Some(&three), true, w("0/2"), from("3@4")),
            Decision::Switch {
                to: Layout {
                    generation: 5,
                    workers: 2
                },
                previous: Some(three.layout),
                retire: vec![
                    "s.w0-of-3.g4".to_owned(),
                    "s.w1-of-3.g4".to_owned(),
                    "s.w2-of-3.g4".to_owned()
                ],
            }
        );
        // Different counts without the word, with the wrong one, or with
        // a count alone: a worker of an old layout after a rescale (which
        // must never rescale the table back), or a typo.
        for told in [None, from("2@4"), from("3@3"), from("3")] {
            let Decision::Refuse(m) = decide("s", Some(&three), true, w("0/4"), told) else {
                panic!("not refused")
            };
            assert!(m.contains("started as 0/4"), "{m}");
            assert!(m.contains("is 3 workers (generation 4"), "{m}");
            assert!(m.contains("--rescale-from 3@4"), "{m}");
        }
    }

    #[test]
    fn the_first_layout_needs_no_word_unless_the_job_ran_in_one_process() {
        let fresh = decide("s", None, false, w("2/3"), None);
        assert_eq!(
            fresh,
            Decision::Switch {
                to: Layout {
                    generation: 1,
                    workers: 3
                },
                previous: None,
                retire: vec!["s".to_owned()],
            }
        );
        let Decision::Refuse(m) = decide("s", None, true, w("2/3"), None) else {
            panic!("not refused")
        };
        assert!(m.contains("--rescale-from 1"), "{m}");
        assert!(matches!(
            decide("s", None, true, w("2/3"), from("1")),
            Decision::Switch { .. }
        ));
        assert!(matches!(
            decide("s", None, true, w("0/1"), None),
            Decision::Switch { .. }
        ));
        // A rescale of a table the job never wrote: a mistake, refused.
        let Decision::Refuse(m) = decide("s", None, false, w("0/2"), from("3@1")) else {
            panic!("not refused")
        };
        assert!(m.contains("nothing to rescale from"), "{m}");
    }

    #[test]
    fn layout_records_read_back() {
        let r = LayoutRecord {
            previous: Some(Layout {
                generation: 1,
                workers: 3,
            }),
            ..record(2, 2)
        };
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(
            json,
            r#"{"generation":2,"workers":2,"previous":{"generation":1,"workers":3},"set_by":"pid 1 on h at 0"}"#
        );
        assert_eq!(serde_json::from_str::<LayoutRecord>(&json).unwrap(), r);
    }
}
