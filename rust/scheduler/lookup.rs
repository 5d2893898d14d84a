//! Admission (DESIGN.md §3.1): how many tokens beyond the engine's prefix hit the CPU tier can
//! load, `0`, or "ask again later". A request waits only for loads already in flight when it
//! first asked, so deduplication never turns into a convoy; the answer is remembered for the
//! `allocate` of the same step.

use std::borrow::Cow;
use std::ops::Range;

use crate::error::{Error, Result};
use crate::ids::{JobId, Key, SlotId};
use crate::pool::KeyState;

use super::requests::{Request, Status};
use super::Scheduler;

/// A lookup's working lists, kept by the scheduler between calls: a lookup then allocates
/// nothing (a new request's lookup reads hundreds of chunks; growing fresh lists for them
/// was about a quarter of its time inside vLLM, the allocator's pages as cold as the data).
#[derive(Debug, Default)]
pub(super) struct LookupScratch {
    /// One group's key states and slots, as the pool answers.
    states: Vec<KeyState>,
    slots: Vec<SlotId>,
    /// Per group, prefix counts of ready chunks, and of chunks ready or being stored.
    ready: Vec<Vec<u32>>,
    maybe: Vec<Vec<u32>>,
    /// One group's slot hints (`touch_prefix`).
    hints: Vec<SlotId>,
}

/// The answer of a request's last lookup, which `allocate` must match.
#[derive(Debug, Clone)]
pub(super) struct LookupResult {
    pub(super) step: u64,
    pub(super) hit: u32,
    pub(super) end: u32,
}

impl Scheduler {
    /// Tokens loadable from the CPU tier beyond the engine's prefix hit of `hit_tokens`;
    /// `Ok(None)` means "ask again later".
    pub fn lookup(&mut self, id: &str, hit_tokens: u32) -> Result<Option<u32>> {
        let i = self.waiting(id, "only waiting requests are looked up")?;
        // Promotions past their deadline release the requests waiting for them.
        self.expire_tier_jobs();
        self.stats.lookups += 1;
        // Work on the request outside the slab so the pools and the tracker stay borrowable.
        let mut r = self.reqs[i as usize]
            .take()
            .expect("indexed request exists");
        let answer = self.lookup_inner(&mut r, hit_tokens);
        self.reqs[i as usize] = Some(r);
        if answer.is_none() {
            self.stats.lookups_deferred += 1;
        }
        Ok(answer)
    }

    /// An engine's ask in one call (vLLM's `get_num_new_matched_tokens`): registers the request
    /// with `prompt_len` and `hashes` if it is not tracked, else appends the hashes beyond those
    /// it holds (see [`Self::sync_request`]); releases a running request the engine queued
    /// again (it dropped the blocks of a failed load, as [`Self::preempt`]); then looks it up.
    /// A `hit` that is not a multiple of every group's block size, or hashes that contradict
    /// the held ones, are refused ([`Error::RequestState`] naming the request and the value)
    /// before anything changes.
    pub fn lookup_request(
        &mut self,
        id: &str,
        prompt_len: u32,
        hashes: Vec<Key>,
        from: usize,
        hit: u32,
    ) -> Result<Option<u32>> {
        if let Some(g) = self.cfg.groups.iter().find(|g| hit % g.block_size != 0) {
            return Err(Error::RequestState {
                request: id.to_owned(),
                reason: format!(
                    "was looked up with a prefix hit of {hit} tokens, not a multiple of the \
                     block size {}",
                    g.block_size
                ),
            });
        }
        match self.index.get(id).copied() {
            // Not tracked: registered with `hashes` as given (no copy).
            None if from == 0 => self.add_request(id, prompt_len, hashes)?,
            None => self.sync_request(id, prompt_len, &hashes, from)?,
            Some(i) => {
                let new = self.new_hashes(i, id, &hashes, from)?;
                if self.req(i).status == Status::Running {
                    self.preempt(id)?;
                } else {
                    self.waiting(id, "only waiting requests are looked up")?;
                }
                self.req_mut(i).hashes.extend_from_slice(&hashes[new..]);
            }
        }
        self.lookup(id, hit)
    }

