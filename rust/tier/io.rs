//! The worker side of the tiers: tier jobs executed on Rust threads, straight from and into the
//! registered CPU pool memory.
//!
//! A [`TierWorker`] registers, once, the CPU pool's buffers and, per KV group, where each
//! registered tensor's CPU rows sit in them (the same row spaces the copier uses) and the
//! group's [`SlabFile`]. A job names chunks only by CPU slot and tier [`Location`]: every slot is
//! checked against the group's registered rows before a byte moves, and the worker turns slots
//! into pieces of registered memory itself, so no caller can make it read or write outside the
//! registration. Jobs go to a queue served by background threads ([`TierWorker::submit`]
//! returns at once); finished jobs are collected with [`TierWorker::poll`] or
//! [`TierWorker::wait`]. A write-behind writes the slots' bytes with the two-phase publish; a
//! promotion reads and verifies every chunk, quarantines a slot whose bytes are bad, and fails
//! the job if any chunk failed (the scheduler then drops the CPU slots: nothing unverified is
//! served).
//!
//! A slot being written behind is pinned in the CPU pool and a slot being promoted is
//! reserved (not readable), so no other copy touches the bytes a tier job reads or writes.
//!
//! The I/O threads of a worker with a disk tier run at the lowest CPU priority (nice 19,
//! [`lower_thread_priority`]): the checksums and copies of a write-behind must not take the
//! CPU from the engine's Python thread on a small machine (the stall budget, DESIGN.md §7).
//! [`TierWorker::low_priority_threads`] says how many got it (a sandbox may refuse). A worker
//! of the shared tier alone keeps the engine's priority: its threads mostly wait on the
//! network, and at nice 19 on a loaded machine they starved.
//!
//! With a [`CpuSet`] (`io_cpus`), every I/O thread pins itself to it before it takes a job,
//! and the threads it starts (checksum helpers, the shared tier's connections) inherit it;
//! [`TierWorker::new`] returns only once every thread is pinned (or fails, with the threads
//! stopped). Without one nothing is pinned.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::affinity::{pin_and_report, CpuSet};
use super::disk::{ChunkRead, SlabFile, WriteItem};
use super::remote::{ChunkNames, ReadItem, ReadOutcome, RemoteClient, WriteItem as RemoteWrite};
use super::Location;
use crate::copy::{extent, RowSpace, Span};
use crate::error::{Error, Result};
use crate::ids::{JobId, Key};
use crate::scheduler::TierJobKind;

/// One registered tensor's CPU rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuRegion {
    /// Where its rows sit.
    pub space: RowSpace,
    /// Bytes per row.
    pub row_bytes: usize,
}

/// One KV group: its CPU rows, rows per chunk, tensors and slab file.
#[derive(Debug)]
pub struct TierGroup {
    /// CPU rows of every region.
    pub cpu_rows: usize,
    /// Rows per chunk (blocks per chunk).
    pub rows_per_chunk: usize,
    /// The group's tensors, in the order their bytes follow each other in a chunk.
    pub regions: Vec<CpuRegion>,
    /// The group's slab file (`None`: the group has no disk tier).
    pub file: Option<SlabFile>,
    /// The group's shared tier (used when it has no slab file).
    pub remote: Option<RemoteGroup>,
}

/// A group's shared (Redis) tier on a worker: the client and this rank's namespace.
#[derive(Debug, Clone)]
pub struct RemoteGroup {
    /// The client (one per worker, shared by its groups).
    pub client: Arc<RemoteClient>,
    /// Namespace digests of this group's chunks on this rank (keys and headers).
    pub namespace: ChunkNames,
}

/// One tier job for a worker (the scheduler's [`crate::scheduler::TierJob`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerJob {
    /// Job id.
    pub id: JobId,
    /// Write-behind or promotion.
    pub kind: TierJobKind,
    /// KV group.
    pub group: u32,
    /// Chunk keys.
    pub keys: Vec<Key>,
    /// CPU slot of each key.
    pub cpu_slots: Vec<u32>,
    /// Tier location of each key.
    pub locations: Vec<Location>,
}

