//! Event time: watermarks and tumbling windows.
//!
//! [`Stream::watermarks`] reads each record's event time and emits
//! watermarks that trail the highest time seen by a bounded
//! out-of-orderness. Operators downstream see the minimum watermark over
//! their inputs. [`KeyedStream::window_aggregate`] folds records into
//! tumbling event-time windows per key and emits a result when the watermark
//! passes a window's end; records up to `allowed_lateness` behind still
//! update (and re-emit) their window, later ones are counted and offered as
//! a side output.
//!
//! ```
//! use std::time::Duration;
//! use tinyflow_api::{JobBuilder, JobId, TumblingWindows};
//! use tinyflow_api::testing::{CollectingSink, VecSource};
//!
//! #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
//! struct Bid { auction: u64, price: u64, ts: i64 }
//!
//! let job = JobBuilder::new(JobId::new("bids-per-auction").unwrap());
//! let counts = CollectingSink::<(u64, i64, u64)>::new();
//! let bids = vec![Bid { auction: 1, price: 10, ts: 1_000 }, Bid { auction: 1, price: 12, ts: 4_000 }];
//! let (results, late) = job
//!     .source("bids", 1, VecSource::new(vec![bids]))
//!     .watermarks("event-time", |b: &Bid| b.ts, Duration::from_secs(1))
//!     .key_by(|b: &Bid| b.auction)
//!     .window_aggregate(
//!         "count",
//!         TumblingWindows::of(Duration::from_secs(10), |b: &Bid| b.ts),
//!         || 0u64,
//!         |n, _bid| *n += 1,
//!         |auction, window, n| (*auction, window.start, *n),
//!     )
//!     .split("results", "late");
//! results.sink("out", 1, counts.clone());
//! drop(late);
//! assert!(job.build().is_ok());
//! ```

use std::collections::{BTreeMap, HashMap};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::data::key_group;
use crate::job::{KeyedStream, Stream};
use crate::operator::Output;
use crate::{
    Data, Key, Operator, OperatorContext, OperatorFactory, OperatorState, StateValue, StreamError,
    StreamResult,
};

/// A window of event time, `[start, end)` in ms since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Window {
    /// First instant inside.
    pub start: i64,
    /// First instant after.
    pub end: i64,
}

type TsFn<T> = Arc<dyn Fn(&T) -> i64 + Send + Sync>;

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Tumbling event-time windows of a fixed size.
pub struct TumblingWindows<T> {
    size: i64,
    allowed_lateness: i64,
    timestamp: TsFn<T>,
}

impl<T> std::fmt::Debug for TumblingWindows<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TumblingWindows(size {} ms, lateness {} ms)",
            self.size, self.allowed_lateness
        )
    }
}

impl<T> TumblingWindows<T> {
    /// Windows of `size` (at least 1 ms), over the event time `timestamp`
    /// returns (ms since the Unix epoch).
    pub fn of(size: Duration, timestamp: impl Fn(&T) -> i64 + Send + Sync + 'static) -> Self {
        TumblingWindows {
            size: millis(size).max(1),
            allowed_lateness: 0,
            timestamp: Arc::new(timestamp),
        }
    }

    /// Keeps windows open this long after the watermark passed their end,
    /// re-emitting a window's result for each record that still arrives.
    pub fn allowed_lateness(mut self, lateness: Duration) -> Self {
        self.allowed_lateness = millis(lateness);
        self
    }

    fn window_of(&self, ts: i64) -> Window {
        let start = ts - ts.rem_euclid(self.size);
        Window {
            start,
            end: start.saturating_add(self.size),
        }
    }
}

/// What a windowed aggregation emits: results, and records that came too
/// late for their window.
#[derive(Debug, Clone, PartialEq)]
pub enum WindowOutput<O, T> {
    /// A window's result.
    Result(O),
    /// A record behind the watermark by more than the allowed lateness.
    Late(T),
}

