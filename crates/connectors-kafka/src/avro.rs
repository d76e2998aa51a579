//! Avro values in the Confluent wire format (a zero byte, the writer
//! schema's registry id in 4 big-endian bytes, the Avro binary datum),
//! decoded straight into Arrow by arrow-avro with the writer's own schema,
//! then made into the table's columns ([`conform`](crate::conform)).
//!
//! Writer schemas are fetched from the registry by id the first time an id
//! is seen, in the background, and kept for the life of the source: a
//! registry outage stops nothing that has seen its schemas. A record whose
//! schema is still being fetched is not decoded: the source reads its
//! partition again from that record once the schema is there (see
//! `defer_waiting` in `reader.rs`), so nothing is lost or skipped while the
//! registry is down. An id the registry does not have is a bad record.
//!
//! Schema evolution ([`SchemaEvolution`]): a writer schema whose fields
//! the columns lack (or whose types are wider) is, under `AddColumns`,
//! taken into the table by the [`ColumnsEvolver`] (a schema commit of its
//! own), after which the source fails with a retryable error so that the
//! job restarts from its last checkpoint with the new columns everywhere
//! (writers switch schema on that restart, never inside a file); its
//! records were never emitted, so they are read again. Under `Fail` such a
//! schema stops the job, naming it and where it was met.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow_array::RecordBatch;
use arrow_avro::reader::{Decoder, ReaderBuilder};
use arrow_avro::schema::{AvroSchema, Fingerprint, FingerprintAlgorithm, SchemaStore};
use arrow_schema::SchemaRef;
use tinyflow_api::{StreamError, StreamResult};
use tokio::task::JoinHandle;

use crate::bad_record::{BadReason, BadRecord};
use crate::registry::{Registry, RegistryError};

/// What an Avro source does when a writer schema has fields its columns
/// lack, or wider types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaEvolution {
    /// The fields are not read (a type that does not convert makes its
    /// records bad): the columns stay as declared.
    Ignore,
    /// The table takes them (new optional columns, widened types) and the
    /// job restarts with them; a change the table cannot take (a type that
    /// neither converts nor widens) stops the job.
    AddColumns,
    /// The job stops, naming the schema and where it was met.
    Fail,
}

/// The table behind an Avro source whose columns may grow (implemented
/// where the source and the table meet: the `tinyflow` command joins it to
/// the Iceberg sink).
#[async_trait::async_trait]
pub trait ColumnsEvolver: Send + Sync + std::fmt::Debug {
    /// The value columns the source decodes into now (the declared ones
    /// first, then the ones added since).
    fn columns(&self) -> SchemaRef;

    /// Makes the table take `wanted` (the columns, grown); afterwards
    /// [`columns`](Self::columns) holds them. Returns what changed, for the
    /// log.
    async fn evolve(&self, wanted: SchemaRef) -> StreamResult<String>;
}

/// Schema evolution for a source: the mode and the table.
#[derive(Debug, Clone)]
pub struct Evolution {
    pub mode: SchemaEvolution,
    pub evolver: Arc<dyn ColumnsEvolver>,
}

/// Writer schemas fetched from the registry, by id: shared by a source's
/// subtasks and kept across the job's restarts, so an outage of the
/// registry stops nothing that has seen its schemas.
#[derive(Debug, Clone, Default)]
pub(crate) struct SchemaCache(Arc<Mutex<HashMap<u32, crate::registry::RegisteredSchema>>>);

impl SchemaCache {
    fn get(&self, id: u32) -> Option<crate::registry::RegisteredSchema> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }

    fn put(&self, s: crate::registry::RegisteredSchema) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(s.id, s);
    }
}

/// The wire format's first byte.
const MAGIC: u8 = 0;
/// The magic byte and the schema id.
const PREFIX: usize = 5;

/// The first retry's pause after a registry failure; doubled up to
/// [`MAX_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(100);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(5);

/// How often an id the registry says it does not have is asked for, and
/// the pause between.
const NOT_FOUND_ATTEMPTS: u32 = 3;
const NOT_FOUND_PAUSE: Duration = Duration::from_millis(500);

/// The writer schema id of a payload in the wire format.
pub(crate) fn schema_id(payload: &[u8]) -> Option<u32> {
    match payload {
        [MAGIC, a, b, c, d, ..] => Some(u32::from_be_bytes([*a, *b, *c, *d])),
        _ => None,
    }
}

