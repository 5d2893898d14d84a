//! Allocation (DESIGN.md §3.2): the engine's block tables for an admitted request are recorded
//! and, if the lookup found tokens to load, the load job is created with its CPU slots pinned
//! (all or nothing). Destination blocks of sliding-window groups are eager fence pairs, those
//! of full-attention groups deferred.

use crate::error::{Error, Result};
use crate::ids::{BlockId, JobId, SlotId};
use crate::jobs::JobKind;

use super::plan::{GroupTransfer, PlannedJob};
use super::requests::Status;
use super::{JobPayload, Scheduler};

/// `pin_load`'s working lists, kept by the scheduler between calls (a load names hundreds of
/// chunks): per chunk copied, its chunk index and its slot hint; per block, its key's index.
#[derive(Debug, Default)]
pub(super) struct LoadScratch {
    chunks: Vec<u32>,
    hints: Vec<SlotId>,
    kidx: Vec<usize>,
}

impl Scheduler {
    /// Records the blocks the engine allocated for an admitted request (its whole block table
    /// per group), its engine prefix hit `hit_tokens`, and `load_tokens` to load from the CPU
    /// tier (as returned by the last lookup, or 0). Creates the load job.
    pub fn allocate(
        &mut self,
        id: &str,
        blocks: &[Vec<BlockId>],
        hit_tokens: u32,
        load_tokens: u32,
    ) -> Result<Option<JobId>> {
        let i = self.waiting(id, "only waiting requests are allocated")?;
        if blocks.len() != self.cfg.groups.len() {
            return Err(Error::RequestState {
                request: id.to_owned(),
                reason: format!(
                    "allocated {} block lists but the engine has {} KV groups",
                    blocks.len(),
                    self.cfg.groups.len()
                ),
            });
        }
        let tables = blocks
            .iter()
            .map(|b| self.engine_blocks(b))
            .collect::<Result<Vec<_>>>()?;
        if let Some(b) = self.first_repeated(tables.iter().flatten().copied()) {
            return Err(Error::RequestState {
                request: id.to_owned(),
                reason: format!("was allocated block {b} twice; a block holds one position"),
            });
        }
        let r = self.req(i);
        if self.tracker.jobs().owner(r.owner).is_some() {
            return Err(Self::state_err(
                id,
                r.status,
                "it still has pending jobs; look it up again",
            ));
        }
        let end = hit_tokens + load_tokens;
        if load_tokens > 0 {
            match &r.lookup {
                Some(l) if l.step == self.step && l.hit == hit_tokens && l.end == end => {}
                _ => {
                    return Err(Error::RequestState {
                        request: id.to_owned(),
                        reason: format!(
                            "allocated with {load_tokens} tokens to load after a hit of \
                             {hit_tokens}, but no lookup of this step returned that"
                        ),
                    })
                }
            }
            for (g, t) in tables.iter().enumerate() {
                let bs = self.cfg.groups[g].block_size;
                let need = end.div_ceil(bs) as usize;
                if t.len() < need {
                    return Err(Error::RequestState {
                        request: id.to_owned(),
                        reason: format!(
                            "group {g} has {} blocks, {need} needed to load {end} tokens",
                            t.len()
                        ),
                    });
                }
                if self.cfg.groups[g].sliding_window.is_none() {
                    let from = (hit_tokens / bs) as usize;
                    if let Some(pos) = (from..(end / bs) as usize).find(|p| t[*p] == BlockId::NULL)
                    {
                        return Err(Error::RequestState {
                            request: id.to_owned(),
                            reason: format!(
                                "group {g} has the null block at position {pos}, which the load \
                                 of tokens {hit_tokens}..{end} must fill"
                            ),
                        });
                    }
                }
            }
        }
        let owner = self.req(i).owner;
        let (transfers, slots) = if load_tokens > 0 {
            self.pin_load(i, &tables, hit_tokens, end)?
        } else {
            (Vec::new(), Vec::new())
        };
        let first_chunks = transfers
            .iter()
            .map(|t| self.first_needed_chunk(t.group as usize, hit_tokens, end))
            .collect();
        // Validated and pinned: apply.
        if self.req(i).status == Status::Preempted {
            self.tracker.reacquire(owner);
        }
        let bpc = self.cfg.blocks_per_chunk;
        for (g, t) in tables.into_iter().enumerate() {
            self.allocated
                .extend(t.iter().filter(|b| **b != BlockId::NULL));
            // Beyond the engine's prefix hit the blocks get new content: re-allocations.
            let reused = (hit_tokens / self.cfg.groups[g].block_size) as usize;
            self.reallocated
                .extend(t.iter().skip(reused).filter(|b| **b != BlockId::NULL));
            let cursor = self.req(i).groups[g]
                .cursor
                .max(end / self.cfg.chunk_tokens(g));
            for (pos, b) in t.iter().enumerate() {
                if *b != BlockId::NULL && pos as u32 >= cursor * bpc {
                    self.pending_assign.push((i, g as u32, pos as u32));
                }
            }
            let rg = &mut self.req_mut(i).groups[g];
            rg.blocks = t;
            rg.cursor = cursor;
        }
        let r = self.req_mut(i);
        r.store_due = 0;
        r.epoch += 1;
        r.status = Status::Running;
        r.computed = hit_tokens;
        r.first_ask = None;
        r.tier_pending = false;
        r.wait_on.clear();
        r.lookup = None;
        if transfers.is_empty() {
            return Ok(None);
        }
        // Destination blocks: sliding-window groups are eager (the engine may free them while
        // the request runs), full-attention groups deferred, as for stores.
        let (mut eager, mut deferred) = (Vec::new(), Vec::new());
        for t in &transfers {
            let class = if self.cfg.groups[t.group as usize].sliding_window.is_some() {
                &mut eager
            } else {
                &mut deferred
            };
            class.extend_from_slice(&t.gpu_blocks);
        }
        for t in &transfers {
            self.stats.load_blocks += t.gpu_blocks.len() as u64;
            self.stats.load_bytes += t.gpu_blocks.len() as u64
                * self.cfg.groups[t.group as usize].bytes_per_chunk
                / u64::from(bpc);
        }
        let payload = JobPayload {
            req: i,
            slots,
            transfers,
            chunks: super::stores::StoreChunks::default(),
            first_chunks,
            load_end: end,
            tier: None,
        };
        let hint = self.req(i).job_entry;
        let (job, entry) = self
            .tracker
            .create_at(JobKind::Load, owner, hint, eager, deferred, payload)
            .expect("blocks validated, no pending job");
        self.req_mut(i).job_entry = entry;
        let payload = &self.tracker.jobs().get(job).expect("just created").payload;
        for (t, slots) in payload.transfers.iter().zip(&payload.slots) {
            let loaders = &mut self.loaders[t.group as usize];
            if let Some(&last) = slots.iter().max() {
                if loaders.len() <= last.0 as usize {
                    loaders.resize(last.0 as usize + 1, JobId::NONE);
                }
            }
            for s in slots {
                loaders[s.0 as usize] = job;
            }
        }
        self.loading_requests += 1;
        self.stats.load_jobs += 1;
        self.stats.load_tokens += u64::from(load_tokens);
        self.req_mut(i).load = job;
        // Its copies join the plan at the next step, in the plan's form (`Scheduler::schedule_with`).
        self.new_loads.push(PlannedJob {
            id: job,
            kind: JobKind::Load,
            request: id.to_owned(),
            transfers: Vec::new(),
        });
        Ok(Some(job))
    }

