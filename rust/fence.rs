//! The fence index: which pending jobs still read (or write) each GPU block.
//!
//! A store job reads its source blocks some time after it is created; a load job writes its
//! destination blocks some time after it is created. If such a block is handed to a new owner
//! and written before the copy is done, KV is silently corrupted. The fence holds only the
//! *armed* `(block, job)` pairs — pairs whose block may be re-allocated — and answers, once per
//! step, which pending jobs touch a block that is about to be written.
//!
//! Block ids are small dense integers, and a block almost always has at most one armed job (a
//! second one needs two pending jobs on one GPU block: a store of a prefix block two requests
//! share, say). So the index is a dense array holding each block's first armed job in place,
//! and a map holding the rare others: arming, disarming and checking a block is one indexed
//! access, a cache miss whose address is known from the block alone (the loops ask for it a few
//! blocks ahead, so the misses overlap), where a list per block cost a miss on the list and a
//! dependent one on its items. The check's cost depends on the number of written blocks, not on
//! how many jobs are pending.

use rustc_hash::FxHashMap;

use crate::ids::{BlockId, JobId};
use crate::prefetch::prefetch;

/// How many blocks ahead of the one it works on a loop asks for a block's entry.
const AHEAD: usize = 16;

/// The armed index `block -> jobs` (a multiset per block).
#[derive(Debug, Default, Clone)]
pub struct Fence {
    /// Each block's first armed job, [`JobId::NONE`] when none is.
    first: Vec<JobId>,
    /// The other jobs armed on a block, for the few blocks with more than one: a block is a key
    /// here only while its `first` is set, with a list that is never empty.
    more: FxHashMap<u32, Vec<JobId>>,
    pairs: usize,
}

impl Fence {
    /// A fence for blocks `0..num_blocks`.
    pub fn new(num_blocks: u32) -> Self {
        Self {
            first: vec![JobId::NONE; num_blocks as usize],
            more: FxHashMap::default(),
            pairs: 0,
        }
    }

    /// Number of blocks covered.
    pub fn num_blocks(&self) -> u32 {
        self.first.len() as u32
    }

    /// Asks for the entry of `blocks[k + AHEAD]`, if any, ahead of its use.
    fn warm(&self, blocks: &[BlockId], k: usize) {
        if let Some(e) = blocks
            .get(k + AHEAD)
            .and_then(|b| self.first.get(b.0 as usize))
        {
            prefetch(e);
        }
    }

    /// Arms `(block, job)` for every block. Blocks must be in range (the tracker validates).
    pub fn arm(&mut self, job: JobId, blocks: &[BlockId]) {
        for (k, b) in blocks.iter().enumerate() {
            self.warm(blocks, k);
            let first = &mut self.first[b.0 as usize];
            if *first == JobId::NONE {
                *first = job;
            } else {
                self.more.entry(b.0).or_default().push(job);
            }
        }
        self.pairs += blocks.len();
    }

    /// Removes the pairs `(block, job)` that [`Fence::arm`] added for these blocks.
    pub fn disarm(&mut self, job: JobId, blocks: &[BlockId]) {
        for (k, b) in blocks.iter().enumerate() {
            self.warm(blocks, k);
            let first = &mut self.first[b.0 as usize];
            if *first == JobId::NONE {
                continue;
            }
            if *first == job {
                // The block's next job, if it has others, takes the first place.
                *first = match self.more.get_mut(&b.0) {
                    None => JobId::NONE,
                    Some(others) => {
                        let next = others.pop().expect("a block's other jobs are never empty");
                        if others.is_empty() {
                            self.more.remove(&b.0);
                        }
                        next
                    }
                };
                self.pairs -= 1;
            } else if let Some(others) = self.more.get_mut(&b.0) {
                if let Some(i) = others.iter().position(|j| *j == job) {
                    others.swap_remove(i);
                    if others.is_empty() {
                        self.more.remove(&b.0);
                    }
                    self.pairs -= 1;
                }
            }
        }
    }

