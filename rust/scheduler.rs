//! The scheduler core: request tracking, lookups and loads, store planning, the per-step plan.
//!
//! An engine calls it a few times per step (DESIGN.md §3):
//! 1. [`Scheduler::lookup`] for each waiting request: tokens loadable from the CPU tier beyond
//!    the engine's own prefix hit, `0`, or `None` ("ask again later");
//! 2. [`Scheduler::allocate`] once the engine allocated the request's blocks: records the block
//!    table and creates the load job (slots pinned);
//! 3. [`Scheduler::schedule`] once per step: applies the step (new blocks, computed tokens,
//!    finished / aborted / preempted requests), builds store jobs for chunks that became full,
//!    runs the single fence check and returns a [`StepPlan`];
//! 4. [`Scheduler::complete`] as workers report jobs.
//!
//! Requests live in a slab indexed by a dense `u32`; external string ids map to it once per
//! call. Each KV group has its own CPU pool (a slot holds one chunk of one group), so keys are
//! the engine's chained prefix hashes as they are.
//!
//! Positions whose chunk is not stored yet are indexed by block (`pos_index`): when a block is
//! *re-allocated* (handed to a request at a position it will write: `allocate` beyond the
//! engine's prefix hit, or `new_blocks`), every other position still holding it is dropped from
//! its request's block table, so a store never reads a block whose content was replaced (a
//! sliding-window block that left the window, or a block of a released request). Writes alone
//! never drop anything: `written` only drives the fence check, so a superset of the truly
//! written blocks costs flushes, never a chunk.
//!
//! The step applies its input in this order (DESIGN.md §4):
//! 1. releases (finished, aborted, preempted): deferred fence pairs are armed;
//! 2. stores of released requests, built from the blocks as they are *before* this step's
//!    re-allocations take effect (a new owner writes them only after this step's flush);
//! 3. this step's re-allocations drop the positions they replace;
//! 4. stores of running requests (chunks completed by this step's forward pass);
//! 5. the single fence check over `written`. A store of step 4 runs after this step's forward
//!    pass and a load submitted with this plan writes its own blocks: neither is ever in the
//!    flush set of the step that creates it.

use rustc_hash::FxHashMap;

use crate::config::SchedulerConfig;
use crate::error::{Error, Result};
use crate::ids::{BlockId, JobId, Key, OwnerId};
use crate::jobs::{Completion, JobKind, JobStats};
use crate::pool::{KeyState, Pool, PoolConfig, PoolEventKind};
use crate::tracker::{FenceStats, Tracker};

/// Internal null block (dropped position, or the engine's null block).
const NULL: u32 = u32::MAX;

/// Lifecycle of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Registered, not admitted yet.
    Waiting,
    /// Holds blocks and is scheduled.
    Running,
    /// Released its blocks; will be re-admitted.
    Preempted,
    /// Finished normally; kept until its last store completes.
    Finished,
    /// Aborted; kept until its jobs complete.
    Aborted,
}

impl Status {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Status::Waiting => "waiting",
            Status::Running => "running",
            Status::Preempted => "preempted",
            Status::Finished => "finished",
            Status::Aborted => "aborted",
        }
    }
}

/// The copies of one job in one KV group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupTransfer {
    /// KV group index.
    pub group: u32,
    /// GPU blocks, one per copied block.
    pub gpu_blocks: Vec<u32>,
    /// Block positions in the group's CPU region: `slot * blocks_per_chunk + offset`.
    pub cpu_blocks: Vec<u32>,
    /// Keys of the chunks touched, in order.
    pub keys: Vec<Key>,
}

/// A store or load job of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedJob {
    /// Job id.
    pub id: JobId,
    /// Store or load.
    pub kind: JobKind,
    /// External id of the request.
    pub request: String,
    /// Copies per group.
    pub transfers: Vec<GroupTransfer>,
}

/// What the workers must do this step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Load jobs created since the previous plan.
    pub loads: Vec<PlannedJob>,
    /// Store jobs created by this step.
    pub stores: Vec<PlannedJob>,
    /// Pending jobs that must complete before this step writes its blocks, sorted.
    pub flush: Vec<JobId>,
}

/// One finished job, as seen by the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletedJob {
    /// Job id.
    pub id: JobId,
    /// Store or load.
    pub kind: JobKind,
    /// External id of the request.
    pub request: String,
    /// Whether every worker succeeded.
    pub ok: bool,
    /// For a failed load: the GPU blocks whose content is invalid (the engine recomputes).
    pub invalid_blocks: Vec<u32>,
}

/// The first value other than [`NULL`] that occurs twice in `values`, found with generation
/// `stamps` indexed by value (no allocation, no clearing per call).
fn first_repeated(
    stamps: &mut [u32],
    stamp: &mut u32,
    values: impl IntoIterator<Item = u32>,
) -> Option<u32> {
    *stamp = stamp.wrapping_add(1);
    if *stamp == 0 {
        stamps.fill(0);
        *stamp = 1;
    }
    for v in values {
        if v == NULL {
            continue;
        }
        let seen = &mut stamps[v as usize];
        if *seen == *stamp {
            return Some(v);
        }
        *seen = *stamp;
    }
    None
}

/// A pool event with its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerEvent {
    /// Stored or removed.
    pub kind: PoolEventKind,
    /// KV group of the keys.
    pub group: u32,
    /// The engine's chunk hashes.
    pub keys: Vec<Key>,
}

