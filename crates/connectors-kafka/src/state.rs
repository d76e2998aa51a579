//! The checkpoint state of one source subtask: the positions of its
//! partitions and, under the dead-letter policy, where in the dead-letter
//! topic a restore starts looking for dead letters written already.
//!
//! Two encodings, both postcard: the original one, a bare
//! `Vec<(topic, partition, next offset)>`, still written when there is no
//! dead-letter state (so older tools read it); and a versioned one, a
//! prefix no bare encoding can start with followed by [`StateV2`]. Both
//! decode, so checkpoints written before the dead-letter state existed
//! restore.

use serde::{Deserialize, Serialize};

/// Starts a versioned encoding. A bare encoding starts with the positions'
/// length as a varint: five bytes of `0xff` would be a length of at least
/// 2^35 partitions.
const VERSIONED: [u8; 5] = [0xff; 5];

/// The version byte after [`VERSIONED`].
const V2: u8 = 2;

/// What a source subtask keeps of the dead-letter topic in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DeadLetterState {
    /// The dead-letter topic.
    pub(crate) topic: String,
    /// Per partition of the dead-letter topic, an offset at or below every
    /// dead letter a restore of this checkpoint must know about: those of
    /// bad records at or after the checkpoint's positions, committed by an
    /// attempt that went on past the checkpoint.
    pub(crate) floors: Vec<(i32, i64)>,
}

/// A subtask's state, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SourceState {
    /// (topic, partition, next offset).
    pub(crate) positions: Vec<(String, i32, i64)>,
    pub(crate) dead_letter: Option<DeadLetterState>,
}

#[derive(Serialize)]
struct StateV2Out<'a> {
    positions: &'a [(&'a str, i32, i64)],
    dead_letter: Option<&'a DeadLetterState>,
}

#[derive(Deserialize)]
struct StateV2 {
    positions: Vec<(String, i32, i64)>,
    dead_letter: Option<DeadLetterState>,
}

/// Encodes `positions` and the dead-letter state: the bare form when there
/// is none.
pub(crate) fn encode(
    positions: &[(&str, i32, i64)],
    dead_letter: Option<&DeadLetterState>,
) -> Result<Vec<u8>, postcard::Error> {
    let Some(dead_letter) = dead_letter else {
        return postcard::to_allocvec(positions);
    };
    let mut out = Vec::with_capacity(64 + positions.len() * 24);
    out.extend_from_slice(&VERSIONED);
    out.push(V2);
    out.extend(postcard::to_allocvec(&StateV2Out {
        positions,
        dead_letter: Some(dead_letter),
    })?);
    Ok(out)
}

/// Decodes either encoding.
pub(crate) fn decode(bytes: &[u8]) -> Result<SourceState, postcard::Error> {
    match bytes.strip_prefix(&VERSIONED[..]) {
        Some([V2, rest @ ..]) => {
            let s: StateV2 = postcard::from_bytes(rest)?;
            Ok(SourceState {
                positions: s.positions,
                dead_letter: s.dead_letter,
            })
        }
        Some(_) => Err(postcard::Error::DeserializeBadEncoding),
        None => Ok(SourceState {
            positions: postcard::from_bytes(bytes)?,
            dead_letter: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn both_encodings_decode_and_the_bare_one_is_kept_without_dead_letters() {
        let positions = [("bids", 0, 12), ("bids", 1, 7)];
        let owned: Vec<(String, i32, i64)> = positions
            .iter()
            .map(|(t, p, o)| ((*t).to_owned(), *p, *o))
            .collect();
        // What checkpoints held before the dead-letter state existed.
        let old = postcard::to_allocvec(&positions[..]).unwrap();
        assert_eq!(encode(&positions, None).unwrap(), old);
        assert_eq!(
            decode(&old).unwrap(),
            SourceState {
                positions: owned.clone(),
                dead_letter: None
            }
        );
        let dl = DeadLetterState {
            topic: "bids-dlq".into(),
            floors: vec![(0, 40), (1, 3)],
        };
        let new = encode(&positions, Some(&dl)).unwrap();
        assert_eq!(
            decode(&new).unwrap(),
            SourceState {
                positions: owned,
                dead_letter: Some(dl)
            }
        );
        // Empty positions, both forms.
        assert!(
            decode(&encode(&[], None).unwrap())
                .unwrap()
                .positions
                .is_empty()
        );
        let mut unknown = VERSIONED.to_vec();
        unknown.push(9);
        assert!(decode(&unknown).is_err());
    }
}
