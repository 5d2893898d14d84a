//! Scheduler configuration, validated once, here, so that the hot path can trust it.
//!
//! This is the one place where configuration values are checked, for every caller: the
//! Python bindings hand over the values as given ([`SchedulerArgs`], integers not yet
//! narrowed) and get either a [`SchedulerConfig`] or an [`Error::Config`] naming the field and
//! the value, in one style: `<field> must be in <min>..=<max>, got <value>`. Every rejection
//! says what to change: block sizes that do not divide the hash granularity, a sliding window
//! smaller than a chunk, a zero capacity. The lower tiers' options are checked with them
//! (`tiers`), so that no caller checks any option itself.
//!
//! Sizes are capped ([`MAX_GPU_BLOCKS`], [`MAX_CPU_SLOTS`], ...) so that a configuration
//! that passes never asks for more bookkeeping memory than a host can serve: the process
//! never aborts on an allocation at construction.

use std::fmt::Display;

use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::policy::PolicyKind;
use crate::pool::PoolConfig;

mod tiers;
pub use tiers::{
    write_rate, DiskTier, RemoteTier, TierArgs, TierConfig, MAX_DISK_WRITE_MBPS, REMOTE_RETRY,
    REMOTE_TTL,
};

/// Largest `num_gpu_blocks` (2^24). The fence and the position index keep 48 bytes per GPU
/// block: 800 MiB at the cap, for 268M tokens of 16-token blocks on one engine.
pub const MAX_GPU_BLOCKS: u32 = 1 << 24;

/// Largest number of CPU slots of one engine, all groups together (`cpu_chunks` x groups),
/// and of one [`crate::pool::Pool`] (2^26). A slot costs about 40 bytes of bookkeeping: 2.5
/// GiB at the cap (1 TiB of 16 KiB chunks).
pub const MAX_CPU_SLOTS: u32 = 1 << 26;

/// Largest number of KV groups.
pub const MAX_GROUPS: usize = 64;

/// Largest number of workers (tensor-parallel x pipeline-parallel ranks) of one engine.
pub const MAX_WORKERS: u32 = crate::jobs::MAX_WORKERS;

/// Largest number of bytes of one chunk of one group on one worker (64 GiB), so that the byte
/// counters cannot overflow.
pub const MAX_BYTES_PER_CHUNK: u64 = 1 << 36;

/// The error for a value of the wrong type: `<field> must be <expected>, got <got>`.
pub fn type_error(field: &str, expected: &str, got: impl Display) -> Error {
    Error::Config(format!("{field} must be {expected}, got {got}"))
}

/// The error for a value out of range: `<field> must be in <min>..=<max>, got <got>`.
pub fn range_error(field: &str, min: u64, max: u64, got: impl Display) -> Error {
    Error::Config(format!("{field} must be in {min}..={max}, got {got}"))
}

/// Checks that `value` is in `min..=max`.
pub fn check_range(field: &str, value: i128, min: u64, max: u64) -> Result<u64> {
    if value >= i128::from(min) && value <= i128::from(max) {
        Ok(value as u64)
    } else {
        Err(range_error(field, min, max, value))
    }
}

fn check_u32(field: &str, value: i128, min: u32, max: u32) -> Result<u32> {
    check_range(field, value, u64::from(min), u64::from(max)).map(|v| v as u32)
}

/// Parses an eviction policy name (`"lru"` or `"arc"`, any case).
pub fn policy(name: &str) -> Result<PolicyKind> {
    name.parse()
}

/// Checks the sizes of a stand-alone job tracker: `(num_blocks, num_workers)`.
pub fn tracker_sizes(num_blocks: i128, num_workers: i128) -> Result<(u32, u32)> {
    Ok((
        check_u32("num_blocks", num_blocks, 1, MAX_GPU_BLOCKS)?,
        check_u32("num_workers", num_workers, 1, MAX_WORKERS)?,
    ))
}

