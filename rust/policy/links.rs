//! Intrusive doubly-linked lists over dense indices (slot numbers, ghost nodes): two `u32`
//! arrays hold each index's neighbours, so insert, touch, remove and evict are O(1) and
//! allocate nothing. Several disjoint lists may share one [`Links`].

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

/// `prev` / `next` neighbours per index; several disjoint lists may share one `Links`.
#[derive(Clone, Debug, Default)]
pub(super) struct Links {
    pub(super) prev: Vec<u32>,
    pub(super) next: Vec<u32>,
}

impl Links {
    pub(super) fn with_len(n: u32) -> Self {
        Self {
            prev: vec![NIL; n as usize],
            next: vec![NIL; n as usize],
        }
    }

    /// Adds one index at the end of the arrays and returns it.
    pub(super) fn grow(&mut self) -> u32 {
        self.prev.push(NIL);
        self.next.push(NIL);
        (self.prev.len() - 1) as u32
    }

    pub(super) fn push_back(&mut self, list: &mut List, i: u32) {
        self.prev[i as usize] = list.tail;
        self.next[i as usize] = NIL;
        if list.tail == NIL {
            list.head = i;
        } else {
            self.next[list.tail as usize] = i;
        }
        list.tail = i;
        list.len += 1;
    }

    pub(super) fn unlink(&mut self, list: &mut List, i: u32) {
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            list.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            list.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i as usize] = NIL;
        self.next[i as usize] = NIL;
        list.len -= 1;
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
            *cursor = self.next[i as usize];
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
                cur = self.next[i as usize];
                i
            })
        })
    }
}
