//! Lower tiers (DESIGN.md §9): write-behind and promotion jobs between the CPU pool and a
//! [`TierIndex`] per KV group (the disk tier; Redis later).
//!
//! - *Write-behind*: when a store job completes and its chunks become ready in the CPU pool,
//!   the keys the tier does not hold yet get places ([`TierIndex::prepare_write`]) and their CPU
//!   slots are pinned (so no eviction reuses them while a worker reads them); one
//!   [`TierJobKind::Write`] job per group goes into the next plan. When every rank reported it,
//!   the slots are unpinned and the tier publishes the keys (or drops them if any rank failed).
//!   Eviction from the CPU pool never writes.
//! - *Promotion*: a request's first lookup (per admission) whose leading chunks are neither ready nor being stored in the CPU
//!   pool but ready in the tier reserves CPU slots for them (storing: not readable), pins them in
//!   the tier ([`TierIndex::prepare_read`]), emits a [`TierJobKind::Promote`] job and answers
//!   "ask later". Other requests needing the same chunks see them as being stored and wait for
//!   this one promotion (no second copy, no convoy: nothing waits for work started later). Once
//!   every rank read and verified its bytes, the CPU slots are published and the normal load
//!   follows; if any rank failed, the CPU slots are dropped, the tier forgets the keys (a rank
//!   that found bad bytes quarantined its slot) and the request recomputes.
//!
//! Tier jobs have job ids from the same table as loads and stores (workers report them the
//! same way, per rank) under one owner of their own, and touch no GPU block, so the fence never
//! sees them. A reset flushes them like every pending job; their tier state is released then.

use std::path::Path;

use crate::error::{Error, Result};
use crate::ids::{JobId, Key, OwnerId};
use crate::pool::KeyState;
use crate::tier::disk::{engine_namespace, scan_namespace, DiskIndex, SlabLayout};
use crate::tier::{Location, TierEvent, TierIndex, TierStats};

use super::lookup::prefix_counts;
use super::requests::Request;
use super::{JobPayload, Scheduler};

/// The owner of every tier job (request owners count up from 0 and never get here).
pub(super) const TIER_OWNER: OwnerId = OwnerId(u64::MAX);
/// The request slab index of tier jobs' payloads (none).
pub(super) const NO_REQUEST: u32 = u32::MAX;

/// Direction of a tier job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TierJobKind {
    /// CPU slots → tier (write-behind).
    Write,
    /// Tier → CPU slots (promotion).
    Promote,
}

impl TierJobKind {
    /// `"write"` or `"promote"`.
    pub fn name(self) -> &'static str {
        match self {
            TierJobKind::Write => "write",
            TierJobKind::Promote => "promote",
        }
    }
}

/// One tier job of a plan: the worker moves chunk `keys[i]` between CPU slot `cpu_slots[i]`
/// and tier location `locations[i]`, verifying every promoted chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierJob {
    /// Job id (report it like a load or a store).
    pub id: JobId,
    /// Write-behind or promotion.
    pub kind: TierJobKind,
    /// The tier's medium (`"disk"`).
    pub medium: &'static str,
    /// KV group.
    pub group: u32,
    /// Chunk keys.
    pub keys: Vec<Key>,
    /// CPU pool slot of each key.
    pub cpu_slots: Vec<u32>,
    /// Tier location of each key.
    pub locations: Vec<Location>,
}

/// Counters of one group's tier as the scheduler sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierGroupStats {
    /// KV group.
    pub group: u32,
    /// The tier's medium (`"disk"`, `"remote"`).
    pub medium: &'static str,
    /// The tier's own counters.
    pub tier: TierStats,
    /// Write-behind jobs created.
    pub write_jobs: u64,
    /// Promotion jobs created.
    pub promote_jobs: u64,
    /// Promotion jobs that failed on some rank.
    pub failed_promotions: u64,
    /// Write-behind jobs that failed on some rank.
    pub failed_writes: u64,
    /// Promotions skipped because the CPU pool had no evictable room.
    pub promote_no_room: u64,
    /// Tier jobs pending now (queue depth).
    pub pending: u64,
    /// Chunks being promoted now (at most half the CPU pool).
    pub promoting: u64,
    /// Tokens lookups answered from chunks promoted from this tier.
    pub promoted_chunks: u64,
}

/// One group's tier and its counters.
#[derive(Debug)]
pub(super) struct GroupTier {
    pub(super) index: Box<dyn TierIndex>,
    pub(super) stats: TierGroupStats,
}

impl Scheduler {
    /// Attaches a lower tier to KV group `group` (before the first request is added). Chunks
    /// become readable through it only by promotion into the CPU pool.
    pub fn attach_tier(&mut self, group: u32, index: Box<dyn TierIndex>) -> Result<()> {
        let g = group as usize;
        if g >= self.cfg.groups.len() {
            return Err(Error::Config(format!(
                "attach_tier: group {group} does not exist, the scheduler has {} groups",
                self.cfg.groups.len()
            )));
        }
        if !self.index.is_empty() || !self.tracker.jobs().is_empty() {
            return Err(Error::Config(format!(
                "attach_tier: group {group}: attach tiers before the first request"
            )));
        }
        self.tiers.resize_with(self.cfg.groups.len(), || None);
        self.tiers[g] = Some(GroupTier {
            index,
            stats: TierGroupStats {
                group,
                ..TierGroupStats::default()
            },
        });
        Ok(())
    }

