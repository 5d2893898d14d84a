//! The CPU pool: the scheduler-side view of the CPU tier (DESIGN.md §5).
//!
//! The pool decides where each chunk lives and which chunk leaves; it holds no bytes (the data
//! plane does). It has a fixed number of slots. Each key is *absent*, *storing* (a slot is
//! reserved, the copy is in flight, nothing is readable) or *ready* with a pin count (loads in
//! flight). Only ready, unpinned entries are ever evicted.
//!
//! How it is laid out, for a million slots on the engine's hot path:
//! - a key index `Key -> SlotId` ([`FxHashMap`]) and dense per-slot arrays (entry state, key);
//! - the eviction order lives in an [`EvictionPolicy`] (intrusive lists over slot indices, O(1)
//!   per insert / touch / evict, no allocation per operation);
//! - free slots are a run-length set: maximal free runs indexed by start and by length (two
//!   B-trees, O(log runs) per allocation or release). A store call asks for all its slots at
//!   once: the smallest free run that holds them all (best fit), else the largest runs first,
//!   so the data plane copies a job with few large copies. In a full pool (the steady state)
//!   the victims' slots are the only free ones: they are handed out directly, sorted, without
//!   touching the B-trees. [`PoolStats`] says how contiguous allocations are.
//!
//! Every operation checks its input before it changes anything: an `Err` (or a `None` from
//! [`Pool::prepare_store`]) means nothing changed. Changes visible to other caches are queued
//! as [`PoolEvent`]s (medium [`MEDIUM`]) and drained with [`Pool::take_events`]. The queue is
//! bounded ([`Pool::set_event_limit`], by default [`default_event_limit`] keys): an event that
//! does not fit is dropped whole and counted in [`PoolStats::events_dropped`], so a caller that
//! never drains costs bounded memory and one that does can tell when its index went stale.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap, FxHashSet};

use crate::error::{Error, Result};
use crate::ids::{Key, SlotId};
use crate::policy::{EvictionPolicy, PolicyKind};

/// The medium of every event of this pool.
pub const MEDIUM: &str = "cpu";

/// The largest capacity a pool accepts (2^28 slots, about 10 GiB of bookkeeping).
pub const MAX_CAPACITY: u32 = 1 << 28;

/// The default bound of the event queue, in keys: twice the capacity, at least 65536.
pub fn default_event_limit(capacity: u32) -> usize {
    (2 * capacity as usize).max(1 << 16)
}

/// Keys below this many per call are deduplicated by a linear scan, above it with a hash set.
const LINEAR_DEDUP: usize = 32;

/// How a pool is configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Number of slots (`1..=MAX_CAPACITY`).
    pub capacity: u32,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Admission filter: a key is stored only after it was looked up (while absent) this many
    /// times. `0` or `1` means no filter.
    pub store_threshold: u32,
}

impl PoolConfig {
    /// `capacity` slots, LRU, no admission filter.
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            policy: PolicyKind::Lru,
            store_threshold: 0,
        }
    }
}

/// What the pool knows about one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyState {
    /// Not in the pool.
    Absent,
    /// A slot is reserved and the store is in flight: not readable, ask again later.
    Storing,
    /// Readable; `pins` loads are in flight.
    Ready {
        /// Number of loads in flight (pinned entries are never evicted).
        pins: u32,
    },
}

impl KeyState {
    /// `"absent"`, `"storing"` or `"ready"`.
    pub fn name(self) -> &'static str {
        match self {
            KeyState::Absent => "absent",
            KeyState::Storing => "storing",
            KeyState::Ready { .. } => "ready",
        }
    }
}

/// The answer of [`Pool::prepare_store`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StorePlan {
    /// Keys to store now, in input order (keys already present or filtered are not here).
    pub keys: Vec<Key>,
    /// The slot of each key of `keys`.
    pub slots: Vec<SlotId>,
    /// Keys evicted to make room, in eviction order (their slots may be reused by `slots`).
    pub evicted: Vec<Key>,
    /// Keys the admission filter skipped (not looked up often enough yet), in input order.
    pub filtered: Vec<Key>,
}

