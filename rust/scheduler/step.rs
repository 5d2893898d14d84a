//! The step (DESIGN.md §3.3): one call checks the whole step input (`checks.rs`), then applies
//! it in the five phases documented in the parent module, one function each, and returns the
//! plan with the single fence check's flush set.

use crate::error::Result;
use crate::ids::{BlockId, JobId};

use super::checks::{null_mapped, CheckedStep};
use super::handle::RequestRef;
use super::plan::{PlanForm, PlannedJob, StepInput, StepPlan};
use super::requests::Status;
use super::stores::Planned;
use super::Scheduler;

/// How many blocks ahead of the one being indexed `reallocate` prefetches its position entry
/// (a cache miss each, spread over the dense index; a few ns of work each).
const AHEAD: usize = 16;

impl Scheduler {
    /// Applies one engine step and returns its plan: loads created since the previous plan,
    /// stores for chunks that became full, and the flush set of the single fence check.
    /// Everything is validated before anything changes.
    pub fn schedule<S: RequestRef, B: AsRef<[BlockId]>>(
        &mut self,
        input: &StepInput<S, B>,
    ) -> Result<StepPlan> {
        self.schedule_with(input, PlanForm::Transfers)
    }

    /// [`Scheduler::schedule`], with the plan's copies in `form`: the same jobs, flush set and
    /// copies either way, and the same state after.
    pub fn schedule_with<S: RequestRef, B: AsRef<[BlockId]>>(
        &mut self,
        input: &StepInput<S, B>,
        form: PlanForm,
    ) -> Result<StepPlan> {
        let mut step = self.check_step(input)?;
        self.step += 1;
        self.stats.steps += 1;
        // 1: releases arm their requests' deferred fence pairs.
        self.release(&step);
        let written = self.written_blocks(step.written.take(), &step.new_blocks);
        // 2: stores of released requests read their blocks as they are before this step's
        // re-allocations; armed at creation, the fence check flushes them if need be.
        let mut retry = std::mem::take(&mut self.retry);
        // A plan's list handed back (`recycle`), with room for half again the previous plan's
        // (decode-heavy steps plan about as many each): no allocation, not one per doubling.
        let mut stores = self.spares.jobs(self.last_stores + self.last_stores / 2);
        // The loads created since the previous plan come first: their copies now, read from
        // their jobs (runs, or the plan's own copies of the transfers); each store's as it is
        // planned.
        let mut runs = self.spares.runs();
        for (k, load) in self.new_loads.iter_mut().enumerate() {
            // No report of a job before its plan is accepted, and a reset empties `new_loads`.
            let job = self
                .tracker
                .jobs()
                .get(load.id)
                .expect("a load not planned yet is pending");
            for t in &job.payload.transfers {
                match form {
                    PlanForm::Runs => crate::runs::push_copies(
                        &mut runs,
                        k as u32,
                        t.group,
                        &t.gpu_blocks,
                        &t.cpu_blocks,
                    ),
                    PlanForm::Transfers => load.transfers.push(self.spares.copy(t)),
                }
            }
        }
        let mut out = Planned {
            jobs: &mut stores,
            form,
            runs: &mut runs,
            first: self.new_loads.len() as u32,
        };
        let mut work = std::mem::take(&mut self.work);
        work.clear();
        work.extend_from_slice(&step.released);
        work.extend(retry.iter().copied().filter(|i| {
            self.reqs[*i as usize]
                .as_ref()
                .is_some_and(|r| r.status != Status::Running)
        }));
        self.plan_all(&work, &mut out);
        // 3: re-allocations drop the positions whose content they replace.
        self.reallocate(&step.resumed, &step.new_blocks);
        // 4: stores of running requests, for chunks this step's forward pass completes.
        let released_stores = out.jobs.len();
        work.clear();
        for (i, computed) in step.scheduled {
            self.req_mut(i).computed = computed;
            work.push(i);
        }
        retry.retain(|i| {
            self.reqs[*i as usize]
                .as_ref()
                .is_some_and(|r| r.status == Status::Running)
        });
        work.append(&mut retry);
        self.plan_all(&work, &mut out);
        self.assign_pending();
        self.work = work;
        // 5: the single fence check, after this step's stores exist.
        let flush = self.fence_check(
            &written,
            &stores[released_stores..],
            input.written.is_some(),
        );
        self.last_stores = stores.len();
        self.planned_below = self.tracker.jobs().next_id();
        Ok(StepPlan {
            loads: std::mem::take(&mut self.new_loads),
            stores,
            runs,
            flush,
            tier_jobs: std::mem::take(&mut self.new_tier_jobs),
            tier_flush: {
                let mut t = std::mem::take(&mut self.reset_tier_flush);
                t.sort_unstable();
                t
            },
        })
    }

    /// Phase 1: finished, aborted and preempted requests take their new status and release
    /// their blocks (the tracker arms their deferred pairs).
    fn release(&mut self, step: &CheckedStep<'_>) {
        for (list, status) in [
            (&step.finished, Status::Finished),
            (&step.aborted, Status::Aborted),
            (&step.preempted, Status::Preempted),
        ] {
            for &i in list {
                let r = self.req_mut(i);
                r.status = status;
                let owner = r.owner;
                self.tracker.release(owner);
            }
        }
    }

