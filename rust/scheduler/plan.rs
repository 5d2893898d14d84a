//! What crosses the scheduler's surface: the step's input, the plan it returns (jobs and their
//! per-group copies, the flush set), completed jobs, pool events and the counters.

use crate::ids::{BlockId, JobId, Key};
use crate::jobs::JobKind;
use crate::pool::PoolEventKind;

/// The copies of one job in one KV group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupTransfer {
    /// KV group index.
    pub group: u32,
    /// GPU blocks, one per copied block.
    pub gpu_blocks: Vec<BlockId>,
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
    /// External id of the request (empty for a store job of a plan in [`PlanForm::Runs`]).
    pub request: String,
    /// Copies per group (none in a plan in [`PlanForm::Runs`]: its copies are in
    /// [`StepPlan::runs`]).
    pub transfers: Vec<GroupTransfer>,
}

/// The form of a plan's copies ([`Scheduler::schedule_with`](super::Scheduler::schedule_with)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlanForm {
    /// Each job with its request id and, per group, its GPU blocks, CPU positions and keys.
    #[default]
    Transfers,
    /// Every job's copies in [`StepPlan::runs`], packed ([`crate::runs`]: the loads' first,
    /// then the stores'); the jobs carry no transfers, and the store jobs no request id (the
    /// loads keep theirs). For an engine binding that ships runs and job ids: a job then fills
    /// no list of its own for the plan (about five a job, each cold).
    Runs,
}

/// What the workers must do this step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Load jobs created since the previous plan.
    pub loads: Vec<PlannedJob>,
    /// Store jobs created by this step.
    pub stores: Vec<PlannedJob>,
    /// In [`PlanForm::Runs`], the copies of `loads` and `stores` as [`crate::runs`] rows (job
    /// index: the loads first, then the stores); empty in [`PlanForm::Transfers`].
    pub runs: Vec<u8>,
    /// Pending jobs that must complete before this step writes its blocks, sorted.
    pub flush: Vec<JobId>,
    /// Lower-tier jobs (write-behind, promotion) created since the previous plan.
    pub tier_jobs: Vec<super::TierJob>,
    /// Tier jobs a reset flushed (handed to workers and not completed), sorted: workers wait
    /// for them on their tier worker. They are not in `flush`.
    pub tier_flush: Vec<JobId>,
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
    pub invalid_blocks: Vec<BlockId>,
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

/// The input of one [`Scheduler::schedule`] call; `S` is any string type for request ids, `B`
/// any owner of a block list (an adapter that converts a step into one flat list hands out
/// slices of it).
#[derive(Debug, Clone)]
pub struct StepInput<S = String, B = Vec<BlockId>> {
    /// Scheduled requests.
    pub scheduled: Vec<S>,
    /// Tokens computed by the end of this step, one per scheduled request.
    pub computed: Vec<u32>,
    /// Blocks appended to a request's block table in one group this step. For a resumed
    /// request: its whole new block table.
    pub new_blocks: Vec<(S, u32, B)>,
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
    pub written: Option<Vec<BlockId>>,
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