/// Checks the configuration of a stand-alone CPU pool.
pub fn pool_config(capacity: i128, policy_name: &str, store_threshold: i128) -> Result<PoolConfig> {
    Ok(PoolConfig {
        capacity: check_u32("capacity", capacity, 1, MAX_CPU_SLOTS)?,
        policy: policy(policy_name)?,
        store_threshold: check_u32("store_threshold", store_threshold, 0, u32::MAX)?,
    })
}

/// Largest bound of a pool's event queue, in keys (2^28: 4 GiB of keys).
pub const MAX_EVENT_KEYS: u64 = 1 << 28;

/// Checks the bound of a pool's event queue, in keys (0: record no events).
pub fn event_limit(max_event_keys: i128) -> Result<usize> {
    check_range("max_event_keys", max_event_keys, 0, MAX_EVENT_KEYS).map(|v| v as usize)
}

/// Default share of a group's CPU slots that write-behind may pin (`tier_write_share`).
pub const DEFAULT_TIER_WRITE_SHARE: f64 = 0.125;

/// Checks `tier_write_share`, a number in (0, 1], and turns it into CPU slots of a group of
/// `cpu_chunks` slots (at least one).
pub fn tier_write_slots(share: f64, cpu_chunks: u32) -> Result<u32> {
    if !(share.is_finite() && share > 0.0 && share <= 1.0) {
        return Err(Error::Config(format!(
            "tier_write_share must be a number in (0, 1], got {share}"
        )));
    }
    let slots = (share * f64::from(cpu_chunks)).floor() as u32;
    Ok(slots.clamp(1, cpu_chunks.max(1)))
}

/// Default deadline of a disk promotion, in milliseconds (`disk_deadline_ms`).
pub const DEFAULT_DISK_DEADLINE_MS: u64 = 5000;

/// Checks a deadline of `field` in milliseconds: a number in (0, 3600000].
pub fn deadline_ms(field: &str, ms: f64) -> Result<std::time::Duration> {
    if ms.is_finite() && ms > 0.0 && ms <= 3_600_000.0 {
        Ok(std::time::Duration::from_secs_f64(ms / 1000.0))
    } else {
        Err(Error::Config(format!(
            "{field} must be a number of milliseconds in (0, 3600000], got {ms}"
        )))
    }
}

/// Checks the layout a tier worker (`what`) is opened with: `blocks_per_chunk >= 1`,
/// `0 <= rank < world_size`, and as many element types (`dtypes`, when given) as groups.
pub fn worker_layout(
    what: &str,
    blocks_per_chunk: u32,
    rank: u32,
    world_size: u32,
    dtypes: Option<usize>,
    groups: usize,
) -> Result<()> {
    if let Some(d) = dtypes.filter(|&d| d != groups) {
        return Err(Error::Config(format!(
            "{what}: dtypes has {d} entries, the pool has {groups} groups"
        )));
    }
    if blocks_per_chunk == 0 || world_size == 0 || rank >= world_size {
        return Err(Error::Config(format!(
            "{what}: blocks_per_chunk={blocks_per_chunk}, rank={rank}, \
             world_size={world_size}: need blocks_per_chunk >= 1 and 0 <= rank < world_size"
        )));
    }
    Ok(())
}

/// Checks the timeout of a wait for tier jobs, in seconds (finite, `>= 0`; capped at 1e9 s).
pub fn wait_timeout(secs: f64) -> Result<std::time::Duration> {
    if secs.is_finite() && secs >= 0.0 {
        Ok(std::time::Duration::from_secs_f64(secs.min(1e9)))
    } else {
        Err(Error::Config(format!(
            "wait: timeout={secs} must be a finite number of seconds >= 0"
        )))
    }
}

/// One KV group as the caller gave it (see [`GroupConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupArgs {
    /// Tokens per GPU block.
    pub block_size: i128,
    /// Sliding window in tokens; `None` for full attention.
    pub sliding_window: Option<i128>,
    /// Bytes of one GPU block of this group on one worker, all layers (0 if unknown).
    pub bytes_per_block: i128,
}

