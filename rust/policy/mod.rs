//! Eviction policies of the CPU pool: which resident entry leaves when room is needed.
//!
//! A policy sees resident entries as slot indices (small dense integers, `0..capacity`) and keeps
//! its recency order in *intrusive* doubly-linked lists: each slot's `[prev, next]` neighbours
//! live in a node ([`LinkNode`]) that the pool keeps in its per-slot record, next to the slot's
//! state and key (one cache line per slot), and passes to every call; insert, touch, remove and
//! evict are O(1) and allocate nothing. Ghost lists (ARC's history of evicted keys) hold keys
//! only, in a slab of the policy's own nodes with the same intrusive links and a key index,
//! bounded by the capacity.
//!
//! The pool owns the entry states (storing, ready, pins); the policy only orders entries. Victim
//! selection is split in two so that a multi-eviction is atomic: [`EvictionPolicy::choose_victims`]
//! reads the order and returns all victims or none (it skips entries the pool says are not
//! evictable), and only then does the pool apply them with [`EvictionPolicy::evict`]. A search
//! costs O(victims + skipped entries).
//!
//! - [`LruPolicy`]: one list; victims are the least recently used evictable entries.
//! - [`ArcPolicy`]: Adaptive Replacement Cache (Megiddo & Modha, FAST 2003): resident lists T1
//!   (seen once) and T2 (seen again), ghost lists B1 and B2, and an adaptive target size of T1
//!   that grows on a B1 ghost hit and shrinks on a B2 ghost hit.
//!
//! More policies implement [`EvictionPolicy`] and get a [`PolicyKind`].
//!
//! Where this ARC departs from the paper, and why: `docs/design-notes.md` ("The ARC variant").

use std::fmt;
use std::str::FromStr;

use crate::error::Error;
use crate::ids::{Key, SlotId};

mod arc;
mod links;
mod lru;

pub use self::arc::ArcPolicy;
pub use self::links::{LinkNode, UNLINKED};
pub use self::lru::LruPolicy;

/// The eviction policies a pool can be configured with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Least recently used.
    #[default]
    Lru,
    /// Adaptive Replacement Cache.
    Arc,
}

impl PolicyKind {
    /// The lower-case name, as accepted by [`PolicyKind::from_str`].
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Arc => "arc",
        }
    }

    /// A policy of this kind for `capacity` slots whose nodes are `N`s.
    pub fn build<N: LinkNode + 'static>(self, capacity: u32) -> Box<dyn EvictionPolicy<N>> {
        match self {
            PolicyKind::Lru => Box::new(LruPolicy::new()),
            PolicyKind::Arc => Box::new(ArcPolicy::new(capacity)),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = Error;

    /// Parses `"lru"` or `"arc"`, ignoring case.
    fn from_str(s: &str) -> Result<Self, Error> {
        if s.eq_ignore_ascii_case("lru") {
            Ok(PolicyKind::Lru)
        } else if s.eq_ignore_ascii_case("arc") {
            Ok(PolicyKind::Arc)
        } else {
            Err(Error::Config(format!(
                "unknown eviction policy {s:?}: use \"lru\" or \"arc\""
            )))
        }
    }
}

/// The order a policy keeps, for tests and debugging (O(capacity) to build).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicySnapshot {
    /// Resident lists by name (LRU: `"lru"`; ARC: `"t1"`, `"t2"`), least recent first.
    pub resident: Vec<(&'static str, Vec<SlotId>)>,
    /// Ghost lists by name (ARC: `"b1"`, `"b2"`), least recent first.
    pub ghosts: Vec<(&'static str, Vec<Key>)>,
    /// ARC's adaptive target size of T1; `None` for policies without one.
    pub target: Option<u32>,
}

/// Whether a resident slot may be evicted now (ready and unpinned), as the pool decides.
pub type Evictable<'a> = &'a dyn Fn(SlotId) -> bool;

/// One access of a batch ([`EvictionPolicy::touch_many`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Touch {
    /// An access to the resident entry in `slot`; `ready` says whether it is readable yet.
    Resident {
        /// The slot.
        slot: SlotId,
        /// Whether the entry is readable yet.
        ready: bool,
    },
    /// An access to a key that is not resident.
    Absent(Key),
}

