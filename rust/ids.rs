//! Newtypes for the ids that cross module boundaries, so a block id is never passed where a
//! job id is expected.

use std::fmt;

/// A GPU block id: a small dense integer chosen by the engine (`0` may be its null block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

/// A transfer job id, monotonic for the lifetime of a tracker (across resets).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobId(pub u64);

/// The owner of jobs: a request, identified by the caller with any `u64`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OwnerId(pub u64);

/// A CPU pool slot: one chunk-sized place in the CPU tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotId(pub u32);

/// Identity of a chunk's content: 128 bits derived from the engine's chained prefix hash (and
/// the KV group). Equal keys mean equal KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key(pub u128);

impl JobId {
    /// No job: never created (ids count up from 0 and never reach it).
    pub const NONE: JobId = JobId(u64::MAX);
}

impl SlotId {
    /// No slot: a hint that says nothing (never a real slot, capacities stay below 2^28).
    pub const NONE: SlotId = SlotId(u32::MAX);
}

impl BlockId {
    /// The scheduler's null block: a dropped position, or the engine's own null block. Never a
    /// real block (`num_gpu_blocks` is at most `2**24 - 1`).
    pub const NULL: BlockId = BlockId(u32::MAX);

    /// The block as an index into per-block arrays.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl Key {
    /// A key from an opaque hash given as bytes: up to 16 bytes are taken as a big-endian
    /// integer; longer hashes (e.g. SHA-256 digests) are folded to 128 bits with FNV-1a.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013B;
        if bytes.len() <= 16 {
            let mut buf = [0u8; 16];
            buf[16 - bytes.len()..].copy_from_slice(bytes);
            return Key(u128::from_be_bytes(buf));
        }
        let mut h: u128 = 0x6C62_272E_07BB_0142_62B8_2175_6295_C58D;
        for &b in bytes {
            h ^= u128::from(b);
            h = h.wrapping_mul(PRIME);
        }
        Key(h)
    }

    /// The key of the same content hash in KV group `group` (group 0 keeps the hash as is).
    #[must_use]
    pub fn in_group(self, group: u32) -> Self {
        if group == 0 {
            return self;
        }
        // A multiply-xorshift mix so that (hash, group) pairs do not collide in practice.
        let mut h = self.0 ^ (u128::from(group) << 64 | u128::from(group));
        h = h.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
        Key(h ^ (h >> 67))
    }
}

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
