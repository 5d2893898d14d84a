//! Free slots of the pool as a run-length set: maximal free runs indexed by start (to merge
//! on release) and by length (to find the best fit on allocation), O(log runs) per operation.

use std::collections::{BTreeMap, BTreeSet};

use crate::ids::SlotId;

/// Free slots as maximal runs, indexed by start (to merge on release) and by length (to find
/// the best fit on allocation).
#[derive(Clone, Debug)]
pub(super) struct FreeSlots {
    pub(super) by_start: BTreeMap<u32, u32>,
    pub(super) by_len: BTreeSet<(u32, u32)>,
    pub(super) free: u32,
}

impl FreeSlots {
    pub(super) fn all(capacity: u32) -> Self {
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
    pub(super) fn alloc(&mut self, n: u32, out: &mut Vec<SlotId>) -> u32 {
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
    pub(super) fn release(&mut self, slot: u32) {
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