/// The output of [`KeyedStream::window_aggregate`].
pub struct WindowedStream<O, T> {
    stream: Stream<WindowOutput<O, T>>,
}

impl<O, T> std::fmt::Debug for WindowedStream<O, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WindowedStream({:?})", self.stream)
    }
}

impl<O: Data, T: Data> WindowedStream<O, T> {
    /// Sets the window operator's parallelism.
    pub fn parallelism(self, parallelism: usize) -> Self {
        WindowedStream {
            stream: self.stream.parallelism(parallelism),
        }
    }

    /// The results only (late records are counted and dropped).
    pub fn results(self, name: &str) -> Stream<O> {
        self.stream.flat_map(name, |o: WindowOutput<O, T>| match o {
            WindowOutput::Result(r) => Some(r),
            WindowOutput::Late(_) => None,
        })
    }

    /// The results and, as a side output, the late records.
    pub fn split(self, results: &str, late: &str) -> (Stream<O>, Stream<T>) {
        let late_stream = self
            .stream
            .branch()
            .flat_map(late, |o: WindowOutput<O, T>| match o {
                WindowOutput::Late(t) => Some(t),
                WindowOutput::Result(_) => None,
            });
        (self.results(results), late_stream)
    }
}

impl<T: Data> Stream<T> {
    /// Assigns event time with `timestamp` and emits watermarks trailing the
    /// highest time seen by `max_out_of_orderness`.
    pub fn watermarks(
        self,
        name: &str,
        timestamp: impl Fn(&T) -> i64 + Send + Sync + 'static,
        max_out_of_orderness: Duration,
    ) -> Stream<T> {
        let timestamp: TsFn<T> = Arc::new(timestamp);
        let bound = millis(max_out_of_orderness);
        let name_owned = name.to_owned();
        self.then(name, move |_: &OperatorContext| {
            Ok(WatermarkGenerator {
                name: name_owned.clone(),
                timestamp: Arc::clone(&timestamp),
                bound,
                max_seen: i64::MIN,
                emitted: i64::MIN,
                _t: PhantomData,
            })
        })
    }
}

struct WatermarkGenerator<T> {
    name: String,
    timestamp: TsFn<T>,
    bound: i64,
    max_seen: i64,
    emitted: i64,
    _t: PhantomData<fn(T)>,
}

impl<T: Data> Operator<T, T> for WatermarkGenerator<T> {
    fn process(&mut self, records: Vec<T>, out: &mut Output<'_, T>) -> StreamResult<()> {
        if let Some(max) = records.iter().map(|r| (self.timestamp)(r)).max() {
            self.max_seen = self.max_seen.max(max);
        }
        out.emit(records);
        let wm = self.max_seen.saturating_sub(self.bound);
        if wm > self.emitted {
            self.emitted = wm;
            out.watermark(wm);
        }
        Ok(())
    }

    fn snapshot(&mut self) -> StreamResult<OperatorState> {
        let local = encode(&self.name, &(self.max_seen, self.emitted))?;
        Ok(OperatorState {
            keyed: BTreeMap::new(),
            local: Some(local),
        })
    }

    fn restore(&mut self, state: OperatorState) -> StreamResult<()> {
        if let Some(bytes) = state.local {
            (self.max_seen, self.emitted) = decode(&self.name, &bytes)?;
        }
        Ok(())
    }

    /// Upstream watermarks are replaced by this one's, except the final one.
    fn on_watermark(&mut self, watermark: i64, out: &mut Output<'_, T>) -> StreamResult<()> {
        if watermark == i64::MAX {
            self.emitted = i64::MAX;
            out.watermark(i64::MAX);
        }
        Ok(())
    }
}