/// The scheduler's configuration as the caller gave it: integers are not yet narrowed, the CPU
/// capacity is given in chunks or in bytes. [`SchedulerArgs::resolve`] checks every value.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerArgs {
    /// The engine's KV groups, in order.
    pub groups: Vec<GroupArgs>,
    /// GPU blocks per chunk.
    pub blocks_per_chunk: i128,
    /// Tokens per chained prefix hash; `None`: the first group's block size.
    pub hash_block_size: Option<i128>,
    /// GPU blocks of the engine.
    pub num_gpu_blocks: i128,
    /// The engine's null block id, if any.
    pub null_block: Option<i128>,
    /// CPU slots per group (exactly one of `cpu_chunks` and `cpu_bytes`).
    pub cpu_chunks: Option<i128>,
    /// CPU bytes, all groups together.
    pub cpu_bytes: Option<i128>,
    /// Eviction policy name.
    pub policy: String,
    /// Workers that report each job.
    pub num_workers: i128,
    /// At most this many requests loading at once (0: no limit).
    pub max_loading_requests: i128,
    /// Store prompt tokens only.
    pub offload_prompt_only: bool,
    /// Store at most this many tokens of a request.
    pub max_offload_tokens: Option<i128>,
    /// Lookups before a chunk is stored.
    pub store_threshold: i128,
    /// Most share of each group's CPU slots that write-behind to lower tiers may pin at once.
    pub tier_write_share: f64,
    /// Testing only: a deliberately broken fence.
    pub debug_skip_deferred_arming: bool,
    /// The lower tiers' options.
    pub tiers: TierArgs,
}

impl SchedulerArgs {
    /// `groups` and `num_gpu_blocks` with every other option at the default a Rust caller (or
    /// a Python caller of the core that omits it) gets: one block per chunk, hashes per first
    /// group's block, block 0 the null block, LRU, one worker, every limit off, no lower tier.
    /// The CPU capacity has no default.
    pub fn new(groups: Vec<GroupArgs>, num_gpu_blocks: i128) -> Self {
        Self {
            groups,
            blocks_per_chunk: 1,
            hash_block_size: None,
            num_gpu_blocks,
            null_block: Some(0),
            cpu_chunks: None,
            cpu_bytes: None,
            policy: "lru".into(),
            num_workers: 1,
            max_loading_requests: 0,
            offload_prompt_only: false,
            max_offload_tokens: None,
            store_threshold: 0,
            tier_write_share: DEFAULT_TIER_WRITE_SHARE,
            debug_skip_deferred_arming: false,
            tiers: TierArgs::default(),
        }
    }

