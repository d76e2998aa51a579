//! Bad records: why a record is bad ([`BadReason`], the `reason` label of
//! `tinyflow_bad_records_total`) and what exactly was wrong
//! ([`BadRecord`]), as the scan, the formats and the decoders report it.
//!
//! Boundary: the vocabulary only, using no other module of the crate. The
//! policy that deals with a bad record (fail, skip, dead-letter) is
//! `policy.rs`'s.

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
    /// A [`Format`](crate::Format)'s decode function refused it, or an Avro
    /// value is not a datum of its writer schema.
    Undecodable,
    /// Its writer schema's id is not in the schema registry.
    UnknownSchema,
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
            BadReason::UnknownSchema => "unknown_schema",
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
            BadReason::UnknownSchema => "unknown_schema",
        };
        write!(f, "{what}: {}", self.detail)
    }
}
