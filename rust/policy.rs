//! Eviction policies of the CPU pool: which resident entry leaves when room is needed.
//!
//! A policy sees resident entries as slot indices (small dense integers, `0..capacity`) and keeps
//! its recency order in *intrusive* doubly-linked lists: two `u32` arrays indexed by slot hold
//! each entry's neighbours, so insert, touch, remove and evict are O(1) and allocate nothing.
//! Ghost lists (ARC's history of evicted keys) hold keys only, in a slab with the same intrusive
//! links and a key index, bounded by the capacity.
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

use rustc_hash::FxHashMap;

use crate::error::Error;
use crate::ids::{Key, SlotId};

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

    /// A policy of this kind for `capacity` slots.
    pub fn build(self, capacity: u32) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(LruPolicy::new(capacity)),
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

/// An eviction policy over the slots of one pool.
///
/// The pool calls [`insert`](EvictionPolicy::insert) when a key gets a slot (it is then
/// *storing*), [`touch`](EvictionPolicy::touch) on an access, [`remove`](EvictionPolicy::remove)
/// when an entry leaves without being evicted (failed store), and
/// [`choose_victims`](EvictionPolicy::choose_victims) then [`evict`](EvictionPolicy::evict) when
/// it needs room. Every resident slot is inserted exactly once before it is touched, removed or
/// evicted.
pub trait EvictionPolicy: Send + fmt::Debug {
    /// Which policy this is.
    fn kind(&self) -> PolicyKind;

    /// A new resident entry: `key` now occupies `slot` (storing).
    fn insert(&mut self, slot: SlotId, key: Key);

    /// An access to the resident entry in `slot`; `ready` says whether it is readable yet.
    fn touch(&mut self, slot: SlotId, ready: bool);

    /// An access to a key that is not resident (a policy with history may learn from it).
    fn touch_absent(&mut self, _key: Key) {}

    /// Appends to `out` exactly `n` victims, in eviction order, each a resident slot for which
    /// `evictable` is true, and returns `true`; or appends nothing and returns `false` when
    /// fewer than `n` are evictable. Changes nothing.
    fn choose_victims(&self, n: usize, evictable: Evictable<'_>, out: &mut Vec<SlotId>) -> bool;

    /// The entry in `slot`, holding `key`, is evicted (a victim of
    /// [`choose_victims`](EvictionPolicy::choose_victims)); a policy with history remembers it.
    fn evict(&mut self, slot: SlotId, key: Key);

    /// The entry in `slot` leaves without a trace (its store failed).
    fn remove(&mut self, slot: SlotId);

    /// Forgets every entry and all history.
    fn clear(&mut self);

    /// Number of keys remembered in ghost lists.
    fn ghost_len(&self) -> usize {
        0
    }

    /// The adaptive target, for policies that have one.
    fn target(&self) -> Option<u32> {
        None
    }

    /// The current order (O(capacity)).
    fn snapshot(&self) -> PolicySnapshot;
}

// ---------------------------------------------------------------------------------------------
// Intrusive lists over dense indices.

const NIL: u32 = u32::MAX;

/// One list threaded through [`Links`]: `head` is the least recent end, `tail` the most recent.
#[derive(Clone, Copy, Debug)]
struct List {
    head: u32,
    tail: u32,
    len: u32,
}

impl List {
    const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

impl Default for List {
    fn default() -> Self {
        List::EMPTY
    }
}

/// `prev` / `next` neighbours per index; several disjoint lists may share one `Links`.
#[derive(Clone, Debug, Default)]
struct Links {
    prev: Vec<u32>,
    next: Vec<u32>,
}

impl Links {
    fn with_len(n: u32) -> Self {
        Self {
            prev: vec![NIL; n as usize],
            next: vec![NIL; n as usize],
        }
    }

    /// Adds one index at the end of the arrays and returns it.
    fn grow(&mut self) -> u32 {
        self.prev.push(NIL);
        self.next.push(NIL);
        (self.prev.len() - 1) as u32
    }

    fn push_back(&mut self, list: &mut List, i: u32) {
        self.prev[i as usize] = list.tail;
        self.next[i as usize] = NIL;
        if list.tail == NIL {
            list.head = i;
        } else {
            self.next[list.tail as usize] = i;
        }
        list.tail = i;
        list.len += 1;
    }

    fn unlink(&mut self, list: &mut List, i: u32) {
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            list.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            list.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i as usize] = NIL;
        self.next[i as usize] = NIL;
        list.len -= 1;
    }

