//! `kvoffload._core.TierWorker` and its `DiskWorker`, and `disk_inspect`: the worker side of
//! the lower tiers, and the read-only report behind `kvoffload disk inspect` / `verify`.
//!
//! A tier worker registers the CPU pool's buffers (Python buffer objects, e.g. numpy views of
//! the pinned pool tensors: it holds them, so the memory stays alive) and, per KV group, where
//! each tensor's CPU rows sit; it opens the group's tier (a slab file here, a shared-tier
//! client in `remote.rs`'s `RemoteWorker`) and runs tier jobs on its own threads. `submit`
//! (plan tuples) and `submit_packed` (the packed rows `schedule_batch` returns, see
//! [`super::tier::encode_tier_jobs`]) return at once; `poll` / `wait` collect `(job_id, ok)`; `close`
//! finishes the queued jobs and stops the threads. Both subclasses share this base: only the
//! way a group's tier is opened, and their counters, differ.

use std::path::PathBuf;
use std::sync::RwLock;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::copy::register;
use super::errors::{to_py, KvOffloadError};
use super::tier::{decode_tier_jobs, set_counters, worker_jobs, TierJobArg};
use crate::copy::RowSpace;
use crate::ids::JobId;
use crate::py::sync::guarded;
use crate::tier::affinity::CpuSet;
use crate::tier::disk::{
    engine_namespace, inspect, layout_namespace, SlabFile, SlabLayout, MEDIUM as DISK,
};
use crate::tier::io::{CpuRegion, RemoteGroup, TierGroup, TierWorker as Io};
use crate::tier::namespace::Namespace;
use crate::tier::Medium;

/// One region as given: `(buffer, offset, stride, row_bytes)`.
pub type RegionArg = (usize, usize, usize, usize);

/// A group's regions as given: `(buffer, offset, stride, row_bytes)` each.
pub fn cpu_regions(regions: Vec<RegionArg>) -> Vec<CpuRegion> {
    regions
        .into_iter()
        .map(|(buffer, offset, stride, row_bytes)| CpuRegion {
            space: RowSpace {
                buffer,
                offset,
                stride,
            },
            row_bytes,
        })
        .collect()
}

/// `io_cpus` as given (`None`, or an iterable of CPU ids) as a checked [`CpuSet`]: a
/// `ConfigError` naming the offending value otherwise (checked before anything opens).
pub fn io_cpus_arg(io_cpus: Option<&Bound<'_, PyAny>>) -> PyResult<Option<CpuSet>> {
    let Some(obj) = io_cpus.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let ids = super::convert::cpu_ids(obj)?;
    Ok(Some(CpuSet::new(&ids).map_err(to_py)?))
}

/// Checks `io_cpus` as the tier workers do when they open (`None`: no pinning); returns the
/// CPU ids, or raises `ConfigError` naming the offending id.
#[pyfunction]
pub fn check_io_cpus(io_cpus: &Bound<'_, PyAny>) -> PyResult<Option<Vec<usize>>> {
    Ok(io_cpus_arg(Some(io_cpus))?.map(|s| s.ids().to_vec()))
}

/// One group's tier as a worker opens it: its slab file or its shared-tier client.
pub type OpenGroup = (Option<SlabFile>, Option<RemoteGroup>);

/// What `DiskWorker` and `RemoteWorker` share: the registration of the CPU pool, the I/O
/// threads, and submitting, polling, waiting for and closing tier jobs.
#[pyclass(subclass, frozen, module = "kvoffload._core")]
pub struct TierWorker {
    /// `None` once closed.
    inner: RwLock<Option<Io>>,
    medium: Medium,
    /// Keeps every registered buffer alive and unresizable.
    _buffers: Vec<PyBuffer<u8>>,
}

