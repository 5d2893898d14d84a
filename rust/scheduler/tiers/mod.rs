//! Lower tiers (DESIGN.md §9): write-behind and promotion jobs between the CPU pool and the
//! [`TierIndex`]es of each KV group: a disk tier, a shared (Redis) tier, or both, nearest
//! first (local before shared).
//!
//! - *Write-behind*: when a store job completes and its chunks become ready in the CPU pool,
//!   each tier whose [`TierAdmission`] lets them through gives places to the keys it does not
//!   hold yet ([`TierIndex::prepare_write`]) and their CPU slots are pinned (so no eviction
//!   reuses them while a worker reads them); one [`TierJobKind::Write`] job per group and tier
//!   goes into the next plan. When every rank reported it, the slots are unpinned and the tier
//!   publishes the keys (or drops them if any rank failed). Eviction from the CPU pool never
//!   writes. A tier admitting on reuse (`min_hits > 0`) gets a chunk when its loads from the
//!   CPU pool reach that count; chunks promoted from one tier go to the others that lack them.
//! - *Promotion*: a request's first lookup (per admission) whose leading chunks are neither
//!   ready nor being stored in the CPU pool but ready in a tier reserves CPU slots for them
//!   (storing: not readable), pins each in the nearest tier holding it
//!   ([`TierIndex::prepare_read`]), emits one [`TierJobKind::Promote`] job per tier and answers
//!   "ask later". Every tier is asked only about the chunks the nearer ones lack; while a shared
//!   tier's answer is pending, the request asks later. Other requests needing the same chunks
//!   see them as being stored and wait for this one promotion (no second copy, no convoy:
//!   nothing waits for work started later). Once every rank read and verified its bytes, the
//!   CPU slots are published and the normal load follows; if any rank failed, the CPU slots
//!   are dropped, the tier forgets the keys (a rank that found bad bytes quarantined its slot)
//!   and the request recomputes.
//!
//! Tier jobs have job ids from the same table as loads and stores (workers report them the
//! same way, per rank; a worker runs the jobs of its tier's medium) under one owner of their
//! own, and touch no GPU block, so the fence never sees them. A reset flushes them like every
//! pending job; their tier state is released then. Per tier, the scheduler counts jobs, queue
//! depth and the time from a job's plan to its completion ([`TierGroupStats`]).
//!
//! How a promotion chooses its chunks and bounds the CPU room it holds (beyond DESIGN.md §9):
//! `docs/design-notes.md`.
//!
//! Files: this one the tier jobs (write-behind, promotion, completion); `attach.rs`
//! attaching tiers; `deadline.rs` the disk tier's promotion deadline and probation.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rustc_hash::{FxHashMap, FxHashSet};

use crate::ids::{JobId, Key, OwnerId, SlotId};
use crate::pool::KeyState;
use crate::tier::health::Health;
use crate::tier::{Location, Medium, TierEvent, TierIndex, TierStats};

mod attach;
mod deadline;

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
    /// The tier's medium.
    pub medium: Medium,
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
    /// The tier's medium.
    pub medium: Medium,
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
    /// Most tier jobs pending at once so far (peak queue depth).
    pub max_pending: u64,
    /// Chunks being promoted from this tier now (a group's tiers together: at most half its
    /// CPU pool).
    pub promoting: u64,
    /// Chunks promoted from this tier and published in the CPU pool.
    pub promoted_chunks: u64,
    /// Microseconds write-behind jobs took, summed: from their plan to the last rank's report
    /// (queueing on the workers, the I/O, and the report), completed jobs only.
    pub write_us: u64,
    /// Microseconds promotion jobs took, summed (as `write_us`).
    pub promote_us: u64,
    /// Promotions that missed their deadline (disk): their keys left the CPU pool's index at
    /// once (waiting requests recompute), their CPU slots stayed held until the late report.
    pub expired_promotions: u64,
    /// CPU slots held now for expired promotions whose report has not arrived.
    pub held_slots: u64,
    /// Reports of expired promotions (they publish nothing; their held slots are freed).
    pub late_reports: u64,
    /// Chunks not written behind because the tier was on probation (disk; the shared tier's
    /// client counts its own).
    pub dropped_writes: u64,
    /// Keys not looked up in the tier because it was on probation (disk) or behind (its
    /// write-behind pinned half its share of CPU slots or more: a promotion would queue
    /// behind those writes).
    pub skipped_lookups: u64,
    /// Chunks not written behind because write-behind jobs already pinned the group's share
    /// of CPU slots (`tier_write_share`): the tier did not keep up. A skipped chunk that is
    /// loaded from the CPU pool later is offered again.
    pub skipped_writes: u64,
    /// CPU slot pins held now by this tier's write-behind jobs (one per chunk).
    pub write_pinned: u64,
}