/// A value in the wire format and its writer schema's id; a tombstone or a
/// value not in the wire format is bad (`kind` names the values expected).
fn wire<'a>(payload: Option<&'a [u8]>, kind: &str) -> Result<(&'a [u8], u32), BadRecord> {
    let Some(payload) = payload else {
        return Err(BadRecord::new(
            BadReason::Undecodable,
            format!("a record without a value (a tombstone); {kind} values are expected"),
        ));
    };
    match schema_id(payload) {
        Some(id) => Ok((payload, id)),
        None => Err(BadRecord::new(
            BadReason::Undecodable,
            format!(
                "not in the Confluent wire format (a zero byte, then a 4-byte schema id); starts with {:02x?}",
                &payload[..payload.len().min(PREFIX)]
            ),
        )),
    }
}

/// The Arrow schema arrow-avro decodes values of this Avro schema into.
pub fn arrow_schema_of(avro: &str) -> Result<SchemaRef, String> {
    Ok(decoder_for(0, avro, 1)?.schema())
}

/// A decoder of wire-format payloads written with `avro` (id `id`).
fn decoder_for(id: u32, avro: &str, rows: usize) -> Result<Decoder, String> {
    let mut store = SchemaStore::new_with_type(FingerprintAlgorithm::Id);
    store
        .set(Fingerprint::Id(id), AvroSchema::new(avro.to_owned()))
        .map_err(|e| format!("the registry's schema is not Avro arrow-avro reads: {e}"))?;
    ReaderBuilder::new()
        .with_writer_schema_store(store)
        .with_active_fingerprint(Fingerprint::Id(id))
        .with_batch_size(rows)
        .build_decoder()
        .map_err(|e| format!("the registry's schema is not Avro arrow-avro reads: {e}"))
}

/// A writer schema, as far as it is known.
enum Writer {
    /// Decodable: its text and the decoder of this poll's records.
    Ready { avro: String, decoder: Box<Decoder> },
    /// Every record written with it is bad, for this reason.
    Bad(BadRecord),
    /// Its records wait until the table has these columns (and the job
    /// has restarted with them).
    Evolve(SchemaRef),
    /// Its records stop the job, for this reason.
    Stop(String),
    /// A Protobuf schema's file.
    #[cfg(feature = "protobuf")]
    Proto(prost_reflect::FileDescriptor),
}

/// One writer schema's share of a poll: batches decoded so far, each with
/// the positions (in the poll) of its rows.
#[derive(Default)]
struct Share {
    done: Vec<(RecordBatch, Vec<usize>)>,
    /// Positions of the rows in the decoder now, not yet flushed.
    open: Vec<usize>,
}

type Fetched = Vec<(
    u32,
    Result<crate::registry::RegisteredSchema, RegistryError>,
)>;

/// Decodes polls of wire-format Avro payloads into batches of a table's
/// schema.
pub(crate) struct AvroValues {
    registry: Registry,
    /// Protobuf values, not Avro.
    #[cfg(feature = "protobuf")]
    protobuf: bool,
    target: SchemaRef,
    strict: bool,
    evolution: Option<Evolution>,
    cache: SchemaCache,
    /// The first record held back by an `Evolve` or `Stop` schema: its id
    /// and where it is (`topic/partition@offset`).
    blocked: Option<(u32, String)>,
    /// The source's name, for logs.
    name: String,
    writers: HashMap<u32, Writer>,
    /// Ids seen but not yet fetched (or being fetched).
    wanted: BTreeSet<u32>,
    fetch: Option<JoinHandle<Result<Fetched, RegistryError>>>,
    /// Rows each decoder takes before a flush.
    rows: usize,
}

impl std::fmt::Debug for AvroValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AvroValues")
            .field("registry", &self.registry.url())
            .field("writers", &self.writers.len())
            .field("wanted", &self.wanted)
            .finish()
    }
}