/// An eviction policy over the slots of one pool, whose nodes (one per slot, holding the
/// slot's links in the policy's lists) are `N`s.
///
/// The pool owns the nodes (all [`UNLINKED`] at first) and passes them to every call that
/// reads or changes the order; only the policy reads or writes their links. The pool calls [`insert`](EvictionPolicy::insert) when a key gets a slot (it is then
/// *storing*), [`touch`](EvictionPolicy::touch) on an access, [`remove`](EvictionPolicy::remove)
/// when an entry leaves without being evicted (failed store), and
/// [`choose_victims`](EvictionPolicy::choose_victims) then [`evict`](EvictionPolicy::evict) when
/// it needs room. Every resident slot is inserted exactly once before it is touched, removed or
/// evicted.
pub trait EvictionPolicy<N>: Send + fmt::Debug {
    /// Which policy this is.
    fn kind(&self) -> PolicyKind;

    /// A new resident entry: `key` now occupies `slot` (storing).
    fn insert(&mut self, nodes: &mut [N], slot: SlotId, key: Key);

    /// An access to the resident entry in `slot`; `ready` says whether it is readable yet.
    fn touch(&mut self, nodes: &mut [N], slot: SlotId, ready: bool);

    /// Applies `touches` in order, as the matching [`touch`](EvictionPolicy::touch) and
    /// [`touch_absent`](EvictionPolicy::touch_absent) calls would: one call per batch, so a
    /// policy can overlap the batch's cache misses.
    fn touch_many(&mut self, nodes: &mut [N], touches: &[Touch]) {
        for t in touches {
            match *t {
                Touch::Resident { slot, ready } => self.touch(nodes, slot, ready),
                Touch::Absent(key) => self.touch_absent(key),
            }
        }
    }

    /// An access to a key that is not resident (a policy with history may learn from it).
    fn touch_absent(&mut self, _key: Key) {}

    /// Appends to `out` exactly `n` victims, in eviction order, each a resident slot for which
    /// `evictable` is true, and returns `true`; or appends nothing and returns `false` when
    /// fewer than `n` are evictable. Changes nothing.
    fn choose_victims(
        &self,
        nodes: &[N],
        n: usize,
        evictable: Evictable<'_>,
        out: &mut Vec<SlotId>,
    ) -> bool;

    /// The first slots of the eviction order into `out`, as many as fit (fewer when fewer are
    /// resident), evictable or not, reading the links of all but the last: the entries the
    /// next victim search reads first, for a caller to load ahead. Changes nothing. A policy
    /// whose search does not start from one end writes none (the default).
    fn eviction_front(&self, _nodes: &[N], _out: &mut [SlotId]) -> usize {
        0
    }

    /// The entry in `slot`, holding `key`, is evicted (a victim of
    /// [`choose_victims`](EvictionPolicy::choose_victims)); a policy with history remembers it.
    fn evict(&mut self, nodes: &mut [N], slot: SlotId, key: Key);

    /// The entry in `slot` leaves without a trace (its store failed).
    fn remove(&mut self, nodes: &mut [N], slot: SlotId);

    /// Forgets every entry and all history (every node is [`UNLINKED`] after).
    fn clear(&mut self, nodes: &mut [N]);

    /// Number of keys remembered in ghost lists.
    fn ghost_len(&self) -> usize {
        0
    }

    /// The adaptive target, for policies that have one.
    fn target(&self) -> Option<u32> {
        None
    }

    /// The current order (O(capacity)).
    fn snapshot(&self, nodes: &[N]) -> PolicySnapshot;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_policy_names() {
        assert_eq!("LRU".parse::<PolicyKind>().unwrap(), PolicyKind::Lru);
        assert_eq!("Arc".parse::<PolicyKind>().unwrap(), PolicyKind::Arc);
        let err = "fifo".parse::<PolicyKind>().unwrap_err().to_string();
        assert!(err.contains("\"fifo\""), "{err}");
    }
}
