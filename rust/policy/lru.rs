//! [`LruPolicy`]: least recently used, one intrusive recency list over the slots.

use super::links::{Links, List};
use super::{Evictable, EvictionPolicy, PolicyKind, PolicySnapshot, Touch};
use crate::ids::{Key, SlotId};

/// Least recently used: one recency list; a touch moves the entry to the most recent end.
#[derive(Clone, Debug)]
pub struct LruPolicy {
    links: Links,
    list: List,
}

impl LruPolicy {
    /// An empty LRU order over `capacity` slots.
    pub fn new(capacity: u32) -> Self {
        Self {
            links: Links::with_len(capacity),
            list: List::EMPTY,
        }
    }
}

impl EvictionPolicy for LruPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }

    fn insert(&mut self, slot: SlotId, _key: Key) {
        self.links.push_back(&mut self.list, slot.0);
    }

    fn touch(&mut self, slot: SlotId, _ready: bool) {
        self.links.move_to_back(&mut self.list, slot.0);
    }

    fn touch_many(&mut self, touches: &[Touch]) {
        // Each move misses the cache on the slot's node and its two neighbours: load them a
        // few moves ahead so the misses overlap (loads only: the moves are `touch`'s, in order).
        let slot = |t: Option<&Touch>| match t {
            Some(Touch::Resident { slot, .. }) => Some(slot.0),
            _ => None,
        };
        for (i, t) in touches.iter().enumerate() {
            if let Some(ahead) = slot(touches.get(i + 8)) {
                self.links.warm(ahead);
            }
            if let Some(ahead) = slot(touches.get(i + 4)) {
                self.links.warm_neighbours(ahead);
            }
            if let Touch::Resident { slot, .. } = t {
                self.links.move_to_back(&mut self.list, slot.0);
            }
        }
    }

    fn choose_victims(&self, n: usize, evictable: Evictable<'_>, out: &mut Vec<SlotId>) -> bool {
        let start = out.len();
        let mut cursor = self.list.head;
        while out.len() - start < n {
            let Some(i) = self.links.next_matching(&mut cursor, evictable) else {
                out.truncate(start);
                return false;
            };
            out.push(SlotId(i));
        }
        true
    }

    fn evict(&mut self, slot: SlotId, _key: Key) {
        self.links.unlink(&mut self.list, slot.0);
    }

    fn remove(&mut self, slot: SlotId) {
        self.links.unlink(&mut self.list, slot.0);
    }

    fn clear(&mut self) {
        self.links.clear();
        self.list = List::EMPTY;
    }

    fn snapshot(&self) -> PolicySnapshot {
        PolicySnapshot {
            resident: vec![("lru", self.links.iter(&self.list).map(SlotId).collect())],
            ghosts: Vec::new(),
            target: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_skips_unevictable_and_is_all_or_nothing() {
        let mut p = LruPolicy::new(4);
        for s in 0..4 {
            p.insert(SlotId(s), Key(u128::from(s)));
        }
        p.touch(SlotId(0), true);
        let mut out = vec![];
        assert!(p.choose_victims(2, &|s| s != SlotId(1), &mut out));
        assert_eq!(out, vec![SlotId(2), SlotId(3)]);
        out.clear();
        assert!(!p.choose_victims(4, &|s| s != SlotId(1), &mut out));
        assert!(out.is_empty());
    }
}
