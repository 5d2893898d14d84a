//! `kvoffload._core.CpuPool`: the CPU pool (slots, key states, pins, LRU / ARC eviction,
//! events) for the scheduler facade and for tests that drive it directly.
//!
//! Keys cross the boundary as Python ints (`bytes` are accepted on input and folded with
//! `Key::from_bytes`); every input is converted before the lock is taken, so a bad key raises
//! `InvalidKeyError` with the pool untouched.

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::convert;
use super::errors::{to_py, ConfigError};
use crate::ids::{Key, SlotId};
use crate::policy::PolicyKind;
use crate::pool::{KeyState, Pool, PoolConfig, StorePlan as CoreStorePlan};

fn ints(keys: &[Key]) -> Vec<u128> {
    keys.iter().map(|k| k.0).collect()
}

fn slot_ids(slots: &[SlotId]) -> Vec<u32> {
    slots.iter().map(|s| s.0).collect()
}

/// Extracts a `u32` configuration value, or raises `ConfigError` naming it.
fn config_u32(obj: &Bound<'_, PyAny>, what: &str, min: u32, max: u32) -> PyResult<u32> {
    let bad = || {
        let repr = obj
            .repr()
            .map_or_else(|_| "?".to_owned(), |r| r.to_string());
        ConfigError::new_err(format!(
            "{what} must be an integer in {min}..={max}, got {repr}"
        ))
    };
    match obj.extract::<i128>() {
        Ok(v) if (i128::from(min)..=i128::from(max)).contains(&v) => Ok(v as u32),
        _ => Err(bad()),
    }
}

/// The slots reserved by `CpuPool.prepare_store`.
#[pyclass(frozen, get_all, module = "kvoffload._core")]
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
            "StorePlan(keys={:?}, slots={:?}, evicted={:?}, filtered={:?})",
            self.keys, self.slots, self.evicted, self.filtered
        )
    }
}

/// The CPU tier's slots: key states, pins, LRU or ARC eviction, stored / removed events.
#[pyclass(frozen, module = "kvoffload._core")]
pub struct CpuPool {
    inner: Mutex<Pool>,
}

