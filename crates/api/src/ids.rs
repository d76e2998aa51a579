//! Identifier newtypes. Each id is its own type so a checkpoint id can never be
//! passed where a task id is expected, and names (`JobId`) are
//! validated once, at the edge, into a form safe for file names and table
//! properties.

use std::fmt;

/// The id of one checkpoint of a job. Strictly increasing for a job, also
/// across restarts; the first id is 1.
///
/// ```
/// use tinyflow_api::CheckpointId;
/// let id = CheckpointId::new(41);
/// assert_eq!(id.next().get(), 42);
/// assert!(id < id.next());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CheckpointId(u64);

impl CheckpointId {
    /// The first checkpoint id a fresh job uses.
    pub const FIRST: CheckpointId = CheckpointId(1);

    /// Wraps a raw id.
    pub const fn new(raw: u64) -> Self {
        CheckpointId(raw)
    }

    /// The raw number.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The id after this one.
    ///
    /// # Panics
    /// At `u64::MAX`; at one checkpoint per millisecond that is 584 million
    /// years away, so reaching it is a broken invariant, not an input error.
    pub fn next(self) -> Self {
        CheckpointId(
            self.0
                .checked_add(1)
                .expect("checkpoint id space exhausted"),
        )
    }
}

impl fmt::Display for CheckpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The id of one running task (an operator subtask) of a job.
///
/// ```
/// use tinyflow_api::TaskId;
/// assert_eq!(TaskId::new(7).get(), 7);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskId(u32);

impl TaskId {
    /// Wraps a raw id.
    pub const fn new(raw: u32) -> Self {
        TaskId(raw)
    }

    /// The raw number.
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "task-{}", self.0)
    }
}

/// Why a name was rejected as a [`JobId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The name is empty.
    #[error("{kind} must not be empty")]
    Empty {
        /// Which kind of id (`job id`, `sink id`).
        kind: &'static str,
    },
    /// The name is longer than [`MAX_NAME_LEN`](JobId::MAX_LEN).
    #[error("{kind} is {len} bytes long, at most {max} are allowed")]
    TooLong {
        /// Which kind of id.
        kind: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The name holds a character outside `[A-Za-z0-9._-]`.
    #[error(
        "{kind} {name:?} holds {found:?} at byte {at}: only ASCII letters, digits, '.', '_' and '-' are allowed"
    )]
    BadChar {
        /// Which kind of id.
        kind: &'static str,
        /// The rejected name.
        name: String,
        /// The offending character.
        found: char,
        /// Its byte offset.
        at: usize,
    },
}

fn validate_name(kind: &'static str, name: &str) -> Result<(), IdError> {
    if name.is_empty() {
        return Err(IdError::Empty { kind });
    }
    if name.len() > JobId::MAX_LEN {
        return Err(IdError::TooLong {
            kind,
            len: name.len(),
            max: JobId::MAX_LEN,
        });
    }
    if let Some((at, found)) = name
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(IdError::BadChar {
            kind,
            name: name.to_owned(),
            found,
            at,
        });
    }
    Ok(())
}

macro_rules! name_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            /// Longest accepted name, in bytes.
            pub const MAX_LEN: usize = 128;

            /// Validates `name`: 1 to 128 ASCII letters, digits, `.`, `_` or `-`,
            /// so it is safe in file names, table properties and logs.
            pub fn new(name: impl Into<String>) -> Result<Self, IdError> {
                let name = name.into();
                validate_name($kind, &name)?;
                Ok($name(name))
            }

            /// The name.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                $name::new(s)
            }
        }
    };
}

name_id!(
    /// The stable name of one pipeline, from its configuration. It survives
    /// restarts; checkpoint ids are scoped to it.
    ///
    /// ```
    /// use tinyflow_api::JobId;
    /// assert!(JobId::new("orders-to-iceberg").is_ok());
    /// assert!(JobId::new("bad name").is_err());
    /// ```
    JobId,
    "job id"
);

/// One worker of a job spread over several processes: worker `index` of
/// `count`. Every worker runs the whole job graph over its share of the
/// source's partitions and commits to the shared table with a sink id of
/// its own. A job in one process is worker `0/1`.
///
/// ```
/// use tinyflow_api::Worker;
/// let w: Worker = "2/3".parse().unwrap();
/// assert_eq!((w.index(), w.count()), (2, 3));
/// assert_eq!(w.to_string(), "2/3");
/// assert!("3/3".parse::<Worker>().is_err());
/// assert_eq!(Worker::SINGLE, Worker::new(0, 1).unwrap());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Worker {
    index: u32,
    count: u32,
}