/// What happened to the keys of a [`PoolEvent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolEventKind {
    /// The keys became readable (a store completed).
    Stored,
    /// The keys were evicted or dropped by a reset; they are no longer readable.
    Removed,
}

impl PoolEventKind {
    /// `"stored"` or `"removed"`.
    pub fn name(self) -> &'static str {
        match self {
            PoolEventKind::Stored => "stored",
            PoolEventKind::Removed => "removed",
        }
    }
}

/// A change visible to caches that index this tier, e.g. a router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolEvent {
    /// Stored or removed.
    pub kind: PoolEventKind,
    /// The keys, in the order of the call that changed them.
    pub keys: Vec<Key>,
}

impl PoolEvent {
    /// The medium the keys live on: always [`MEDIUM`] (`"cpu"`).
    pub fn medium(&self) -> &'static str {
        MEDIUM
    }
}

/// Occupancy and counters of a pool. Counters are cumulative across resets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Number of slots.
    pub capacity: u32,
    /// Slots holding a key (storing or ready).
    pub used: u32,
    /// Free slots (`used + free == capacity`).
    pub free: u32,
    /// Entries being stored.
    pub storing: u32,
    /// Ready entries with at least one pin.
    pub pinned: u32,
    /// Keys looked up within the leading ready prefix of a [`Pool::lookup`].
    pub hits: u64,
    /// Keys looked up after the leading ready prefix (absent, storing, or after a gap).
    pub misses: u64,
    /// Entries evicted to make room.
    pub evictions: u64,
    /// Ready entries dropped by [`Pool::discard`] (content no longer trusted).
    pub discarded: u64,
    /// Stores completed successfully (keys that became readable).
    pub stores: u64,
    /// Stores completed as failed (keys dropped, never readable).
    pub failed_stores: u64,
    /// Keys pinned by [`Pool::prepare_load`].
    pub loads: u64,
    /// [`Pool::prepare_store`] calls refused for lack of evictable room.
    pub no_room: u64,
    /// Keys skipped by the admission filter.
    pub filtered: u64,
    /// [`Pool::prepare_store`] calls that reserved at least one slot.
    pub allocations: u64,
    /// Slots reserved by those calls.
    pub allocated_slots: u64,
    /// Contiguous runs those slots formed (one per call is ideal).
    pub allocated_runs: u64,
    /// Calls whose slots formed a single contiguous run.
    pub contiguous_allocations: u64,
    /// Calls to [`Pool::reset`].
    pub resets: u64,
    /// Keys remembered by the policy's ghost lists (ARC), 0 for LRU.
    pub ghosts: u32,
    /// ARC's adaptive target size of T1; `None` for LRU.
    pub target: Option<u32>,
    /// Keys the admission filter currently tracks (bounded by twice the capacity, min 2048).
    pub admission_tracked: u32,
    /// Events not queued because the queue was full or recording was off
    /// ([`Pool::set_event_limit`]).
    pub events_dropped: u64,
    /// Keys in the events queued now (at most the event limit).
    pub event_keys_queued: u64,
}

impl PoolStats {
    /// Average number of slots per contiguous run of an allocation (higher is better; the
    /// average store size is the ceiling). `0.0` before the first allocation.
    pub fn slots_per_run(&self) -> f64 {
        if self.allocated_runs == 0 {
            0.0
        } else {
            self.allocated_slots as f64 / self.allocated_runs as f64
        }
    }
}

/// The pool's order, with keys in place of slots (see [`Pool::order`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolOrder {
    /// Resident lists by name (LRU: `"lru"`; ARC: `"t1"`, `"t2"`), least recent first.
    pub resident: Vec<(&'static str, Vec<Key>)>,
    /// Ghost lists by name (ARC: `"b1"`, `"b2"`), least recent first.
    pub ghosts: Vec<(&'static str, Vec<Key>)>,
    /// ARC's adaptive target; `None` for LRU.
    pub target: Option<u32>,
}

/// State of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    Free,
    Storing,
    Ready(u32),
}

