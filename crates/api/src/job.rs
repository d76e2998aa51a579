//! Building jobs: a typed, fluent API over a type-erased [`JobGraph`].
//!
//! ```
//! use tinyflow_api::{JobBuilder, JobId};
//! use tinyflow_api::testing::{CollectingSink, VecSource};
//!
//! let job = JobBuilder::new(JobId::new("word-lengths").unwrap());
//! let sink = CollectingSink::<(String, usize)>::new();
//! job.source("words", 2, VecSource::new(vec![vec!["a".to_owned(), "bb".into()], vec!["bb".into()]]))
//!     .map("length", |w: String| { let n = w.len(); (w, n) })
//!     .filter("long", |(_, n): &(String, usize)| *n > 1)
//!     .key_by(|(w, _): &(String, usize)| w.clone())
//!     .reduce("count", |acc: &mut (String, usize), (_, n)| acc.1 += n)
//!     .sink("out", 1, sink.clone());
//! let graph = job.build().unwrap();
//! assert_eq!(graph.nodes.len(), 5);
//! ```

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::marker::PhantomData;
use std::rc::Rc;
use std::sync::Arc;

use crate::data::{AnyBatch, key_group, owner_of_group};
use crate::engine::{
    ErasedOperatorFactory, ErasedSinkFactory, ErasedSourceFactory, ErasedWriterFactory,
    TypedOperatorFactory, TypedSinkFactory, TypedSourceFactory, TypedWriterFactory, downcast,
};
use crate::operator::Output;
use crate::{
    Data, JobId, Key, Operator, OperatorContext, OperatorFactory, OperatorState, SinkFactory,
    SourceFactory, StateValue, StreamError, StreamResult,
};

/// Index of a node in a [`JobGraph`].
pub type NodeId = usize;

/// A job as the runtime sees it: nodes (sources, operators, sinks) with a
/// parallelism each, and the edges between them.
#[derive(Debug)]
pub struct JobGraph {
    /// The job's stable id.
    pub job_id: JobId,
    /// Number of key groups (upper bound of any keyed operator's parallelism).
    pub max_parallelism: u16,
    /// Nodes in the order they were added (every edge goes from a lower
    /// index to a higher one).
    pub nodes: Vec<Node>,
    /// Edges.
    pub edges: Vec<Edge>,
}

/// One node of a [`JobGraph`].
pub struct Node {
    /// Unique name.
    pub name: String,
    /// Number of subtasks.
    pub parallelism: usize,
    /// What it is.
    pub kind: NodeKind,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            NodeKind::Source(_) => "source",
            NodeKind::Operator(_) => "operator",
            NodeKind::Sink(_) => "sink",
            NodeKind::Writer(_) => "writer",
        };
        write!(f, "{kind} {:?} x{}", self.name, self.parallelism)
    }
}

/// What a node does.
#[allow(
    missing_debug_implementations,
    reason = "holds factories of user code; Node's Debug names the kind"
)]
pub enum NodeKind {
    /// Reads from outside.
    Source(Box<dyn ErasedSourceFactory>),
    /// Transforms.
    Operator(Box<dyn ErasedOperatorFactory>),
    /// Writes to outside with two-phase commit.
    Sink(Box<dyn ErasedSinkFactory>),
    /// Writes in parallel and sends what it wrote (committables) downstream
    /// on every barrier, before the barrier: the first stage of a sink whose
    /// committer is the next node.
    Writer(Box<dyn ErasedWriterFactory>),
}

/// How records move from the subtasks of one node to those of the next.
#[derive(Clone)]
pub enum Partitioning {
    /// Subtask i to subtask i (equal parallelism).
    Forward,
    /// Batches round-robin over the downstream subtasks.
    Rebalance,
    /// Each record to the subtask owning its key's group.
    Hash(Arc<dyn Partitioner>),
}

impl fmt::Debug for Partitioning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Partitioning::Forward => "Forward",
            Partitioning::Rebalance => "Rebalance",
            Partitioning::Hash(_) => "Hash",
        })
    }
}

/// Splits a batch by key over downstream subtasks.
pub trait Partitioner: Send + Sync {
    /// `(target subtask, records)` pairs, each target at most once.
    fn partition(
        &self,
        batch: AnyBatch,
        max_parallelism: u16,
        targets: usize,
    ) -> StreamResult<Vec<(usize, AnyBatch)>>;
}

/// An edge of a [`JobGraph`].
#[derive(Debug, Clone)]
pub struct Edge {
    /// Upstream node.
    pub from: NodeId,
    /// Downstream node.
    pub to: NodeId,
    /// How records are distributed.
    pub partitioning: Partitioning,
}