impl<K: Key, T: StateValue> KeyedStream<K, T> {
    /// Aggregates each key's records per tumbling event-time window:
    /// `init` creates a window's accumulator, `add` folds a record in, and
    /// `result` turns it into the output emitted when the watermark passes
    /// the window's end (and again for each allowed late record).
    pub fn window_aggregate<A: StateValue, O: Data>(
        self,
        name: &str,
        windows: TumblingWindows<T>,
        init: impl Fn() -> A + Send + Sync + 'static,
        add: impl Fn(&mut A, T) + Send + Sync + 'static,
        result: impl Fn(&K, Window, &A) -> O + Send + Sync + 'static,
    ) -> WindowedStream<O, T> {
        let agg = Arc::new(Aggregation {
            windows,
            init,
            add,
            result,
            _p: PhantomData,
        });
        let name_owned = name.to_owned();
        let (stream, key) = self.into_parts();
        let stream = stream.then_keyed(
            name,
            &key,
            WindowFactory {
                agg,
                key: Arc::clone(&key),
                name: name_owned,
            },
        );
        WindowedStream { stream }
    }
}

struct Aggregation<K, T, A, O, I, F, R> {
    windows: TumblingWindows<T>,
    init: I,
    add: F,
    result: R,
    _p: PhantomData<fn(K, A) -> O>,
}

trait WindowAgg<K, T, A, O>: Send + Sync {
    fn windows(&self) -> &TumblingWindows<T>;
    fn init(&self) -> A;
    fn add(&self, acc: &mut A, record: T);
    fn result(&self, key: &K, window: Window, acc: &A) -> O;
}

impl<K, T, A, O, I, F, R> WindowAgg<K, T, A, O> for Aggregation<K, T, A, O, I, F, R>
where
    I: Fn() -> A + Send + Sync,
    F: Fn(&mut A, T) + Send + Sync,
    R: Fn(&K, Window, &A) -> O + Send + Sync,
    TumblingWindows<T>: Send + Sync,
{
    fn windows(&self) -> &TumblingWindows<T> {
        &self.windows
    }
    fn init(&self) -> A {
        (self.init)()
    }
    fn add(&self, acc: &mut A, record: T) {
        (self.add)(acc, record);
    }
    fn result(&self, key: &K, window: Window, acc: &A) -> O {
        (self.result)(key, window, acc)
    }
}

struct WindowFactory<K, T, A, O> {
    agg: Arc<dyn WindowAgg<K, T, A, O>>,
    key: Arc<dyn Fn(&T) -> K + Send + Sync>,
    name: String,
}

impl<K: Key, T: StateValue, A: StateValue, O: Data> OperatorFactory<T, WindowOutput<O, T>>
    for WindowFactory<K, T, A, O>
{
    fn create(
        &self,
        ctx: &OperatorContext,
    ) -> StreamResult<Box<dyn Operator<T, WindowOutput<O, T>>>> {
        Ok(Box::new(WindowOperator {
            agg: Arc::clone(&self.agg),
            key: Arc::clone(&self.key),
            name: self.name.clone(),
            max_parallelism: ctx.max_parallelism,
            windows: BTreeMap::new(),
            watermark: i64::MIN,
            late: 0,
        }))
    }
}

struct Slot<A> {
    acc: A,
    fired: bool,
}

struct WindowOperator<K, T, A, O> {
    agg: Arc<dyn WindowAgg<K, T, A, O>>,
    key: Arc<dyn Fn(&T) -> K + Send + Sync>,
    name: String,
    max_parallelism: u16,
    /// Open windows by start, then key.
    windows: BTreeMap<i64, HashMap<K, Slot<A>>>,
    watermark: i64,
    late: u64,
}

impl<K: Key, T: StateValue, A: StateValue, O: Data> WindowOperator<K, T, A, O> {
    fn cleanup_time(&self, w: Window) -> i64 {
        (w.end - 1).saturating_add(self.agg.windows().allowed_lateness)
    }
}

