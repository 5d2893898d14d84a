//! Completion (DESIGN.md §3.5): worker reports, one by one or in an all-or-nothing batch. A
//! done store publishes (or drops) its keys, a done load unpins its slots and sets the
//! request's computed tokens (a failed one rewinds the store cursors), and a finished request
//! with nothing pending is dropped.

use crate::error::{Error, Result};
use crate::ids::{BlockId, JobId};
use crate::jobs::{Completion, JobKind};

use super::plan::CompletedJob;
use super::requests::Status;
use super::Scheduler;

impl Scheduler {
    /// Records one batch of worker reports `(job, worker, ok)`, all or nothing: every report is
    /// validated (a duplicate within the batch included) before any is applied. Returns the
    /// jobs that completed.
    pub fn complete_many(&mut self, reports: &[(JobId, u32, bool)]) -> Result<Vec<CompletedJob>> {
        self.validate_reports(reports)?;
        self.warm_completions(reports);
        let mut done = Vec::new();
        for &(job, worker, ok) in reports {
            if let Some(d) = self.complete(job, worker, ok).expect("validated") {
                done.push(d);
            }
        }
        Ok(done)
    }

    /// [`Self::complete_many`] for a caller that needs no job objects (vLLM's connector):
    /// returns how many jobs completed `(ok, failed)`, and copies no request id.
    pub fn complete_counts(&mut self, reports: &[(JobId, u32, bool)]) -> Result<(usize, usize)> {
        self.validate_reports(reports)?;
        self.warm_completions(reports);
        let (mut ok, mut failed) = (0, 0);
        for &(job, worker, report) in reports {
            if let Some(done) = self.finish(job, worker, report, false).expect("validated") {
                ok += usize::from(done.ok);
                failed += usize::from(!done.ok);
            }
        }
        Ok((ok, failed))
    }

    /// Checks a batch of reports, a duplicate within the batch included; changes nothing.
    fn validate_reports(&self, reports: &[(JobId, u32, bool)]) -> Result<()> {
        // Reports in increasing order (the usual case) hold no duplicate: no list to sort.
        let mut last = None;
        let mut increasing = true;
        for &(job, worker, _) in reports {
            if self.validate_report(job, worker)? {
                increasing &= last < Some((job, worker));
                last = Some((job, worker));
            }
        }
        if increasing {
            return Ok(());
        }
        let mut live: Vec<_> = reports
            .iter()
            .filter(|&&(job, worker, _)| matches!(self.validate_report(job, worker), Ok(true)))
            .map(|&(job, worker, _)| (job, worker))
            .collect();
        live.sort_unstable();
        if let Some(w) = live.windows(2).find(|w| w[0] == w[1]) {
            let (job, worker) = w[0];
            return Err(Error::DuplicateReport { job, worker });
        }
        Ok(())
    }

    /// Validates one report without changing anything: `Ok(false)` for a late one (a job from
    /// before the last reset). A job no plan handed out yet cannot have been run by a worker:
    /// its report is refused (the plan would otherwise carry a job whose outcome is known).
    fn validate_report(&self, job: JobId, worker: u32) -> Result<bool> {
        let live = self.tracker.jobs().validate(job, worker)?;
        if live && job >= self.planned_below {
            return Err(Error::JobNotPlanned(job));
        }
        Ok(live)
    }

    /// Brings into the cache what completing the jobs of `reports` (validated) will read: each
    /// finishing job's owner entry, its request, its stored chunks' keys and pool records.
    /// Changes nothing. The completions would miss on them one job after the other; here the
    /// misses overlap (a store job of a decoding request holds only a few chunks, too few for
    /// the pool's own look-ahead to cover).
    fn warm_completions(&self, reports: &[(JobId, u32, bool)]) {
        let jobs = self.tracker.jobs();
        let finishing = || {
            reports
                .iter()
                .filter_map(|&(id, _, _)| jobs.get(id).filter(|j| j.remaining == 1))
        };
        // The lines each finishing job points at directly...
        for j in finishing() {
            jobs.warm_owner(j);
            if let Some(r) = self.reqs.get(j.payload.req as usize) {
                crate::prefetch::prefetch(r);
            }
            for (_, keys, hints) in j.payload.chunks.groups() {
                crate::prefetch::prefetch_ptr(keys.as_ptr().cast());
                crate::prefetch::prefetch_ptr(hints.as_ptr().cast());
            }
        }
        // ... then the lines those lead to: the other keys, the slots' records.
        for j in finishing() {
            jobs.warm_owner_jobs(j);
            for (g, keys, hints) in j.payload.chunks.groups() {
                // One key per cache line (16-byte keys).
                for key in keys.iter().step_by(4).skip(1) {
                    crate::prefetch::prefetch(key);
                }
                self.pools[g as usize].warm_slots(hints);
            }
        }
    }

