//! kvoffload core: the scheduler-side bookkeeping of KV-cache offloading.
//!
//! The engine's hot path asks, every step, which chunks to store, which to load and which
//! pending copies must finish before a GPU block is overwritten. This crate answers with plain
//! data structures over dense integer ids:
//!
//! - [`ids`]: newtypes for the ids that cross module boundaries;
//! - [`jobs`]: the job table (monotonic ids, per-worker completion counting, reset epochs) and
//!   the per-request rule "one pending load or any number of pending stores";
//! - [`fence`]: the armed index `block -> pending jobs` and the one-pass check;
//! - [`tracker`]: jobs and fence together, with the eager / deferred lifecycle classes;
//! - [`pool`]: the CPU pool (slots, key states, pins, contiguous allocation, events);
//! - [`policy`]: its eviction policies (LRU, ARC) behind one trait;
//! - [`tier`]: tiers below the CPU pool (the disk tier; the contract lower tiers share).
//!
//! Domain modules never import pyo3; the Python bindings live in `rust/py/` behind the
//! `python` feature, so `cargo test` and `cargo bench` build plain Rust.

pub mod config;
pub mod copy;
pub mod error;
pub mod fence;
pub mod ids;
pub mod jobs;
pub mod policy;
pub mod pool;
pub mod scheduler;
pub mod tier;
pub mod tracker;

#[cfg(feature = "python")]
mod py;

pub use error::{Error, Result};
pub use ids::{BlockId, JobId, Key, OwnerId, SlotId};
