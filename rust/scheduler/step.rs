//! The step (DESIGN.md §3.3): one call validates the whole step input, then applies it in the
//! order documented in the parent module and returns the plan with the single fence check's
//! flush set.

use crate::error::{Error, Result};
use crate::ids::{BlockId, JobId};

use super::plan::{StepInput, StepPlan};
use super::requests::Status;
use super::Scheduler;

impl Scheduler {
    /// Applies one engine step and returns its plan: loads created since the previous plan,
    /// stores for chunks that became full, and the flush set of the single fence check.
    /// Everything is validated before anything changes.
    pub fn schedule<S: AsRef<str>>(&mut self, input: &StepInput<S>) -> Result<StepPlan> {
        // Validate.
        if input.scheduled.len() != input.computed.len() {
            return Err(Error::StepInputLength {
                scheduled: input.scheduled.len(),
                computed: input.computed.len(),
            });
        }
        let resumed = self.ids(&input.resumed)?;
        let finished = self.ids(&input.finished)?;
        let aborted = self.ids(&input.aborted)?;
        let preempted = self.ids(&input.preempted)?;
        for &i in &resumed {
            let r = self.req(i);
            if !matches!(r.status, Status::Preempted | Status::Running) {
                return Err(Self::state_err(
                    &r.id,
                    r.status,
                    "only a preempted request resumes",
                ));
            }
        }
        // A request is released at most once per step, and a released request is not
        // scheduled in the same step.
        let released: Vec<u32> = finished
            .iter()
            .chain(&aborted)
            .chain(&preempted)
            .copied()
            .collect();
        if let Some(i) = self.first_repeated_req(released.iter().copied()) {
            return Err(Error::RequestState {
                request: self.req(i).id.clone(),
                reason: "is listed twice among finished, aborted and preempted in one step".into(),
            });
        }
        let live = |s: &Self, i: u32| s.req(i).status == Status::Running || resumed.contains(&i);
        let mut scheduled = Vec::with_capacity(input.scheduled.len());
        for (id, computed) in input.scheduled.iter().zip(&input.computed) {
            let id = id.as_ref();
            let i = self.idx(id)?;
            if !live(self, i) {
                let r = self.req(i);
                return Err(Self::state_err(
                    id,
                    r.status,
                    "allocate it before scheduling it",
                ));
            }
            scheduled.push((i, *computed));
        }
        let ids = scheduled
            .iter()
            .map(|(i, _)| *i)
            .chain(released.iter().copied());
        if let Some(i) = self.first_repeated_req(ids) {
            let id = self.req(i).id.clone();
            return Err(Error::RequestState {
                reason: if released.contains(&i) {
                    "is scheduled and released (finished, aborted or preempted) in one step".into()
                } else {
                    "is scheduled twice in one step".into()
                },
                request: id,
            });
        }
        let mut new_blocks = Vec::with_capacity(input.new_blocks.len());
        for (id, g, blocks) in &input.new_blocks {
            let id = id.as_ref();
            let i = self.idx(id)?;
            if *g as usize >= self.cfg.groups.len() {
                return Err(Error::RequestState {
                    request: id.to_owned(),
                    reason: format!(
                        "got blocks for group {g}, but the engine has {} KV groups",
                        self.cfg.groups.len()
                    ),
                });
            }
            if !live(self, i) {
                let r = self.req(i);
                return Err(Self::state_err(
                    id,
                    r.status,
                    "only running requests get blocks",
                ));
            }
            new_blocks.push((i, *g as usize, self.engine_blocks(blocks)?));
        }
        let fresh = new_blocks.iter().flat_map(|(_, _, b)| b.iter().copied());
        if let Some(b) = self.first_repeated(fresh) {
            let (i, _, _) = new_blocks
                .iter()
                .find(|(_, _, bl)| bl.contains(&b))
                .expect("a repeated block was given");
            return Err(Error::RequestState {
                request: self.req(*i).id.clone(),
                reason: format!(
                    "got block {b}, which this step allocates twice; a block holds one position"
                ),
            });
        }
        for &i in finished.iter().chain(&aborted) {
            let r = self.req(i);
            if matches!(r.status, Status::Finished | Status::Aborted) {
                return Err(Self::state_err(&r.id, r.status, "it cannot finish again"));
            }
        }
        for &i in &preempted {
            let r = self.req(i);
            if !matches!(r.status, Status::Running | Status::Preempted) {
                return Err(Self::state_err(
                    &r.id,
                    r.status,
                    "only running requests are preempted",
                ));
            }
        }
        let explicit = match &input.written {
            Some(w) => Some(self.engine_blocks(w)?),
            None => None,
        };

        // Apply. 1: releases arm their requests' deferred fence pairs.
        self.step += 1;
        self.stats.steps += 1;
        for (list, status) in [
            (&finished, Status::Finished),
            (&aborted, Status::Aborted),
            (&preempted, Status::Preempted),
        ] {
            for &i in list {
                let r = self.req_mut(i);
                r.status = status;
                let owner = r.owner;
                self.tracker.release(owner);
            }
        }
        let written: Vec<BlockId> = if let Some(w) = explicit {
            w.into_iter().filter(|b| *b != BlockId::NULL).collect()
        } else {
            let mut w = std::mem::take(&mut self.allocated);
            for (_, _, blocks) in &new_blocks {
                w.extend(blocks.iter().filter(|b| **b != BlockId::NULL));
            }
            w
        };
        self.allocated.clear();
        // 2: stores of released requests read their blocks as they are before this step's
        // re-allocations; armed at creation, the fence check flushes them if need be.
        let mut retry = std::mem::take(&mut self.retry);
        let mut stores = Vec::new();
        let mut work = released;
        work.extend(retry.iter().copied().filter(|i| {
            self.reqs[*i as usize]
                .as_ref()
                .is_some_and(|r| r.status != Status::Running)
        }));
        self.plan_all(&work, &mut stores);
        // 3: re-allocations drop the positions whose content they replace.
        for b in std::mem::take(&mut self.reallocated) {
            self.invalidate(b);
        }
        for (_, _, blocks) in &new_blocks {
            for b in blocks {
                self.invalidate(*b);
            }
        }
        for &i in &resumed {
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
        for (i, g, blocks) in new_blocks {
            let rg = &mut self.req_mut(i).groups[g];
            let start = rg.blocks.len() as u32;
            let from = start.max(rg.cursor * bpc);
            rg.blocks.extend_from_slice(&blocks);
            for (k, b) in blocks.iter().enumerate() {
                let pos = start + k as u32;
                if *b != BlockId::NULL && pos >= from {
                    self.pending_assign.push((i, g as u32, pos));
                }
            }
        }
        for (i, g, pos) in std::mem::take(&mut self.pending_assign) {
            self.assign(i, g, pos);
        }
        // 4: stores of running requests, for chunks this step's forward pass completes.
        let released_stores = stores.len();
        work.clear();
        for (i, computed) in scheduled {
            self.req_mut(i).computed = computed;
            work.push(i);
        }
        retry.retain(|i| {
            self.reqs[*i as usize]
                .as_ref()
                .is_some_and(|r| r.status == Status::Running)
        });
        work.append(&mut retry);
        self.plan_all(&work, &mut stores);
        // 5: the single fence check, after this step's stores exist. Neither a store of step 4
        // (it runs after this step's forward pass) nor a load of this plan (it writes its own
        // blocks) is flushed by the step that creates it.
        let mut flush = Vec::new();
        self.tracker
            .check_into(&written, &mut flush)
            .expect("written blocks validated");
        if !flush.is_empty() {
            let first_running = stores.get(released_stores).map(|j| j.id);
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
        if input.written.is_some() {
            self.stats.flushes_necessary += n;
        } else {
            self.stats.flushes_conservative += n;
        }
        if !self.reset_flush.is_empty() {
            flush.append(&mut self.reset_flush);
            flush.sort_unstable();
            flush.dedup();
        }
        Ok(StepPlan {
            loads: std::mem::take(&mut self.new_loads),
            stores,
            flush,
        })
    }
}