/// Free slots as maximal runs, indexed by start (to merge on release) and by length (to find
/// the best fit on allocation).
#[derive(Clone, Debug)]
struct FreeSlots {
    by_start: BTreeMap<u32, u32>,
    by_len: BTreeSet<(u32, u32)>,
    free: u32,
}

impl FreeSlots {
    fn all(capacity: u32) -> Self {
        let mut s = Self {
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
            free: 0,
        };
        s.add_run(0, capacity);
        s.free = capacity;
        s
    }

    fn add_run(&mut self, start: u32, len: u32) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
    }

    fn remove_run(&mut self, start: u32, len: u32) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
    }

    /// Reserves `n <= self.free` slots, appended to `out`; returns the number of runs used.
    fn alloc(&mut self, n: u32, out: &mut Vec<SlotId>) -> u32 {
        debug_assert!(n <= self.free);
        let mut remaining = n;
        let mut runs = 0;
        while remaining > 0 {
            let (len, start) = self
                .by_len
                .range((remaining, 0)..)
                .next()
                .or_else(|| self.by_len.last())
                .copied()
                .expect("free count says there is room");
            let take = len.min(remaining);
            self.remove_run(start, len);
            if len > take {
                self.add_run(start + take, len - take);
            }
            out.extend((start..start + take).map(SlotId));
            remaining -= take;
            runs += 1;
        }
        self.free -= n;
        runs
    }

    /// Returns one slot, merging it with its neighbours.
    fn release(&mut self, slot: u32) {
        let (mut start, mut len) = (slot, 1);
        if let Some((&ls, &ll)) = self.by_start.range(..slot).next_back() {
            debug_assert!(ls + ll <= slot, "slot {slot} released twice");
            if ls + ll == slot {
                self.remove_run(ls, ll);
                start = ls;
                len += ll;
            }
        }
        if let Some(&rl) = self.by_start.get(&(slot + 1)) {
            self.remove_run(slot + 1, rl);
            len += rl;
        }
        self.add_run(start, len);
        self.free += 1;
    }
}

/// The admission filter: per-key lookup counts in two generations; when the current one holds
/// `bound` keys it becomes the previous one (dropping the older), so memory stays bounded and
/// keys not looked up for a while are forgotten.
#[derive(Clone, Debug)]
struct Admission {
    threshold: u32,
    bound: usize,
    current: FxHashMap<Key, u32>,
    previous: FxHashMap<Key, u32>,
}

impl Admission {
    fn new(threshold: u32, capacity: u32) -> Self {
        Self {
            threshold,
            bound: (capacity as usize).max(1024),
            current: FxHashMap::default(),
            previous: FxHashMap::default(),
        }
    }

    fn enabled(&self) -> bool {
        self.threshold > 1
    }

    fn count(&self, key: Key) -> u32 {
        self.current
            .get(&key)
            .or_else(|| self.previous.get(&key))
            .copied()
            .unwrap_or(0)
    }

