//! The one error type of the core. Every message names the ids or values involved, so a caller
//! can tell what to fix without a debugger. Every fallible operation checks its input before it
//! changes anything: an `Err` means state is unchanged.

use crate::ids::{BlockId, JobId, Key, OwnerId};

/// Convenience alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the core.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range or inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A job id that was never issued by this tracker.
    #[error("unknown job {0}: no job with this id was ever created")]
    UnknownJob(JobId),

    /// A completion for a job that already completed.
    #[error("job {0} already completed: duplicate completion rejected")]
    JobAlreadyCompleted(JobId),

    /// A report of a job that no plan has handed out yet.
    #[error(
        "job {0} was not handed out in a plan yet: no worker can have run it; report it after \
         the plan that carries it"
    )]
    JobNotPlanned(JobId),

    /// A second report of one job from the same worker rank.
    #[error("job {job}: worker {worker} already reported it; duplicate report rejected")]
    DuplicateReport {
        /// The job.
        job: JobId,
        /// The worker rank that reported twice.
        worker: u32,
    },

    /// A report from a worker rank the engine does not have.
    #[error(
        "job {job}: worker rank {worker} is out of range, the engine has {num_workers} workers"
    )]
    WorkerOutOfRange {
        /// The job.
        job: JobId,
        /// The offending rank.
        worker: u32,
        /// Workers configured.
        num_workers: u32,
    },

    /// A block id outside the engine's block range.
    #[error("invalid block id {block}: the engine has {num_blocks} blocks")]
    BlockOutOfRange {
        /// The offending block.
        block: BlockId,
        /// Number of blocks the tracker was configured with.
        num_blocks: u32,
    },

    /// A request that would hold a load and stores (or two loads) at once.
    #[error("request {owner}: {reason}")]
    OwnerBusy {
        /// The request.
        owner: OwnerId,
        /// Why the job was refused.
        reason: &'static str,
    },

    /// A step input whose scheduled requests and computed-token counts differ in number.
    #[error("step input: {scheduled} scheduled request ids but {computed} computed-token counts")]
    StepInputLength {
        /// Scheduled requests given.
        scheduled: usize,
        /// Computed-token counts given.
        computed: usize,
    },

    /// A request id that is not registered.
    #[error("unknown request {0:?}: add it before using it (or it finished and was dropped)")]
    UnknownRequest(String),

    /// An operation the request's state does not allow.
    #[error("request {request:?} {reason}")]
    RequestState {
        /// The request.
        request: String,
        /// What is wrong.
        reason: String,
    },

    /// A job with no blocks.
    #[error("request {0}: a job needs at least one block")]
    EmptyJob(OwnerId),

    /// A key the CPU pool holds no entry for.
    #[error("unknown key {0}: the CPU pool holds no entry for it")]
    UnknownKey(Key),

    /// A load of a key whose store has not completed.
    #[error("key {0} is being stored and is not readable yet: load it after its store completes")]
    KeyNotReady(Key),

    /// An operating-system I/O failure of a lower tier (a full disk, a read error, a thread
    /// that cannot start): not the caller's configuration.
    #[error("I/O error: {0}")]
    Io(String),

    /// A disk tier directory that another opener holds (one owner per directory).
    #[error(
        "disk tier {dir}: in use by {holder}; one engine per directory (stop the other one, \
         or give this one another disk_path)"
    )]
    TierInUse {
        /// The namespace directory.
        dir: String,
        /// Who holds it, as far as its lock file tells.
        holder: String,
    },

    /// A path in a disk tier directory the tier will not use: a symbolic link, not a regular
    /// file or directory, linked elsewhere too, or owned by another user.
    #[error("disk tier {path}: {reason}")]
    TierPath {
        /// The path.
        path: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An unpin without a matching pin.
    #[error("key {0} is not pinned: complete_load without a matching prepare_load")]
    KeyNotPinned(Key),
}