    /// The blocks [`Self::allocate`] handed out beyond the engine's prefix hit since the
    /// previous step (null blocks excluded): every one of them is written this step (by its
    /// load or the forward pass), so an adapter adds them to the step's `written` instead of
    /// collecting them itself.
    pub fn allocated_beyond_hit(&self) -> &[BlockId] {
        &self.reallocated
    }

    /// Builds the copies of a load of tokens `[hit, end)` into `tables` and pins their slots
    /// (all or nothing): the copies per group, and the slot of each of their keys.
    pub(super) fn pin_load(
        &mut self,
        i: u32,
        tables: &[Vec<BlockId>],
        hit: u32,
        end: u32,
    ) -> Result<(Vec<GroupTransfer>, Vec<Vec<SlotId>>)> {
        let bpc = self.cfg.blocks_per_chunk;
        let mut out: Vec<GroupTransfer> = Vec::new();
        let mut pinned = Vec::new();
        let LoadScratch {
            mut chunks,
            mut hints,
            mut kidx,
        } = std::mem::take(&mut self.load_scratch);
        for (g, t) in tables.iter().enumerate() {
            let bs = self.cfg.groups[g].block_size;
            let first_pos = self.first_needed_chunk(g, hit, end) * bpc;
            let first_pos = first_pos.max(hit / bs);
            let n = (end / bs).saturating_sub(first_pos) as usize;
            let mut tr = GroupTransfer {
                group: g as u32,
                gpu_blocks: Vec::with_capacity(n),
                cpu_blocks: Vec::with_capacity(n),
                keys: Vec::with_capacity(n.div_ceil(bpc as usize)),
            };
            kidx.clear();
            chunks.clear();
            let mut last_chunk = u32::MAX;
            let first_chunk = first_pos / bpc;
            let keys = self.chunk_key_slice(self.req(i), g, first_chunk..(end / bs).div_ceil(bpc));
            for pos in first_pos..end / bs {
                let b = t[pos as usize];
                if b == BlockId::NULL {
                    continue;
                }
                let c = pos / bpc;
                if c != last_chunk {
                    last_chunk = c;
                    let key = keys.get((c - first_chunk) as usize);
                    tr.keys.push(*key.expect("looked-up key"));
                    chunks.push(c);
                }
                kidx.push(tr.keys.len() - 1);
                tr.gpu_blocks.push(b);
                tr.cpu_blocks.push(pos % bpc);
            }
            if tr.keys.is_empty() {
                continue;
            }
            let slots = &self.req(i).groups[g].slots;
            hints.clear();
            hints.extend(
                chunks
                    .iter()
                    .map(|&c| slots.get(c as usize).copied().unwrap_or(SlotId::NONE)),
            );
            match self.pools[g].prepare_load_hinted(&tr.keys, &hints) {
                Ok(slots) => {
                    for (cpu, &k) in tr.cpu_blocks.iter_mut().zip(&kidx) {
                        *cpu += slots[k].0 * bpc;
                    }
                    let rg = &mut self.req_mut(i).groups[g];
                    for (&c, &slot) in chunks.iter().zip(&slots) {
                        rg.hint(c, slot);
                    }
                    out.push(tr);
                    pinned.push(slots);
                }
                Err(e) => {
                    for (done, slots) in out.iter().zip(&pinned) {
                        let pool = &mut self.pools[done.group as usize];
                        let undone = pool.complete_load_hinted(&done.keys, slots);
                        debug_assert!(undone.is_ok(), "{undone:?}");
                    }
                    self.load_scratch = LoadScratch {
                        chunks,
                        hints,
                        kidx,
                    };
                    return Err(e);
                }
            }
        }
        self.load_scratch = LoadScratch {
            chunks,
            hints,
            kidx,
        };
        Ok((out, pinned))
    }
}