    /// Registers request `id` with `prompt_len` and `hashes` if it is not tracked, else appends
    /// the hashes beyond those it holds. `hashes` are the items `from..` of the request's whole
    /// hash list as the engine has it now (an engine that knows what the core holds sends only
    /// the tail, or the tail and the last held hash as a check): items the request holds are
    /// compared, not appended again. A list that leaves a gap, is shorter than the held one or
    /// differs from it is refused ([`Error::RequestState`] naming the request), nothing
    /// changed; so is a `from` other than 0 for an untracked request.
    pub fn sync_request(
        &mut self,
        id: &str,
        prompt_len: u32,
        hashes: &[Key],
        from: usize,
    ) -> Result<()> {
        let Some(i) = self.index.get(id).copied() else {
            if from != 0 {
                return Err(Error::RequestState {
                    request: id.to_owned(),
                    reason: format!(
                        "is not tracked, yet its hashes were given from position {from} on"
                    ),
                });
            }
            return self.add_request(id, prompt_len, hashes.to_vec());
        };
        let new = self.new_hashes(i, id, hashes, from)?;
        self.req_mut(i).hashes.extend_from_slice(&hashes[new..]);
        Ok(())
    }

    /// How many leading items of `hashes` (items `from..` of request `i`'s whole hash list)
    /// the request already holds; an error when the list contradicts the held hashes.
    fn new_hashes(&self, i: u32, id: &str, hashes: &[Key], from: usize) -> Result<usize> {
        let held = &self.req(i).hashes;
        let given = from + hashes.len();
        let refuse = |reason: String| {
            Err(Error::RequestState {
                request: id.to_owned(),
                reason,
            })
        };
        if from > held.len() {
            return refuse(format!(
                "holds {} hashes, yet its hashes were given from position {from} on",
                held.len()
            ));
        }
        if given < held.len() {
            return refuse(format!(
                "holds {} hashes, yet a hash list of {given} was given (hash lists only grow)",
                held.len()
            ));
        }
        let overlap = held.len() - from;
        if let Some(p) = (0..overlap).find(|&p| hashes[p] != held[from + p]) {
            return refuse(format!(
                "holds hash {:#x} at position {}, yet {:#x} was given there",
                held[from + p].0,
                from + p,
                hashes[p].0
            ));
        }
        Ok(overlap)
    }

    /// The lookup of a request taken out of the slab: remembers its first ask and the loads
    /// it waits for, and records the answer.
    pub(super) fn lookup_inner(&mut self, r: &mut Request, hit: u32) -> Option<u32> {
        r.lookup = None;
        if self.tracker.jobs().owner(r.owner).is_some() {
            return None;
        }
        let first_ask = r.first_ask.is_none();
        if first_ask {
            r.first_ask = Some(self.step);
        }
        if !first_ask && !r.tier_pending && self.must_wait(r) && self.run_beyond(r, hit) {
            // A re-ask that must wait anyway: the full scan below would answer "later" too.
            return None;
        }
        let (end, storing) = self.hit_end(r, hit);
        // Promote on the first ask only (or while a tier's answer to it is pending): later asks
        // wait for those chunks (being stored in the CPU pool) and load what is there; they
        // never chase chunks promoted since.
        if first_ask || r.tier_pending {
            let (created, pending) = self.promote(r, hit, end);
            r.tier_pending = pending;
            if created || pending {
                return None;
            }
        }
        if end == 0 {
            if storing {
                return None;
            }
            self.touch_prefix(r, hit, hit);
            return Some(0);
        }
        if first_ask {
            // Wait only for loads already in flight now, never for loads started later.
            r.wait_on = self.loads_reading(r, hit, end);
        }
        let tracker = &self.tracker;
        r.wait_on.retain(|j| tracker.jobs().get(*j).is_some());
        let backpressure = self.cfg.max_loading_requests > 0
            && self.loading_requests >= self.cfg.max_loading_requests;
        if storing || backpressure || !r.wait_on.is_empty() {
            return None;
        }
        let waited = self.step - r.first_ask.unwrap_or(self.step);
        self.stats.max_lookup_wait_steps = self.stats.max_lookup_wait_steps.max(waited);
        self.stats.lookup_hit_tokens += u64::from(end - hit);
        r.lookup = Some(LookupResult {
            step: self.step,
            hit,
            end,
        });
        self.touch_prefix(r, hit, end);
        Some(end - hit)
    }

