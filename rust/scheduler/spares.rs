//! Lists kept for reuse: the records and GPU block lists of completed store jobs, and the lists
//! of plans their caller handed back ([`Scheduler::recycle`]). A store job's lists then come
//! from here: past the first steps, a step whose plan is handed back allocates none per job
//! (each allocation of a list touches cold memory: about 35 store jobs and five lists each
//! per step at B=512).

use crate::ids::{BlockId, Key};

use super::plan::{GroupTransfer, PlannedJob, StepPlan};
use super::stores::StoreChunks;
use super::Scheduler;

/// Most lists of each kind [`Spares`] keeps: more than the store jobs of a step at B=512
/// (about 35), so the steady state never allocates one, and a burst's lists are freed.
const SPARES: usize = 128;

/// The kept lists, emptied (see the module doc).
#[derive(Debug, Default)]
pub(super) struct Spares {
    chunks: Vec<StoreChunks>,
    blocks: Vec<Vec<BlockId>>,
    cpu: Vec<Vec<u32>>,
    keys: Vec<Vec<Key>>,
    transfers: Vec<Vec<GroupTransfer>>,
    names: Vec<String>,
    /// Plans' job lists (their entries are written once per job and step: kept, they are
    /// written where the previous plans' were).
    jobs: Vec<Vec<PlannedJob>>,
    /// A plan's runs buffer ([`super::PlanForm::Runs`]).
    runs: Vec<u8>,
}

/// A kept list with room for `n` items, or a new one.
fn take<T>(kept: &mut Vec<Vec<T>>, n: usize) -> Vec<T> {
    let mut v = kept.pop().unwrap_or_default();
    v.reserve(n);
    v
}

/// Keeps `v`, emptied, unless it has no room or enough are kept.
fn keep<T>(kept: &mut Vec<Vec<T>>, mut v: Vec<T>) {
    if kept.len() < SPARES && v.capacity() > 0 {
        v.clear();
        kept.push(v);
    }
}

impl Spares {
    /// An empty record, reused when one is kept.
    pub(super) fn chunks(&mut self) -> StoreChunks {
        self.chunks.pop().unwrap_or_default()
    }

    /// Keeps a completed job's record for a later one.
    pub(super) fn put_chunks(&mut self, mut c: StoreChunks) {
        if self.chunks.len() < SPARES && c.clear() {
            self.chunks.push(c);
        }
    }

    /// Appends `blocks` to a job's block class, taking a kept list for a class still empty.
    pub(super) fn extend(&mut self, class: &mut Vec<BlockId>, blocks: &[BlockId]) {
        if class.capacity() == 0 {
            if let Some(b) = self.blocks.pop() {
                *class = b;
            }
        }
        class.extend_from_slice(blocks);
    }

    /// Keeps a completed job's block list for a later one.
    pub(super) fn put_blocks(&mut self, b: Vec<BlockId>) {
        keep(&mut self.blocks, b);
    }

    /// An empty GPU block list with room for `n`.
    pub(super) fn blocks(&mut self, n: usize) -> Vec<BlockId> {
        take(&mut self.blocks, n)
    }

    /// An empty CPU block list with room for `n`.
    pub(super) fn cpu(&mut self, n: usize) -> Vec<u32> {
        take(&mut self.cpu, n)
    }

    /// A copy of `keys` in a kept list.
    pub(super) fn keys(&mut self, keys: &[Key]) -> Vec<Key> {
        let mut v = take(&mut self.keys, keys.len());
        v.extend_from_slice(keys);
        v
    }

    /// A copy of `t` in kept lists.
    pub(super) fn copy(&mut self, t: &GroupTransfer) -> GroupTransfer {
        let mut gpu_blocks = self.blocks(t.gpu_blocks.len());
        gpu_blocks.extend_from_slice(&t.gpu_blocks);
        let mut cpu_blocks = self.cpu(t.cpu_blocks.len());
        cpu_blocks.extend_from_slice(&t.cpu_blocks);
        GroupTransfer {
            group: t.group,
            gpu_blocks,
            cpu_blocks,
            keys: self.keys(&t.keys),
        }
    }

    /// An empty list of a plan's jobs with room for `n`.
    pub(super) fn jobs(&mut self, n: usize) -> Vec<PlannedJob> {
        take(&mut self.jobs, n)
    }

