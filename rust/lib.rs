//! kvoffload core: the scheduler-side bookkeeping of KV-cache offloading.
//!
//! The engine's hot path asks, every step, which chunks to store, which to load and which
//! pending copies must finish before a GPU block is overwritten. This crate answers with plain
//! data structures over dense integer ids:
//!
//! - [`ids`]: newtypes for the ids that cross module boundaries;
//! - [`error`]: the one error type, whose messages name the ids involved;
//! - [`config`]: the scheduler's configuration, validated once;
//! - [`jobs`]: the job table (monotonic ids, per-worker completion, reset epochs);
//! - [`fence`]: the armed index `block -> pending jobs` and the one-pass check;
//! - [`tracker`]: jobs and fence together, with the eager / deferred lifecycle classes;
//! - [`pool`]: the CPU pool (slots, key states, pins, contiguous allocation, events);
//! - [`policy`]: the pool's eviction policies (LRU, ARC) behind one trait;
//! - [`scheduler`]: requests, lookups, loads, store planning and the per-step plan;
//! - [`prefetch`]: cache prefetch hints for the hot paths;
//! - [`runs`]: the packed copy runs a plan hands the data plane, and their check;
//! - [`copy`]: bounded byte copies between registered KV tensors and the CPU pool;
//! - [`tier`]: tiers below the CPU pool (the disk tier; the contract lower tiers share);
//! - `mem`: huge-page arrays for the pool's random reads;
//! - `py` (feature `python`): the Python bindings, the only place that mentions pyo3.
//!
//! Domain modules never import pyo3; the Python bindings live in `rust/py/` behind the
//! `python` feature, so `cargo test` and `cargo bench` build plain Rust.

pub mod config;
pub mod copy;
pub mod error;
pub mod fence;
pub mod ids;
pub mod jobs;
mod mem;
pub mod policy;
pub mod pool;
pub mod prefetch;
pub mod runs;
pub mod scheduler;
pub mod tier;
pub mod tracker;

#[cfg(feature = "python")]
mod py;

pub use error::{Error, Result};
pub use ids::{BlockId, JobId, Key, OwnerId, SlotId};