    /// Checks every value and combination; the CPU capacity in bytes becomes slots per group.
    pub fn resolve(&self) -> Result<SchedulerConfig> {
        if self.groups.is_empty() {
            return Err(Error::Config("at least one KV group is needed".into()));
        }
        if self.groups.len() > MAX_GROUPS {
            return Err(range_error(
                "the number of KV groups",
                1,
                MAX_GROUPS as u64,
                self.groups.len(),
            ));
        }
        let blocks_per_chunk = check_u32("blocks_per_chunk", self.blocks_per_chunk, 1, u32::MAX)?;
        let mut groups = Vec::with_capacity(self.groups.len());
        for (g, grp) in self.groups.iter().enumerate() {
            let block_size = check_u32(
                &format!("groups[{g}].block_size"),
                grp.block_size,
                1,
                u32::MAX,
            )?;
            let sliding_window = grp
                .sliding_window
                .map(|w| check_u32(&format!("groups[{g}].sliding_window"), w, 1, u32::MAX))
                .transpose()?;
            let field = format!("groups[{g}].bytes_per_block");
            let bytes_per_block = check_range(&field, grp.bytes_per_block, 0, MAX_BYTES_PER_CHUNK)?;
            let bytes_per_chunk = bytes_per_block * u64::from(blocks_per_chunk);
            if bytes_per_chunk > MAX_BYTES_PER_CHUNK {
                return Err(Error::Config(format!(
                    "group {g}: a chunk of {blocks_per_chunk} blocks of {bytes_per_block} bytes \
                     is {bytes_per_chunk} bytes, above the cap of {MAX_BYTES_PER_CHUNK}: lower \
                     blocks_per_chunk"
                )));
            }
            groups.push(GroupConfig {
                block_size,
                sliding_window,
                bytes_per_chunk,
            });
        }
        let hash_block_size = match self.hash_block_size {
            Some(h) => check_u32("hash_block_size", h, 1, u32::MAX)?,
            None => groups[0].block_size,
        };
        let num_gpu_blocks = check_u32("num_gpu_blocks", self.num_gpu_blocks, 1, MAX_GPU_BLOCKS)?;
        let null_block = self
            .null_block
            .map(|n| check_u32("null_block", n, 0, num_gpu_blocks - 1).map(BlockId))
            .transpose()?;
        let max_slots = MAX_CPU_SLOTS / groups.len() as u32;
        let cpu_chunks = match (self.cpu_chunks, self.cpu_bytes) {
            (Some(c), None) => check_u32("cpu_chunks", c, 1, max_slots).map_err(|e| {
                if c == 0 {
                    Error::Config(
                        "cpu_chunks must be at least 1, got 0: raise cpu_bytes or cpu_chunks"
                            .into(),
                    )
                } else if groups.len() > 1 && c > 0 {
                    Error::Config(format!(
                        "cpu_chunks must be in 1..={max_slots} ({MAX_CPU_SLOTS} CPU slots in all, \
                         {} groups), got {c}",
                        groups.len()
                    ))
                } else {
                    e
                }
            })?,
            (None, Some(b)) => {
                let bytes = check_range("cpu_bytes", b, 0, u64::MAX)?;
                let per_slot: u64 = groups.iter().map(|g| g.bytes_per_chunk).sum();
                if per_slot == 0 {
                    return Err(Error::Config(
                        "cpu_bytes needs bytes_per_block on every KV group".into(),
                    ));
                }
                let chunks = bytes / per_slot;
                if chunks == 0 {
                    return Err(Error::Config(format!(
                        "cpu_bytes {bytes} holds no chunk ({per_slot} bytes per chunk across \
                         groups): raise cpu_bytes"
                    )));
                }
                if chunks > u64::from(max_slots) {
                    return Err(Error::Config(format!(
                        "cpu_bytes {bytes} is {chunks} chunks of {per_slot} bytes, above the cap \
                         of {max_slots} per group ({MAX_CPU_SLOTS} CPU slots in all): lower \
                         cpu_bytes or raise blocks_per_chunk"
                    )));
                }
                chunks as u32
            }
            _ => {
                return Err(Error::Config(
                    "give exactly one of cpu_chunks and cpu_bytes".into(),
                ))
            }
        };
        let cfg = SchedulerConfig {
            groups,
            blocks_per_chunk,
            hash_block_size,
            num_gpu_blocks,
            null_block,
            cpu_chunks,
            policy: policy(&self.policy)?,
            num_workers: check_u32("num_workers", self.num_workers, 1, MAX_WORKERS)?,
            max_loading_requests: check_u32(
                "max_loading_requests",
                self.max_loading_requests,
                0,
                u32::MAX,
            )?,
            offload_prompt_only: self.offload_prompt_only,
            max_offload_tokens: self
                .max_offload_tokens
                .map(|m| check_u32("max_offload_tokens", m, 0, u32::MAX))
                .transpose()?,
            store_threshold: check_u32("store_threshold", self.store_threshold, 0, u32::MAX)?,
            tier_write_slots: tier_write_slots(self.tier_write_share, cpu_chunks)?,
            debug_skip_deferred_arming: self.debug_skip_deferred_arming,
            tiers: self.tiers.resolve()?,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// One KV group: layers sharing one block table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupConfig {
    /// Tokens per GPU block.
    pub block_size: u32,
    /// Sliding window in tokens; `None` for full attention.
    pub sliding_window: Option<u32>,
    /// Bytes of one chunk of this group (all layers, one worker), for the byte counters; 0 if
    /// unknown.
    pub bytes_per_chunk: u64,
}

/// Everything the scheduler core needs to know about the engine and the CPU tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// The engine's KV groups, in the engine's order.
    pub groups: Vec<GroupConfig>,
    /// GPU blocks per chunk (the unit of offloading).
    pub blocks_per_chunk: u32,
    /// Tokens per chained prefix hash the engine computes.
    pub hash_block_size: u32,
    /// GPU blocks of the engine (block ids are `0..num_gpu_blocks`).
    pub num_gpu_blocks: u32,
    /// The engine's null block id, if it has one (never stored, never loaded).
    pub null_block: Option<BlockId>,
    /// CPU slots per group (one slot holds one chunk).
    pub cpu_chunks: u32,
    /// Eviction policy of the CPU pools.
    pub policy: PolicyKind,
    /// Workers (tensor-parallel ranks) that must report each job.
    pub num_workers: u32,
    /// At most this many requests loading at once (0: no limit).
    pub max_loading_requests: u32,
    /// Store only prompt tokens, not generated ones.
    pub offload_prompt_only: bool,
    /// Store at most this many tokens of a request.
    pub max_offload_tokens: Option<u32>,
    /// Store a chunk only after it was looked up this many times (0 or 1: always).
    pub store_threshold: u32,
    /// Most CPU slots of each group that write-behind jobs to lower tiers pin at once (from
    /// `tier_write_share`); past it a write is skipped, never a store.
    pub tier_write_slots: u32,
    /// Testing only: never arm deferred pairs (a deliberately broken fence, so that the
    /// integrity oracle can show it fails).
    pub debug_skip_deferred_arming: bool,
    /// The lower tiers [`crate::scheduler::Scheduler::open`] attaches (none by default).
    pub tiers: TierConfig,
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl SchedulerConfig {
    /// A configuration of `groups`, `num_gpu_blocks` GPU blocks (block 0 the null block) and
    /// `cpu_chunks` CPU slots with one block per chunk, hashes per first group's block, LRU, one
    /// worker, and every limit off; set other fields with struct update syntax. Not validated.
    pub fn new(groups: Vec<GroupConfig>, num_gpu_blocks: u32, cpu_chunks: u32) -> Self {
        let hash_block_size = groups.first().map_or(1, |g| g.block_size);
        SchedulerConfig {
            groups,
            blocks_per_chunk: 1,
            hash_block_size,
            num_gpu_blocks,
            null_block: Some(BlockId(0)),
            cpu_chunks,
            policy: PolicyKind::Lru,
            num_workers: 1,
            max_loading_requests: 0,
            offload_prompt_only: false,
            max_offload_tokens: None,
            store_threshold: 0,
            tier_write_slots: tier_write_slots(DEFAULT_TIER_WRITE_SHARE, cpu_chunks).unwrap_or(1),
            debug_skip_deferred_arming: false,
            tiers: TierConfig::default(),
        }
    }

    /// Checks every value and combination, caps included.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.groups.is_empty() {
            return bad("at least one KV group is needed".into());
        }
        if self.groups.len() > MAX_GROUPS {
            return Err(range_error(
                "the number of KV groups",
                1,
                MAX_GROUPS as u64,
                self.groups.len(),
            ));
        }
        let n = i128::from;
        check_u32("blocks_per_chunk", n(self.blocks_per_chunk), 1, u32::MAX)?;
        check_u32("hash_block_size", n(self.hash_block_size), 1, u32::MAX)?;
        check_u32("num_gpu_blocks", n(self.num_gpu_blocks), 1, MAX_GPU_BLOCKS)?;
        let max_slots = MAX_CPU_SLOTS / self.groups.len() as u32;
        if self.cpu_chunks == 0 {
            return bad(
                "cpu_chunks must be at least 1, got 0: raise cpu_bytes or cpu_chunks".into(),
            );
        }
        check_u32("cpu_chunks", n(self.cpu_chunks), 1, max_slots)?;
        check_u32("num_workers", n(self.num_workers), 1, MAX_WORKERS)?;
        check_u32(
            "tier_write_slots",
            n(self.tier_write_slots),
            1,
            self.cpu_chunks,
        )?;
        if let Some(b) = self.null_block {
            check_u32("null_block", n(b.0), 0, self.num_gpu_blocks - 1)?;
        }
        for (g, grp) in self.groups.iter().enumerate() {
            check_u32(
                &format!("groups[{g}].block_size"),
                n(grp.block_size),
                1,
                u32::MAX,
            )?;
            check_range(
                &format!("groups[{g}].bytes_per_chunk"),
                i128::from(grp.bytes_per_chunk),
                0,
                MAX_BYTES_PER_CHUNK,
            )?;
            let chunk = u64::from(grp.block_size) * u64::from(self.blocks_per_chunk);
            if chunk > u64::from(u32::MAX) {
                return bad(format!(
                    "group {g}: a chunk is {chunk} tokens (block_size {} x blocks_per_chunk {}), \
                     above 2**32 - 1: lower blocks_per_chunk",
                    grp.block_size, self.blocks_per_chunk
                ));
            }
            if chunk % u64::from(self.hash_block_size) != 0 {
                return bad(format!(
                    "group {g}: a chunk is {chunk} tokens (block_size {} x blocks_per_chunk {}), \
                     not a multiple of hash_block_size {}; change blocks_per_chunk or \
                     hash_block_size so that it divides",
                    grp.block_size, self.blocks_per_chunk, self.hash_block_size
                ));
            }
            if let Some(w) = grp.sliding_window {
                if u64::from(w) < chunk {
                    return bad(format!(
                        "group {g}: sliding_window {w} is smaller than a chunk ({chunk} tokens); \
                         lower blocks_per_chunk to at most {}",
                        (w / grp.block_size).max(1)
                    ));
                }
            }
        }
        // The least common multiple of the chunk sizes, without overflow.
        let mut align = 1u64;
        for grp in &self.groups {
            let c = u64::from(grp.block_size) * u64::from(self.blocks_per_chunk);
            align = (align / gcd(align, c))
                .checked_mul(c)
                .filter(|&a| u32::try_from(a).is_ok())
                .ok_or_else(|| {
                    Error::Config(
                        "the chunk sizes of the groups have no common multiple below 2**32".into(),
                    )
                })?;
        }
        Ok(())
    }

