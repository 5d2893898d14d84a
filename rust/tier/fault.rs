//! Fault injection for tests (cargo feature `fault-injection`, off by default): disk reads
//! under a directory that hang until released, or are delayed. The disk deadline tests use it
//! to make a promotion late on a real I/O thread (`tests/disk_deadline.rs`).
//!
//! A [`ReadFault`] applies to every [`SlabFile::read`] of a slab file under its root, in any
//! thread, while it lives; tests running in parallel use distinct roots. Dropping it releases
//! the reads it holds.
//!
//! [`SlabFile::read`]: super::disk::SlabFile::read

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

#[derive(Debug)]
struct Gate {
    root: PathBuf,
    /// `None`: hang until released; `Some(d)`: sleep `d`.
    delay: Option<Duration>,
    released: Mutex<bool>,
    cv: Condvar,
    reads: AtomicU64,
}

static GATES: Mutex<Vec<Arc<Gate>>> = Mutex::new(Vec::new());

/// A fault on the disk reads under one directory. See the module documentation.
#[derive(Debug)]
pub struct ReadFault {
    gate: Arc<Gate>,
}

impl ReadFault {
    /// Reads under `root` hang until [`ReadFault::release`] (or the drop).
    pub fn hang(root: &Path) -> Self {
        Self::install(root, None)
    }

    /// Reads under `root` take `delay` longer.
    pub fn delay(root: &Path, delay: Duration) -> Self {
        Self::install(root, Some(delay))
    }

    fn install(root: &Path, delay: Option<Duration>) -> Self {
        let gate = Arc::new(Gate {
            root: root.to_path_buf(),
            delay,
            released: Mutex::new(false),
            cv: Condvar::new(),
            reads: AtomicU64::new(0),
        });
        GATES.lock().expect("gates lock").push(Arc::clone(&gate));
        Self { gate }
    }

    /// Reads that met the fault so far (held, delayed or let through after the release).
    pub fn reads(&self) -> u64 {
        self.gate.reads.load(Relaxed)
    }

    /// Lets held reads go on; later reads are not held.
    pub fn release(&self) {
        *self.gate.released.lock().expect("gate lock") = true;
        self.gate.cv.notify_all();
    }
}

impl Drop for ReadFault {
    fn drop(&mut self) {
        self.release();
        GATES
            .lock()
            .expect("gates lock")
            .retain(|g| !Arc::ptr_eq(g, &self.gate));
    }
}

/// Called before every disk read of the file at `path`: applies the faults on it.
pub(crate) fn before_read(path: &Path) {
    let gates: Vec<Arc<Gate>> = GATES
        .lock()
        .expect("gates lock")
        .iter()
        .filter(|g| path.starts_with(&g.root))
        .cloned()
        .collect();
    for g in gates {
        g.reads.fetch_add(1, Relaxed);
        if let Some(d) = g.delay {
            std::thread::sleep(d);
        } else {
            let mut released = g.released.lock().expect("gate lock");
            while !*released {
                released = g.cv.wait(released).expect("gate lock");
            }
        }
    }
}
