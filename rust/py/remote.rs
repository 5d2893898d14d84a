//! `kvoffload._core.RemoteClient`: the shared (Redis) tier's client, for benchmarks, tools and
//! tests that move chunks held in Python buffers. Every call releases the GIL around its I/O.
//! `RemoteWorker`: the worker side of the shared tier, a `TierWorker` (`tier.rs`) whose groups
//! write to and read from the server.
//!
//! Chunks are given as one 1-D, C-contiguous `uint8` buffer holding `len(keys)` chunks of
//! equal size back to back (e.g. a numpy array or a CPU tensor's numpy view).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::convert::keys as extract_keys;
use super::errors::{to_py, KvOffloadError};
use super::tier_worker::{io_cpus_arg, RegionArg, TierWorker};
use crate::ids::Key;
use crate::py::sync::guarded;
use crate::tier::io::RemoteGroup;
use crate::tier::namespace::Namespace;
use crate::tier::remote::MEDIUM;
use crate::tier::remote::{
    ChunkNames, ReadItem, ReadOutcome, RemoteClient as Client, RemoteConfig, WriteItem,
};

/// The chunk buffer of a call, checked: its base address and the bytes of one chunk.
fn chunk_buffer(buf: &PyBuffer<u8>, n: usize, writable: bool, what: &str) -> PyResult<usize> {
    if (writable && buf.readonly()) || buf.dimensions() != 1 || !buf.is_c_contiguous() {
        return Err(KvOffloadError::new_err(format!(
            "{what} must be a one-dimensional, contiguous{} uint8 buffer",
            if writable { ", writable" } else { "" }
        )));
    }
    let len = buf.len_bytes();
    if n == 0 || len % n != 0 {
        return Err(KvOffloadError::new_err(format!(
            "{what} holds {len} bytes, not a whole number of chunks for {n} keys"
        )));
    }
    Ok(len / n)
}

fn duration(field: &str, ms: f64) -> PyResult<std::time::Duration> {
    crate::config::deadline_ms(field, ms).map_err(to_py)
}

/// The namespace digest of chunks with this meaning (model, KV layout, rank, group and tenant
/// salt): what every lower tier keys and checks chunks by.
#[pyfunction]
#[pyo3(signature = (*, model, dtype, tensor_shapes, block_size, blocks_per_chunk, rank = 0,
                    world_size = 1, group = 0, cache_salt = String::new()))]
#[allow(clippy::too_many_arguments)] // keyword-only, one per namespace field
pub fn namespace_digest(
    model: String,
    dtype: String,
    tensor_shapes: Vec<Vec<u64>>,
    block_size: u32,
    blocks_per_chunk: u32,
    rank: u32,
    world_size: u32,
    group: u32,
    cache_salt: String,
) -> u128 {
    Namespace {
        model,
        dtype,
        tensor_shapes,
        block_size,
        blocks_per_chunk,
        rank,
        world_size,
        group,
        cache_salt,
    }
    .digest()
}

/// A client's counters, by name.
fn stats_dict<'py>(py: Python<'py>, client: &Client) -> PyResult<Bound<'py, PyDict>> {
    let s = client.stats();
    let d = PyDict::new(py);
    for (k, v) in s.named() {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Counters per server (the one server, or every cluster master the client talked to).
fn node_stats_dict<'py>(py: Python<'py>, client: &Client) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for (node, s) in client.node_stats() {
        let d = PyDict::new(py);
        for (k, v) in s.named() {
            d.set_item(k, v)?;
        }
        out.set_item(node, d)?;
    }
    Ok(out)
}

/// A client of `url` with the default settings, `deadline_ms` and `tls_ca` (`rediss://`).
pub fn client(url: &str, deadline_ms: f64, tls_ca: Option<PathBuf>) -> PyResult<Client> {
    let mut cfg = RemoteConfig::new(url);
    cfg.deadline = duration("remote_deadline_ms", deadline_ms)?;
    cfg.tls_ca = tls_ca;
    Client::new(cfg).map_err(to_py)
}