impl From<&crate::scheduler::TierJob> for WorkerJob {
    /// The worker's part of a planned tier job (the medium picks the worker).
    fn from(j: &crate::scheduler::TierJob) -> Self {
        Self {
            id: j.id,
            kind: j.kind,
            group: j.group,
            keys: j.keys.clone(),
            cpu_slots: j.cpu_slots.clone(),
            locations: j.locations.clone(),
        }
    }
}

#[derive(Debug)]
struct Shared {
    groups: Vec<TierGroup>,
    done: Mutex<Vec<(JobId, bool)>>,
    cv: Condvar,
    /// I/O threads that run at the lowest CPU priority.
    low_priority: AtomicUsize,
}

/// Tier jobs on background threads. See the module documentation.
#[derive(Debug)]
pub struct TierWorker {
    shared: Arc<Shared>,
    tx: Option<mpsc::Sender<WorkerJob>>,
    threads: Vec<JoinHandle<()>>,
    cpus: Option<CpuSet>,
}

impl TierGroup {
    /// `(address, len)` pieces of CPU slot `slot`, in chunk order (row spaces are absolute
    /// once registered).
    fn pieces(&self, slot: u32) -> Vec<(usize, usize)> {
        let g = self;
        let first = slot as usize * g.rows_per_chunk;
        let mut out = Vec::new();
        for r in &g.regions {
            let base = r.space.offset + first * r.space.stride;
            if r.space.stride == r.row_bytes {
                out.push((base, g.rows_per_chunk * r.row_bytes));
            } else {
                out.extend((0..g.rows_per_chunk).map(|i| (base + i * r.space.stride, r.row_bytes)));
            }
        }
        out
    }

    /// The pieces of CPU slot `slot` as byte slices to read from.
    ///
    /// # Safety
    /// `slot` was checked against the group's registered rows, and nothing writes the slot's
    /// bytes while the slices live (a slot being written behind is pinned in the CPU pool).
    #[allow(unsafe_code)]
    unsafe fn src(&self, slot: u32) -> Vec<&[u8]> {
        self.pieces(slot)
            .into_iter()
            // SAFETY: registered memory, alive for the worker's lifetime (the caller's
            // contract covers the rest).
            .map(|(a, n)| unsafe { std::slice::from_raw_parts(a as *const u8, n) })
            .collect()
    }

    /// The pieces of CPU slot `slot` as byte slices to write into.
    ///
    /// # Safety
    /// As [`Self::src`], and nothing else reads or writes the slot's bytes while the slices
    /// live (a slot being promoted is reserved in the CPU pool, and a job's slots are
    /// distinct).
    #[allow(unsafe_code, clippy::mut_from_ref)]
    unsafe fn dst(&self, slot: u32) -> Vec<&mut [u8]> {
        self.pieces(slot)
            .into_iter()
            // SAFETY: as above.
            .map(|(a, n)| unsafe { std::slice::from_raw_parts_mut(a as *mut u8, n) })
            .collect()
    }
}

impl TierGroup {
    /// Runs `job` against the shared tier (slots checked by the caller).
    fn run_remote(&self, r: &RemoteGroup, job: &WorkerJob) -> bool {
        match job.kind {
            TierJobKind::Write => {
                let items: Vec<RemoteWrite<'_>> = job
                    .keys
                    .iter()
                    .zip(&job.cpu_slots)
                    .map(|(&key, &slot)| RemoteWrite {
                        key,
                        group: job.group,
                        // SAFETY: the slot was checked by the caller and is pinned.
                        #[allow(unsafe_code)]
                        data: unsafe { self.src(slot) },
                    })
                    .collect();
                r.client.write(r.namespace, &items).iter().all(|&ok| ok)
            }
            TierJobKind::Promote => {
                let mut items: Vec<ReadItem<'_>> = job
                    .keys
                    .iter()
                    .zip(&job.cpu_slots)
                    .map(|(&key, &slot)| ReadItem {
                        key,
                        group: job.group,
                        // SAFETY: the slot was checked by the caller and is reserved.
                        #[allow(unsafe_code)]
                        dst: unsafe { self.dst(slot) },
                    })
                    .collect();
                r.client
                    .read(r.namespace, &mut items)
                    .iter()
                    .all(|&o| o == ReadOutcome::Hit)
            }
        }
    }
}

