//! The bad-record policy of a source subtask (fail, skip, dead-letter),
//! with bad records counted in `tinyflow_bad_records_total` by reason and
//! summed up in the log: at most one info line per [`SUMMARY_INTERVAL`]
//! with the counts by reason and the first positions since the last line,
//! and the totals when the subtask ends.
//!
//! Boundary: the reader hands each bad record over with its polled record
//! and calls [`BadRecords::flush`] before a checkpoint's positions are
//! taken; what a bad record is, is `bad_record.rs`'s, and the dead letters
//! themselves are `dead_letter.rs`'s.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use rdkafka::message::Message;
use tinyflow_api::{StreamError, StreamResult};
use tokio::time::Instant;

use crate::bad_record::{BadReason, BadRecord};
use crate::client::Partition;
use crate::config::BadRecordPolicy;
use crate::dead_letter::DeadLetter;
use crate::decode::Polled;
use crate::state::DeadLetterState;

/// The shortest time between two summaries of a subtask's bad records.
const SUMMARY_INTERVAL: Duration = Duration::from_secs(10);

/// Positions of bad records a summary names at most.
const FIRST_POSITIONS: usize = 5;

/// Counts bad records by reason, for the log: what came since the last
/// summary (with the first positions) and in total. Pure: the caller passes
/// the time.
#[derive(Debug, Default)]
struct Summary {
    since: BTreeMap<BadReason, u64>,
    first: Vec<String>,
    totals: BTreeMap<BadReason, u64>,
    /// When the last summary was due and given.
    last: Option<Instant>,
}

impl Summary {
    /// Counts one bad record.
    fn record(&mut self, reason: BadReason, topic: &str, partition: i32, offset: i64) {
        *self.since.entry(reason).or_default() += 1;
        *self.totals.entry(reason).or_default() += 1;
        if self.first.len() < FIRST_POSITIONS {
            self.first.push(format!("{topic}/{partition}@{offset}"));
        }
    }

    /// The summary of what came since the last one, if there is anything
    /// and the last one is at least `interval` old: (counts by reason, first
    /// positions). Starts the next interval.
    fn due(&mut self, now: Instant, interval: Duration) -> Option<(String, String)> {
        if self.since.is_empty() || self.last.is_some_and(|l| now < l + interval) {
            return None;
        }
        self.last = Some(now);
        let counts = counts(&self.since);
        let first = self.first.join(", ");
        self.since.clear();
        self.first.clear();
        Some((counts, first))
    }

    /// The totals by reason, if there was any bad record.
    fn totals(&self) -> Option<String> {
        (!self.totals.is_empty()).then(|| counts(&self.totals))
    }
}

/// `invalid_json=3 undecodable=1`, in the order of [`BadReason`].
fn counts(by_reason: &BTreeMap<BadReason, u64>) -> String {
    let mut out = String::new();
    for (reason, n) in by_reason {
        if !out.is_empty() {
            out.push(' ');
        }
        let _ = write!(out, "{}={n}", reason.label());
    }
    out
}