/// How the scheduler watches a disk tier's jobs: a promotion's deadline, and probation after
/// repeated failed or expired jobs ([`Health`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskWatch {
    /// Longest time from a promotion's plan to its last report; later, it expires.
    pub deadline: Duration,
    /// Consecutive failed or expired jobs that put the tier on probation.
    pub probation_after: u32,
    /// How long a probation lasts before the next trial.
    pub probation: Duration,
    /// Most bytes per second written behind to the tier (0: no limit); past it chunks are
    /// skipped like those past the write-behind bound (`skipped_writes`).
    pub write_bytes_per_s: u64,
}

impl Default for DiskWatch {
    /// A 5 s deadline ([`crate::config::DEFAULT_DISK_DEADLINE_MS`]); probation after 3 failed
    /// or expired jobs, for 5 s; no write rate limit.
    fn default() -> Self {
        Self {
            deadline: Duration::from_millis(crate::config::DEFAULT_DISK_DEADLINE_MS),
            probation_after: 3,
            probation: Duration::from_secs(5),
            write_bytes_per_s: 0,
        }
    }
}

/// A write-behind rate limit (`disk_write_mbps`): a token bucket of bytes, refilled at
/// `rate` per second up to a quarter of a second's worth (at least one chunk), full at first.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pacer {
    rate: f64,
    chunk: f64,
    burst: f64,
    credit: f64,
    last: Instant,
}

impl Pacer {
    /// A limit of `bytes_per_s` for chunks of `chunk` bytes.
    pub(super) fn new(bytes_per_s: u64, chunk: u64) -> Self {
        let (rate, chunk) = (bytes_per_s as f64, chunk as f64);
        let burst = (rate / 4.0).max(chunk);
        Self {
            rate,
            chunk,
            burst,
            credit: burst,
            last: Instant::now(),
        }
    }

    /// How many of `want` chunks may be written now (their bytes are taken from the bucket).
    fn take(&mut self, now: Instant, want: usize) -> usize {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.credit = (self.credit + dt * self.rate).min(self.burst);
        let n = ((self.credit / self.chunk) as usize).min(want);
        self.credit -= n as f64 * self.chunk;
        n
    }
}

/// Which chunks a tier admits for write-behind (DESIGN.md §9: an admission filter per tier).
///
/// `min_hits = 0` writes every chunk behind as soon as it is ready in the CPU pool (its store
/// completed). `min_hits = n > 0` writes a chunk behind when it has been *loaded* from the
/// CPU pool `n` times (counted per group and tier, since the tier was attached): only chunks
/// that were reused go down. That suits a shared tier: every chunk written there costs the
/// network and the server's memory for the whole fleet, and a chunk this engine never reused
/// (one user's last turn) is rarely reused by another engine, while a system prompt or a
/// document is reused at once. A local disk tier is cheap and private: it admits everything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierAdmission {
    /// Loads from the CPU pool a chunk needs before it is written behind (0: on store).
    pub min_hits: u32,
}

