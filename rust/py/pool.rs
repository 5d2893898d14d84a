//! `kvoffload._core._CpuPool`: the CPU pool (slots, key states, pins, LRU / ARC eviction,
//! events) from Python, for the tests and tools that drive it directly. Private (not exported
//! from `kvoffload`): engines use the scheduler, which holds its own pools.
//!
//! Keys cross the boundary as Python ints (`bytes` are accepted on input and folded with
//! `Key::from_bytes`); every input is converted before the lock is taken, so a bad key raises
//! `InvalidKeyError` with the pool untouched.

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyDict};

use super::convert;
use super::convert::Arg;
use super::errors::to_py;
use crate::ids::{Key, SlotId};
use crate::pool::{KeyState, Pool, PoolStats, StorePlan as CoreStorePlan};
use crate::py::sync::guarded;

fn ints(keys: &[Key]) -> Vec<u128> {
    keys.iter().map(|k| k.0).collect()
}

fn slot_ids(slots: &[SlotId]) -> Vec<u32> {
    slots.iter().map(|s| s.0).collect()
}

/// A pool's counters by name, as `_CpuPool.stats()` and `Scheduler.stats()["pools"]` report
/// them (`target` apart).
pub fn pool_counters(s: &PoolStats) -> [(&'static str, u64); 23] {
    [
        ("capacity", u64::from(s.capacity)),
        ("used", u64::from(s.used)),
        ("free", u64::from(s.free)),
        ("storing", u64::from(s.storing)),
        ("pinned", u64::from(s.pinned)),
        ("hits", s.hits),
        ("misses", s.misses),
        ("evictions", s.evictions),
        ("discarded", s.discarded),
        ("stores", s.stores),
        ("failed_stores", s.failed_stores),
        ("loads", s.loads),
        ("no_room", s.no_room),
        ("filtered", s.filtered),
        ("allocations", s.allocations),
        ("allocated_slots", s.allocated_slots),
        ("allocated_runs", s.allocated_runs),
        ("contiguous_allocations", s.contiguous_allocations),
        ("resets", s.resets),
        ("ghosts", u64::from(s.ghosts)),
        ("admission_tracked", u64::from(s.admission_tracked)),
        ("events_dropped", s.events_dropped),
        ("event_keys_queued", s.event_keys_queued),
    ]
}

/// The slots reserved by `_CpuPool.prepare_store`.
#[pyclass(frozen, get_all, name = "_StorePlan", module = "kvoffload._core")]
pub struct StorePlan {
    /// Keys to store now, in input order.
    keys: Vec<u128>,
    /// The slot of each key of `keys`.
    slots: Vec<u32>,
    /// Keys evicted to make room.
    evicted: Vec<u128>,
    /// Keys skipped by the admission filter.
    filtered: Vec<u128>,
}

impl From<CoreStorePlan> for StorePlan {
    fn from(p: CoreStorePlan) -> Self {
        Self {
            keys: ints(&p.keys),
            slots: slot_ids(&p.slots),
            evicted: ints(&p.evicted),
            filtered: ints(&p.filtered),
        }
    }
}

#[pymethods]
impl StorePlan {
    fn __repr__(&self) -> String {
        format!(
            "_StorePlan(keys={:?}, slots={:?}, evicted={:?}, filtered={:?})",
            self.keys, self.slots, self.evicted, self.filtered
        )
    }
}

/// The CPU tier's slots: key states, pins, LRU or ARC eviction, stored / removed events.
#[pyclass(frozen, name = "_CpuPool", module = "kvoffload._core")]
pub struct CpuPool {
    inner: Mutex<Pool>,
}

impl CpuPool {
    /// The core lock, waited for with the GIL released; never held while calling Python.
    fn lock(&self) -> PyResult<MutexGuard<'_, Pool>> {
        super::sync::lock(&self.inner)
    }
}

