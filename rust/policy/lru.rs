//! [`LruPolicy`]: least recently used, one intrusive recency list over the slots.

use super::links::{self, LinkNode, List};
use super::{Evictable, EvictionPolicy, PolicyKind, PolicySnapshot, Touch};
use crate::ids::{Key, SlotId};

/// Least recently used: one recency list; a touch moves the entry to the most recent end.
#[derive(Clone, Debug, Default)]
pub struct LruPolicy {
    list: List,
}

impl LruPolicy {
    /// An empty LRU order (its links live in the slots' nodes).
    pub fn new() -> Self {
        Self::default()
    }
}

impl<N: LinkNode> EvictionPolicy<N> for LruPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }

    fn insert(&mut self, nodes: &mut [N], slot: SlotId, _key: Key) {
        self.list.push_back(nodes, slot.0);
    }

    fn touch(&mut self, nodes: &mut [N], slot: SlotId, _ready: bool) {
        self.list.move_to_back(nodes, slot.0);
    }

    fn touch_many(&mut self, nodes: &mut [N], touches: &[Touch]) {
        // Each move misses the cache on the slot's node and its two neighbours: load them a
        // few moves ahead so the misses overlap (loads only: the moves are `touch`'s, in order).
        let slot = |t: Option<&Touch>| match t {
            Some(Touch::Resident { slot, .. }) => Some(slot.0),
            _ => None,
        };
        for (i, t) in touches.iter().enumerate() {
            if let Some(ahead) = slot(touches.get(i + 8)) {
                links::warm(nodes, ahead);
            }
            if let Some(ahead) = slot(touches.get(i + 4)) {
                links::warm_neighbours(nodes, ahead);
            }
            if let Touch::Resident { slot, .. } = t {
                self.list.move_to_back(nodes, slot.0);
            }
        }
    }

    fn choose_victims(
        &self,
        nodes: &[N],
        n: usize,
        evictable: Evictable<'_>,
        out: &mut Vec<SlotId>,
    ) -> bool {
        let start = out.len();
        let mut cursor = self.list.head;
        while out.len() - start < n {
            let Some(i) = List::next_matching(nodes, &mut cursor, evictable) else {
                out.truncate(start);
                return false;
            };
            out.push(SlotId(i));
        }
        true
    }

    fn eviction_front(&self, nodes: &[N], out: &mut [SlotId]) -> usize {
        List::front(nodes, self.list.head, out)
    }

    fn evict(&mut self, nodes: &mut [N], slot: SlotId, _key: Key) {
        self.list.unlink(nodes, slot.0);
    }

    fn remove(&mut self, nodes: &mut [N], slot: SlotId) {
        self.list.unlink(nodes, slot.0);
    }

    fn clear(&mut self, nodes: &mut [N]) {
        links::unlink_all(nodes);
        self.list = List::EMPTY;
    }

    fn snapshot(&self, nodes: &[N]) -> PolicySnapshot {
        PolicySnapshot {
            resident: vec![("lru", self.list.iter(nodes).map(SlotId).collect())],
            ghosts: Vec::new(),
            target: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::UNLINKED;

    #[test]
    fn lru_skips_unevictable_and_is_all_or_nothing() {
        let mut p = LruPolicy::new();
        let mut nodes = [UNLINKED; 4];
        for s in 0..4 {
            p.insert(&mut nodes[..], SlotId(s), Key(u128::from(s)));
        }
        p.touch(&mut nodes[..], SlotId(0), true);
        let mut out = vec![];
        assert!(p.choose_victims(&nodes[..], 2, &|s| s != SlotId(1), &mut out));
        assert_eq!(out, vec![SlotId(2), SlotId(3)]);
        out.clear();
        assert!(!p.choose_victims(&nodes[..], 4, &|s| s != SlotId(1), &mut out));
        assert!(out.is_empty());
    }

    #[test]
    fn eviction_front_is_the_order_s_start_evictable_or_not() {
        let mut p = LruPolicy::new();
        let mut nodes = [UNLINKED; 6];
        let mut front = [SlotId::NONE; 3];
        assert_eq!(p.eviction_front(&nodes[..], &mut front), 0, "empty order");
        for s in [4, 1, 5, 0] {
            p.insert(&mut nodes[..], SlotId(s), Key(u128::from(s)));
        }
        p.touch(&mut nodes[..], SlotId(4), true);
        // Order, least recent first: 1, 5, 0, 4.
        assert_eq!(p.eviction_front(&nodes[..], &mut front), 3);
        assert_eq!(front, [SlotId(1), SlotId(5), SlotId(0)]);
        let order = p.snapshot(&nodes[..]).resident[0].1.clone();
        assert_eq!(&order[..3], &front[..]);
        let mut wide = [SlotId::NONE; 8];
        assert_eq!(
            p.eviction_front(&nodes[..], &mut wide),
            4,
            "fewer resident than asked"
        );
        assert_eq!(&wide[..4], &order[..]);
        p.evict(&mut nodes[..], SlotId(1), Key(1));
        assert_eq!(p.eviction_front(&nodes[..], &mut front), 3);
        assert_eq!(front, [SlotId(5), SlotId(0), SlotId(4)]);
    }
}
