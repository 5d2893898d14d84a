//! Stores: `prepare_store` reserves slots (evicting ready, unpinned entries the policy
//! chooses; all or nothing) and `complete_store` publishes or drops the keys.

use crate::error::{Error, Result};
use crate::ids::{Key, SlotId};

use super::{Entry, Pool, PoolEventKind};

/// Keys below this many per call are deduplicated by a linear scan, above it with a table
/// (`dedup.rs`).
const LINEAR_DEDUP: usize = 32;

/// How many index probes [`Pool::prepare_store`] keeps in flight ahead of its work (on its
/// keys, then on its victims' keys): a prefill's store names hundreds of keys, each a miss in
/// the index, which overlap only if asked for well before they are read.
const WARM_PROBES: usize = 64;

/// How far ahead of the key it completes a completion asks for a slot's record: at ~100 ns a
/// miss and a few ns a key, far enough for the misses to overlap.
pub(super) const RECORDS_AHEAD: usize = 16;

/// How many entries of the eviction end [`Pool::warm_victims`] reads or loads: the next
/// victim and the one after (their buckets), and the record of the third.
const VICTIMS_AHEAD: usize = 3;

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

impl Pool {
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
        self.prepare_store_into(keys, &mut plan).then_some(plan)
    }

    /// [`Pool::prepare_store`] into a caller's plan, cleared first (a caller that reuses one
    /// plan across calls allocates nothing once its lists have grown): `false` where
    /// `prepare_store` answers `None` (then nothing changed and `plan` says nothing).
    pub fn prepare_store_into(&mut self, keys: &[Key], plan: &mut StorePlan) -> bool {
        plan.keys.clear();
        plan.slots.clear();
        plan.evicted.clear();
        plan.filtered.clear();
        plan.keys.reserve(keys.len());
        let many = keys.len() > LINEAR_DEDUP;
        if many {
            self.seen.start(keys.len());
        }
        // Ready entries of this call are protected from eviction by a temporary extra pin.
        // (`scratch` is free between calls: it holds `complete_store`'s slots only there.)
        let mut protected = std::mem::take(&mut self.scratch);
        protected.clear();
        self.warm_index(keys.iter().copied());
        for (i, &key) in keys.iter().enumerate() {
            if let Some(&ahead) = keys.get(i + WARM_PROBES) {
                self.index.warm(ahead);
            }
            if let Some(slot) = self.index.get(key, &self.records) {
                if matches!(self.entry(slot), Entry::Ready(_)) {
                    protected.push(slot);
                }
                continue;
            }
            if self.is_duplicate(key, plan, many) {
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
            let records = &self.records;
            let found = self.policy.choose_victims(
                records,
                evict,
                &|s| records[s.0 as usize].entry == Entry::Ready(0),
                &mut victims,
            );
            self.adjust_pins(&protected, false);
            if !found {
                self.victims = victims;
                self.scratch = protected;
                self.stats.no_room += 1;
                return false;
            }
        }
        // A full pool (the steady state) has no free slot but the victims' own: they are
        // handed out directly, sorted, instead of through the free set (same runs, no B-tree
        // traffic).
        let reuse_victims = self.free.free == 0;
        plan.evicted.reserve(victims.len());
        self.warm_index(victims.iter().map(|&s| self.key_of(s)));
        for (i, &slot) in victims.iter().enumerate() {
            if let Some(&ahead) = victims.get(i + WARM_PROBES) {
                self.index.warm(self.key_of(ahead));
            }
            let key = self.key_of(slot);
            self.policy.evict(&mut self.records, slot, key);
            self.index.remove(key, slot);
            *self.entry_mut(slot) = Entry::Free;
            if !reuse_victims {
                self.free.release(slot.0);
            }
            plan.evicted.push(key);
        }
        if !plan.evicted.is_empty() {
            self.stats.evictions += plan.evicted.len() as u64;
            self.emit_copy(PoolEventKind::Removed, &plan.evicted);
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
                let r = &mut self.records[slot.0 as usize];
                r.entry = Entry::Storing;
                r.key = key;
                self.policy.insert(&mut self.records, slot, key);
            }
            self.storing += need;
            self.stats.allocations += 1;
            self.stats.allocated_slots += u64::from(need);
            self.stats.allocated_runs += u64::from(runs);
            self.stats.contiguous_allocations += u64::from(runs == 1);
        }
        self.victims = victims;
        self.scratch = protected;
        self.stats.filtered += plan.filtered.len() as u64;
        true
    }

    /// Probes the index for the first [`WARM_PROBES`] of `keys` ahead of the work on them (the
    /// work asks for each later one as it goes); changes nothing. The probes are independent,
    /// so their cache misses overlap, where the work's own probes would wait for each other.
    fn warm_index(&self, keys: impl Iterator<Item = Key>) {
        for key in keys.take(WARM_PROBES) {
            self.index.warm(key);
        }
    }

    /// Adds (`up`) or removes one raw pin on the ready entries of `slots`, without touching the
    /// pinned counter: used only to hide entries from a victim search.
    fn adjust_pins(&mut self, slots: &[SlotId], up: bool) {
        for s in slots {
            if let Entry::Ready(p) = self.entry_mut(*s) {
                *p = if up { *p + 1 } else { *p - 1 };
            }
        }
    }

    /// Asks for the index bucket of `key` ahead of a store naming it; changes nothing.
    pub fn warm_key(&self, key: Key) {
        self.index.warm(key);
    }

    /// When the pool is full, asks for what the next store's victim search and eviction read
    /// first: the records at the eviction end of the policy's order and the index buckets of
    /// the keys they hold. Changes nothing. Called before each store of a run of small ones
    /// (a decode step's one-chunk stores, each evicting one entry), the records it reads were
    /// asked for by the call before, so each call waits for nothing and the next store's
    /// misses are in flight before it starts.
    pub fn warm_victims(&self) {
        if self.free.free > 0 {
            return;
        }
        let mut front = [SlotId::NONE; VICTIMS_AHEAD];
        let n = self.policy.eviction_front(&self.records, &mut front);
        for (k, &slot) in front[..n].iter().enumerate() {
            if k + 1 < n {
                self.index.warm(self.key_of(slot));
            } else {
                self.prefetch_record(slot);
            }
        }
    }

    /// Asks for the records of `slots` ahead of their completion (a store's hints); changes
    /// nothing.
    pub fn warm_slots(&self, slots: &[SlotId]) {
        for &slot in slots {
            self.prefetch_record(slot);
        }
    }

    /// Asks for the record of `slot` (if any) ahead of its use; changes nothing.
    pub(super) fn prefetch_record(&self, slot: SlotId) {
        if let Some(r) = self.records.get(slot.0 as usize) {
            crate::prefetch::prefetch(r);
        }
    }

    /// Finishes the stores of `keys`: with `ok` they become readable (one `stored` event);
    /// otherwise they are removed and their slots freed, never readable. Keys already ready are
    /// left as they are (a late failure cannot unpublish them). Every key must be present,
    /// else [`Error::UnknownKey`] and nothing changes.
    pub fn complete_store(&mut self, keys: &[Key], ok: bool) -> Result<()> {
        self.complete_store_hinted(keys, ok, &[])
    }

    /// [`Pool::complete_store`] with a slot hint per key (`hints[i]` for `keys[i]`, as
    /// `StorePlan::slots` gave them; missing or wrong hints are fine, see
    /// [`Pool::hinted_slot`]): same effect, fewer index probes.
    pub fn complete_store_hinted(
        &mut self,
        keys: &[Key],
        ok: bool,
        hints: &[SlotId],
    ) -> Result<()> {
        let mut slots = std::mem::take(&mut self.scratch);
        slots.clear();
        for (i, &key) in keys.iter().enumerate() {
            // The records are cold: load a few ahead so their misses overlap.
            if let Some(&ahead) = hints.get(i + RECORDS_AHEAD) {
                self.prefetch_record(ahead);
            }
            let Some(slot) = self.hinted_slot(key, hints.get(i).copied()) else {
                self.scratch = slots;
                return Err(Error::UnknownKey(key));
            };
            slots.push(slot);
        }
        // The stored keys are gathered only for a queue with room (none when events are off).
        let record = self.event_keys < self.event_limit;
        let mut stored = Vec::with_capacity(if record { keys.len() } else { 0 });
        let mut n = 0;
        for (&key, &slot) in keys.iter().zip(&slots) {
            // A duplicate of a key this call already handled is no longer storing.
            if self.entry(slot) != Entry::Storing {
                continue;
            }
            self.storing -= 1;
            if ok {
                *self.entry_mut(slot) = Entry::Ready(0);
                n += 1;
                if record {
                    stored.push(key);
                }
            } else {
                self.policy.remove(&mut self.records, slot);
                self.index.remove(key, slot);
                *self.entry_mut(slot) = Entry::Free;
                self.free.release(slot.0);
                self.stats.failed_stores += 1;
            }
        }
        self.scratch = slots;
        if n > 0 {
            self.stats.stores += n;
            if record {
                self.emit(PoolEventKind::Stored, stored);
            } else {
                self.stats.events_dropped += 1;
            }
        }
        Ok(())
    }
}