/// The input of one [`Scheduler::schedule`] call; `S` is any string type for request ids.
#[derive(Debug, Clone)]
pub struct StepInput<S = String> {
    /// Scheduled requests.
    pub scheduled: Vec<S>,
    /// Tokens computed by the end of this step, one per scheduled request.
    pub computed: Vec<u32>,
    /// Blocks appended to a request's block table in one group this step. For a resumed
    /// request: its whole new block table.
    pub new_blocks: Vec<(S, u32, Vec<u32>)>,
    /// Requests resumed from preemption this step.
    pub resumed: Vec<S>,
    /// Requests that finished normally.
    pub finished: Vec<S>,
    /// Requests that were aborted.
    pub aborted: Vec<S>,
    /// Requests that were preempted (their blocks released).
    pub preempted: Vec<S>,
    /// Blocks written this step; `None`: every block allocated since the previous step
    /// (conservative, still correct).
    pub written: Option<Vec<u32>>,
}

/// Counters of the scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// `schedule` calls.
    pub steps: u64,
    /// `lookup` calls.
    pub lookups: u64,
    /// Lookups answered "ask again later".
    pub lookups_deferred: u64,
    /// Tokens reported loadable by lookups that admitted a request.
    pub lookup_hit_tokens: u64,
    /// Longest wait of a request, in steps, from its first lookup to an answer.
    pub max_lookup_wait_steps: u64,
    /// Store jobs created.
    pub store_jobs: u64,
    /// Chunks stored (planned).
    pub store_chunks: u64,
    /// Bytes planned for stores (per worker).
    pub store_bytes: u64,
    /// Load jobs created.
    pub load_jobs: u64,
    /// Blocks loaded (planned).
    pub load_blocks: u64,
    /// Tokens loaded (planned).
    pub load_tokens: u64,
    /// Bytes planned for loads (per worker).
    pub load_bytes: u64,
    /// Jobs flushed with an explicit written set.
    pub flushes_necessary: u64,
    /// Jobs flushed in conservative mode (every allocated block counted as written).
    pub flushes_conservative: u64,
    /// Jobs flushed by resets.
    pub flushes_reset: u64,
    /// Store attempts that found no room in the pool (retried next step).
    pub store_no_room: u64,
    /// Chunks skipped because a block of theirs was re-allocated before the store.
    pub chunks_dropped: u64,
    /// Completed store jobs that failed.
    pub failed_stores: u64,
    /// Completed load jobs that failed.
    pub failed_loads: u64,
    /// Resets.
    pub resets: u64,
}

#[derive(Debug, Clone)]
struct ReqGroup {
    blocks: Vec<u32>,
    /// Chunks handled (stored, skipped, hit or loaded): the next chunk to consider.
    cursor: u32,
}

#[derive(Debug, Clone)]
struct LookupResult {
    step: u64,
    hit: u32,
    end: u32,
}

#[derive(Debug, Clone)]
struct Request {
    id: String,
    owner: OwnerId,
    prompt_len: u32,
    hashes: Vec<Key>,
    computed: u32,
    status: Status,
    groups: Vec<ReqGroup>,
    load: Option<JobId>,
    first_ask: Option<u64>,
    wait_on: Vec<JobId>,
    lookup: Option<LookupResult>,
    /// Step at which it was last queued for store planning (dedup of the work list).
    queued: u64,
    /// Bumped whenever the block table is replaced, so older index entries die.
    epoch: u32,
}

#[derive(Debug, Clone, Copy)]
struct PosEntry {
    req: u32,
    owner: OwnerId,
    epoch: u32,
    group: u32,
    pos: u32,
}

#[derive(Debug, Clone)]
struct JobPayload {
    req: u32,
    transfers: Vec<GroupTransfer>,
    /// For a load: per group, the first chunk it fills (a failed load rewinds the store
    /// cursor there, so the recomputed chunks are stored again).
    first_chunks: Vec<u32>,
    /// For a load: the token it loads up to (the request's computed tokens once it is done).
    load_end: u32,
}

/// The scheduler core. See the module documentation.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    align: u32,
    pools: Vec<Pool>,
    tracker: Tracker<JobPayload>,
    reqs: Vec<Option<Request>>,
    free: Vec<u32>,
    index: FxHashMap<String, u32>,
    next_owner: u64,
    pos_index: Vec<Vec<PosEntry>>,
    pending_assign: Vec<(u32, u32, u32)>,
    /// Blocks re-allocated by `allocate` since the previous step (applied in `schedule`).
    reallocated: Vec<u32>,
    /// Generation stamps per block, for duplicate checks without allocation.
    stamps: Vec<u32>,
    /// Generation stamps per request slab index.
    req_stamps: Vec<u32>,
    stamp: u32,
    req_stamp: u32,
    loading: FxHashMap<(u32, Key), JobId>,
    loading_requests: u32,
    step: u64,
    new_loads: Vec<PlannedJob>,
    allocated: Vec<BlockId>,
    retry: Vec<u32>,
    reset_flush: Vec<JobId>,
    stats: SchedulerStats,
}

