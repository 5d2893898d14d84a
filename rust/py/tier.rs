//! `kvoffload._core.DiskWorker` and `disk_inspect`: the worker side of the disk tier, and the
//! read-only report behind `kvoffload disk inspect` / `verify`.
//!
//! A `DiskWorker` registers the CPU pool's buffers (Python buffer objects, e.g. numpy views of
//! the pinned pool tensors: it holds them, so the memory stays alive) and, per KV group, where
//! each tensor's CPU rows sit; it opens the group's slab file and runs tier jobs on its own
//! threads. `submit` returns at once; `poll` / `wait` collect `(job_id, ok)`.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::{to_py, ConfigError, KvOffloadError};
use crate::copy::{RowSpace, Span};
use crate::ids::{JobId, Key};
use crate::scheduler::{TierGroupStats, TierJob, TierJobKind};
use crate::tier::disk::{engine_namespace, inspect, SlabFile, SlabLayout};
use crate::tier::io::{CpuRegion, TierGroup, TierWorker, WorkerJob};
use crate::tier::Location;

/// One region as given: `(buffer, offset, stride, row_bytes)`.
pub type RegionArg = (usize, usize, usize, usize);
/// One tier job as a plan carries it: `(job_id, kind, medium, group, keys, cpu_slots, places,
/// generations)`.
pub type TierJobTuple = (
    u64,
    &'static str,
    &'static str,
    u32,
    Vec<u128>,
    Vec<u32>,
    Vec<u64>,
    Vec<u64>,
);

/// A tier job as `submit` takes it (the tuple of a plan, kind and medium as strings).
pub type TierJobArg = (
    u64,
    String,
    String,
    u32,
    Vec<u128>,
    Vec<u32>,
    Vec<u64>,
    Vec<u64>,
);

/// A plan's tier job as a tuple.
pub fn tier_job_tuple(j: TierJob) -> TierJobTuple {
    (
        j.id.0,
        j.kind.name(),
        j.medium,
        j.group,
        j.keys.iter().map(|k| k.0).collect(),
        j.cpu_slots,
        j.locations.iter().map(|l| l.place).collect(),
        j.locations.iter().map(|l| l.generation).collect(),
    )
}

