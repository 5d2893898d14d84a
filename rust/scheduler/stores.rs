//! Store planning: full chunks below a request's watermark that no store covers yet become one
//! store job per request and step, with slots reserved in each group's pool (at most a pool's
//! worth of chunks per attempt; no room: retried next step). Chunks with a dropped position are
//! skipped and counted.

use crate::ids::{BlockId, Key, SlotId};
use crate::jobs::JobKind;

use super::plan::{GroupTransfer, PlannedJob};
use super::requests::Status;
use super::{JobPayload, Scheduler};

/// Store planning's per-request working lists, kept by the scheduler between calls so that
/// planning a request allocates only what its job and plan keep.
#[derive(Debug, Default)]
pub(super) struct StoreScratch {
    /// One group's candidate keys (full chunks with all their blocks).
    keys: Vec<Key>,
    /// The chunk index of each of `keys`.
    chunks: Vec<u32>,
    /// `(chunk, slot)` of each chunk the pool reserved a slot for, in one group.
    hints: Vec<(u32, SlotId)>,
    /// `(group, cursor)` to set once every group is planned.
    cursors: Vec<(usize, u32)>,
    /// A dropped request's keys to refresh in one group (`requests.rs`), where a chunk spans
    /// several hash blocks.
    pub(super) refresh_keys: Vec<Key>,
    /// The slot hint of each of `refresh_keys`.
    pub(super) refresh_hints: Vec<SlotId>,
}

impl Scheduler {
    /// Plans the stores of each request of `work` once per step and drops the finished ones
    /// that have nothing left.
    pub(super) fn plan_all(&mut self, work: &[u32], stores: &mut Vec<PlannedJob>) {
        let step = self.step;
        if self.queued.len() < self.reqs.len() {
            self.queued.resize(self.reqs.len(), u64::MAX);
        }
        for &i in work {
            if self.queued[i as usize] == step || self.reqs[i as usize].is_none() {
                continue;
            }
            self.queued[i as usize] = step;
            self.plan_stores(i, stores);
            self.maybe_drop(i);
        }
    }

    /// Plans the stores of request `i`: full chunks below its watermark not handled yet.
    pub(super) fn plan_stores(&mut self, i: u32, out: &mut Vec<PlannedJob>) {
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
        if wm < r.store_due {
            // Nothing to store (most running requests in most steps), known without reading
            // the block tables.
            debug_assert!(!self.below_watermark(r, wm));
            return;
        }
        let due = self.store_due(r);
        if wm < due {
            self.req_mut(i).store_due = due;
            return;
        }
        let bpc = self.cfg.blocks_per_chunk;
        let owner = r.owner;
        let mut sc = std::mem::take(&mut self.store_scratch);
        sc.cursors.clear();
        let mut transfers = Vec::new();
        let mut slots = Vec::new();
        let (mut eager, mut deferred) = (Vec::new(), Vec::new());
        let mut retry = false;
        for g in 0..self.cfg.groups.len() {
            let r = self.req(i);
            let rg = &r.groups[g];
            let limit = wm / self.cfg.chunk_tokens(g);
            let mut c = rg.cursor;
            sc.keys.clear();
            sc.chunks.clear();
            let mut dropped = 0;
            // At most a pool's worth of chunks per attempt, so a long request still fits.
            while c < limit && sc.keys.len() < self.cfg.cpu_chunks as usize {
                let Some(key) = self.key(r, g, c) else {
                    break;
                };
                let Some(blocks) = rg.blocks.get((c * bpc) as usize..((c + 1) * bpc) as usize)
                else {
                    break;
                };
                if blocks.contains(&BlockId::NULL) {
                    dropped += 1;
                } else {
                    sc.keys.push(key);
                    sc.chunks.push(c);
                }
                c += 1;
            }
            if c == rg.cursor {
                continue;
            }
            let plan = if sc.keys.is_empty() {
                None
            } else {
                let Some(p) = self.pools[g].prepare_store(&sc.keys) else {
                    self.stats.store_no_room += 1;
                    retry = true;
                    continue;
                };
                Some(p)
            };
            self.stats.chunks_dropped += dropped;
            sc.cursors.push((g, c));
            let Some(plan) = plan else {
                continue;
            };
            let rg = &self.req(i).groups[g];
            let len = plan.keys.len() * bpc as usize;
            let (mut gpu_blocks, mut cpu_blocks) =
                (Vec::with_capacity(len), Vec::with_capacity(len));
            let mut j = 0;
            sc.hints.clear();
            for (k, c) in sc.keys.iter().zip(&sc.chunks) {
                if plan.keys.get(j) != Some(k) {
                    continue;
                }
                let slot = plan.slots[j];
                j += 1;
                sc.hints.push((*c, slot));
                for off in 0..bpc {
                    gpu_blocks.push(rg.blocks[(c * bpc + off) as usize]);
                    cpu_blocks.push(slot.0 * bpc + off);
                }
            }
            let rg = &mut self.req_mut(i).groups[g];
            for &(c, slot) in &sc.hints {
                rg.hint(c, slot);
            }
            if gpu_blocks.is_empty() {
                continue;
            }
            let class = if self.cfg.groups[g].sliding_window.is_some() {
                &mut eager
            } else {
                &mut deferred
            };
            class.extend_from_slice(&gpu_blocks);
            let chunks = plan.keys.len() as u64;
            self.stats.store_chunks += chunks;
            self.stats.store_bytes += chunks * self.cfg.groups[g].bytes_per_chunk;
            transfers.push(GroupTransfer {
                group: g as u32,
                gpu_blocks,
                cpu_blocks,
                keys: plan.keys,
            });
            slots.push(plan.slots);
        }
        for &(g, c) in &sc.cursors {
            self.req_mut(i).groups[g].cursor = c;
        }
        let due = self.store_due(self.req(i));
        self.req_mut(i).store_due = due;
        self.store_scratch = sc;
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
                    // Its completion needs the keys only (one copy): the plan owns the rest.
                    transfers: transfers
                        .iter()
                        .map(|t| GroupTransfer {
                            group: t.group,
                            gpu_blocks: Vec::new(),
                            cpu_blocks: Vec::new(),
                            keys: t.keys.clone(),
                        })
                        .collect(),
                    slots,
                    first_chunks: Vec::new(),
                    load_end: 0,
                    tier: None,
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
    pub(super) fn has_stores_to_plan(&self, i: u32) -> bool {
        let r = self.req(i);
        self.below_watermark(r, self.watermark(r))
    }

    /// The lowest watermark at which some group of `r` has a full chunk past its store cursor:
    /// `below_watermark(r, wm)` holds exactly when `wm` reaches it.
    pub(super) fn store_due(&self, r: &super::requests::Request) -> u32 {
        r.groups
            .iter()
            .enumerate()
            .map(|(g, rg)| (rg.cursor.saturating_add(1)).saturating_mul(self.cfg.chunk_tokens(g)))
            .min()
            .unwrap_or(u32::MAX)
    }

    /// Whether some group of `r` has a store cursor below the watermark `wm`.
    fn below_watermark(&self, r: &super::requests::Request, wm: u32) -> bool {
        r.groups
            .iter()
            .enumerate()
            .any(|(g, rg)| rg.cursor < wm / self.cfg.chunk_tokens(g))
    }
}
