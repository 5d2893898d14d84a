//! `kvoffload._core.Copier`: the CPU data plane's copies, bounded by registered buffers.
//!
//! The data plane registers each KV tensor's storage and the CPU pool as Python buffer objects
//! (1-D, C-contiguous, writable `uint8`, e.g. numpy views of the tensors): the copier holds
//! them, so the memory stays alive as long as the copier, and every row of every copy is
//! checked against them ([`crate::copy`]). There is no call that takes a raw address.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::{ConfigError, InvalidBlockError, KvOffloadError};
use crate::copy::{self, CopyError, Direction, Group, Region, RowSpace, Runs, Span};
use crate::py::sync::guarded;
use crate::runs::{self, GroupShape, RunsError};

/// One region as given: `(gpu_buffer, gpu_offset, gpu_stride, cpu_buffer, cpu_offset,
/// cpu_stride, row_bytes)`.
type RegionArg = (usize, usize, usize, usize, usize, usize, usize);
/// One run list as given: `(group, region or None, gpu_starts, cpu_starts, counts)`.
type RunsArg = (usize, Option<usize>, Vec<i64>, Vec<i64>, Vec<i64>);

// By value so that call sites read `.map_err(to_py)`.
#[allow(clippy::needless_pass_by_value)]
fn to_py(e: CopyError) -> PyErr {
    let msg = e.to_string();
    match e {
        CopyError::Region { .. } | CopyError::Overlap { .. } => ConfigError::new_err(msg),
        CopyError::RowsOutOfRange { .. } => InvalidBlockError::new_err(msg),
        CopyError::UnknownGroup { .. }
        | CopyError::UnknownRegion { .. }
        | CopyError::Lengths { .. }
        | CopyError::Packed { .. } => KvOffloadError::new_err(msg),
    }
}

/// Out-of-range rows raise `InvalidBlockError`, every other bad buffer the data plane's
/// `TransferError` (a Python class: looked up when raised).
fn runs_error(py: Python<'_>, e: &RunsError) -> PyErr {
    let msg = e.to_string();
    if matches!(e, RunsError::OutOfRange { .. }) {
        return InvalidBlockError::new_err(msg);
    }
    match py
        .import("kvoffload.errors")
        .and_then(|m| m.getattr("TransferError"))
    {
        Ok(cls) => PyErr::from_type(cls.cast_into().expect("TransferError is a class"), msg),
        Err(err) => err,
    }
}

fn direction(store: bool) -> Direction {
    if store {
        Direction::Store
    } else {
        Direction::Load
    }
}

/// Checks a plan's packed `runs` ([`crate::runs`]) for `jobs` jobs, the first `loads` of them
/// loads, against the registered groups `(gpu_rows, cpu_rows, bytes_per_block, regions)`;
/// returns `(first row, end row, bytes, copies)` per job. Nothing is kept.
#[pyfunction]
#[allow(clippy::needless_pass_by_value)] // pyo3 hands arguments over by value
pub fn check_runs(
    py: Python<'_>,
    runs: &Bound<'_, PyBytes>,
    jobs: usize,
    loads: usize,
    groups: Vec<(u32, u32, u64, u64)>,
) -> PyResult<Vec<(usize, usize, u64, u64)>> {
    let shapes: Vec<GroupShape> = groups
        .into_iter()
        .map(
            |(gpu_rows, cpu_rows, bytes_per_block, regions)| GroupShape {
                gpu_rows,
                cpu_rows,
                bytes_per_block,
                regions,
            },
        )
        .collect();
    let out = runs::check(runs.as_bytes(), jobs, loads.min(jobs), &shapes)
        .map_err(|e| runs_error(py, &e))?;
    Ok(out
        .into_iter()
        .map(|j| (j.rows.start, j.rows.end, j.bytes, j.copies))
        .collect())
}

/// Holds `buffers` (1-D, contiguous, writable `uint8`: a copier's KV tensors and CPU pool, or
/// a tier worker's CPU pool) and returns their spans.
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