    /// Attaches a disk tier under `root` to every group: `disk_bytes` per group and worker,
    /// namespaces from `model` and the configuration ([`engine_namespace`]), each index rebuilt
    /// from every rank's headers. All or nothing.
    pub fn attach_disk(&mut self, root: &Path, disk_bytes: u64, model: &str) -> Result<()> {
        let cfg = &self.cfg;
        let mut indexes = Vec::with_capacity(cfg.groups.len());
        for (g, gc) in cfg.groups.iter().enumerate() {
            if gc.bytes_per_chunk == 0 {
                return Err(Error::Config(format!(
                    "disk tier: group {g} has bytes_per_chunk=0; the disk tier needs the size of \
                     a chunk"
                )));
            }
            let layout = SlabLayout::new(gc.bytes_per_chunk, disk_bytes)?;
            let scans = (0..cfg.num_workers)
                .map(|rank| {
                    let ns = engine_namespace(
                        model,
                        gc.bytes_per_chunk,
                        gc.block_size,
                        cfg.blocks_per_chunk,
                        rank,
                        cfg.num_workers,
                        g as u32,
                    );
                    scan_namespace(root, &ns, layout)
                })
                .collect::<Result<Vec<_>>>()?;
            indexes.push(DiskIndex::recover(layout, cfg.policy, &scans)?);
        }
        if !self.index.is_empty() || !self.tracker.jobs().is_empty() {
            return Err(Error::Config(
                "attach_disk: attach tiers before the first request".into(),
            ));
        }
        for (g, idx) in indexes.into_iter().enumerate() {
            self.attach_tier(g as u32, Box::new(idx))?;
        }
        Ok(())
    }

    /// Whether any group has a lower tier.
    pub fn has_tiers(&self) -> bool {
        self.tiers.iter().any(Option::is_some)
    }

    /// Per group with a tier: its counters.
    pub fn tier_stats(&self) -> Vec<TierGroupStats> {
        self.tiers
            .iter()
            .flatten()
            .map(|t| {
                let mut s = t.stats;
                s.tier = t.index.stats();
                s.medium = t.index.medium();
                s
            })
            .collect()
    }

    /// Drains every tier's events, with their group.
    pub fn take_tier_events(&mut self) -> Vec<(u32, TierEvent)> {
        let mut out = Vec::new();
        for (g, t) in self.tiers.iter_mut().enumerate() {
            if let Some(t) = t {
                out.extend(t.index.take_events().into_iter().map(|e| (g as u32, e)));
            }
        }
        out
    }

    /// Creates promotion jobs that take `r` beyond `end` (the end its ready CPU chunks reach
    /// from the engine's hit `hit`, 0 if none): the highest end point at which every group's
    /// needed chunks are in the CPU pool or ready in its tier, and for it exactly the needed
    /// chunks the CPU pool lacks (a sliding-window group: the window before that end point,
    /// not before the prompt's end). Returns whether a job was created, and whether a tier's
    /// answer about them is still pending (either: ask later).
    pub(super) fn promote(&mut self, r: &Request, hit: u32, end: u32) -> (bool, bool) {
        if !self.has_tiers() {
            return (false, false);
        }
        let cap = self.lookup_cap(r);
        let from = hit.max(end);
        if cap <= from || cap - from < self.align {
            return (false, false);
        }
        let groups = self.cfg.groups.len();
        let mut counts = Vec::with_capacity(groups);
        let mut pending = false;
        for g in 0..groups {
            let keys = self.chunk_keys(r, g, hit, cap);
            let pool = &self.pools[g];
            let Some(tier) = self.tiers.get_mut(g).and_then(Option::as_mut) else {
                counts.push(prefix_counts(&keys, |k| pool.state(k) != KeyState::Absent));
                continue;
            };
            // A remote tier answers asynchronously: while it is asked, the request asks later.
            let missing: Vec<Key> = keys
                .iter()
                .copied()
                .filter(|&k| pool.state(k) == KeyState::Absent)
                .collect();
            pending |= tier.index.prefetch(&missing);
            let index = &tier.index;
            counts.push(prefix_counts(&keys, |k| {
                pool.state(k) != KeyState::Absent
                    || matches!(index.state(k), KeyState::Ready { .. })
            }));
        }
        if pending {
            return (false, true);
        }
        // Promotions in flight hold at most half of each group's CPU pool: they must not
        // evict what they promote before it is loaded. Without room now, the request asks
        // again later (promotions in flight finish within a few steps).
        let limit = (self.cfg.cpu_chunks as usize / 2).max(1);
        let room: Vec<usize> = (0..groups)
            .map(|g| {
                let promoting = self.tiers[g].as_ref().map_or(0, |t| t.stats.promoting);
                limit.saturating_sub(promoting as usize)
            })
            .collect();
        let mut p = self.best_end(&counts, hit, cap);
        let mut full = false;
        let wants = loop {
            if p <= from {
                return (false, full);
            }
            let wants: Vec<Vec<Key>> = (0..groups)
                .map(|g| {
                    self.needed_keys(r, g, hit, p)
                        .into_iter()
                        .filter(|&k| self.pools[g].state(k) == KeyState::Absent)
                        .collect()
                })
                .collect();
            let short: Vec<usize> = (0..groups).filter(|&g| wants[g].len() > room[g]).collect();
            if short.is_empty() {
                break wants;
            }
            // Waiting helps only where promotions in flight hold the room.
            full |= short.iter().any(|&g| room[g] < limit);
            p = self.best_end(&counts, hit, p - self.align);
        };
        let mut created = false;
        for (g, want) in wants.into_iter().enumerate() {
            if want.is_empty() {
                continue;
            }
            let tier = self.tiers[g]
                .as_mut()
                .expect("only a group with a tier has chunks the CPU pool lacks at p");
            tier.index.lookup(&want);
            let Some(plan) = self.pools[g].prepare_store(&want) else {
                tier.stats.promote_no_room += 1;
                continue;
            };
            if plan.keys.is_empty() {
                continue;
            }
            let locations = tier
                .index
                .prepare_read(&plan.keys)
                .expect("ready keys, not pinned by this call");
            let job = self.tracker.create_unfenced(
                TIER_OWNER,
                JobPayload::tier(TierJobKind::Promote, g as u32, plan.keys.clone()),
            );
            tier.stats.promote_jobs += 1;
            tier.stats.pending += 1;
            tier.stats.promoting += plan.keys.len() as u64;
            self.new_tier_jobs.push(TierJob {
                id: job,
                kind: TierJobKind::Promote,
                medium: tier.index.medium(),
                group: g as u32,
                keys: plan.keys,
                cpu_slots: plan.slots.iter().map(|s| s.0).collect(),
                locations,
            });
            created = true;
        }
        (created, false)
    }

