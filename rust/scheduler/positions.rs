//! The position index: positions whose chunk is not stored yet, indexed by the block holding
//! them. When a block is re-allocated, every other unstored position still holding it is
//! dropped from its request's block table (set to the null block), so no store reads a block
//! whose content was replaced. Entries die lazily: one whose request, epoch, block or cursor
//! no longer matches is skipped and pruned.
//!
//! A block holds at most one live unstored position in practice (a prefix hit is below its
//! request's store cursor, so it is never indexed): each block has one entry inline, in a
//! dense array read with one cache miss, and only a block with a second live position keeps
//! the others in a side map (empty in the common case, so never probed).

use rustc_hash::FxHashMap;

use crate::ids::{BlockId, OwnerId};

use super::Scheduler;

/// An unstored position of a request's block table; valid while the request's owner, epoch,
/// block and store cursor still match. 24 bytes: as large as the `Vec` header per block it
/// replaced.
#[derive(Debug, Clone, Copy)]
pub(super) struct PosEntry {
    pub(super) req: u32,
    pub(super) owner: OwnerId,
    pub(super) epoch: u32,
    pub(super) group: u32,
    pub(super) pos: u32,
}

impl PosEntry {
    /// No entry.
    const EMPTY: PosEntry = PosEntry {
        req: u32::MAX,
        owner: OwnerId(u64::MAX),
        epoch: 0,
        group: 0,
        pos: 0,
    };

    fn is_empty(&self) -> bool {
        self.req == u32::MAX
    }
}

/// Unstored positions by block: one entry inline per block, more in a side map.
#[derive(Debug)]
pub(super) struct PosIndex {
    first: Vec<PosEntry>,
    more: FxHashMap<BlockId, Vec<PosEntry>>,
}

impl PosIndex {
    /// An empty index over `blocks` blocks.
    pub(super) fn new(blocks: u32) -> Self {
        Self {
            first: vec![PosEntry::EMPTY; blocks as usize],
            more: FxHashMap::default(),
        }
    }

    /// Prefetches block `b`'s inline entry (blocks are spread over the dense array: each one
    /// is a cache miss when it is read).
    pub(super) fn prefetch(&self, b: BlockId) {
        if let Some(e) = self.first.get(b.index()) {
            crate::prefetch::prefetch(e);
        }
    }

    /// Forgets every entry.
    pub(super) fn clear(&mut self) {
        self.first.fill(PosEntry::EMPTY);
        self.more.clear();
    }
}

impl Scheduler {
    /// Indexes position `pos` of group `g` of request `i` under its block.
    pub(super) fn assign(&mut self, i: u32, g: u32, pos: u32) {
        let Some(r) = self.reqs[i as usize].as_ref() else {
            return;
        };
        let Some(&b) = r.groups[g as usize].blocks.get(pos as usize) else {
            return;
        };
        if b == BlockId::NULL {
            return;
        }
        let entry = PosEntry {
            req: i,
            owner: r.owner,
            epoch: r.epoch,
            group: g,
            pos,
        };
        let first = self.pos_index.first[b.index()];
        let first_live = !first.is_empty() && self.entry_live(&first, b);
        // The side map's dead entries of this block go too (it is empty in the common case).
        let mut more = if self.pos_index.more.is_empty() {
            Vec::new()
        } else {
            self.pos_index.more.remove(&b).unwrap_or_default()
        };
        more.retain(|e| self.entry_live(e, b));
        if first_live {
            more.push(entry);
        } else {
            self.pos_index.first[b.index()] = entry;
        }
        if !more.is_empty() {
            self.pos_index.more.insert(b, more);
        }
    }

    /// Whether an index entry still refers to an unstored position holding block `b`.
    pub(super) fn entry_live(&self, e: &PosEntry, b: BlockId) -> bool {
        let Some(r) = self.reqs[e.req as usize].as_ref() else {
            return false;
        };
        let rg = &r.groups[e.group as usize];
        r.owner == e.owner
            && r.epoch == e.epoch
            && rg.blocks.get(e.pos as usize) == Some(&b)
            && e.pos >= rg.cursor * self.cfg.blocks_per_chunk
    }

