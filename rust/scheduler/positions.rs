//! The position index: positions whose chunk is not stored yet, indexed by the block holding
//! them. When a block is re-allocated, every other unstored position still holding it is
//! dropped from its request's block table (set to the null block), so no store reads a block
//! whose content was replaced. Entries die lazily: one whose request, epoch, block or cursor
//! no longer matches is skipped and pruned.

use crate::ids::{BlockId, OwnerId};

use super::Scheduler;

/// An unstored position of a request's block table; valid while the request's owner, epoch,
/// block and store cursor still match.
#[derive(Debug, Clone, Copy)]
pub(super) struct PosEntry {
    pub(super) req: u32,
    pub(super) owner: OwnerId,
    pub(super) epoch: u32,
    pub(super) group: u32,
    pub(super) pos: u32,
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
        let (owner, epoch) = (r.owner, r.epoch);
        let mut entries = std::mem::take(&mut self.pos_index[b.index()]);
        entries.retain(|e| self.entry_live(e, b));
        entries.push(PosEntry {
            req: i,
            owner,
            epoch,
            group: g,
            pos,
        });
        self.pos_index[b.index()] = entries;
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
        let Some(slot) = self.pos_index.get_mut(b.index()) else {
            return;
        };
        if slot.is_empty() {
            return;
        }
        let mut entries = std::mem::take(slot);
        for e in &entries {
            if self.entry_live(e, b) {
                self.req_mut(e.req).groups[e.group as usize].blocks[e.pos as usize] = BlockId::NULL;
            }
        }
        entries.clear();
        self.pos_index[b.index()] = entries;
    }
}