    /// The blocks this step writes: the explicit set (checked, the null block left out), or
    /// every block allocated since the previous step and in `new_blocks` (conservative).
    fn written_blocks(
        &mut self,
        explicit: Option<Vec<BlockId>>,
        new_blocks: &[(u32, usize, &[BlockId])],
    ) -> Vec<BlockId> {
        let written = if let Some(w) = explicit {
            w
        } else {
            let mut w = std::mem::take(&mut self.allocated);
            let null = self.cfg.null_block;
            for (_, _, blocks) in new_blocks {
                w.extend(
                    blocks
                        .iter()
                        .map(|&b| null_mapped(null, b))
                        .filter(|b| *b != BlockId::NULL),
                );
            }
            w
        };
        self.allocated.clear();
        written
    }

    /// Phase 3: this step's re-allocations (by `allocate` since the previous step, and
    /// `new_blocks`) drop the unstored positions they replace; resumed requests start a new
    /// block table; the new blocks are appended, their unstored positions indexed after phase
    /// 4 (`assign_pending`).
    fn reallocate(&mut self, resumed: &[u32], new_blocks: &[(u32, usize, &[BlockId])]) {
        let null = self.cfg.null_block;
        let mut reallocated = std::mem::take(&mut self.reallocated);
        for (k, &b) in reallocated.iter().enumerate() {
            if let Some(&ahead) = reallocated.get(k + AHEAD) {
                self.pos_index.prefetch(ahead);
            }
            self.invalidate(b);
        }
        reallocated.clear();
        self.reallocated = reallocated;
        for &(_, _, blocks) in new_blocks {
            for (k, &b) in blocks.iter().enumerate() {
                if let Some(&ahead) = blocks.get(k + AHEAD) {
                    self.pos_index.prefetch(ahead);
                }
                self.invalidate(null_mapped(null, b));
            }
        }
        for &i in resumed {
            let owner = self.req(i).owner;
            self.tracker.reacquire(owner);
            let r = self.req_mut(i);
            r.status = Status::Running;
            r.epoch += 1;
            for g in &mut r.groups {
                g.blocks.clear();
            }
        }
        let bpc = self.cfg.blocks_per_chunk;
        for &(i, g, blocks) in new_blocks {
            let rg = &mut self.req_mut(i).groups[g];
            let start = rg.blocks.len() as u32;
            let from = start.max(rg.cursor * bpc);
            rg.blocks
                .extend(blocks.iter().map(|&b| null_mapped(null, b)));
            for (k, &b) in blocks.iter().enumerate() {
                let pos = start + k as u32;
                if null_mapped(null, b) != BlockId::NULL && pos >= from {
                    self.pending_assign.push((i, g as u32, pos));
                }
            }
        }
    }

    /// After phase 4: indexes the positions this step's re-allocations and appends brought
    /// (`pending_assign`) that are still unstored. A chunk stored in this very step (a
    /// prefill's, or the one a decode completes) leaves its positions below the store cursor:
    /// indexed, they would die at once (an entry below the cursor is dead), so they are not.
    /// Nothing reads the index between phase 3, whose invalidations all come first, and here.
    fn assign_pending(&mut self) {
        let mut pending = std::mem::take(&mut self.pending_assign);
        let bpc = self.cfg.blocks_per_chunk;
        let reqs = &self.reqs;
        pending.retain(|&(i, g, pos)| {
            reqs[i as usize]
                .as_ref()
                .is_some_and(|r| pos >= r.groups[g as usize].cursor * bpc)
        });
        for (k, &(i, g, pos)) in pending.iter().enumerate() {
            let ahead = pending.get(k + AHEAD).and_then(|&(j, g, pos)| {
                let r = self.reqs[j as usize].as_ref()?;
                r.groups[g as usize].blocks.get(pos as usize).copied()
            });
            if let Some(b) = ahead {
                self.pos_index.prefetch(b);
            }
            self.assign(i, g, pos);
        }
        pending.clear();
        self.pending_assign = pending;
    }

    /// Phase 5: the single fence check over `written`. Neither a store of a running request
    /// (`running_stores`: it runs after this step's forward pass) nor a load of this plan (it
    /// writes its own blocks) is flushed by the step that creates it. Jobs flushed by a reset
    /// since the previous plan are added.
    fn fence_check(
        &mut self,
        written: &[BlockId],
        running_stores: &[PlannedJob],
        explicit: bool,
    ) -> Vec<JobId> {
        let mut flush = Vec::new();
        self.tracker
            .check_into(written, &mut flush)
            .expect("written blocks validated");
        if !flush.is_empty() {
            let first_running = running_stores.first().map(|j| j.id);
            // A load whose request released its blocks in this very step no longer writes
            // blocks of its own: the fence decides for it as for any job.
            let own_loads: Vec<JobId> = self
                .new_loads
                .iter()
                .filter(|l| {
                    self.tracker.jobs().get(l.id).is_some_and(|j| {
                        self.reqs[j.payload.req as usize]
                            .as_ref()
                            .is_some_and(|r| r.status == Status::Running)
                    })
                })
                .map(|l| l.id)
                .collect();
            flush.retain(|j| first_running.is_none_or(|f| *j < f) && !own_loads.contains(j));
        }
        let n = flush.len() as u64;
        if explicit {
            self.stats.flushes_necessary += n;
        } else {
            self.stats.flushes_conservative += n;
        }
        if !self.reset_flush.is_empty() {
            flush.append(&mut self.reset_flush);
            flush.sort_unstable();
            flush.dedup();
        }
        flush
    }
}
