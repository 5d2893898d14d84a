//! What the Rust integration tests share, one module per subject. A test crate includes it with
//! `mod support;` and uses what it needs, so any one crate leaves most of it unused.
#![allow(dead_code)]

pub mod cluster;
pub mod remote;
pub mod step;
pub mod tier;
