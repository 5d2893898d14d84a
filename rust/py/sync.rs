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

use std::sync::{Mutex, MutexGuard, TryLockError};

use pyo3::prelude::*;

/// Takes `m`: at once when it is free; otherwise waits with the GIL released, then takes it
/// attached. A poisoned lock (a panic inside the core) is taken as is.
pub fn lock<T: Send>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    loop {
        match m.try_lock() {
            Ok(g) => return g,
            Err(TryLockError::Poisoned(p)) => return p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                // Wait for the holder without the GIL, then retry with it: a guard cannot leave
                // the detached closure (it is not `Send`).
                Python::attach(|py| py.detach(|| drop(m.lock())));
            }
        }
    }
}
