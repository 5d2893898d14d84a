//! Reads and recency: key states, leading-ready lookups (feeding the admission filter),
//! `touch` (an access) and `refresh` (recency only).

use crate::ids::{Key, SlotId};
use crate::policy::Touch;

use super::{Entry, KeyState, Pool};

/// Keys whose index probes [`Pool::lookup_slots`] issues together.
const PROBE_BATCH: usize = 16;

impl Pool {
    fn entry_state(&self, slot: SlotId) -> KeyState {
        match self.entry(slot) {
            Entry::Free => KeyState::Absent,
            Entry::Storing => KeyState::Storing,
            Entry::Ready(pins) => KeyState::Ready { pins },
        }
    }

    /// The state of `key`. No side effects.
    pub fn state(&self, key: Key) -> KeyState {
        self.index
            .get(key, &self.records)
            .map_or(KeyState::Absent, |s| self.entry_state(s))
    }

    /// The slot of `key`, if present (storing or ready).
    pub fn slot(&self, key: Key) -> Option<SlotId> {
        self.index.get(key, &self.records)
    }

    /// Sets `slots[i]` to [`Pool::slot`]`(keys[i])` wherever it holds [`SlotId::NONE`] (an
    /// absent key leaves it so); other entries are kept as they are. Each run of unknown
    /// entries is resolved in batches whose cache misses overlap, guessing first that a key's
    /// slot follows the slot before it ([`Pool::slots_after`]): that pays off where `keys` are
    /// consecutive chunks of one sequence; any keys get the index's answers.
    pub fn fill_slots(&self, keys: &[Key], slots: &mut [SlotId]) {
        let mut found = [None; PROBE_BATCH];
        let len = keys.len().min(slots.len());
        let mut i = 0;
        while i < len {
            if slots[i] != SlotId::NONE {
                i += 1;
                continue;
            }
            let run_end = (i..len).find(|&j| slots[j] != SlotId::NONE).unwrap_or(len);
            let end = run_end.min(i + PROBE_BATCH);
            let prev = i
                .checked_sub(1)
                .map(|p| slots[p])
                .filter(|&s| s != SlotId::NONE);
            let next = &keys[end..run_end.min(end + PROBE_BATCH)];
            let out = &mut found[..end - i];
            self.slots_after(&keys[i..end], prev, out, next);
            for (s, f) in slots[i..end].iter_mut().zip(out.iter()) {
                *s = f.unwrap_or(SlotId::NONE);
            }
            i = end;
        }
    }

    /// How many leading keys are ready (loadable now). Counts that many hits and the rest as
    /// misses, and feeds the admission filter with every absent key.
    pub fn lookup(&mut self, keys: &[Key]) -> usize {
        self.lookup_inner(keys, None, None, false)
    }

    /// [`Pool::lookup`] that also appends the state of every key to `states`, so the caller can
    /// tell a miss (absent) from a chunk being stored (ask again later).
    pub fn lookup_states(&mut self, keys: &[Key], states: &mut Vec<KeyState>) -> usize {
        self.lookup_inner(keys, Some(states), None, false)
    }

    /// [`Pool::lookup_states`] that also appends the slot of every key whose state it appends
    /// ([`SlotId::NONE`] for an absent key): hints for [`Pool::touch_hinted`] and
    /// [`Pool::prepare_load_hinted`], valid until the pool changes (they are checked before use
    /// anyway). With `stop_at_absent` the scan ends after the first absent key (its state is
    /// the last one appended) unless the admission filter must see every absent key; hits and
    /// misses are counted over all of `keys` either way.
    pub fn lookup_slots(
        &mut self,
        keys: &[Key],
        states: &mut Vec<KeyState>,
        slots: &mut Vec<SlotId>,
        stop_at_absent: bool,
    ) -> usize {
        self.lookup_inner(keys, Some(states), Some(slots), stop_at_absent)
    }