impl AvroValues {
    pub(crate) fn new(
        registry: Registry,
        target: SchemaRef,
        strict: bool,
        name: String,
        evolution: Option<Evolution>,
        cache: SchemaCache,
    ) -> Self {
        AvroValues {
            registry,
            #[cfg(feature = "protobuf")]
            protobuf: false,
            // The columns the source's output was built for (with
            // evolution, the evolver's when the source was created).
            target,
            strict,
            evolution,
            cache,
            blocked: None,
            name,
            writers: HashMap::new(),
            wanted: BTreeSet::new(),
            fetch: None,
            rows: 1024,
        }
    }

    /// Whether a record with this payload (at `at`, named only when
    /// needed) must wait: for its writer schema (which this starts
    /// fetching), or for the table to take that schema's columns.
    pub(crate) fn must_wait(
        &mut self,
        payload: Option<&[u8]>,
        at: impl FnOnce() -> String,
    ) -> bool {
        let Some(id) = payload.and_then(schema_id) else {
            return false; // not the wire format: bad, decoded now
        };
        if !self.writers.contains_key(&id)
            && let Some(s) = self.cache.get(id)
        {
            let w = self.admit(s);
            self.writers.insert(id, w);
        }
        match self.writers.get(&id) {
            Some(Writer::Ready { .. } | Writer::Bad(_)) => false,
            #[cfg(feature = "protobuf")]
            Some(Writer::Proto(_)) => false,
            Some(Writer::Evolve(_) | Writer::Stop(_)) => {
                if self.blocked.is_none() {
                    self.blocked = Some((id, at()));
                }
                true
            }
            None => {
                self.wanted.insert(id);
                true
            }
        }
    }

    /// For Protobuf values instead of Avro (no schema evolution).
    #[cfg(feature = "protobuf")]
    pub(crate) fn protobuf(mut self) -> Self {
        self.protobuf = true;
        self.evolution = None;
        self
    }

    /// What records of writer schema `s` get: decoded, bad, or held back
    /// for schema evolution.
    fn admit(&self, s: crate::registry::RegisteredSchema) -> Writer {
        let id = s.id;
        #[cfg(feature = "protobuf")]
        if self.protobuf {
            if s.schema_type != "PROTOBUF" {
                return Writer::Bad(BadRecord::new(
                    BadReason::SchemaMismatch,
                    format!("schema id {id} is a {} schema, not Protobuf", s.schema_type),
                ));
            }
            if s.has_references {
                return Writer::Bad(BadRecord::new(
                    BadReason::SchemaMismatch,
                    format!(
                        "schema id {id} imports schemas of other subjects, which is not supported yet (Google's well-known types are)"
                    ),
                ));
            }
            return match crate::protobuf::compile(&s.schema) {
                Ok(file) => {
                    tracing::info!(source = %self.name, schema_id = id, registry = %self.registry.url(), "fetched a writer schema");
                    Writer::Proto(file)
                }
                Err(e) => Writer::Bad(BadRecord::new(
                    BadReason::SchemaMismatch,
                    format!("schema id {id}: {e}"),
                )),
            };
        }
        if s.schema_type != "AVRO" {
            return Writer::Bad(BadRecord::new(
                BadReason::SchemaMismatch,
                format!("schema id {id} is a {} schema, not Avro", s.schema_type),
            ));
        }
        if s.has_references {
            return Writer::Bad(BadRecord::new(
                BadReason::SchemaMismatch,
                format!("schema id {id} refers to other schemas, which is not supported yet"),
            ));
        }
        let decoder = match decoder_for(id, &s.schema, self.rows) {
            Ok(d) => d,
            Err(e) => {
                return Writer::Bad(BadRecord::new(
                    BadReason::SchemaMismatch,
                    format!("schema id {id}: {e}"),
                ));
            }
        };
        let mode = self.evolution.as_ref().map(|e| e.mode);
        if let Some(mode @ (SchemaEvolution::AddColumns | SchemaEvolution::Fail)) = mode {
            let writer = decoder.schema();
            match (
                crate::conform::grow(self.target.fields(), writer.fields()),
                mode,
            ) {
                (Ok(None), _) => {}
                (Ok(Some(fields)), SchemaEvolution::AddColumns) => {
                    return Writer::Evolve(Arc::new(arrow_schema::Schema::new(fields)));
                }
                (Ok(Some(fields)), _) => {
                    let new: Vec<&str> = fields
                        .iter()
                        .filter(|f| self.target.field_with_name(f.name()).is_err())
                        .map(|f| f.name().as_str())
                        .collect();
                    return Writer::Stop(format!(
                        "schema id {id} has fields or types the table lacks (new columns: {new:?}), and sink.schema_evolution is \"fail\""
                    ));
                }
                (Err(e), _) => {
                    return Writer::Stop(format!(
                        "schema id {id} changes a column in a way the table cannot take: {e}"
                    ));
                }
            }
        }
        tracing::info!(source = %self.name, schema_id = id, registry = %self.registry.url(), "fetched a writer schema");
        Writer::Ready {
            avro: s.schema,
            decoder: Box::new(decoder),
        }
    }

