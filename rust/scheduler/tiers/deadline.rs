//! Deadlines and probation of the disk tier's jobs, as the scheduler sees them.
//!
//! - *Deadline*: a disk promotion not completed [`DiskWatch::deadline`] after its plan
//!   expires ([`Scheduler::expire_tier_jobs`], run by every lookup). Its keys leave the CPU
//!   pool's index at once, so the requests waiting for them stop asking later and recompute;
//!   but its CPU slots stay *held* (not free, never reused: [`Pool::hold`]) because the
//!   worker's I/O thread may still write into them. Its disk entries stay pinned and are not
//!   promoted again meanwhile. When the late report arrives, the held slots are freed and
//!   nothing is published, whatever the report says; a late failure drops the keys from the
//!   tier, a late success only unpins them.
//! - *Probation* ([`Health`], shared with the Redis client): failed or expired jobs put the
//!   tier on probation; meanwhile chunks are not written behind (counted in
//!   [`TierGroupStats::dropped_writes`]) and lookups skip the tier (counted in
//!   [`TierGroupStats::skipped_lookups`]); the first job after it is the trial.
//!
//! [`DiskWatch::deadline`]: super::DiskWatch::deadline
//! [`Pool::hold`]: crate::pool::Pool::hold
//! [`Health`]: crate::tier::health::Health
//! [`TierGroupStats::dropped_writes`]: super::TierGroupStats::dropped_writes
//! [`TierGroupStats::skipped_lookups`]: super::TierGroupStats::skipped_lookups

use std::time::Instant;

use crate::ids::{JobId, Key, SlotId};

use super::GroupTier;
use crate::scheduler::Scheduler;

impl GroupTier {
    /// Whether the tier takes a job now (not on probation, or this is the trial).
    pub(in crate::scheduler) fn admit(&mut self, now: Instant) -> bool {
        self.health.as_mut().is_none_or(|h| h.admit(now))
    }

    /// Records the outcome of one of the tier's jobs in its health.
    pub(in crate::scheduler) fn record(&mut self, ok: bool) {
        if let Some(h) = self.health.as_mut() {
            h.record(ok, Instant::now());
        }
    }
}

impl Scheduler {
    /// Expires every promotion past its deadline (see the module documentation).
    pub(in crate::scheduler) fn expire_tier_jobs(&mut self) {
        if !self.tiers.iter().flatten().any(|t| !t.deadlines.is_empty()) {
            return;
        }
        self.expire_tier_jobs_at(Instant::now());
    }

    /// [`Scheduler::expire_tier_jobs`] as of `now`.
    fn expire_tier_jobs_at(&mut self, now: Instant) {
        for g in 0..self.tiers.len() {
            for ti in 0..self.tiers[g].len() {
                while let Some(&(at, job)) = self.tiers[g][ti].deadlines.front() {
                    if at > now {
                        break;
                    }
                    self.tiers[g][ti].deadlines.pop_front();
                    if self.tiers[g][ti].is_pending(job) {
                        self.expire(g, ti, job, now);
                    }
                }
            }
        }
    }

    /// Expires promotion `job` of group `g`'s tier `ti`: its keys leave the CPU pool's index,
    /// its slots stay held until its report.
    fn expire(&mut self, g: usize, ti: usize, job: JobId, now: Instant) {
        let Some(keys) = self
            .tracker
            .jobs()
            .get(job)
            .map(|j| j.payload.transfers[0].keys.clone())
        else {
            return;
        };
        let held = self.pools[g].hold(&keys);
        debug_assert!(held.is_ok(), "{held:?}");
        let Ok(slots) = held else { return };
        let tier = &mut self.tiers[g][ti];
        tier.stats.expired_promotions += 1;
        tier.stats.held_slots += slots.len() as u64;
        tier.stuck.extend(keys.iter().copied());
        tier.held.insert(job, slots);
        if let Some(h) = tier.health.as_mut() {
            h.record(false, now);
        }
    }
}

impl GroupTier {
    /// Ends the hold of expired promotion `job` of `keys`, if it expired: returns the CPU
    /// slots it held.
    pub(in crate::scheduler) fn end_hold(
        &mut self,
        job: JobId,
        keys: &[Key],
    ) -> Option<Vec<SlotId>> {
        let slots = self.held.remove(&job)?;
        self.stats.held_slots -= slots.len() as u64;
        for k in keys {
            self.stuck.remove(k);
        }
        Some(slots)
    }

    /// Applies the report of promotion `job` of `keys` if it expired (its counters already
    /// ended by the caller): publishes nothing and returns the CPU slots it held, for the caller
    /// to free. `None`: the job did not expire (only promotions expire).
    pub(in crate::scheduler) fn complete_late(
        &mut self,
        job: JobId,
        keys: &[Key],
        ok: bool,
    ) -> Option<Vec<SlotId>> {
        let slots = self.end_hold(job, keys)?;
        self.stats.late_reports += 1;
        self.end_promotion(keys, ok);
        Some(slots)
    }

    /// Whether tier job `job` is pending and has not expired.
    fn is_pending(&self, job: JobId) -> bool {
        self.started.contains_key(&job) && !self.held.contains_key(&job)
    }
}