#[derive(Default)]
struct GraphInner {
    nodes: Vec<Node>,
    edges: Vec<(NodeId, NodeId, Option<Partitioning>)>,
    max_parallelism: Option<u16>,
}

/// Builds a [`JobGraph`] with typed streams. See the module docs.
pub struct JobBuilder {
    job_id: JobId,
    inner: Rc<RefCell<GraphInner>>,
}

impl fmt::Debug for JobBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobBuilder({})", self.job_id)
    }
}

impl JobBuilder {
    /// A builder for job `job_id`.
    pub fn new(job_id: JobId) -> Self {
        JobBuilder {
            job_id,
            inner: Rc::default(),
        }
    }

    /// Sets the number of key groups (default
    /// [`DEFAULT_MAX_PARALLELISM`](crate::DEFAULT_MAX_PARALLELISM)). Keep it
    /// fixed for the life of a job: restored keyed state depends on it.
    pub fn max_parallelism(&self, n: u16) -> &Self {
        self.inner.borrow_mut().max_parallelism = Some(n);
        self
    }

    /// Adds a source with `parallelism` subtasks.
    pub fn source<T: Data>(
        &self,
        name: &str,
        parallelism: usize,
        factory: impl SourceFactory<T> + 'static,
    ) -> Stream<T> {
        let kind = NodeKind::Source(Box::new(TypedSourceFactory(factory, PhantomData)));
        let node = add_node(&self.inner, name, parallelism, kind);
        Stream {
            graph: Rc::clone(&self.inner),
            node,
            next: None,
            _t: PhantomData,
        }
    }

    /// Validates and returns the graph.
    pub fn build(self) -> StreamResult<JobGraph> {
        let inner = Rc::try_unwrap(self.inner)
            .map_err(|_| {
                graph_err("a Stream of this job is still alive; drop every Stream before build()")
            })?
            .into_inner();
        let max_parallelism = inner
            .max_parallelism
            .unwrap_or(crate::DEFAULT_MAX_PARALLELISM);
        if max_parallelism == 0 {
            return Err(graph_err("max_parallelism must be at least 1"));
        }
        let mut names = BTreeSet::new();
        for node in &inner.nodes {
            if !names.insert(node.name.as_str()) {
                return Err(graph_err(format!("two nodes are named {:?}", node.name)));
            }
            if node.parallelism == 0 || node.parallelism > usize::from(max_parallelism) {
                return Err(graph_err(format!(
                    "{:?} has parallelism {}, expected 1 to max_parallelism {max_parallelism}",
                    node.name, node.parallelism
                )));
            }
        }
        if !inner
            .nodes
            .iter()
            .any(|n| matches!(n.kind, NodeKind::Source(_)))
        {
            return Err(graph_err("the job has no source"));
        }
        let mut edges = Vec::new();
        for (from, to, partitioning) in inner.edges {
            let (pf, pt) = (inner.nodes[from].parallelism, inner.nodes[to].parallelism);
            let partitioning = match partitioning {
                Some(Partitioning::Forward) if pf != pt => {
                    return Err(graph_err(format!(
                        "forward edge {:?} -> {:?} joins parallelism {pf} to {pt}",
                        inner.nodes[from].name, inner.nodes[to].name
                    )));
                }
                Some(p) => p,
                None if pf == pt => Partitioning::Forward,
                None => Partitioning::Rebalance,
            };
            edges.push(Edge {
                from,
                to,
                partitioning,
            });
        }
        for (i, node) in inner.nodes.iter().enumerate() {
            let has_input = edges.iter().any(|e| e.to == i);
            if !matches!(node.kind, NodeKind::Source(_)) && !has_input {
                return Err(graph_err(format!("{:?} has no input", node.name)));
            }
        }
        Ok(JobGraph {
            job_id: self.job_id,
            max_parallelism,
            nodes: inner.nodes,
            edges,
        })
    }
}

fn graph_err(message: impl Into<String>) -> StreamError {
    StreamError::Graph {
        message: message.into(),
    }
}

fn add_node(
    inner: &Rc<RefCell<GraphInner>>,
    name: &str,
    parallelism: usize,
    kind: NodeKind,
) -> NodeId {
    let mut g = inner.borrow_mut();
    g.nodes.push(Node {
        name: name.to_owned(),
        parallelism,
        kind,
    });
    g.nodes.len() - 1
}