impl Scheduler {
    /// A scheduler for `cfg` (validated).
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        cfg.validate()?;
        let pools = (0..cfg.groups.len())
            .map(|_| {
                Pool::new(PoolConfig {
                    capacity: cfg.cpu_chunks,
                    policy: cfg.policy,
                    store_threshold: cfg.store_threshold,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut tracker = Tracker::new(cfg.num_workers, cfg.num_gpu_blocks)?;
        tracker.set_skip_deferred_arming(cfg.debug_skip_deferred_arming);
        Ok(Self {
            align: cfg.align_tokens() as u32,
            tracker,
            pos_index: vec![Vec::new(); cfg.num_gpu_blocks as usize],
            pools,
            reqs: Vec::new(),
            free: Vec::new(),
            index: FxHashMap::default(),
            next_owner: 0,
            pending_assign: Vec::new(),
            reallocated: Vec::new(),
            stamps: vec![0; cfg.num_gpu_blocks as usize],
            req_stamps: Vec::new(),
            req_stamp: 0,
            stamp: 0,
            loading: FxHashMap::default(),
            loading_requests: 0,
            step: 0,
            new_loads: Vec::new(),
            allocated: Vec::new(),
            retry: Vec::new(),
            reset_flush: Vec::new(),
            stats: SchedulerStats::default(),
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    fn idx(&self, id: &str) -> Result<u32> {
        self.index
            .get(id)
            .copied()
            .ok_or_else(|| Error::UnknownRequest(id.to_owned()))
    }

    fn req(&self, i: u32) -> &Request {
        self.reqs[i as usize]
            .as_ref()
            .expect("indexed request exists")
    }

    fn req_mut(&mut self, i: u32) -> &mut Request {
        self.reqs[i as usize]
            .as_mut()
            .expect("indexed request exists")
    }

    fn state_err(id: &str, status: Status, what: &str) -> Error {
        Error::RequestState {
            request: id.to_owned(),
            reason: format!("is {}; {what}", status.name()),
        }
    }

    /// Registers a request with its prompt length and the chained hashes of its complete
    /// hash blocks so far.
    pub fn add_request(&mut self, id: &str, prompt_len: u32, hashes: Vec<Key>) -> Result<()> {
        if self.index.contains_key(id) {
            return Err(Error::RequestState {
                request: id.to_owned(),
                reason: "is already registered".into(),
            });
        }
        if prompt_len == 0 {
            return Err(Error::RequestState {
                request: id.to_owned(),
                reason: "has an empty prompt (prompt_len 0)".into(),
            });
        }
        let owner = OwnerId(self.next_owner);
        self.next_owner += 1;
        let groups = vec![
            ReqGroup {
                blocks: Vec::new(),
                cursor: 0,
            };
            self.cfg.groups.len()
        ];
        let req = Request {
            id: id.to_owned(),
            owner,
            prompt_len,
            hashes,
            computed: 0,
            status: Status::Waiting,
            groups,
            load: None,
            first_ask: None,
            wait_on: Vec::new(),
            lookup: None,
            queued: u64::MAX,
            epoch: 0,
        };
        let i = if let Some(i) = self.free.pop() {
            self.reqs[i as usize] = Some(req);
            i
        } else {
            self.reqs.push(Some(req));
            (self.reqs.len() - 1) as u32
        };
        self.index.insert(id.to_owned(), i);
        Ok(())
    }

    /// Appends chained hashes as the request's tokens grow.
    pub fn extend_hashes(&mut self, id: &str, hashes: &[Key]) -> Result<()> {
        let i = self.idx(id)?;
        self.req_mut(i).hashes.extend_from_slice(hashes);
        Ok(())
    }

    fn key(&self, r: &Request, g: usize, chunk: u32) -> Option<Key> {
        let end = (u64::from(chunk) + 1) * u64::from(self.cfg.chunk_tokens(g));
        let h = (end / u64::from(self.cfg.hash_block_size)) as usize;
        r.hashes.get(h.checked_sub(1)?).copied()
    }

    /// Store watermark in tokens: what may be stored of this request now.
    fn watermark(&self, r: &Request) -> u32 {
        let mut wm = r.computed;
        if self.cfg.offload_prompt_only {
            wm = wm.min(r.prompt_len);
        }
        if let Some(cap) = self.cfg.max_offload_tokens {
            wm = wm.min(cap);
        }
        wm
    }

    /// Tokens loadable from the CPU tier beyond the engine's prefix hit of `hit_tokens`;
    /// `Ok(None)` means "ask again later".
    pub fn lookup(&mut self, id: &str, hit_tokens: u32) -> Result<Option<u32>> {
        let i = self.idx(id)?;
        let r = self.req(i);
        if !matches!(r.status, Status::Waiting | Status::Preempted) {
            return Err(Self::state_err(
                id,
                r.status,
                "only waiting requests are looked up",
            ));
        }
        self.stats.lookups += 1;
        // Work on the request outside the slab so the pools and the tracker stay borrowable.
        let mut r = self.reqs[i as usize]
            .take()
            .expect("indexed request exists");
        let answer = self.lookup_inner(&mut r, hit_tokens);
        self.reqs[i as usize] = Some(r);
        if answer.is_none() {
            self.stats.lookups_deferred += 1;
        }
        Ok(answer)
    }

    fn lookup_inner(&mut self, r: &mut Request, hit: u32) -> Option<u32> {
        r.lookup = None;
        if self.tracker.jobs().owner(r.owner).is_some() {
            return None;
        }
        let first_ask = r.first_ask.is_none();
        if first_ask {
            r.first_ask = Some(self.step);
        }
        let (end, storing) = self.hit_end(r, hit);
        if end == 0 {
            if storing {
                return None;
            }
            self.touch_prefix(r, hit, hit);
            return Some(0);
        }
        if first_ask {
            // Wait only for loads already in flight now, never for loads started later.
            let mut jobs = Vec::new();
            for g in 0..self.cfg.groups.len() {
                let loading = &self.loading;
                jobs.extend(
                    self.needed_keys(r, g, hit, end)
                        .into_iter()
                        .filter_map(|k| loading.get(&(g as u32, k)).copied()),
                );
            }
            jobs.sort_unstable();
            jobs.dedup();
            r.wait_on = jobs;
        }
        let tracker = &self.tracker;
        r.wait_on.retain(|j| tracker.jobs().get(*j).is_some());
        let backpressure = self.cfg.max_loading_requests > 0
            && self.loading_requests >= self.cfg.max_loading_requests;
        if storing || backpressure || !r.wait_on.is_empty() {
            return None;
        }
        let waited = self.step - r.first_ask.unwrap_or(self.step);
        self.stats.max_lookup_wait_steps = self.stats.max_lookup_wait_steps.max(waited);
        self.stats.lookup_hit_tokens += u64::from(end - hit);
        r.lookup = Some(LookupResult {
            step: self.step,
            hit,
            end,
        });
        self.touch_prefix(r, hit, end);
        Some(end - hit)
    }

    /// Refreshes the recency of every chunk the request re-uses: the engine's own prefix hit
    /// (chunks the GPU cache serves now may be evicted from it first) and the chunks it loads,
    /// the earliest ending most recent.
    fn touch_prefix(&mut self, r: &Request, hit: u32, end: u32) {
        for g in 0..self.cfg.groups.len() {
            let ct = self.cfg.chunk_tokens(g);
            let first = match self.cfg.groups[g].sliding_window {
                None => 0,
                Some(w) => hit.saturating_sub(w) / ct,
            };
            let keys: Vec<Key> = (first..end.max(hit) / ct)
                .filter_map(|c| self.key(r, g, c))
                .collect();
            if !keys.is_empty() {
                self.pools[g].touch(&keys);
            }
        }
    }

    /// Highest token end point `p > hit` (aligned) at which every group's needed chunks are
    /// ready, or 0; and whether chunks still being stored could make it higher (ask again
    /// later). The pools are not consulted when less than one aligned step of tokens lies
    /// beyond the hit.
    fn hit_end(&mut self, r: &Request, hit: u32) -> (u32, bool) {
        let mut cap = r.prompt_len - u32::from(self.cfg.has_window());
        if r.status == Status::Preempted {
            // Resumed requests recompute their generated tokens too: every token that had KV
            // may come back (the last sampled one never had any).
            cap = cap.max(r.computed);
        }
        let hashed = (r.hashes.len() as u64 * u64::from(self.cfg.hash_block_size))
            .min(u64::from(u32::MAX)) as u32;
        cap = cap.min(hashed);
        cap -= cap % self.align;
        if cap <= hit || cap - hit < self.align {
            return (0, false);
        }
        // Per group, prefix counts from the hit chunk of chunks that are ready, and of chunks
        // that are ready or being stored.
        let mut counts: Vec<(usize, Vec<u32>, Vec<u32>)> = Vec::with_capacity(self.pools.len());
        // Full attention needs every chunk from the hit: its leading run bounds the answer.
        let (mut bound_ready, mut bound_maybe) = (cap, cap);
        for g in 0..self.cfg.groups.len() {
            let ct = self.cfg.chunk_tokens(g);
            let (s, n) = (hit / ct, cap / ct);
            let keys: Vec<Key> = (s..n).filter_map(|c| self.key(r, g, c)).collect();
            self.pools[g].lookup(&keys);
            let mut ready = Vec::with_capacity(keys.len() + 1);
            let mut maybe = Vec::with_capacity(keys.len() + 1);
            ready.push(0u32);
            maybe.push(0u32);
            for k in &keys {
                let st = self.pools[g].state(*k);
                let (r0, m0) = (
                    *ready.last().expect("seeded"),
                    *maybe.last().expect("seeded"),
                );
                ready.push(r0 + u32::from(matches!(st, KeyState::Ready { .. })));
                maybe.push(m0 + u32::from(st != KeyState::Absent));
            }
            if self.cfg.groups[g].sliding_window.is_none() {
                let run = |c: &[u32]| {
                    c.iter()
                        .enumerate()
                        .take_while(|(i, v)| **v as usize == *i)
                        .count() as u32
                        - 1
                };
                bound_ready = bound_ready.min((s + run(&ready)) * ct);
                bound_maybe = bound_maybe.min((s + run(&maybe)) * ct);
            }
            counts.push((g, ready, maybe));
        }
        let best = |use_maybe: bool| -> u32 {
            let mut p = if use_maybe { bound_maybe } else { bound_ready };
            p -= p % self.align;
            while p > hit && p - hit >= self.align {
                let ok = counts.iter().all(|(g, ready, maybe)| {
                    let c = if use_maybe { maybe } else { ready };
                    let s = hit / self.cfg.chunk_tokens(*g);
                    let first = self.first_needed_chunk(*g, hit, p);
                    let last = p / self.cfg.chunk_tokens(*g);
                    c[(last - s) as usize] - c[(first - s) as usize] == last - first
                });
                if ok {
                    return p;
                }
                p -= self.align;
            }
            0
        };
        let end = best(false);
        (end, best(true) > end)
    }

    /// First chunk a group needs to load for an end point `end` beyond `hit`.
    fn first_needed_chunk(&self, g: usize, hit: u32, end: u32) -> u32 {
        let start = match self.cfg.groups[g].sliding_window {
            None => hit,
            Some(w) => hit.max(end.saturating_sub(w)),
        };
        start / self.cfg.chunk_tokens(g)
    }

    /// Keys of the chunks group `g` needs loaded for tokens `[hit, end)`.
    fn needed_keys(&self, r: &Request, g: usize, hit: u32, end: u32) -> Vec<Key> {
        let last = end / self.cfg.chunk_tokens(g);
        (self.first_needed_chunk(g, hit, end)..last)
            .filter_map(|c| self.key(r, g, c))
            .collect()
    }

    /// The first non-null block that occurs twice in `blocks`, if any.
    fn first_repeated(&mut self, blocks: impl IntoIterator<Item = u32>) -> Option<u32> {
        first_repeated(&mut self.stamps, &mut self.stamp, blocks)
    }

    /// The first request (slab index) that occurs twice in `reqs`, if any.
    fn first_repeated_req(&mut self, reqs: impl IntoIterator<Item = u32>) -> Option<u32> {
        self.req_stamps.resize(self.reqs.len(), 0);
        first_repeated(&mut self.req_stamps, &mut self.req_stamp, reqs)
    }

    fn engine_block(&self, b: u32) -> Result<u32> {
        if b >= self.cfg.num_gpu_blocks {
            return Err(Error::BlockOutOfRange {
                block: BlockId(b),
                num_blocks: self.cfg.num_gpu_blocks,
            });
        }
        Ok(if Some(b) == self.cfg.null_block {
            NULL
        } else {
            b
        })
    }

    fn engine_blocks(&self, blocks: &[u32]) -> Result<Vec<u32>> {
        blocks.iter().map(|b| self.engine_block(*b)).collect()
    }

    /// Records the blocks the engine allocated for an admitted request (its whole block table
    /// per group), its engine prefix hit `hit_tokens`, and `load_tokens` to load from the CPU
    /// tier (as returned by the last lookup, or 0). Creates the load job.
    pub fn allocate(
        &mut self,
        id: &str,
        blocks: &[Vec<u32>],
        hit_tokens: u32,
        load_tokens: u32,
    ) -> Result<Option<JobId>> {
        let i = self.idx(id)?;
        let r = self.req(i);
        if !matches!(r.status, Status::Waiting | Status::Preempted) {
            return Err(Self::state_err(
                id,
                r.status,
                "only waiting requests are allocated",
            ));
        }
        if blocks.len() != self.cfg.groups.len() {
            return Err(Error::RequestState {
                request: id.to_owned(),
                reason: format!(
                    "allocated {} block lists but the engine has {} KV groups",
                    blocks.len(),
                    self.cfg.groups.len()
                ),
            });
        }
        let tables = blocks
            .iter()
            .map(|b| self.engine_blocks(b))
            .collect::<Result<Vec<_>>>()?;
        if let Some(b) = self.first_repeated(tables.iter().flatten().copied()) {
            return Err(Error::RequestState {
                request: id.to_owned(),
                reason: format!("was allocated block {b} twice; a block holds one position"),
            });
        }
        let r = self.req(i);
        if self.tracker.jobs().owner(r.owner).is_some() {
            return Err(Self::state_err(
                id,
                r.status,
                "it still has pending jobs; look it up again",
            ));
        }
        let end = hit_tokens + load_tokens;
        if load_tokens > 0 {
            match &r.lookup {
                Some(l) if l.step == self.step && l.hit == hit_tokens && l.end == end => {}
                _ => {
                    return Err(Error::RequestState {
                        request: id.to_owned(),
                        reason: format!(
                            "allocated with {load_tokens} tokens to load after a hit of \
                             {hit_tokens}, but no lookup of this step returned that"
                        ),
                    })
                }
            }
            for (g, t) in tables.iter().enumerate() {
                let bs = self.cfg.groups[g].block_size;
                let need = end.div_ceil(bs) as usize;
                if t.len() < need {
                    return Err(Error::RequestState {
                        request: id.to_owned(),
                        reason: format!(
                            "group {g} has {} blocks, {need} needed to load {end} tokens",
                            t.len()
                        ),
                    });
                }
                if self.cfg.groups[g].sliding_window.is_none() {
                    let from = (hit_tokens / bs) as usize;
                    if let Some(pos) = (from..(end / bs) as usize).find(|p| t[*p] == NULL) {
                        return Err(Error::RequestState {
                            request: id.to_owned(),
                            reason: format!(
                                "group {g} has the null block at position {pos}, which the load \
                                 of tokens {hit_tokens}..{end} must fill"
                            ),
                        });
                    }
                }
            }
        }
        let owner = self.req(i).owner;
        let transfers = if load_tokens > 0 {
            self.pin_load(i, &tables, hit_tokens, end)?
        } else {
            Vec::new()
        };
        let first_chunks = transfers
            .iter()
            .map(|t| self.first_needed_chunk(t.group as usize, hit_tokens, end))
            .collect();
        // Validated and pinned: apply.
        if self.req(i).status == Status::Preempted {
            self.tracker.reacquire(owner);
        }
        let bpc = self.cfg.blocks_per_chunk;
        for (g, t) in tables.into_iter().enumerate() {
            self.allocated
                .extend(t.iter().filter(|b| **b != NULL).map(|b| BlockId(*b)));
            // Beyond the engine's prefix hit the blocks get new content: re-allocations.
            let reused = (hit_tokens / self.cfg.groups[g].block_size) as usize;
            self.reallocated
                .extend(t.iter().skip(reused).filter(|b| **b != NULL));
            let cursor = self.req(i).groups[g]
                .cursor
                .max(end / self.cfg.chunk_tokens(g));
            for (pos, b) in t.iter().enumerate() {
                if *b != NULL && pos as u32 >= cursor * bpc {
                    self.pending_assign.push((i, g as u32, pos as u32));
                }
            }
            let rg = &mut self.req_mut(i).groups[g];
            rg.blocks = t;
            rg.cursor = cursor;
        }
        let r = self.req_mut(i);
        r.epoch += 1;
        r.status = Status::Running;
        r.computed = hit_tokens;
        r.first_ask = None;
        r.wait_on.clear();
        r.lookup = None;
        if transfers.is_empty() {
            return Ok(None);
        }
        // Destination blocks: sliding-window groups are eager (the engine may free them while
        // the request runs), full-attention groups deferred, as for stores.
        let (mut eager, mut deferred) = (Vec::new(), Vec::new());
        for t in &transfers {
            let class = if self.cfg.groups[t.group as usize].sliding_window.is_some() {
                &mut eager
            } else {
                &mut deferred
            };
            class.extend(t.gpu_blocks.iter().map(|b| BlockId(*b)));
        }
        let payload = JobPayload {
            req: i,
            transfers: transfers.clone(),
            first_chunks,
            load_end: end,
        };
        let job = self
            .tracker
            .create(JobKind::Load, owner, eager, deferred, payload)
            .expect("blocks validated, no pending job");
        for t in &transfers {
            for k in &t.keys {
                self.loading.insert((t.group, *k), job);
            }
            self.stats.load_blocks += t.gpu_blocks.len() as u64;
            self.stats.load_bytes += t.gpu_blocks.len() as u64
                * self.cfg.groups[t.group as usize].bytes_per_chunk
                / u64::from(bpc);
        }
        self.loading_requests += 1;
        self.stats.load_jobs += 1;
        self.stats.load_tokens += u64::from(load_tokens);
        self.req_mut(i).load = Some(job);
        self.new_loads.push(PlannedJob {
            id: job,
            kind: JobKind::Load,
            request: id.to_owned(),
            transfers,
        });
        Ok(Some(job))
    }

    /// Builds the copies of a load of tokens `[hit, end)` into `tables` and pins their slots
    /// (all or nothing).
    fn pin_load(
        &mut self,
        i: u32,
        tables: &[Vec<u32>],
        hit: u32,
        end: u32,
    ) -> Result<Vec<GroupTransfer>> {
        let bpc = self.cfg.blocks_per_chunk;
        let mut out: Vec<GroupTransfer> = Vec::new();
        for (g, t) in tables.iter().enumerate() {
            let bs = self.cfg.groups[g].block_size;
            let first_pos = self.first_needed_chunk(g, hit, end) * bpc;
            let first_pos = first_pos.max(hit / bs);
            let mut tr = GroupTransfer {
                group: g as u32,
                gpu_blocks: Vec::new(),
                cpu_blocks: Vec::new(),
                keys: Vec::new(),
            };
            let mut kidx = Vec::new();
            let mut last_chunk = u32::MAX;
            for pos in first_pos..end / bs {
                let b = t[pos as usize];
                if b == NULL {
                    continue;
                }
                let c = pos / bpc;
                if c != last_chunk {
                    last_chunk = c;
                    tr.keys
                        .push(self.key(self.req(i), g, c).expect("looked-up key"));
                }
                kidx.push(tr.keys.len() - 1);
                tr.gpu_blocks.push(b);
                tr.cpu_blocks.push(pos % bpc);
            }
            if tr.keys.is_empty() {
                continue;
            }
            match self.pools[g].prepare_load(&tr.keys) {
                Ok(slots) => {
                    for (cpu, k) in tr.cpu_blocks.iter_mut().zip(kidx) {
                        *cpu += slots[k].0 * bpc;
                    }
                    out.push(tr);
                }
                Err(e) => {
                    for done in &out {
                        let undone = self.pools[done.group as usize].complete_load(&done.keys);
                        debug_assert!(undone.is_ok(), "{undone:?}");
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    fn ids<S: AsRef<str>>(&self, ids: &[S]) -> Result<Vec<u32>> {
        ids.iter().map(|id| self.idx(id.as_ref())).collect()
    }

    /// Applies one engine step and returns its plan: loads created since the previous plan,
    /// stores for chunks that became full, and the flush set of the single fence check.
    /// Everything is validated before anything changes.
    pub fn schedule<S: AsRef<str>>(&mut self, input: &StepInput<S>) -> Result<StepPlan> {
        // Validate.
        if input.scheduled.len() != input.computed.len() {
            return Err(Error::Config(format!(
                "step input: {} scheduled requests but {} computed-token counts",
                input.scheduled.len(),
                input.computed.len()
            )));
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
            w.into_iter().filter(|b| *b != NULL).map(BlockId).collect()
        } else {
            let mut w = std::mem::take(&mut self.allocated);
            for (_, _, blocks) in &new_blocks {
                w.extend(blocks.iter().filter(|b| **b != NULL).map(|b| BlockId(*b)));
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
                if *b != NULL && pos >= from {
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

    /// Plans the stores of each request of `work` once per step and drops the finished ones
    /// that have nothing left.
    fn plan_all(&mut self, work: &[u32], stores: &mut Vec<PlannedJob>) {
        let step = self.step;
        for &i in work {
            let Some(r) = self.reqs[i as usize].as_mut() else {
                continue;
            };
            if r.queued == step {
                continue;
            }
            r.queued = step;
            self.plan_stores(i, stores);
            self.maybe_drop(i);
        }
    }

    /// The engine released a running request's blocks outside a step (for example after a
    /// failed load it chose not to keep): its pending jobs' deferred pairs are armed, its
    /// remaining stores are planned next step, and it may be looked up again. Idempotent for
    /// a request already preempted; reporting it again in the next step's `preempted` is fine.
    pub fn preempt(&mut self, id: &str) -> Result<()> {
        let i = self.idx(id)?;
        let r = self.req(i);
        match r.status {
            Status::Preempted => Ok(()),
            Status::Running => {
                let owner = r.owner;
                self.req_mut(i).status = Status::Preempted;
                self.tracker.release(owner);
                self.retry.push(i);
                Ok(())
            }
            status => Err(Self::state_err(
                id,
                status,
                "only running requests are preempted",
            )),
        }
    }

    /// Indexes position `pos` of group `g` of request `i` under its block.
    fn assign(&mut self, i: u32, g: u32, pos: u32) {
        let Some(r) = self.reqs[i as usize].as_ref() else {
            return;
        };
        let Some(&b) = r.groups[g as usize].blocks.get(pos as usize) else {
            return;
        };
        if b == NULL {
            return;
        }
        let (owner, epoch) = (r.owner, r.epoch);
        let mut entries = std::mem::take(&mut self.pos_index[b as usize]);
        entries.retain(|e| self.entry_live(e, b));
        entries.push(PosEntry {
            req: i,
            owner,
            epoch,
            group: g,
            pos,
        });
        self.pos_index[b as usize] = entries;
    }

    /// Whether an index entry still refers to an unstored position holding block `b`.
    fn entry_live(&self, e: &PosEntry, b: u32) -> bool {
        let Some(r) = self.reqs[e.req as usize].as_ref() else {
            return false;
        };
        let rg = &r.groups[e.group as usize];
        r.owner == e.owner
            && r.epoch == e.epoch
            && rg.blocks.get(e.pos as usize) == Some(&b)
            && e.pos >= rg.cursor * self.cfg.blocks_per_chunk
    }

    /// Block `b` is written this step: drop every unstored position still holding it.
    fn invalidate(&mut self, b: u32) {
        let Some(slot) = self.pos_index.get_mut(b as usize) else {
            return;
        };
        if slot.is_empty() {
            return;
        }
        let mut entries = std::mem::take(slot);
        for e in &entries {
            if self.entry_live(e, b) {
                self.req_mut(e.req).groups[e.group as usize].blocks[e.pos as usize] = NULL;
            }
        }
        entries.clear();
        self.pos_index[b as usize] = entries;
    }

    /// Plans the stores of request `i`: full chunks below its watermark not handled yet.
    fn plan_stores(&mut self, i: u32, out: &mut Vec<PlannedJob>) {
        let r = self.req(i);
        if r.status == Status::Waiting {
            return;
        }
        if r.load.is_some() {
            // A request has one pending load or stores, never both: plan after the load.
            self.retry.push(i);
            return;
        }
        let wm = self.watermark(r);
        let bpc = self.cfg.blocks_per_chunk;
        let owner = r.owner;
        let mut transfers = Vec::new();
        let (mut eager, mut deferred) = (Vec::new(), Vec::new());
        let mut cursors = Vec::new();
        let mut retry = false;
        for g in 0..self.cfg.groups.len() {
            let r = self.req(i);
            let rg = &r.groups[g];
            let limit = wm / self.cfg.chunk_tokens(g);
            let mut c = rg.cursor;
            let (mut keys, mut chunks) = (Vec::new(), Vec::new());
            let mut dropped = 0;
            // At most a pool's worth of chunks per attempt, so a long request still fits.
            while c < limit && keys.len() < self.cfg.cpu_chunks as usize {
                let Some(key) = self.key(r, g, c) else {
                    break;
                };
                let Some(blocks) = rg.blocks.get((c * bpc) as usize..((c + 1) * bpc) as usize)
                else {
                    break;
                };
                if blocks.contains(&NULL) {
                    dropped += 1;
                } else {
                    keys.push(key);
                    chunks.push(c);
                }
                c += 1;
            }
            if c == rg.cursor {
                continue;
            }
            let plan = if keys.is_empty() {
                None
            } else {
                let Some(p) = self.pools[g].prepare_store(&keys) else {
                    self.stats.store_no_room += 1;
                    retry = true;
                    continue;
                };
                Some(p)
            };
            self.stats.chunks_dropped += dropped;
            cursors.push((g, c));
            let Some(plan) = plan else {
                continue;
            };
            let rg = &self.req(i).groups[g];
            let mut tr = GroupTransfer {
                group: g as u32,
                gpu_blocks: Vec::with_capacity(plan.keys.len() * bpc as usize),
                cpu_blocks: Vec::with_capacity(plan.keys.len() * bpc as usize),
                keys: plan.keys.clone(),
            };
            let mut j = 0;
            for (k, c) in keys.iter().zip(&chunks) {
                if plan.keys.get(j) != Some(k) {
                    continue;
                }
                let slot = plan.slots[j].0;
                j += 1;
                for off in 0..bpc {
                    tr.gpu_blocks.push(rg.blocks[(c * bpc + off) as usize]);
                    tr.cpu_blocks.push(slot * bpc + off);
                }
            }
            if tr.gpu_blocks.is_empty() {
                continue;
            }
            let class = if self.cfg.groups[g].sliding_window.is_some() {
                &mut eager
            } else {
                &mut deferred
            };
            class.extend(tr.gpu_blocks.iter().map(|b| BlockId(*b)));
            self.stats.store_chunks += tr.keys.len() as u64;
            self.stats.store_bytes += tr.keys.len() as u64 * self.cfg.groups[g].bytes_per_chunk;
            transfers.push(tr);
        }
        for (g, c) in cursors {
            self.req_mut(i).groups[g].cursor = c;
        }
        if retry {
            self.retry.push(i);
        }
        if transfers.is_empty() {
            return;
        }
        let id = self
            .tracker
            .create(
                JobKind::Store,
                owner,
                eager,
                deferred,
                JobPayload {
                    req: i,
                    transfers: transfers.clone(),
                    first_chunks: Vec::new(),
                    load_end: 0,
                },
            )
            .expect("blocks validated, no pending load");
        self.stats.store_jobs += 1;
        out.push(PlannedJob {
            id,
            kind: JobKind::Store,
            request: self.req(i).id.clone(),
            transfers,
        });
    }

    /// Whether request `i` has full chunks below its watermark that no store covers yet.
    fn has_stores_to_plan(&self, i: u32) -> bool {
        let r = self.req(i);
        let wm = self.watermark(r);
        r.groups
            .iter()
            .enumerate()
            .any(|(g, rg)| rg.cursor < wm / self.cfg.chunk_tokens(g))
    }

    /// Records one batch of worker reports `(job, worker, ok)`, all or nothing: every report is
    /// validated (a duplicate within the batch included) before any is applied. Returns the
    /// jobs that completed.
    pub fn complete_many(&mut self, reports: &[(JobId, u32, bool)]) -> Result<Vec<CompletedJob>> {
        let jobs = self.tracker.jobs();
        let mut live = Vec::with_capacity(reports.len());
        for &(job, worker, _) in reports {
            if jobs.validate(job, worker)? {
                live.push((job, worker));
            }
        }
        live.sort_unstable();
        if let Some(w) = live.windows(2).find(|w| w[0] == w[1]) {
            let (job, worker) = w[0];
            return Err(Error::DuplicateReport { job, worker });
        }
        let mut done = Vec::new();
        for &(job, worker, ok) in reports {
            if let Some(d) = self.complete(job, worker, ok).expect("validated") {
                done.push(d);
            }
        }
        Ok(done)
    }

    /// Drops a finished or aborted request once nothing is pending for it.
    fn maybe_drop(&mut self, i: u32) {
        let Some(r) = self.reqs[i as usize].as_ref() else {
            return;
        };
        if !matches!(r.status, Status::Finished | Status::Aborted)
            || self.tracker.jobs().owner(r.owner).is_some()
            || self.retry.contains(&i)
        {
            return;
        }
        let owner = r.owner;
        let id = r.id.clone();
        self.tracker.forget(owner);
        self.index.remove(&id);
        self.reqs[i as usize] = None;
        self.free.push(i);
    }

    /// Records worker `worker`'s report for `job` (`ok == false`: the worker failed it). When
    /// every worker reported, completes the job: stored chunks become readable (or are dropped
    /// if any worker failed), loaded slots are unpinned, fence pairs removed, and a finished
    /// request with nothing pending is dropped. Reports for jobs from before a reset return
    /// `Ok(None)`, as do reports that leave the job pending. A second report from the same
    /// worker is an error and changes nothing.
    pub fn complete(&mut self, job: JobId, worker: u32, ok: bool) -> Result<Option<CompletedJob>> {
        let Completion::Done(j) = self.tracker.complete(job, worker, ok)? else {
            return Ok(None);
        };
        let ok = !j.failed;
        let i = j.payload.req;
        let mut invalid_blocks = Vec::new();
        match j.kind {
            JobKind::Store => {
                for t in &j.payload.transfers {
                    // The pool holds exactly these keys as storing: cannot fail.
                    let done = self.pools[t.group as usize].complete_store(&t.keys, ok);
                    debug_assert!(done.is_ok(), "{done:?}");
                }
                self.stats.failed_stores += u64::from(!ok);
            }
            JobKind::Load => {
                for t in &j.payload.transfers {
                    let pool = &mut self.pools[t.group as usize];
                    let done = pool.complete_load(&t.keys);
                    debug_assert!(done.is_ok(), "{done:?}");
                    if !ok {
                        // A failed load leaves its chunks suspect: drop them (unless another
                        // load still reads them), so a persistent fault cannot loop forever.
                        pool.discard(&t.keys);
                    }
                    for k in &t.keys {
                        if self.loading.get(&(t.group, *k)) == Some(&job) {
                            self.loading.remove(&(t.group, *k));
                        }
                    }
                    if !ok {
                        invalid_blocks.extend_from_slice(&t.gpu_blocks);
                    }
                }
                self.loading_requests -= 1;
                self.stats.failed_loads += u64::from(!ok);
                let bpc = self.cfg.blocks_per_chunk;
                let r = self.req_mut(i);
                r.load = None;
                if ok {
                    // The loaded tokens are computed now: a reset before the next step restarts
                    // the window's store cursor from here, not from the engine's prefix hit.
                    r.computed = r.computed.max(j.payload.load_end);
                }
                if !ok {
                    // The engine recomputes what the load should have brought: rewind the
                    // store cursors so those chunks are stored again.
                    let mut rewound = Vec::new();
                    for (t, &c) in j.payload.transfers.iter().zip(&j.payload.first_chunks) {
                        let rg = &mut r.groups[t.group as usize];
                        if c < rg.cursor {
                            let n = rg.blocks.len() as u32;
                            rewound
                                .extend((c * bpc..(rg.cursor * bpc).min(n)).map(|p| (t.group, p)));
                            rg.cursor = c;
                        }
                    }
                    for (g, pos) in rewound {
                        self.assign(i, g, pos);
                    }
                }
                if matches!(self.req(i).status, Status::Finished | Status::Aborted)
                    && !self.has_stores_to_plan(i)
                {
                    // Nothing left to store once its load is done: drop it now.
                    self.retry.retain(|x| *x != i);
                }
            }
        }
        let done = CompletedJob {
            id: job,
            kind: j.kind,
            request: self.req(i).id.clone(),
            ok,
            invalid_blocks,
        };
        self.maybe_drop(i);
        Ok(Some(done))
    }

    /// Forgets every pending job and empties the CPU tier. Returns the pending jobs that were
    /// handed to workers in a plan (the next plan's flush set holds them too; their late
    /// reports are ignored; a load created but not planned yet is never handed out) and the
    /// requests whose load was cancelled (the engine must recompute those tokens). Running
    /// requests restart their store cursors: their chunks are stored again from the blocks
    /// they still hold. Finished and aborted requests are dropped; preempted ones store again
    /// once resumed.
    pub fn reset(&mut self) -> (Vec<JobId>, Vec<(String, JobId)>) {
        let pending = self.tracker.reset();
        // Loads not handed out in a plan yet never reach a worker: cancelled, never flushed.
        let unplanned: Vec<JobId> = self.new_loads.drain(..).map(|j| j.id).collect();
        let flushed: Vec<JobId> = pending
            .iter()
            .map(|j| j.id)
            .filter(|j| !unplanned.contains(j))
            .collect();
        self.stats.flushes_reset += flushed.len() as u64;
        self.stats.resets += 1;
        self.reset_flush.extend_from_slice(&flushed);
        for p in &mut self.pools {
            p.reset();
        }
        self.loading.clear();
        self.loading_requests = 0;
        self.retry.clear();
        self.pending_assign.clear();
        for e in &mut self.pos_index {
            e.clear();
        }
        let mut cancelled = Vec::new();
        let bpc = self.cfg.blocks_per_chunk;
        for i in 0..self.reqs.len() as u32 {
            let Some(r) = self.reqs[i as usize].as_mut() else {
                continue;
            };
            if let Some(job) = r.load.take() {
                cancelled.push((r.id.clone(), job));
            }
            r.first_ask = None;
            r.wait_on.clear();
            r.lookup = None;
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
}