    /// Whether a lookup of `r` must answer "ask again later" if anything is loadable: loads
    /// it waits for are still pending, or too many requests are loading. Drops the finished
    /// loads from its wait list.
    fn must_wait(&self, r: &mut Request) -> bool {
        let tracker = &self.tracker;
        r.wait_on.retain(|j| tracker.jobs().get(*j).is_some());
        let backpressure = self.cfg.max_loading_requests > 0
            && self.loading_requests >= self.cfg.max_loading_requests;
        backpressure || !r.wait_on.is_empty()
    }

    /// Whether [`Self::hit_end`] would find chunks (ready or being stored) for an aligned
    /// step beyond `hit`, i.e. whether its answer is anything but "nothing, nothing coming",
    /// probing only the chunks of that first step. Exact where every group has full attention
    /// (a run from the hit) and no admission filter must see every absent key; elsewhere it
    /// says `false` and the caller makes the full scan.
    fn run_beyond(&mut self, r: &Request, hit: u32) -> bool {
        if self.cfg.has_window() || self.cfg.store_threshold > 1 {
            return false;
        }
        let cap = self.lookup_cap(r);
        // The lowest end point `best_end` may answer.
        let first = (hit + self.align).div_ceil(self.align) * self.align;
        if first > cap {
            return false;
        }
        let mut sc = std::mem::take(&mut self.lookup_scratch);
        let found = (0..self.cfg.groups.len()).all(|g| {
            let keys = self.chunk_keys(r, g, hit, first);
            sc.states.clear();
            sc.slots.clear();
            self.pools[g].lookup_slots(&keys, &mut sc.states, &mut sc.slots, true);
            sc.states.len() == keys.len() && sc.states.iter().all(|&st| st != KeyState::Absent)
        });
        self.lookup_scratch = sc;
        found
    }

    /// Refreshes the recency of every chunk the request re-uses: the engine's own prefix hit
    /// (chunks the GPU cache serves now may be evicted from it first) and the chunks it loads,
    /// the earliest ending most recent. The request's slot hints (from its lookup, stores and
    /// loads) spare the pools' index probes where they still hold; the slots probed here
    /// become hints too, so the refresh when the request is done (`refresh_stored`) reads
    /// their records instead of probing the index again.
    pub(super) fn touch_prefix(&mut self, r: &mut Request, hit: u32, end: u32) {
        let mut sc = std::mem::take(&mut self.lookup_scratch);
        let hints = &mut sc.hints;
        for g in 0..self.cfg.groups.len() {
            let ct = self.cfg.chunk_tokens(g);
            let first = match self.cfg.groups[g].sliding_window {
                None => 0,
                Some(w) => hit.saturating_sub(w) / ct,
            };
            hints.clear();
            let keys = self.chunk_key_slice(r, g, first..end.max(hit) / ct);
            // Chunks without a hint (those below the engine's hit: no lookup probed them) are
            // probed here, in one pass of independent probes whose cache misses overlap, not
            // one by one between the touches.
            let slots = &r.groups[g].slots;
            hints.extend(
                (first as usize..first as usize + keys.len())
                    .map(|c| slots.get(c).copied().unwrap_or(SlotId::NONE)),
            );
            self.pools[g].fill_slots(&keys, hints);
            if !keys.is_empty() {
                self.pools[g].touch_resolved(&keys, hints);
                let slots = &mut r.groups[g].slots;
                let (lo, hi) = (first as usize, first as usize + hints.len());
                super::requests::grow(slots, hi, SlotId::NONE);
                slots[lo..hi].copy_from_slice(hints);
            }
        }
        self.lookup_scratch = sc;
    }