#[cfg(test)]
mod tests {
    use crate::error::Error;
    use crate::ids::{BlockId, Key};
    use crate::scheduler::positions::tests::{small, step};

    fn blocks(ids: &[u32]) -> Vec<Vec<BlockId>> {
        let t: Vec<BlockId> = ids.iter().copied().map(BlockId).collect();
        vec![t.clone(), t.iter().map(|b| BlockId(b.0 + 32)).collect()]
    }

    /// A load whose second group's chunk went missing after the lookup (here: dropped from
    /// that group's pool behind the scheduler's back) fails whole: the first group's slots,
    /// pinned before the second failed, are unpinned, and a new lookup loads what is left.
    #[test]
    fn a_load_failing_in_its_second_group_unpins_the_first() {
        let mut s = small(2);
        let keys = vec![Key(7), Key(8)];
        s.add_request("a", 9, keys.clone()).unwrap();
        assert_eq!(s.lookup("a", 0).unwrap(), Some(0));
        s.allocate("a", &blocks(&[1, 2, 3]), 0, 0).unwrap();
        let plan = s.schedule(&step(&[("a", 9)])).unwrap();
        for job in &plan.stores {
            s.complete(job.id, 0, true).unwrap();
        }
        s.add_request("b", 9, keys.clone()).unwrap();
        assert_eq!(s.lookup("b", 0).unwrap(), Some(8));
        assert_eq!(s.pools[1].discard(&keys[1..]), vec![Key(8)]);
        let err = s.allocate("b", &blocks(&[4, 5, 6]), 0, 8).unwrap_err();
        assert!(matches!(err, Error::UnknownKey(Key(8))), "{err:?}");
        assert_eq!(s.pools[0].stats().pinned, 0, "group 0's pins are undone");
        assert_eq!(s.pools[1].stats().pinned, 0);
        assert_eq!(s.lookup("b", 0).unwrap(), Some(4));
        let job = s.allocate("b", &blocks(&[4, 5, 6]), 0, 4).unwrap();
        assert!(job.is_some());
        assert_eq!(s.pools[0].stats().pinned, 1);
        assert_eq!(s.pools[1].stats().pinned, 1);
    }
}
