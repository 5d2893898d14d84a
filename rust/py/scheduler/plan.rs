//! The step plan's Python objects: [`TransferJob`], [`StepPlan`] and [`CompletedJob`].

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList};

use crate::ids::BlockId;
use crate::jobs::JobKind;
use crate::scheduler::{CompletedJob as CoreCompleted, PlannedJob};

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
    /// `transfers` and `keys`, each built on its first read (a job never changes).
    transfers: PyOnceLock<Py<PyList>>,
    keys: PyOnceLock<Py<PyList>>,
}

#[pymethods]
impl TransferJob {
    /// Copies per group: `(group, gpu_blocks, cpu_blocks)`; `cpu_blocks` are positions in the
    /// group's CPU region (`slot * blocks_per_chunk + offset`).
    #[getter]
    fn transfers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = self.transfers.get_or_try_init(py, || {
            let items = self.inner.transfers.iter().map(|t| {
                let gpu = PyList::new(py, t.gpu_blocks.iter().copied())?;
                let cpu = PyList::new(py, t.cpu_blocks.iter().copied())?;
                Ok::<_, PyErr>((t.group, gpu, cpu))
            });
            PyList::new(py, items.collect::<PyResult<Vec<_>>>()?).map(Bound::unbind)
        })?;
        Ok(list.bind(py).clone())
    }

    /// Chunk keys per group: `(group, keys)`.
    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = self.keys.get_or_try_init(py, || {
            let items = self
                .inner
                .transfers
                .iter()
                .map(|t| (t.group, t.keys.iter().map(|k| k.0).collect::<Vec<u128>>()));
            PyList::new(py, items).map(Bound::unbind)
        })?;
        Ok(list.bind(py).clone())
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

pub(super) fn job_obj(py: Python<'_>, j: PlannedJob) -> PyResult<Py<TransferJob>> {
    Py::new(
        py,
        TransferJob {
            job_id: j.id.0,
            kind: kind_name(j.kind),
            request_id: j.request.clone(),
            inner: j,
            transfers: PyOnceLock::new(),
            keys: PyOnceLock::new(),
        },
    )
}

/// What the workers must do this step.
#[pyclass(frozen, get_all, module = "kvoffload._core")]
pub struct StepPlan {
    /// Load jobs created since the previous plan.
    pub(super) loads: Py<PyList>,
    /// Store jobs of this step (submit them at the start of the next step).
    pub(super) stores: Py<PyList>,
    /// Jobs that must complete before this step writes its blocks.
    pub(super) flush: Py<PyList>,
    /// Lower-tier jobs: `(job_id, kind, medium, group, keys, cpu_slots, places, generations)`
    /// with kind `"write"` (write-behind) or `"promote"`; run them with a `DiskWorker`.
    pub(super) tier_jobs: Py<PyList>,
    /// Tier jobs a reset flushed (handed to tier workers, not completed), sorted: wait for them
    /// on their tier worker before this step writes. They are not in `flush`.
    pub(super) tier_flush: Vec<u64>,
}

#[pymethods]
impl StepPlan {
    /// The copies of every job as one packed buffer of runs ([`crate::runs`]): rows of
    /// little-endian `u32` (job index in `loads + stores`, group, first GPU block, first CPU
    /// position, length), as `TransferEngine.step_packed` takes them. Built when asked.
    #[getter]
    fn runs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let mut jobs = Vec::new();
        for list in [&self.loads, &self.stores] {
            for item in list.bind(py).iter() {
                jobs.push(item.cast_into::<TransferJob>()?.unbind());
            }
        }
        let runs = crate::runs::encode(jobs.iter().map(|j| &j.get().inner));
        Ok(PyBytes::new(py, &runs))
    }

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
#[pyclass(frozen, get_all, module = "kvoffload._core")]
pub struct CompletedJob {
    /// Job id.
    job_id: u64,
    /// `"store"` or `"load"`.
    kind: &'static str,
    /// The request it belongs to.
    request_id: String,
    /// Whether every worker succeeded.
    ok: bool,
    /// For a failed load: GPU blocks whose content is invalid (recompute them).
    invalid_blocks: Vec<BlockId>,
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
