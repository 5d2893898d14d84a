//! Attaching lower tiers (DESIGN.md §9) before the first request, those a configuration names
//! ([`Scheduler::open`]) or any [`TierIndex`] per
//! group, the disk tier (one [`DiskIndex`] per group, rebuilt from every rank's headers, with
//! its deadline and probation: [`DiskWatch`]) and the shared (Redis) tier (one
//! [`RemoteIndex`] per group over one client, keyed by the namespaces the workers write
//! under: every rank's, with the optional tenant salt). Nearest first: local tiers before the
//! shared one. What the attached tiers do is `mod.rs`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{SchedulerConfig, REMOTE_RETRY, REMOTE_TTL};
use crate::error::{Error, Result};
use crate::tier::affinity::CpuSet;
use crate::tier::disk::{engine_namespace, scan_namespace, DiskIndex, SlabLayout};
use crate::tier::health::Health;
use crate::tier::namespace::Namespace;
use crate::tier::remote::{RemoteClient, RemoteIndex, RemoteIndexConfig};
use crate::tier::{Medium, TierIndex};

use super::{DiskWatch, GroupTier, TierAdmission};
use crate::scheduler::Scheduler;

impl Scheduler {
    /// A scheduler for `cfg` with the lower tiers `cfg.tiers` names attached, each with its
    /// admission filter: the disk tier, then the shared tier (its client connects once now, its
    /// lookup threads on `cfg.tiers.io_cpus`). All or nothing.
    pub fn open(cfg: SchedulerConfig) -> Result<Self> {
        let tiers = cfg.tiers.clone();
        let mut s = Self::new(cfg)?;
        if let Some(d) = &tiers.disk {
            s.attach_disk_with(&d.path, d.bytes, &d.model, d.watch)?;
            s.set_tier_admission(Medium::Disk, d.admission);
        }
        if let Some(r) = &tiers.remote {
            let client = Arc::new(RemoteClient::new(r.client.clone())?);
            s.attach_remote(
                &client,
                &r.model,
                &r.cache_salt,
                REMOTE_TTL,
                REMOTE_RETRY,
                tiers.io_cpus.as_ref(),
            )?;
            s.set_tier_admission(Medium::Remote, r.admission);
        }
        Ok(s)
    }

    /// Attaches a lower tier to KV group `group` (before the first request is added), written
    /// behind to as `admission` says. A group may have one tier per medium; lookups promote
    /// from the nearest tier holding a chunk (local tiers before the shared one). Chunks become
    /// readable through a tier only by promotion into the CPU pool.
    pub fn attach_tier(&mut self, group: u32, index: Box<dyn TierIndex>) -> Result<()> {
        self.attach_tier_with(group, index, TierAdmission::default())
    }

    /// [`Scheduler::attach_tier`] with an admission filter.
    pub fn attach_tier_with(
        &mut self,
        group: u32,
        index: Box<dyn TierIndex>,
        admission: TierAdmission,
    ) -> Result<()> {
        let g = group as usize;
        if g >= self.cfg.groups.len() {
            return Err(Error::Config(format!(
                "attach_tier: group {group} does not exist, the scheduler has {} groups",
                self.cfg.groups.len()
            )));
        }
        self.check_no_requests("attach_tier")?;
        let medium = index.medium();
        if self
            .tiers
            .get(g)
            .is_some_and(|ts| ts.iter().any(|t| t.index.medium() == medium))
        {
            return Err(Error::Config(format!(
                "attach_tier: group {group} has a {medium} tier already"
            )));
        }
        self.tiers.resize_with(self.cfg.groups.len(), Vec::new);
        let tiers = &mut self.tiers[g];
        tiers.push(GroupTier::new(index, group, admission));
        // Nearest first: the shared tier after the local ones.
        tiers.sort_by_key(|t| t.index.medium() == Medium::Remote);
        Ok(())
    }

    /// Sets the admission filter of every group's tier of `medium`; returns how many tiers
    /// it set (0: no such tier).
    pub fn set_tier_admission(&mut self, medium: Medium, admission: TierAdmission) -> usize {
        let mut n = 0;
        for t in self.tiers.iter_mut().flatten() {
            if t.index.medium() == medium {
                t.admission = admission;
                n += 1;
            }
        }
        n
    }

    /// `Err` naming `what` once a request or a job exists (tiers attach before them).
    pub(in crate::scheduler) fn check_no_requests(&self, what: &str) -> Result<()> {
        if !self.index.is_empty() || !self.tracker.jobs().is_empty() {
            return Err(Error::Config(format!(
                "{what}: attach tiers before the first request"
            )));
        }
        Ok(())
    }

    /// Attaches a disk tier under `root` to every group: `disk_bytes` per group and worker,
    /// namespaces from `model` and the configuration ([`engine_namespace`]), each index rebuilt
    /// from every rank's headers. All or nothing.
    pub fn attach_disk(&mut self, root: &Path, disk_bytes: u64, model: &str) -> Result<()> {
        self.attach_disk_with(root, disk_bytes, model, DiskWatch::default())
    }

