//! `kvoffload._core.Scheduler` and its plan objects. Inputs are flat lists (request ids,
//! token counts, block ids) so that one engine step is one call; request ids are borrowed
//! from Python strings without copying.

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyDict, PyList};

use super::convert;
use super::errors::to_py;
use crate::config::{GroupConfig, SchedulerConfig};
use crate::jobs::JobKind;
use crate::policy::PolicyKind;
use crate::pool::PoolEventKind;
use crate::scheduler::{CompletedJob as CoreCompleted, PlannedJob, Scheduler as Core, StepInput};

fn kind_name(kind: JobKind) -> &'static str {
    match kind {
        JobKind::Store => "store",
        JobKind::Load => "load",
    }
}

/// One store or load job of a step plan.
#[pyclass(frozen, module = "kvoffload._core")]
pub struct TransferJob {
    /// Job id.
    #[pyo3(get)]
    job_id: u64,
    /// `"store"` or `"load"`.
    #[pyo3(get)]
    kind: &'static str,
    /// The request it belongs to.
    #[pyo3(get)]
    request_id: String,
    inner: PlannedJob,
}

#[pymethods]
impl TransferJob {
    /// Copies per group: `(group, gpu_blocks, cpu_blocks)`; `cpu_blocks` are positions in the
    /// group's CPU region (`slot * blocks_per_chunk + offset`).
    #[getter]
    fn transfers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .inner
            .transfers
            .iter()
            .map(|t| (t.group, t.gpu_blocks.clone(), t.cpu_blocks.clone()));
        PyList::new(py, items)
    }

    /// Chunk keys per group: `(group, keys)`.
    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .inner
            .transfers
            .iter()
            .map(|t| (t.group, t.keys.iter().map(|k| k.0).collect::<Vec<u128>>()));
        PyList::new(py, items)
    }

    /// Number of GPU blocks copied.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner
            .transfers
            .iter()
            .map(|t| t.gpu_blocks.len())
            .sum()
    }

    fn __repr__(&self) -> String {
        format!(
            "TransferJob(job_id={}, kind={:?}, request_id={:?}, blocks={})",
            self.job_id,
            self.kind,
            self.request_id,
            self.num_blocks()
        )
    }
}

fn job_obj(py: Python<'_>, j: PlannedJob) -> PyResult<Py<TransferJob>> {
    Py::new(
        py,
        TransferJob {
            job_id: j.id.0,
            kind: kind_name(j.kind),
            request_id: j.request.clone(),
            inner: j,
        },
    )
}

/// What the workers must do this step.
#[pyclass(frozen, module = "kvoffload._core")]
pub struct StepPlan {
    /// Load jobs created since the previous plan.
    #[pyo3(get)]
    loads: Py<PyList>,
    /// Store jobs of this step (submit them at the start of the next step).
    #[pyo3(get)]
    stores: Py<PyList>,
    /// Jobs that must complete before this step writes its blocks.
    #[pyo3(get)]
    flush: Py<PyList>,
}

#[pymethods]
impl StepPlan {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StepPlan(loads={}, stores={}, flush={})",
            self.loads.bind(py).len(),
            self.stores.bind(py).len(),
            self.flush
                .bind(py)
                .repr()
                .map_or_else(|_| "?".into(), |r| r.to_string())
        )
    }
}

/// A job whose last worker reported.
#[pyclass(frozen, module = "kvoffload._core")]
pub struct CompletedJob {
    /// Job id.
    #[pyo3(get)]
    job_id: u64,
    /// `"store"` or `"load"`.
    #[pyo3(get)]
    kind: &'static str,
    /// The request it belongs to.
    #[pyo3(get)]
    request_id: String,
    /// Whether every worker succeeded.
    #[pyo3(get)]
    ok: bool,
    /// For a failed load: GPU blocks whose content is invalid (recompute them).
    #[pyo3(get)]
    invalid_blocks: Vec<u32>,
}

