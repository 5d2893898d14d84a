//! Tiers below the CPU pool (DESIGN.md §9): the contract every lower tier (disk, Redis)
//! implements, and what they share.
//!
//! The CPU pool stays the staging tier: the GPU talks only to it. A lower tier holds copies of
//! chunks that were ready in the CPU pool:
//!
//! - *write-behind*: when a chunk becomes ready in the CPU pool and the tier admits it, the
//!   scheduler reserves a place with [`TierIndex::prepare_write`], pins the CPU slot, and emits a
//!   write job; workers write the slot's bytes (data first, then the header:
//!   [`header`]), report per rank, and [`TierIndex::complete_write`] publishes the key (only when
//!   every rank succeeded). Eviction from the CPU pool never writes.
//! - *promotion*: a lookup that misses the CPU pool but finds the leading chunks in a tier
//!   reserves CPU slots (storing), pins the tier entries with [`TierIndex::prepare_read`], and
//!   emits a promotion job; the request is told "ask later". Workers read the tier's bytes into
//!   the CPU slots and verify them; [`TierIndex::complete_read`] unpins, drops (and, on disk,
//!   quarantines) every key a rank could not verify. A promotion that failed on any rank fails
//!   the job: its CPU slots are dropped and the request recomputes. Nothing unverified is ever
//!   readable from the CPU pool.
//!
//! The split follows the engine's processes: a [`TierIndex`] lives with the scheduler (one per
//! KV group and tier), does no I/O and answers in microseconds; the I/O side (e.g.
//! [`disk::SlabFile`]) lives with each worker, which holds the registered CPU pool memory, and
//! runs on Rust threads with the GIL released. They agree through [`Location`]s the index hands
//! out and the [`header`] every chunk carries; the index is rebuilt from those headers on open.
//!
//! Shared pieces: [`header`] (chunk header, checksums), [`namespace`] (which bytes a process may
//! read), [`TierEvent`] (events with the tier's medium) and [`TierStats`].

pub mod affinity;
mod counters;
pub mod disk;
pub mod events;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod header;
pub mod health;
pub mod io;
pub mod namespace;
pub mod remote;

use crate::error::Result;
use crate::ids::Key;
use crate::pool::{KeyState, PoolEventKind};

/// Where a chunk lives in a tier: a place (a disk slot, a remote key suffix) and the generation
/// the index expects to find in its header. A reader that finds another generation there treats
/// the chunk as a miss.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Location {
    /// Tier-specific place (disk: slot index in the slab file).
    pub place: u64,
    /// Generation of the write that put the chunk there.
    pub generation: u64,
}

/// The answer of [`TierIndex::prepare_write`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierWritePlan {
    /// Keys to write now, in input order (keys already present or not admitted are not here).
    pub keys: Vec<Key>,
    /// Where each key of `keys` goes.
    pub locations: Vec<Location>,
    /// Keys evicted to make room (no longer readable).
    pub evicted: Vec<Key>,
}

/// What a lower tier is: its name in events, stats and the Python API, its code in a packed
/// tier-job buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// The persistent disk tier ([`disk`]).
    #[default]
    Disk,
    /// The shared tier on Redis ([`remote`]).
    Remote,
}

impl Medium {
    /// `"disk"` or `"remote"`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Medium::Disk => "disk",
            Medium::Remote => "remote",
        }
    }

    /// Its code in a packed tier-job buffer: 0 disk, 1 remote.
    #[must_use]
    pub const fn code(self) -> u64 {
        self as u64
    }
}

impl std::fmt::Display for Medium {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A change visible to caches that index this tier, with the tier's medium.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierEvent {
    /// The tier's medium.
    pub medium: Medium,
    /// Stored or removed.
    pub kind: PoolEventKind,
    /// The keys, in the order of the call that changed them.
    pub keys: Vec<Key>,
}