impl Shared {
    fn run(&self, job: &WorkerJob) -> bool {
        let Some(g) = self.groups.get(job.group as usize) else {
            return false;
        };
        let rows = g.cpu_rows / g.rows_per_chunk.max(1);
        if job.cpu_slots.iter().any(|&s| s as usize >= rows)
            || job.keys.len() != job.cpu_slots.len()
            || job.keys.len() != job.locations.len()
        {
            return false;
        }
        if job.kind == TierJobKind::Promote {
            // A promotion writes its slots while their checksums are read beside it: two
            // chunks must never share one.
            let mut slots = job.cpu_slots.clone();
            slots.sort_unstable();
            if slots.windows(2).any(|w| w[0] == w[1]) {
                return false;
            }
        }
        let Some(file) = g.file.as_ref() else {
            return g.remote.as_ref().is_some_and(|r| g.run_remote(r, job));
        };
        match job.kind {
            TierJobKind::Write => {
                let items: Vec<WriteItem<'_>> = job
                    .keys
                    .iter()
                    .zip(&job.cpu_slots)
                    .zip(&job.locations)
                    .map(|((&key, &slot), loc)| WriteItem {
                        slot: u32::try_from(loc.place).unwrap_or(u32::MAX),
                        key,
                        generation: loc.generation,
                        // SAFETY: the slot was checked above and is pinned.
                        #[allow(unsafe_code)]
                        pieces: unsafe { g.src(slot) },
                    })
                    .collect();
                file.write(&items).iter().all(std::result::Result::is_ok)
            }
            TierJobKind::Promote => {
                let mut items: Vec<ChunkRead<'_>> = job
                    .keys
                    .iter()
                    .zip(&job.cpu_slots)
                    .zip(&job.locations)
                    .map(|((&key, &slot), &loc)| ChunkRead {
                        key,
                        loc,
                        // SAFETY: the slot was checked above and is reserved.
                        #[allow(unsafe_code)]
                        pieces: unsafe { g.dst(slot) },
                    })
                    .collect();
                let mut ok = true;
                for (r, loc) in file.read_batch(&mut items).iter().zip(&job.locations) {
                    if let Err(e) = r {
                        if e.is_corrupt() {
                            let _ = file.quarantine(u32::try_from(loc.place).unwrap_or(u32::MAX));
                        }
                        ok = false;
                    }
                }
                ok
            }
        }
    }
}