    /// Waits up to `max` for the schemas being fetched; `Ok(true)` when
    /// none is missing any more. A registry that refuses the credentials
    /// fails the source.
    pub(crate) async fn ready(&mut self, max: Duration) -> StreamResult<bool> {
        if let Some((id, at)) = self.blocked.take() {
            match self.writers.get(&id) {
                Some(Writer::Stop(reason)) => {
                    return Err(StreamError::external(
                        self.name.clone(),
                        "kafka",
                        "reading Avro records".to_owned(),
                        format!("the record at {at}: {reason}"),
                        false,
                    ));
                }
                Some(Writer::Evolve(grown)) => {
                    let grown = Arc::clone(grown);
                    let evolver = match &self.evolution {
                        Some(e) => Arc::clone(&e.evolver),
                        None => return Ok(true),
                    };
                    let change = evolver.evolve(grown).await?;
                    tracing::info!(source = %self.name, schema_id = id, at = %at, change = %change, "the table took the writer schema's new columns; restarting from the last checkpoint with them");
                    return Err(StreamError::external(
                        self.name.clone(),
                        "iceberg",
                        "evolving the table's schema".to_owned(),
                        format!(
                            "schema id {id} (first at {at}) brought {change}; the job restarts from its last checkpoint with the new columns"
                        ),
                        true,
                    ));
                }
                _ => {}
            }
        }
        if self.fetch.is_none() {
            if self.wanted.is_empty() {
                return Ok(true);
            }
            self.fetch = Some(self.spawn_fetch());
        }
        let Some(handle) = self.fetch.as_mut() else {
            return Ok(true);
        };
        // Cancel safe: the handle stays, the fetch goes on.
        let Ok(joined) = tokio::time::timeout(max, handle).await else {
            return Ok(false);
        };
        self.fetch = None;
        let fetched = joined
            .map_err(|e| self.error(format!("the schema fetch task failed: {e}"), false))?
            .map_err(|e| self.error(e.to_string(), e.is_transient()))?;
        for (id, answer) in fetched {
            self.wanted.remove(&id);
            let writer = match answer {
                Ok(s) => {
                    self.cache.put(s.clone());
                    self.admit(s)
                }
                Err(e) => Writer::Bad(BadRecord::new(
                    BadReason::UnknownSchema,
                    format!("schema id {id}: {e}"),
                )),
            };
            self.writers.insert(id, writer);
        }
        Ok(self.wanted.is_empty())
    }

    fn error(&self, message: String, retryable: bool) -> StreamError {
        StreamError::external(
            self.name.clone(),
            "schema registry",
            "fetching writer schemas".to_owned(),
            message,
            retryable,
        )
    }

