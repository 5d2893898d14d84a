//! [`ArcPolicy`]: Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) over the slots, with
//! ghost lists B1 and B2 kept in a slab of intrusive nodes. Where it departs from the paper, and
//! why: `docs/design-notes.md` ("The ARC variant").

use rustc_hash::FxHashMap;

use super::links::{self, LinkNode, List, NIL, UNLINKED};
use super::{Evictable, EvictionPolicy, PolicyKind, PolicySnapshot};
use crate::ids::{Key, SlotId};

const B1: usize = 0;
const B2: usize = 1;

/// ARC's ghost lists B1 and B2: keys only, in a slab of nodes with intrusive links and a key
/// index. Nodes are recycled through a free stack, so the slab never exceeds the largest number
/// of ghosts held at once (bounded by the capacity per list).
#[derive(Clone, Debug, Default)]
struct Ghosts {
    links: Vec<[u32; 2]>,
    keys: Vec<Key>,
    which: Vec<u8>,
    spare: Vec<u32>,
    index: FxHashMap<Key, u32>,
    lists: [List; 2],
}

impl Ghosts {
    fn len(&self, which: usize) -> u32 {
        self.lists[which].len
    }

    /// Adds `key` (not a ghost yet) at the most recent end of list `which`.
    fn push(&mut self, which: usize, key: Key) {
        let node = if let Some(n) = self.spare.pop() {
            self.keys[n as usize] = key;
            self.which[n as usize] = which as u8;
            n
        } else {
            let n = self.links.len() as u32;
            self.links.push(UNLINKED);
            self.keys.push(key);
            self.which.push(which as u8);
            n
        };
        self.lists[which].push_back(&mut self.links, node);
        self.index.insert(key, node);
    }

    /// Forgets `key`; returns the list it was in.
    fn remove(&mut self, key: Key) -> Option<usize> {
        let node = self.index.remove(&key)?;
        let which = usize::from(self.which[node as usize]);
        self.lists[which].unlink(&mut self.links, node);
        self.spare.push(node);
        Some(which)
    }

    /// Moves `key` to the most recent end of its list; returns the list.
    fn touch(&mut self, key: Key) -> Option<usize> {
        let node = *self.index.get(&key)?;
        let which = usize::from(self.which[node as usize]);
        self.lists[which].move_to_back(&mut self.links, node);
        Some(which)
    }

    /// Forgets the least recent key of list `which`.
    fn pop_front(&mut self, which: usize) {
        let node = self.lists[which].head;
        if node != NIL {
            let key = self.keys[node as usize];
            self.remove(key);
        }
    }

    fn keys_of(&self, which: usize) -> Vec<Key> {
        self.lists[which]
            .iter(&self.links)
            .map(|n| self.keys[n as usize])
            .collect()
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// Adaptive Replacement Cache over the pool's slots.
///
/// - A new key enters T1; a key remembered in B1 or B2 enters T2 (it was seen before).
/// - A touch of a *ready* T1 entry promotes it to T2; a storing entry stays in T1 (it has not
///   been used yet). A touch in T2 moves it to T2's most recent end.
/// - A touch of a key in B1 raises the target `p` by `max(|B2| / |B1|, 1)` (up to the
///   capacity); in B2 it lowers `p` by `max(|B1| / |B2|, 1)` (down to 0). The ghost moves to
///   the most recent end of its list and stays there until the key is stored again (it then
///   enters T2) or is trimmed. Every touch adapts, so touch once per access.
/// - Replacement takes the least recent evictable entry of T1 when `|T1| > p`, else of T2, and
///   falls back to the other list when the preferred one has no evictable entry. A multi-victim
///   choice applies this rule once per victim, counting earlier victims as gone.
/// - A victim from T1 is remembered in B1, one from T2 in B2. After every change the ghosts are
///   trimmed (least recent first) so that `|T1| + |B1| <= c`, `|B2| <= c` and
///   `|T1| + |T2| + |B1| + |B2| <= 2c`, the bounds of the original algorithm.
/// - An entry that leaves because its store failed leaves no ghost.
#[derive(Clone, Debug)]
pub struct ArcPolicy {
    capacity: u32,
    target: u32,
    in_t2: Vec<bool>,
    t1: List,
    t2: List,
    ghosts: Ghosts,
}

impl ArcPolicy {
    /// An empty ARC over `capacity` slots, target 0 (its links live in the slots' nodes).
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            target: 0,
            in_t2: vec![false; capacity as usize],
            t1: List::EMPTY,
            t2: List::EMPTY,
            ghosts: Ghosts::default(),
        }
    }

    fn list_of(&mut self, slot: u32) -> &mut List {
        if self.in_t2[slot as usize] {
            &mut self.t2
        } else {
            &mut self.t1
        }
    }

    fn unlink<N: LinkNode>(&mut self, nodes: &mut [N], slot: u32) {
        self.list_of(slot).unlink(nodes, slot);
    }