    /// [`Scheduler::attach_disk`] with a promotion deadline, probation settings and a write
    /// rate limit.
    pub fn attach_disk_with(
        &mut self,
        root: &Path,
        disk_bytes: u64,
        model: &str,
        watch: DiskWatch,
    ) -> Result<()> {
        let health = Health::new(
            "disk_probation_after",
            watch.probation_after,
            watch.probation,
        )?;
        for (field, d) in [
            ("disk_deadline_ms", watch.deadline),
            ("disk_probation_ms", watch.probation),
        ] {
            if d.is_zero() {
                return Err(Error::Config(format!("{field} must be positive, got 0")));
            }
        }
        let mut indexes = Vec::with_capacity(self.cfg.groups.len());
        for g in 0..self.cfg.groups.len() {
            let chunk = self.tier_chunk_bytes(g, Medium::Disk)?;
            let layout = SlabLayout::new(chunk, disk_bytes)?;
            let scans = (0..self.cfg.num_workers)
                .map(|rank| scan_namespace(root, &self.tier_namespace(g, rank, model), layout))
                .collect::<Result<Vec<_>>>()?;
            indexes.push(DiskIndex::recover(layout, self.cfg.policy, &scans)?);
        }
        self.attach_all("attach_disk", indexes)?;
        for (g, ts) in self.tiers.iter_mut().enumerate() {
            let chunk = self.cfg.groups[g].bytes_per_chunk;
            for t in ts {
                if t.index.medium() == Medium::Disk {
                    t.deadline = Some(watch.deadline);
                    t.health = Some(health.clone());
                    t.pacer = (watch.write_bytes_per_s > 0)
                        .then(|| super::Pacer::new(watch.write_bytes_per_s, chunk));
                }
            }
        }
        Ok(())
    }

    /// Bytes of a chunk of group `g` (a lower tier of `medium` needs them).
    pub(in crate::scheduler) fn tier_chunk_bytes(&self, g: usize, medium: Medium) -> Result<u64> {
        match self.cfg.groups[g].bytes_per_chunk {
            0 => Err(Error::Config(format!(
                "{medium} tier: group {g} has bytes_per_chunk=0; a lower tier needs the size of \
                 a chunk"
            ))),
            n => Ok(n),
        }
    }

    /// The engine namespace of group `g`'s chunks on worker `rank` ([`engine_namespace`]).
    pub(in crate::scheduler) fn tier_namespace(
        &self,
        g: usize,
        rank: u32,
        model: &str,
    ) -> Namespace {
        let (cfg, gc) = (&self.cfg, &self.cfg.groups[g]);
        engine_namespace(
            model,
            gc.bytes_per_chunk,
            gc.block_size,
            cfg.blocks_per_chunk,
            rank,
            cfg.num_workers,
            g as u32,
        )
    }

    /// Attaches one index per group (group `i` gets `indexes[i]`), all or nothing.
    pub(in crate::scheduler) fn attach_all<T: TierIndex + 'static>(
        &mut self,
        what: &str,
        indexes: Vec<T>,
    ) -> Result<()> {
        self.check_no_requests(what)?;
        if let Some(g) = (0..indexes.len()).find(|&g| {
            let m = indexes[g].medium();
            self.tiers
                .get(g)
                .is_some_and(|ts| ts.iter().any(|t| t.index.medium() == m))
        }) {
            return Err(Error::Config(format!(
                "{what}: group {g} has a {} tier already",
                indexes[g].medium()
            )));
        }
        for (g, idx) in indexes.into_iter().enumerate() {
            self.attach_tier(g as u32, Box::new(idx))?;
        }
        Ok(())
    }

    /// Attaches the shared tier of `client` to every group: present chunks are promoted into
    /// the CPU pool, chunks stored in the CPU pool are written behind. Existence answers are
    /// trusted for `ttl` (present) and `retry` (absent). All or nothing. A group may have a
    /// disk tier too: lookups promote from the disk first. Each group's lookup thread runs
    /// on `cpus` when given (`io_cpus`).
    pub fn attach_remote(
        &mut self,
        client: &Arc<RemoteClient>,
        model: &str,
        cache_salt: &str,
        ttl: Duration,
        retry: Duration,
        cpus: Option<&CpuSet>,
    ) -> Result<()> {
        let mut indexes = Vec::with_capacity(self.cfg.groups.len());
        for g in 0..self.cfg.groups.len() {
            self.tier_chunk_bytes(g, Medium::Remote)?;
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
                cpus: cpus.cloned(),
            };
            indexes.push(RemoteIndex::new(Arc::clone(client), rc)?);
        }
        self.attach_all("attach_remote", indexes)
    }
}