    /// Write-behind of `keys` of group `g`, just published in the CPU pool.
    pub(super) fn write_behind(&mut self, g: usize, keys: &[Key]) {
        let Some(Some(tier)) = self.tiers.get_mut(g) else {
            return;
        };
        let Some(plan) = tier.index.prepare_write(keys) else {
            return;
        };
        if plan.keys.is_empty() {
            return;
        }
        let slots = self.pools[g]
            .prepare_load(&plan.keys)
            .expect("keys just published in the CPU pool");
        let job = self.tracker.create_unfenced(
            TIER_OWNER,
            JobPayload::tier(TierJobKind::Write, g as u32, plan.keys.clone()),
        );
        tier.stats.write_jobs += 1;
        tier.stats.pending += 1;
        self.new_tier_jobs.push(TierJob {
            id: job,
            kind: TierJobKind::Write,
            medium: tier.index.medium(),
            group: g as u32,
            keys: plan.keys,
            cpu_slots: slots.iter().map(|s| s.0).collect(),
            locations: plan.locations,
        });
    }

    /// Applies a tier job every rank reported (`ok`: all succeeded).
    pub(super) fn complete_tier(&mut self, kind: TierJobKind, g: usize, keys: &[Key], ok: bool) {
        let tier = self.tiers[g]
            .as_mut()
            .expect("tier jobs exist only for tiers");
        tier.stats.pending -= 1;
        let pool = &mut self.pools[g];
        match kind {
            TierJobKind::Write => {
                let unpinned = pool.complete_load(keys);
                debug_assert!(unpinned.is_ok(), "{unpinned:?}");
                let done = tier.index.complete_write(keys, ok);
                debug_assert!(done.is_ok(), "{done:?}");
                tier.stats.failed_writes += u64::from(!ok);
            }
            TierJobKind::Promote => {
                tier.stats.promoting -= keys.len() as u64;
                let published = pool.complete_store(keys, ok);
                debug_assert!(published.is_ok(), "{published:?}");
                // A failed promotion drops its keys from the tier: bad bytes were quarantined
                // by the rank that found them, and a persistent I/O fault must not loop.
                let bad: &[Key] = if ok { &[] } else { keys };
                let done = tier.index.complete_read(keys, bad);
                debug_assert!(done.is_ok(), "{done:?}");
                tier.stats.failed_promotions += u64::from(!ok);
                if ok {
                    tier.stats.promoted_chunks += keys.len() as u64;
                }
            }
        }
    }

    /// A reset flushed tier job `kind` of group `g`: its tier state is released (a write
    /// counts as failed, a promotion's pins go; the CPU pool was emptied anyway).
    pub(super) fn reset_tier_job(&mut self, kind: TierJobKind, g: usize, keys: &[Key]) {
        let tier = self.tiers[g]
            .as_mut()
            .expect("tier jobs exist only for tiers");
        tier.stats.pending -= 1;
        let done = match kind {
            TierJobKind::Write => tier.index.complete_write(keys, false),
            TierJobKind::Promote => {
                tier.stats.promoting -= keys.len() as u64;
                tier.index.complete_read(keys, &[])
            }
        };
        debug_assert!(done.is_ok(), "{done:?}");
    }
}
