//! Store planning: full chunks below a request's watermark that no store covers yet become one
//! store job per request and step, with slots reserved in each group's pool (at most a pool's
//! worth of chunks per attempt; no room: retried next step). Chunks with a dropped position are
//! skipped and counted.
//!
//! A store job's record is flat ([`StoreChunks`]: its keys and slots, group after group), and
//! the lists of completed jobs, and of plans handed back ([`Scheduler::recycle`]), are kept for
//! the next ones (`spares.rs`): past the first steps a store job allocates no list. In
//! [`PlanForm::Runs`] a job's copies go straight to the plan's runs: it fills no list of the
//! plan's (transfers, blocks, positions, keys, request id).

use crate::ids::{BlockId, JobId, Key, SlotId};
use crate::jobs::JobKind;
use crate::pool::StorePlan;

use super::plan::{GroupTransfer, PlanForm, PlannedJob};
use super::requests::Status;
use super::{JobPayload, Scheduler};

/// A stage of [`Scheduler::warm_request`], the farthest ahead first.
#[derive(Clone, Copy)]
enum Warm {
    Line,
    Groups,
    Chunk,
}

/// Where store planning puts a step's store jobs: the plan's list and, in [`PlanForm::Runs`],
/// their copies in the plan's runs.
pub(super) struct Planned<'a> {
    pub(super) jobs: &'a mut Vec<PlannedJob>,
    pub(super) form: PlanForm,
    pub(super) runs: &'a mut Vec<u8>,
    /// The plan's loads (their runs come first): the first store job's index in the runs.
    pub(super) first: u32,
}

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
    /// The pool's answer for one group.
    plan: StorePlan,
    /// One group's copies ([`PlanForm::Runs`]: they go to the runs, not to a list of the job).
    gpu_blocks: Vec<BlockId>,
    cpu_blocks: Vec<u32>,
}

/// What a store job's completion needs: the keys it stores and the slot of each (hints for the
/// pool), group after group, in three flat lists whatever the job's size.
#[derive(Debug, Clone, Default)]
pub(super) struct StoreChunks {
    /// `(group, end)` per group stored, in order: that group's chunks end at `keys[end]`.
    groups: Vec<(u32, u32)>,
    keys: Vec<Key>,
    slots: Vec<SlotId>,
}

impl StoreChunks {
    /// Appends group `g`'s chunks: `keys[i]` stored into `slots[i]`.
    pub(super) fn push(&mut self, g: u32, keys: &[Key], slots: &[SlotId]) {
        debug_assert_eq!(keys.len(), slots.len());
        self.keys.extend_from_slice(keys);
        self.slots.extend_from_slice(slots);
        self.groups.push((g, self.keys.len() as u32));
    }

    /// Each group stored, in order: `(group, keys, their slots)`.
    pub(super) fn groups(&self) -> impl Iterator<Item = (u32, &[Key], &[SlotId])> {
        let mut start = 0;
        self.groups.iter().map(move |&(g, end)| {
            let r = start..end as usize;
            start = end as usize;
            (g, &self.keys[r.clone()], &self.slots[r])
        })
    }

    /// Whether no chunk is recorded.
    pub(super) fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Empties the record, keeping its lists' room; `false` if it never had any.
    pub(super) fn clear(&mut self) -> bool {
        self.groups.clear();
        self.keys.clear();
        self.slots.clear();
        self.keys.capacity() > 0
    }
}

