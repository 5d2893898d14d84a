//! Store planning: full chunks below a request's watermark that no store covers yet become one
//! store job per request and step, with slots reserved in each group's pool (at most a pool's
//! worth of chunks per attempt; no room: retried next step). Chunks with a dropped position are
//! skipped and counted.

use crate::ids::BlockId;
use crate::jobs::JobKind;

use super::plan::{GroupTransfer, PlannedJob};
use super::requests::Status;
use super::{JobPayload, Scheduler};

impl Scheduler {
    /// Plans the stores of each request of `work` once per step and drops the finished ones
    /// that have nothing left.
    pub(super) fn plan_all(&mut self, work: &[u32], stores: &mut Vec<PlannedJob>) {
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
        if !self.below_watermark(r, wm) {
            // Nothing to store (most running requests in most steps): no planning at all.
            return;
        }
        let bpc = self.cfg.blocks_per_chunk;
        let owner = r.owner;
        let mut transfers = Vec::new();
        let mut slots = Vec::new();
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
                if blocks.contains(&BlockId::NULL) {
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
            let mut hints = Vec::with_capacity(plan.keys.len());
            for (k, c) in keys.iter().zip(&chunks) {
                if plan.keys.get(j) != Some(k) {
                    continue;
                }
                let slot = plan.slots[j].0;
                j += 1;
                hints.push((*c, plan.slots[j - 1]));
                for off in 0..bpc {
                    tr.gpu_blocks.push(rg.blocks[(c * bpc + off) as usize]);
                    tr.cpu_blocks.push(slot * bpc + off);
                }
            }
            let rg = &mut self.req_mut(i).groups[g];
            for (c, slot) in hints {
                rg.hint(c, slot);
            }
            if tr.gpu_blocks.is_empty() {
                continue;
            }
            let class = if self.cfg.groups[g].sliding_window.is_some() {
                &mut eager
            } else {
                &mut deferred
            };
            class.extend_from_slice(&tr.gpu_blocks);
            self.stats.store_chunks += tr.keys.len() as u64;
            self.stats.store_bytes += tr.keys.len() as u64 * self.cfg.groups[g].bytes_per_chunk;
            transfers.push(tr);
            slots.push(plan.slots);
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
                    // Its completion needs the keys only: the copies go out with the plan.
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

    /// Whether some group of `r` has a store cursor below the watermark `wm`.
    fn below_watermark(&self, r: &super::requests::Request, wm: u32) -> bool {
        r.groups
            .iter()
            .enumerate()
            .any(|(g, rg)| rg.cursor < wm / self.cfg.chunk_tokens(g))
    }
}
