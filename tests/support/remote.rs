//! Chunks through the shared tier's client: write and read items of group 0 named by plain
//! integer keys, each chunk whole or cut in two pieces (the client gathers and scatters them).

use kvoffload::tier::remote::{ReadItem, ReadOutcome, RemoteClient, WriteItem};
use kvoffload::Key;

/// Where a chunk is cut into the pieces its items carry.
#[derive(Clone, Copy, Debug)]
pub enum Cut {
    /// One piece.
    Whole,
    /// Two pieces, the first a third of the chunk.
    Third,
    /// Two pieces of half the chunk each.
    Half,
}

impl Cut {
    /// The offset of the cut in a chunk of `len` bytes; 0 for one piece.
    fn at(self, len: usize) -> usize {
        match self {
            Self::Whole => 0,
            Self::Third => len / 3,
            Self::Half => len / 2,
        }
    }

    /// `d` as the pieces a write item carries.
    fn pieces(self, d: &[u8]) -> Vec<&[u8]> {
        match self.at(d.len()) {
            0 => vec![d],
            at => vec![&d[..at], &d[at..]],
        }
    }

    /// `d` as the pieces a read item fills.
    fn pieces_mut(self, d: &mut [u8]) -> Vec<&mut [u8]> {
        let at = self.at(d.len());
        if at == 0 {
            return vec![d];
        }
        let (a, b) = d.split_at_mut(at);
        vec![a, b]
    }
}

/// The key of chunk `k`.
pub fn key(k: u64) -> Key {
    Key(u128::from(k))
}

/// Writes chunk `data[i]` under `keys[i]` in namespace `ns`, cut as `cut` says: the client's
/// answer per chunk.
pub fn write(c: &RemoteClient, ns: u128, keys: &[u64], data: &[Vec<u8>], cut: Cut) -> Vec<bool> {
    let items: Vec<WriteItem<'_>> = keys
        .iter()
        .zip(data)
        .map(|(&k, d)| WriteItem {
            key: key(k),
            group: 0,
            data: cut.pieces(d),
        })
        .collect();
    c.write(ns, &items)
}

/// Reads `keys` from namespace `ns` into buffers of `len(key)` bytes, cut as `cut` says: the
/// outcomes and the bytes read.
pub fn read(
    c: &RemoteClient,
    ns: u128,
    keys: &[u64],
    len: impl Fn(u64) -> usize,
    cut: Cut,
) -> (Vec<ReadOutcome>, Vec<Vec<u8>>) {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|&k| vec![0u8; len(k)]).collect();
    let mut items: Vec<ReadItem<'_>> = keys
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&k, b)| ReadItem {
            key: key(k),
            group: 0,
            dst: cut.pieces_mut(b),
        })
        .collect();
    let out = c.read(ns, &mut items);
    drop(items);
    (out, bufs)
}