impl Worker {
    /// The one worker of a job that runs in one process.
    pub const SINGLE: Worker = Worker { index: 0, count: 1 };

    /// Most workers a job may have.
    pub const MAX_COUNT: u32 = 1024;

    /// Worker `index` of `count`: `count` in `1..=1024`, `index < count`.
    pub fn new(index: u32, count: u32) -> Result<Worker, String> {
        if count == 0 || count > Self::MAX_COUNT {
            return Err(format!(
                "{count} workers: expected 1 to {}",
                Self::MAX_COUNT
            ));
        }
        if index >= count {
            return Err(format!(
                "worker {index} of {count}: the index counts from 0, so it must be below {count}"
            ));
        }
        Ok(Worker { index, count })
    }

    /// Its index, from 0.
    pub fn index(self) -> u32 {
        self.index
    }

    /// How many workers the job has.
    pub fn count(self) -> u32 {
        self.count
    }

    /// Whether the job runs in this one process.
    pub fn is_single(self) -> bool {
        self.count == 1
    }
}

impl fmt::Display for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for Worker {
    type Err = String;

    /// `I/N`, such as `0/3`.
    fn from_str(s: &str) -> Result<Worker, String> {
        let (i, n) = s
            .trim()
            .split_once('/')
            .ok_or_else(|| format!("`{s}`: expected I/N, such as 0/3 (worker 0 of 3)"))?;
        let number = |x: &str| {
            x.trim()
                .parse::<u32>()
                .map_err(|_| format!("`{s}`: expected I/N with whole numbers, such as 0/3"))
        };
        Worker::new(number(i)?, number(n)?)
    }
}

/// The layout a rescale replaces, as the new layout's workers are told it
/// (`--rescale-from`): `N@G`, the `N` workers of layout generation `G` (what
/// `tinyflow inspect` shows), or `1`, the job in one process. Naming the
/// generation makes a rescale happen once: a worker left with an old value
/// can never switch the table again.
///
/// ```
/// use tinyflow_api::RescaleFrom;
/// let r: RescaleFrom = "3@2".parse().unwrap();
/// assert_eq!((r.workers, r.generation), (3, Some(2)));
/// assert_eq!(r.to_string(), "3@2");
/// assert_eq!("1".parse::<RescaleFrom>().unwrap().generation, None);
/// assert!("3@x".parse::<RescaleFrom>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RescaleFrom {
    /// How many workers the old layout has.
    pub workers: u32,
    /// Its generation; `None` for the job in one process.
    pub generation: Option<u64>,
}

impl fmt::Display for RescaleFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.generation {
            Some(g) => write!(f, "{}@{g}", self.workers),
            None => write!(f, "{}", self.workers),
        }
    }
}

impl std::str::FromStr for RescaleFrom {
    type Err = String;

    /// `N@G` or `1`.
    fn from_str(s: &str) -> Result<RescaleFrom, String> {
        let bad = || {
            format!(
                "`{s}`: expected the layout being replaced as WORKERS@GENERATION, such as 3@2 (tinyflow inspect shows it), or 1 for the job in one process"
            )
        };
        let (n, g) = match s.trim().split_once('@') {
            Some((n, g)) => (n, Some(g.trim().parse::<u64>().map_err(|_| bad())?)),
            None => (s.trim(), None),
        };
        let workers = n.trim().parse::<u32>().map_err(|_| bad())?;
        if workers == 0 || g == Some(0) {
            return Err(bad());
        }
        Ok(RescaleFrom {
            workers,
            generation: g,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_with_position() {
        assert_eq!(JobId::new(""), Err(IdError::Empty { kind: "job id" }));
        let err = JobId::new("a/b").unwrap_err();
        assert_eq!(
            err,
            IdError::BadChar {
                kind: "job id",
                name: "a/b".into(),
                found: '/',
                at: 1
            }
        );
        assert!(err.to_string().contains("'/'"), "{err}");
        assert!(matches!(
            JobId::new("x".repeat(129)),
            Err(IdError::TooLong { len: 129, .. })
        ));
        assert_eq!(JobId::new("job_1.v-2").unwrap().as_str(), "job_1.v-2");
    }

    #[test]
    fn checkpoint_ids_order_and_advance() {
        assert_eq!(CheckpointId::FIRST.get(), 1);
        assert!(CheckpointId::new(9) < CheckpointId::new(10));
        assert_eq!(CheckpointId::new(9).next(), CheckpointId::new(10));
    }
}
