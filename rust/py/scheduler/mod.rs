//! `kvoffload._core.Scheduler` and its plan objects. Inputs are flat lists (request ids,
//! token counts, block ids) so that one engine step is one call; request ids are borrowed
//! from Python strings without copying.
//!
//! Every argument is converted into owned Rust values before the core lock is taken, and every
//! Python object is built after it is released (see `super::sync`); a value of the wrong type
//! or range raises a `kvoffload.errors` exception naming the argument and the value, with the
//! core untouched. Configuration values are handed to [`SchedulerArgs::resolve`] as given: it
//! is the one place that checks them.
//!
//! The plan objects are in `plan`, the input conversion in `input`, the constructor's
//! signature in `config`.

mod batch;
mod config;
mod ids;
mod input;
mod plan;
mod stats;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyDict, PyList, PyTuple};

use self::config::resolve;
use self::input::{block_lists, id_list, new_blocks_input, request_tokens, scheduled_input};
use self::plan::job_obj;
pub use self::plan::{CompletedJob, StepPlan, TransferJob};
use super::convert::{self, Arg};
use super::engine::engine_hashes_from;
use super::errors::to_py;
use crate::error::Error;
use crate::py::sync::guarded;
use crate::scheduler::{Scheduler as Core, StepInput, TABLE_ROOM};

/// [`Scheduler::tail_under_lock`]'s answer: the lock, the held hash count, the tail's start.
type Tail<'a> = (MutexGuard<'a, Core>, Option<usize>, usize, Vec<crate::Key>);

/// The scheduler core: request tracking, lookups, loads, store planning and the fence.
#[pyclass(frozen, module = "kvoffload._core")]
pub struct Scheduler {
    inner: Mutex<Core>,
    /// How many times the lock was taken (bumped under it): a call that converts its input
    /// between two locks sees whether anyone else had the core meanwhile.
    locks: AtomicU64,
    /// `schedule_batch`'s scheduled ids of the previous step, by object (`ids`); taken before
    /// the core lock, never while holding it.
    ids: Mutex<ids::IdCache>,
}

/// `reset`'s answer: flushed job ids, `(request id, cancelled load)` pairs.
type ResetLists = (Vec<u64>, Vec<(String, u64)>);

/// `take_events`' rows: `(kind, group, keys, medium)`.
type EventRows = Vec<(&'static str, u32, Vec<u128>, &'static str)>;

impl Scheduler {
    /// The core lock, waited for with the GIL released; never held while calling Python.
    fn lock(&self) -> PyResult<MutexGuard<'_, Core>> {
        let core = super::sync::lock(&self.inner)?;
        self.locks.fetch_add(1, Ordering::Relaxed);
        Ok(core)
    }

    /// The hashes of `block_hashes` (a request's whole hash list) from the last one the core
    /// holds for `id` on (all of them if it does not track `id`), the held count, their
    /// position in the list, and the lock under which the held count still holds. The held
    /// hash converted again lets the core check the list against the ones it holds: hashes
    /// are chained, so the last one stands for the whole prefix. The conversion runs unlocked (it may call
    /// Python, which may call back in and change the request); if the count changed
    /// meanwhile it is converted again, so the tail is never appended at the wrong position.
    fn tail_under_lock(&self, id: &str, block_hashes: &Bound<'_, PyAny>) -> PyResult<Tail<'_>> {
        loop {
            let held = self.lock()?.num_hashes(id).ok();
            // (A `block_hashes` that is no sequence fails in the conversion, as it should.)
            let len = block_hashes.len().unwrap_or(usize::MAX);
            let from = held.map_or(0, |n| n.saturating_sub(1).min(len));
            // A new request's list becomes its own: room for the hashes it decodes (vLLM
            // appends one per full block), so that its first appends do not copy it.
            let spare = if held.is_none() { TABLE_ROOM } else { 0 };
            let tail = engine_hashes_from(block_hashes, from, spare, "block_hashes")?;
            let core = self.lock()?;
            if core.num_hashes(id).ok() == held {
                return Ok((core, held, from, tail));
            }
        }
    }

    /// One worker's report applied by `apply`, all or nothing (see `complete_many`).
    fn report<T>(
        &self,
        finished: &Bound<'_, PyAny>,
        failed: Option<&Bound<'_, PyAny>>,
        worker: &Arg<'_>,
        apply: impl FnOnce(&mut Core, &[(crate::JobId, u32, bool)]) -> Result<T, Error>,
    ) -> PyResult<T> {
        // The rank is checked even for an empty report.
        let (_, clamped, w) =
            convert::completion(&0u8.into_pyobject(finished.py())?.into_any(), worker)?;
        let mut reports = Vec::new();
        for (ids, ok) in [(Some(finished), true), (failed, false)] {
            let Some(ids) = ids else { continue };
            let ids = convert::report_ids(ids, worker)?;
            reports.reserve(ids.len());
            reports.extend(ids.into_iter().map(|(id, clamped, _)| (id, clamped, ok)));
        }
        apply(&mut *self.lock()?, &reports).map_err(|e| match e {
            Error::WorkerOutOfRange { job, .. } => convert::completion_error(e, job, w, clamped),
            e => to_py(e),
        })
    }
}

