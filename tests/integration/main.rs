//! tinyflow's integration tests: one binary, one module per scenario
//! (fewer link steps, one place to look). The chaos test (`tinyflow run` as a
//! child process, killed again and again) is `crates/cli/tests/chaos.rs`, where
//! cargo builds the binary for it.
//!
//! - `checkpoint_flaws`: a regression test per flaw of the seed's checkpoint manager.
//! - `checkpoint_driver`: the async driver under tokio's paused clock, exact durations,
//!   backpressure bounds and a determinism check.
//! - `checkpoint_object_store`: the checkpoint store on object storage against a real S3
//!   server (`TINYFLOW_S3_ENDPOINT`, started by `cargo xtask ci`): a new store on the same
//!   prefix restores the newest checkpoint, retention, fallback past a damaged object,
//!   refused keys and an unreachable server.
//! - `checkpoint_props`: property tests of the coordinator's state machine against a
//!   reference model, checking the exactly-once invariants after every step.
//! - `checkpoint_store`: the local-directory checkpoint store: atomicity, corruption,
//!   retention, id continuity.
//! - `iceberg_sink`: the Iceberg sink on a sqlite catalog: crashes at every step of the commit,
//!   two sinks on one table, snapshot expiry, cadence, open-file cap, orphans; whole jobs
//!   with failures, read back by pyiceberg, on sqlite and on PostgreSQL.
//! - `iceberg_maintenance`: table maintenance: expiry deletes only what expired snapshots
//!   alone named (also after another engine deleted rows) and the metadata files past the
//!   kept versions, a dry run says exactly what goes, the dedupe marker survives, and a job
//!   failing again and again with a round after every commit leaves each row once.
//! - `iceberg_identity`: the table is the truth: restored checkpoints that disagree with
//!   their table (dropped, created again, lost with the warehouse, restored from an older
//!   backup, data files deleted) are refused; two live runs of one sink, the newer fences
//!   the older, also inside a commit, and a property test of interleaved claims and commits.
//! - `kafka_source`: the Kafka source against a real broker (`KAFKA_BOOTSTRAP`, started by
//!   `cargo xtask ci`): replay without duplicates or gaps, rescaling, bad records, unknown topics.
//! - `kafka_secure`: the Kafka source over the broker's SASL_SSL listener: SCRAM-SHA-256/512 and
//!   PLAIN read every record once, and so does OAUTHBEARER with OIDC tokens of a real identity
//!   provider (Keycloak), renewed while it reads; a wrong password, an untrusted certificate, a
//!   plaintext client on the TLS port, a wrong client secret, a token for another audience and
//!   an unreachable identity provider fail within 30 s saying which setting to check.
//! - `kafka_avro`: Avro values with a schema registry that requires basic authentication (right
//!   and wrong credentials), and a registry that is down while records wait for their schema.
//! - `kafka_raw`: values as they are (string or binary), keys and headers as columns, and
//!   bytes that are not UTF-8 as bad records.
//! - `kafka_dead_letter`: the dead-letter topic exactly once across crashes and restarts
//!   (by hand, with a rescale, and through the runtime with injected failures), and bad
//!   records too large for it sent truncated.
//! - `runtime_exactly_once`: jobs through the runtime with failures injected at generated
//!   points; committed output equals the expected output; keyed state across restore and
//!   rescale.
//! - `runtime_driver_thread`: where the checkpoint coordinator's driver runs (its own
//!   thread on a multi-thread runtime, in place on a current-thread one) and what a panic
//!   there does.
//! - `runtime_metrics`: per-operator and checkpoint metrics through the `metrics` facade.
//! - `runtime_windows`: event-time windows, watermarks, lateness and side output, and window
//!   results across restore.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a panic is the failure report"
)]

mod checkpoint_driver;
mod checkpoint_flaws;
mod checkpoint_object_store;
mod checkpoint_props;
mod checkpoint_store;
mod iceberg_identity;
mod iceberg_layout;
mod iceberg_maintenance;
mod iceberg_merge;
mod iceberg_sink;
mod kafka_avro;
mod kafka_dead_letter;
mod kafka_raw;
mod kafka_secure;
mod kafka_source;
mod kafka_source_topics;
mod runtime_driver_thread;
mod runtime_exactly_once;
mod runtime_metrics;
mod runtime_windows;

// Only `checkpoint_flaws::traced_events` installs a global tracing
// subscriber, filtered to INFO and above of the checkpoint crate: a second
// global one would fail to install, and a scoped one can miss events (tracing
// caches per call site whether anyone listens).
mod tidy;