    fn record(&mut self, key: Key) {
        if let Some(c) = self.current.get_mut(&key) {
            *c = c.saturating_add(1);
            return;
        }
        let c = self.previous.get(&key).map_or(1, |c| c.saturating_add(1));
        if self.current.len() >= self.bound {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(key, c);
    }

    fn admits(&self, key: Key) -> bool {
        !self.enabled() || self.count(key) >= self.threshold
    }

    fn tracked(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    fn clear(&mut self) {
        self.current.clear();
        self.previous.clear();
    }
}

/// The CPU pool. See the module documentation.
#[derive(Debug)]
pub struct Pool {
    config: PoolConfig,
    index: FxHashMap<Key, SlotId>,
    entries: Vec<Entry>,
    keys: Vec<Key>,
    free: FreeSlots,
    policy: Box<dyn EvictionPolicy>,
    admission: Admission,
    events: Vec<PoolEvent>,
    event_keys: usize,
    event_limit: usize,
    storing: u32,
    pinned: u32,
    stats: PoolStats,
    victims: Vec<SlotId>,
    seen: FxHashSet<Key>,
}

impl Pool {
    /// An empty pool. Fails when the capacity is 0 or above [`MAX_CAPACITY`].
    pub fn new(config: PoolConfig) -> Result<Pool> {
        let c = config.capacity;
        if c == 0 || c > MAX_CAPACITY {
            return Err(Error::Config(format!(
                "pool capacity must be between 1 and {MAX_CAPACITY} slots, got {c}: \
                 size it as CPU bytes for KV / bytes per chunk"
            )));
        }
        Ok(Pool {
            config,
            index: FxHashMap::default(),
            entries: vec![Entry::Free; c as usize],
            keys: vec![Key(0); c as usize],
            free: FreeSlots::all(c),
            policy: config.policy.build(c),
            admission: Admission::new(config.store_threshold, c),
            events: Vec::new(),
            event_keys: 0,
            event_limit: default_event_limit(c),
            storing: 0,
            pinned: 0,
            stats: PoolStats::default(),
            victims: Vec::new(),
            seen: FxHashSet::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> PoolConfig {
        self.config
    }

    /// Number of slots.
    pub fn capacity(&self) -> u32 {
        self.config.capacity
    }

    /// The eviction policy in use.
    pub fn policy(&self) -> PolicyKind {
        self.config.policy
    }

    /// Number of keys present (storing or ready).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no key is present.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    fn entry_state(&self, slot: SlotId) -> KeyState {
        match self.entries[slot.0 as usize] {
            Entry::Free => KeyState::Absent,
            Entry::Storing => KeyState::Storing,
            Entry::Ready(pins) => KeyState::Ready { pins },
        }
    }

    /// The state of `key`. No side effects.
    pub fn state(&self, key: Key) -> KeyState {
        self.index
            .get(&key)
            .map_or(KeyState::Absent, |&s| self.entry_state(s))
    }

    /// The slot of `key`, if present (storing or ready).
    pub fn slot(&self, key: Key) -> Option<SlotId> {
        self.index.get(&key).copied()
    }

    /// How many leading keys are ready (loadable now). Counts that many hits and the rest as
    /// misses, and feeds the admission filter with every absent key.
    pub fn lookup(&mut self, keys: &[Key]) -> usize {
        self.lookup_inner(keys, None)
    }

    /// [`Pool::lookup`] that also appends the state of every key to `states`, so the caller can
    /// tell a miss (absent) from a chunk being stored (ask again later).
    pub fn lookup_states(&mut self, keys: &[Key], states: &mut Vec<KeyState>) -> usize {
        self.lookup_inner(keys, Some(states))
    }

    fn lookup_inner(&mut self, keys: &[Key], mut states: Option<&mut Vec<KeyState>>) -> usize {
        let full_scan = states.is_some() || self.admission.enabled();
        let mut prefix = 0;
        let mut in_prefix = true;
        for &key in keys {
            let state = self.state(key);
            if in_prefix {
                if matches!(state, KeyState::Ready { .. }) {
                    prefix += 1;
                } else {
                    in_prefix = false;
                    if !full_scan {
                        break;
                    }
                }
            }
            if state == KeyState::Absent && self.admission.enabled() {
                self.admission.record(key);
            }
            if let Some(out) = states.as_deref_mut() {
                out.push(state);
            }
        }
        self.stats.hits += prefix as u64;
        self.stats.misses += (keys.len() - prefix) as u64;
        prefix
    }

    /// Whether `key` already occurs among the absent keys gathered so far in this call.
    fn is_duplicate(&mut self, key: Key, plan: &StorePlan, many: bool) -> bool {
        if many {
            !self.seen.insert(key)
        } else {
            plan.keys.contains(&key) || plan.filtered.contains(&key)
        }
    }

    /// Reserves slots for the keys not present yet, evicting ready unpinned entries chosen by
    /// the policy when there is not enough free room — never an entry of a key in `keys`.
    /// Keys already present are skipped; keys the admission filter rejects are listed in
    /// [`StorePlan::filtered`]. The new entries are *storing* until [`Pool::complete_store`].
    ///
    /// All or nothing: `None` when not enough entries are evictable; then nothing changed
    /// (the refusal is counted in [`PoolStats::no_room`]).
    pub fn prepare_store(&mut self, keys: &[Key]) -> Option<StorePlan> {
        let mut plan = StorePlan::default();
        let many = keys.len() > LINEAR_DEDUP;
        if many {
            self.seen.clear();
        }
        // Ready entries of this call are protected from eviction by a temporary extra pin.
        let mut protected: Vec<SlotId> = Vec::new();
        for &key in keys {
            if let Some(&slot) = self.index.get(&key) {
                if matches!(self.entries[slot.0 as usize], Entry::Ready(_)) {
                    protected.push(slot);
                }
                continue;
            }
            if self.is_duplicate(key, &plan, many) {
                continue;
            }
            if self.admission.admits(key) {
                plan.keys.push(key);
            } else {
                plan.filtered.push(key);
            }
        }
        let need = plan.keys.len() as u32;
        let evict = need.saturating_sub(self.free.free) as usize;
        let mut victims = std::mem::take(&mut self.victims);
        victims.clear();
        if evict > 0 {
            self.adjust_pins(&protected, true);
            let entries = &self.entries;
            let found = self.policy.choose_victims(
                evict,
                &|s| entries[s.0 as usize] == Entry::Ready(0),
                &mut victims,
            );
            self.adjust_pins(&protected, false);
            if !found {
                self.victims = victims;
                self.stats.no_room += 1;
                return None;
            }
        }
        // A full pool (the steady state) has no free slot but the victims' own: they are
        // handed out directly, sorted, instead of through the free set (same runs, no B-tree
        // traffic).
        let reuse_victims = self.free.free == 0;
        plan.evicted.reserve(victims.len());
        for &slot in &victims {
            let key = self.keys[slot.0 as usize];
            self.policy.evict(slot, key);
            self.index.remove(&key);
            self.entries[slot.0 as usize] = Entry::Free;
            if !reuse_victims {
                self.free.release(slot.0);
            }
            plan.evicted.push(key);
        }
        if !plan.evicted.is_empty() {
            self.stats.evictions += plan.evicted.len() as u64;
            self.emit(PoolEventKind::Removed, plan.evicted.clone());
        }
        if need > 0 {
            plan.slots.reserve(need as usize);
            let runs = if reuse_victims {
                debug_assert_eq!(victims.len(), need as usize);
                victims.sort_unstable();
                plan.slots.extend_from_slice(&victims);
                1 + victims.windows(2).filter(|w| w[1].0 != w[0].0 + 1).count() as u32
            } else {
                self.free.alloc(need, &mut plan.slots)
            };
            for (&key, &slot) in plan.keys.iter().zip(&plan.slots) {
                self.index.insert(key, slot);
                self.entries[slot.0 as usize] = Entry::Storing;
                self.keys[slot.0 as usize] = key;
                self.policy.insert(slot, key);
            }
            self.storing += need;
            self.stats.allocations += 1;
            self.stats.allocated_slots += u64::from(need);
            self.stats.allocated_runs += u64::from(runs);
            self.stats.contiguous_allocations += u64::from(runs == 1);
        }
        self.victims = victims;
        self.stats.filtered += plan.filtered.len() as u64;
        Some(plan)
    }

    /// Adds (`up`) or removes one raw pin on the ready entries of `slots`, without touching the
    /// pinned counter: used only to hide entries from a victim search.
    fn adjust_pins(&mut self, slots: &[SlotId], up: bool) {
        for s in slots {
            if let Entry::Ready(p) = &mut self.entries[s.0 as usize] {
                *p = if up { *p + 1 } else { *p - 1 };
            }
        }
    }

    /// Finishes the stores of `keys`: with `ok` they become readable (one `stored` event);
    /// otherwise they are removed and their slots freed, never readable. Keys already ready are
    /// left as they are (a late failure cannot unpublish them). Every key must be present,
    /// else [`Error::UnknownKey`] and nothing changes.
    pub fn complete_store(&mut self, keys: &[Key], ok: bool) -> Result<()> {
        if let Some(&key) = keys.iter().find(|k| !self.index.contains_key(k)) {
            return Err(Error::UnknownKey(key));
        }
        let mut stored = Vec::new();
        for &key in keys {
            let Some(&slot) = self.index.get(&key) else {
                continue; // a duplicate of a key this call already dropped
            };
            if self.entries[slot.0 as usize] != Entry::Storing {
                continue;
            }
            self.storing -= 1;
            if ok {
                self.entries[slot.0 as usize] = Entry::Ready(0);
                stored.push(key);
            } else {
                self.policy.remove(slot);
                self.index.remove(&key);
                self.entries[slot.0 as usize] = Entry::Free;
                self.free.release(slot.0);
                self.stats.failed_stores += 1;
            }
        }
        if !stored.is_empty() {
            self.stats.stores += stored.len() as u64;
            self.emit(PoolEventKind::Stored, stored);
        }
        Ok(())
    }

    /// Pins every key for a load and returns their slots, in input order (a key listed twice is
    /// pinned twice). Every key must be ready, else [`Error::UnknownKey`] or
    /// [`Error::KeyNotReady`] and nothing changes. Does not update recency: call
    /// [`Pool::touch`] for that.
    pub fn prepare_load(&mut self, keys: &[Key]) -> Result<Vec<SlotId>> {
        let mut slots = Vec::with_capacity(keys.len());
        for &key in keys {
            let &slot = self.index.get(&key).ok_or(Error::UnknownKey(key))?;
            if self.entries[slot.0 as usize] == Entry::Storing {
                return Err(Error::KeyNotReady(key));
            }
            slots.push(slot);
        }
        for &slot in &slots {
            self.pin(slot);
        }
        self.stats.loads += keys.len() as u64;
        Ok(slots)
    }

    fn pin(&mut self, slot: SlotId) {
        if let Entry::Ready(p) = &mut self.entries[slot.0 as usize] {
            if *p == 0 {
                self.pinned += 1;
            }
            *p += 1;
        }
    }

    fn unpin(&mut self, key: Key) -> Result<()> {
        let &slot = self.index.get(&key).ok_or(Error::UnknownKey(key))?;
        match &mut self.entries[slot.0 as usize] {
            Entry::Ready(p) if *p > 0 => {
                *p -= 1;
                if *p == 0 {
                    self.pinned -= 1;
                }
                Ok(())
            }
            _ => Err(Error::KeyNotPinned(key)),
        }
    }

    /// Unpins every key (once per occurrence). Every key must be pinned, else
    /// [`Error::UnknownKey`] or [`Error::KeyNotPinned`] and nothing changes.
    pub fn complete_load(&mut self, keys: &[Key]) -> Result<()> {
        for (i, &key) in keys.iter().enumerate() {
            if let Err(e) = self.unpin(key) {
                for k in &keys[..i] {
                    let slot = self.index[k];
                    self.pin(slot);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Drops ready, unpinned entries whose content can no longer be trusted (for example after
    /// a load from them failed), freeing their slots without a ghost entry, and emits one
    /// `removed` event. Absent, storing and pinned keys are left as they are. Returns the keys
    /// dropped.
    pub fn discard(&mut self, keys: &[Key]) -> Vec<Key> {
        let mut dropped = Vec::new();
        for &key in keys {
            let Some(&slot) = self.index.get(&key) else {
                continue;
            };
            if self.entries[slot.0 as usize] != Entry::Ready(0) {
                continue;
            }
            self.policy.remove(slot);
            self.index.remove(&key);
            self.entries[slot.0 as usize] = Entry::Free;
            self.free.release(slot.0);
            dropped.push(key);
        }
        if !dropped.is_empty() {
            self.stats.discarded += dropped.len() as u64;
            self.emit(PoolEventKind::Removed, dropped.clone());
        }
        dropped
    }

    /// Recency update, walking `keys` from last to first so that the earliest prefix chunk
    /// ends most recent (prefixes outlive their suffixes). Absent keys may inform the policy
    /// (ARC ghost hits adapt its target). Call it once per access, not on every re-ask.
    pub fn touch(&mut self, keys: &[Key]) {
        for &key in keys.iter().rev() {
            match self.index.get(&key) {
                Some(&slot) => {
                    let ready = matches!(self.entries[slot.0 as usize], Entry::Ready(_));
                    self.policy.touch(slot, ready);
                }
                None => self.policy.touch_absent(key),
            }
        }
    }

    /// Recency only, no access: walks the present `keys` from last to first, so the earliest
    /// prefix chunk ends most recent, without counting a use (ARC keeps each entry in its
    /// list: a refresh never promotes T1 to T2 nor adapts the target). Absent keys are
    /// skipped. For chunks whose request is done with them, so a prefix outlives its suffixes
    /// and colder chunks leave first.
    pub fn refresh(&mut self, keys: &[Key]) {
        for &key in keys.iter().rev() {
            if let Some(&slot) = self.index.get(&key) {
                self.policy.touch(slot, false);
            }
        }
    }

    /// Drains the queued events, oldest first.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        self.event_keys = 0;
        std::mem::take(&mut self.events)
    }

    /// Bounds the event queue to `limit` keys (0: record no events). Events already queued
    /// stay until drained.
    pub fn set_event_limit(&mut self, limit: usize) {
        self.event_limit = limit;
    }

    /// The bound of the event queue, in keys (0: events are not recorded).
    pub fn event_limit(&self) -> usize {
        self.event_limit
    }

    /// Queues an event if it fits under the limit, else counts it as dropped.
    fn emit(&mut self, kind: PoolEventKind, keys: Vec<Key>) {
        if self.event_keys + keys.len() > self.event_limit {
            self.stats.events_dropped += 1;
            return;
        }
        self.event_keys += keys.len();
        self.events.push(PoolEvent { kind, keys });
    }

    /// Empties the pool: every entry (pinned and storing ones included), the policy's order
    /// and history, and the admission counts. Ready keys are announced in one `removed` event
    /// (queued after any undrained events). Counters are kept; `resets` counts the call.
    pub fn reset(&mut self) {
        let mut removed: Vec<(SlotId, Key)> = self
            .index
            .iter()
            .filter(|(_, s)| matches!(self.entries[s.0 as usize], Entry::Ready(_)))
            .map(|(&k, &s)| (s, k))
            .collect();
        removed.sort_unstable();
        if !removed.is_empty() {
            self.emit(
                PoolEventKind::Removed,
                removed.into_iter().map(|(_, k)| k).collect(),
            );
        }
        self.index.clear();
        self.entries.fill(Entry::Free);
        self.free = FreeSlots::all(self.config.capacity);
        self.policy.clear();
        self.admission.clear();
        self.storing = 0;
        self.pinned = 0;
        self.stats.resets += 1;
    }

    /// Occupancy and counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            capacity: self.config.capacity,
            used: self.index.len() as u32,
            free: self.free.free,
            storing: self.storing,
            pinned: self.pinned,
            ghosts: self.policy.ghost_len() as u32,
            target: self.policy.target(),
            admission_tracked: self.admission.tracked() as u32,
            event_keys_queued: self.event_keys as u64,
            ..self.stats
        }
    }

    /// The policy's order with keys in place of slots, for tests and debugging
    /// (O(capacity)).
    pub fn order(&self) -> PoolOrder {
        let snap = self.policy.snapshot();
        PoolOrder {
            resident: snap
                .resident
                .into_iter()
                .map(|(name, slots)| {
                    let keys = slots.iter().map(|s| self.keys[s.0 as usize]).collect();
                    (name, keys)
                })
                .collect(),
            ghosts: snap.ghosts,
            target: snap.target,
        }
    }

    /// Checks every internal invariant (O(capacity), for tests); the error says which broke.
    pub fn check_consistency(&self) -> std::result::Result<(), String> {
        let cap = self.config.capacity;
        if self.index.len() as u64 + u64::from(self.free.free) != u64::from(cap) {
            return Err(format!(
                "used {} + free {} != capacity {cap}",
                self.index.len(),
                self.free.free
            ));
        }
        let (mut storing, mut pinned) = (0, 0);
        for (&key, &slot) in &self.index {
            match self.entries[slot.0 as usize] {
                Entry::Free => return Err(format!("key {key} maps to free slot {slot}")),
                Entry::Storing => storing += 1,
                Entry::Ready(p) => pinned += u32::from(p > 0),
            }
            if self.keys[slot.0 as usize] != key {
                return Err(format!("slot {slot} of key {key} holds another key"));
            }
        }
        let occupied = self.entries.iter().filter(|e| **e != Entry::Free).count();
        if occupied != self.index.len() {
            return Err(format!(
                "{occupied} occupied slots, {} keys",
                self.index.len()
            ));
        }
        if (storing, pinned) != (self.storing, self.pinned) {
            return Err(format!(
                "counted storing/pinned {storing}/{pinned}, tracked {}/{}",
                self.storing, self.pinned
            ));
        }
        // Free runs: disjoint, maximal, all slots free, both indexes agree, sum == free.
        let (mut sum, mut prev_end) = (0u32, None::<u32>);
        for (&start, &len) in &self.free.by_start {
            if len == 0 || !self.free.by_len.contains(&(len, start)) {
                return Err(format!("free run {start}+{len} badly indexed"));
            }
            if prev_end.is_some_and(|e| e >= start) {
                return Err(format!(
                    "free run at {start} overlaps or touches the previous"
                ));
            }
            if (start..start + len).any(|s| self.entries[s as usize] != Entry::Free) {
                return Err(format!("free run {start}+{len} holds an occupied slot"));
            }
            prev_end = Some(start + len);
            sum += len;
        }
        if sum != self.free.free || self.free.by_len.len() != self.free.by_start.len() {
            return Err(format!(
                "free runs hold {sum} slots, free count {}",
                self.free.free
            ));
        }
        // Policy: every occupied slot exactly once; ghosts bounded and not resident.
        let snap = self.policy.snapshot();
        let mut listed = vec![false; cap as usize];
        for (name, slots) in &snap.resident {
            for s in slots {
                if self.entries[s.0 as usize] == Entry::Free || listed[s.0 as usize] {
                    return Err(format!("policy list {name} holds slot {s} wrongly"));
                }
                listed[s.0 as usize] = true;
            }
        }
        if listed.iter().filter(|l| **l).count() != self.index.len() {
            return Err("policy lists miss occupied slots".into());
        }
        let mut ghosts = 0;
        for (name, keys) in &snap.ghosts {
            if keys.len() > cap as usize {
                return Err(format!(
                    "ghost list {name} holds {} > {cap} keys",
                    keys.len()
                ));
            }
            if let Some(k) = keys.iter().find(|k| self.index.contains_key(k)) {
                return Err(format!("ghost list {name} holds resident key {k}"));
            }
            ghosts += keys.len();
        }
        if ghosts + self.index.len() > 2 * cap as usize || ghosts != self.policy.ghost_len() {
            return Err(format!("{ghosts} ghosts over the bound"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(pool: &mut Pool, keys: &[u128]) {
        let keys: Vec<Key> = keys.iter().map(|&k| Key(k)).collect();
        pool.prepare_store(&keys).expect("room");
        pool.complete_store(&keys, true).unwrap();
    }

    #[test]
    fn the_event_queue_is_bounded_and_counts_what_it_dropped() {
        let mut pool = Pool::new(PoolConfig::new(16)).unwrap();
        assert_eq!(pool.event_limit(), 1 << 16);
        pool.set_event_limit(3);
        stored(&mut pool, &[1, 2]);
        stored(&mut pool, &[3, 4]); // would make 4 keys: dropped whole
        stored(&mut pool, &[5]);
        let s = pool.stats();
        assert_eq!((s.events_dropped, s.event_keys_queued), (1, 3));
        let events = pool.take_events();
        let keys: Vec<Vec<u128>> = events
            .iter()
            .map(|e| e.keys.iter().map(|k| k.0).collect())
            .collect();
        assert_eq!(keys, vec![vec![1, 2], vec![5]]);
        assert_eq!(pool.stats().event_keys_queued, 0);
        // Draining makes room again.
        stored(&mut pool, &[6, 7, 8]);
        assert_eq!(pool.take_events().len(), 1);
        // Limit 0: nothing is recorded, everything is counted.
        pool.set_event_limit(0);
        stored(&mut pool, &[9]);
        assert!(pool.take_events().is_empty());
        assert_eq!(pool.stats().events_dropped, 2);
    }
}
