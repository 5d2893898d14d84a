//! The duplicate check of one store call: the keys seen so far in the call, in an
//! open-addressing table of `(stamp, index)` entries emptied in O(1) by a new stamp.
//!
//! A prefill's store names a few hundred keys, each checked once. A general hash set costs
//! about 14 ns a key there (its hashing, its control bytes, its 16-byte buckets, and clearing
//! them between calls); this table is sized for the call (at most half full), probes 8-byte
//! entries of a table that stays in the cache from call to call, and confirms a key against
//! the call's own list only when its entry is live.

use crate::ids::Key;

use super::index::hash;

/// The keys of one call (see the module documentation).
#[derive(Debug, Default)]
pub(super) struct CallKeys {
    /// `(stamp, index into keys)`: live only when its stamp is the call's.
    table: Vec<(u32, u32)>,
    keys: Vec<Key>,
    stamp: u32,
    /// The probe mask of this call: it uses the first `mask + 1` entries.
    mask: usize,
}

impl CallKeys {
    /// Starts a call that will insert at most `n` keys: forgets the previous call's.
    pub(super) fn start(&mut self, n: usize) {
        let size = (2 * n).next_power_of_two().max(64);
        if self.table.len() < size {
            self.table.resize(size, (0, 0));
        }
        self.mask = size - 1;
        self.keys.clear();
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            // After 2^32 calls: no entry may keep a stamp that comes round again.
            self.table.fill((0, 0));
            self.stamp = 1;
        }
    }

    /// Adds `key`: `false` if this call already added it.
    pub(super) fn insert(&mut self, key: Key) -> bool {
        debug_assert!(self.keys.len() <= self.mask / 2, "sized by start");
        let mut p = hash(key) as usize & self.mask;
        loop {
            let (stamp, i) = self.table[p];
            if stamp != self.stamp {
                self.table[p] = (self.stamp, self.keys.len() as u32);
                self.keys.push(key);
                return true;
            }
            if self.keys[i as usize] == key {
                return false;
            }
            p = (p + 1) & self.mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use rustc_hash::FxHashSet;

    use super::*;

    /// Random calls of random sizes (keys chosen to collide in the table and to repeat within
    /// and across calls) against a fresh set per call.
    #[test]
    fn matches_a_fresh_set_per_call() {
        let mut keys = CallKeys::default();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for call in 0..2_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 700) as usize;
            keys.start(n);
            let mut model = FxHashSet::default();
            for k in 0..n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Few distinct values (many repeats), high halves that differ.
                let key = Key(u128::from(x % 97) | (u128::from(x % 3) << 64));
                assert_eq!(keys.insert(key), model.insert(key), "call {call}, key {k}");
            }
        }
    }

    #[test]
    fn a_new_call_forgets_the_last_one_s_keys_even_across_the_stamp_s_wrap() {
        let mut keys = CallKeys::default();
        keys.start(2);
        assert!(keys.insert(Key(5)));
        assert!(!keys.insert(Key(5)));
        keys.start(2);
        assert!(keys.insert(Key(5)), "a new call");
        keys.stamp = u32::MAX;
        keys.start(1);
        assert_eq!(keys.stamp, 1);
        assert!(keys.insert(Key(7)) && !keys.insert(Key(7)));
        // An entry stamped 1 before the wrap would have read as live: the table was emptied.
        keys.start(1);
        assert!(keys.insert(Key(7)));
    }
}