#[pymethods]
impl CpuPool {
    #[new]
    #[pyo3(
        signature = (capacity, policy = Arg::Omitted, store_threshold = Arg::Omitted, max_event_keys = Arg::Omitted),
        text_signature = "(capacity, policy='lru', store_threshold=0, max_event_keys=None)"
    )]
    // pyo3 hands keyword arguments over by value.
    #[allow(clippy::needless_pass_by_value)]
    fn new(
        capacity: &Bound<'_, PyAny>,
        policy: Arg<'_>,
        store_threshold: Arg<'_>,
        max_event_keys: Arg<'_>,
    ) -> PyResult<Self> {
        let capacity = convert::config_int(capacity, "capacity")?;
        let policy = convert::config_str(&policy, "policy", "\"lru\" or \"arc\"", "lru")?;
        let store_threshold = convert::config_int_or(&store_threshold, "store_threshold", 0)?;
        let max_event_keys = convert::config_opt_int(&max_event_keys, "max_event_keys", None)?;
        let config =
            crate::config::pool_config(capacity, &policy, store_threshold).map_err(to_py)?;
        let event_limit = match max_event_keys {
            Some(n) => crate::config::event_limit(n).map_err(to_py)?,
            None => crate::pool::default_event_limit(config.capacity),
        };
        let mut pool = Pool::new(config).map_err(to_py)?;
        pool.set_event_limit(event_limit);
        Ok(Self {
            inner: Mutex::new(pool),
        })
    }

    /// The bound of the event queue, in keys (0: events are not recorded).
    #[getter]
    fn max_event_keys(&self) -> PyResult<usize> {
        guarded(|| Ok(self.lock()?.event_limit()))
    }

    /// Number of slots.
    #[getter]
    fn capacity(&self) -> PyResult<u32> {
        guarded(|| Ok(self.lock()?.capacity()))
    }

    /// The eviction policy: `"lru"` or `"arc"`.
    #[getter]
    fn policy(&self) -> PyResult<&'static str> {
        guarded(|| Ok(self.lock()?.policy().name()))
    }

    /// Lookups needed before a key is admitted (0 or 1: no filter).
    #[getter]
    fn store_threshold(&self) -> PyResult<u32> {
        guarded(|| Ok(self.lock()?.config().store_threshold))
    }

    /// How many leading keys are ready, and the state of every key (`"absent"`, `"storing"`,
    /// `"ready"`).
    fn lookup(&self, keys: &Bound<'_, PyAny>) -> PyResult<(usize, Vec<&'static str>)> {
        guarded(|| {
            let keys = convert::keys(keys, "keys")?;
            let mut states = Vec::with_capacity(keys.len());
            let prefix = self.lock()?.lookup_states(&keys, &mut states);
            Ok((prefix, states.into_iter().map(KeyState::name).collect()))
        })
    }

    /// The state of one key: `"absent"`, `"storing"` or `"ready"` (no side effects).
    fn state(&self, key: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        guarded(|| {
            let key = convert::key(key, "key")?;
            Ok(self.lock()?.state(key).name())
        })
    }

    /// Loads in flight on a key (0 unless it is ready and pinned).
    fn pins(&self, key: &Bound<'_, PyAny>) -> PyResult<u32> {
        guarded(|| {
            let key = convert::key(key, "key")?;
            Ok(match self.lock()?.state(key) {
                KeyState::Ready { pins } => pins,
                _ => 0,
            })
        })
    }

    /// The slot of a present (storing or ready) key, else `None`.
    fn slot(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        guarded(|| {
            let key = convert::key(key, "key")?;
            Ok(self.lock()?.slot(key).map(|s| s.0))
        })
    }

    /// Reserves slots for the absent keys, evicting if needed; `None` when there is not
    /// enough evictable room (nothing changed).
    fn prepare_store(&self, keys: &Bound<'_, PyAny>) -> PyResult<Option<StorePlan>> {
        guarded(|| {
            let keys = convert::keys(keys, "keys")?;
            Ok(self.lock()?.prepare_store(&keys).map(StorePlan::from))
        })
    }

    /// Publishes (`ok`) or drops (failed) the stores of `keys`.
    #[pyo3(signature = (keys, ok = Arg::Omitted), text_signature = "(self, keys, ok=True)")]
    #[allow(clippy::needless_pass_by_value)]
    fn complete_store(&self, keys: &Bound<'_, PyAny>, ok: Arg<'_>) -> PyResult<()> {
        guarded(|| {
            let keys = convert::keys(keys, "keys")?;
            let ok = convert::flag(&ok, "ok", true, super::errors::CompletionError::new_err)?;
            self.lock()?.complete_store(&keys, ok).map_err(to_py)
        })
    }

    /// Pins ready keys for a load; returns their slots.
    fn prepare_load(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        guarded(|| {
            let keys = convert::keys(keys, "keys")?;
            let slots = self.lock()?.prepare_load(&keys).map_err(to_py)?;
            Ok(slot_ids(&slots))
        })
    }

    /// Unpins keys whose load finished.
    fn complete_load(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(|| {
            let keys = convert::keys(keys, "keys")?;
            self.lock()?.complete_load(&keys).map_err(to_py)
        })
    }

    /// Recency update, last key first, so the earliest prefix chunk ends most recent.
    fn touch(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(|| {
            let keys = convert::keys(keys, "keys")?;
            self.lock()?.touch(&keys);
            Ok(())
        })
    }

    /// Recency only (no use counted, absent keys skipped), last key first.
    fn refresh(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(|| {
            let keys = convert::keys(keys, "keys")?;
            self.lock()?.refresh(&keys);
            Ok(())
        })
    }

    /// Drops ready, unpinned entries whose content is no longer trusted; returns the keys
    /// dropped (absent, storing and pinned keys are left alone).
    fn discard(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<u128>> {
        guarded(|| {
            let keys = convert::keys(keys, "keys")?;
            Ok(ints(&self.lock()?.discard(&keys)))
        })
    }

    /// Drains the events: `(kind, keys, medium)` with kind `"stored"` or `"removed"`.
    fn take_events(&self) -> PyResult<Vec<(&'static str, Vec<u128>, &'static str)>> {
        guarded(|| {
            Ok(self
                .lock()?
                .take_events()
                .into_iter()
                .map(|e| (e.kind.name(), ints(&e.keys), e.medium()))
                .collect())
        })
    }

    /// Empties the pool (ready keys are announced in one `removed` event).
    fn reset(&self) -> PyResult<()> {
        guarded(|| {
            self.lock()?.reset();
            Ok(())
        })
    }

    /// Occupancy and counters (`target` only for ARC).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(|| {
            // Read under the lock, built after it (see `super::sync`).
            let s = self.lock()?.stats();
            let d = pool_counters(&s).into_py_dict(py)?;
            if let Some(t) = s.target {
                d.set_item("target", t)?;
            }
            Ok(d)
        })
    }

    /// The policy's lists, least recent first: `lru` (LRU) or `t1`, `t2`, `b1`, `b2` (ARC).
    fn order<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(|| {
            let o = self.lock()?.order(); // the guard is dropped at the end of this statement
            let d = PyDict::new(py);
            for (name, keys) in o.resident.into_iter().chain(o.ghosts) {
                d.set_item(name, ints(&keys))?;
            }
            Ok(d)
        })
    }

    /// Number of present keys (storing or ready).
    fn __len__(&self) -> PyResult<usize> {
        guarded(|| Ok(self.lock()?.len()))
    }

    fn __repr__(&self) -> PyResult<String> {
        guarded(|| {
            let p = self.lock()?;
            let s = p.stats();
            Ok(format!(
                "_CpuPool(capacity={}, policy='{}', used={}, storing={}, pinned={})",
                s.capacity,
                p.policy(),
                s.used,
                s.storing,
                s.pinned
            ))
        })
    }
}
