//! The lock discipline of the bindings: never call into Python while holding a core lock, and
//! wait for a contended lock with the GIL released.
//!
//! Each pyclass keeps its core behind a [`Mutex`]. A binding holds that lock only around pure
//! Rust work: Python inputs are converted before it is taken and Python objects are built
//! after it is released, because any Python allocation may run the garbage collector, whose
//! finalizers may call back into the same object (on this thread: a self-deadlock) or release
//! the GIL to another thread that then calls in. A thread that finds the lock taken waits for
//! it detached from the interpreter ([`Python::detach`]), so the holder can always get the GIL
//! back and finish.
//!
//! No panic crosses the boundary: every method of a pyclass that holds a core runs inside
//! [`guarded`], which turns a panic (an internal bug) into `kvoffload.errors.InternalError`. A
//! panic while the core's lock is held poisons it, and [`lock`] then refuses every later call
//! with the same error: a core that stopped half-way through a call is never used again.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use pyo3::prelude::*;

use super::errors::InternalError;

/// Takes `m`: at once when it is free; otherwise waits with the GIL released, then takes it
/// attached. A poisoned lock (an earlier call panicked while holding it) raises
/// `InternalError`.
pub fn lock<T: Send>(m: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    take(m).map_err(|_| {
        InternalError::new_err(
            "an earlier call panicked inside this object's core (a bug in kvoffload; its \
             message is on stderr): its state may be half-applied, so it refuses every call; \
             build a new one",
        )
    })
}

/// [`lock`] for a lock that guards only a cache of the bindings (never core state): a poisoned
/// one is taken as is.
pub fn lock_cache<T: Send>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    take(m).unwrap_or_else(PoisonError::into_inner)
}

/// The lock discipline of [`lock`] and [`lock_cache`]: `Err` holds a poisoned lock's guard.
fn take<T: Send>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>, PoisonError<MutexGuard<'_, T>>> {
    loop {
        match m.try_lock() {
            Ok(g) => return Ok(g),
            Err(TryLockError::Poisoned(p)) => return Err(p),
            Err(TryLockError::WouldBlock) => {
                // Wait for the holder without the GIL, then retry with it: a guard cannot leave
                // the detached closure (it is not `Send`).
                Python::attach(|py| py.detach(|| drop(m.lock())));
            }
        }
    }
}

/// Runs one binding call, a panic inside it raised as `InternalError` with the panic's message
/// (the lock it held, if any, is poisoned by the unwinding: see [`lock`]).
pub fn guarded<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        Err(InternalError::new_err(format!(
            "internal error (a bug in kvoffload, please report it): {msg}; this object refuses \
             every later call"
        )))
    })
}