    /// Fetches every wanted id, retrying while the registry is unreachable
    /// (with a warning at the first failure and at powers of two); ends
    /// with an error only for refused credentials or requests.
    fn spawn_fetch(&self) -> JoinHandle<Result<Fetched, RegistryError>> {
        let registry = self.registry.clone();
        let ids: Vec<u32> = self.wanted.iter().copied().collect();
        let name = self.name.clone();
        tokio::spawn(async move {
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                let mut failures: u32 = 0;
                let mut not_found: u32 = 0;
                let mut pause = FIRST_RETRY_PAUSE;
                loop {
                    match registry.schema_by_id(id).await {
                        Err(e) if e.is_transient() => {
                            failures += 1;
                            if failures.is_power_of_two() {
                                tracing::warn!(source = %name, schema_id = id, failures, error = %e, "the schema registry does not answer; records written with this schema wait, and are read once it answers");
                            }
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(MAX_RETRY_PAUSE);
                        }
                        // A registry of several nodes can answer 404 for an
                        // id registered a moment ago: asked again a few
                        // times before the id is taken as unknown.
                        Err(e @ RegistryError::NotFound { .. }) => {
                            not_found += 1;
                            if not_found < NOT_FOUND_ATTEMPTS {
                                tokio::time::sleep(NOT_FOUND_PAUSE).await;
                                continue;
                            }
                            out.push((id, Err(e)));
                            break;
                        }
                        Err(e) => return Err(e),
                        Ok(s) => {
                            if failures > 0 {
                                tracing::info!(source = %name, schema_id = id, failures, "the schema registry answers again");
                            }
                            out.push((id, Ok(s)));
                            break;
                        }
                    }
                }
            }
            Ok(out)
        })
    }

    /// Decodes `payloads` (`None` for a record without a value): the batch
    /// of the good ones in order, `bad` filled in for the others (entries
    /// already `Some` are left out). Every payload's writer schema is known
    /// ([`must_wait`](Self::must_wait) said so).
    pub(crate) fn decode(
        &mut self,
        payloads: &[Option<&[u8]>],
        bad: &mut [Option<BadRecord>],
    ) -> Option<RecordBatch> {
        if payloads.len() >= self.rows {
            self.rows = payloads.len() + 1;
            for (id, w) in &mut self.writers {
                if let Writer::Ready { avro, decoder } = w {
                    // Same schema as when it was first built: cannot fail.
                    if let Ok(d) = decoder_for(*id, avro, self.rows) {
                        **decoder = d;
                    }
                }
            }
        }
        let mut shares: HashMap<u32, Share> = HashMap::new();
        for (i, payload) in payloads.iter().enumerate() {
            if bad[i].is_some() {
                continue;
            }
            let (payload, id) = match wire(*payload, "Avro") {
                Ok(w) => w,
                Err(b) => {
                    bad[i] = Some(b);
                    continue;
                }
            };
            match self.writers.get_mut(&id) {
                None => {
                    // must_wait held it back; cannot happen.
                    bad[i] = Some(BadRecord::new(
                        BadReason::UnknownSchema,
                        format!("schema id {id} was not fetched"),
                    ));
                }
                Some(Writer::Bad(b)) => bad[i] = Some(b.clone()),
                #[cfg(feature = "protobuf")]
                Some(Writer::Proto(_)) => {
                    bad[i] = Some(BadRecord::new(
                        BadReason::SchemaMismatch,
                        format!("schema id {id} is Protobuf, the source reads Avro"),
                    ));
                }
                Some(Writer::Evolve(_) | Writer::Stop(_)) => {
                    // must_wait held it back; cannot happen.
                    bad[i] = Some(BadRecord::new(
                        BadReason::SchemaMismatch,
                        format!("schema id {id} waits for the table's schema"),
                    ));
                }
                Some(Writer::Ready { avro, decoder }) => {
                    let share = shares.entry(id).or_default();
                    match feed(decoder, payload) {
                        Ok(()) => share.open.push(i),
                        Err(e) => {
                            bad[i] = Some(BadRecord::new(
                                BadReason::Undecodable,
                                format!("not an Avro datum of schema id {id}: {e}"),
                            ));
                            // The decoder may hold part of it: start again
                            // from the good rows before it.
                            let mut fresh = match decoder_for(id, avro, self.rows) {
                                Ok(d) => d,
                                Err(_) => continue,
                            };
                            let mut replayed = Vec::with_capacity(share.open.len());
                            for &j in &share.open {
                                match payloads[j].map(|p| feed(&mut fresh, p)) {
                                    Some(Ok(())) => replayed.push(j),
                                    _ => {
                                        bad[j] = Some(BadRecord::new(
                                            BadReason::Undecodable,
                                            format!("schema id {id}: decoded once, then not again"),
                                        ))
                                    }
                                }
                            }
                            share.open.clear();
                            share
                                .done
                                .extend(flush_rows(id, avro, &mut fresh, replayed, payloads, bad));
                            **decoder = fresh;
                        }
                    }
                }
            }
        }
        // Flush each writer's rows and make them the table's.
        let mut pieces: Vec<(RecordBatch, Vec<usize>)> = Vec::new();
        for (id, mut share) in shares {
            if let Some(Writer::Ready { avro, decoder }) = self.writers.get_mut(&id)
                && !share.open.is_empty()
            {
                let open = std::mem::take(&mut share.open);
                share
                    .done
                    .extend(flush_rows(id, avro, decoder, open, payloads, bad));
            }
            for (batch, rows) in share.done {
                match crate::conform::conform(&batch, &self.target, self.strict) {
                    Ok((batch, bad_rows)) => {
                        let mut rows = rows;
                        if !bad_rows.is_empty() {
                            let mut drop = vec![false; rows.len()];
                            for (r, why) in bad_rows {
                                drop[r] = true;
                                bad[rows[r]] = Some(BadRecord::new(
                                    BadReason::SchemaMismatch,
                                    format!("schema id {id}: {why}"),
                                ));
                            }
                            let mut k = 0;
                            rows.retain(|_| {
                                k += 1;
                                !drop[k - 1]
                            });
                        }
                        if !rows.is_empty() {
                            pieces.push((batch, rows));
                        }
                    }
                    Err(why) => {
                        for &j in &rows {
                            bad[j] = Some(BadRecord::new(
                                BadReason::SchemaMismatch,
                                format!("schema id {id} does not fit the table: {why}"),
                            ));
                        }
                    }
                }
            }
        }
        merge_in_order(pieces, bad)
    }
}

