//! Reset: every pending job is flushed, the CPU tier emptied, finished requests dropped and
//! running requests restart their store cursors from the blocks they still hold.

use crate::ids::JobId;

use super::requests::Status;
use super::Scheduler;

impl Scheduler {
    /// Forgets every pending job and empties the CPU tier. Returns the pending jobs that were
    /// handed to workers in a plan (the next plan's flush set holds them too; their late
    /// reports are ignored; a load created but not planned yet is never handed out) and the
    /// requests whose load was cancelled (the engine must recompute those tokens). Running
    /// requests restart their store cursors: their chunks are stored again from the blocks
    /// they still hold. Finished and aborted requests are dropped; preempted ones store again
    /// once resumed.
    pub fn reset(&mut self) -> (Vec<JobId>, Vec<(String, JobId)>) {
        let pending = self.tracker.reset();
        for j in &pending {
            if let Some(tier) = j.payload.tier {
                let t = &j.payload.transfers[0];
                self.reset_tier_job(j.id, tier, t.group as usize, &t.keys);
            }
        }
        // Tier jobs not handed out in a plan yet are flushed like the others (a worker that
        // never saw them has nothing to wait for).
        self.new_tier_jobs.clear();
        // Loads not handed out in a plan yet never reach a worker: cancelled, never flushed.
        let unplanned: Vec<JobId> = self.new_loads.drain(..).map(|j| j.id).collect();
        let flushed: Vec<JobId> = pending
            .iter()
            .map(|j| j.id)
            .filter(|j| !unplanned.contains(j))
            .collect();
        self.stats.flushes_reset += flushed.len() as u64;
        self.stats.resets += 1;
        // Tier jobs leave the copy flush set for the plan's `tier_flush`: workers wait for them
        // on their tier worker, not the data plane.
        for j in &pending {
            if unplanned.contains(&j.id) {
                continue;
            }
            if j.payload.tier.is_some() {
                self.reset_tier_flush.push(j.id);
            } else {
                self.reset_flush.push(j.id);
            }
        }
        for p in &mut self.pools {
            p.reset();
        }
        self.loading_requests = 0;
        self.retry.clear();
        self.pending_assign.clear();
        self.pos_index.clear();
        let mut cancelled = Vec::new();
        let bpc = self.cfg.blocks_per_chunk;
        for i in 0..self.reqs.len() as u32 {
            let Some(r) = self.reqs[i as usize].as_mut() else {
                continue;
            };
            let job = std::mem::replace(&mut r.load, JobId::NONE);
            if job != JobId::NONE {
                cancelled.push((r.id.clone(), job));
            }
            r.first_ask = None;
            r.tier_pending = false;
            r.wait_on.clear();
            r.lookup = None;
            r.store_due = 0;
            match r.status {
                Status::Finished | Status::Aborted => {
                    let id = r.id.clone();
                    self.index.remove(&id);
                    self.reqs[i as usize] = None;
                    self.free.push(i);
                }
                Status::Preempted | Status::Waiting => {
                    for g in &mut r.groups {
                        g.blocks.clear();
                        g.cursor = 0;
                    }
                }
                Status::Running => {
                    let computed = r.computed;
                    for (g, rg) in r.groups.iter_mut().enumerate() {
                        let ct = self.cfg.groups[g].block_size * bpc;
                        rg.cursor = match self.cfg.groups[g].sliding_window {
                            None => 0,
                            Some(w) => computed.saturating_sub(w).div_ceil(ct),
                        };
                    }
                    for g in 0..self.cfg.groups.len() {
                        let r = self.req(i);
                        let from = r.groups[g].cursor * bpc;
                        let n = r.groups[g].blocks.len() as u32;
                        for pos in from..n {
                            self.assign(i, g as u32, pos);
                        }
                    }
                }
            }
        }
        cancelled.sort_unstable_by_key(|(_, j)| *j);
        (flushed, cancelled)
    }
}