    /// The highest aligned token count a lookup of `r` may answer up to.
    pub(super) fn lookup_cap(&self, r: &Request) -> u32 {
        let mut cap = r.prompt_len - u32::from(self.cfg.has_window());
        if r.status == Status::Preempted {
            // Resumed requests recompute their generated tokens too: every token that had KV
            // may come back (the last sampled one never had any).
            cap = cap.max(r.computed);
        }
        let hashed = (r.hashes.len() as u64 * u64::from(self.cfg.hash_block_size))
            .min(u64::from(u32::MAX)) as u32;
        cap = cap.min(hashed);
        cap - cap % self.align
    }

    /// Highest token end point `p > hit` (aligned) at which every group's needed chunks are
    /// ready, or 0; and whether chunks still being stored could make it higher (ask again
    /// later). The pools are not consulted when less than one aligned step of tokens lies
    /// beyond the hit.
    pub(super) fn hit_end(&mut self, r: &mut Request, hit: u32) -> (u32, bool) {
        let cap = self.lookup_cap(r);
        if cap <= hit || cap - hit < self.align {
            return (0, false);
        }
        // Per group, prefix counts from the hit chunk of chunks that are ready, and of chunks
        // that are ready or being stored. A full-attention group needs an unbroken run from
        // the hit, so its scan stops at the first absent chunk (`best_end` reads no count
        // beyond its run). The slots found are kept as the request's hints (touch, load).
        let mut sc = std::mem::take(&mut self.lookup_scratch);
        let groups = self.cfg.groups.len();
        sc.ready.resize_with(groups, Vec::new);
        sc.maybe.resize_with(groups, Vec::new);
        for g in 0..groups {
            sc.states.clear();
            sc.slots.clear();
            {
                let keys = self.chunk_keys(r, g, hit, cap);
                sc.states.reserve(keys.len());
                sc.slots.reserve(keys.len());
                let full = self.cfg.groups[g].sliding_window.is_none();
                self.pools[g].lookup_slots(&keys, &mut sc.states, &mut sc.slots, full);
            }
            let rg = &mut r.groups[g];
            let first = hit / self.cfg.chunk_tokens(g);
            // The hints' list sized once for the chunks probed, not grown chunk by chunk.
            let probed = first as usize + sc.slots.len();
            super::requests::grow(&mut rg.slots, probed, SlotId::NONE);
            for (c, &slot) in (first..).zip(&sc.slots) {
                if slot != SlotId::NONE {
                    rg.hint(c, slot);
                }
            }
            prefix_counts_into(&sc.states, &mut sc.ready[g], |st| {
                matches!(st, KeyState::Ready { .. })
            });
            prefix_counts_into(&sc.states, &mut sc.maybe[g], |st| st != KeyState::Absent);
        }
        let end = self.best_end(&sc.ready[..groups], hit, cap);
        let more = self.best_end(&sc.maybe[..groups], hit, cap) > end;
        self.lookup_scratch = sc;
        (end, more)
    }

