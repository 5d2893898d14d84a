//! Intrusive doubly-linked lists over dense indices (slot numbers, ghost nodes): one array of
//! `[prev, next]` pairs holds each index's neighbours (one cache line per index touched, not
//! two: a move in a 400k-slot list is bound by its cache misses), so insert, touch, remove and
//! evict are O(1) and allocate nothing. Several disjoint lists may share one [`Links`].

use crate::ids::SlotId;

pub(super) const NIL: u32 = u32::MAX;

/// One list threaded through [`Links`]: `head` is the least recent end, `tail` the most recent.
#[derive(Clone, Copy, Debug)]
pub(super) struct List {
    pub(super) head: u32,
    pub(super) tail: u32,
    pub(super) len: u32,
}

impl List {
    pub(super) const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

impl Default for List {
    fn default() -> Self {
        List::EMPTY
    }
}

/// Index of the `prev` neighbour in a node.
const PREV: usize = 0;
/// Index of the `next` neighbour in a node.
const NEXT: usize = 1;

/// `[prev, next]` neighbours per index; several disjoint lists may share one `Links`.
#[derive(Clone, Debug, Default)]
pub(super) struct Links {
    nodes: Vec<[u32; 2]>,
}

impl Links {
    pub(super) fn with_len(n: u32) -> Self {
        Self {
            nodes: vec![[NIL; 2]; n as usize],
        }
    }

    /// Adds one index at the end of the array and returns it.
    pub(super) fn grow(&mut self) -> u32 {
        self.nodes.push([NIL; 2]);
        (self.nodes.len() - 1) as u32
    }

    /// Unlinks every index (the lists sharing these links must be reset too).
    pub(super) fn clear(&mut self) {
        self.nodes.fill([NIL; 2]);
    }

    pub(super) fn push_back(&mut self, list: &mut List, i: u32) {
        self.nodes[i as usize] = [list.tail, NIL];
        if list.tail == NIL {
            list.head = i;
        } else {
            self.nodes[list.tail as usize][NEXT] = i;
        }
        list.tail = i;
        list.len += 1;
    }

    pub(super) fn unlink(&mut self, list: &mut List, i: u32) {
        let [p, n] = self.nodes[i as usize];
        if p == NIL {
            list.head = n;
        } else {
            self.nodes[p as usize][NEXT] = n;
        }
        if n == NIL {
            list.tail = p;
        } else {
            self.nodes[n as usize][PREV] = p;
        }
        self.nodes[i as usize] = [NIL; 2];
        list.len -= 1;
    }

    /// Loads the node of `i` (if any) into the cache ahead of a move; changes nothing.
    pub(super) fn warm(&self, i: u32) {
        std::hint::black_box(self.nodes.get(i as usize).copied());
    }

    /// Loads the nodes of `i`'s neighbours into the cache ahead of a move; changes nothing.
    pub(super) fn warm_neighbours(&self, i: u32) {
        if let Some(&[p, n]) = self.nodes.get(i as usize) {
            std::hint::black_box(self.nodes.get(p as usize).copied());
            std::hint::black_box(self.nodes.get(n as usize).copied());
        }
    }

    pub(super) fn move_to_back(&mut self, list: &mut List, i: u32) {
        if list.tail != i {
            self.unlink(list, i);
            self.push_back(list, i);
        }
    }

    /// The first index at or after `*cursor` (following `next`) for which `ok` holds; the cursor
    /// moves past it. `None` once the list is exhausted.
    pub(super) fn next_matching(
        &self,
        cursor: &mut u32,
        ok: &dyn Fn(SlotId) -> bool,
    ) -> Option<u32> {
        while *cursor != NIL {
            let i = *cursor;
            *cursor = self.nodes[i as usize][NEXT];
            if ok(SlotId(i)) {
                return Some(i);
            }
        }
        None
    }

    pub(super) fn iter<'a>(&'a self, list: &List) -> impl Iterator<Item = u32> + 'a {
        let mut cur = list.head;
        std::iter::from_fn(move || {
            (cur != NIL).then(|| {
                let i = cur;
                cur = self.nodes[i as usize][NEXT];
                i
            })
        })
    }
}