impl TierWorker {
    /// Registers `buffers` and `groups` (`(cpu_rows, block_size, regions)` each) and starts the
    /// threads (pinned to `cpus` when given, checked by [`io_cpus_arg`] before anything
    /// opened); `open(place, layout, chunk_bytes)` opens each group's tier, given the group's
    /// engine namespace on this rank (`model` names the weights: [`engine_namespace`], where
    /// chunks go) and the namespace of the bytes its registered tensors make
    /// ([`layout_namespace`], what headers carry: with the element type of each group's
    /// tensors, `dtypes`, when given). `what` names the class in errors.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        what: &str,
        medium: Medium,
        buffers: &[Bound<'_, PyAny>],
        groups: Vec<(usize, u32, Vec<RegionArg>)>,
        blocks_per_chunk: u32,
        model: &str,
        rank: u32,
        world_size: u32,
        threads: usize,
        cpus: Option<CpuSet>,
        dtypes: Option<&[String]>,
        mut open: impl FnMut(Namespace, Namespace, u64) -> PyResult<OpenGroup>,
    ) -> PyResult<Self> {
        crate::config::worker_layout(
            what,
            blocks_per_chunk,
            rank,
            world_size,
            dtypes.map(<[String]>::len),
            groups.len(),
        )
        .map_err(to_py)?;
        let (held, spans) = register(buffers)?;
        let mut tgroups = Vec::with_capacity(groups.len());
        for (g, (cpu_rows, block_size, regions)) in groups.into_iter().enumerate() {
            let chunk: u64 = regions
                .iter()
                .map(|r| (r.3 * blocks_per_chunk as usize) as u64)
                .sum();
            let ns = engine_namespace(
                model,
                chunk,
                block_size,
                blocks_per_chunk,
                rank,
                world_size,
                g as u32,
            );
            let tensors: Vec<u64> = regions
                .iter()
                .map(|r| (r.3 * blocks_per_chunk as usize) as u64)
                .collect();
            let dtype = dtypes.map_or("", |d| d[g].as_str());
            let bytes = layout_namespace(&ns, dtype, &tensors);
            let (file, remote) = open(ns, bytes, chunk)?;
            tgroups.push(TierGroup {
                cpu_rows,
                rows_per_chunk: blocks_per_chunk as usize,
                regions: cpu_regions(regions),
                file,
                remote,
            });
        }
        #[allow(unsafe_code)]
        // SAFETY: each span is the memory of a buffer held in `_buffers` for the worker's whole
        // lifetime; a held buffer export keeps its exporter from freeing or resizing it.
        let inner = unsafe { Io::new(&spans, tgroups, threads, cpus) }.map_err(to_py)?;
        Ok(Self {
            inner: RwLock::new(Some(inner)),
            medium,
            _buffers: held,
        })
    }

    /// Runs `f` on the open worker (`None` once closed).
    pub fn with<R>(&self, f: impl FnOnce(Option<&Io>) -> R) -> R {
        f(self.inner.read().expect("tier worker lock").as_ref())
    }
}

fn results(done: Vec<(JobId, bool)>) -> Vec<(u64, bool)> {
    done.into_iter().map(|(j, ok)| (j.0, ok)).collect()
}

#[pymethods]
impl TierWorker {
    /// The tier's medium: `"disk"` or `"remote"`.
    #[getter]
    fn medium(&self) -> PyResult<&'static str> {
        guarded(|| Ok(self.medium.as_str()))
    }

    /// Queues tier jobs as `StepPlan.tier_jobs` carries them; returns at once.
    fn submit(&self, jobs: Vec<TierJobArg>) -> PyResult<()> {
        guarded(|| {
            let jobs = worker_jobs(jobs, self.medium)?;
            self.with(|w| w.map(|w| w.submit(jobs)))
                .ok_or_else(|| self.closed_err())
        })
    }

    /// Queues the tier jobs of a packed buffer (`Scheduler.schedule_batch`'s sixth item, one
    /// row per chunk); returns their ids at once, in order.
    fn submit_packed(&self, jobs: &[u8]) -> PyResult<Vec<u64>> {
        guarded(|| {
            let jobs = decode_tier_jobs(jobs, self.medium)?;
            let ids = jobs.iter().map(|j| j.id.0).collect();
            self.with(|w| w.map(|w| w.submit(jobs)))
                .ok_or_else(|| self.closed_err())?;
            Ok(ids)
        })
    }

    /// Jobs finished since the last poll or wait: `(job_id, ok)`.
    ///
    /// Stays attached: it takes a lock the I/O threads hold only to push a result, so releasing
    /// the GIL for it would only let another Python thread take the engine's GIL for up to a
    /// switch interval every step.
    fn poll(&self) -> PyResult<Vec<(u64, bool)>> {
        guarded(|| Ok(results(self.with(|w| w.map(Io::poll).unwrap_or_default()))))
    }

    /// Waits (GIL released) until every job of `job_ids` finished or `timeout` seconds
    /// passed; returns every job finished since the last poll or wait: `(job_id, ok)`.
    #[pyo3(signature = (job_ids, timeout = 60.0))]
    fn wait(&self, py: Python<'_>, job_ids: Vec<u64>, timeout: f64) -> PyResult<Vec<(u64, bool)>> {
        guarded(|| {
            let d = crate::config::wait_timeout(timeout).map_err(to_py)?;
            let ids: Vec<JobId> = job_ids.into_iter().map(JobId).collect();
            Ok(results(py.detach(|| {
                self.with(|w| w.map(|w| w.wait(&ids, d)).unwrap_or_default())
            })))
        })
    }

    /// Finishes the queued jobs (their results are dropped), stops the threads and releases
    /// the tier; later submits raise, polls return nothing. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        guarded(|| {
            let io = self.inner.write().expect("tier worker lock").take();
            py.detach(move || drop(io));
            Ok(())
        })
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> PyResult<bool> {
        guarded(|| Ok(self.with(|w| w.is_none())))
    }
}

