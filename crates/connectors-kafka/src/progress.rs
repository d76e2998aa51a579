//! Stall watch: progress per partition of a source subtask, to report
//! partitions that make none while behind (committed records not read yet),
//! and those held back by an open transaction, and to fail a subtask that
//! makes none at all while behind.
//!
//! Boundary: bookkeeping only, with the time passed in. The reader calls it
//! on each read with its positions and the partition ends from the client's
//! statistics, and sets the stalled-partitions gauge from what it returns.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use tinyflow_api::{StreamError, StreamResult};
use tokio::time::Instant;

use crate::client::Partition;

/// How often stalls are looked for.
const STALL_CHECK_EVERY: Duration = Duration::from_secs(1);

/// A gap between two reads longer than this is time the job held the
/// source back (backpressure, a checkpoint), not the source stalling.
const HELD_BACK: Duration = Duration::from_secs(1);

/// Progress per partition, to report partitions that make none while
/// behind and to fail a source that makes none at all.
pub(crate) struct Progress {
    warn: Duration,
    fail: Option<Duration>,
    /// Per partition: its position when it last moved, and when.
    moved: BTreeMap<Partition, (i64, Instant)>,
    /// Partitions reported since they last moved.
    reported: BTreeSet<Partition>,
    /// When any partition last moved.
    any_moved: Instant,
    last_call: Instant,
    /// What the source itself waited since `last_call` (retry pauses):
    /// not time the job held it back.
    own_wait: Duration,
    next_check: Instant,
}

impl Progress {
    pub(crate) fn new(
        positions: &BTreeMap<Partition, i64>,
        now: Instant,
        warn: Duration,
        fail: Option<Duration>,
    ) -> Self {
        Progress {
            warn,
            fail,
            moved: positions
                .iter()
                .map(|(p, o)| (p.clone(), (*o, now)))
                .collect(),
            reported: BTreeSet::new(),
            any_moved: now,
            last_call: now,
            own_wait: Duration::ZERO,
            next_check: now + STALL_CHECK_EVERY,
        }
    }

    /// A read starts: time the job held the source back does not count.
    pub(crate) fn called(&mut self, now: Instant) {
        let gap = now
            .duration_since(self.last_call)
            .saturating_sub(std::mem::take(&mut self.own_wait));
        if gap > HELD_BACK {
            for (_, since) in self.moved.values_mut() {
                *since += gap;
            }
            self.any_moved += gap;
        }
        self.last_call = now;
    }

    /// The source paused `d` on its own (after consumer errors).
    pub(crate) fn waited(&mut self, d: Duration) {
        self.own_wait += d;
    }

    pub(crate) fn due(&self, now: Instant) -> bool {
        now >= self.next_check
    }