/// Counters of one tier (cumulative) and its occupancy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Places (chunks) the tier can hold.
    pub capacity: u64,
    /// Places holding a key (writing or ready).
    pub used: u64,
    /// Bytes the tier may occupy at most (disk: slots × slot size).
    pub bytes_capacity: u64,
    /// Keys found readable by lookups (leading prefix).
    pub hits: u64,
    /// Keys looked up and not found readable.
    pub misses: u64,
    /// Keys published by completed writes.
    pub writes: u64,
    /// Keys whose write failed (never readable).
    pub failed_writes: u64,
    /// Keys pinned for promotion.
    pub promotions: u64,
    /// Keys a reader could not verify: dropped and never served (disk: quarantined slots).
    pub quarantined: u64,
    /// Keys evicted to make room.
    pub evictions: u64,
    /// Writes refused for lack of evictable room.
    pub no_room: u64,
    /// Writes in flight (keys).
    pub writing: u64,
    /// Promotions in flight (pinned keys).
    pub reading: u64,
    /// Existence checks sent (a remote tier; local tiers know without asking).
    pub checks: u64,
    /// Existence checks that failed or were unanswered within the deadline (their keys count
    /// as absent until the retry time passes).
    pub expired_checks: u64,
    /// Lookups answered "miss" without asking because the tier was on probation.
    pub skipped_checks: u64,
    /// Lookups told "ask later" at once because an existence check was in flight (they do
    /// not wait for the server).
    pub asked_later: u64,
    /// Times the scheduler's client of the tier was put on probation.
    pub probations: u64,
    /// Trials that ended a probation of the scheduler's client.
    pub recoveries: u64,
    /// Events not queued because the tier's event queue was full or recording was off
    /// ([`TierIndex::set_event_limit`]).
    pub events_dropped: u64,
}

/// The scheduler-side index of one lower tier for one KV group. No I/O; every call checks its
/// input before it changes anything (an `Err` means nothing changed).
pub trait TierIndex: Send + std::fmt::Debug {
    /// The tier's medium.
    fn medium(&self) -> Medium;

    /// The state of `key`: absent, being written (not readable), or ready with its pin count.
    fn state(&self, key: Key) -> KeyState;

    /// How many leading `keys` are readable now; counts hits and misses.
    fn lookup(&mut self, keys: &[Key]) -> usize;

    /// Starts finding out about the `keys` this index cannot answer yet and returns whether
    /// an answer about the first key past the known-readable prefix is still pending (a remote
    /// tier looks up asynchronously, bounded by its deadline): the request should ask again
    /// later instead of counting it as a miss. Local tiers know at once: `false`.
    fn prefetch(&mut self, _keys: &[Key]) -> bool {
        false
    }

    /// Reserves places for the `keys` not present yet, evicting ready unpinned entries the
    /// policy chooses (never one of `keys`), all or nothing: `None` means no room and no change.
    fn prepare_write(&mut self, keys: &[Key]) -> Option<TierWritePlan>;

    /// Ends the writes of `keys`: `ok` publishes them, otherwise they are dropped.
    fn complete_write(&mut self, keys: &[Key], ok: bool) -> Result<()>;

    /// Pins ready `keys` for promotion and returns their locations (all or nothing).
    fn prepare_read(&mut self, keys: &[Key]) -> Result<Vec<Location>>;

    /// Unpins `keys` after a promotion; every key of `bad` (a subset of `keys`) failed
    /// verification on some rank: it is dropped from the tier and counted as quarantined.
    fn complete_read(&mut self, keys: &[Key], bad: &[Key]) -> Result<()>;

    /// Drains the tier's events.
    fn take_events(&mut self) -> Vec<TierEvent>;

    /// Bounds the tier's event queue to `limit` keys (0: record no events); an event that
    /// does not fit is dropped whole and counted ([`TierStats::events_dropped`]).
    fn set_event_limit(&mut self, limit: usize);

    /// Counters and occupancy.
    fn stats(&self) -> TierStats;
}