    fn lookup_inner(
        &mut self,
        keys: &[Key],
        mut states: Option<&mut Vec<KeyState>>,
        mut slots: Option<&mut Vec<SlotId>>,
        stop_at_absent: bool,
    ) -> usize {
        let filter = self.admission.enabled();
        let full_scan = filter || (states.is_some() && !stop_at_absent);
        let mut prefix = 0;
        let mut in_prefix = true;
        // The index is probed a batch of keys ahead of the scan: the probes of a batch are
        // independent, so their cache misses overlap (at most a batch's probes are wasted
        // past the key where the scan stops).
        let mut probed = [None; PROBE_BATCH];
        let mut batch = 0..0;
        let mut last = None;
        for (i, &key) in keys.iter().enumerate() {
            if !batch.contains(&i) {
                batch = i..(i + PROBE_BATCH).min(keys.len());
                let next = &keys[batch.end..(batch.end + PROBE_BATCH).min(keys.len())];
                self.slots_after(&keys[batch.clone()], last, &mut probed, next);
            }
            let slot = probed[i - batch.start];
            last = slot;
            let state = slot.map_or(KeyState::Absent, |s| self.entry_state(s));
            if in_prefix {
                if matches!(state, KeyState::Ready { .. }) {
                    prefix += 1;
                } else {
                    in_prefix = false;
                }
            }
            if state == KeyState::Absent && filter {
                self.admission.record(key);
            }
            if let Some(out) = states.as_deref_mut() {
                out.push(state);
            }
            if let Some(out) = slots.as_deref_mut() {
                out.push(slot.unwrap_or(SlotId::NONE));
            }
            let stop = if states.is_some() {
                state == KeyState::Absent
            } else {
                !in_prefix
            };
            if stop && !full_scan {
                break;
            }
        }
        self.stats.hits += prefix as u64;
        self.stats.misses += (keys.len() - prefix) as u64;
        prefix
    }

    /// Recency update, walking `keys` from last to first so that the earliest prefix chunk
    /// ends most recent (prefixes outlive their suffixes). Absent keys may inform the policy
    /// (ARC ghost hits adapt its target). Call it once per access, not on every re-ask.
    pub fn touch(&mut self, keys: &[Key]) {
        self.touch_hinted(keys, &[]);
    }

    /// [`Pool::touch`] with a slot hint per key (`hints[i]` for `keys[i]`; missing or
    /// [`SlotId::NONE`] hints are fine): see [`Pool::hinted_slot`]. Same effect as
    /// `touch(keys)`, fewer index probes.
    pub fn touch_hinted(&mut self, keys: &[Key], hints: &[SlotId]) {
        self.touch_batch(keys, hints, true, false);
    }

    /// [`Pool::touch`] of `keys` whose slots are known: `slots[i]` is `keys[i]`'s slot, or
    /// [`SlotId::NONE`] where the key is absent, as [`Pool::fill_slots`] left them with no
    /// change to the pool since (a present slot is still checked, as a hint is; an absent key
    /// is not probed again).
    pub fn touch_resolved(&mut self, keys: &[Key], slots: &[SlotId]) {
        self.touch_batch(keys, slots, true, true);
    }

    /// The touches of `keys` (`hints` as in [`Pool::touch_hinted`]), walked from last to first
    /// and applied in that order in one batch; `access`: a use (absent keys inform the policy),
    /// else a refresh (present keys only, none ready); `resolved`: a [`SlotId::NONE`] hint
    /// means absent ([`Pool::touch_resolved`]). Two passes, the same effect as one touch per
    /// key: the slots first (independent loads, whose cache misses overlap), then the policy's
    /// moves.
    fn touch_batch(&mut self, keys: &[Key], hints: &[SlotId], access: bool, resolved: bool) {
        let mut touches = std::mem::take(&mut self.touches);
        touches.clear();
        for (i, &key) in keys.iter().enumerate().rev() {
            if let Some(a) = i.checked_sub(8) {
                // A hint's record, or the index bucket of a key without one (unless a resolved
                // hint says it is absent): either way the probe below then waits for nothing.
                match hints.get(a) {
                    Some(&SlotId::NONE) if resolved => {}
                    Some(&h) if h != SlotId::NONE => self.warm(h),
                    _ => self.index.warm(keys[a]),
                }
            }
            let hint = hints.get(i).copied();
            let slot = if resolved && hint == Some(SlotId::NONE) {
                None
            } else {
                self.hinted_slot(key, hint)
            };
            match slot {
                Some(slot) => touches.push(Touch::Resident {
                    slot,
                    ready: access && matches!(self.entry(slot), Entry::Ready(_)),
                }),
                None if access => touches.push(Touch::Absent(key)),
                None => {}
            }
        }
        self.policy.touch_many(&mut self.records, &touches);
        self.touches = touches;
    }