/// One tier of one group and its counters.
#[derive(Debug)]
pub(super) struct GroupTier {
    pub(super) index: Box<dyn TierIndex>,
    pub(super) stats: TierGroupStats,
    pub(super) admission: TierAdmission,
    /// Loads per key (with `admission.min_hits > 0`), cleared when it grows past
    /// [`HIT_COUNTS`] keys (counts are then recent ones).
    hits: FxHashMap<Key, u32>,
    /// When each pending job of this tier was created (its I/O time ends at completion).
    pub(super) started: FxHashMap<JobId, Instant>,
    /// Promotion deadline (disk tiers; `None`: the tier bounds its own operations).
    pub(super) deadline: Option<Duration>,
    /// Probation of the tier as its jobs show it (disk tiers; `None`: the tier keeps its own).
    pub(super) health: Option<Health>,
    /// `(deadline, job)` of promotions with a deadline, in creation order.
    pub(super) deadlines: VecDeque<(Instant, JobId)>,
    /// Expired promotions awaiting their report: the CPU slots they hold.
    pub(super) held: FxHashMap<JobId, Vec<SlotId>>,
    /// Keys of expired promotions awaiting their report: not promoted again meanwhile.
    pub(super) stuck: FxHashSet<Key>,
    /// Whether this tier is skipped by the promotion being planned (on probation).
    pub(super) skip: bool,
    /// Write-behind rate limit (disk tiers with `disk_write_mbps`).
    pub(super) pacer: Option<Pacer>,
}

impl GroupTier {
    /// Ends a promotion of `keys` in the tier's index. A failed one drops its keys from the
    /// tier: bad bytes were quarantined by the rank that found them, and a persistent I/O fault
    /// must not loop. A successful (or late) one leaves them there, unpinned.
    pub(super) fn end_promotion(&mut self, keys: &[Key], ok: bool) {
        self.stats.promoting -= keys.len() as u64;
        let bad: &[Key] = if ok { &[] } else { keys };
        let done = self.index.complete_read(keys, bad);
        debug_assert!(done.is_ok(), "{done:?}");
    }

    /// Tier `index` of group `group`, written behind to as `admission` says.
    pub(super) fn new(index: Box<dyn TierIndex>, group: u32, admission: TierAdmission) -> Self {
        Self {
            index,
            stats: TierGroupStats {
                group,
                ..TierGroupStats::default()
            },
            admission,
            hits: FxHashMap::default(),
            started: FxHashMap::default(),
            deadline: None,
            health: None,
            deadlines: VecDeque::new(),
            held: FxHashMap::default(),
            stuck: FxHashSet::default(),
            skip: false,
            pacer: None,
        }
    }
}

/// Most keys whose loads a tier with `min_hits > 0` counts at once.
const HIT_COUNTS: usize = 1 << 20;

/// Where a tier job belongs: its kind and its tier among its group's tiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TierRef {
    pub(super) kind: TierJobKind,
    pub(super) tier: u32,
}

impl Scheduler {
    /// Whether any group has a lower tier.
    pub fn has_tiers(&self) -> bool {
        self.tiers.iter().any(|ts| !ts.is_empty())
    }

    /// Per group and tier (groups in order, nearest tier first): its counters.
    pub fn tier_stats(&self) -> Vec<TierGroupStats> {
        self.tiers
            .iter()
            .flatten()
            .map(|t| {
                let mut s = t.stats;
                s.tier = t.index.stats();
                s.medium = t.index.medium();
                if let Some(h) = &t.health {
                    s.tier.probations = h.probations();
                    s.tier.recoveries = h.recoveries();
                    s.tier.skipped_checks = s.skipped_lookups;
                }
                s
            })
            .collect()
    }

    /// Drains every tier's events, with their group.
    pub fn take_tier_events(&mut self) -> Vec<(u32, TierEvent)> {
        let mut out = Vec::new();
        for (g, ts) in self.tiers.iter_mut().enumerate() {
            for t in ts {
                out.extend(t.index.take_events().into_iter().map(|e| (g as u32, e)));
            }
        }
        out
    }

