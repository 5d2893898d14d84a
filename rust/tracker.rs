//! Jobs and fence together: the lifecycle classes of DESIGN.md §4.
//!
//! Every `(job, block)` pair has a class fixed at creation. *Eager* pairs (sliding-window
//! blocks, which the engine may free while the request runs) are armed at once. *Deferred*
//! pairs (full-attention blocks, which the running request holds) are armed only when the
//! owning request releases its blocks — finish, abort or preemption — or at creation if it
//! already did. A running full-attention request's store therefore never touches the fence
//! index. [`Tracker::check`] is the single per-step fence check: the pending jobs with an armed
//! pair on a block about to be written.

use rustc_hash::FxHashSet;

use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::ids::{BlockId, JobId, OwnerId};
use crate::jobs::{Completion, Job, JobKind, JobStats, JobTable, NO_ENTRY};

/// Counters of the fence.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FenceStats {
    /// Calls to [`Tracker::check`].
    pub checks: u64,
    /// Jobs returned by checks (a job flushed in two steps counts twice).
    pub flushed: u64,
    /// Jobs flushed by resets.
    pub reset_flushed: u64,
}

/// Job table + fence index + which owners have released their blocks.
#[derive(Debug)]
pub struct Tracker<P> {
    jobs: JobTable<P>,
    fence: Fence,
    released: FxHashSet<OwnerId>,
    stats: FenceStats,
    skip_deferred: bool,
}

impl<P> Tracker<P> {
    /// A tracker for an engine with `num_blocks` GPU blocks and `num_workers` workers.
    pub fn new(num_workers: u32, num_blocks: u32) -> Result<Self> {
        if num_blocks == 0 {
            return Err(Error::Config("num_blocks must be at least 1, got 0".into()));
        }
        Ok(Self {
            jobs: JobTable::new(num_workers)?,
            fence: Fence::new(num_blocks),
            released: FxHashSet::default(),
            stats: FenceStats::default(),
            skip_deferred: false,
        })
    }

    /// Testing only: never arm deferred pairs (a deliberately broken fence, for mutation
    /// tests that show the integrity oracle catches it).
    pub fn set_skip_deferred_arming(&mut self, skip: bool) {
        self.skip_deferred = skip;
    }

    /// Checks that every block is in range.
    pub fn validate_blocks(&self, blocks: &[BlockId]) -> Result<()> {
        let num_blocks = self.fence.num_blocks();
        match blocks.iter().find(|b| b.0 >= num_blocks) {
            Some(&block) => Err(Error::BlockOutOfRange { block, num_blocks }),
            None => Ok(()),
        }
    }

    /// Creates a job reading (store) or writing (load) `eager` and `deferred` blocks.
    pub fn create(
        &mut self,
        kind: JobKind,
        owner: OwnerId,
        eager: Vec<BlockId>,
        deferred: Vec<BlockId>,
        payload: P,
    ) -> Result<JobId> {
        self.create_at(kind, owner, NO_ENTRY, eager, deferred, payload)
            .map(|(id, _)| id)
    }

    /// [`Tracker::create`] with a hint of the owner's entry in the job table: what its last
    /// `create_at` returned beside the job id ([`NO_ENTRY`]: none; see
    /// [`JobTable::insert_at`]). Returns the job's id and the hint for the owner's next job.
    pub fn create_at(
        &mut self,
        kind: JobKind,
        owner: OwnerId,
        hint: u32,
        eager: Vec<BlockId>,
        deferred: Vec<BlockId>,
        payload: P,
    ) -> Result<(JobId, u32)> {
        if eager.is_empty() && deferred.is_empty() {
            return Err(Error::EmptyJob(owner));
        }
        self.validate_blocks(&eager)?;
        self.validate_blocks(&deferred)?;
        self.jobs.check_owner_at(owner, hint, kind)?;
        let armed = self.released.contains(&owner) && !self.skip_deferred;
        let next = self.jobs.next_id();
        self.fence.arm(next, &eager);
        if armed {
            self.fence.arm(next, &deferred);
        }
        Ok(self
            .jobs
            .insert_at(kind, owner, hint, eager, deferred, armed, payload))
    }