impl CpuPool {
    fn lock(&self) -> MutexGuard<'_, Pool> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[pymethods]
impl CpuPool {
    #[new]
    #[pyo3(
        signature = (capacity, policy = None, store_threshold = None),
        text_signature = "(capacity, policy='lru', store_threshold=0)"
    )]
    fn new(
        capacity: &Bound<'_, PyAny>,
        policy: Option<&Bound<'_, PyAny>>,
        store_threshold: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let capacity = config_u32(capacity, "capacity", 1, crate::pool::MAX_CAPACITY)?;
        let policy = match policy {
            None => PolicyKind::Lru,
            Some(p) => {
                let name: String = p.extract().map_err(|_| {
                    let repr = p.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string());
                    ConfigError::new_err(format!("policy must be \"lru\" or \"arc\", got {repr}"))
                })?;
                name.parse().map_err(to_py)?
            }
        };
        let store_threshold = match store_threshold {
            None => 0,
            Some(t) => config_u32(t, "store_threshold", 0, u32::MAX)?,
        };
        let pool = Pool::new(PoolConfig {
            capacity,
            policy,
            store_threshold,
        })
        .map_err(to_py)?;
        Ok(Self {
            inner: Mutex::new(pool),
        })
    }

    /// Number of slots.
    #[getter]
    fn capacity(&self) -> u32 {
        self.lock().capacity()
    }

    /// The eviction policy: `"lru"` or `"arc"`.
    #[getter]
    fn policy(&self) -> &'static str {
        self.lock().policy().name()
    }

    /// Lookups needed before a key is admitted (0 or 1: no filter).
    #[getter]
    fn store_threshold(&self) -> u32 {
        self.lock().config().store_threshold
    }

    /// How many leading keys are ready, and the state of every key (`"absent"`, `"storing"`,
    /// `"ready"`).
    fn lookup(&self, keys: &Bound<'_, PyAny>) -> PyResult<(usize, Vec<&'static str>)> {
        let keys = convert::keys(keys, "keys")?;
        let mut states = Vec::with_capacity(keys.len());
        let prefix = self.lock().lookup_states(&keys, &mut states);
        Ok((prefix, states.into_iter().map(KeyState::name).collect()))
    }

    /// The state of one key: `"absent"`, `"storing"` or `"ready"` (no side effects).
    fn state(&self, key: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let key = convert::key(key, "key")?;
        Ok(self.lock().state(key).name())
    }

    /// Loads in flight on a key (0 unless it is ready and pinned).
    fn pins(&self, key: &Bound<'_, PyAny>) -> PyResult<u32> {
        let key = convert::key(key, "key")?;
        Ok(match self.lock().state(key) {
            KeyState::Ready { pins } => pins,
            _ => 0,
        })
    }

    /// The slot of a present (storing or ready) key, else `None`.
    fn slot(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let key = convert::key(key, "key")?;
        Ok(self.lock().slot(key).map(|s| s.0))
    }

    /// Reserves slots for the absent keys, evicting if needed; `None` when there is not
    /// enough evictable room (nothing changed).
    fn prepare_store(&self, keys: &Bound<'_, PyAny>) -> PyResult<Option<StorePlan>> {
        let keys = convert::keys(keys, "keys")?;
        Ok(self.lock().prepare_store(&keys).map(StorePlan::from))
    }

    /// Publishes (`ok`) or drops (failed) the stores of `keys`.
    #[pyo3(signature = (keys, ok = true))]
    fn complete_store(&self, keys: &Bound<'_, PyAny>, ok: bool) -> PyResult<()> {
        let keys = convert::keys(keys, "keys")?;
        self.lock().complete_store(&keys, ok).map_err(to_py)
    }

    /// Pins ready keys for a load; returns their slots.
    fn prepare_load(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let keys = convert::keys(keys, "keys")?;
        let slots = self.lock().prepare_load(&keys).map_err(to_py)?;
        Ok(slot_ids(&slots))
    }

    /// Unpins keys whose load finished.
    fn complete_load(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = convert::keys(keys, "keys")?;
        self.lock().complete_load(&keys).map_err(to_py)
    }

    /// Recency update, last key first, so the earliest prefix chunk ends most recent.
    fn touch(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = convert::keys(keys, "keys")?;
        self.lock().touch(&keys);
        Ok(())
    }

    /// Drops ready, unpinned entries whose content is no longer trusted; returns the keys
    /// dropped (absent, storing and pinned keys are left alone).
    fn discard(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<u128>> {
        let keys = convert::keys(keys, "keys")?;
        Ok(ints(&self.lock().discard(&keys)))
    }

    /// Drains the events: `(kind, keys, medium)` with kind `"stored"` or `"removed"`.
    fn take_events(&self) -> Vec<(&'static str, Vec<u128>, &'static str)> {
        self.lock()
            .take_events()
            .into_iter()
            .map(|e| (e.kind.name(), ints(&e.keys), e.medium()))
            .collect()
    }

    /// Empties the pool (ready keys are announced in one `removed` event).
    fn reset(&self) {
        self.lock().reset();
    }

    /// Occupancy and counters (`target` only for ARC).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.lock().stats();
        let d = PyDict::new(py);
        d.set_item("capacity", s.capacity)?;
        d.set_item("used", s.used)?;
        d.set_item("free", s.free)?;
        d.set_item("storing", s.storing)?;
        d.set_item("pinned", s.pinned)?;
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("discarded", s.discarded)?;
        d.set_item("stores", s.stores)?;
        d.set_item("failed_stores", s.failed_stores)?;
        d.set_item("loads", s.loads)?;
        d.set_item("no_room", s.no_room)?;
        d.set_item("filtered", s.filtered)?;
        d.set_item("allocations", s.allocations)?;
        d.set_item("allocated_slots", s.allocated_slots)?;
        d.set_item("allocated_runs", s.allocated_runs)?;
        d.set_item("contiguous_allocations", s.contiguous_allocations)?;
        d.set_item("resets", s.resets)?;
        d.set_item("ghosts", s.ghosts)?;
        d.set_item("admission_tracked", s.admission_tracked)?;
        if let Some(t) = s.target {
            d.set_item("target", t)?;
        }
        Ok(d)
    }

    /// The policy's lists, least recent first: `lru` (LRU) or `t1`, `t2`, `b1`, `b2` (ARC).
    fn order<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let o = self.lock().order();
        let d = PyDict::new(py);
        for (name, keys) in o.resident.into_iter().chain(o.ghosts) {
            d.set_item(name, ints(&keys))?;
        }
        Ok(d)
    }

    /// Number of present keys (storing or ready).
    fn __len__(&self) -> usize {
        self.lock().len()
    }

    fn __repr__(&self) -> String {
        let p = self.lock();
        let s = p.stats();
        format!(
            "CpuPool(capacity={}, policy='{}', used={}, storing={}, pinned={})",
            s.capacity,
            p.policy(),
            s.used,
            s.storing,
            s.pinned
        )
    }
}