    /// The kept runs buffer, emptied (a new one if none is kept).
    pub(super) fn runs(&mut self) -> Vec<u8> {
        let mut runs = std::mem::take(&mut self.runs);
        runs.clear();
        runs
    }

    /// An empty list of transfers.
    pub(super) fn transfers(&mut self) -> Vec<GroupTransfer> {
        take(&mut self.transfers, 0)
    }

    /// A copy of `name` in a kept string.
    pub(super) fn name(&mut self, name: &str) -> String {
        let mut s = self.names.pop().unwrap_or_default();
        s.push_str(name);
        s
    }

    /// Keeps a job's request name.
    fn put_name(&mut self, mut s: String) {
        if self.names.len() < SPARES && s.capacity() > 0 {
            s.clear();
            self.names.push(s);
        }
    }

    /// Keeps the lists of a transfer list.
    fn put_transfers(&mut self, mut transfers: Vec<GroupTransfer>) {
        for t in transfers.drain(..) {
            keep(&mut self.blocks, t.gpu_blocks);
            keep(&mut self.cpu, t.cpu_blocks);
            keep(&mut self.keys, t.keys);
        }
        keep(&mut self.transfers, transfers);
    }
}

impl Scheduler {
    /// Takes back a plan its caller is done with (an engine binding that encoded it): the
    /// lists of its jobs are kept for the next plans' jobs, so that a caller handing every
    /// plan back allocates no list per job in the steady state. Optional: a plan dropped
    /// instead costs those allocations, nothing else.
    pub fn recycle(&mut self, plan: StepPlan) {
        if plan.runs.capacity() > self.spares.runs.capacity() {
            self.spares.runs = plan.runs;
        }
        for mut jobs in [plan.loads, plan.stores] {
            for job in jobs.drain(..) {
                self.spares.put_transfers(job.transfers);
                self.spares.put_name(job.request);
            }
            keep(&mut self.spares.jobs, jobs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::PlannedJob;
    use super::*;
    use crate::ids::JobId;
    use crate::jobs::JobKind;

    #[test]
    fn kept_block_lists_come_back_empty_and_are_bounded() {
        let mut spares = Spares::default();
        for _ in 0..SPARES + 10 {
            spares.put_blocks(vec![BlockId(9); 4]);
        }
        spares.put_blocks(Vec::new());
        assert_eq!(spares.blocks.len(), SPARES);
        let mut class = Vec::new();
        spares.extend(&mut class, &[BlockId(1), BlockId(2)]);
        assert_eq!(class, vec![BlockId(1), BlockId(2)]);
        assert!(class.capacity() >= 4);
        assert_eq!(spares.blocks.len(), SPARES - 1);
    }

    #[test]
    fn a_recycled_plan_s_lists_serve_the_next_jobs() {
        let mut spares = Spares::default();
        let transfer = GroupTransfer {
            group: 0,
            gpu_blocks: vec![BlockId(1); 64],
            cpu_blocks: vec![7; 64],
            keys: vec![Key(3); 16],
        };
        let job = |transfers| PlannedJob {
            id: JobId(1),
            kind: JobKind::Store,
            request: "a-fairly-long-request-id".to_owned(),
            transfers,
        };
        let plan = StepPlan {
            stores: vec![job(vec![transfer.clone(), transfer]), job(Vec::new())],
            ..StepPlan::default()
        };
        for job in plan.stores {
            spares.put_transfers(job.transfers);
            spares.put_name(job.request);
        }
        let blocks = spares.blocks(8);
        let cpu = spares.cpu(8);
        let keys = spares.keys(&[Key(9)]);
        let name = spares.name("b");
        assert!(blocks.is_empty() && blocks.capacity() >= 64);
        assert!(cpu.is_empty() && cpu.capacity() >= 64);
        assert_eq!(keys, vec![Key(9)]);
        assert!(keys.capacity() >= 16);
        assert_eq!(name, "b");
        assert!(name.capacity() >= "a-fairly-long-request-id".len());
        let transfers = spares.transfers();
        assert!(transfers.is_empty() && transfers.capacity() >= 2);
        // Lists with no room are not kept: nothing left to take but new lists.
        assert_eq!(spares.transfers().capacity(), 0);
        assert!(spares.names.len() == 1 && spares.names[0].is_empty());
    }
}
