//! Checksums beside the I/O: a batch's CRC-32C runs on a helper thread while the I/O thread
//! moves the next bytes, instead of between its reads and writes.
//!
//! A write needs a chunk's checksum only for its header, which is written after the batch's
//! `fdatasync`; a promotion needs it only to decide whether the chunk may be served, after its
//! bytes arrived. On one I/O thread the 2 MiB checksum (0.12 ms here, 6–8% of a chunk's I/O)
//! sat between two device requests; beside them it overlaps the next request. The CPU spent is
//! the same (the I/O thread sleeps in the kernel meanwhile), so the engine's thread loses
//! nothing more; the helper inherits the I/O thread's priority (nice 19 on Linux). Batches
//! under [`BESIDE_MIN_BYTES`] keep everything on the I/O thread (starting a thread costs tens
//! of microseconds).

use std::sync::{mpsc, Mutex};
use std::time::Instant;

use super::slab::{ReadError, SlabFile};
use crate::ids::Key;
use crate::tier::Location;

/// Batches of at least this many data bytes get a checksum thread.
pub const BESIDE_MIN_BYTES: u64 = 1 << 20;

/// One chunk of a [`SlabFile::read_batch`].
#[derive(Debug)]
pub struct ChunkRead<'a> {
    /// The key the index expects.
    pub key: Key,
    /// Where the index expects it (slot and generation).
    pub loc: Location,
    /// Where its data goes, in order (`chunk_bytes` in total); taken by the read.
    pub pieces: Vec<&'a mut [u8]>,
}

impl SlabFile {
    /// Runs `main` on this thread and `side` beside it on a helper thread when `chunks`
    /// chunks make a batch of at least [`BESIDE_MIN_BYTES`] (or here, after `main`, when the
    /// batch is smaller or no thread can be started).
    pub(super) fn beside<A: Send, B>(
        &self,
        chunks: usize,
        side: impl FnOnce() -> A + Send,
        main: impl FnOnce() -> B,
    ) -> (A, B) {
        let side = Mutex::new(Some(side));
        let run = || side.lock().expect("side lock").take().map(|f| f());
        if (chunks as u64).saturating_mul(self.layout.chunk_bytes) < BESIDE_MIN_BYTES {
            let b = main();
            return (run().expect("not run yet"), b);
        }
        std::thread::scope(|s| {
            let helper = std::thread::Builder::new()
                .name("kvoffload-crc".into())
                .spawn_scoped(s, run);
            let b = main();
            let a = match helper {
                Ok(h) => h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                Err(_) => run(),
            };
            (a.expect("run once"), b)
        })
    }

    /// Reads and verifies a batch of chunks (as [`SlabFile::read`] each), the checksums
    /// beside the reads; one result per item, in order. On `Err` an item's pieces hold
    /// unspecified bytes that must not be served.
    pub fn read_batch(&self, items: &mut [ChunkRead<'_>]) -> Vec<Result<(), ReadError>> {
        let t0 = Instant::now();
        let mut out: Vec<Result<(), ReadError>> = items.iter().map(|_| Ok(())).collect();
        let (tx, rx) = mpsc::channel::<(usize, u32, Vec<&[u8]>, u32)>();
        let (checked, ()) = self.beside(
            items.len(),
            move || {
                rx.into_iter()
                    .map(|(i, slot, pieces, crc)| (i, Self::verify_data(slot, &pieces, crc)))
                    .collect::<Vec<_>>()
            },
            || {
                for (i, it) in items.iter_mut().enumerate() {
                    match self.read_unverified(it.key, it.loc, &mut it.pieces) {
                        Ok(crc) => {
                            let slot = u32::try_from(it.loc.place).unwrap_or(u32::MAX);
                            let data: Vec<&[u8]> = std::mem::take(&mut it.pieces)
                                .into_iter()
                                .map(|p| &*p)
                                .collect();
                            tx.send((i, slot, data, crc)).expect("the checker runs");
                        }
                        Err(e) => out[i] = Err(e),
                    }
                }
                drop(tx);
            },
        );
        for (i, r) in checked {
            out[i] = r;
        }
        for r in &out {
            self.count_read(r.is_ok());
        }
        self.add_read_ns(t0);
        out
    }
}