    /// Creates promotion jobs that take `r` beyond `end` (the end its ready CPU chunks reach
    /// from the engine's hit `hit`, 0 if none): the highest end point at which every group's
    /// needed chunks are in the CPU pool or ready in one of its tiers, and for it exactly the
    /// needed chunks the CPU pool lacks (a sliding-window group: the window before that end
    /// point, not before the prompt's end), each from the nearest tier holding it. Returns
    /// whether a job was created, and whether a tier's answer about them is still pending or
    /// promotions in flight hold the CPU room they need (either: ask later).
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
        let now = Instant::now();
        // A tier whose write-behind holds half its room or more is behind: its queue is deep,
        // and a promotion would wait behind those writes, holding CPU room all that time (a
        // slow tier cost more hits that way than it gave). Lookups skip it, as on probation.
        let behind = u64::from(self.cfg.tier_write_slots / 2).max(1);
        for t in self.tiers.iter_mut().flatten() {
            t.skip = t.stats.write_pinned >= behind || !t.admit(now);
        }
        for g in 0..groups {
            let keys = self.chunk_keys(r, g, hit, cap);
            let pool = &self.pools[g];
            let tiers: &mut [GroupTier] = match self.tiers.get_mut(g) {
                Some(t) => t,
                None => &mut [],
            };
            // Each tier is asked about the chunks the CPU pool and the nearer tiers lack; a
            // remote tier answers asynchronously: while it is asked, the request asks later.
            let mut missing: Vec<Key> = keys
                .iter()
                .copied()
                .filter(|&k| pool.state(k) == KeyState::Absent)
                .collect();
            for t in tiers.iter_mut() {
                if t.skip {
                    t.stats.skipped_lookups += missing.len() as u64;
                    continue;
                }
                pending |= t.index.prefetch(&missing);
                missing.retain(|&k| !matches!(t.index.state(k), KeyState::Ready { .. }));
            }
            let tiers = &*tiers;
            counts.push(prefix_counts(&keys, |k| {
                pool.state(k) != KeyState::Absent || nearest(tiers, k).is_some()
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
                let promoting: u64 = self
                    .tiers
                    .get(g)
                    .map_or(0, |ts| ts.iter().map(|t| t.stats.promoting).sum());
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
            // Only a group with a tier has needed chunks the CPU pool lacks at `p`.
            let Some(plan) = self.pools[g].prepare_store(&want) else {
                let ti = nearest(&self.tiers[g], want[0]).expect("ready in a tier");
                self.tiers[g][ti].stats.promote_no_room += 1;
                continue;
            };
            for ti in 0..self.tiers[g].len() {
                let (keys, slots): (Vec<Key>, Vec<u32>) = plan
                    .keys
                    .iter()
                    .zip(&plan.slots)
                    .filter(|(k, _)| nearest(&self.tiers[g], **k) == Some(ti))
                    .map(|(k, s)| (*k, s.0))
                    .unzip();
                if keys.is_empty() {
                    continue;
                }
                let tier = &mut self.tiers[g][ti];
                tier.index.lookup(&keys);
                tier.stats.promoting += keys.len() as u64;
                let locations = tier
                    .index
                    .prepare_read(&keys)
                    .expect("ready keys, not pinned by this call");
                self.push_tier_job(TierJobKind::Promote, g, ti, keys, slots, locations);
                created = true;
            }
        }
        (created, false)
    }

    /// Creates tier job `kind` of group `g`'s tier `ti` and queues it for the next plan.
    fn push_tier_job(
        &mut self,
        kind: TierJobKind,
        g: usize,
        ti: usize,
        keys: Vec<Key>,
        cpu_slots: Vec<u32>,
        locations: Vec<Location>,
    ) {
        let job = self.tracker.create_unfenced(
            TIER_OWNER,
            JobPayload::tier(
                TierRef {
                    kind,
                    tier: ti as u32,
                },
                g as u32,
                keys.clone(),
            ),
        );
        let tier = &mut self.tiers[g][ti];
        match kind {
            TierJobKind::Write => tier.stats.write_jobs += 1,
            TierJobKind::Promote => tier.stats.promote_jobs += 1,
        }
        tier.stats.pending += 1;
        tier.stats.max_pending = tier.stats.max_pending.max(tier.stats.pending);
        let now = Instant::now();
        tier.started.insert(job, now);
        if let (TierJobKind::Promote, Some(d)) = (kind, tier.deadline) {
            tier.deadlines.push_back((now + d, job));
        }
        self.new_tier_jobs.push(TierJob {
            id: job,
            kind,
            medium: tier.index.medium(),
            group: g as u32,
            keys,
            cpu_slots,
            locations,
        });
    }

    /// Write-behind of `keys` of group `g`, just published in the CPU pool (`loaded`: just
    /// loaded from it instead), to every tier whose admission filter lets them through.
    ///
    /// Bounded (DESIGN.md §9, "a lower tier only ever adds"): the write-behind jobs of a
    /// group's tiers pin at most `tier_write_slots` CPU slots at once, so a tier that cannot
    /// keep up (slow, stuck, its I/O threads starved) takes at most that share of the CPU
    /// pool's room from the stores; past it a chunk is skipped (`skipped_writes`), never a
    /// store dropped. Which chunks get the room when it is scarce:
    ///
    /// - *Reused chunks first*: a fresh chunk (its store just completed) may take only half
    ///   of the room; a chunk loaded from the CPU pool (a hit, so likely hit again, e.g. a
    ///   system prompt or a document) may take all of it. A chunk skipped for lack of room is
    ///   offered again at its next load, so a slow tier ends up holding the reused chunks
    ///   rather than whichever were stored first. Chunks about to be evicted would be the
    ///   other candidate, but pinning them is exactly what keeps the pool from evicting them:
    ///   it costs the same room and favours chunks nobody asked for.
    /// - *Paced*: a disk tier with a write rate limit (`disk_write_mbps`) takes only what the
    ///   rate allows now; the rest is skipped the same way.
    /// - *Prefix first*: within one batch, the earliest chunks of the prefix go first; a
    ///   later chunk is of no use to a lookup without the ones before it.
    pub(super) fn write_behind(&mut self, g: usize, keys: &[Key], loaded: bool) {
        let Some(tiers) = self.tiers.get(g) else {
            return;
        };
        let limit = u64::from(self.cfg.tier_write_slots);
        for ti in 0..tiers.len() {
            let pinned: u64 = self.tiers[g].iter().map(|t| t.stats.write_pinned).sum();
            let tier = &mut self.tiers[g][ti];
            let need = tier.admission.min_hits;
            let admitted: Vec<Key> = match (need, loaded) {
                (0, false) => keys.to_vec(),
                // Offered again only if the tier skipped writes: a tier that keeps up has
                // every stored chunk already (this path costs a lookup per loaded chunk).
                (0, true) if tier.stats.skipped_writes > 0 => keys.to_vec(),
                (0, true) | (1.., false) => continue,
                (1.., true) => {
                    if tier.hits.len() > HIT_COUNTS {
                        tier.hits.clear();
                    }
                    // Past `need`, only while the tier skipped writes (a skipped one retries).
                    let again = tier.stats.skipped_writes > 0;
                    keys.iter()
                        .copied()
                        .filter(|k| {
                            let n = tier.hits.entry(*k).or_insert(0);
                            *n = n.saturating_add(1);
                            *n == need || (again && *n > need)
                        })
                        .collect()
                }
            };
            if admitted.is_empty() {
                continue;
            }
            if !tier.admit(Instant::now()) {
                tier.stats.dropped_writes += admitted.len() as u64;
                continue;
            }
            // Keys the tier holds or is writing already cost no room.
            let mut wanted: Vec<Key> = admitted
                .into_iter()
                .filter(|&k| tier.index.state(k) == KeyState::Absent)
                .collect();
            let cap = if loaded { limit } else { (limit / 2).max(1) };
            let mut room = cap.saturating_sub(pinned) as usize;
            if let Some(p) = tier.pacer.as_mut() {
                room = p.take(Instant::now(), wanted.len().min(room));
            }
            if wanted.len() > room {
                // A fresh chunk skipped now may still be offered again at its first load.
                tier.stats.skipped_writes += (wanted.len() - room) as u64;
                wanted.truncate(room);
            }
            if wanted.is_empty() {
                continue;
            }
            let Some(plan) = tier.index.prepare_write(&wanted) else {
                continue;
            };
            if plan.keys.is_empty() {
                continue;
            }
            tier.stats.write_pinned += plan.keys.len() as u64;
            let slots = self.pools[g]
                .prepare_load(&plan.keys)
                .expect("keys ready in the CPU pool");
            let slots = slots.iter().map(|s| s.0).collect();
            self.push_tier_job(TierJobKind::Write, g, ti, plan.keys, slots, plan.locations);
        }
    }

    /// Ends tier job `job` of group `g` (its `chunks`) in its tier's counters (pending, I/O
    /// time, CPU pins of write-behind).
    pub(super) fn end_tier_job(
        &mut self,
        job: JobId,
        t: TierRef,
        g: usize,
        chunks: usize,
    ) -> &mut GroupTier {
        let tier = &mut self.tiers[g][t.tier as usize];
        tier.stats.pending -= 1;
        if t.kind == TierJobKind::Write {
            tier.stats.write_pinned -= chunks as u64;
        }
        let us = tier
            .started
            .remove(&job)
            .map_or(0, |s| s.elapsed().as_micros() as u64);
        match t.kind {
            TierJobKind::Write => tier.stats.write_us += us,
            TierJobKind::Promote => tier.stats.promote_us += us,
        }
        tier
    }

    /// Applies tier job `job` every rank reported (`ok`: all succeeded).
    pub(super) fn complete_tier(
        &mut self,
        job: JobId,
        t: TierRef,
        g: usize,
        keys: &[Key],
        ok: bool,
    ) {
        let tier = self.end_tier_job(job, t, g, keys.len());
        if let Some(slots) = tier.complete_late(job, keys, ok) {
            let freed = self.pools[g].release_held(&slots);
            debug_assert!(freed.is_ok(), "{freed:?}");
            return;
        }
        tier.record(ok);
        match t.kind {
            TierJobKind::Write => {
                let done = tier.index.complete_write(keys, ok);
                debug_assert!(done.is_ok(), "{done:?}");
                tier.stats.failed_writes += u64::from(!ok);
                let unpinned = self.pools[g].complete_load(keys);
                debug_assert!(unpinned.is_ok(), "{unpinned:?}");
            }
            TierJobKind::Promote => {
                tier.end_promotion(keys, ok);
                tier.stats.failed_promotions += u64::from(!ok);
                if ok {
                    tier.stats.promoted_chunks += keys.len() as u64;
                }
                let published = self.pools[g].complete_store(keys, ok);
                debug_assert!(published.is_ok(), "{published:?}");
                if ok {
                    // Promoted chunks are ready in the CPU pool: the other tiers may want them
                    // (a restart with a disk tier refills an empty shared tier; the tier they
                    // came from holds them and writes nothing).
                    self.write_behind(g, keys, false);
                }
            }
        }
    }

    /// A reset flushed tier job `job` of group `g`: its tier state is released (a write
    /// counts as failed, a promotion's pins go; the CPU pool was emptied anyway).
    pub(super) fn reset_tier_job(&mut self, job: JobId, t: TierRef, g: usize, keys: &[Key]) {
        let tier = self.end_tier_job(job, t, g, keys.len());
        // The CPU pool was emptied (held slots too): the flush waits for the late I/O.
        tier.end_hold(job, keys);
        match t.kind {
            TierJobKind::Write => {
                let done = tier.index.complete_write(keys, false);
                debug_assert!(done.is_ok(), "{done:?}");
            }
            TierJobKind::Promote => tier.end_promotion(keys, true),
        }
    }
}

/// The nearest of `tiers` holding `key` ready, skipping tiers on probation and keys an
/// expired promotion still reads.
fn nearest(tiers: &[GroupTier], key: Key) -> Option<usize> {
    tiers.iter().position(|t| {
        !t.skip && matches!(t.index.state(key), KeyState::Ready { .. }) && !t.stuck.contains(&key)
    })
}