/// A typed stream of records in a job being built.
pub struct Stream<T> {
    graph: Rc<RefCell<GraphInner>>,
    node: NodeId,
    next: Option<Partitioning>,
    _t: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for Stream<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Stream<{}>(node {})",
            std::any::type_name::<T>(),
            self.node
        )
    }
}

impl<T: Data> Stream<T> {
    /// Sets the parallelism of the node that produces this stream.
    pub fn parallelism(self, parallelism: usize) -> Self {
        self.graph.borrow_mut().nodes[self.node].parallelism = parallelism;
        self
    }

    /// Spreads batches round-robin over the next operator's subtasks.
    pub fn rebalance(mut self) -> Self {
        self.next = Some(Partitioning::Rebalance);
        self
    }

    /// Keeps subtask i feeding subtask i (the default for equal parallelism).
    pub fn forward(mut self) -> Self {
        self.next = Some(Partitioning::Forward);
        self
    }

    /// Splits each batch over the next operator's subtasks with
    /// `partitioner` (Flink's `partitionCustom`): a sink that routes rows by
    /// what it will write them as, such as an Iceberg sink by table
    /// partition. The next operator sees no keyed state from it.
    pub fn partition_custom(mut self, partitioner: Arc<dyn Partitioner>) -> Self {
        self.next = Some(Partitioning::Hash(partitioner));
        self
    }

    pub(crate) fn then<U: Data>(
        self,
        name: &str,
        factory: impl OperatorFactory<T, U> + 'static,
    ) -> Stream<U> {
        let parallelism = self.graph.borrow().nodes[self.node].parallelism;
        let kind = NodeKind::Operator(Box::new(TypedOperatorFactory(factory, PhantomData)));
        self.connect(name, parallelism, kind)
    }

    /// Adds a node fed by this stream (with the partitioning set on it) and
    /// returns the node's output stream.
    fn connect<U: Data>(self, name: &str, parallelism: usize, kind: NodeKind) -> Stream<U> {
        let node = add_node(&self.graph, name, parallelism, kind);
        self.graph
            .borrow_mut()
            .edges
            .push((self.node, node, self.next));
        Stream {
            graph: self.graph,
            node,
            next: None,
            _t: PhantomData,
        }
    }

    /// A second handle on the same node, for a second consumer (records are
    /// cloned to each).
    pub(crate) fn branch(&self) -> Stream<T> {
        Stream {
            graph: Rc::clone(&self.graph),
            node: self.node,
            next: None,
            _t: PhantomData,
        }
    }

    /// Adds a keyed operator fed by hash partitioning on `key`.
    pub(crate) fn then_keyed<K: Key, U: Data>(
        mut self,
        name: &str,
        key: &KeyFn<K, T>,
        factory: impl OperatorFactory<T, U> + 'static,
    ) -> Stream<U> {
        self.next = Some(Partitioning::Hash(Arc::new(HashPartitioner {
            key: Arc::clone(key),
        })));
        self.then(name, factory)
    }

    /// Adds a custom [`Operator`]; `factory` creates one instance per
    /// subtask (a closure `|ctx: &OperatorContext| Ok(MyOperator::new(ctx))`
    /// will do).
    pub fn transform<U: Data>(
        self,
        name: &str,
        factory: impl OperatorFactory<T, U> + 'static,
    ) -> Stream<U> {
        self.then(name, factory)
    }

    /// Turns each batch into another with `f`, which may fail: an error
    /// fails the job attempt (it restarts from the last checkpoint), so use
    /// it for what retrying can mend or what must stop the job, and keep
    /// bad records out of the batch otherwise.
    ///
    /// ```
    /// use tinyflow_api::{JobBuilder, JobId, StreamError};
    /// use tinyflow_api::testing::{CollectingSink, VecSource};
    ///
    /// let job = JobBuilder::new(JobId::new("parse").unwrap());
    /// let sink = CollectingSink::<u64>::new();
    /// job.source("text", 1, VecSource::new(vec![vec!["1".to_owned(), "2".into()]]))
    ///     .try_map("parse", |batch: Vec<String>| {
    ///         batch
    ///             .iter()
    ///             .map(|s| s.parse::<u64>().map_err(|e| StreamError::User {
    ///                 operator: "parse".to_owned(),
    ///                 message: format!("{s:?}: {e}"),
    ///             }))
    ///             .collect()
    ///     })
    ///     .sink("out", 1, sink.clone());
    /// assert!(job.build().is_ok());
    /// ```
    pub fn try_map<U: Data>(
        self,
        name: &str,
        f: impl Fn(Vec<T>) -> StreamResult<Vec<U>> + Clone + Send + Sync + 'static,
    ) -> Stream<U> {
        self.then(name, move |_: &OperatorContext| {
            Ok(Stateless::<T, U, _>::new(f.clone()))
        })
    }

