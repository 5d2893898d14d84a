//! Loads: pins on ready entries (never evicted while pinned), and `discard` of entries whose
//! content is no longer trusted.

use crate::error::{Error, Result};
use crate::ids::{Key, SlotId};

use super::store::RECORDS_AHEAD;
use super::{Entry, Pool, PoolEventKind};

impl Pool {
    /// Pins every key for a load and returns their slots, in input order (a key listed twice is
    /// pinned twice). Every key must be ready, else [`Error::UnknownKey`] or
    /// [`Error::KeyNotReady`] and nothing changes. Does not update recency: call
    /// [`Pool::touch`] for that.
    pub fn prepare_load(&mut self, keys: &[Key]) -> Result<Vec<SlotId>> {
        self.prepare_load_hinted(keys, &[])
    }

    /// [`Pool::prepare_load`] with a slot hint per key (`hints[i]` for `keys[i]`, as
    /// [`Pool::lookup_slots`] gave them; missing or wrong hints are fine, see
    /// [`Pool::hinted_slot`]): same effect, fewer index probes.
    pub fn prepare_load_hinted(&mut self, keys: &[Key], hints: &[SlotId]) -> Result<Vec<SlotId>> {
        let mut slots = Vec::with_capacity(keys.len());
        for (i, &key) in keys.iter().enumerate() {
            let slot = self
                .hinted_slot(key, hints.get(i).copied())
                .ok_or(Error::UnknownKey(key))?;
            if self.entry(slot) == Entry::Storing {
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

    /// The slot of `key` while something pins it (a load, or a tier write reading it), trying
    /// `hint` first (see [`Pool::hinted_slot`]). No side effects.
    pub fn pinned_slot(&self, key: Key, hint: Option<SlotId>) -> Option<SlotId> {
        let slot = self.hinted_slot(key, hint)?;
        matches!(self.entry(slot), Entry::Ready(pins) if pins > 0).then_some(slot)
    }

    fn pin(&mut self, slot: SlotId) {
        if let Entry::Ready(p) = &mut self.records[slot.0 as usize].entry {
            if *p == 0 {
                self.pinned += 1;
            }
            *p += 1;
        }
    }

    fn unpin(&mut self, key: Key, hint: Option<SlotId>) -> Result<()> {
        let slot = self.hinted_slot(key, hint).ok_or(Error::UnknownKey(key))?;
        match &mut self.records[slot.0 as usize].entry {
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
        self.complete_load_hinted(keys, &[])
    }

    /// [`Pool::complete_load`] with a slot hint per key (`hints[i]` for `keys[i]`, as
    /// [`Pool::prepare_load`] gave them; missing or wrong hints are fine, see
    /// [`Pool::hinted_slot`]): same effect, fewer index probes.
    pub fn complete_load_hinted(&mut self, keys: &[Key], hints: &[SlotId]) -> Result<()> {
        for (i, &key) in keys.iter().enumerate() {
            // The records are cold: load a few ahead so their misses overlap.
            if let Some(&ahead) = hints.get(i + RECORDS_AHEAD) {
                self.prefetch_record(ahead);
            }
            if let Err(e) = self.unpin(key, hints.get(i).copied()) {
                for k in &keys[..i] {
                    let slot = self.index.get(*k, &self.records).expect("unpinned above");
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
            let Some(slot) = self.index.get(key, &self.records) else {
                continue;
            };
            if self.entry(slot) != Entry::Ready(0) {
                continue;
            }
            self.policy.remove(&mut self.records, slot);
            self.index.remove(key, slot);
            *self.entry_mut(slot) = Entry::Free;
            self.free.release(slot.0);
            dropped.push(key);
        }
        if !dropped.is_empty() {
            self.stats.discarded += dropped.len() as u64;
            self.emit_copy(PoolEventKind::Removed, &dropped);
        }
        dropped
    }
}