/// Copies rows between registered KV tensors and CPU-pool regions, with the GIL released.
#[pyclass(frozen, module = "kvoffload._core")]
pub struct Copier {
    inner: copy::Copier,
    /// Keeps every registered buffer (and the object exporting it) alive and unresizable.
    _buffers: Vec<PyBuffer<u8>>,
}

#[pymethods]
impl Copier {
    /// Registers `buffers` and, per group `(gpu_rows, cpu_rows, regions)`, where each region's
    /// rows sit in them.
    #[new]
    #[allow(clippy::needless_pass_by_value)] // pyo3 hands arguments over by value
    fn new(
        buffers: Vec<Bound<'_, PyAny>>,
        groups: Vec<(usize, usize, Vec<RegionArg>)>,
    ) -> PyResult<Self> {
        let (held, spans) = register(&buffers)?;
        let space = |buffer, offset, stride| RowSpace {
            buffer,
            offset,
            stride,
        };
        let groups = groups
            .into_iter()
            .map(|(gpu_rows, cpu_rows, regions)| Group {
                gpu_rows,
                cpu_rows,
                regions: regions
                    .into_iter()
                    .map(|(gb, go, gs, cb, co, cs, row_bytes)| Region {
                        gpu: space(gb, go, gs),
                        cpu: space(cb, co, cs),
                        row_bytes,
                    })
                    .collect(),
            })
            .collect();
        #[allow(unsafe_code)]
        // SAFETY: each span is the memory of a buffer held in `_buffers` for the copier's whole
        // lifetime; a held buffer export keeps its exporter from freeing or resizing it.
        let inner = unsafe { copy::Copier::new(spans, groups) }.map_err(to_py)?;
        Ok(Self {
            inner,
            _buffers: held,
        })
    }

    /// Copies the rows of `runs` (GPU → CPU if `store`, else CPU → GPU) over up to `threads`
    /// threads, with the GIL released. Every row is checked first: out of range, nothing is
    /// copied. Returns the bytes copied.
    #[pyo3(signature = (store, runs, threads = 1))]
    fn copy(
        &self,
        py: Python<'_>,
        store: bool,
        runs: Vec<RunsArg>,
        threads: usize,
    ) -> PyResult<usize> {
        guarded(|| {
            let runs: Vec<Runs> = runs
                .into_iter()
                .map(|(group, region, gpu, cpu, counts)| Runs {
                    group,
                    region,
                    gpu,
                    cpu,
                    counts,
                })
                .collect();
            let dir = direction(store);
            py.detach(|| self.inner.copy(dir, &runs, threads))
                .map_err(to_py)
        })
    }

    /// Copies rows `start..end` of a packed runs buffer (GPU → CPU if `store`), for every
    /// region of each row's group or only `region`, over up to `threads` threads, with the
    /// GIL released; the rows are read in place. Every row is checked first: out of range,
    /// nothing is copied. Returns the bytes copied.
    #[pyo3(signature = (store, runs, start, end, threads = 1, region = None))]
    #[allow(clippy::too_many_arguments)]
    fn copy_packed(
        &self,
        py: Python<'_>,
        store: bool,
        runs: &Bound<'_, PyBytes>,
        start: usize,
        end: usize,
        threads: usize,
        region: Option<usize>,
    ) -> PyResult<usize> {
        guarded(|| {
            let buf = runs.as_bytes();
            let dir = direction(store);
            py.detach(|| {
                self.inner
                    .copy_packed(dir, buf, start..end, region, threads)
            })
            .map_err(to_py)
        })
    }

    /// Registered groups: `(gpu_rows, cpu_rows, regions)` each.
    fn layout(&self) -> Vec<(usize, usize, usize)> {
        self.inner
            .groups()
            .iter()
            .map(|g| (g.gpu_rows, g.cpu_rows, g.regions.len()))
            .collect()
    }
}
