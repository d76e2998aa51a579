//! Records, batches and keys.
//!
//! User code sees typed records (`T`); between tasks records travel in
//! batches (`Vec<T>`), type-erased as [`AnyBatch`] so the runtime can move
//! them without knowing `T`. Keys map to a fixed number of key groups
//! (`max_parallelism`), the unit in which keyed state is snapshotted and
//! redistributed when a job is restored with a different parallelism.

use std::any::Any;
use std::fmt;
use std::hash::{Hash, Hasher};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A record type that can flow through a job.
pub trait Data: Clone + Send + Sync + fmt::Debug + 'static {}

impl<T: Clone + Send + Sync + fmt::Debug + 'static> Data for T {}

/// A key of a keyed stream: hashable, comparable, and serialisable into
/// keyed state.
pub trait Key: Data + Hash + Eq + Serialize + DeserializeOwned {}

impl<T: Data + Hash + Eq + Serialize + DeserializeOwned> Key for T {}

/// A value kept in keyed state.
pub trait StateValue: Data + Serialize + DeserializeOwned {}

impl<T: Data + Serialize + DeserializeOwned> StateValue for T {}

/// Default number of key groups (the highest parallelism a keyed operator
/// can be rescaled to).
pub const DEFAULT_MAX_PARALLELISM: u16 = 128;

/// The key group of `key` among `max_parallelism` groups.
///
/// Stable across processes and versions of this crate (FNV-1a over the
/// key's `Hash` output), since restored state depends on it.
///
/// ```
/// use tinyflow_api::key_group;
/// let g = key_group(&"auction-17", 128);
/// assert!(g < 128);
/// assert_eq!(g, key_group(&"auction-17", 128));
/// ```
pub fn key_group<K: Hash + ?Sized>(key: &K, max_parallelism: u16) -> u16 {
    let mut h = Fnv1a(0xcbf2_9ce4_8422_2325);
    key.hash(&mut h);
    // Finalise (murmur3 fmix64) so that nearby keys spread over groups.
    let mut x = h.0;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    let groups = u64::from(max_parallelism.max(1));
    u16::try_from(x % groups).expect("a key group fits the u16 it was reduced modulo")
}

/// The subtask (of `parallelism`) that owns `group`: key groups are split
/// into contiguous ranges, one per subtask.
///
/// ```
/// use tinyflow_api::engine::{key_groups_of, owner_of_group};
/// assert_eq!(owner_of_group(0, 128, 4), 0);
/// assert_eq!(owner_of_group(127, 128, 4), 3);
/// assert_eq!(key_groups_of(1, 128, 4), 32..64);
/// ```
pub fn owner_of_group(group: u16, max_parallelism: u16, parallelism: usize) -> usize {
    usize::from(group) * parallelism / usize::from(max_parallelism.max(1))
}

/// The key groups subtask `subtask` of `parallelism` owns.
pub fn key_groups_of(
    subtask: usize,
    max_parallelism: u16,
    parallelism: usize,
) -> std::ops::Range<u16> {
    let max = usize::from(max_parallelism);
    let start = (subtask * max).div_ceil(parallelism);
    let end = ((subtask + 1) * max).div_ceil(parallelism);
    let narrow = |n: usize| u16::try_from(n).expect("bounded by max_parallelism");
    narrow(start)..narrow(end)
}

struct Fnv1a(u64);

impl Hasher for Fnv1a {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

trait ErasedVec: Send {
    fn len(&self) -> usize;
    fn rows(&self) -> usize;
    fn clone_box(&self) -> Box<dyn ErasedVec>;
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
    fn type_name(&self) -> &'static str;
}

impl<T: Data> ErasedVec for Vec<T> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn rows(&self) -> usize {
        #[cfg(feature = "arrow")]
        if let Some(batches) = (self as &dyn Any).downcast_ref::<Vec<arrow_array::RecordBatch>>() {
            return batches.iter().map(arrow_array::RecordBatch::num_rows).sum();
        }
        Vec::len(self)
    }

    fn clone_box(&self) -> Box<dyn ErasedVec> {
        Box::new(self.clone())
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }

    fn type_name(&self) -> &'static str {
        std::any::type_name::<T>()
    }
}

/// A batch of records of some type, as it travels between tasks.
///
/// ```
/// use tinyflow_api::engine::AnyBatch;
/// let batch = AnyBatch::new(vec![1u64, 2, 3]);
/// assert_eq!(batch.len(), 3);
/// assert_eq!(batch.clone().downcast::<u64>().unwrap(), vec![1, 2, 3]);
/// assert!(batch.downcast::<String>().is_err());
/// ```
pub struct AnyBatch(Box<dyn ErasedVec>);

impl AnyBatch {
    /// Wraps typed records.
    pub fn new<T: Data>(records: Vec<T>) -> Self {
        AnyBatch(Box::new(records))
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Number of rows: the records, except that Arrow record batches (with
    /// feature `arrow`) count the rows in them. What the runtime's record
    /// metrics count.
    pub fn rows(&self) -> usize {
        self.0.rows()
    }

    /// Whether the batch holds no record.
    pub fn is_empty(&self) -> bool {
        self.0.len() == 0
    }

    /// The typed records, or the batch back if it holds another type.
    pub fn downcast<T: Data>(self) -> Result<Vec<T>, AnyBatch> {
        if self.0.type_name() != std::any::type_name::<T>() {
            return Err(self);
        }
        match self.0.into_any().downcast::<Vec<T>>() {
            Ok(records) => Ok(*records),
            // Same type name, different type: only possible across two
            // copies of a crate; the batch is lost, which the caller reports.
            Err(_) => Err(AnyBatch::new(Vec::<()>::new())),
        }
    }

    /// The record type's name, for error messages.
    pub fn type_name(&self) -> &'static str {
        self.0.type_name()
    }
}

impl Clone for AnyBatch {
    fn clone(&self) -> Self {
        AnyBatch(self.0.clone_box())
    }
}

impl fmt::Debug for AnyBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "AnyBatch<{}>({} records)",
            self.0.type_name(),
            self.0.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_group_ranges_partition_all_groups() {
        for parallelism in [1usize, 3, 4, 7, 128] {
            let mut next = 0u16;
            for s in 0..parallelism {
                let r = key_groups_of(s, 128, parallelism);
                assert_eq!(r.start, next, "p={parallelism} s={s}");
                for g in r.clone() {
                    assert_eq!(
                        owner_of_group(g, 128, parallelism),
                        s,
                        "p={parallelism} g={g}"
                    );
                }
                next = r.end;
            }
            assert_eq!(next, 128);
        }
    }

    #[test]
    fn keys_spread_over_groups() {
        let mut seen = std::collections::BTreeSet::new();
        for k in 0u64..10_000 {
            seen.insert(key_group(&k, 128));
        }
        assert_eq!(seen.len(), 128);
        // Pinned values: restored state depends on them never changing.
        assert_eq!(key_group(&42u64, 128), key_group(&42u64, 128));
        assert_eq!(key_group(&"a", 1), 0);
    }
}
