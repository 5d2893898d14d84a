//! Read-only views of the scheduler for engines and tests: counters, pools, pending jobs, the
//! fence's size, request status and sizes; and the pools' events (and whether they are
//! recorded).

use crate::error::Result;
use crate::ids::JobId;
use crate::jobs::JobStats;
use crate::pool::Pool;
use crate::tracker::FenceStats;

use super::handle::RequestRef;
use super::plan::{SchedulerEvent, SchedulerStats};
use super::requests::Status;
use super::Scheduler;

impl Scheduler {
    /// Drains the CPU pools' events (stored / removed keys, per group).
    pub fn take_events(&mut self) -> Vec<SchedulerEvent> {
        let mut out = Vec::new();
        for (g, p) in self.pools.iter_mut().enumerate() {
            out.extend(p.take_events().into_iter().map(|e| SchedulerEvent {
                kind: e.kind,
                group: g as u32,
                keys: e.keys,
            }));
        }
        out
    }

    /// Counters.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// The CPU pool of group `g`.
    pub fn pool(&self, g: usize) -> Option<&Pool> {
        self.pools.get(g)
    }

    /// Ids of pending jobs, in creation order.
    pub fn pending_jobs(&self) -> Vec<JobId> {
        self.tracker.jobs().pending_ids().collect()
    }

    /// How many jobs are pending.
    pub fn num_pending(&self) -> usize {
        self.tracker.jobs().len()
    }

    /// Armed `(block, job)` pairs in the fence.
    pub fn armed_pairs(&self) -> usize {
        self.tracker.fence().armed_pairs()
    }

    /// Job and fence counters.
    pub fn tracker_stats(&self) -> (JobStats, FenceStats) {
        (self.tracker.job_stats(), self.tracker.fence_stats())
    }

    /// Number of tracked requests.
    pub fn num_requests(&self) -> usize {
        self.index.len()
    }

    /// Status of a request.
    pub fn status(&self, id: &str) -> Result<Status> {
        Ok(self.req(self.idx(id)?).status)
    }

    /// Number of requests with a pending load.
    pub fn loading_requests(&self) -> u32 {
        self.loading_requests
    }

    /// The engine step counter (number of `schedule` calls).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Number of chained hashes request `id` holds (an engine appends only the ones beyond).
    pub fn num_hashes<R: RequestRef + ?Sized>(&self, id: &R) -> Result<usize> {
        Ok(self.req(self.idx_of(id)?).hashes.len())
    }

    /// Length of request `id`'s block table in group `g` (0 for a group it has no table in).
    pub fn table_len<R: RequestRef + ?Sized>(&self, id: &R, g: usize) -> Result<usize> {
        Ok(self
            .req(self.idx_of(id)?)
            .groups
            .get(g)
            .map_or(0, |t| t.blocks.len()))
    }

    /// Bounds every pool's and lower tier's event queue to `limit` keys; 0 records no
    /// events (an engine that publishes no KV events).
    pub fn set_event_limit(&mut self, limit: usize) {
        for p in &mut self.pools {
            p.set_event_limit(limit);
        }
        for t in self.tiers.iter_mut().flatten() {
            t.index.set_event_limit(limit);
        }
    }
}