impl<K: Key, T: StateValue, A: StateValue, O: Data> Operator<T, WindowOutput<O, T>>
    for WindowOperator<K, T, A, O>
{
    fn process(
        &mut self,
        records: Vec<T>,
        out: &mut Output<'_, WindowOutput<O, T>>,
    ) -> StreamResult<()> {
        let mut emitted: Vec<WindowOutput<O, T>> = Vec::new();
        for r in records {
            let w = self
                .agg
                .windows()
                .window_of((self.agg.windows().timestamp)(&r));
            if self.cleanup_time(w) <= self.watermark {
                self.late += 1;
                tracing::debug!(operator = %self.name, window_start = w.start, watermark = self.watermark, late_total = self.late, "late record");
                emitted.push(WindowOutput::Late(r));
                continue;
            }
            let k = (self.key)(&r);
            let slot = self
                .windows
                .entry(w.start)
                .or_default()
                .entry(k.clone())
                .or_insert_with(|| Slot {
                    acc: self.agg.init(),
                    fired: false,
                });
            self.agg.add(&mut slot.acc, r);
            if slot.fired {
                // A late record within the allowed lateness updates the result.
                emitted.push(WindowOutput::Result(self.agg.result(&k, w, &slot.acc)));
            }
        }
        out.emit(emitted);
        Ok(())
    }

    fn on_watermark(
        &mut self,
        watermark: i64,
        out: &mut Output<'_, WindowOutput<O, T>>,
    ) -> StreamResult<()> {
        self.watermark = watermark;
        let size = self.agg.windows().size;
        let mut emitted: Vec<WindowOutput<O, T>> = Vec::new();
        for (start, keys) in self.windows.range_mut(..) {
            let w = Window {
                start: *start,
                end: start.saturating_add(size),
            };
            if w.end - 1 > watermark {
                break;
            }
            for (k, slot) in keys.iter_mut().filter(|(_, s)| !s.fired) {
                slot.fired = true;
                emitted.push(WindowOutput::Result(self.agg.result(k, w, &slot.acc)));
            }
        }
        let lateness = self.agg.windows().allowed_lateness;
        self.windows.retain(|start, _| {
            (start.saturating_add(size) - 1).saturating_add(lateness) > watermark
        });
        out.emit(emitted);
        out.watermark(watermark);
        Ok(())
    }

    fn snapshot(&mut self) -> StreamResult<OperatorState> {
        let mut groups: BTreeMap<u16, Vec<(&K, i64, &A, bool)>> = BTreeMap::new();
        for (start, keys) in &self.windows {
            for (k, slot) in keys {
                groups
                    .entry(key_group(k, self.max_parallelism))
                    .or_default()
                    .push((k, *start, &slot.acc, slot.fired));
            }
        }
        // The watermark decides which records are late: keep it, so a
        // restored job classifies replayed records as the first run did.
        let mut state = OperatorState {
            keyed: BTreeMap::new(),
            local: Some(encode(&self.name, &self.watermark)?),
        };
        for (g, entries) in groups {
            state.keyed.insert(g, encode(&self.name, &entries)?);
        }
        Ok(state)
    }

    fn restore(&mut self, state: OperatorState) -> StreamResult<()> {
        if let Some(bytes) = &state.local {
            self.watermark = decode(&self.name, bytes)?;
        }
        for bytes in state.keyed.values() {
            let entries: Vec<(K, i64, A, bool)> = decode(&self.name, bytes)?;
            for (k, start, acc, fired) in entries {
                self.windows
                    .entry(start)
                    .or_default()
                    .insert(k, Slot { acc, fired });
            }
        }
        Ok(())
    }
}

fn encode<S: Serialize>(operator: &str, value: &S) -> StreamResult<Vec<u8>> {
    postcard::to_allocvec(value).map_err(|e| StreamError::State {
        operator: operator.to_owned(),
        action: "encoded",
        message: e.to_string(),
    })
}

fn decode<D: serde::de::DeserializeOwned>(operator: &str, bytes: &[u8]) -> StreamResult<D> {
    postcard::from_bytes(bytes).map_err(|e| StreamError::State {
        operator: operator.to_owned(),
        action: "decoded",
        message: e.to_string(),
    })
}
