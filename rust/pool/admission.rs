//! The admission filter: a key is stored only after it was looked up (while absent) a
//! threshold number of times, counted in two bounded generations.

use rustc_hash::FxHashMap;

use crate::ids::Key;

/// The admission filter: per-key lookup counts in two generations; when the current one holds
/// `bound` keys it becomes the previous one (dropping the older), so memory stays bounded and
/// keys not looked up for a while are forgotten.
#[derive(Clone, Debug)]
pub(super) struct Admission {
    pub(super) threshold: u32,
    pub(super) bound: usize,
    pub(super) current: FxHashMap<Key, u32>,
    pub(super) previous: FxHashMap<Key, u32>,
}

impl Admission {
    pub(super) fn new(threshold: u32, capacity: u32) -> Self {
        Self {
            threshold,
            bound: (capacity as usize).max(1024),
            current: FxHashMap::default(),
            previous: FxHashMap::default(),
        }
    }

    pub(super) fn enabled(&self) -> bool {
        self.threshold > 1
    }

    fn count(&self, key: Key) -> u32 {
        self.current
            .get(&key)
            .or_else(|| self.previous.get(&key))
            .copied()
            .unwrap_or(0)
    }

    pub(super) fn record(&mut self, key: Key) {
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

    pub(super) fn admits(&self, key: Key) -> bool {
        !self.enabled() || self.count(key) >= self.threshold
    }

    pub(super) fn tracked(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    pub(super) fn clear(&mut self) {
        self.current.clear();
        self.previous.clear();
    }
}