#[cfg(feature = "protobuf")]
impl AvroValues {
    /// Protobuf payloads as JSON objects (empty for a bad one, `bad`
    /// filled in), for the JSON decoder.
    pub(crate) fn protobuf_json(
        &mut self,
        payloads: &[Option<&[u8]>],
        bad: &mut [Option<BadRecord>],
    ) -> Vec<Vec<u8>> {
        let mut out = vec![Vec::new(); payloads.len()];
        for (i, payload) in payloads.iter().enumerate() {
            if bad[i].is_some() {
                continue;
            }
            let undecodable = |m: String| Some(BadRecord::new(BadReason::Undecodable, m));
            let (payload, id) = match wire(*payload, "Protobuf") {
                Ok(w) => w,
                Err(b) => {
                    bad[i] = Some(b);
                    continue;
                }
            };
            match self.writers.get(&id) {
                Some(Writer::Proto(file)) => {
                    let result =
                        crate::protobuf::message_indexes(payload).and_then(|(indexes, at)| {
                            let desc = crate::protobuf::message_at(file, &indexes)?;
                            crate::protobuf::to_json(&desc, &payload[at..], &mut out[i])
                        });
                    if let Err(e) = result {
                        out[i].clear();
                        bad[i] = undecodable(format!("schema id {id}: {e}"));
                    }
                }
                Some(Writer::Bad(b)) => bad[i] = Some(b.clone()),
                _ => {
                    bad[i] = Some(BadRecord::new(
                        BadReason::SchemaMismatch,
                        format!("schema id {id} is not a Protobuf schema the source reads"),
                    ));
                }
            }
        }
        out
    }
}

/// Flushes `decoder`, which holds the rows of `rows` (positions in the
/// poll): their batch. arrow-avro checks some values only at the flush
/// (UTF-8 of strings, enum indexes), so when the flush fails each row is
/// decoded alone to find the bad ones; every row ends in a batch or bad,
/// and the decoder is left empty.
fn flush_rows(
    id: u32,
    avro: &str,
    decoder: &mut Decoder,
    rows: Vec<usize>,
    payloads: &[Option<&[u8]>],
    bad: &mut [Option<BadRecord>],
) -> Vec<(RecordBatch, Vec<usize>)> {
    match decoder.flush() {
        Ok(Some(batch)) if batch.num_rows() == rows.len() => return vec![(batch, rows)],
        Ok(None) if rows.is_empty() => return Vec::new(),
        _ => {}
    }
    // The flush failed (and the decoder may hold part of a batch): start
    // it afresh, and take each row alone.
    if let Ok(fresh) = decoder_for(id, avro, decoder.batch_size()) {
        *decoder = fresh;
    }
    let mut out = Vec::new();
    for j in rows {
        let one = decoder_for(id, avro, 2).and_then(|mut d| {
            feed(&mut d, payloads[j].unwrap_or_default())?;
            d.flush().map_err(|e| e.to_string())
        });
        match one {
            Ok(Some(batch)) if batch.num_rows() == 1 => out.push((batch, vec![j])),
            Ok(_) => {
                bad[j] = Some(BadRecord::new(
                    BadReason::Undecodable,
                    format!("schema id {id}: the datum decodes to no row"),
                ));
            }
            Err(e) => {
                bad[j] = Some(BadRecord::new(
                    BadReason::Undecodable,
                    format!("not an Avro datum of schema id {id}: {e}"),
                ));
            }
        }
    }
    out
}