impl Scheduler {
    /// Plans the stores of each request of `work` once per step and drops the finished ones
    /// that have nothing left.
    ///
    /// Two passes. The first keeps, in order, the requests with something to do, read from
    /// their first line alone (in most steps most running requests have nothing to store:
    /// their watermark is below their store due point). The second plans them, each as
    /// before, while loading ahead what the next ones read, in stages
    /// ([`Scheduler::warm_request`]): a request's table line and due hash three ahead, its
    /// groups two ahead, its due chunk's index bucket, block entries and hint one ahead, and
    /// before each the pools' eviction end. A decode step's stores are one chunk each, and
    /// each chunk's misses (the hash, the block table, the new key's bucket, the victim's
    /// record and bucket) would otherwise be waited for one after the other, request after
    /// request.
    pub(super) fn plan_all(&mut self, work: &[u32], out: &mut Planned<'_>) {
        let step = self.step;
        if self.queued.len() < self.reqs.len() {
            self.queued.resize(self.reqs.len(), u64::MAX);
        }
        let mut todo = std::mem::take(&mut self.todo);
        todo.clear();
        for (k, &i) in work.iter().enumerate() {
            // `queued` is dense but indexed by slab index: a miss per request, prefetched.
            if let Some(q) = work.get(k + 16).and_then(|&a| self.queued.get(a as usize)) {
                crate::prefetch::prefetch(q);
            }
            if self.queued[i as usize] == step {
                continue;
            }
            let Some(r) = self.reqs[i as usize].as_ref() else {
                continue;
            };
            self.queued[i as usize] = step;
            // What `plan_stores` returns at without a change, and `maybe_drop` ignores.
            let idle = r.status == Status::Running
                && r.load == JobId::NONE
                && self.watermark(r) < r.store_due;
            if !idle {
                todo.push(i);
            }
        }
        for t in 0..todo.len() {
            for (ahead, stage) in [(3, Warm::Line), (2, Warm::Groups), (1, Warm::Chunk)] {
                if let Some(&a) = todo.get(t + ahead) {
                    self.warm_request(a, stage);
                }
            }
            for pool in &self.pools {
                pool.warm_victims();
            }
            self.plan_stores(todo[t], out);
            self.maybe_drop(todo[t]);
        }
        self.todo = todo;
    }

    /// Loads ahead one stage of what planning request `i`'s store reads, if it has a chunk
    /// due (the stages in [`Scheduler::plan_all`]); changes nothing.
    fn warm_request(&self, i: u32, stage: Warm) {
        use crate::prefetch::{prefetch, prefetch_ptr};
        let Some(r) = self.reqs[i as usize].as_ref() else {
            return;
        };
        if r.load != JobId::NONE || r.store_due == 0 || self.watermark(r) < r.store_due {
            return;
        }
        match stage {
            Warm::Line => {
                // The second line (block tables, id) and the due chunk's hash.
                prefetch_ptr(std::ptr::from_ref(r).cast::<u8>().wrapping_add(64));
                let h = (r.store_due / self.cfg.hash_block_size) as usize;
                if let Some(key) = h.checked_sub(1).and_then(|h| r.hashes.get(h)) {
                    prefetch(key);
                }
            }
            Warm::Groups => {
                for rg in &r.groups {
                    prefetch(rg);
                }
            }
            Warm::Chunk => {
                let bpc = self.cfg.blocks_per_chunk as usize;
                for (g, rg) in r.groups.iter().enumerate() {
                    let c = rg.cursor;
                    if let Some(key) = self.key(r, g, c) {
                        self.pools[g].warm_key(key);
                    }
                    if let Some(b) = rg.blocks.get(c as usize * bpc) {
                        prefetch(b);
                    }
                    if let Some(s) = rg.slots.get(c as usize) {
                        prefetch(s);
                    }
                }
            }
        }
    }

