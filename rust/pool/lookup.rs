//! Reads and recency: key states, leading-ready lookups (feeding the admission filter),
//! `touch` (an access) and `refresh` (recency only).

use crate::ids::{Key, SlotId};

use super::{Entry, KeyState, Pool};

impl Pool {
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

    /// [`Pool::refresh`] with a slot hint per key (`hints[i]` for `keys[i]`; missing or
    /// [`SlotId::NONE`] hints are fine): see [`Pool::hinted_slot`]. Same effect as
    /// `refresh(keys)`, fewer index probes.
    pub fn refresh_hinted(&mut self, keys: &[Key], hints: &[SlotId]) {
        for (i, &key) in keys.iter().enumerate().rev() {
            if let Some(slot) = self.hinted_slot(key, hints.get(i).copied()) {
                self.policy.touch(slot, false);
            }
        }
    }

    /// The slot of `key` (as [`Pool::slot`]), trying `hint` first: a hinted slot that holds
    /// `key` ready, or storing while no slot is held, is the one the index maps `key` to
    /// (held slots are storing entries outside the index), so it is used without probing
    /// the index; any other hint falls back to the probe.
    pub(super) fn hinted_slot(&self, key: Key, hint: Option<SlotId>) -> Option<SlotId> {
        if let Some(slot) = hint {
            let s = slot.0 as usize;
            let sure = match self.entries.get(s) {
                Some(Entry::Ready(_)) => true,
                Some(Entry::Storing) => self.held == 0,
                Some(Entry::Free) | None => false,
            };
            if sure && self.keys[s] == key {
                return Some(slot);
            }
        }
        self.index.get(&key).copied()
    }
}