    /// Appends to `out` every job armed on a block of `written`, sorted and without duplicates.
    /// Blocks out of range are ignored: nothing can be armed on them.
    pub fn check(&self, written: &[BlockId], out: &mut Vec<JobId>) {
        let start = out.len();
        for (k, b) in written.iter().enumerate() {
            self.warm(written, k);
            let Some(&first) = self.first.get(b.0 as usize) else {
                continue;
            };
            if first != JobId::NONE {
                out.push(first);
                if !self.more.is_empty() {
                    if let Some(others) = self.more.get(&b.0) {
                        out.extend_from_slice(others);
                    }
                }
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

    /// Jobs armed on one block (a job armed twice on it, twice), in no particular order.
    pub fn jobs_on(&self, block: BlockId) -> Vec<JobId> {
        let Some(&first) = self.first.get(block.0 as usize) else {
            return Vec::new();
        };
        if first == JobId::NONE {
            return Vec::new();
        }
        let mut jobs = vec![first];
        if let Some(others) = self.more.get(&block.0) {
            jobs.extend_from_slice(others);
        }
        jobs
    }

    /// Number of armed pairs.
    pub fn armed_pairs(&self) -> usize {
        self.pairs
    }

    /// Removes every pair.
    pub fn clear(&mut self) {
        if self.pairs > 0 {
            self.first.fill(JobId::NONE);
            self.more.clear();
            self.pairs = 0;
        }
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
        assert_eq!(f.jobs_on(BlockId(2)), vec![JobId(3)]);
    }

    /// The index as it was (a list per block), the reference for the random sequences below.
    #[derive(Default)]
    struct Lists(Vec<Vec<JobId>>);

    impl Lists {
        fn arm(&mut self, job: JobId, blocks: &[BlockId]) {
            for b in blocks {
                self.0[b.0 as usize].push(job);
            }
        }

        fn disarm(&mut self, job: JobId, blocks: &[BlockId]) {
            for b in blocks {
                let jobs = &mut self.0[b.0 as usize];
                if let Some(i) = jobs.iter().position(|j| *j == job) {
                    jobs.swap_remove(i);
                }
            }
        }

        fn sorted_on(&self, b: usize) -> Vec<JobId> {
            let mut jobs = self.0[b].clone();
            jobs.sort_unstable();
            jobs
        }
    }

    /// Random arms, disarms (of armed and of never-armed pairs, blocks repeated within a call,
    /// the first job of a shared block removed before or after the others), checks and clears
    /// on few blocks (so blocks are shared by several jobs): the same multiset per block, the
    /// same check answers and pair count as the per-block lists.
    #[test]
    fn matches_a_list_per_block_on_random_sequences() {
        const BLOCKS: u32 = 12;
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..200 {
            let mut f = Fence::new(BLOCKS);
            let mut lists = Lists(vec![Vec::new(); BLOCKS as usize]);
            let mut pairs = 0usize;
            for _ in 0..300 {
                let job = JobId(next(6));
                let blocks: Vec<BlockId> = (0..next(5))
                    .map(|_| BlockId(next(u64::from(BLOCKS)) as u32))
                    .collect();
                match next(10) {
                    0..=3 => {
                        f.arm(job, &blocks);
                        lists.arm(job, &blocks);
                        pairs += blocks.len();
                    }
                    4..=7 => {
                        let before: usize = lists.0.iter().map(Vec::len).sum();
                        f.disarm(job, &blocks);
                        lists.disarm(job, &blocks);
                        pairs -= before - lists.0.iter().map(Vec::len).sum::<usize>();
                    }
                    8 => {
                        let mut got = vec![JobId(77)];
                        f.check(&blocks, &mut got);
                        let mut want: Vec<JobId> = blocks
                            .iter()
                            .flat_map(|b| lists.0[b.0 as usize].clone())
                            .collect();
                        want.sort_unstable();
                        want.dedup();
                        want.insert(0, JobId(77));
                        assert_eq!(got, want);
                    }
                    _ => {
                        if next(4) == 0 {
                            f.clear();
                            lists = Lists(vec![Vec::new(); BLOCKS as usize]);
                            pairs = 0;
                        }
                    }
                }
                assert_eq!(f.armed_pairs(), pairs);
                for b in 0..BLOCKS {
                    let mut got = f.jobs_on(BlockId(b));
                    got.sort_unstable();
                    assert_eq!(got, lists.sorted_on(b as usize), "block {b}");
                }
                assert!(
                    f.more
                        .iter()
                        .all(|(b, o)| !o.is_empty() && f.first[*b as usize] != JobId::NONE),
                    "a block's other jobs exist only beside its first one"
                );
            }
        }
    }
}
