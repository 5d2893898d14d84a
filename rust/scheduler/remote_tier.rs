//! Attaching the shared (Redis) tier: one [`RemoteIndex`] per KV group over one client, keyed
//! by the same namespaces the workers write under (every rank's; optional tenant salt).

use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::tier::remote::RemoteClient;
use crate::tier::remote_index::{RemoteIndex, RemoteIndexConfig};

use super::Scheduler;

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
                    self.tier_namespace(g, rank, model)
                        .salted(cache_salt)
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