/// Runs shared-tier jobs (write-behind, promotion) on Rust threads, straight from and into the
/// registered CPU pool (the same registration as `DiskWorker`).
#[pyclass(extends = TierWorker, frozen, module = "kvoffload._core")]
pub struct RemoteWorker {
    client: Arc<Client>,
}

#[pymethods]
impl RemoteWorker {
    /// Connects (lazily) to `url` and registers the CPU pool: `buffers`, and per group
    /// `(cpu_rows, block_size, regions)` with regions `(buffer, offset, stride, row_bytes)`.
    /// `model` and `cache_salt` must match the scheduler's; `dtypes` (per group, the element
    /// type of its tensors) is part of the chunks' namespace.
    #[new]
    #[pyo3(signature = (url, buffers, groups, blocks_per_chunk = 1, model = "", cache_salt = "",
                        rank = 0, world_size = 1, threads = 2, deadline_ms = 1000.0,
                        io_cpus = None, dtypes = None, tls_ca = None))]
    #[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)]
    fn new(
        url: &str,
        buffers: Vec<Bound<'_, PyAny>>,
        groups: Vec<(usize, u32, Vec<RegionArg>)>,
        blocks_per_chunk: u32,
        model: &str,
        cache_salt: &str,
        rank: u32,
        world_size: u32,
        threads: usize,
        deadline_ms: f64,
        io_cpus: Option<Bound<'_, PyAny>>,
        dtypes: Option<Vec<String>>,
        tls_ca: Option<PathBuf>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let cpus = io_cpus_arg(io_cpus.as_ref())?;
        let client = Arc::new(client(url, deadline_ms, tls_ca)?);
        let base = TierWorker::open(
            "RemoteWorker",
            MEDIUM,
            &buffers,
            groups,
            blocks_per_chunk,
            model,
            rank,
            world_size,
            threads,
            cpus,
            dtypes.as_deref(),
            |place, bytes, _| {
                let remote = RemoteGroup {
                    client: Arc::clone(&client),
                    namespace: ChunkNames {
                        key: place.salted(cache_salt).digest(),
                        header: bytes.salted(cache_salt).digest(),
                    },
                };
                Ok((None, Some(remote)))
            },
        )?;
        Ok(PyClassInitializer::from(base).add_subclass(Self { client }))
    }

    /// The client's counters (writes, reads, checksum mismatches, probations, ...).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(|| stats_dict(py, &self.client))
    }

    /// The counters per server: `{"host:port": counters}` (every cluster master).
    fn node_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(|| node_stats_dict(py, &self.client))
    }
}

/// A client of the shared tier (one Redis server or a cluster): pipelined batches, connection
/// pools, deadlines, probation.
#[pyclass(frozen, module = "kvoffload._core")]
pub struct RemoteClient {
    inner: Client,
}

