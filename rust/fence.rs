//! The fence index: which pending jobs still read (or write) each GPU block.
//!
//! A store job reads its source blocks some time after it is created; a load job writes its
//! destination blocks some time after it is created. If such a block is handed to a new owner
//! and written before the copy is done, KV is silently corrupted. The fence holds only the
//! *armed* `(block, job)` pairs — pairs whose block may be re-allocated — and answers, once per
//! step, which pending jobs touch a block that is about to be written.
//!
//! Block ids are small dense integers, so the index is a `Vec` indexed by block holding the few
//! jobs armed on it. The check is one indexed load per written block: its cost depends on the
//! number of written blocks, not on how many jobs are pending.

use crate::ids::{BlockId, JobId};

/// The armed index `block -> jobs`.
#[derive(Debug, Default, Clone)]
pub struct Fence {
    armed: Vec<Vec<JobId>>,
    pairs: usize,
}

impl Fence {
    /// A fence for blocks `0..num_blocks`.
    pub fn new(num_blocks: u32) -> Self {
        Self {
            armed: vec![Vec::new(); num_blocks as usize],
            pairs: 0,
        }
    }

    /// Number of blocks covered.
    pub fn num_blocks(&self) -> u32 {
        self.armed.len() as u32
    }

    /// Arms `(block, job)` for every block. Blocks must be in range (the tracker validates).
    pub fn arm(&mut self, job: JobId, blocks: &[BlockId]) {
        for b in blocks {
            self.armed[b.0 as usize].push(job);
        }
        self.pairs += blocks.len();
    }

    /// Removes the pairs `(block, job)` that [`Fence::arm`] added for these blocks.
    pub fn disarm(&mut self, job: JobId, blocks: &[BlockId]) {
        for b in blocks {
            let jobs = &mut self.armed[b.0 as usize];
            if let Some(i) = jobs.iter().position(|j| *j == job) {
                jobs.swap_remove(i);
                self.pairs -= 1;
            }
        }
    }

    /// Appends to `out` every job armed on a block of `written`, sorted and without duplicates.
    /// Blocks out of range are ignored: nothing can be armed on them.
    pub fn check(&self, written: &[BlockId], out: &mut Vec<JobId>) {
        let start = out.len();
        for b in written {
            if let Some(jobs) = self.armed.get(b.0 as usize) {
                out.extend_from_slice(jobs);
            }
        }
        let found = &mut out[start..];
        if found.len() > 1 {
            found.sort_unstable();
            let mut keep = start + 1;
            for i in start + 1..out.len() {
                if out[i] != out[keep - 1] {
                    out[keep] = out[i];
                    keep += 1;
                }
            }
            out.truncate(keep);
        }
    }

    /// Jobs armed on one block.
    pub fn jobs_on(&self, block: BlockId) -> &[JobId] {
        self.armed.get(block.0 as usize).map_or(&[], Vec::as_slice)
    }

    /// Number of armed pairs.
    pub fn armed_pairs(&self) -> usize {
        self.pairs
    }

    /// Removes every pair.
    pub fn clear(&mut self) {
        for jobs in &mut self.armed {
            jobs.clear();
        }
        self.pairs = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_dedups_and_sorts() {
        let mut f = Fence::new(8);
        f.arm(JobId(5), &[BlockId(1), BlockId(2)]);
        f.arm(JobId(3), &[BlockId(2)]);
        let mut out = vec![JobId(99)];
        f.check(
            &[BlockId(2), BlockId(1), BlockId(7), BlockId(100)],
            &mut out,
        );
        assert_eq!(out, vec![JobId(99), JobId(3), JobId(5)]);
        f.disarm(JobId(5), &[BlockId(1), BlockId(2)]);
        assert_eq!(f.armed_pairs(), 1);
        assert_eq!(f.jobs_on(BlockId(2)), &[JobId(3)]);
    }
}
