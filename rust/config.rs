//! Scheduler configuration, validated once at construction so that the hot path can trust it.
//!
//! Every rejection says what to change: block sizes that do not divide the hash granularity,
//! a sliding window smaller than a chunk, a zero capacity.

use crate::error::{Error, Result};
use crate::policy::PolicyKind;

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
    pub null_block: Option<u32>,
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
    /// Testing only: never arm deferred pairs (a deliberately broken fence, so that the
    /// integrity oracle can show it fails).
    pub debug_skip_deferred_arming: bool,
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl SchedulerConfig {
    /// Checks every value and combination.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.groups.is_empty() {
            return bad("at least one KV group is needed".into());
        }
        if self.blocks_per_chunk == 0 {
            return bad("blocks_per_chunk must be at least 1, got 0".into());
        }
        if self.hash_block_size == 0 {
            return bad("hash_block_size must be at least 1, got 0".into());
        }
        if self.num_gpu_blocks == 0 {
            return bad("num_gpu_blocks must be at least 1, got 0".into());
        }
        if self.cpu_chunks == 0 {
            return bad("CPU capacity is zero chunks: raise cpu_bytes or cpu_chunks".into());
        }
        if self.num_workers == 0 {
            return bad("num_workers must be at least 1, got 0".into());
        }
        if let Some(n) = self.null_block {
            if n >= self.num_gpu_blocks {
                return bad(format!(
                    "null_block {n} is outside the engine's {} blocks",
                    self.num_gpu_blocks
                ));
            }
        }
        for (g, grp) in self.groups.iter().enumerate() {
            if grp.block_size == 0 {
                return bad(format!("group {g}: block_size must be at least 1, got 0"));
            }
            let chunk = u64::from(grp.block_size) * u64::from(self.blocks_per_chunk);
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
        if self.align_tokens() > u64::from(u32::MAX) {
            return bad("the chunk sizes of the groups have no common multiple below 2**32".into());
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