#[pymethods]
impl RemoteClient {
    /// A client of `url` (`redis://[user:password@]host:port[/db]`, connects lazily; or
    /// `redis+cluster://[user:password@]host:port[,host:port...]`, reads the slot map now).
    #[new]
    #[pyo3(signature = (url, *, deadline_ms = 1000.0, connections = None, part_bytes = 64 << 20,
                        probation_after = 3, probation_ms = 2000.0, tls_ca = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        url: &str,
        deadline_ms: f64,
        connections: Option<usize>,
        part_bytes: usize,
        probation_after: u32,
        probation_ms: f64,
        tls_ca: Option<PathBuf>,
    ) -> PyResult<Self> {
        let cfg = RemoteConfig {
            url: url.to_owned(),
            deadline: duration("remote_deadline_ms", deadline_ms)?,
            connections: connections.unwrap_or(RemoteConfig::new(url).connections),
            part_bytes,
            probation_after,
            probation: duration("remote_probation_ms", probation_ms)?,
            tls_ca,
        };
        Ok(Self {
            inner: Client::new(cfg).map_err(to_py)?,
        })
    }

    /// The server's URL.
    #[getter]
    fn url(&self) -> PyResult<String> {
        guarded(|| Ok(self.inner.config().url.clone()))
    }

    /// Whether the tier is on probation (operations skipped) now.
    #[getter]
    fn on_probation(&self) -> PyResult<bool> {
        guarded(|| Ok(self.inner.on_probation()))
    }

    /// Writes chunk `i` of `data` under `keys[i]` in `namespace`; per key, whether it was
    /// stored.
    #[pyo3(signature = (namespace, keys, data, group = 0))]
    fn write(
        &self,
        py: Python<'_>,
        namespace: u128,
        keys: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        group: u32,
    ) -> PyResult<Vec<bool>> {
        guarded(|| {
            let keys = extract_keys(keys, "keys")?;
            let buf = PyBuffer::<u8>::get(data)?;
            let size = chunk_buffer(&buf, keys.len(), false, "data")?;
            let base = buf.buf_ptr() as usize;
            let total = buf.len_bytes();
            py.detach(|| {
                #[allow(unsafe_code)]
                // SAFETY: `buf` holds the export of `total` bytes at `base` for this whole call, so
                // the memory stays allocated and unresized; it is only read.
                let bytes = unsafe { std::slice::from_raw_parts(base as *const u8, total) };
                let items: Vec<WriteItem<'_>> = keys
                    .iter()
                    .zip(bytes.chunks_exact(size))
                    .map(|(&key, chunk)| WriteItem {
                        key,
                        group,
                        data: vec![chunk],
                    })
                    .collect();
                Ok(self.inner.write(namespace, &items))
            })
        })
    }

    /// Reads `keys` of `namespace` into `out` (chunk `i` at `i * chunk size`) and verifies
    /// them; per key `"hit"`, `"miss"`, `"corrupt"` (refused by verification) or `"failed"`
    /// (error, deadline, probation). Only a `"hit"` chunk's bytes are meaningful.
    #[pyo3(signature = (namespace, keys, out, group = 0))]
    fn read(
        &self,
        py: Python<'_>,
        namespace: u128,
        keys: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        group: u32,
    ) -> PyResult<Vec<&'static str>> {
        guarded(|| {
            let keys = extract_keys(keys, "keys")?;
            let buf = PyBuffer::<u8>::get(out)?;
            let size = chunk_buffer(&buf, keys.len(), true, "out")?;
            let base = buf.buf_ptr() as usize;
            let total = buf.len_bytes();
            let outcomes = py.detach(|| {
                #[allow(unsafe_code)]
                // SAFETY: `buf` holds the writable export of `total` bytes at `base` for this whole
                // call; this is the only reference made to that memory here.
                let bytes = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, total) };
                let mut items: Vec<ReadItem<'_>> = keys
                    .iter()
                    .zip(bytes.chunks_exact_mut(size))
                    .map(|(&key, chunk)| ReadItem {
                        key,
                        group,
                        dst: vec![chunk],
                    })
                    .collect();
                self.inner.read(namespace, &mut items)
            });
            Ok(outcomes
                .into_iter()
                .map(|o| match o {
                    ReadOutcome::Hit => "hit",
                    ReadOutcome::Miss => "miss",
                    ReadOutcome::Corrupt => "corrupt",
                    ReadOutcome::Failed => "failed",
                })
                .collect())
        })
    }

    /// Per key of `namespace`, whether it exists: one round trip. `None` when the operation
    /// failed or the tier is on probation.
    fn exists(
        &self,
        py: Python<'_>,
        namespace: u128,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Vec<bool>>> {
        guarded(|| {
            let keys: Vec<Key> = extract_keys(keys, "keys")?;
            Ok(py.detach(|| self.inner.exists(namespace, &keys)))
        })
    }

    /// Counters so far, by name.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(|| stats_dict(py, &self.inner))
    }

    /// The counters per server: `{"host:port": counters}` (every cluster master).
    fn node_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(|| node_stats_dict(py, &self.inner))
    }

    fn __repr__(&self) -> PyResult<String> {
        guarded(|| {
            Ok(format!(
                "RemoteClient({:?}, on_probation={})",
                self.inner.config().url,
                self.inner.on_probation()
            ))
        })
    }
}