#[pymethods]
impl CompletedJob {
    fn __repr__(&self) -> String {
        format!(
            "CompletedJob(job_id={}, kind={:?}, request_id={:?}, ok={})",
            self.job_id,
            self.kind,
            self.request_id,
            if self.ok { "True" } else { "False" }
        )
    }
}

impl From<CoreCompleted> for CompletedJob {
    fn from(c: CoreCompleted) -> Self {
        Self {
            job_id: c.id.0,
            kind: kind_name(c.kind),
            request_id: c.request,
            ok: c.ok,
            invalid_blocks: c.invalid_blocks,
        }
    }
}

/// The scheduler core: request tracking, lookups, loads, store planning and the fence.
#[pyclass(frozen, module = "kvoffload._core")]
pub struct Scheduler {
    inner: Mutex<Core>,
}

impl Scheduler {
    fn lock(&self) -> MutexGuard<'_, Core> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn block_lists(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    convert::for_each_item(obj, what, |g, item| {
        out.push(
            convert::blocks(item, &format!("{what}[{g}]"))?
                .into_iter()
                .map(|b| b.0)
                .collect(),
        );
        Ok(())
    })?;
    Ok(out)
}

fn token_count(v: i64, what: &str) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| {
        super::errors::InvalidRequestError::new_err(format!("{what} must be in 0..2**32, got {v}"))
    })
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (
        groups, *, blocks_per_chunk, hash_block_size, num_gpu_blocks, cpu_chunks,
        policy = "lru", num_workers = 1, max_loading_requests = 0, offload_prompt_only = false,
        max_offload_tokens = None, store_threshold = 0, null_block = Some(0),
        debug_skip_deferred_arming = false
    ))]
    #[allow(clippy::too_many_arguments, clippy::fn_params_excessive_bools)]
    fn new(
        groups: Vec<(u32, Option<u32>, u64)>,
        blocks_per_chunk: u32,
        hash_block_size: u32,
        num_gpu_blocks: u32,
        cpu_chunks: u32,
        policy: &str,
        num_workers: u32,
        max_loading_requests: u32,
        offload_prompt_only: bool,
        max_offload_tokens: Option<u32>,
        store_threshold: u32,
        null_block: Option<u32>,
        debug_skip_deferred_arming: bool,
    ) -> PyResult<Self> {
        let policy: PolicyKind = policy.parse().map_err(to_py)?;
        let cfg = SchedulerConfig {
            groups: groups
                .into_iter()
                .map(
                    |(block_size, sliding_window, bytes_per_chunk)| GroupConfig {
                        block_size,
                        sliding_window,
                        bytes_per_chunk,
                    },
                )
                .collect(),
            blocks_per_chunk,
            hash_block_size,
            num_gpu_blocks,
            null_block,
            cpu_chunks,
            policy,
            num_workers,
            max_loading_requests,
            offload_prompt_only,
            max_offload_tokens,
            store_threshold,
            debug_skip_deferred_arming,
        };
        Ok(Self {
            inner: Mutex::new(Core::new(cfg).map_err(to_py)?),
        })
    }

    /// Registers a request: its prompt length and the chained hashes (int or bytes) of its
    /// complete hash blocks.
    fn add_request(
        &self,
        request_id: &str,
        prompt_len: i64,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let n = token_count(prompt_len, "prompt_len")?;
        let hashes = convert::keys(block_hashes, "block_hashes")?;
        self.lock()
            .add_request(request_id, n, hashes)
            .map_err(to_py)
    }

    /// Appends chained hashes as the request's tokens grow.
    fn extend_hashes(&self, request_id: &str, block_hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let hashes = convert::keys(block_hashes, "block_hashes")?;
        self.lock()
            .extend_hashes(request_id, &hashes)
            .map_err(to_py)
    }

    /// Tokens loadable beyond the engine's prefix hit; `None`: ask again later.
    fn lookup(&self, request_id: &str, num_computed_tokens: i64) -> PyResult<Option<u32>> {
        let hit = token_count(num_computed_tokens, "num_computed_tokens")?;
        self.lock().lookup(request_id, hit).map_err(to_py)
    }

    /// Records the request's block table (one list per group) after the engine allocated it;
    /// creates the load job of `num_load_tokens` tokens. Returns the load job id, if any.
    fn allocate(
        &self,
        request_id: &str,
        block_ids: &Bound<'_, PyAny>,
        num_computed_tokens: i64,
        num_load_tokens: i64,
    ) -> PyResult<Option<u64>> {
        let tables = block_lists(block_ids, "block_ids")?;
        let hit = token_count(num_computed_tokens, "num_computed_tokens")?;
        let load = token_count(num_load_tokens, "num_load_tokens")?;
        let job = self
            .lock()
            .allocate(request_id, &tables, hit, load)
            .map_err(to_py)?;
        Ok(job.map(|j| j.0))
    }

    /// The engine released a running request's blocks outside a step (e.g. after a failed
    /// load); idempotent.
    fn preempt(&self, request_id: &str) -> PyResult<()> {
        self.lock().preempt(request_id).map_err(to_py)
    }

    /// Applies one engine step; returns its plan.
    #[pyo3(signature = (
        scheduled, computed, new_blocks = None, resumed = None, finished = None,
        aborted = None, preempted = None, written = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn schedule(
        &self,
        py: Python<'_>,
        scheduled: Vec<PyBackedStr>,
        computed: Vec<i64>,
        new_blocks: Option<Vec<(PyBackedStr, u32, Bound<'_, PyAny>)>>,
        resumed: Option<Vec<PyBackedStr>>,
        finished: Option<Vec<PyBackedStr>>,
        aborted: Option<Vec<PyBackedStr>>,
        preempted: Option<Vec<PyBackedStr>>,
        written: Option<Bound<'_, PyAny>>,
    ) -> PyResult<StepPlan> {
        let computed = computed
            .into_iter()
            .map(|c| token_count(c, "computed tokens"))
            .collect::<PyResult<Vec<u32>>>()?;
        let new_blocks = new_blocks
            .unwrap_or_default()
            .into_iter()
            .map(|(id, g, b)| {
                let blocks = convert::blocks(&b, "new_blocks")?;
                Ok((id, g, blocks.into_iter().map(|b| b.0).collect()))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let written = match written {
            Some(w) if !w.is_none() => Some(
                convert::blocks(&w, "written")?
                    .into_iter()
                    .map(|b| b.0)
                    .collect(),
            ),
            _ => None,
        };
        let input = StepInput {
            scheduled,
            computed,
            new_blocks,
            resumed: resumed.unwrap_or_default(),
            finished: finished.unwrap_or_default(),
            aborted: aborted.unwrap_or_default(),
            preempted: preempted.unwrap_or_default(),
            written,
        };
        let plan = self.lock().schedule(&input).map_err(to_py)?;
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
        })
    }

    /// Records `count` worker reports for `job`. Returns the completed job when the last
    /// worker reported, else `None` (also for reports of jobs from before a reset).
    #[pyo3(signature = (job, count = None, ok = true))]
    fn complete(
        &self,
        job: &Bound<'_, PyAny>,
        count: Option<&Bound<'_, PyAny>>,
        ok: bool,
    ) -> PyResult<Option<CompletedJob>> {
        let (id, clamped, count) = convert::completion(job, count)?;
        Ok(self
            .lock()
            .complete(id, clamped, ok)
            .map_err(|e| convert::completion_error(e, id, count, clamped))?
            .map(CompletedJob::from))
    }

    /// Forgets every pending job and empties the CPU tier. Returns `(flushed job ids,
    /// [(request_id, cancelled load job id)])`.
    fn reset(&self) -> (Vec<u64>, Vec<(String, u64)>) {
        let (flushed, cancelled) = self.lock().reset();
        (
            flushed.into_iter().map(|j| j.0).collect(),
            cancelled.into_iter().map(|(r, j)| (r, j.0)).collect(),
        )
    }

    /// Drains pool events: `(kind, group, keys, medium)` with kind `"stored"` / `"removed"`.
    fn take_events(&self) -> Vec<(&'static str, u32, Vec<u128>, &'static str)> {
        self.lock()
            .take_events()
            .into_iter()
            .map(|e| {
                let kind = match e.kind {
                    PoolEventKind::Stored => "stored",
                    PoolEventKind::Removed => "removed",
                };
                (kind, e.group, e.keys.iter().map(|k| k.0).collect(), "cpu")
            })
            .collect()
    }

    /// Status of a request: waiting, running, preempted, finished or aborted.
    fn status(&self, request_id: &str) -> PyResult<&'static str> {
        Ok(self.lock().status(request_id).map_err(to_py)?.name())
    }

    /// Ids of pending jobs, in creation order.
    fn pending_jobs(&self) -> Vec<u64> {
        self.lock()
            .pending_jobs()
            .into_iter()
            .map(|j| j.0)
            .collect()
    }

    /// Number of tracked requests.
    #[getter]
    fn num_requests(&self) -> usize {
        self.lock().num_requests()
    }

    /// Number of armed `(block, job)` pairs.
    #[getter]
    fn armed_pairs(&self) -> usize {
        self.lock().armed_pairs()
    }

    /// Requests with a pending load.
    #[getter]
    fn loading_requests(&self) -> u32 {
        self.lock().loading_requests()
    }

    /// Counters of the scheduler, the job table, the fence and each group's pool.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let core = self.lock();
        let st = core.stats();
        let (jobs, fence) = core.tracker_stats();
        let d = PyDict::new(py);
        for (k, v) in [
            ("steps", st.steps),
            ("lookups", st.lookups),
            ("lookups_deferred", st.lookups_deferred),
            ("lookup_hit_tokens", st.lookup_hit_tokens),
            ("max_lookup_wait_steps", st.max_lookup_wait_steps),
            ("store_jobs", st.store_jobs),
            ("store_chunks", st.store_chunks),
            ("store_bytes", st.store_bytes),
            ("load_jobs", st.load_jobs),
            ("load_blocks", st.load_blocks),
            ("load_tokens", st.load_tokens),
            ("load_bytes", st.load_bytes),
            ("flushes_necessary", st.flushes_necessary),
            ("flushes_conservative", st.flushes_conservative),
            ("flushes_reset", st.flushes_reset),
            ("store_no_room", st.store_no_room),
            ("chunks_dropped", st.chunks_dropped),
            ("failed_stores", st.failed_stores),
            ("failed_loads", st.failed_loads),
            ("resets", st.resets),
            ("jobs_completed", jobs.completed),
            ("late_reports", jobs.late_reports),
            ("fence_checks", fence.checks),
        ] {
            d.set_item(k, v)?;
        }
        d.set_item("pending_jobs", core.pending_jobs().len())?;
        d.set_item("armed_pairs", core.armed_pairs())?;
        d.set_item("requests", core.num_requests())?;
        d.set_item("loading_requests", core.loading_requests())?;
        let pools = PyList::empty(py);
        for g in 0..core.config().groups.len() {
            let p = core.pool(g).expect("group pool").stats();
            let pd = PyDict::new(py);
            pd.set_item("capacity", p.capacity)?;
            pd.set_item("used", p.used)?;
            pd.set_item("storing", p.storing)?;
            pd.set_item("pinned", p.pinned)?;
            pd.set_item("hits", p.hits)?;
            pd.set_item("misses", p.misses)?;
            pd.set_item("evictions", p.evictions)?;
            pd.set_item("failed_stores", p.failed_stores)?;
            pools.append(pd)?;
        }
        d.set_item("pools", pools)?;
        Ok(d)
    }
}
