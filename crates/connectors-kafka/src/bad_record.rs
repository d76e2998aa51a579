//! Bad records: why a record is bad, and the policy that deals with it
//! (fail, skip, dead-letter), counted in `tinyflow_bad_records_total` by
//! reason.

use std::time::Duration;

use rdkafka::message::Message;
use tinyflow_api::{StreamError, StreamResult};

use crate::config::BadRecordPolicy;
use crate::dead_letter::DeadLetter;
use crate::source::Polled;

/// Why a record is bad: the `reason` label of `tinyflow_bad_records_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BadReason {
    /// Not valid JSON, or not exactly one JSON value.
    InvalidJson,
    /// Valid JSON that does not fit the declared schema: a wrong type, a
    /// missing required field, a field the schema lacks (strict).
    SchemaMismatch,
    /// A value that would only fit its column by a lossy conversion.
    LossyConversion,
    /// Larger than the configured maximum record size.
    TooLarge,
    /// Nested deeper than the configured maximum.
    TooDeep,
    /// A [`Format`](crate::Format)'s decode function refused it.
    Undecodable,
}

impl BadReason {
    /// The metric label and the name in logs.
    pub fn label(self) -> &'static str {
        match self {
            BadReason::InvalidJson => "invalid_json",
            BadReason::SchemaMismatch => "schema_mismatch",
            BadReason::LossyConversion => "lossy_conversion",
            BadReason::TooLarge => "too_large",
            BadReason::TooDeep => "too_deep",
            BadReason::Undecodable => "undecodable",
        }
    }
}

/// One bad record: its reason and what exactly was wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadRecord {
    pub(crate) reason: BadReason,
    pub(crate) detail: String,
}

impl BadRecord {
    /// The longest detail kept, in bytes: a decoder's error can quote the
    /// whole value (arrow-json does), and the detail goes into logs, errors
    /// and a dead letter's header.
    pub(crate) const MAX_DETAIL: usize = 1024;

    pub(crate) fn new(reason: BadReason, detail: impl Into<String>) -> Self {
        let mut detail = detail.into();
        if detail.len() > Self::MAX_DETAIL {
            let mut cut = Self::MAX_DETAIL;
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            detail.truncate(cut);
            detail.push_str("...");
        }
        BadRecord { reason, detail }
    }
}

impl std::fmt::Display for BadRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.reason {
            BadReason::InvalidJson => "invalid JSON",
            BadReason::SchemaMismatch => "does not fit the schema",
            BadReason::LossyConversion => "not exactly representable in its column",
            BadReason::TooLarge => "record too large",
            BadReason::TooDeep => "nested too deep",
            BadReason::Undecodable => "undecodable",
        };
        write!(f, "{what}: {}", self.detail)
    }
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
                dl.send(&p.msg, &reason, &self.name)?;
                tracing::debug!(source = %self.name, %topic, partition, offset, %reason, dead_letter = %dl.topic, "bad record sent to the dead-letter topic");
            }
            _ => {
                tracing::debug!(source = %self.name, %topic, partition, offset, %reason, "bad record skipped");
            }
        }
        Ok(())
    }

    /// Waits until every dead letter sent so far is in its topic.
    pub(crate) fn flush(&mut self) -> StreamResult<()> {
        match &mut self.dead_letter {
            Some(dl) => dl.flush(&self.name, self.request_timeout),
            None => Ok(()),
        }
    }
}