    /// The owner released its blocks (finished, aborted or preempted): arm the deferred pairs
    /// of its pending jobs, and of every job created for it until [`Tracker::reacquire`].
    pub fn release(&mut self, owner: OwnerId) {
        self.released.insert(owner);
        if self.skip_deferred {
            return;
        }
        let Some(o) = self.jobs.owner(owner) else {
            return;
        };
        let ids = o.jobs.clone();
        for id in ids {
            let job = self.jobs.get_mut(id).expect("owner's job is pending");
            if !job.deferred_armed {
                job.deferred_armed = true;
                self.fence.arm(id, &job.deferred);
            }
        }
    }

    /// The owner holds blocks again (resumed after preemption): its new jobs are deferred
    /// again. Pairs armed by the release stay armed.
    pub fn reacquire(&mut self, owner: OwnerId) {
        self.released.remove(&owner);
    }

    /// The owner is gone for good; no more jobs will be created for it.
    pub fn forget(&mut self, owner: OwnerId) {
        self.released.remove(&owner);
        self.jobs.forget(owner);
    }

    /// Whether the owner has released its blocks.
    pub fn is_released(&self, owner: OwnerId) -> bool {
        self.released.contains(&owner)
    }

    /// The single per-step fence check: pending jobs with an armed pair on a `written` block,
    /// sorted by id.
    pub fn check(&mut self, written: &[BlockId]) -> Result<Vec<JobId>> {
        let mut out = Vec::new();
        self.check_into(written, &mut out)?;
        Ok(out)
    }

    /// [`Tracker::check`] appending to a caller buffer.
    pub fn check_into(&mut self, written: &[BlockId], out: &mut Vec<JobId>) -> Result<()> {
        self.validate_blocks(written)?;
        let start = out.len();
        self.fence.check(written, out);
        self.stats.checks += 1;
        self.stats.flushed += (out.len() - start) as u64;
        Ok(())
    }

    /// Records worker `worker`'s report for `id`. When the job is done its armed pairs leave
    /// the fence and the job is returned.
    pub fn complete(&mut self, id: JobId, worker: u32, ok: bool) -> Result<Completion<P>> {
        let c = self.jobs.complete(id, worker, ok)?;
        if let Completion::Done(job) = &c {
            self.fence.disarm(job.id, &job.eager);
            if job.deferred_armed {
                self.fence.disarm(job.id, &job.deferred);
            }
        }
        Ok(c)
    }

    /// A job that reads and writes no GPU block (a lower-tier job: write-behind or
    /// promotion): counted, reported and completed like a store, never in the fence.
    pub fn create_unfenced(&mut self, owner: OwnerId, payload: P) -> JobId {
        self.jobs.insert(
            JobKind::Store,
            owner,
            Vec::new(),
            Vec::new(),
            false,
            payload,
        )
    }

    /// Forgets everything: returns every pending job (all must be flushed); later reports for
    /// them are ignored. Released owners are forgotten too.
    pub fn reset(&mut self) -> Vec<Job<P>> {
        let pending = self.jobs.reset();
        self.fence.clear();
        self.released.clear();
        self.stats.reset_flushed += pending.len() as u64;
        pending
    }

    /// The job table (read-only).
    pub fn jobs(&self) -> &JobTable<P> {
        &self.jobs
    }

    /// The fence index (read-only).
    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    /// Number of owners marked released.
    pub fn released_len(&self) -> usize {
        self.released.len()
    }

    /// Job counters.
    pub fn job_stats(&self) -> JobStats {
        self.jobs.stats()
    }

    /// Fence counters.
    pub fn fence_stats(&self) -> FenceStats {
        self.stats
    }
}