/// The bad-record policy of one subtask.
pub(crate) struct BadRecords {
    /// The subtask, for errors and logs.
    pub(crate) name: String,
    policy: BadRecordPolicy,
    /// `operator` and `subtask` of `tinyflow_bad_records_total`.
    labels: [(&'static str, String); 2],
    dead_letter: Option<DeadLetter>,
    request_timeout: Duration,
    summary: Summary,
}

impl BadRecords {
    pub(crate) fn new(
        name: String,
        policy: BadRecordPolicy,
        labels: [(&'static str, String); 2],
        dead_letter: Option<DeadLetter>,
        request_timeout: Duration,
    ) -> Self {
        BadRecords {
            name,
            policy,
            labels,
            dead_letter,
            request_timeout,
            summary: Summary::default(),
        }
    }

    /// Counts `bad` under its reason and applies the policy.
    pub(crate) fn handle(&mut self, p: &Polled<'_>, bad: BadRecord) -> StreamResult<()> {
        let (topic, partition, offset) = (&p.topic, p.msg.partition(), p.msg.offset());
        let [operator, subtask] = &self.labels;
        metrics::counter!(
            "tinyflow_bad_records_total",
            operator.0 => operator.1.clone(),
            subtask.0 => subtask.1.clone(),
            "reason" => bad.reason.label()
        )
        .increment(1);
        let reason = bad.to_string();
        match (&self.policy, &mut self.dead_letter) {
            (BadRecordPolicy::Fail, _) => {
                return Err(StreamError::BadRecord {
                    operator: self.name.clone(),
                    topic: topic.to_string(),
                    partition,
                    offset,
                    reason,
                });
            }
            (BadRecordPolicy::DeadLetter { .. }, Some(dl)) => {
                if dl.send(&p.msg, &reason, &self.name)? {
                    tracing::debug!(source = %self.name, %topic, partition, offset, %reason, dead_letter = %dl.topic, "bad record sent to the dead-letter topic");
                } else {
                    tracing::debug!(source = %self.name, %topic, partition, offset, %reason, dead_letter = %dl.topic, "bad record already in the dead-letter topic (written before a restart)");
                }
            }
            _ => {
                tracing::debug!(source = %self.name, %topic, partition, offset, %reason, "bad record skipped");
            }
        }
        self.summary.record(bad.reason, topic, partition, offset);
        self.summarize(Instant::now());
        Ok(())
    }

    /// Logs a summary of the bad records since the last one, when one is
    /// due.
    fn summarize(&mut self, now: Instant) {
        if let Some((counts, first)) = self.summary.due(now, SUMMARY_INTERVAL) {
            tracing::info!(
                source = %self.name,
                policy = self.policy_name(),
                %counts,
                %first,
                "bad records since the last summary (counts by reason, first positions)"
            );
        }
    }

    fn policy_name(&self) -> &'static str {
        match self.policy {
            BadRecordPolicy::Fail => "fail",
            BadRecordPolicy::Skip => "skip",
            BadRecordPolicy::DeadLetter { .. } => "dead-letter",
        }
    }

    /// Commits the dead letters sent so far (before a checkpoint's
    /// positions are taken, or at the end of a bounded read), and logs a
    /// summary when one is due.
    pub(crate) fn flush(&mut self) -> StreamResult<()> {
        self.summarize(Instant::now());
        match &mut self.dead_letter {
            Some(dl) => dl.commit(&self.name, self.request_timeout),
            None => Ok(()),
        }
    }

    /// Whether the source may read on: not while a restored dead-letter
    /// policy reads its topic back (waits a little for it, so the caller
    /// returns an empty batch and serves its control messages). Cancel
    /// safe.
    pub(crate) async fn ready(&mut self) -> StreamResult<bool> {
        match &mut self.dead_letter {
            Some(dl) => dl.ready(&self.name).await,
            None => Ok(true),
        }
    }

    /// The dead-letter state of a checkpoint at `positions`; call after
    /// [`BadRecords::flush`].
    pub(crate) fn checkpoint_state(
        &mut self,
        positions: &BTreeMap<Partition, i64>,
    ) -> Option<DeadLetterState> {
        self.dead_letter.as_mut().map(|dl| dl.state(positions))
    }
}

impl Drop for BadRecords {
    /// The final summary: the source ended, was stopped, or its attempt
    /// failed.
    fn drop(&mut self) {
        self.summarize(Instant::now() + SUMMARY_INTERVAL * 2);
        if let Some(totals) = self.summary.totals() {
            tracing::info!(
                source = %self.name,
                policy = self.policy_name(),
                %totals,
                "bad records of this source subtask, in total, as it ends"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_count_by_reason_name_the_first_positions_and_come_once_an_interval() {
        let start = Instant::now();
        let interval = Duration::from_secs(10);
        let mut s = Summary::default();
        assert_eq!(s.due(start, interval), None, "nothing to sum up");
        assert_eq!(s.totals(), None);

        // The first bad record is summed up at once.
        s.record(BadReason::Undecodable, "bids", 1, 40);
        assert_eq!(
            s.due(start, interval),
            Some(("undecodable=1".into(), "bids/1@40".into()))
        );
        // The rest wait for the interval: counted, not logged.
        for offset in 41..48 {
            s.record(BadReason::InvalidJson, "bids", 0, offset);
        }
        s.record(BadReason::TooLarge, "bids", 1, 3);
        assert_eq!(s.due(start + Duration::from_secs(9), interval), None);
        assert_eq!(
            s.due(start + interval, interval),
            Some((
                "invalid_json=7 too_large=1".into(),
                "bids/0@41, bids/0@42, bids/0@43, bids/0@44, bids/0@45".into()
            ))
        );
        // Nothing new since: no line, however long it is.
        assert_eq!(s.due(start + interval * 5, interval), None);
        // The next one is due an interval after the last one given.
        s.record(BadReason::InvalidJson, "bids", 0, 99);
        assert_eq!(
            s.due(start + interval * 5, interval),
            Some(("invalid_json=1".into(), "bids/0@99".into()))
        );
        assert_eq!(
            s.totals(),
            Some("invalid_json=8 too_large=1 undecodable=1".into())
        );
    }
}