    fn move_to_back(&mut self, list: &mut List, i: u32) {
        if list.tail != i {
            self.unlink(list, i);
            self.push_back(list, i);
        }
    }

    /// The first index at or after `*cursor` (following `next`) for which `ok` holds; the cursor
    /// moves past it. `None` once the list is exhausted.
    fn next_matching(&self, cursor: &mut u32, ok: &dyn Fn(SlotId) -> bool) -> Option<u32> {
        while *cursor != NIL {
            let i = *cursor;
            *cursor = self.next[i as usize];
            if ok(SlotId(i)) {
                return Some(i);
            }
        }
        None
    }

    fn iter<'a>(&'a self, list: &List) -> impl Iterator<Item = u32> + 'a {
        let mut cur = list.head;
        std::iter::from_fn(move || {
            (cur != NIL).then(|| {
                let i = cur;
                cur = self.next[i as usize];
                i
            })
        })
    }
}

// ---------------------------------------------------------------------------------------------
// LRU.

/// Least recently used: one recency list; a touch moves the entry to the most recent end.
#[derive(Clone, Debug)]
pub struct LruPolicy {
    links: Links,
    list: List,
}

impl LruPolicy {
    /// An empty LRU order over `capacity` slots.
    pub fn new(capacity: u32) -> Self {
        Self {
            links: Links::with_len(capacity),
            list: List::EMPTY,
        }
    }
}