#[pymethods]
impl Scheduler {
    /// Builds the core and attaches the lower tiers the options name (GIL released: the disk
    /// tier's index is rebuilt from its directory, the shared tier's client connects). The
    /// options are `OffloadConfig`'s fields: `groups` holds `(block_size, sliding_window,
    /// bytes_per_block)` per KV group; give exactly one of `cpu_chunks` (slots per group) and
    /// `cpu_bytes` (all groups).
    #[new]
    #[pyo3(
        signature = (*args, **kwargs),
        text_signature = "(groups, *, num_gpu_blocks, blocks_per_chunk=1, hash_block_size=None, \
            cpu_chunks=None, cpu_bytes=None, policy='lru', num_workers=1, max_loading_requests=0, \
            offload_prompt_only=False, max_offload_tokens=None, store_threshold=0, null_block=0, \
            debug_skip_deferred_arming=False, disk_path=None, disk_bytes=None, disk_model='', \
            disk_deadline_ms=5000.0, disk_probation_after=3, disk_probation_ms=5000.0, \
            disk_write_mbps=0.0, remote_url=None, remote_model='', cache_salt='', \
            remote_deadline_ms=1000.0, remote_tls_ca=None, disk_min_hits=0, remote_min_hits=0, \
            tier_write_share=0.125, io_cpus=None)"
    )]
    fn new(
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let cfg = resolve(args, kwargs)?;
        Ok(Self {
            inner: Mutex::new(py.detach(|| Core::open(cfg)).map_err(to_py)?),
            locks: AtomicU64::new(0),
            ids: Mutex::default(),
        })
    }

    /// Checks a configuration without building or opening anything (same arguments as the
    /// constructor).
    /// Returns `(cpu_chunks, bytes_per_chunk of each group)` as the core resolves them.
    #[staticmethod]
    #[pyo3(
        signature = (*args, **kwargs),
        text_signature = "(groups, *, num_gpu_blocks, blocks_per_chunk=1, hash_block_size=None, \
            cpu_chunks=None, cpu_bytes=None, policy='lru', num_workers=1, max_loading_requests=0, \
            offload_prompt_only=False, max_offload_tokens=None, store_threshold=0, null_block=0, \
            debug_skip_deferred_arming=False, disk_path=None, disk_bytes=None, disk_model='', \
            disk_deadline_ms=5000.0, disk_probation_after=3, disk_probation_ms=5000.0, \
            disk_write_mbps=0.0, remote_url=None, remote_model='', cache_salt='', \
            remote_deadline_ms=1000.0, remote_tls_ca=None, disk_min_hits=0, remote_min_hits=0, \
            tier_write_share=0.125, io_cpus=None)"
    )]
    fn check_config(
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<(u32, Vec<u64>)> {
        let cfg = resolve(args, kwargs)?;
        let bytes = cfg.groups.iter().map(|g| g.bytes_per_chunk).collect();
        Ok((cfg.cpu_chunks, bytes))
    }

    /// What each keyword of the constructor takes when omitted, by name (the required ones
    /// left out).
    #[staticmethod]
    fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
        self::config::defaults(py)
    }

    /// Registers a request: its prompt length and the chained hashes (int or bytes) of its
    /// complete hash blocks.
    fn add_request(
        &self,
        request_id: &Bound<'_, PyAny>,
        prompt_len: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        guarded(|| {
            let id = convert::request_id(request_id, "request_id")?;
            let n = request_tokens(prompt_len, "prompt_len")?;
            let hashes = convert::keys(block_hashes, "block_hashes")?;
            self.lock()?.add_request(id, n, hashes).map_err(to_py)
        })
    }

    /// Appends chained hashes as the request's tokens grow.
    fn extend_hashes(
        &self,
        request_id: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        guarded(|| {
            let id = convert::request_id(request_id, "request_id")?;
            let hashes = convert::keys(block_hashes, "block_hashes")?;
            self.lock()?.extend_hashes(id, &hashes).map_err(to_py)
        })
    }

    /// Tokens loadable beyond the engine's prefix hit; `None`: ask again later.
    fn lookup(
        &self,
        request_id: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u32>> {
        guarded(|| {
            let id = convert::request_id(request_id, "request_id")?;
            let hit = request_tokens(num_computed_tokens, "num_computed_tokens")?;
            self.lock()?.lookup(id, hit).map_err(to_py)
        })
    }

    /// Records the request's block table (one list per group, of block ids or of the engine's
    /// block objects with a `block_id`) after the engine allocated it;
    /// creates the load job of `num_load_tokens` tokens. Returns the load job id, if any.
    fn allocate(
        &self,
        request_id: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
        num_load_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u64>> {
        guarded(|| {
            let id = convert::request_id(request_id, "request_id")?;
            let tables = block_lists(block_ids, "block_ids")?;
            let hit = request_tokens(num_computed_tokens, "num_computed_tokens")?;
            let load = request_tokens(num_load_tokens, "num_load_tokens")?;
            let job = self
                .lock()?
                .allocate(id, &tables, hit, load)
                .map_err(to_py)?;
            Ok(job.map(|j| j.0))
        })
    }

    /// The engine released a running request's blocks outside a step (e.g. after a failed
    /// load); idempotent.
    fn preempt(&self, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(|| {
            let id = convert::request_id(request_id, "request_id")?;
            self.lock()?.preempt(id).map_err(to_py)
        })
    }

    /// Applies one engine step; returns its plan. `scheduled` holds `(request_id, tokens)`
    /// pairs, or, with `computed`, the request ids alone (two parallel sequences).
    #[pyo3(signature = (
        scheduled, computed = None, new_blocks = None, resumed = None, finished = None,
        aborted = None, preempted = None, written = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn schedule(
        &self,
        py: Python<'_>,
        scheduled: &Bound<'_, PyAny>,
        computed: Option<&Bound<'_, PyAny>>,
        new_blocks: Option<&Bound<'_, PyAny>>,
        resumed: Option<&Bound<'_, PyAny>>,
        finished: Option<&Bound<'_, PyAny>>,
        aborted: Option<&Bound<'_, PyAny>>,
        preempted: Option<&Bound<'_, PyAny>>,
        written: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<StepPlan> {
        guarded(|| {
            let (scheduled, computed) = scheduled_input(scheduled, computed)?;
            let new_blocks = match new_blocks {
                Some(b) if !b.is_none() => new_blocks_input(b)?,
                _ => Vec::new(),
            };
            let written = match written {
                Some(w) if !w.is_none() => Some(convert::blocks(w, "written")?),
                _ => None,
            };
            let input = StepInput {
                scheduled,
                computed,
                new_blocks,
                resumed: id_list(resumed, "resumed")?,
                finished: id_list(finished, "finished")?,
                aborted: id_list(aborted, "aborted")?,
                preempted: id_list(preempted, "preempted")?,
                written,
            };
            let plan = self.lock()?.schedule(&input).map_err(to_py)?;
            let loads = plan
                .loads
                .into_iter()
                .map(|j| job_obj(py, j))
                .collect::<PyResult<Vec<_>>>()?;
            let stores = plan
                .stores
                .into_iter()
                .map(|j| job_obj(py, j))
                .collect::<PyResult<Vec<_>>>()?;
            Ok(StepPlan {
                loads: PyList::new(py, loads)?.unbind(),
                stores: PyList::new(py, stores)?.unbind(),
                flush: PyList::new(py, plan.flush.iter().map(|j| j.0))?.unbind(),
                tier_jobs: PyList::new(
                    py,
                    plan.tier_jobs.into_iter().map(super::tier::tier_job_tuple),
                )?
                .unbind(),
                tier_flush: plan.tier_flush.iter().map(|j| j.0).collect(),
            })
        })
    }

    /// One engine step from the sequences the engine holds (see `batch`): `scheduled` ids and
    /// their `computed` tokens before the step, plus `added[id]` (the step's scheduled tokens)
    /// where `added` is given; `new` `(id, computed tokens, one block list per group)` requests
    /// scheduled before those (as they are: the engine's own lists of its running requests are
    /// passed without a concatenated copy), their whole tables read as `tables`' are;
    /// `appended` (parallel to `scheduled`, `None` or one block list per group) the blocks
    /// appended this step; `tables` `(id, one block list per group)` whole tables, of which the
    /// blocks beyond the core's are appended; `hashes` maps ids to their
    /// whole, growing hash lists (read where the core lacks hashes). Appended blocks, and the
    /// blocks `allocate` handed out beyond the prefix hit since the previous step, count as
    /// written; `written` adds the others (block ids or engine blocks; `None`: the conservative
    /// fence). Returns `(load job ids, their request ids, store job ids, flush, runs, tier jobs,
    /// tier flush)`, the tier jobs packed for `TierWorker.submit_packed`
    /// (`tier::encode_tier_jobs`), the tier flush the tier jobs a reset flushed (not in `flush`).
    #[pyo3(signature = (
        scheduled, computed, *, new = None, added = None, appended = None, tables = None,
        hashes = None, finished = None, aborted = None, preempted = None, written = None
    ))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn schedule_batch<'py>(
        &self,
        py: Python<'py>,
        scheduled: &Bound<'py, PyAny>,
        computed: &Bound<'py, PyAny>,
        new: Option<&Bound<'py, PyAny>>,
        added: Option<&Bound<'py, PyAny>>,
        appended: Option<&Bound<'py, PyAny>>,
        tables: Option<&Bound<'py, PyAny>>,
        hashes: Option<&Bound<'py, PyAny>>,
        finished: Option<&Bound<'py, PyAny>>,
        aborted: Option<&Bound<'py, PyAny>>,
        preempted: Option<&Bound<'py, PyAny>>,
        written: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(
        Vec<u64>,
        Vec<String>,
        Vec<u64>,
        Vec<u64>,
        Bound<'py, PyBytes>,
        Bound<'py, PyBytes>,
        Vec<u64>,
    )> {
        guarded(|| {
            let args = batch::Args {
                scheduled,
                computed,
                new,
                added,
                appended,
                tables,
                hashes,
                finished,
                aborted,
                preempted,
                written,
            };
            let mut plan = self.batch_step(&args)?;
            let tier_jobs = super::tier::encode_tier_jobs(&plan.tier_jobs);
            let out = (
                plan.loads.iter().map(|j| j.id.0).collect(),
                plan.loads
                    .iter_mut()
                    .map(|j| std::mem::take(&mut j.request))
                    .collect(),
                plan.stores.iter().map(|j| j.id.0).collect(),
                plan.flush.iter().map(|j| j.0).collect(),
                PyBytes::new(py, &plan.runs),
                PyBytes::new(py, &tier_jobs),
                plan.tier_flush.iter().map(|j| j.0).collect(),
            );
            // Encoded: the jobs' lists serve the next plans' jobs.
            self.lock()?.recycle(plan);
            Ok(out)
        })
    }

    /// Registers a request (prompt length and hashes) if the core does not track it, else
    /// appends the hashes beyond those it holds. `block_hashes` is the request's whole hash list
    /// so far; `bytes` hashes are keyed by the int of their last 8 bytes, big-endian (the
    /// 64-bit ints vLLM publishes in its KV events). Only the new hashes and the last held one
    /// are converted: a list shorter than the held one, or whose hash at that position differs
    /// (hashes are chained: the whole prefix differs), raises `RequestStateError`, nothing
    /// changed.
    fn sync_request(
        &self,
        request_id: &Bound<'_, PyAny>,
        prompt_len: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        guarded(|| {
            let id = convert::request_id(request_id, "request_id")?;
            let n = request_tokens(prompt_len, "prompt_len")?;
            match self.tail_under_lock(id, block_hashes)? {
                // Not tracked: registered with the list as converted (the core's copy spared).
                (mut core, None, _, tail) => core.add_request(id, n, tail),
                (mut core, Some(_), from, tail) => core.sync_request(id, n, &tail, from),
            }
            .map_err(to_py)
        })
    }

    /// An engine's ask in one call (vLLM's `get_num_new_matched_tokens`): [`Self::sync_request`]
    /// (registers the request with `prompt_len`, or appends the hashes of `block_hashes`, its
    /// whole hash list so far, beyond those the core holds), a running request is released as
    /// by `preempt` (the engine queued it again), then [`Self::lookup`]. A `num_computed_tokens`
    /// that is not a multiple of the block size, or a hash list that contradicts the held one
    /// (as in `sync_request`), raises `RequestStateError`, nothing changed.
    fn lookup_request(
        &self,
        request_id: &Bound<'_, PyAny>,
        prompt_len: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u32>> {
        guarded(|| {
            let id = convert::request_id(request_id, "request_id")?;
            let n = request_tokens(prompt_len, "prompt_len")?;
            let hit = request_tokens(num_computed_tokens, "num_computed_tokens")?;
            let (mut core, _, from, tail) = self.tail_under_lock(id, block_hashes)?;
            core.lookup_request(id, n, tail, from, hit).map_err(to_py)
        })
    }

    /// Bounds each CPU pool's event queue to `limit` keys; 0 records no events (for an engine
    /// that publishes none).
    fn set_event_limit(&self, limit: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(|| {
            let limit = convert::config_int(limit, "limit")?;
            let limit = crate::config::event_limit(limit).map_err(to_py)?;
            self.lock()?.set_event_limit(limit);
            Ok(())
        })
    }

    /// Panics inside the core with its lock held, as an internal bug would: the boundary's tests
    /// check that it raises `InternalError` and that the object then refuses every call. Never
    /// called by kvoffload itself.
    fn _debug_panic(&self) -> PyResult<()> {
        guarded(|| {
            let _core = self.lock()?;
            panic!("Scheduler._debug_panic was called")
        })
    }

    /// Records worker `worker`'s report for `job`. Returns the completed job when every worker
    /// reported, else `None` (also for reports of jobs from before a reset).
    #[pyo3(
        signature = (job, worker = Arg::Omitted, ok = Arg::Omitted),
        text_signature = "(self, job, worker=0, ok=True)"
    )]
    #[allow(clippy::needless_pass_by_value)] // pyo3 hands arguments over by value
    fn complete(
        &self,
        job: &Bound<'_, PyAny>,
        worker: Arg<'_>,
        ok: Arg<'_>,
    ) -> PyResult<Option<CompletedJob>> {
        guarded(|| {
            let r = convert::Report::new(job, &worker, &ok)?;
            Ok(self
                .lock()?
                .complete(r.job, r.worker, r.ok)
                .map_err(|e| r.error(e))?
                .map(CompletedJob::from))
        })
    }

    /// Records one worker's report, all or nothing: `finished` and `failed` job ids from
    /// worker `worker`. Returns the jobs that completed.
    #[pyo3(
        signature = (finished, failed = None, worker = Arg::Omitted),
        text_signature = "(self, finished, failed=None, worker=0)"
    )]
    #[allow(clippy::needless_pass_by_value)] // pyo3 hands arguments over by value
    fn complete_many(
        &self,
        finished: &Bound<'_, PyAny>,
        failed: Option<&Bound<'_, PyAny>>,
        worker: Arg<'_>,
    ) -> PyResult<Vec<CompletedJob>> {
        guarded(|| {
            let done = self.report(finished, failed, &worker, Core::complete_many)?;
            Ok(done.into_iter().map(CompletedJob::from).collect())
        })
    }

    /// [`Self::complete_many`] for a caller that needs no job objects: returns how many jobs
    /// completed `(ok, failed)`.
    #[pyo3(
        signature = (finished, failed = None, worker = Arg::Omitted),
        text_signature = "(self, finished, failed=None, worker=0)"
    )]
    #[allow(clippy::needless_pass_by_value)] // pyo3 hands arguments over by value
    fn complete_counts(
        &self,
        finished: &Bound<'_, PyAny>,
        failed: Option<&Bound<'_, PyAny>>,
        worker: Arg<'_>,
    ) -> PyResult<(usize, usize)> {
        guarded(|| self.report(finished, failed, &worker, Core::complete_counts))
    }

    /// Forgets every pending job and empties the CPU tier. Returns `(flushed job ids,
    /// [(request_id, cancelled load job id)])`.
    fn reset(&self) -> PyResult<ResetLists> {
        guarded(|| {
            let (flushed, cancelled) = self.lock()?.reset();
            Ok((
                flushed.into_iter().map(|j| j.0).collect(),
                cancelled.into_iter().map(|(r, j)| (r, j.0)).collect(),
            ))
        })
    }

    /// Drains pool and tier events: `(kind, group, keys, medium)` with kind `"stored"` /
    /// `"removed"` and medium `"cpu"` or a tier's (`"disk"`).
    fn take_events(&self) -> PyResult<EventRows> {
        guarded(|| Ok(stats::take_events(&mut *self.lock()?)))
    }

    /// Per group and lower tier: its counters (hits, bytes, promotions, quarantined, queue
    /// depth, I/O time, ...).
    fn tier_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        guarded(|| {
            let stats = self.lock()?.tier_stats();
            stats
                .iter()
                .map(|s| super::tier::tier_stats_dict(py, s))
                .collect()
        })
    }

    /// Status of a request: waiting, running, preempted, finished or aborted.
    fn status(&self, request_id: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        guarded(|| {
            let id = convert::request_id(request_id, "request_id")?;
            Ok(self.lock()?.status(id).map_err(to_py)?.name())
        })
    }

    /// Ids of pending jobs, in creation order.
    fn pending_jobs(&self) -> PyResult<Vec<u64>> {
        guarded(|| {
            Ok(self
                .lock()?
                .pending_jobs()
                .into_iter()
                .map(|j| j.0)
                .collect())
        })
    }

    /// Number of pending jobs (without listing them).
    #[getter]
    fn num_pending(&self) -> PyResult<usize> {
        guarded(|| Ok(self.lock()?.num_pending()))
    }

    /// Number of tracked requests.
    #[getter]
    fn num_requests(&self) -> PyResult<usize> {
        guarded(|| Ok(self.lock()?.num_requests()))
    }

    /// Number of armed `(block, job)` pairs.
    #[getter]
    fn armed_pairs(&self) -> PyResult<usize> {
        guarded(|| Ok(self.lock()?.armed_pairs()))
    }

    /// Requests with a pending load.
    #[getter]
    fn loading_requests(&self) -> PyResult<u32> {
        guarded(|| Ok(self.lock()?.loading_requests()))
    }

    /// Counters of the scheduler, the job table, the fence and each group's pool.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(|| {
            // A snapshot under the lock; the dicts are built after it is released (building them
            // may run the garbage collector, whose finalizers may call back in).
            let (counters, pools) = stats::snapshot(&*self.lock()?);
            let d = counters.into_py_dict(py)?;
            let pools = pools
                .iter()
                .map(|p| super::pool::pool_counters(p).into_py_dict(py))
                .collect::<PyResult<Vec<_>>>()?;
            d.set_item("pools", pools)?;
            Ok(d)
        })
    }
}
