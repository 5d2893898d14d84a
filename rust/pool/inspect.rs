//! Occupancy, counters, the policy order with keys, and the consistency check for tests.

use crate::ids::{Key, SlotId};
use crate::policy::UNLINKED;

use super::{Entry, Pool};

/// Occupancy and counters of a pool. Counters are cumulative across resets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Number of slots.
    pub capacity: u32,
    /// Slots holding a key (storing or ready).
    pub used: u32,
    /// Free slots (`used + held + free == capacity`).
    pub free: u32,
    /// Slots held for a late writer ([`Pool::hold`]): neither used nor free.
    pub held: u32,
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

impl Pool {
    /// Occupancy and counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            capacity: self.config.capacity,
            used: self.index.len() as u32,
            free: self.free.free,
            storing: self.storing,
            held: self.held,
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
        let snap = self.policy.snapshot(&self.records);
        PoolOrder {
            resident: snap
                .resident
                .into_iter()
                .map(|(name, slots)| {
                    let keys = slots.iter().map(|&s| self.key_of(s)).collect();
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
        let held = u64::from(self.held);
        if self.index.len() as u64 + held + u64::from(self.free.free) != u64::from(cap) {
            return Err(format!(
                "used {} + held {held} + free {} != capacity {cap}",
                self.index.len(),
                self.free.free
            ));
        }
        self.index.check(&self.records)?;
        let (mut storing, mut pinned) = (0, 0);
        for (key, slot) in self.index.iter(&self.records) {
            match self.entry(slot) {
                Entry::Free => return Err(format!("key {key} maps to free slot {slot}")),
                Entry::Storing => storing += 1,
                Entry::Ready(p) => pinned += u32::from(p > 0),
            }
        }
        let occupied = (self.records.iter())
            .filter(|r| r.entry != Entry::Free)
            .count();
        // A free slot is in no list of the policy.
        if let Some(s) =
            (self.records.iter()).position(|r| r.entry == Entry::Free && r.links != UNLINKED)
        {
            return Err(format!(
                "free slot {s} is still linked in the policy's lists"
            ));
        }
        if occupied as u64 != self.index.len() as u64 + held {
            return Err(format!(
                "{occupied} occupied slots, {} keys and {held} held",
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
            if (start..start + len).any(|s| self.entry(SlotId(s)) != Entry::Free) {
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
        let snap = self.policy.snapshot(&self.records);
        let mut listed = vec![false; cap as usize];
        for (name, slots) in &snap.resident {
            for s in slots {
                if self.entry(*s) == Entry::Free || listed[s.0 as usize] {
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
            if let Some(k) = keys
                .iter()
                .find(|k| self.index.get(**k, &self.records).is_some())
            {
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