    /// Restores the ghost bounds, dropping the least recent ghosts first.
    fn trim(&mut self) {
        let c = self.capacity;
        while self.t1.len + self.ghosts.len(B1) > c && self.ghosts.len(B1) > 0 {
            self.ghosts.pop_front(B1);
        }
        // Implied at operation boundaries by the 2c bound (evictions happen only when the pool
        // is full), but it can be exceeded in the middle of a multi-eviction: keep it explicit.
        while self.ghosts.len(B2) > c {
            self.ghosts.pop_front(B2);
        }
        while u64::from(self.t1.len)
            + u64::from(self.t2.len)
            + u64::from(self.ghosts.len(B1))
            + u64::from(self.ghosts.len(B2))
            > 2 * u64::from(c)
        {
            let which = if self.ghosts.len(B2) > 0 { B2 } else { B1 };
            self.ghosts.pop_front(which);
        }
    }
}

impl<N: LinkNode> EvictionPolicy<N> for ArcPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Arc
    }

    fn insert(&mut self, nodes: &mut [N], slot: SlotId, key: Key) {
        let seen_before = self.ghosts.remove(key).is_some();
        self.in_t2[slot.0 as usize] = seen_before;
        if seen_before {
            self.t2.push_back(nodes, slot.0);
        } else {
            self.t1.push_back(nodes, slot.0);
        }
        self.trim();
    }

    fn touch(&mut self, nodes: &mut [N], slot: SlotId, ready: bool) {
        let i = slot.0;
        if self.in_t2[i as usize] {
            self.t2.move_to_back(nodes, i);
        } else if ready {
            self.t1.unlink(nodes, i);
            self.t2.push_back(nodes, i);
            self.in_t2[i as usize] = true;
        } else {
            self.t1.move_to_back(nodes, i);
        }
    }

    fn touch_absent(&mut self, key: Key) {
        match self.ghosts.touch(key) {
            Some(B1) => {
                let step = (self.ghosts.len(B2) / self.ghosts.len(B1)).max(1);
                self.target = self.target.saturating_add(step).min(self.capacity);
            }
            Some(_) => {
                let step = (self.ghosts.len(B1) / self.ghosts.len(B2)).max(1);
                self.target = self.target.saturating_sub(step);
            }
            None => {}
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
        let (mut c1, mut c2) = (self.t1.head, self.t2.head);
        let mut t1_len = self.t1.len;
        while out.len() - start < n {
            let prefer_t1 = t1_len > self.target;
            let (first, second) = if prefer_t1 {
                (&mut c1, &mut c2)
            } else {
                (&mut c2, &mut c1)
            };
            let victim = match List::next_matching(nodes, first, evictable) {
                Some(i) => Some((i, prefer_t1)),
                None => List::next_matching(nodes, second, evictable).map(|i| (i, !prefer_t1)),
            };
            let Some((i, from_t1)) = victim else {
                out.truncate(start);
                return false;
            };
            if from_t1 {
                t1_len -= 1;
            }
            out.push(SlotId(i));
        }
        true
    }

    fn evict(&mut self, nodes: &mut [N], slot: SlotId, key: Key) {
        let ghost = if self.in_t2[slot.0 as usize] { B2 } else { B1 };
        self.unlink(nodes, slot.0);
        self.ghosts.push(ghost, key);
        self.trim();
    }

    fn remove(&mut self, nodes: &mut [N], slot: SlotId) {
        self.unlink(nodes, slot.0);
    }

    fn clear(&mut self, nodes: &mut [N]) {
        links::unlink_all(nodes);
        self.in_t2.fill(false);
        self.t1 = List::EMPTY;
        self.t2 = List::EMPTY;
        self.ghosts.clear();
        self.target = 0;
    }

    fn ghost_len(&self) -> usize {
        self.ghosts.index.len()
    }

    fn target(&self) -> Option<u32> {
        Some(self.target)
    }

    fn snapshot(&self, nodes: &[N]) -> PolicySnapshot {
        let slots = |l: &List| l.iter(nodes).map(SlotId).collect();
        PolicySnapshot {
            resident: vec![("t1", slots(&self.t1)), ("t2", slots(&self.t2))],
            ghosts: vec![
                ("b1", self.ghosts.keys_of(B1)),
                ("b2", self.ghosts.keys_of(B2)),
            ],
            target: Some(self.target),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(_: SlotId) -> bool {
        true
    }

    #[test]
    fn arc_ghost_hit_enters_t2_and_adapts() {
        let mut p = ArcPolicy::new(2);
        let mut nodes = [UNLINKED; 2];
        p.insert(&mut nodes[..], SlotId(0), Key(10));
        p.insert(&mut nodes[..], SlotId(1), Key(11));
        let mut out = vec![];
        assert!(p.choose_victims(&nodes[..], 1, &all, &mut out));
        assert_eq!(out, vec![SlotId(0)]);
        p.evict(&mut nodes[..], SlotId(0), Key(10));
        EvictionPolicy::<[u32; 2]>::touch_absent(&mut p, Key(10));
        assert_eq!(EvictionPolicy::<[u32; 2]>::target(&p), Some(1));
        p.insert(&mut nodes[..], SlotId(0), Key(10));
        let snap = p.snapshot(&nodes[..]);
        assert_eq!(snap.resident[1], ("t2", vec![SlotId(0)]));
        assert_eq!(EvictionPolicy::<[u32; 2]>::ghost_len(&p), 0);
    }
}