impl TierWorker {
    /// Registers `buffers` and `groups` (each region's rows checked to lie in its buffer) and
    /// starts `threads` I/O threads, each pinned to `cpus` when given (an error if a thread
    /// cannot be pinned: the threads are stopped).
    ///
    /// # Safety
    /// Every span must be memory that stays allocated, readable and writable for the whole
    /// lifetime of the worker.
    #[allow(unsafe_code)]
    pub unsafe fn new(
        buffers: &[Span],
        mut groups: Vec<TierGroup>,
        threads: usize,
        cpus: Option<CpuSet>,
    ) -> Result<Self> {
        for (gi, g) in groups.iter_mut().enumerate() {
            if g.rows_per_chunk == 0 {
                return Err(Error::Config(format!("tier group {gi}: 0 rows per chunk")));
            }
            let chunk: usize = g
                .regions
                .iter()
                .map(|r| r.row_bytes * g.rows_per_chunk)
                .sum();
            if let Some(f) = &g.file {
                if chunk as u64 != f.layout().chunk_bytes {
                    return Err(Error::Config(format!(
                        "tier group {gi}: a chunk has {chunk} bytes in the CPU pool, the slab's \
                         chunks have {}",
                        f.layout().chunk_bytes
                    )));
                }
            }
            for (ri, r) in g.regions.iter_mut().enumerate() {
                let (start, _) = extent(buffers, r.space, g.cpu_rows, r.row_bytes)
                    .map_err(|e| Error::Config(format!("tier group {gi} region {ri}: {e}")))?;
                // From here on the row space is absolute: offset is an address.
                r.space.offset = start;
            }
        }
        // Disk I/O threads checksum and copy whole chunks: lowest priority. The shared tier's
        // mostly wait on the network; lowered, they starved on a loaded machine (the server's
        // recovery trials came too late for tests/test_remote_engine_faults.py).
        let lower = groups.iter().any(|g| g.file.is_some());
        let shared = Arc::new(Shared {
            groups,
            done: Mutex::new(Vec::new()),
            cv: Condvar::new(),
            low_priority: AtomicUsize::new(0),
        });
        let (tx, rx) = mpsc::channel::<WorkerJob>();
        let rx = Arc::new(Mutex::new(rx));
        let (pinned_tx, pinned) = mpsc::channel::<Result<()>>();
        let threads = (0..threads.max(1))
            .map(|i| {
                let (shared, rx) = (Arc::clone(&shared), Arc::clone(&rx));
                let (cpus, pinned_tx) = (cpus.clone(), pinned_tx.clone());
                std::thread::Builder::new()
                    .name(format!("kvoffload-tier-{i}"))
                    .spawn(move || {
                        if !pin_and_report(cpus.as_ref(), &pinned_tx) {
                            return;
                        }
                        if lower && lower_thread_priority() {
                            shared.low_priority.fetch_add(1, Relaxed);
                        }
                        loop {
                            let job = rx.lock().expect("queue lock").recv();
                            let Ok(job) = job else { break };
                            let ok = shared.run(&job);
                            shared.done.lock().expect("done lock").push((job.id, ok));
                            shared.cv.notify_all();
                        }
                    })
                    .expect("spawn a tier I/O thread")
            })
            .collect::<Vec<_>>();
        let n = threads.len();
        let worker = Self {
            shared,
            tx: Some(tx),
            threads,
            cpus,
        };
        for _ in 0..n {
            // On an error the worker is dropped: its threads stop and are joined.
            pinned.recv().expect("every I/O thread reports")?;
        }
        Ok(worker)
    }

    /// The registered groups.
    pub fn groups(&self) -> &[TierGroup] {
        &self.shared.groups
    }

    /// `(lowered, threads)`: I/O threads running at the lowest CPU priority, of all (a
    /// thread lowers itself when it starts: right after [`TierWorker::new`] the count may
    /// still grow).
    pub fn low_priority_threads(&self) -> (usize, usize) {
        (self.shared.low_priority.load(Relaxed), self.threads.len())
    }

    /// The CPUs the I/O threads are pinned to (`None`: not pinned).
    pub fn cpus(&self) -> Option<&[usize]> {
        self.cpus.as_ref().map(CpuSet::ids)
    }

    /// Queues `jobs`; returns at once.
    pub fn submit(&self, jobs: Vec<WorkerJob>) {
        let tx = self.tx.as_ref().expect("open until dropped");
        for j in jobs {
            tx.send(j).expect("I/O threads run until dropped");
        }
    }

    /// Jobs finished since the last poll: `(id, ok)`.
    pub fn poll(&self) -> Vec<(JobId, bool)> {
        std::mem::take(&mut *self.shared.done.lock().expect("done lock"))
    }

    /// Waits until every job of `ids` finished (or `timeout` passed) and returns every job
    /// finished since the last poll; the ids not finished in time are left out.
    pub fn wait(&self, ids: &[JobId], timeout: Duration) -> Vec<(JobId, bool)> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        let mut guard = self.shared.done.lock().expect("done lock");
        loop {
            out.append(&mut guard);
            if ids.iter().all(|id| out.iter().any(|(d, _)| d == id)) {
                return out;
            }
            let now = Instant::now();
            if now >= deadline {
                return out;
            }
            guard = self
                .shared
                .cv
                .wait_timeout(guard, deadline - now)
                .expect("done lock")
                .0;
        }
    }
}