impl TierWorker {
    fn closed_err(&self) -> PyErr {
        KvOffloadError::new_err(format!("the {} tier worker was closed", self.medium))
    }
}

/// Runs disk tier jobs on Rust threads, straight from and into the registered CPU pool.
#[pyclass(extends = TierWorker, frozen, module = "kvoffload._core")]
pub struct DiskWorker {}

#[pymethods]
impl DiskWorker {
    /// Opens the slab file of every group under `path` (`disk_bytes` each) for worker `rank`
    /// of `world_size`, and registers the CPU pool: `buffers`, and per group
    /// `(cpu_rows, block_size, regions)` with regions `(buffer, offset, stride, row_bytes)`;
    /// `dtypes` (per group, the element type of its tensors) is part of the chunks' namespace.
    #[new]
    #[pyo3(signature = (path, disk_bytes, buffers, groups, blocks_per_chunk = 1, model = "", rank = 0, world_size = 1, threads = 2, direct = true, sync = true, io_cpus = None, dtypes = None))]
    #[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)]
    fn new(
        path: PathBuf,
        disk_bytes: u64,
        buffers: Vec<Bound<'_, PyAny>>,
        groups: Vec<(usize, u32, Vec<RegionArg>)>,
        blocks_per_chunk: u32,
        model: &str,
        rank: u32,
        world_size: u32,
        threads: usize,
        direct: bool,
        sync: bool,
        io_cpus: Option<Bound<'_, PyAny>>,
        dtypes: Option<Vec<String>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let cpus = io_cpus_arg(io_cpus.as_ref())?;
        let base = TierWorker::open(
            "DiskWorker",
            DISK,
            &buffers,
            groups,
            blocks_per_chunk,
            model,
            rank,
            world_size,
            threads,
            cpus,
            dtypes.as_deref(),
            |place, bytes, chunk| {
                let layout = SlabLayout::new(chunk, disk_bytes).map_err(to_py)?;
                let file =
                    SlabFile::open_in(&path, &place.dir_name(), &bytes, layout, direct, sync)
                        .map_err(to_py)?;
                Ok((Some(file), None))
            },
        )?;
        Ok(PyClassInitializer::from(base).add_subclass(Self {}))
    }

    /// Per group: whether `O_DIRECT` is in use, its I/O counters, how many of the worker's
    /// I/O threads run at the lowest CPU priority and the CPUs they are pinned to
    /// (`io_cpus`, `None`: not pinned) (empty once closed).
    fn stats<'py>(slf: &Bound<'py, Self>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let py = slf.py();
        slf.as_super().get().with(|w| {
            let mut out = Vec::new();
            let (low, threads) = w.map_or((0, 0), Io::low_priority_threads);
            for (g, grp) in w.map_or(&[][..], Io::groups).iter().enumerate() {
                let d = PyDict::new(py);
                d.set_item("group", g)?;
                d.set_item("io_threads", threads)?;
                d.set_item("io_threads_low_priority", low)?;
                d.set_item("io_cpus", w.and_then(Io::cpus))?;
                if let Some(f) = &grp.file {
                    let s = f.io_stats();
                    d.set_item("path", f.path())?;
                    d.set_item("direct", f.direct())?;
                    d.set_item("slots", f.layout().slots)?;
                    d.set_item("chunk_bytes", f.layout().chunk_bytes)?;
                    for (k, v) in s.named() {
                        d.set_item(k, v)?;
                    }
                }
                out.push(d);
            }
            Ok(out)
        })
    }
}

/// Reports every namespace directory of a disk tier at `path` (read-only, under a shared lock);
/// with `verify`, reads every committed chunk and checks its checksum. Each report's
/// `problems` lists what `verify` cannot vouch for, one line each; `in_use` names the holder
/// of a directory an engine owns.
#[pyfunction]
#[pyo3(signature = (path, verify = false))]
#[allow(clippy::needless_pass_by_value)] // pyo3 hands arguments over by value
pub fn disk_inspect(
    py: Python<'_>,
    path: PathBuf,
    verify: bool,
) -> PyResult<Vec<Bound<'_, PyDict>>> {
    let reports = py.detach(|| inspect(&path, verify)).map_err(to_py)?;
    let mut out = Vec::with_capacity(reports.len());
    for r in reports {
        let d = PyDict::new(py);
        d.set_item("namespace", format!("{:032x}", r.namespace))?;
        set_counters!(
            d,
            r,
            dir,
            group,
            chunk_bytes,
            slots,
            chunks,
            free,
            quarantined,
            bad_headers,
            file_bytes,
            disk_bytes
        );
        d.set_item("in_use", r.in_use)?;
        d.set_item("problems", r.problems)?;
        if verify {
            d.set_item("verified", r.verified)?;
            d.set_item("corrupt", r.corrupt)?;
        }
        out.push(d);
    }
    Ok(out)
}