    /// Reports partitions behind (committed records not read) that have
    /// not moved for `warn`, and those held back by an open transaction;
    /// fails when no partition moved for `fail` while one is behind.
    /// `ends`: (committed end, log end) per partition, from the client's
    /// statistics. Returns the number of stalled partitions.
    pub(crate) fn check(
        &mut self,
        name: &str,
        positions: &BTreeMap<Partition, i64>,
        stop: Option<&BTreeMap<Partition, i64>>,
        ends: &HashMap<(String, i32), (i64, i64)>,
        now: Instant,
    ) -> StreamResult<usize> {
        self.next_check = now + STALL_CHECK_EVERY;
        let mut stalled = 0;
        let mut behind = Vec::new();
        for (p, position) in positions {
            let (at, since) = self.moved.entry(p.clone()).or_insert((*position, now));
            if *at != *position {
                (*at, *since) = (*position, now);
                self.any_moved = now;
                self.reported.remove(p);
                continue;
            }
            if stop
                .and_then(|s| s.get(p))
                .is_some_and(|end| position >= end)
            {
                continue; // a bounded read that is done with it
            }
            let Some(&(committed_end, log_end)) = ends.get(&(p.0.to_string(), p.1)) else {
                continue; // no statistics yet
            };
            let still = now.duration_since(*since);
            if committed_end > *position {
                behind.push(format!(
                    "{}/{}@{position} (committed end {committed_end})",
                    p.0, p.1
                ));
                if still >= self.warn {
                    stalled += 1;
                    if self.reported.insert(p.clone()) {
                        tracing::warn!(source = %name, topic = %p.0, partition = p.1, position, committed_end, still_secs = still.as_secs(), "partition makes no progress while behind");
                    }
                }
            } else if log_end > *position && still >= self.warn && self.reported.insert(p.clone()) {
                tracing::warn!(source = %name, topic = %p.0, partition = p.1, position, log_end, still_secs = still.as_secs(), "partition held back by a transaction open since offset {position}: its records are read once it is committed or aborted");
            }
        }
        if let Some(fail) = self.fail
            && !behind.is_empty()
            && now.duration_since(self.any_moved) >= fail
        {
            return Err(StreamError::external(
                name.to_owned(),
                "kafka",
                "reading".to_owned(),
                format!(
                    "no progress for {} s while behind on {}",
                    now.duration_since(self.any_moved).as_secs(),
                    behind.join(", ")
                ),
                true,
            ));
        }
        Ok(stalled)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use std::sync::Arc;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_partition_behind_without_progress_is_reported_then_fails_the_reader() {
        let p: Partition = (Arc::from("t"), 0);
        let q: Partition = (Arc::from("t"), 1);
        let mut positions = BTreeMap::from([(p.clone(), 10), (q.clone(), 5)]);
        let start = Instant::now();
        let mut progress = Progress::new(
            &positions,
            start,
            Duration::from_secs(2),
            Some(Duration::from_secs(5)),
        );
        // p is behind (committed end 20); q is at its committed end, held
        // back by an open transaction (log end 9): reported, never failed.
        let ends = HashMap::from([
            (("t".to_owned(), 0), (20, 20)),
            (("t".to_owned(), 1), (5, 9)),
        ]);
        let at = |secs: u64| start + Duration::from_secs(secs);
        for s in 1..=4 {
            let now = at(s);
            progress.called(now);
            let stalled = progress.check("src", &positions, None, &ends, now).unwrap();
            assert_eq!(stalled, usize::from(s >= 2), "at {s} s");
        }
        // Progress on p resets it, and the subtask's clock.
        positions.insert(p.clone(), 11);
        let now = at(5);
        progress.called(now);
        assert_eq!(
            progress.check("src", &positions, None, &ends, now).unwrap(),
            0
        );
        // Held back by the job for 10 s (one call after a long gap): not a
        // stall.
        let now = at(15);
        progress.called(now);
        assert_eq!(
            progress.check("src", &positions, None, &ends, now).unwrap(),
            0
        );
        // Then no progress for 5 s while behind: failed, naming p.
        for s in 16..=19 {
            let now = at(s);
            progress.called(now);
            progress.check("src", &positions, None, &ends, now).unwrap();
        }
        let now = at(20);
        progress.called(now);
        let err = progress
            .check("src", &positions, None, &ends, now)
            .unwrap_err();
        assert!(err.is_retryable());
        let text = err.to_string();
        assert!(
            text.contains("no progress for 5 s") && text.contains("t/0@11"),
            "{text}"
        );
        assert!(!text.contains("t/1"), "{text}");
        // A bounded read done with p does not count it as behind.
        let stop = BTreeMap::from([(p.clone(), 11), (q.clone(), 5)]);
        assert_eq!(
            progress
                .check("src", &positions, Some(&stop), &ends, at(21))
                .unwrap(),
            0
        );
    }

    #[tokio::test(start_paused = true)]
    async fn retry_pauses_count_towards_a_stall() {
        let p: Partition = (Arc::from("t"), 0);
        let positions = BTreeMap::from([(p.clone(), 10)]);
        let ends = HashMap::from([(("t".to_owned(), 0), (20, 20))]);
        let start = Instant::now();
        let mut progress = Progress::new(
            &positions,
            start,
            Duration::from_secs(2),
            Some(Duration::from_secs(5)),
        );
        // Errors in a row: each read pauses 1 s on its own, so reads come
        // more than HELD_BACK apart, yet the job held nothing back.
        let mut failed = None;
        for call in 1..=10u64 {
            let now = start + Duration::from_millis(1_050 * call);
            progress.called(now);
            if let Err(e) = progress.check("src", &positions, None, &ends, now) {
                failed = Some((call, e));
                break;
            }
            progress.waited(Duration::from_secs(1));
        }
        let (call, err) = failed.expect("a source pausing on errors while behind fails");
        assert!(call <= 6, "failed only at read {call}");
        assert!(err.to_string().contains("t/0@10"), "{err}");
    }
}
