//! The pool's index, key -> slot: an open-addressing table of 8-byte buckets with linear
//! probing, sized once for the pool (at most half full), whose keys live in the slot records.
//!
//! A bucket holds a slot and 32 bits of its key's hash (the low bits of which are the home
//! bucket): a probe compares hashes in the table and reads a candidate's record only to confirm
//! its key, the record a lookup reads next anyway for the slot's state. So a probe costs one
//! cache miss in the table (eight buckets a line, runs are short) where a general hash map
//! costs two (its control bytes, then a 32-byte key bucket), and the bucket's address is known
//! from the key alone, so a batch of probes can be warmed ahead ([`SlotIndex::warm`]).
//! Removal shifts the run's later entries back (no tombstones), so probes never lengthen with
//! churn.

use crate::ids::{Key, SlotId};
use crate::prefetch::prefetch;

use super::Record;

/// An empty bucket (no real slot is `u32::MAX`).
const EMPTY: u64 = u64::MAX;

/// The index (see the module documentation).
#[derive(Debug)]
pub(super) struct SlotIndex {
    buckets: Vec<u64>,
    mask: usize,
    len: usize,
}

/// 32 bits of `key`'s hash. Keys derive from the engine's hashes but may be small integers
/// (tests, other engines): the multiply spreads them.
pub(super) fn hash(key: Key) -> u32 {
    let x = (key.0 as u64) ^ ((key.0 >> 64) as u64);
    (x.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
}

fn bucket(h: u32, slot: SlotId) -> u64 {
    (u64::from(h) << 32) | u64::from(slot.0)
}

fn slot_of(b: u64) -> SlotId {
    SlotId(b as u32)
}

fn hash_of(b: u64) -> u32 {
    (b >> 32) as u32
}

impl SlotIndex {
    /// An empty index for a pool of `capacity` slots (every slot's key fits, half full at most).
    pub(super) fn new(capacity: u32) -> SlotIndex {
        let n = (2 * capacity as usize).next_power_of_two().max(16);
        SlotIndex {
            buckets: crate::mem::huge_page_vec(EMPTY, n),
            mask: n - 1,
            len: 0,
        }
    }

    /// Number of keys indexed.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every key.
    pub(super) fn clear(&mut self) {
        if self.len > 0 {
            self.buckets.fill(EMPTY);
            self.len = 0;
        }
    }

    /// The slot of `key`, confirmed against the slot records.
    pub(super) fn get(&self, key: Key, records: &[Record]) -> Option<SlotId> {
        self.position(key, records)
            .map(|p| slot_of(self.buckets[p]))
    }

    /// The bucket holding `key`, if indexed.
    fn position(&self, key: Key, records: &[Record]) -> Option<usize> {
        self.find(key, |s| records[s.0 as usize].key == key)
    }

    /// The first bucket of `key`'s run with its hash whose slot `confirm` accepts.
    fn find(&self, key: Key, confirm: impl Fn(SlotId) -> bool) -> Option<usize> {
        let h = hash(key);
        let mut p = h as usize & self.mask;
        loop {
            let b = self.buckets[p];
            if b == EMPTY {
                return None;
            }
            if hash_of(b) == h && confirm(slot_of(b)) {
                return Some(p);
            }
            p = (p + 1) & self.mask;
        }
    }

    /// Prefetches `key`'s home bucket ahead of its probe; changes nothing.
    pub(super) fn warm(&self, key: Key) {
        crate::prefetch::prefetch(&self.buckets[hash(key) as usize & self.mask]);
    }

    /// The slot of `key`'s first bucket with its hash, unconfirmed (a record to load ahead of
    /// [`SlotIndex::get`]).
    pub(super) fn candidate(&self, key: Key) -> Option<SlotId> {
        self.find(key, |_| true).map(|p| slot_of(self.buckets[p]))
    }

    /// Asks for `key`'s home bucket ahead of its probe, without waiting for it.
    fn prefetch(&self, key: Key) {
        prefetch(&self.buckets[hash(key) as usize & self.mask]);
    }

    /// [`SlotIndex::get`] of each of `keys` into `out`, in three passes, so their cache misses
    /// overlap: prefetches of the home buckets, then of the candidates' records (prefetches
    /// retire at once: the whole batch is in flight), then the probes themselves. The home
    /// buckets of `next` (the keys the caller probes
    /// next) are requested after this batch's, so they arrive while this batch waits for its
    /// records: a run of batches waits about once per batch, not twice.
    pub(super) fn get_many(
        &self,
        keys: &[Key],
        records: &[Record],
        out: &mut [Option<SlotId>],
        next: &[Key],
    ) {
        for &k in keys {
            self.prefetch(k);
        }
        for &k in next {
            self.prefetch(k);
        }
        for &k in keys {
            if let Some(r) = self.candidate(k).and_then(|s| records.get(s.0 as usize)) {
                prefetch(r);
            }
        }
        for (o, &k) in out.iter_mut().zip(keys) {
            *o = self.get(k, records);
        }
    }

    /// Indexes `key` (not indexed yet) at `slot`.
    pub(super) fn insert(&mut self, key: Key, slot: SlotId) {
        debug_assert!(
            self.len < self.buckets.len() / 2 + 1,
            "index sized for the pool"
        );
        let h = hash(key);
        let mut p = h as usize & self.mask;
        while self.buckets[p] != EMPTY {
            p = (p + 1) & self.mask;
        }
        self.buckets[p] = bucket(h, slot);
        self.len += 1;
    }

    /// Removes `key`, indexed at `slot`; returns whether it was. The entries after it in its
    /// run move back, each to the first free bucket at or after its home.
    pub(super) fn remove(&mut self, key: Key, slot: SlotId) -> bool {
        let want = bucket(hash(key), slot);
        let mut hole = hash(key) as usize & self.mask;
        loop {
            let b = self.buckets[hole];
            if b == EMPTY {
                return false;
            }
            if b == want {
                break;
            }
            hole = (hole + 1) & self.mask;
        }
        let mut p = hole;
        loop {
            p = (p + 1) & self.mask;
            let b = self.buckets[p];
            if b == EMPTY {
                break;
            }
            // `b` may move into the hole unless its home lies cyclically in (hole, p].
            let start = hash_of(b) as usize & self.mask;
            if (p.wrapping_sub(start) & self.mask) >= (p.wrapping_sub(hole) & self.mask) {
                self.buckets[hole] = b;
                hole = p;
            }
        }
        self.buckets[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Checks the table: each bucket's hash is its record key's, each entry is reachable from
    /// its home bucket (no empty bucket between them), no slot is indexed twice, and the count.
    pub(super) fn check(&self, records: &[Record]) -> Result<(), String> {
        let mut seen = vec![false; records.len()];
        let mut n = 0;
        for (p, &b) in self.buckets.iter().enumerate() {
            if b == EMPTY {
                continue;
            }
            n += 1;
            let slot = slot_of(b);
            let Some(r) = records.get(slot.0 as usize) else {
                return Err(format!("index bucket {p} names slot {slot}, out of range"));
            };
            if std::mem::replace(&mut seen[slot.0 as usize], true) {
                return Err(format!("slot {slot} is indexed twice"));
            }
            if hash(r.key) != hash_of(b) {
                return Err(format!("index bucket {p}: slot {slot} holds another key"));
            }
            let mut q = hash_of(b) as usize & self.mask;
            while q != p {
                if self.buckets[q] == EMPTY {
                    return Err(format!(
                        "index bucket {p} (slot {slot}) is cut off its home"
                    ));
                }
                q = (q + 1) & self.mask;
            }
        }
        if n != self.len {
            return Err(format!("index holds {n} keys but counts {}", self.len));
        }
        Ok(())
    }

    /// Every `(key, slot)` indexed, keys read from the records (bucket order).
    pub(super) fn iter<'a>(
        &'a self,
        records: &'a [Record],
    ) -> impl Iterator<Item = (Key, SlotId)> + 'a {
        self.buckets
            .iter()
            .filter(|&&b| b != EMPTY)
            .map(move |&b| (records[slot_of(b).0 as usize].key, slot_of(b)))
    }
}

#[cfg(test)]
mod tests {
    use rustc_hash::FxHashMap;

    use super::*;

    fn record(key: u128) -> Record {
        Record {
            key: Key(key),
            ..Record::FREE
        }
    }

    /// Random inserts and removals against a map, in a table small enough that runs wrap
    /// around its end and collide (keys chosen so many share home buckets).
    #[test]
    fn matches_a_map_under_churn_with_wrapping_runs() {
        let cap = 64u32;
        let mut idx = SlotIndex::new(cap);
        let mut records = vec![Record::FREE; cap as usize];
        let mut model: FxHashMap<Key, SlotId> = FxHashMap::default();
        let mut free: Vec<u32> = (0..cap).rev().collect();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = Key(u128::from(x % 200) | (u128::from(x % 3) << 64));
            match model.get(&key).copied() {
                Some(slot) if x % 5 < 3 => {
                    assert!(idx.remove(key, slot), "step {step}: {key:?} indexed");
                    model.remove(&key);
                    free.push(slot.0);
                }
                None if !free.is_empty() => {
                    let slot = SlotId(free.pop().unwrap());
                    records[slot.0 as usize] = record(key.0);
                    idx.insert(key, slot);
                    model.insert(key, slot);
                }
                _ => {}
            }
            assert_eq!(idx.len(), model.len());
            assert_eq!(idx.get(key, &records), model.get(&key).copied());
            if step % 997 == 0 {
                for k in 0..200u128 {
                    for hi in 0..3u128 {
                        let k = Key(k | (hi << 64));
                        assert_eq!(idx.get(k, &records), model.get(&k).copied(), "{k:?}");
                    }
                }
                let mut all: Vec<_> = idx.iter(&records).collect();
                all.sort_unstable();
                let mut want: Vec<_> = model.iter().map(|(&k, &s)| (k, s)).collect();
                want.sort_unstable();
                assert_eq!(all, want);
            }
        }
    }

    #[test]
    fn a_key_is_confirmed_by_its_record_and_removed_only_at_its_slot() {
        let mut idx = SlotIndex::new(4);
        let mut records = vec![Record::FREE; 4];
        records[1] = record(7);
        idx.insert(Key(7), SlotId(1));
        assert_eq!(idx.get(Key(7), &records), Some(SlotId(1)));
        // The record now names another key: the bucket's hash matches, the record does not.
        records[1] = record(8);
        assert_eq!(idx.get(Key(7), &records), None);
        records[1] = record(7);
        assert!(!idx.remove(Key(7), SlotId(2)));
        assert!(idx.remove(Key(7), SlotId(1)));
        assert!(idx.is_empty());
        assert_eq!(idx.get(Key(7), &records), None);
        idx.insert(Key(7), SlotId(1));
        idx.clear();
        assert_eq!((idx.len(), idx.get(Key(7), &records)), (0, None));
    }
}
