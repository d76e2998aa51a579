//! Task snapshots inside checkpoints, and how a restored checkpoint is
//! handed back to a job (possibly with different parallelism).
//!
//! Every task acks with a [`TaskSnapshot`] naming its nodes and subtask, so a
//! restore depends neither on task ids nor on how nodes were chained. Keyed state is
//! merged over all old subtasks and split again by key-group ranges; source
//! positions and sink staging are handed to the new instances whole, for the
//! source or sink to divide.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use tinyflow_api::engine::key_groups_of;
use tinyflow_api::{CheckpointId, OperatorState, StreamError, StreamResult};
use tinyflow_checkpoint::{CompletedCheckpoint, StateHandle};

/// What one task (a chain of nodes) contributes to a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSnapshot {
    /// The subtask index (the same for every node of a chain).
    pub subtask: u32,
    /// Each node's name and state, in chain order.
    pub nodes: Vec<(String, NodeState)>,
}

/// The state of one subtask, by node kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeState {
    /// A source's position.
    Source(Vec<u8>),
    /// An operator's keyed and local state.
    Operator(OperatorState),
    /// A sink's staged, uncommitted work.
    Sink(Vec<u8>),
}

impl TaskSnapshot {
    /// Encodes into a state handle.
    pub fn encode(&self) -> StreamResult<StateHandle> {
        postcard::to_allocvec(self)
            .map(StateHandle::from)
            .map_err(|e| StreamError::State {
                operator: self
                    .nodes
                    .first()
                    .map(|(n, _)| n.clone())
                    .unwrap_or_default(),
                action: "encoded",
                message: e.to_string(),
            })
    }

    /// Decodes a state handle.
    pub fn decode(handle: &StateHandle) -> StreamResult<Self> {
        postcard::from_bytes(handle.as_bytes()).map_err(|e| StreamError::State {
            operator: "<unknown>".into(),
            action: "decoded",
            message: e.to_string(),
        })
    }
}

/// A restored checkpoint, sorted by node.
#[derive(Debug, Default)]
pub struct RestorePlan {
    /// The restored checkpoint.
    pub checkpoint: Option<CheckpointId>,
    nodes: HashMap<String, Vec<(u32, NodeState)>>,
}

impl RestorePlan {
    /// Sorts a completed checkpoint's task states by node.
    pub fn new(checkpoint: Option<&CompletedCheckpoint>) -> StreamResult<Self> {
        let mut plan = RestorePlan {
            checkpoint: checkpoint.map(|c| c.id),
            nodes: HashMap::new(),
        };
        for handle in checkpoint.into_iter().flat_map(|c| c.task_states.values()) {
            let snap = TaskSnapshot::decode(handle)?;
            for (node, state) in snap.nodes {
                plan.nodes
                    .entry(node)
                    .or_default()
                    .push((snap.subtask, state));
            }
        }
        for states in plan.nodes.values_mut() {
            states.sort_by_key(|(s, _)| *s);
        }
        Ok(plan)
    }

    /// Every old subtask's position of source `node`.
    pub fn source(&self, node: &str) -> Vec<Vec<u8>> {
        self.states(node, |s| match s {
            NodeState::Source(b) => Some(b.clone()),
            _ => None,
        })
    }

    /// Every old subtask's staged work of sink `node`.
    pub fn sink(&self, node: &str) -> Vec<Vec<u8>> {
        self.states(node, |s| match s {
            NodeState::Sink(b) => Some(b.clone()),
            _ => None,
        })
    }

    /// The state operator `node`'s subtask `subtask` (of `parallelism`) owns:
    /// its key groups from whichever old subtask held them, and its own
    /// local state if that subtask existed before.
    pub fn operator(
        &self,
        node: &str,
        subtask: usize,
        parallelism: usize,
        max_parallelism: u16,
    ) -> OperatorState {
        let owned = key_groups_of(subtask, max_parallelism, parallelism);
        let mut state = OperatorState::default();
        for (old, s) in self.nodes.get(node).into_iter().flatten() {
            if let NodeState::Operator(op) = s {
                let groups: BTreeMap<_, _> = op
                    .keyed
                    .iter()
                    .filter(|(g, _)| owned.contains(g))
                    .map(|(g, b)| (*g, b.clone()))
                    .collect();
                state.keyed.extend(groups);
                if *old as usize == subtask {
                    state.local.clone_from(&op.local);
                }
            }
        }
        state
    }

    fn states(&self, node: &str, pick: impl Fn(&NodeState) -> Option<Vec<u8>>) -> Vec<Vec<u8>> {
        self.nodes
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|(_, s)| pick(s))
            .collect()
    }
}
