//! Intrusive doubly-linked lists over dense indices (slot numbers, ghost nodes): each index's
//! node holds its `[prev, next]` neighbours, so insert, touch, remove and evict are O(1) and
//! allocate nothing. Several disjoint lists may thread through one slice of nodes.
//!
//! A node is anything that holds a pair of links ([`LinkNode`]): the pool's per-slot records
//! hold them next to the slot's state and key, so a move in a 400k-slot list, bound by its
//! cache misses, misses once per index it touches, not once for the links and again for the
//! state. Ghost lists use bare `[u32; 2]` nodes.

use crate::ids::SlotId;

pub(super) const NIL: u32 = u32::MAX;

/// A node of the policy's lists: storage for one index's `[prev, next]` neighbours. The
/// policy alone reads and writes them; their owner only stores them ([`UNLINKED`] when new).
pub trait LinkNode {
    /// The `[prev, next]` neighbours.
    fn links(&self) -> [u32; 2];
    /// The `[prev, next]` neighbours, mutably.
    fn links_mut(&mut self) -> &mut [u32; 2];
}

/// The links of a node that is in no list.
pub const UNLINKED: [u32; 2] = [NIL; 2];

impl LinkNode for [u32; 2] {
    fn links(&self) -> [u32; 2] {
        *self
    }
    fn links_mut(&mut self) -> &mut [u32; 2] {
        self
    }
}

/// Index of the `prev` neighbour in a node.
const PREV: usize = 0;
/// Index of the `next` neighbour in a node.
const NEXT: usize = 1;

/// One list threaded through a slice of nodes: `head` is the least recent end, `tail` the most
/// recent. Every operation takes the nodes it threads through.
#[derive(Clone, Copy, Debug)]
pub(super) struct List {
    pub(super) head: u32,
    pub(super) tail: u32,
    pub(super) len: u32,
}

impl Default for List {
    fn default() -> Self {
        List::EMPTY
    }
}

impl List {
    pub(super) const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };

    pub(super) fn push_back<N: LinkNode>(&mut self, nodes: &mut [N], i: u32) {
        *nodes[i as usize].links_mut() = [self.tail, NIL];
        if self.tail == NIL {
            self.head = i;
        } else {
            nodes[self.tail as usize].links_mut()[NEXT] = i;
        }
        self.tail = i;
        self.len += 1;
    }

    pub(super) fn unlink<N: LinkNode>(&mut self, nodes: &mut [N], i: u32) {
        let [p, n] = nodes[i as usize].links();
        if p == NIL {
            self.head = n;
        } else {
            nodes[p as usize].links_mut()[NEXT] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            nodes[n as usize].links_mut()[PREV] = p;
        }
        *nodes[i as usize].links_mut() = UNLINKED;
        self.len -= 1;
    }

    pub(super) fn move_to_back<N: LinkNode>(&mut self, nodes: &mut [N], i: u32) {
        if self.tail != i {
            self.unlink(nodes, i);
            self.push_back(nodes, i);
        }
    }

    /// The first index at or after `*cursor` (following `next`) for which `ok` holds; the
    /// cursor moves past it. `None` once the list is exhausted.
    pub(super) fn next_matching<N: LinkNode>(
        nodes: &[N],
        cursor: &mut u32,
        ok: &dyn Fn(SlotId) -> bool,
    ) -> Option<u32> {
        while *cursor != NIL {
            let i = *cursor;
            *cursor = nodes[i as usize].links()[NEXT];
            if ok(SlotId(i)) {
                return Some(i);
            }
        }
        None
    }

    /// The first indices from `head` into `out`, as many as fit or the list holds; reads the
    /// links of all but the last (whose node a caller may be loading ahead).
    pub(super) fn front<N: LinkNode>(nodes: &[N], head: u32, out: &mut [SlotId]) -> usize {
        let mut cur = head;
        let mut n = 0;
        while cur != NIL && n < out.len() {
            out[n] = SlotId(cur);
            n += 1;
            if n < out.len() {
                cur = nodes[cur as usize].links()[NEXT];
            }
        }
        n
    }

    pub(super) fn iter<'a, N: LinkNode>(&self, nodes: &'a [N]) -> impl Iterator<Item = u32> + 'a {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            (cur != NIL).then(|| {
                let i = cur;
                cur = nodes[i as usize].links()[NEXT];
                i
            })
        })
    }
}

/// Prefetches the node of `i` (if any) ahead of a move; changes nothing.
pub(super) fn warm<N: LinkNode>(nodes: &[N], i: u32) {
    if let Some(n) = nodes.get(i as usize) {
        crate::prefetch::prefetch_all(n);
    }
}

/// Prefetches the nodes of `i`'s neighbours ahead of a move (reading `i`'s links); changes
/// nothing.
pub(super) fn warm_neighbours<N: LinkNode>(nodes: &[N], i: u32) {
    if let Some([p, n]) = nodes.get(i as usize).map(LinkNode::links) {
        warm(nodes, p);
        warm(nodes, n);
    }
}

/// Unlinks every node (the lists threaded through them must be reset too).
pub(super) fn unlink_all<N: LinkNode>(nodes: &mut [N]) {
    for n in nodes {
        *n.links_mut() = UNLINKED;
    }
}