/// One batch of the pieces' rows in poll order.
fn merge_in_order(
    mut pieces: Vec<(RecordBatch, Vec<usize>)>,
    bad: &mut [Option<BadRecord>],
) -> Option<RecordBatch> {
    match pieces.len() {
        0 => None,
        1 => pieces.pop().map(|(b, _)| b),
        _ => {
            let mut order: Vec<(usize, (usize, usize))> = pieces
                .iter()
                .enumerate()
                .flat_map(|(p, (_, rows))| rows.iter().enumerate().map(move |(r, &i)| (i, (p, r))))
                .collect();
            order.sort_unstable_by_key(|(i, _)| *i);
            let indices: Vec<(usize, usize)> = order.iter().map(|(_, at)| *at).collect();
            let batches: Vec<&RecordBatch> = pieces.iter().map(|(b, _)| b).collect();
            match arrow_select::interleave::interleave_record_batch(&batches, &indices) {
                Ok(b) => Some(b),
                Err(e) => {
                    // Cannot happen: every piece has the table's schema.
                    for (i, _) in order {
                        bad[i] = Some(BadRecord::new(
                            BadReason::SchemaMismatch,
                            format!("batches of two writer schemas do not merge: {e}"),
                        ));
                    }
                    None
                }
            }
        }
    }
}

/// Decodes one wire-format payload into `decoder`, which must then hold
/// exactly one more row and nothing else.
fn feed(decoder: &mut Decoder, payload: &[u8]) -> Result<(), String> {
    let before = decoder.capacity();
    let used = decoder.decode(payload).map_err(|e| e.to_string())?;
    if used < payload.len() || decoder.capacity() + 1 != before {
        return Err(if decoder.capacity() + 1 == before {
            format!(
                "{} bytes after the datum",
                payload.len().saturating_sub(used)
            )
        } else {
            "the datum ends early (truncated, or written with another schema)".to_owned()
        });
    }
    // Bytes after the datum that look like the start of another message
    // (a zero byte and this schema's id) leave the decoder waiting for a
    // body that the next record would fill. A decoder not waiting refuses a
    // byte that is not the magic byte without changing; one waiting does
    // something else.
    match decoder.decode(&[0xFF]) {
        Err(arrow_avro::errors::AvroError::ParseError(m))
            if m == "Missing magic bytes and fingerprint" =>
        {
            Ok(())
        }
        _ => Err("bytes after the datum".to_owned()),
    }
}

impl Drop for AvroValues {
    fn drop(&mut self) {
        if let Some(f) = self.fetch.take() {
            f.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;
    use arrow_schema::{DataType, Field, Schema};

    use super::*;

    const BID: &str = r#"{"type":"record","name":"Bid","fields":[
        {"name":"auction","type":"long"},
        {"name":"note","type":["null","string"],"default":null}]}"#;

    fn zigzag(v: i64, out: &mut Vec<u8>) {
        let mut z = ((v << 1) ^ (v >> 63)) as u64;
        loop {
            let b = (z & 0x7f) as u8;
            z >>= 7;
            if z == 0 {
                out.push(b);
                break;
            }
            out.push(b | 0x80);
        }
    }

    /// A bid in the wire format, as Confluent's serializer writes it.
    fn bid(id: u32, auction: i64, note: Option<&str>) -> Vec<u8> {
        let mut out = vec![0];
        out.extend(id.to_be_bytes());
        zigzag(auction, &mut out);
        match note {
            None => zigzag(0, &mut out),
            Some(n) => {
                zigzag(1, &mut out);
                zigzag(n.len() as i64, &mut out);
                out.extend(n.as_bytes());
            }
        }
        out
    }