    /// Keys of group `g`'s chunks from the one holding token `hit` to the last one ending by
    /// `cap`.
    pub(super) fn chunk_keys<'r>(
        &self,
        r: &'r Request,
        g: usize,
        hit: u32,
        cap: u32,
    ) -> Cow<'r, [Key]> {
        let ct = self.cfg.chunk_tokens(g);
        self.chunk_key_slice(r, g, hit / ct..cap / ct)
    }

    /// [`Self::chunk_key_iter`]'s keys as a list: where a chunk is one hash block (vLLM's
    /// shape) the request's own hashes, borrowed, not a copy of hundreds of them.
    pub(super) fn chunk_key_slice<'r>(
        &self,
        r: &'r Request,
        g: usize,
        chunks: Range<u32>,
    ) -> Cow<'r, [Key]> {
        if self.cfg.chunk_tokens(g) == self.cfg.hash_block_size {
            let n = r.hashes.len();
            let (lo, hi) = (chunks.start as usize, chunks.end as usize);
            Cow::Borrowed(&r.hashes[lo.min(n)..hi.max(lo).min(n)])
        } else {
            Cow::Owned(self.chunk_key_iter(r, g, chunks).collect())
        }
    }

    /// The keys of group `g`'s chunks in `chunks` that the request has hashes for (a prefix of
    /// the range: hashes are only ever appended), each as [`Self::key`] gives it, read at a
    /// stride instead of a division per chunk: chunk `c`'s key is hash `(c + 1) * per - 1`,
    /// `per` the hashes per chunk (the configuration makes it a whole number).
    pub(super) fn chunk_key_iter<'r>(
        &self,
        r: &'r Request,
        g: usize,
        chunks: Range<u32>,
    ) -> impl Iterator<Item = Key> + 'r {
        let per = (self.cfg.chunk_tokens(g) / self.cfg.hash_block_size) as usize;
        debug_assert_eq!(self.cfg.chunk_tokens(g) % self.cfg.hash_block_size, 0);
        let first = chunks.start as usize * per + per - 1;
        let n = chunks.len();
        r.hashes
            .get(first..)
            .unwrap_or(&[])
            .iter()
            .step_by(per)
            .take(n)
            .copied()
    }

    /// Highest aligned end point `p` with `hit < p <= cap` at which every group's needed
    /// chunks are available, or 0. `counts[g]` are group `g`'s prefix counts of available
    /// chunks over [`Self::chunk_keys`] `(hit, cap)`.
    pub(super) fn best_end(&self, counts: &[Vec<u32>], hit: u32, cap: u32) -> u32 {
        // Full attention needs every chunk from the hit: its leading run bounds the answer.
        let mut p = cap;
        for (g, c) in counts.iter().enumerate() {
            if self.cfg.groups[g].sliding_window.is_none() {
                let run = c
                    .iter()
                    .enumerate()
                    .take_while(|(i, v)| **v as usize == *i)
                    .count() as u32
                    - 1;
                let ct = self.cfg.chunk_tokens(g);
                p = p.min((hit / ct + run) * ct);
            }
        }
        p -= p % self.align;
        while p > hit && p - hit >= self.align {
            let ok = counts.iter().enumerate().all(|(g, c)| {
                let s = hit / self.cfg.chunk_tokens(g);
                let first = self.first_needed_chunk(g, hit, p);
                let last = p / self.cfg.chunk_tokens(g);
                c[(last - s) as usize] - c[(first - s) as usize] == last - first
            });
            if ok {
                return p;
            }
            p -= self.align;
        }
        0
    }

    /// First chunk a group needs to load for an end point `end` beyond `hit`.
    pub(super) fn first_needed_chunk(&self, g: usize, hit: u32, end: u32) -> u32 {
        let start = match self.cfg.groups[g].sliding_window {
            None => hit,
            Some(w) => hit.max(end.saturating_sub(w)),
        };
        start / self.cfg.chunk_tokens(g)
    }

    /// The pending loads that read chunks `r` needs to load `hit..end` (sorted, once each):
    /// the loader of each needed chunk's slot while a load pins it.
    fn loads_reading(&self, r: &Request, hit: u32, end: u32) -> Vec<JobId> {
        let mut jobs = Vec::new();
        for g in 0..self.cfg.groups.len() {
            let (pool, loaders, hints) = (&self.pools[g], &self.loaders[g], &r.groups[g].slots);
            let first = self.first_needed_chunk(g, hit, end);
            let chunks = first..end / self.cfg.chunk_tokens(g);
            for (c, key) in chunks.clone().zip(self.chunk_key_iter(r, g, chunks)) {
                let Some(slot) = pool.pinned_slot(key, hints.get(c as usize).copied()) else {
                    continue;
                };
                // A slot a tier write pins may have no loader, or a finished one.
                let Some(&job) = loaders.get(slot.0 as usize) else {
                    continue;
                };
                if job != JobId::NONE
                    && jobs.last() != Some(&job)
                    && self.tracker.jobs().get(job).is_some()
                {
                    jobs.push(job);
                }
            }
        }
        jobs.sort_unstable();
        jobs.dedup();
        jobs
    }

    /// Keys of the chunks group `g` needs loaded for tokens `[hit, end)`.
    pub(super) fn needed_keys(&self, r: &Request, g: usize, hit: u32, end: u32) -> Vec<Key> {
        let last = end / self.cfg.chunk_tokens(g);
        self.chunk_key_iter(r, g, self.first_needed_chunk(g, hit, end)..last)
            .collect()
    }
}