    /// Adds a stateless operator that turns each batch into another.
    fn per_batch<U: Data>(
        self,
        name: &str,
        f: impl Fn(Vec<T>) -> Vec<U> + Clone + Send + Sync + 'static,
    ) -> Stream<U> {
        self.try_map(name, move |records: Vec<T>| Ok(f(records)))
    }

    /// Applies `f` to every record.
    pub fn map<U: Data>(
        self,
        name: &str,
        f: impl Fn(T) -> U + Clone + Send + Sync + 'static,
    ) -> Stream<U> {
        self.per_batch(name, move |records: Vec<T>| {
            records.into_iter().map(&f).collect()
        })
    }

    /// Keeps the records for which `f` is true.
    pub fn filter(
        self,
        name: &str,
        f: impl Fn(&T) -> bool + Clone + Send + Sync + 'static,
    ) -> Stream<T> {
        self.per_batch(name, move |mut records: Vec<T>| {
            records.retain(&f);
            records
        })
    }

    /// Maps every record to zero or more records.
    pub fn flat_map<U: Data, I: IntoIterator<Item = U>>(
        self,
        name: &str,
        f: impl Fn(T) -> I + Clone + Send + Sync + 'static,
    ) -> Stream<U> {
        self.per_batch(name, move |records: Vec<T>| {
            records.into_iter().flat_map(&f).collect()
        })
    }

    /// Partitions the stream by key: the next operator sees every record of
    /// a key in the same subtask, with keyed state.
    pub fn key_by<K: Key>(
        self,
        key: impl Fn(&T) -> K + Send + Sync + 'static,
    ) -> KeyedStream<K, T> {
        KeyedStream {
            stream: self,
            key: Arc::new(key),
        }
    }

    /// Adds a parallel [`crate::Writer`] with `parallelism` subtasks: it
    /// writes this stream's records and, on every barrier, sends its
    /// committables (`C`) downstream, typically to a committer sink of
    /// parallelism 1. The writer never shares a task with the next node.
    pub fn write<C: Data>(
        self,
        name: &str,
        parallelism: usize,
        factory: impl crate::WriterFactory<T, C> + 'static,
    ) -> Stream<C> {
        let kind = NodeKind::Writer(Box::new(TypedWriterFactory(factory, PhantomData)));
        self.connect(name, parallelism, kind)
    }

    /// Ends the stream in a two-phase-commit sink with `parallelism` subtasks.
    pub fn sink(self, name: &str, parallelism: usize, factory: impl SinkFactory<T> + 'static) {
        let kind = NodeKind::Sink(Box::new(TypedSinkFactory(factory, PhantomData)));
        // A sink has no output: the handle on it is dropped.
        let _: Stream<T> = self.connect(name, parallelism, kind);
    }
}

pub(crate) type KeyFn<K, T> = Arc<dyn Fn(&T) -> K + Send + Sync>;

/// A stream partitioned by key; see [`Stream::key_by`].
pub struct KeyedStream<K, T> {
    stream: Stream<T>,
    key: KeyFn<K, T>,
}

impl<K, T> fmt::Debug for KeyedStream<K, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KeyedStream<{}, {}>",
            std::any::type_name::<K>(),
            std::any::type_name::<T>()
        )
    }
}

impl<K: Key, T: StateValue> KeyedStream<K, T> {
    /// Folds every record of a key into the key's current value with `f`
    /// (the first record is the initial value) and emits the updated value
    /// after each record. The values are keyed state: checkpointed,
    /// restored, and redistributed on rescale.
    pub fn reduce(
        self,
        name: &str,
        f: impl Fn(&mut T, T) + Clone + Send + Sync + 'static,
    ) -> Stream<T> {
        let (stream, key) = self.into_parts();
        let factory = ReduceFactory {
            key: Arc::clone(&key),
            f,
            name: name.to_owned(),
        };
        stream.then_keyed(name, &key, factory)
    }
}

impl<K: Key, T: Data> KeyedStream<K, T> {
    /// Adds a custom keyed operator: every record of a key reaches the same
    /// subtask. Its snapshot must file keyed state under each key's
    /// [`key_group`](crate::key_group), so restore can redistribute it.
    pub fn transform<U: Data>(
        self,
        name: &str,
        factory: impl OperatorFactory<T, U> + 'static,
    ) -> Stream<U> {
        let (stream, key) = self.into_parts();
        stream.then_keyed(name, &key, factory)
    }
}