    /// Tokens per chunk of group `g`.
    pub fn chunk_tokens(&self, g: usize) -> u32 {
        self.groups[g].block_size * self.blocks_per_chunk
    }

    /// Least common multiple of the groups' chunk sizes: loads are aligned to it.
    pub fn align_tokens(&self) -> u64 {
        (0..self.groups.len()).fold(1u64, |acc, g| {
            let c = u64::from(self.chunk_tokens(g));
            acc / gcd(acc, c) * c
        })
    }

    /// Whether any group has a sliding window.
    pub fn has_window(&self) -> bool {
        self.groups.iter().any(|g| g.sliding_window.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> SchedulerArgs {
        let group = GroupArgs {
            block_size: 16,
            sliding_window: None,
            bytes_per_block: 1024,
        };
        SchedulerArgs {
            blocks_per_chunk: 2,
            cpu_chunks: Some(8),
            ..SchedulerArgs::new(vec![group], 64)
        }
    }

    fn message(a: &SchedulerArgs) -> String {
        match a.resolve() {
            Err(Error::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn tier_write_share_becomes_at_least_one_slot_and_bad_shares_are_refused() {
        let mut a = args();
        assert_eq!(a.resolve().unwrap().tier_write_slots, 1, "1/8 of 8 slots");
        a.cpu_chunks = Some(1000);
        assert_eq!(a.resolve().unwrap().tier_write_slots, 125);
        a.tier_write_share = 1.0;
        assert_eq!(a.resolve().unwrap().tier_write_slots, 1000);
        for bad in [0.0, -0.1, 1.01, f64::NAN, f64::INFINITY] {
            a.tier_write_share = bad;
            assert!(message(&a).contains("tier_write_share"), "{bad}");
        }
    }

    #[test]
    fn resolves_defaults_and_bytes() {
        let cfg = args().resolve().unwrap();
        assert_eq!(cfg.hash_block_size, 16);
        assert_eq!(cfg.groups[0].bytes_per_chunk, 2048);
        let mut a = args();
        a.cpu_chunks = None;
        a.cpu_bytes = Some(2048 * 5 + 7);
        assert_eq!(a.resolve().unwrap().cpu_chunks, 5);
    }

    #[test]
    fn sizes_that_cannot_be_served_name_the_field() {
        let mut a = args();
        a.num_gpu_blocks = i128::from(u32::MAX);
        assert_eq!(
            message(&a),
            "num_gpu_blocks must be in 1..=16777216, got 4294967295"
        );
        a.num_gpu_blocks = i128::from(MAX_GPU_BLOCKS);
        a.null_block = Some(i128::from(MAX_GPU_BLOCKS));
        assert!(message(&a).starts_with("null_block must be in 0..=16777215"));
        let mut a = args();
        a.cpu_chunks = Some(i128::from(MAX_CPU_SLOTS) + 1);
        assert!(message(&a).starts_with("cpu_chunks must be in 1..=67108864"));
        // The cap counts every group's slots.
        a.groups.push(a.groups[0]);
        a.cpu_chunks = Some(i128::from(MAX_CPU_SLOTS / 2) + 1);
        assert!(message(&a).contains("cpu_chunks must be in 1..=33554432"));
        a.cpu_chunks = None;
        a.cpu_bytes = Some(i128::from(u64::MAX));
        assert!(message(&a).contains("cpu_bytes"));
        let mut a = args();
        a.num_workers = i128::from(MAX_WORKERS) + 1;
        assert!(message(&a).starts_with(&format!("num_workers must be in 1..={MAX_WORKERS}")));
        let mut a = args();
        a.groups[0].bytes_per_block = i128::from(MAX_BYTES_PER_CHUNK);
        assert!(message(&a).contains("lower blocks_per_chunk"));
        assert_eq!(
            tracker_sizes(i128::from(u32::MAX), 1),
            Err(range_error("num_blocks", 1, 16_777_216, 4_294_967_295u64))
        );
        assert!(pool_config(i128::from(MAX_CPU_SLOTS) + 1, "lru", 0).is_err());
        assert!(event_limit(-1).is_err());
    }

    #[test]
    fn values_of_the_wrong_range_are_printed_as_given() {
        let mut a = args();
        a.max_offload_tokens = Some(-(1i128 << 70));
        assert_eq!(
            message(&a),
            format!(
                "max_offload_tokens must be in 0..=4294967295, got {}",
                -(1i128 << 70)
            )
        );
        let mut a = args();
        a.policy = "fifo".into();
        assert!(message(&a).contains("\"fifo\""));
        let mut a = args();
        a.cpu_bytes = Some(10);
        assert_eq!(message(&a), "give exactly one of cpu_chunks and cpu_bytes");
    }

    #[test]
    fn chunk_sizes_never_overflow() {
        let mut a = args();
        a.groups[0].block_size = 1 << 20;
        a.blocks_per_chunk = 1 << 20;
        a.hash_block_size = Some(1);
        assert!(message(&a).contains("above 2**32 - 1"));
        // Three coprime chunk sizes whose common multiple is beyond 2**32.
        let mut a = args();
        a.blocks_per_chunk = 1;
        a.hash_block_size = Some(1);
        a.groups = [65_521, 65_519, 65_497]
            .into_iter()
            .map(|b| GroupArgs {
                block_size: b,
                sliding_window: None,
                bytes_per_block: 0,
            })
            .collect();
        assert!(message(&a).contains("no common multiple below 2**32"));
    }

    #[test]
    fn validate_caps_a_config_built_in_rust() {
        let mut cfg = args().resolve().unwrap();
        cfg.num_gpu_blocks = u32::MAX;
        assert!(cfg.validate().is_err());
        let mut cfg = args().resolve().unwrap();
        cfg.cpu_chunks = MAX_CPU_SLOTS + 1;
        assert!(cfg.validate().is_err());
    }
}