    /// Records worker `worker`'s report for `job` (`ok == false`: the worker failed it). When
    /// every worker reported, completes the job: stored chunks become readable (or are dropped
    /// if any worker failed), loaded slots are unpinned, fence pairs removed, and a finished
    /// request with nothing pending is dropped. Reports for jobs from before a reset return
    /// `Ok(None)`, as do reports that leave the job pending. A second report from the same
    /// worker is an error and changes nothing.
    pub fn complete(&mut self, job: JobId, worker: u32, ok: bool) -> Result<Option<CompletedJob>> {
        Ok(self.finish(job, worker, ok, true)?.map(|d| CompletedJob {
            id: job,
            kind: d.kind,
            request: d.request.unwrap_or_default(),
            ok: d.ok,
            invalid_blocks: d.invalid_blocks,
        }))
    }

    /// [`Self::complete`], with the request id only if `named` (it is read before the
    /// request may be dropped).
    fn finish(
        &mut self,
        job: JobId,
        worker: u32,
        ok: bool,
        named: bool,
    ) -> Result<Option<Finished>> {
        if job >= self.planned_below {
            // Rare: a job of the next plan (or an unknown one); validated whole.
            self.validate_report(job, worker)?;
        }
        let Completion::Done(mut j) = self.tracker.complete(job, worker, ok)? else {
            return Ok(None);
        };
        let ok = !j.failed;
        if let Some(tier) = j.payload.tier {
            // Tier jobs belong to no request: their effect shows in the pools and the tiers.
            let t = &j.payload.transfers[0];
            self.complete_tier(job, tier, t.group as usize, &t.keys, ok);
            return Ok(None);
        }
        let i = j.payload.req;
        let mut invalid_blocks = Vec::new();
        match j.kind {
            JobKind::Store => {
                for (g, keys, hints) in j.payload.chunks.groups() {
                    // The pool holds exactly these keys as storing: cannot fail.
                    let pool = &mut self.pools[g as usize];
                    let done = pool.complete_store_hinted(keys, ok, hints);
                    debug_assert!(done.is_ok(), "{done:?}");
                    if ok {
                        self.write_behind(g as usize, keys, false);
                    }
                }
                self.stats.failed_stores += u64::from(!ok);
                self.spares
                    .put_chunks(std::mem::take(&mut j.payload.chunks));
            }
            JobKind::Load => {
                for (ti, t) in j.payload.transfers.iter().enumerate() {
                    let hints = j.payload.slots.get(ti).map_or(&[][..], Vec::as_slice);
                    let pool = &mut self.pools[t.group as usize];
                    let done = pool.complete_load_hinted(&t.keys, hints);
                    debug_assert!(done.is_ok(), "{done:?}");
                    if !ok {
                        // A failed load leaves its chunks suspect: drop them (unless another
                        // load still reads them), so a persistent fault cannot loop forever.
                        pool.discard(&t.keys);
                    } else if !self.tiers.is_empty() {
                        // Reused chunks: tiers that admit on hits may want them now.
                        self.write_behind(t.group as usize, &t.keys, true);
                    }
                    if !ok {
                        invalid_blocks.extend_from_slice(&t.gpu_blocks);
                    }
                }
                self.loading_requests -= 1;
                self.stats.failed_loads += u64::from(!ok);
                let bpc = self.cfg.blocks_per_chunk;
                let r = self.req_mut(i);
                r.load = JobId::NONE;
                if ok {
                    // The loaded tokens are computed now: a reset before the next step restarts
                    // the window's store cursor from here, not from the engine's prefix hit.
                    r.computed = r.computed.max(j.payload.load_end);
                }
                if !ok {
                    // The engine recomputes what the load should have brought: rewind the
                    // store cursors so those chunks are stored again.
                    let mut rewound = Vec::new();
                    r.store_due = 0;
                    for (t, &c) in j.payload.transfers.iter().zip(&j.payload.first_chunks) {
                        let rg = &mut r.groups[t.group as usize];
                        if c < rg.cursor {
                            let n = rg.blocks.len() as u32;
                            rewound
                                .extend((c * bpc..(rg.cursor * bpc).min(n)).map(|p| (t.group, p)));
                            rg.cursor = c;
                        }
                    }
                    for (g, pos) in rewound {
                        self.assign(i, g, pos);
                    }
                }
                if matches!(self.req(i).status, Status::Finished | Status::Aborted)
                    && !self.has_stores_to_plan(i)
                {
                    // Nothing left to store once its load is done: drop it now.
                    self.retry.retain(|x| *x != i);
                }
            }
        }
        // The job's block lists serve the next store jobs.
        self.spares.put_blocks(j.eager);
        self.spares.put_blocks(j.deferred);
        let done = Finished {
            kind: j.kind,
            request: named.then(|| self.req(i).id.clone()),
            ok,
            invalid_blocks,
        };
        self.maybe_drop(i);
        Ok(Some(done))
    }
}

/// What [`Scheduler::finish`] says of a completed job.
struct Finished {
    kind: JobKind,
    request: Option<String>,
    ok: bool,
    invalid_blocks: Vec<BlockId>,
}