impl<K, T> KeyedStream<K, T> {
    pub(crate) fn into_parts(self) -> (Stream<T>, KeyFn<K, T>) {
        (self.stream, self.key)
    }
}

struct HashPartitioner<K, T> {
    key: KeyFn<K, T>,
}

impl<K: Key, T: Data> Partitioner for HashPartitioner<K, T> {
    fn partition(
        &self,
        batch: AnyBatch,
        max_parallelism: u16,
        targets: usize,
    ) -> StreamResult<Vec<(usize, AnyBatch)>> {
        let records = downcast::<T>(batch, "key_by")?;
        if targets == 1 {
            return Ok(vec![(0, AnyBatch::new(records))]);
        }
        let mut split: Vec<Vec<T>> = (0..targets).map(|_| Vec::new()).collect();
        for r in records {
            let group = key_group(&(self.key)(&r), max_parallelism);
            split[owner_of_group(group, max_parallelism, targets)].push(r);
        }
        Ok(split
            .into_iter()
            .enumerate()
            .filter(|(_, v)| !v.is_empty())
            .map(|(i, v)| (i, AnyBatch::new(v)))
            .collect())
    }
}

struct Stateless<T, U, F> {
    f: F,
    _t: PhantomData<fn(T) -> U>,
}

impl<T, U, F> Stateless<T, U, F> {
    fn new(f: F) -> Self {
        Stateless { f, _t: PhantomData }
    }
}

impl<T: Data, U: Data, F: FnMut(Vec<T>) -> StreamResult<Vec<U>> + Send> Operator<T, U>
    for Stateless<T, U, F>
{
    fn process(&mut self, batch: Vec<T>, out: &mut Output<'_, U>) -> StreamResult<()> {
        out.emit((self.f)(batch)?);
        Ok(())
    }
}

struct ReduceFactory<K, T, F> {
    key: KeyFn<K, T>,
    f: F,
    name: String,
}

impl<K: Key, T: StateValue, F: Fn(&mut T, T) + Clone + Send + Sync + 'static> OperatorFactory<T, T>
    for ReduceFactory<K, T, F>
{
    fn create(&self, ctx: &OperatorContext) -> StreamResult<Box<dyn Operator<T, T>>> {
        Ok(Box::new(Reduce {
            key: Arc::clone(&self.key),
            f: self.f.clone(),
            name: self.name.clone(),
            max_parallelism: ctx.max_parallelism,
            values: HashMap::new(),
        }))
    }
}

struct Reduce<K, T, F> {
    key: KeyFn<K, T>,
    f: F,
    name: String,
    max_parallelism: u16,
    values: HashMap<K, T>,
}

impl<K: Key, T: StateValue, F: Fn(&mut T, T) + Send> Operator<T, T> for Reduce<K, T, F> {
    fn process(&mut self, records: Vec<T>, out: &mut Output<'_, T>) -> StreamResult<()> {
        let mut updated = Vec::with_capacity(records.len());
        for r in records {
            let k = (self.key)(&r);
            let value = match self.values.entry(k) {
                std::collections::hash_map::Entry::Occupied(mut e) => {
                    (self.f)(e.get_mut(), r);
                    e.into_mut()
                }
                std::collections::hash_map::Entry::Vacant(e) => e.insert(r),
            };
            updated.push(value.clone());
        }
        out.emit(updated);
        Ok(())
    }

    fn snapshot(&mut self) -> StreamResult<OperatorState> {
        let mut groups: std::collections::BTreeMap<u16, Vec<(&K, &T)>> =
            std::collections::BTreeMap::new();
        for (k, v) in &self.values {
            groups
                .entry(key_group(k, self.max_parallelism))
                .or_default()
                .push((k, v));
        }
        let mut state = OperatorState::default();
        for (g, entries) in groups {
            let bytes = postcard::to_allocvec(&entries).map_err(|e| StreamError::State {
                operator: self.name.clone(),
                action: "encoded",
                message: e.to_string(),
            })?;
            state.keyed.insert(g, bytes);
        }
        Ok(state)
    }

    fn restore(&mut self, state: OperatorState) -> StreamResult<()> {
        for bytes in state.keyed.values() {
            let entries: Vec<(K, T)> =
                postcard::from_bytes(bytes).map_err(|e| StreamError::State {
                    operator: self.name.clone(),
                    action: "decoded",
                    message: e.to_string(),
                })?;
            self.values.extend(entries);
        }
        Ok(())
    }
}