    /// Block `b` is re-allocated this step: drop every unstored position still holding it.
    pub(super) fn invalidate(&mut self, b: BlockId) {
        let Some(&first) = self.pos_index.first.get(b.index()) else {
            return;
        };
        if !first.is_empty() {
            self.pos_index.first[b.index()] = PosEntry::EMPTY;
            self.drop_position(&first, b);
        }
        if self.pos_index.more.is_empty() {
            return;
        }
        if let Some(more) = self.pos_index.more.remove(&b) {
            for e in &more {
                self.drop_position(e, b);
            }
        }
    }

    /// Drops the position of entry `e` from its request's block table if it is live.
    fn drop_position(&mut self, e: &PosEntry, b: BlockId) {
        if self.entry_live(e, b) {
            self.req_mut(e.req).groups[e.group as usize].blocks[e.pos as usize] = BlockId::NULL;
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use crate::config::{GroupConfig, SchedulerConfig};
    use crate::ids::{BlockId, Key};
    use crate::scheduler::{Scheduler, StepInput};

    /// A step of `scheduled` `(request, computed tokens)` pairs, nothing else in it.
    pub(in crate::scheduler) fn step(scheduled: &[(&str, u32)]) -> StepInput<String> {
        StepInput {
            scheduled: scheduled.iter().map(|(r, _)| (*r).to_owned()).collect(),
            computed: scheduled.iter().map(|(_, c)| *c).collect(),
            new_blocks: Vec::new(),
            resumed: Vec::new(),
            finished: Vec::new(),
            aborted: Vec::new(),
            preempted: Vec::new(),
            written: Some(Vec::new()),
        }
    }

    /// A scheduler of `groups` full-attention groups of 4-token blocks (one a chunk), 64 GPU
    /// blocks and 16 CPU chunks a group.
    pub(in crate::scheduler) fn small(groups: usize) -> Scheduler {
        let group = GroupConfig {
            block_size: 4,
            sliding_window: None,
            bytes_per_chunk: 64,
        };
        Scheduler::new(SchedulerConfig::new(vec![group; groups], 64, 16)).unwrap()
    }

    fn admit(s: &mut Scheduler, id: &str, first_key: u128, blocks: &[u32]) {
        let keys = (first_key..first_key + 2).map(Key).collect();
        s.add_request(id, 9, keys).unwrap();
        assert_eq!(s.lookup(id, 0).unwrap(), Some(0));
        let table = vec![blocks.iter().copied().map(BlockId).collect()];
        assert_eq!(s.allocate(id, &table, 0, 0).unwrap(), None);
    }

    /// Two requests handed the same block (the engine may not, a caller can): both unstored
    /// positions are indexed (the second in the side map), and a later re-allocation of the
    /// block drops both, so neither request stores the replaced content.
    #[test]
    fn a_block_with_two_unstored_positions_drops_both() {
        let mut s = small(1);
        admit(&mut s, "a", 1000, &[5, 6, 7]);
        admit(&mut s, "b", 2000, &[5, 8, 9]);
        let plan = s.schedule(&step(&[("a", 3), ("b", 3)])).unwrap();
        assert!(plan.stores.is_empty());
        assert_eq!(s.pos_index.more.get(&BlockId(5)).map(Vec::len), Some(1));
        admit(&mut s, "c", 3000, &[5, 10, 11]);
        let plan = s.schedule(&step(&[("a", 8), ("b", 8), ("c", 3)])).unwrap();
        assert!(s.pos_index.more.is_empty());
        let mut stored: Vec<(String, Vec<Key>)> = plan
            .stores
            .iter()
            .map(|j| (j.request.clone(), j.transfers[0].keys.clone()))
            .collect();
        stored.sort();
        assert_eq!(
            stored,
            vec![
                ("a".to_owned(), vec![Key(1001)]),
                ("b".to_owned(), vec![Key(2001)]),
            ]
        );
        assert_eq!(s.stats().chunks_dropped, 2);
    }
}
