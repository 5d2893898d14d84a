//! The scheduler core: request tracking, lookups and loads, store planning, the per-step plan.
//!
//! An engine calls it a few times per step (DESIGN.md §3); each call lives in its own file:
//! 1. [`Scheduler::lookup`] (`lookup.rs`) for each waiting request: tokens loadable from the
//!    CPU tier beyond the engine's own prefix hit, `0`, or `None` ("ask again later");
//! 2. [`Scheduler::allocate`] (`load.rs`) once the engine allocated the request's blocks:
//!    records the block table and creates the load job (slots pinned);
//! 3. [`Scheduler::schedule`] (`step.rs`) once per step: applies the step (new blocks, computed
//!    tokens, finished / aborted / preempted requests), builds store jobs for chunks that became
//!    full (`stores.rs`), runs the single fence check and returns a [`StepPlan`];
//! 4. [`Scheduler::complete`] (`complete.rs`) as workers report jobs; [`Scheduler::reset`]
//!    (`reset.rs`) when the engine drops its cache.
//!
//! Requests live in a slab indexed by a dense `u32` (`requests.rs`); external string ids map
//! to it once per call. Each KV group has its own CPU pool (a slot holds one chunk of one
//! group), so keys are the engine's chained prefix hashes as they are.
//!
//! Positions whose chunk is not stored yet are indexed by block (`positions.rs`): when a block
//! is *re-allocated* (handed to a request at a position it will write: `allocate` beyond the
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
//!
//! Departures from DESIGN.md §3–§4 (lcm-aligned loads, `written` never drops a chunk, a flushed
//! load submitted by its own step) and their reasons: `docs/design-notes.md`.

mod checks;
mod complete;
mod handle;
mod inspect;
mod load;
mod lookup;
mod plan;
mod positions;
mod requests;
mod reset;
mod spares;
mod step;
mod stores;
mod tiers;

use rustc_hash::FxHashMap;

use crate::config::SchedulerConfig;
use crate::error::Result;
use crate::ids::{BlockId, JobId, Key, SlotId};
use crate::pool::{Pool, PoolConfig};
use crate::tracker::Tracker;

pub use handle::{RequestHandle, RequestRef, Resolved};
pub use plan::{
    CompletedJob, GroupTransfer, PlanForm, PlannedJob, SchedulerEvent, SchedulerStats, StepInput,
    StepPlan,
};
pub use requests::{Status, TABLE_ROOM};
pub use tiers::{DiskWatch, TierAdmission, TierGroupStats, TierJob, TierJobKind};

use requests::Request;

/// What the tracker carries with each job: what its completion must apply.
#[derive(Debug, Clone)]
struct JobPayload {
    /// Slab index of the request.
    req: u32,
    /// For a load or a tier job: copies per group (keys to unpin or hand on).
    transfers: Vec<GroupTransfer>,
    /// For a load: per transfer, the slot of each key: hints for the pool at completion
    /// (checked there).
    slots: Vec<Vec<SlotId>>,
    /// For a store: the keys to publish and their slots, flat (`stores.rs`).
    chunks: stores::StoreChunks,
    /// For a load: per group, the first chunk it fills (a failed load rewinds the store
    /// cursor there, so the recomputed chunks are stored again).
    first_chunks: Vec<u32>,
    /// For a load: the token it loads up to (the request's computed tokens once it is done).
    load_end: u32,
    /// For a tier job (`req` is [`tiers::NO_REQUEST`]): its kind and tier; its group and keys
    /// are the one transfer's.
    tier: Option<tiers::TierRef>,
}

impl JobPayload {
    /// The payload of a store job of request `req`.
    fn store(req: u32, chunks: stores::StoreChunks) -> Self {
        Self {
            req,
            transfers: Vec::new(),
            slots: Vec::new(),
            chunks,
            first_chunks: Vec::new(),
            load_end: 0,
            tier: None,
        }
    }

    /// The payload of a tier job.
    fn tier(tier: tiers::TierRef, group: u32, keys: Vec<Key>) -> Self {
        Self {
            req: tiers::NO_REQUEST,
            transfers: vec![GroupTransfer {
                group,
                gpu_blocks: Vec::new(),
                cpu_blocks: Vec::new(),
                keys,
            }],
            slots: Vec::new(),
            chunks: stores::StoreChunks::default(),
            first_chunks: Vec::new(),
            load_end: 0,
            tier: Some(tier),
        }
    }
}

