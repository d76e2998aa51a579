//! Wall-clock time for metadata.
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

/// This process, as tools and other runs should see it: `pid N on HOST`.
/// For lock holders and sink epochs, so that an operator can find a run
/// that holds a job.
pub fn this_process() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "an unknown host".to_owned());
    format!("pid {} on {host}", std::process::id())
}