/// One group's tier counters as a dict.
pub fn tier_stats_dict<'py>(py: Python<'py>, s: &TierGroupStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("medium", s.medium)?;
    d.set_item("group", s.group)?;
    let t = &s.tier;
    for (k, v) in [
        ("capacity", t.capacity),
        ("used", t.used),
        ("bytes_capacity", t.bytes_capacity),
        ("hits", t.hits),
        ("misses", t.misses),
        ("writes", t.writes),
        ("failed_writes", t.failed_writes),
        ("promotions", t.promotions),
        ("quarantined", t.quarantined),
        ("evictions", t.evictions),
        ("no_room", t.no_room),
        ("writing", t.writing),
        ("reading", t.reading),
        ("write_jobs", s.write_jobs),
        ("promote_jobs", s.promote_jobs),
        ("failed_promotions", s.failed_promotions),
        ("failed_write_jobs", s.failed_writes),
        ("promote_no_room", s.promote_no_room),
        ("queue_depth", s.pending),
        ("max_queue_depth", s.max_pending),
        ("promoting_chunks", s.promoting),
        ("promoted_chunks", s.promoted_chunks),
        ("write_us", s.write_us),
        ("promote_us", s.promote_us),
        ("checks", t.checks),
        ("expired_checks", t.expired_checks),
        ("skipped_checks", t.skipped_checks),
        ("asked_later", t.asked_later),
        ("probations", t.probations),
        ("recoveries", t.recoveries),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Holds the CPU pool's buffers (1-D, contiguous, writable `uint8`) and returns their spans.
pub fn register(buffers: &[Bound<'_, PyAny>]) -> PyResult<(Vec<PyBuffer<u8>>, Vec<Span>)> {
    let mut held = Vec::with_capacity(buffers.len());
    let mut spans = Vec::with_capacity(buffers.len());
    for (i, obj) in buffers.iter().enumerate() {
        let buf = PyBuffer::<u8>::get(obj)
            .map_err(|e| ConfigError::new_err(format!("buffer {i} is not a uint8 buffer: {e}")))?;
        if buf.readonly() || buf.dimensions() != 1 || !buf.is_c_contiguous() {
            return Err(ConfigError::new_err(format!(
                "buffer {i} must be one-dimensional, contiguous and writable"
            )));
        }
        spans.push(Span {
            base: buf.buf_ptr() as usize,
            len: buf.len_bytes(),
        });
        held.push(buf);
    }
    Ok((held, spans))
}

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

/// Tier jobs as plans carry them, checked, for a worker of `medium`.
pub fn worker_jobs(jobs: Vec<TierJobArg>, medium_of_worker: &str) -> PyResult<Vec<WorkerJob>> {
    let mut out = Vec::with_capacity(jobs.len());
    for (id, kind, medium, group, keys, cpu_slots, places, gens) in jobs {
        let kind = match kind.as_str() {
            "write" => TierJobKind::Write,
            "promote" => TierJobKind::Promote,
            _ => {
                return Err(KvOffloadError::new_err(format!(
                    "tier job {id}: kind {kind:?} is neither \"write\" nor \"promote\""
                )))
            }
        };
        if medium != medium_of_worker {
            return Err(KvOffloadError::new_err(format!(
                "tier job {id}: medium {medium:?} is not {medium_of_worker:?}"
            )));
        }
        if keys.len() != cpu_slots.len() || keys.len() != places.len() || keys.len() != gens.len() {
            return Err(KvOffloadError::new_err(format!(
                "tier job {id}: {} keys, {} slots, {} places, {} generations",
                keys.len(),
                cpu_slots.len(),
                places.len(),
                gens.len()
            )));
        }
        out.push(WorkerJob {
            id: JobId(id),
            kind,
            group,
            keys: keys.into_iter().map(Key).collect(),
            cpu_slots,
            locations: places
                .into_iter()
                .zip(gens)
                .map(|(place, generation)| Location { place, generation })
                .collect(),
        });
    }
    Ok(out)
}

/// Runs disk tier jobs on Rust threads, straight from and into the registered CPU pool.
#[pyclass(frozen, module = "kvoffload._core")]
pub struct DiskWorker {
    inner: TierWorker,
    /// Keeps every registered buffer alive and unresizable.
    _buffers: Vec<PyBuffer<u8>>,
}

#[pymethods]
impl DiskWorker {
    /// Opens the slab file of every group under `path` (`disk_bytes` each) for worker `rank`
    /// of `world_size`, and registers the CPU pool: `buffers`, and per group
    /// `(cpu_rows, block_size, regions)` with regions `(buffer, offset, stride, row_bytes)`.
    #[new]
    #[pyo3(signature = (path, disk_bytes, buffers, groups, blocks_per_chunk = 1, model = "", rank = 0, world_size = 1, threads = 2, direct = true, sync = true))]
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
    ) -> PyResult<Self> {
        if blocks_per_chunk == 0 || world_size == 0 || rank >= world_size {
            return Err(ConfigError::new_err(format!(
                "DiskWorker: blocks_per_chunk={blocks_per_chunk}, rank={rank}, \
                 world_size={world_size}: need blocks_per_chunk >= 1 and 0 <= rank < world_size"
            )));
        }
        let (held, spans) = register(&buffers)?;
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
            let layout = SlabLayout::new(chunk, disk_bytes).map_err(to_py)?;
            let file = SlabFile::open(&path, &ns, layout, direct, sync).map_err(to_py)?;
            tgroups.push(TierGroup {
                cpu_rows,
                rows_per_chunk: blocks_per_chunk as usize,
                regions: cpu_regions(regions),
                file: Some(file),
                remote: None,
            });
        }
        #[allow(unsafe_code)]
        // SAFETY: each span is the memory of a buffer held in `_buffers` for the worker's whole
        // lifetime; a held buffer export keeps its exporter from freeing or resizing it.
        let inner = unsafe { TierWorker::new(&spans, tgroups, threads) }.map_err(to_py)?;
        Ok(Self {
            inner,
            _buffers: held,
        })
    }

    /// Queues tier jobs as plans carry them (`StepPlan.tier_jobs`); returns at once.
    fn submit(&self, jobs: Vec<TierJobArg>) -> PyResult<()> {
        self.inner.submit(worker_jobs(jobs, "disk")?);
        Ok(())
    }

    /// Jobs finished since the last poll: `(job_id, ok)`.
    fn poll(&self, py: Python<'_>) -> Vec<(u64, bool)> {
        py.detach(|| self.inner.poll())
            .into_iter()
            .map(|(j, ok)| (j.0, ok))
            .collect()
    }

    /// Waits (GIL released) until every job of `job_ids` finished or `timeout` seconds
    /// passed; returns every job finished since the last poll.
    #[pyo3(signature = (job_ids, timeout = 60.0))]
    fn wait(&self, py: Python<'_>, job_ids: Vec<u64>, timeout: f64) -> PyResult<Vec<(u64, bool)>> {
        if !timeout.is_finite() || timeout < 0.0 {
            return Err(ConfigError::new_err(format!(
                "wait: timeout={timeout} must be a finite number of seconds >= 0"
            )));
        }
        let ids: Vec<JobId> = job_ids.into_iter().map(JobId).collect();
        let d = Duration::from_secs_f64(timeout.min(1e9));
        Ok(py
            .detach(|| self.inner.wait(&ids, d))
            .into_iter()
            .map(|(j, ok)| (j.0, ok))
            .collect())
    }

    /// Per group: whether `O_DIRECT` is in use, and its I/O counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let mut out = Vec::new();
        for (g, grp) in self.inner.groups().iter().enumerate() {
            let d = PyDict::new(py);
            d.set_item("group", g)?;
            if let Some(f) = &grp.file {
                let s = f.io_stats();
                d.set_item("path", f.path())?;
                d.set_item("direct", f.direct())?;
                d.set_item("slots", f.layout().slots)?;
                d.set_item("chunk_bytes", f.layout().chunk_bytes)?;
                for (k, v) in [
                    ("bytes_written", s.bytes_written),
                    ("bytes_read", s.bytes_read),
                    ("chunks_written", s.chunks_written),
                    ("chunks_read", s.chunks_read),
                    ("read_failures", s.read_failures),
                    ("write_failures", s.write_failures),
                    ("direct_pieces", s.direct_pieces),
                    ("buffered_pieces", s.buffered_pieces),
                    ("write_ns", s.write_ns),
                    ("read_ns", s.read_ns),
                ] {
                    d.set_item(k, v)?;
                }
            }
            out.push(d);
        }
        Ok(out)
    }
}

/// Reports every namespace directory of a disk tier at `path` (read-only); with `verify`,
/// reads every committed chunk and checks its checksum.
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
        d.set_item("dir", r.dir)?;
        d.set_item("namespace", format!("{:032x}", r.namespace))?;
        d.set_item("group", r.group)?;
        d.set_item("chunk_bytes", r.chunk_bytes)?;
        d.set_item("slots", r.slots)?;
        d.set_item("chunks", r.chunks)?;
        d.set_item("free", r.free)?;
        d.set_item("quarantined", r.quarantined)?;
        d.set_item("file_bytes", r.file_bytes)?;
        d.set_item("disk_bytes", r.disk_bytes)?;
        if verify {
            d.set_item("verified", r.verified)?;
            d.set_item("corrupt", r.corrupt)?;
        }
        out.push(d);
    }
    Ok(out)
}