impl EvictionPolicy for LruPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }

    fn insert(&mut self, slot: SlotId, _key: Key) {
        self.links.push_back(&mut self.list, slot.0);
    }

    fn touch(&mut self, slot: SlotId, _ready: bool) {
        self.links.move_to_back(&mut self.list, slot.0);
    }

    fn choose_victims(&self, n: usize, evictable: Evictable<'_>, out: &mut Vec<SlotId>) -> bool {
        let start = out.len();
        let mut cursor = self.list.head;
        while out.len() - start < n {
            let Some(i) = self.links.next_matching(&mut cursor, evictable) else {
                out.truncate(start);
                return false;
            };
            out.push(SlotId(i));
        }
        true
    }

    fn evict(&mut self, slot: SlotId, _key: Key) {
        self.links.unlink(&mut self.list, slot.0);
    }

    fn remove(&mut self, slot: SlotId) {
        self.links.unlink(&mut self.list, slot.0);
    }

    fn clear(&mut self) {
        self.links.prev.fill(NIL);
        self.links.next.fill(NIL);
        self.list = List::EMPTY;
    }

    fn snapshot(&self) -> PolicySnapshot {
        PolicySnapshot {
            resident: vec![("lru", self.links.iter(&self.list).map(SlotId).collect())],
            ghosts: Vec::new(),
            target: None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ARC.

const B1: usize = 0;
const B2: usize = 1;

/// ARC's ghost lists B1 and B2: keys only, in a slab of nodes with intrusive links and a key
/// index. Nodes are recycled through a free stack, so the slab never exceeds the largest number
/// of ghosts held at once (bounded by the capacity per list).
#[derive(Clone, Debug, Default)]
struct Ghosts {
    links: Links,
    keys: Vec<Key>,
    which: Vec<u8>,
    spare: Vec<u32>,
    index: FxHashMap<Key, u32>,
    lists: [List; 2],
}

impl Ghosts {
    fn len(&self, which: usize) -> u32 {
        self.lists[which].len
    }

    /// Adds `key` (not a ghost yet) at the most recent end of list `which`.
    fn push(&mut self, which: usize, key: Key) {
        let node = if let Some(n) = self.spare.pop() {
            self.keys[n as usize] = key;
            self.which[n as usize] = which as u8;
            n
        } else {
            let n = self.links.grow();
            self.keys.push(key);
            self.which.push(which as u8);
            n
        };
        self.links.push_back(&mut self.lists[which], node);
        self.index.insert(key, node);
    }

    /// Forgets `key`; returns the list it was in.
    fn remove(&mut self, key: Key) -> Option<usize> {
        let node = self.index.remove(&key)?;
        let which = usize::from(self.which[node as usize]);
        self.links.unlink(&mut self.lists[which], node);
        self.spare.push(node);
        Some(which)
    }

    /// Moves `key` to the most recent end of its list; returns the list.
    fn touch(&mut self, key: Key) -> Option<usize> {
        let node = *self.index.get(&key)?;
        let which = usize::from(self.which[node as usize]);
        self.links.move_to_back(&mut self.lists[which], node);
        Some(which)
    }

    /// Forgets the least recent key of list `which`.
    fn pop_front(&mut self, which: usize) {
        let node = self.lists[which].head;
        if node != NIL {
            let key = self.keys[node as usize];
            self.remove(key);
        }
    }

    fn keys_of(&self, which: usize) -> Vec<Key> {
        self.links
            .iter(&self.lists[which])
            .map(|n| self.keys[n as usize])
            .collect()
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// Adaptive Replacement Cache over the pool's slots.
///
/// - A new key enters T1; a key remembered in B1 or B2 enters T2 (it was seen before).
/// - A touch of a *ready* T1 entry promotes it to T2; a storing entry stays in T1 (it has not
///   been used yet). A touch in T2 moves it to T2's most recent end.
/// - A touch of a key in B1 raises the target `p` by `max(|B2| / |B1|, 1)` (up to the
///   capacity); in B2 it lowers `p` by `max(|B1| / |B2|, 1)` (down to 0). The ghost moves to
///   the most recent end of its list and stays there until the key is stored again (it then
///   enters T2) or is trimmed. Every touch adapts, so touch once per access.
/// - Replacement takes the least recent evictable entry of T1 when `|T1| > p`, else of T2, and
///   falls back to the other list when the preferred one has no evictable entry. A multi-victim
///   choice applies this rule once per victim, counting earlier victims as gone.
/// - A victim from T1 is remembered in B1, one from T2 in B2. After every change the ghosts are
///   trimmed (least recent first) so that `|T1| + |B1| <= c`, `|B2| <= c` and
///   `|T1| + |T2| + |B1| + |B2| <= 2c`, the bounds of the original algorithm.
/// - An entry that leaves because its store failed leaves no ghost.
#[derive(Clone, Debug)]
pub struct ArcPolicy {
    capacity: u32,
    target: u32,
    links: Links,
    in_t2: Vec<bool>,
    t1: List,
    t2: List,
    ghosts: Ghosts,
}

impl ArcPolicy {
    /// An empty ARC over `capacity` slots, target 0.
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            target: 0,
            links: Links::with_len(capacity),
            in_t2: vec![false; capacity as usize],
            t1: List::EMPTY,
            t2: List::EMPTY,
            ghosts: Ghosts::default(),
        }
    }

    fn list_of(&mut self, slot: u32) -> &mut List {
        if self.in_t2[slot as usize] {
            &mut self.t2
        } else {
            &mut self.t1
        }
    }

    fn unlink(&mut self, slot: u32) {
        let mut list = *self.list_of(slot);
        self.links.unlink(&mut list, slot);
        *self.list_of(slot) = list;
    }

    /// Restores the ghost bounds, dropping the least recent ghosts first.
    fn trim(&mut self) {
        let c = self.capacity;
        while self.t1.len + self.ghosts.len(B1) > c && self.ghosts.len(B1) > 0 {
            self.ghosts.pop_front(B1);
        }
        // Implied at operation boundaries by the 2c bound (evictions happen only when the pool
        // is full), but it can be exceeded in the middle of a multi-eviction: keep it explicit.
        while self.ghosts.len(B2) > c {
            self.ghosts.pop_front(B2);
        }
        while u64::from(self.t1.len)
            + u64::from(self.t2.len)
            + u64::from(self.ghosts.len(B1))
            + u64::from(self.ghosts.len(B2))
            > 2 * u64::from(c)
        {
            let which = if self.ghosts.len(B2) > 0 { B2 } else { B1 };
            self.ghosts.pop_front(which);
        }
    }
}

impl EvictionPolicy for ArcPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Arc
    }

    fn insert(&mut self, slot: SlotId, key: Key) {
        let seen_before = self.ghosts.remove(key).is_some();
        self.in_t2[slot.0 as usize] = seen_before;
        if seen_before {
            self.links.push_back(&mut self.t2, slot.0);
        } else {
            self.links.push_back(&mut self.t1, slot.0);
        }
        self.trim();
    }

    fn touch(&mut self, slot: SlotId, ready: bool) {
        let i = slot.0;
        if self.in_t2[i as usize] {
            self.links.move_to_back(&mut self.t2, i);
        } else if ready {
            self.links.unlink(&mut self.t1, i);
            self.links.push_back(&mut self.t2, i);
            self.in_t2[i as usize] = true;
        } else {
            self.links.move_to_back(&mut self.t1, i);
        }
    }

    fn touch_absent(&mut self, key: Key) {
        match self.ghosts.touch(key) {
            Some(B1) => {
                let step = (self.ghosts.len(B2) / self.ghosts.len(B1)).max(1);
                self.target = self.target.saturating_add(step).min(self.capacity);
            }
            Some(_) => {
                let step = (self.ghosts.len(B1) / self.ghosts.len(B2)).max(1);
                self.target = self.target.saturating_sub(step);
            }
            None => {}
        }
    }

    fn choose_victims(&self, n: usize, evictable: Evictable<'_>, out: &mut Vec<SlotId>) -> bool {
        let start = out.len();
        let (mut c1, mut c2) = (self.t1.head, self.t2.head);
        let mut t1_len = self.t1.len;
        while out.len() - start < n {
            let prefer_t1 = t1_len > self.target;
            let (first, second) = if prefer_t1 {
                (&mut c1, &mut c2)
            } else {
                (&mut c2, &mut c1)
            };
            let victim = match self.links.next_matching(first, evictable) {
                Some(i) => Some((i, prefer_t1)),
                None => self
                    .links
                    .next_matching(second, evictable)
                    .map(|i| (i, !prefer_t1)),
            };
            let Some((i, from_t1)) = victim else {
                out.truncate(start);
                return false;
            };
            if from_t1 {
                t1_len -= 1;
            }
            out.push(SlotId(i));
        }
        true
    }

    fn evict(&mut self, slot: SlotId, key: Key) {
        let ghost = if self.in_t2[slot.0 as usize] { B2 } else { B1 };
        self.unlink(slot.0);
        self.ghosts.push(ghost, key);
        self.trim();
    }

    fn remove(&mut self, slot: SlotId) {
        self.unlink(slot.0);
    }

    fn clear(&mut self) {
        self.links.prev.fill(NIL);
        self.links.next.fill(NIL);
        self.in_t2.fill(false);
        self.t1 = List::EMPTY;
        self.t2 = List::EMPTY;
        self.ghosts.clear();
        self.target = 0;
    }

    fn ghost_len(&self) -> usize {
        self.ghosts.index.len()
    }

    fn target(&self) -> Option<u32> {
        Some(self.target)
    }

    fn snapshot(&self) -> PolicySnapshot {
        let slots = |l: &List| self.links.iter(l).map(SlotId).collect();
        PolicySnapshot {
            resident: vec![("t1", slots(&self.t1)), ("t2", slots(&self.t2))],
            ghosts: vec![
                ("b1", self.ghosts.keys_of(B1)),
                ("b2", self.ghosts.keys_of(B2)),
            ],
            target: Some(self.target),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(_: SlotId) -> bool {
        true
    }

    #[test]
    fn parse_policy_names() {
        assert_eq!("LRU".parse::<PolicyKind>().unwrap(), PolicyKind::Lru);
        assert_eq!("Arc".parse::<PolicyKind>().unwrap(), PolicyKind::Arc);
        let err = "fifo".parse::<PolicyKind>().unwrap_err().to_string();
        assert!(err.contains("\"fifo\""), "{err}");
    }

    #[test]
    fn lru_skips_unevictable_and_is_all_or_nothing() {
        let mut p = LruPolicy::new(4);
        for s in 0..4 {
            p.insert(SlotId(s), Key(u128::from(s)));
        }
        p.touch(SlotId(0), true);
        let mut out = vec![];
        assert!(p.choose_victims(2, &|s| s != SlotId(1), &mut out));
        assert_eq!(out, vec![SlotId(2), SlotId(3)]);
        out.clear();
        assert!(!p.choose_victims(4, &|s| s != SlotId(1), &mut out));
        assert!(out.is_empty());
    }

    #[test]
    fn arc_ghost_hit_enters_t2_and_adapts() {
        let mut p = ArcPolicy::new(2);
        p.insert(SlotId(0), Key(10));
        p.insert(SlotId(1), Key(11));
        let mut out = vec![];
        assert!(p.choose_victims(1, &all, &mut out));
        assert_eq!(out, vec![SlotId(0)]);
        p.evict(SlotId(0), Key(10));
        p.touch_absent(Key(10));
        assert_eq!(p.target(), Some(1));
        p.insert(SlotId(0), Key(10));
        let snap = p.snapshot();
        assert_eq!(snap.resident[1], ("t2", vec![SlotId(0)]));
        assert_eq!(p.ghost_len(), 0);
    }
}
