//! `kvoffload._core._JobTracker`: the job table and the fence from Python, for the tests and
//! tools that drive them directly. Private (not exported from `kvoffload`): engines use the
//! scheduler, which holds its own tracker.

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyDict};

use super::convert::{self, Arg};
use super::errors::to_py;
use crate::jobs::{Completion, JobKind};
use crate::py::sync::guarded;
use crate::tracker::Tracker;

/// Job table + fence index with eager and deferred lifecycle classes.
#[pyclass(frozen, name = "_JobTracker", module = "kvoffload._core")]
pub struct JobTracker {
    inner: Mutex<Tracker<()>>,
}

impl JobTracker {
    /// The core lock, waited for with the GIL released; never held while calling Python.
    fn lock(&self) -> PyResult<MutexGuard<'_, Tracker<()>>> {
        super::sync::lock(&self.inner)
    }
}

#[pymethods]
impl JobTracker {
    #[new]
    #[pyo3(
        signature = (num_blocks, num_workers = None),
        text_signature = "(num_blocks, num_workers=1)"
    )]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        num_workers: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        // Sizes are extracted here, not by pyo3, so that a negative, oversized or non-integer
        // size raises ConfigError naming it rather than OverflowError or TypeError; the core
        // checks the ranges (and caps them, so that the fence is never too large to allocate).
        let num_blocks = convert::config_int(num_blocks, "num_blocks")?;
        let num_workers = num_workers.map_or(Ok(1), |n| convert::config_int(n, "num_workers"))?;
        let (num_blocks, num_workers) =
            crate::config::tracker_sizes(num_blocks, num_workers).map_err(to_py)?;
        Ok(Self {
            inner: Mutex::new(Tracker::new(num_workers, num_blocks).map_err(to_py)?),
        })
    }

    /// Creates a store job for request `owner` reading `eager` (armed now) and `deferred`
    /// (armed when the request releases its blocks) blocks. Returns the job id.
    #[pyo3(signature = (owner, eager = None, deferred = None))]
    fn create_store(
        &self,
        owner: &Bound<'_, PyAny>,
        eager: Option<&Bound<'_, PyAny>>,
        deferred: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        guarded(|| {
            let owner = convert::owner(owner)?;
            let eager = eager.map_or(Ok(Vec::new()), |b| convert::blocks(b, "eager"))?;
            let deferred = deferred.map_or(Ok(Vec::new()), |b| convert::blocks(b, "deferred"))?;
            let id = self
                .lock()?
                .create(JobKind::Store, owner, eager, deferred, ())
                .map_err(to_py)?;
            Ok(id.0)
        })
    }

    /// Creates a load job for request `owner` writing `blocks` (deferred class). Returns the
    /// job id.
    fn create_load(&self, owner: &Bound<'_, PyAny>, blocks: &Bound<'_, PyAny>) -> PyResult<u64> {
        guarded(|| {
            let owner = convert::owner(owner)?;
            let blocks = convert::blocks(blocks, "blocks")?;
            let id = self
                .lock()?
                .create(JobKind::Load, owner, Vec::new(), blocks, ())
                .map_err(to_py)?;
            Ok(id.0)
        })
    }

    /// Request `owner` released its blocks (finish, abort, preemption).
    fn release(&self, owner: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(|| {
            let owner = convert::owner(owner)?;
            self.lock()?.release(owner);
            Ok(())
        })
    }

    /// Request `owner` holds blocks again (resumed after preemption).
    fn reacquire(&self, owner: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(|| {
            let owner = convert::owner(owner)?;
            self.lock()?.reacquire(owner);
            Ok(())
        })
    }

    /// Request `owner` is gone; no more jobs will be created for it.
    fn forget(&self, owner: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(|| {
            let owner = convert::owner(owner)?;
            self.lock()?.forget(owner);
            Ok(())
        })
    }

    /// The per-step fence check: ids of pending jobs with an armed pair on a written block.
    fn check(&self, written: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        guarded(|| {
            let written = convert::blocks(written, "written")?;
            let flush = self.lock()?.check(&written).map_err(to_py)?;
            Ok(flush.into_iter().map(|j| j.0).collect())
        })
    }

    /// Records worker `worker`'s report for `job`. Returns `"pending"`, `"done"`, `"failed"`
    /// (done, with a failed report) or `"late"` (created before a reset, ignored).
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
    ) -> PyResult<&'static str> {
        guarded(|| {
            let r = convert::Report::new(job, &worker, &ok)?;
            let outcome = self
                .lock()?
                .complete(r.job, r.worker, r.ok)
                .map_err(|e| r.error(e))?;
            Ok(match outcome {
                Completion::Pending { .. } => "pending",
                Completion::Done(j) if j.failed => "failed",
                Completion::Done(_) => "done",
                Completion::Late => "late",
            })
        })
    }

    /// Forgets every job; returns the ids that were pending (all must be flushed).
    fn reset(&self) -> PyResult<Vec<u64>> {
        guarded(|| Ok(self.lock()?.reset().into_iter().map(|j| j.id.0).collect()))
    }

    /// Ids of pending jobs, in creation order.
    fn pending_jobs(&self) -> PyResult<Vec<u64>> {
        guarded(|| Ok(self.lock()?.jobs().pending_ids().map(|j| j.0).collect()))
    }

    /// Ids of pending jobs armed on `block`.
    fn jobs_on(&self, block: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        guarded(|| {
            let b = convert::block(block, "block")?;
            let t = self.lock()?;
            t.validate_blocks(&[b]).map_err(to_py)?;
            let mut ids: Vec<u64> = t.fence().jobs_on(b).iter().map(|j| j.0).collect();
            ids.sort_unstable();
            Ok(ids)
        })
    }

    /// Worker reports still expected for a pending job.
    fn remaining(&self, job: &Bound<'_, PyAny>) -> PyResult<u32> {
        guarded(|| {
            let id = convert::job_id(job)?;
            let t = self.lock()?;
            if let Some(j) = t.jobs().get(id) {
                return Ok(j.remaining);
            }
            // Not pending: never issued or already completed (an error), or late (0).
            t.jobs().validate(id, 0).map_err(to_py)?;
            Ok(0)
        })
    }

    /// Whether request `owner` has released its blocks.
    fn is_released(&self, owner: &Bound<'_, PyAny>) -> PyResult<bool> {
        guarded(|| {
            let owner = convert::owner(owner)?;
            Ok(self.lock()?.is_released(owner))
        })
    }

    /// Number of pending jobs.
    fn __len__(&self) -> PyResult<usize> {
        guarded(|| Ok(self.lock()?.jobs().len()))
    }

    /// Number of armed `(block, job)` pairs.
    #[getter]
    fn armed_pairs(&self) -> PyResult<usize> {
        guarded(|| Ok(self.lock()?.fence().armed_pairs()))
    }

    /// Counters: jobs created, completed, failed, late reports, resets, checks, flushed.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(|| {
            // A snapshot under the lock; the dict is built after it is released (building it may
            // run the garbage collector, whose finalizers may call back in).
            let counters: [(&str, u64); 13] = {
                let t = self.lock()?;
                let (j, f) = (t.job_stats(), t.fence_stats());
                [
                    ("stores_created", j.stores_created),
                    ("loads_created", j.loads_created),
                    ("completed", j.completed),
                    ("failed", j.failed),
                    ("late_reports", j.late_reports),
                    ("resets", j.resets),
                    ("checks", f.checks),
                    ("flushed", f.flushed),
                    ("reset_flushed", f.reset_flushed),
                    ("pending", t.jobs().len() as u64),
                    ("armed_pairs", t.fence().armed_pairs() as u64),
                    ("owners", t.jobs().owners_len() as u64),
                    ("released_owners", t.released_len() as u64),
                ]
            };
            counters.into_py_dict(py)
        })
    }

    fn __repr__(&self) -> PyResult<String> {
        guarded(|| {
            let t = self.lock()?;
            Ok(format!(
                "_JobTracker(num_blocks={}, num_workers={}, pending={}, armed_pairs={})",
                t.fence().num_blocks(),
                t.jobs().num_workers(),
                t.jobs().len(),
                t.fence().armed_pairs()
            ))
        })
    }
}