impl Drop for TierWorker {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Puts the calling thread at the lowest CPU priority (nice 19; Linux: `setpriority` on the
/// thread's id, which changes only that thread; threads it starts inherit it). Returns
/// whether that worked (elsewhere, or where the system refuses: `false`, nothing changed).
pub fn lower_thread_priority() -> bool {
    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    {
        // SAFETY: `gettid` has no preconditions and `setpriority` only reads its arguments.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) };
        // SAFETY: as above; a failure leaves the priority as it was.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::{CpuRegion, TierGroup, TierWorker, WorkerJob};
    use crate::copy::{RowSpace, Span};
    use crate::ids::{JobId, Key};
    use crate::scheduler::TierJobKind;
    use crate::tier::disk::{engine_namespace, SlabFile, SlabLayout, BLOCK};
    use crate::tier::Location;
    use std::time::Duration;

    #[test]
    fn a_promotion_naming_one_cpu_slot_twice_fails_without_io() {
        let dir = std::env::temp_dir().join(format!("kvo-io-dup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let chunk = 4096usize;
        let layout = SlabLayout::new(chunk as u64, 4 * (BLOCK + chunk as u64)).unwrap();
        let ns = engine_namespace("m", chunk as u64, 1, 1, 0, 1, 0);
        let file = SlabFile::open(&dir, &ns, layout, false, false).unwrap();
        let mut cpu = vec![0u8; 4 * chunk];
        cpu[..chunk].fill(1);
        cpu[chunk..2 * chunk].fill(2);
        let span = Span {
            base: cpu.as_mut_ptr() as usize,
            len: cpu.len(),
        };
        let group = TierGroup {
            cpu_rows: 4,
            rows_per_chunk: 1,
            regions: vec![CpuRegion {
                space: RowSpace {
                    buffer: 0,
                    offset: 0,
                    stride: chunk,
                },
                row_bytes: chunk,
            }],
            file: Some(file),
            remote: None,
        };
        #[allow(unsafe_code)]
        // SAFETY: `cpu` outlives the worker (dropped after it) and never moves.
        let w = unsafe { TierWorker::new(&[span], vec![group], 1, None) }.unwrap();
        let loc = |place| Location {
            place,
            generation: 1,
        };
        let job = |id, kind, cpu_slots: Vec<u32>| WorkerJob {
            id: JobId(id),
            kind,
            group: 0,
            keys: vec![Key(1), Key(2)],
            cpu_slots,
            locations: vec![loc(0), loc(1)],
        };
        let run = |j: WorkerJob| {
            let id = j.id;
            w.submit(vec![j]);
            w.wait(&[id], Duration::from_secs(30))
        };
        assert_eq!(
            run(job(1, TierJobKind::Write, vec![0, 1])),
            [(JobId(1), true)]
        );
        assert_eq!(
            run(job(2, TierJobKind::Promote, vec![2, 2])),
            [(JobId(2), false)]
        );
        assert!(w.groups()[0].file.as_ref().unwrap().io_stats().chunks_read == 0);
        assert_eq!(
            run(job(3, TierJobKind::Promote, vec![2, 3])),
            [(JobId(3), true)]
        );
        drop(w);
        assert!(cpu[2 * chunk..3 * chunk].iter().all(|&b| b == 1));
        assert!(cpu[3 * chunk..].iter().all(|&b| b == 2));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    fn own_nice() -> i32 {
        // SAFETY: no preconditions.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) };
        // SAFETY: reads the priority of this thread only.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn only_the_calling_thread_gets_the_lowest_priority() {
        let before = own_nice();
        let (ok, nice, child) = std::thread::spawn(|| {
            let ok = super::lower_thread_priority();
            let child = std::thread::spawn(own_nice).join().unwrap();
            (ok, own_nice(), child)
        })
        .join()
        .unwrap();
        assert!(ok, "raising one's own nice value is always allowed");
        assert_eq!((nice, child), (19, 19), "its threads inherit it");
        assert_eq!(own_nice(), before, "other threads keep theirs");
    }
}