/// The scheduler core. See the module documentation.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    /// Least common multiple of the groups' chunk sizes in tokens: lookups answer multiples.
    align: u32,
    /// One CPU pool per KV group.
    pools: Vec<Pool>,
    /// Jobs and the fence.
    tracker: Tracker<JobPayload>,
    /// The request slab (`requests.rs`); `None`: a free index.
    reqs: Vec<Option<Request>>,
    /// Free slab indices.
    free: Vec<u32>,
    /// External request id -> slab index.
    index: FxHashMap<String, u32>,
    /// The next request's tracker owner id (never reused).
    next_owner: u64,
    /// Unstored positions by block (`positions.rs`).
    pos_index: positions::PosIndex,
    /// Positions `(request, group, pos)` to index once this step's re-allocations are applied.
    pending_assign: Vec<(u32, u32, u32)>,
    /// Blocks re-allocated by `allocate` since the previous step (applied in `schedule`).
    reallocated: Vec<BlockId>,
    /// Generation stamps per block, for duplicate checks without allocation.
    stamps: Vec<u32>,
    /// Generation stamps per request slab index.
    req_stamps: Vec<u32>,
    /// Per slab index, the step at which its request was last queued for store planning
    /// (dedup of the work list; dense, so the dedup reads no request).
    queued: Vec<u64>,
    /// Current generation of `stamps`.
    stamp: u32,
    /// Current generation of `req_stamps`.
    req_stamp: u32,
    /// Per group, per pool slot: the last load created that reads the slot (lookups wait for
    /// it while it is pending). A pinned slot keeps its key, so a pending load named here
    /// reads that slot's key; a finished one (or one a reset dropped) is no longer in the job
    /// table and is ignored: nothing is removed on completion.
    loaders: Vec<Vec<JobId>>,
    /// Requests with a pending load (for load backpressure).
    loading_requests: u32,
    /// `schedule` calls so far.
    step: u64,
    /// Loads created since the previous plan.
    new_loads: Vec<PlannedJob>,
    /// Store jobs of the previous plan: the next plan's list is sized for as many.
    last_stores: usize,
    /// Blocks allocated since the previous step (the conservative written set).
    allocated: Vec<BlockId>,
    /// Requests whose store planning is retried next step (no room, or a load pending).
    retry: Vec<u32>,
    /// The step's list of requests to plan, kept between steps (a running batch's worth).
    work: Vec<u32>,
    /// The requests of a `work` list with something to plan or drop (`stores.rs`), reused.
    todo: Vec<u32>,
    /// Store planning's working lists, reused (`stores.rs`).
    store_scratch: stores::StoreScratch,
    /// Lookups' working lists, reused (`lookup.rs`).
    lookup_scratch: lookup::LookupScratch,
    /// Load pinning's working lists, reused (`load.rs`).
    load_scratch: load::LoadScratch,
    /// Completed jobs' lists, kept for the next store jobs (`stores.rs`).
    spares: spares::Spares,
    /// Jobs flushed by a reset, added to the next plan's flush set.
    reset_flush: Vec<JobId>,
    /// Tier jobs flushed by a reset, the next plan's `tier_flush`.
    reset_tier_flush: Vec<JobId>,
    /// Counters.
    stats: SchedulerStats,
    /// Per group, its lower tiers, nearest first (`tiers/`); empty when none is attached.
    tiers: Vec<Vec<tiers::GroupTier>>,
    /// Tier jobs created since the previous plan.
    new_tier_jobs: Vec<TierJob>,
    /// Every job below this id was handed out in a plan (ids are monotonic and a plan carries
    /// every job created before it): a report of a later job is refused, so no plan carries a
    /// job whose outcome is already known.
    planned_below: JobId,
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
            pos_index: positions::PosIndex::new(cfg.num_gpu_blocks),
            pools,
            reqs: Vec::new(),
            free: Vec::new(),
            index: FxHashMap::default(),
            next_owner: 0,
            pending_assign: Vec::new(),
            reallocated: Vec::new(),
            // Written at random by every duplicate check: backed (and faulted in) up front.
            stamps: crate::mem::huge_page_vec(0, cfg.num_gpu_blocks as usize),
            req_stamps: Vec::new(),
            queued: Vec::new(),
            req_stamp: 0,
            stamp: 0,
            // One entry per slot from the start: grown on demand, it was copied (and its new
            // pages faulted in) in the middle of steps until the pool had handed out every slot.
            loaders: (0..cfg.groups.len())
                .map(|_| crate::mem::huge_page_vec(JobId::NONE, cfg.cpu_chunks as usize))
                .collect(),
            loading_requests: 0,
            step: 0,
            new_loads: Vec::new(),
            last_stores: 0,
            allocated: Vec::new(),
            retry: Vec::new(),
            work: Vec::new(),
            todo: Vec::new(),
            store_scratch: stores::StoreScratch::default(),
            lookup_scratch: lookup::LookupScratch::default(),
            load_scratch: load::LoadScratch::default(),
            spares: spares::Spares::default(),
            reset_flush: Vec::new(),
            reset_tier_flush: Vec::new(),
            stats: SchedulerStats::default(),
            tiers: Vec::new(),
            new_tier_jobs: Vec::new(),
            planned_below: JobId(0),
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }
}
