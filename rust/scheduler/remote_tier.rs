//! Attaching the shared (Redis) tier: one [`RemoteIndex`] per KV group over one client, keyed
//! by the same namespaces the workers write under (every rank's; optional tenant salt).

use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::tier::disk::engine_namespace;
use crate::tier::namespace::Namespace;
use crate::tier::remote::RemoteClient;
use crate::tier::remote_index::{RemoteIndex, RemoteIndexConfig};

use super::Scheduler;

/// The namespace of group `group`'s chunks on worker `rank` in the shared tier: the disk
/// tier's engine namespace plus the tenant `cache_salt`.
#[allow(clippy::too_many_arguments)] // one per namespace field
pub fn remote_namespace(
    model: &str,
    cache_salt: &str,
    chunk_bytes: u64,
    block_size: u32,
    blocks_per_chunk: u32,
    rank: u32,
    world_size: u32,
    group: u32,
) -> Namespace {
    Namespace {
        cache_salt: cache_salt.to_owned(),
        ..engine_namespace(
            model,
            chunk_bytes,
            block_size,
            blocks_per_chunk,
            rank,
            world_size,
            group,
        )
    }
}

impl Scheduler {
    /// Attaches the shared tier of `client` to every group: present chunks are promoted into
    /// the CPU pool, chunks stored in the CPU pool are written behind. Existence answers are
    /// trusted for `ttl` (present) and `retry` (absent). All or nothing. A group may have a
    /// disk tier too: lookups promote from the disk first.
    pub fn attach_remote(
        &mut self,
        client: &Arc<RemoteClient>,
        model: &str,
        cache_salt: &str,
        ttl: Duration,
        retry: Duration,
    ) -> Result<()> {
        let mut indexes = Vec::with_capacity(self.cfg.groups.len());
        for g in 0..self.cfg.groups.len() {
            self.tier_chunk_bytes(g, "remote")?;
            let namespaces = (0..self.cfg.num_workers)
                .map(|rank| {
                    Namespace {
                        cache_salt: cache_salt.to_owned(),
                        ..self.tier_namespace(g, rank, model)
                    }
                    .digest()
                })
                .collect();
            let rc = RemoteIndexConfig {
                namespaces,
                ttl,
                retry,
            };
            indexes.push(RemoteIndex::new(Arc::clone(client), rc)?);
        }
        self.attach_all("attach_remote", indexes)
    }
}