/// `c[i]` = how many of the first `i` items (keys, or their states) are available.
pub(super) fn prefix_counts<T: Copy>(items: &[T], available: impl FnMut(T) -> bool) -> Vec<u32> {
    let mut c = Vec::with_capacity(items.len() + 1);
    prefix_counts_into(items, &mut c, available);
    c
}

/// [`prefix_counts`] into `c` (emptied first; its room is reused).
fn prefix_counts_into<T: Copy>(
    items: &[T],
    c: &mut Vec<u32>,
    mut available: impl FnMut(T) -> bool,
) {
    c.clear();
    c.reserve(items.len() + 1);
    let mut n = 0u32;
    c.push(n);
    for &k in items {
        n += u32::from(available(k));
        c.push(n);
    }
}

#[cfg(test)]
mod tests {
    use crate::ids::{BlockId, Key, SlotId};
    use crate::scheduler::positions::tests::{small, step};
    use crate::scheduler::Scheduler;

    /// The slots a lookup finds for the engine's own prefix hit (chunks it touches, loads
    /// none of) become the request's hints, so the refresh when it is done reads their
    /// records instead of probing the index; hints it had are kept, and a wrong one stays only
    /// a hint, checked before use (the touches still move the right chunks).
    #[test]
    fn a_lookup_keeps_the_slots_of_the_engine_s_hit_as_hints() {
        let mut s = small(1);
        let keys: Vec<Key> = (100..104).map(Key).collect();
        // "a" stores its four chunks.
        s.add_request("a", 17, keys.clone()).unwrap();
        assert_eq!(s.lookup("a", 0).unwrap(), Some(0));
        let table = vec![(1..6).map(BlockId).collect()];
        assert_eq!(s.allocate("a", &table, 0, 0).unwrap(), None);
        let plan = s.schedule(&step(&[("a", 16)])).unwrap();
        let done: Vec<_> = plan.stores.iter().map(|j| (j.id, 0, true)).collect();
        s.complete_counts(&done).unwrap();
        let slots: Vec<SlotId> = keys.iter().map(|&k| s.pools[0].slot(k).unwrap()).collect();
        // "b" shares the prefix; the engine serves its first three chunks from the GPU.
        s.add_request("b", 17, keys.clone()).unwrap();
        let b = s.idx("b").unwrap();
        assert!(
            s.req(b).groups[0].slots.is_empty(),
            "no hint before its lookup"
        );
        assert_eq!(s.lookup("b", 12).unwrap(), Some(4));
        assert_eq!(&s.req(b).groups[0].slots[..4], &slots[..]);
        // The touch walked the prefix from its last chunk: the first ends most recent.
        let lru = |s: &Scheduler| s.pools[0].order().resident[0].1.clone();
        assert_eq!(lru(&s), vec![keys[3], keys[2], keys[1], keys[0]]);
        // A wrong hint stays a hint, checked before use: the second lookup touches the same
        // chunks in the same order (it would have moved chunk 3's key last if trusted).
        s.req_mut(b).groups[0].slots[0] = slots[3];
        assert_eq!(s.lookup("b", 12).unwrap(), Some(4));
        assert_eq!(lru(&s), vec![keys[3], keys[2], keys[1], keys[0]]);
    }
}
