//! What the Rust integration tests share, one module per subject. A test crate includes it with
//! `mod support;` and uses what it needs, so any one crate leaves most of it unused.
#![allow(dead_code)]

pub mod cluster;
pub mod remote;
pub mod step;
pub mod tier;

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Runs the tests of one binary one at a time (hold the guard for the whole test): a test that
/// spawns a process forks it holding every descriptor of this process until its `exec`
/// (close-on-exec), a disk tier's lock file among them, so a test that drops a tier and reopens
/// it at that moment would find the directory still locked.
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}
