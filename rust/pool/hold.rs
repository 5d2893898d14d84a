//! Held slots: a store that the scheduler gave up on (a promotion past its deadline) while a
//! worker may still write into its slots.
//!
//! [`Pool::hold`] takes storing keys out of the index (they are absent at once: lookups stop
//! waiting for them and a new store of the same key gets another slot) but keeps their slots
//! *held*: not free, never a victim, never handed out, because the late writer may still
//! write there. [`Pool::release_held`] frees them once that writer reported. A held slot is a
//! `Storing` entry whose key is not in the index (counted in [`PoolStats::held`]); it is never
//! readable.
//!
//! [`PoolStats::held`]: super::PoolStats::held

use crate::error::{Error, Result};
use crate::ids::{Key, SlotId};

use super::{Entry, Pool};

impl Pool {
    /// Takes the storing `keys` out of the index and holds their slots (returned in key
    /// order) until [`Pool::release_held`]. Every key must be storing (a duplicate is an
    /// error), else [`Error::UnknownKey`] names the first that is not and nothing changes.
    pub fn hold(&mut self, keys: &[Key]) -> Result<Vec<SlotId>> {
        let mut slots = Vec::with_capacity(keys.len());
        for &key in keys {
            match self.index.get(key, &self.records) {
                Some(s) if self.entry(s) == Entry::Storing && !slots.contains(&s) => {
                    slots.push(s);
                }
                _ => return Err(Error::UnknownKey(key)),
            }
        }
        for (&key, &slot) in keys.iter().zip(&slots) {
            self.index.remove(key, slot);
            self.policy.remove(&mut self.records, slot);
            self.storing -= 1;
            self.held += 1;
        }
        Ok(slots)
    }

    /// Frees `slots` held by [`Pool::hold`]. Every slot must be held (a duplicate is an
    /// error), else [`Error::Config`] names it and nothing changes.
    pub fn release_held(&mut self, slots: &[SlotId]) -> Result<()> {
        for (i, &s) in slots.iter().enumerate() {
            let held = self.records.get(s.0 as usize).is_some_and(|r| {
                r.entry == Entry::Storing && self.index.get(r.key, &self.records) != Some(s)
            }) && !slots[..i].contains(&s);
            if !held {
                return Err(Error::Config(format!("release_held: slot {s} is not held")));
            }
        }
        for &s in slots {
            *self.entry_mut(s) = Entry::Free;
            self.free.release(s.0);
            self.held -= 1;
        }
        Ok(())
    }
}