    fn values() -> AvroValues {
        let registry =
            Registry::new(crate::registry::RegistryConfig::new("http://127.0.0.1:9")).expect("ok");
        let target = Arc::new(Schema::new(vec![
            Field::new("auction", DataType::Int64, false),
            Field::new("note", DataType::Utf8, true),
        ]));
        let mut v = AvroValues::new(
            registry,
            target,
            false,
            "test".to_owned(),
            None,
            SchemaCache::default(),
        );
        v.writers.insert(
            7,
            Writer::Ready {
                avro: BID.to_owned(),
                decoder: Box::new(decoder_for(7, BID, 16).expect("a valid schema")),
            },
        );
        v.rows = 16;
        v
    }

    fn decode(v: &mut AvroValues, payloads: &[Vec<u8>]) -> (Vec<i64>, Vec<Option<BadRecord>>) {
        let refs: Vec<Option<&[u8]>> = payloads.iter().map(|p| Some(p.as_slice())).collect();
        let mut bad = vec![None; refs.len()];
        let batch = v.decode(&refs, &mut bad);
        let auctions = batch.map_or_else(Vec::new, |b| {
            b.column(0).as_primitive::<Int64Type>().values().to_vec()
        });
        (auctions, bad)
    }

    #[test]
    fn good_records_decode_in_order_around_bad_ones() {
        let mut v = values();
        let mut truncated = bid(7, 3, Some("long note"));
        truncated.truncate(truncated.len() - 2);
        let mut trailing = bid(7, 5, None);
        trailing.extend([0, 0, 0, 0, 7]); // looks like the next message's start
        let mut garbage = bid(7, 6, None);
        garbage.push(0x42);
        let (auctions, bad) = decode(
            &mut v,
            &[
                bid(7, 1, Some("a")),
                b"{\"json\": 1}".to_vec(),
                bid(7, 2, None),
                truncated,
                bid(7, 4, Some("b")),
                trailing,
                garbage,
                bid(7, 8, None),
            ],
        );
        assert_eq!(auctions, vec![1, 2, 4, 8]);
        let reasons: Vec<Option<BadReason>> =
            bad.iter().map(|b| b.as_ref().map(|b| b.reason)).collect();
        use BadReason::Undecodable as U;
        assert_eq!(
            reasons,
            vec![None, Some(U), None, Some(U), None, Some(U), Some(U), None]
        );
        assert!(bad[1].as_ref().unwrap().detail.contains("wire format"));
        // The next poll starts clean.
        let (auctions, bad) = decode(&mut v, &[bid(7, 9, None)]);
        assert_eq!(auctions, vec![9]);
        assert!(bad[0].is_none());
    }

    #[test]
    fn a_string_that_is_not_utf8_makes_only_its_record_bad() {
        let mut v = values();
        let mut not_utf8 = bid(7, 2, Some("ab"));
        let at = not_utf8.len() - 2;
        not_utf8[at] = 0xff;
        let mut truncated = bid(7, 3, Some("long note"));
        truncated.truncate(truncated.len() - 2);
        let (auctions, bad) = decode(
            &mut v,
            &[bid(7, 1, None), not_utf8, truncated, bid(7, 4, Some("x"))],
        );
        assert_eq!(auctions, vec![1, 4]);
        assert!(bad[0].is_none() && bad[3].is_none(), "{bad:?}");
        assert!(bad[1].is_some() && bad[2].is_some(), "{bad:?}");
    }

    #[test]
    fn records_of_two_writer_schemas_keep_their_order_and_an_unknown_one_waits() {
        let mut v = values();
        let newer = r#"{"type":"record","name":"Bid","fields":[
            {"name":"auction","type":"int"},
            {"name":"note","type":["null","string"],"default":null},
            {"name":"extra","type":"long","default":0}]}"#;
        v.writers.insert(
            8,
            Writer::Ready {
                avro: newer.to_owned(),
                decoder: Box::new(decoder_for(8, newer, 16).expect("a valid schema")),
            },
        );
        let mut b = bid(8, 2, None);
        zigzag(99, &mut b); // extra
        assert!(!v.must_wait(Some(&b), String::new));
        assert!(v.must_wait(Some(&bid(9, 1, None)), String::new));
        let (auctions, bad) = decode(&mut v, &[bid(7, 1, None), b, bid(7, 3, None)]);
        assert!(bad.iter().all(Option::is_none), "{bad:?}");
        assert_eq!(auctions, vec![1, 2, 3]);
    }
}