    /// Plans the stores of request `i`: full chunks below its watermark not handled yet.
    pub(super) fn plan_stores(&mut self, i: u32, out: &mut Planned<'_>) {
        let r = self.req(i);
        if r.status == Status::Waiting {
            return;
        }
        if r.load != JobId::NONE {
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
        let packed = out.form == PlanForm::Runs;
        let mut transfers = if packed {
            Vec::new()
        } else {
            self.spares.transfers()
        };
        let mut record = self.spares.chunks();
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
            if !sc.keys.is_empty() && !self.pools[g].prepare_store_into(&sc.keys, &mut sc.plan) {
                self.stats.store_no_room += 1;
                retry = true;
                continue;
            }
            self.stats.chunks_dropped += dropped;
            sc.cursors.push((g, c));
            let plan = &sc.plan;
            if sc.keys.is_empty() || plan.keys.is_empty() {
                continue;
            }
            let len = plan.keys.len() * bpc as usize;
            let (mut gpu_blocks, mut cpu_blocks) = if packed {
                sc.gpu_blocks.clear();
                sc.cpu_blocks.clear();
                (
                    std::mem::take(&mut sc.gpu_blocks),
                    std::mem::take(&mut sc.cpu_blocks),
                )
            } else {
                (self.spares.blocks(len), self.spares.cpu(len))
            };
            let rg = &self.req(i).groups[g];
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
            let class = if self.cfg.groups[g].sliding_window.is_some() {
                &mut eager
            } else {
                &mut deferred
            };
            self.spares.extend(class, &gpu_blocks);
            let chunks = plan.keys.len() as u64;
            self.stats.store_chunks += chunks;
            self.stats.store_bytes += chunks * self.cfg.groups[g].bytes_per_chunk;
            record.push(g as u32, &plan.keys, &plan.slots);
            if packed {
                let job = out.first + out.jobs.len() as u32;
                crate::runs::push_copies(out.runs, job, g as u32, &gpu_blocks, &cpu_blocks);
                (sc.gpu_blocks, sc.cpu_blocks) = (gpu_blocks, cpu_blocks);
            } else {
                transfers.push(GroupTransfer {
                    group: g as u32,
                    gpu_blocks,
                    cpu_blocks,
                    keys: self.spares.keys(&plan.keys),
                });
            }
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
        if record.is_empty() {
            self.spares.put_chunks(record);
            return;
        }
        let hint = self.req(i).job_entry;
        let (id, entry) = self
            .tracker
            .create_at(
                JobKind::Store,
                owner,
                hint,
                eager,
                deferred,
                JobPayload::store(i, record),
            )
            .expect("blocks validated, no pending load");
        self.req_mut(i).job_entry = entry;
        self.stats.store_jobs += 1;
        let request = if packed {
            String::new()
        } else {
            let r = self.reqs[i as usize]
                .as_ref()
                .expect("planned request exists");
            self.spares.name(&r.id)
        };
        out.jobs.push(PlannedJob {
            id,
            kind: JobKind::Store,
            request,
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

#[cfg(test)]
mod tests {
    use super::super::spares::Spares;
    use super::*;

    fn keys(ids: &[u128]) -> Vec<Key> {
        ids.iter().map(|&k| Key(k)).collect()
    }

    fn slots(ids: &[u32]) -> Vec<SlotId> {
        ids.iter().map(|&s| SlotId(s)).collect()
    }

    #[test]
    fn groups_come_back_in_order_and_a_kept_record_comes_back_empty() {
        let mut spares = Spares::default();
        let mut c = spares.chunks();
        c.push(1, &keys(&[10, 11]), &slots(&[5, 6]));
        c.push(0, &keys(&[20]), &slots(&[7]));
        c.push(3, &keys(&[30, 31, 32]), &slots(&[1, 2, 3]));
        let got: Vec<(u32, Vec<Key>, Vec<SlotId>)> = c
            .groups()
            .map(|(g, k, s)| (g, k.to_vec(), s.to_vec()))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, keys(&[10, 11]), slots(&[5, 6])),
                (0, keys(&[20]), slots(&[7])),
                (3, keys(&[30, 31, 32]), slots(&[1, 2, 3])),
            ]
        );
        let cap = c.keys.capacity();
        spares.put_chunks(c);
        let again = spares.chunks();
        assert!(again.is_empty() && again.groups().next().is_none());
        assert!(again.keys.is_empty() && again.slots.is_empty());
        assert_eq!(
            again.keys.capacity(),
            cap,
            "the kept record's list is reused"
        );
    }
}