    /// Recency only, no access: walks the present `keys` from last to first, so the earliest
    /// prefix chunk ends most recent, without counting a use (ARC keeps each entry in its
    /// list: a refresh never promotes T1 to T2 nor adapts the target). Absent keys are
    /// skipped. For chunks whose request is done with them, so a prefix outlives its suffixes
    /// and colder chunks leave first.
    pub fn refresh(&mut self, keys: &[Key]) {
        for &key in keys.iter().rev() {
            if let Some(slot) = self.index.get(key, &self.records) {
                self.policy.touch(&mut self.records, slot, false);
            }
        }
    }

    /// [`Pool::refresh`] with a slot hint per key (`hints[i]` for `keys[i]`; missing or
    /// [`SlotId::NONE`] hints are fine): see [`Pool::hinted_slot`]. Same effect as
    /// `refresh(keys)`, fewer index probes.
    pub fn refresh_hinted(&mut self, keys: &[Key], hints: &[SlotId]) {
        self.touch_batch(keys, hints, false, false);
    }

    /// Prefetches the record of `slot` (if any) ahead of a hint check; changes nothing.
    pub(super) fn warm(&self, slot: SlotId) {
        if let Some(r) = self.records.get(slot.0 as usize) {
            crate::prefetch::prefetch_all(r);
        }
    }

    /// The slot of `key` (as [`Pool::slot`]), trying `hint` first: a hinted slot that
    /// [`Pool::holds`] `key` is the one the index maps `key` to, so it is used without probing
    /// the index; any other hint falls back to the probe.
    pub(super) fn hinted_slot(&self, key: Key, hint: Option<SlotId>) -> Option<SlotId> {
        match hint {
            Some(s) if self.holds(key, s) => hint,
            _ => self.index.get(key, &self.records),
        }
    }

    /// Whether the index maps `key` to `slot`, read from the slot's record alone: it holds
    /// `key` ready, or storing while no slot is held (held slots are storing entries outside
    /// the index). `false` may still be a slot of `key`'s (then the index says so).
    fn holds(&self, key: Key, slot: SlotId) -> bool {
        self.records.get(slot.0 as usize).is_some_and(|r| {
            r.key == key
                && match r.entry {
                    Entry::Ready(_) => true,
                    Entry::Storing => self.held == 0,
                    Entry::Free => false,
                }
        })
    }

    /// The slots of `keys` into `out`, as [`SlotIndex::get_many`] (`next`: the keys probed
    /// after these), guessing first that they follow `prev`, the previous key's slot, slot
    /// after slot: a prefix stored by one job holds a run of consecutive slots, so its records
    /// are one sequential read, and a key its guessed record [`Pool::holds`] needs no index
    /// probe. From the first guess that fails, the keys left are probed. The guesses' records
    /// are asked for alone: with the keys' home buckets beside them, they wait behind those.
    ///
    /// [`SlotIndex::get_many`]: super::index::SlotIndex::get_many
    fn slots_after(
        &self,
        keys: &[Key],
        prev: Option<SlotId>,
        out: &mut [Option<SlotId>],
        next: &[Key],
    ) {
        let mut known = 0;
        if let Some(p) = prev {
            let first = p.0 as usize + 1;
            let guesses = self
                .records
                .get(first..)
                .map_or(&[][..], |r| &r[..keys.len().min(r.len())]);
            for r in guesses {
                crate::prefetch::prefetch(r);
            }
            while known < guesses.len() {
                let slot = SlotId((first + known) as u32);
                if !self.holds(keys[known], slot) {
                    break;
                }
                out[known] = Some(slot);
                known += 1;
            }
        }
        if known < keys.len() {
            self.index
                .get_many(&keys[known..], &self.records, &mut out[known..], next);
        }
    }
}
