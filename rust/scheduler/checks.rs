//! Input checks shared by `allocate` and `schedule`: engine block ids (range, the engine's null
//! block) and duplicates within one call, found with generation stamps indexed by block or
//! slab index (no allocation, no clearing per call).

use crate::error::{Error, Result};
use crate::ids::BlockId;

use super::Scheduler;

/// The first value other than [`BlockId::NULL`] that occurs twice in `values`, found with generation
/// `stamps` indexed by value (no allocation, no clearing per call).
fn first_repeated(
    stamps: &mut [u32],
    stamp: &mut u32,
    values: impl IntoIterator<Item = u32>,
) -> Option<u32> {
    *stamp = stamp.wrapping_add(1);
    if *stamp == 0 {
        stamps.fill(0);
        *stamp = 1;
    }
    for v in values {
        if v == BlockId::NULL.0 {
            continue;
        }
        let seen = &mut stamps[v as usize];
        if *seen == *stamp {
            return Some(v);
        }
        *seen = *stamp;
    }
    None
}

impl Scheduler {
    /// The first non-null block that occurs twice in `blocks`, if any.
    pub(super) fn first_repeated(
        &mut self,
        blocks: impl IntoIterator<Item = BlockId>,
    ) -> Option<BlockId> {
        let values = blocks.into_iter().map(|b| b.0);
        first_repeated(&mut self.stamps, &mut self.stamp, values).map(BlockId)
    }

    /// The first request (slab index) that occurs twice in `reqs`, if any.
    pub(super) fn first_repeated_req(
        &mut self,
        reqs: impl IntoIterator<Item = u32>,
    ) -> Option<u32> {
        self.req_stamps.resize(self.reqs.len(), 0);
        first_repeated(&mut self.req_stamps, &mut self.req_stamp, reqs)
    }

    pub(super) fn engine_block(&self, b: BlockId) -> Result<BlockId> {
        if b.0 >= self.cfg.num_gpu_blocks {
            return Err(Error::BlockOutOfRange {
                block: b,
                num_blocks: self.cfg.num_gpu_blocks,
            });
        }
        Ok(if Some(b) == self.cfg.null_block {
            BlockId::NULL
        } else {
            b
        })
    }

    pub(super) fn engine_blocks(&self, blocks: &[BlockId]) -> Result<Vec<BlockId>> {
        blocks.iter().map(|b| self.engine_block(*b)).collect()
    }
}
