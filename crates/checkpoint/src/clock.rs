//! Wall-clock time for checkpoint metadata.
//!
//! Ordering and timeouts use `tokio::time` (so tests run under a paused
//! clock); wall-clock stamps only label metadata and come in through this
//! trait, so tests can fix them.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};
/// A source of wall-clock time, in milliseconds since the Unix epoch.
pub trait WallClock: Send + Sync + fmt::Debug {
    /// Now, in milliseconds since the Unix epoch.
    fn now_millis(&self) -> u64;
}

/// The system's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemWallClock;

impl WallClock for SystemWallClock {
    fn now_millis(&self) -> u64 {
        // A clock before 1970 is a misconfigured host; 0 keeps metadata
        // writable rather than failing a checkpoint over a label.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}
