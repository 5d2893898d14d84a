//! The worker side of the disk tier: the slab file of one namespace (two-phase publish,
//! checked reads, quarantine, `O_DIRECT` probe, a durable close).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::dir::TierDir;
use super::scan::{scan_file, ScanReport};
use super::vio::{self, aligned, AlignedBlock};
use super::{SlabLayout, BLOCK, LAYOUT_FILE, QUARANTINE, SLAB_FILE};
use crate::error::{Error, Result};
use crate::ids::Key;
use crate::tier::counters::atomic_counters;
use crate::tier::header::{checksum, ChunkHeader, HeaderError, HEADER_LEN};
use crate::tier::namespace::Namespace;
use crate::tier::Location;

/// Why a chunk could not be served. The chunk is a miss; the slot should be quarantined
/// (except for I/O errors, which say nothing about the bytes).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// The slot's header does not decode.
    #[error("slot {slot}: {err}")]
    Header {
        /// The slot.
        slot: u32,
        /// Why.
        err: HeaderError,
    },
    /// The header decodes but names another chunk.
    #[error("slot {slot}: header {field} is {found:#x}, expected {expected:#x}")]
    Mismatch {
        /// The slot.
        slot: u32,
        /// The field.
        field: &'static str,
        /// What the header holds.
        found: u128,
        /// What the reader expected.
        expected: u128,
    },
    /// The data does not match the header's checksum.
    #[error("slot {slot}: data checksum {found:#010x}, header says {expected:#010x}")]
    Checksum {
        /// The slot.
        slot: u32,
        /// Checksum of the bytes read.
        found: u32,
        /// Checksum in the header.
        expected: u32,
    },
    /// The read itself failed (or the request was malformed).
    #[error("slot {slot}: {msg}")]
    Io {
        /// The slot.
        slot: u32,
        /// What failed.
        msg: String,
    },
}

impl ReadError {
    /// Whether the slot's bytes are bad (quarantine it), not merely unreadable now.
    pub fn is_corrupt(&self) -> bool {
        !matches!(self, ReadError::Io { .. })
    }
}

atomic_counters! {
    /// Cumulative I/O counters of a [`SlabFile`] (thread-safe).
    pub struct IoStats =>
    /// A plain copy of [`IoStats`].
    IoSnapshot {
        /// Data bytes written.
        bytes_written,
        /// Data bytes read.
        bytes_read,
        /// Chunks written (data and header).
        chunks_written,
        /// Chunks read and verified.
        chunks_read,
        /// Reads refused (header, mismatch, checksum, I/O).
        read_failures,
        /// Writes failed.
        write_failures,
        /// Data pieces moved with `O_DIRECT`.
        direct_pieces,
        /// Data pieces moved through the page cache.
        buffered_pieces,
        /// Nanoseconds spent in writes (batches) and reads.
        write_ns,
        /// Nanoseconds spent in reads.
        read_ns,
        /// `fdatasync` calls: one per batch (with `sync`) and one at close.
        syncs,
    }
}

/// One chunk of a [`SlabFile::write`] batch: its data as pieces, in order.
#[derive(Debug)]
pub struct WriteItem<'a> {
    /// Destination slot.
    pub slot: u32,
    /// The chunk's key.
    pub key: Key,
    /// Generation to record (from the index's [`Location`]).
    pub generation: u64,
    /// The data, `chunk_bytes` in total.
    pub pieces: Vec<&'a [u8]>,
}

/// The worker-side I/O of one namespace's slab file. See the module documentation.
#[derive(Debug)]
pub struct SlabFile {
    pub(super) path: PathBuf,
    pub(super) file: File,
    pub(super) direct: Option<File>,
    pub(super) layout: SlabLayout,
    pub(super) namespace: u128,
    pub(super) group: u32,
    pub(super) sync: bool,
    pub(super) stats: IoStats,
    /// A block-aligned block of zeros (written over a slot's header block with its data).
    pub(super) zeros: AlignedBlock,
    /// The directory this file's owner holds (`None`: a reader's view, or closed).
    pub(super) owner: Option<TierDir>,
}

impl Drop for SlabFile {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// The layout note of a slab of `ns`: its geometry, the digest every header carries, the group
/// and the per-tensor shapes of one chunk (for `kvoffload disk inspect`, and for the scheduler,
/// which reads the digest its workers write).
pub(super) fn layout_note(layout: SlabLayout, ns: &Namespace) -> String {
    let tensors: Vec<String> = ns
        .tensor_shapes
        .iter()
        .map(|s| s.iter().map(u64::to_string).collect::<Vec<_>>().join("x"))
        .collect();
    format!(
        "chunk_bytes={} slots={} namespace={:032x} group={} tensors={}\n",
        layout.chunk_bytes,
        layout.slots,
        ns.digest(),
        ns.group,
        tensors.join(",")
    )
}

pub(super) fn io_err(path: &Path, what: &str, e: &io::Error) -> Error {
    Error::Io(format!("disk tier {}: {what}: {e}", path.display()))
}

impl SlabFile {
    /// Opens (creating and preallocating if needed) the slab file of `ns` under `root`, in the
    /// directory `ns` names ([`SlabFile::open_in`]).
    pub fn open(
        root: &Path,
        ns: &Namespace,
        layout: SlabLayout,
        direct: bool,
        sync: bool,
    ) -> Result<Self> {
        Self::open_in(root, &ns.dir_name(), ns, layout, direct, sync)
    }

    /// Opens (creating and preallocating if needed) the slab file of directory `dir_name` under
    /// `root` for chunks of namespace `ns` (every header written carries its digest), sized
    /// for `layout`, and holds the directory ([`TierDir`]: one owner, nothing followed,
    /// owner-only) until the file is dropped or closed. A file of another size is resized to
    /// the layout: slots past the new end are gone, new slots are free. The layout note is
    /// replaced atomically when it changed, and left alone when it did not. `direct` asks for
    /// `O_DIRECT` where the file system allows it; `sync` makes every batch durable before its
    /// headers are written.
    pub fn open_in(
        root: &Path,
        dir_name: &str,
        ns: &Namespace,
        layout: SlabLayout,
        direct: bool,
        sync: bool,
    ) -> Result<Self> {
        let dir = TierDir::open(root, dir_name)?;
        let path = dir.path().join(SLAB_FILE);
        let file = dir.open_file(SLAB_FILE, true)?;
        let want = layout.file_bytes();
        let len = file
            .metadata()
            .map_err(|e| io_err(&path, "cannot stat", &e))?
            .len();
        if len != want {
            file.set_len(want)
                .and_then(|()| file.sync_all())
                .map_err(|e| io_err(&path, "cannot size", &e))?;
        }
        preallocate(&file, want);
        let note = layout_note(layout, ns);
        if dir.read(LAYOUT_FILE)?.as_deref() == Some(note.as_bytes()) {
            if len == 0 {
                dir.sync()?; // a new slab file's entry
            }
        } else {
            dir.replace(LAYOUT_FILE, note.as_bytes())?;
        }
        let direct = if direct {
            probe_direct(&dir, &file)
        } else {
            None
        };
        Ok(Self {
            path,
            file,
            direct,
            layout,
            namespace: ns.digest(),
            group: ns.group,
            sync,
            stats: IoStats::default(),
            zeros: AlignedBlock::new(),
            owner: Some(dir),
        })
    }

    /// Makes everything written durable (headers included), releases the directory and
    /// returns the final counters. Dropping the file does the same, without the result.
    pub fn close(mut self) -> io::Result<IoSnapshot> {
        self.finish()?;
        Ok(self.stats.snapshot())
    }

    /// The durable end of an owner: one `fdatasync` of what the last batch and any quarantine
    /// left in the page cache, then the directory's lock goes.
    fn finish(&mut self) -> io::Result<()> {
        let Some(dir) = self.owner.take() else {
            return Ok(());
        };
        let r = self.file.sync_data();
        self.stats.syncs.fetch_add(1, Ordering::Relaxed);
        drop(dir);
        r
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Slot geometry.
    pub fn layout(&self) -> SlabLayout {
        self.layout
    }

    /// Whether `O_DIRECT` is in use for aligned pieces (false: the file system refused it, or
    /// it was not asked for).
    pub fn direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The namespace digest every header must carry.
    pub fn namespace(&self) -> u128 {
        self.namespace
    }

    /// A copy of the I/O counters.
    pub fn io_stats(&self) -> IoSnapshot {
        self.stats.snapshot()
    }

    /// Reads every slot's header: committed chunks of this namespace and group, free slots, and
    /// bad ones (quarantined, foreign, undecodable).
    pub fn scan(&self) -> io::Result<ScanReport> {
        scan_file(&self.file, self.layout, self.namespace, self.group)
    }

    fn check_slot(&self, slot: u32) -> io::Result<()> {
        if slot >= self.layout.slots {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "slot {slot} out of range: the slab has {} slots",
                    self.layout.slots
                ),
            ));
        }
        Ok(())
    }

    /// The descriptor that moves pieces, and whether it is the `O_DIRECT` one (used when
    /// every piece is block-aligned: `all_aligned`).
    fn fd_for(&self, all_aligned: bool) -> (&File, bool) {
        match self.direct.as_ref() {
            Some(d) if all_aligned => (d, true),
            _ => (&self.file, false),
        }
    }

    /// Writes `pieces` back to back from `offset`, in one vectored write.
    fn write_data(&self, offset: u64, pieces: &[&[u8]]) -> io::Result<()> {
        let (f, direct) = self.fd_for(pieces.iter().all(|p| aligned(p)));
        vio::write_at(f, pieces, offset)?;
        self.count_pieces(direct, pieces.len());
        Ok(())
    }

    /// Counts `n` pieces moved with `O_DIRECT` (`direct`) or buffered.
    fn count_pieces(&self, direct: bool, n: usize) {
        let counter = if direct {
            &self.stats.direct_pieces
        } else {
            &self.stats.buffered_pieces
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Writes a batch of chunks with the two-phase publish (see the module documentation) and
    /// returns one result per item. An item whose slot, size or data write fails gets no header
    /// (its slot stays free); the others are published.
    pub fn write(&self, items: &[WriteItem<'_>]) -> Vec<io::Result<()>> {
        let t0 = Instant::now();
        let mut results: Vec<io::Result<()>> = items
            .iter()
            .map(|it| {
                self.check_slot(it.slot)?;
                let len: u64 = it.pieces.iter().map(|p| p.len() as u64).sum();
                if len != self.layout.chunk_bytes {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!(
                            "slot {}: {len} data bytes, the slab's chunks have {}",
                            it.slot, self.layout.chunk_bytes
                        ),
                    ));
                }
                Ok(())
            })
            .collect();
        // Phase 1: each slot's header block zeroed (no old header may stand over new data)
        // and its data, in one write; then one barrier for the whole batch. The checksums,
        // needed only by phase 2, are computed beside the writes (see `batch.rs`).
        let wanted: Vec<bool> = results.iter().map(Result::is_ok).collect();
        let crcs = self
            .beside(
                wanted.iter().filter(|&&w| w).count(),
                || {
                    items
                        .iter()
                        .zip(&wanted)
                        .map(|(it, &w)| w.then(|| checksum(it.pieces.iter().copied())))
                        .collect::<Vec<_>>()
                },
                || {
                    for (it, r) in items.iter().zip(&mut results) {
                        if r.is_ok() {
                            let mut pieces = Vec::with_capacity(it.pieces.len() + 1);
                            pieces.push(self.zeros.get());
                            pieces.extend_from_slice(&it.pieces);
                            *r = self.write_data(self.layout.header_offset(it.slot), &pieces);
                        }
                    }
                    if self.sync && results.iter().any(Result::is_ok) {
                        self.stats.syncs.fetch_add(1, Ordering::Relaxed);
                        if let Err(e) = self.file.sync_data() {
                            for r in &mut results {
                                if r.is_ok() {
                                    *r = Err(io::Error::new(e.kind(), e.to_string()));
                                }
                            }
                        }
                    }
                },
            )
            .0;
        let results = results
            .into_iter()
            .zip(crcs)
            .map(|(r, crc)| r.map(|()| crc.unwrap_or_default()));
        // Phase 2: the headers that make the chunks visible, each as a whole block through
        // the page cache: a whole-block write needs no read of the block first (a 72-byte
        // one read it back from the device, 0.15 ms a chunk), and the next batch's
        // `fdatasync` writes them out together.
        let mut block = vec![0u8; BLOCK as usize];
        let mut out = Vec::with_capacity(items.len());
        for (it, r) in items.iter().zip(results) {
            let r = r.and_then(|crc| {
                let h = ChunkHeader {
                    group: self.group,
                    namespace: self.namespace,
                    key: it.key,
                    length: self.layout.chunk_bytes,
                    generation: it.generation,
                    checksum: crc,
                };
                block[..HEADER_LEN].copy_from_slice(&h.encode());
                self.file
                    .write_all_at(&block, self.layout.header_offset(it.slot))
            });
            if r.is_ok() {
                self.stats.chunks_written.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .bytes_written
                    .fetch_add(self.layout.chunk_bytes, Ordering::Relaxed);
            } else {
                self.stats.write_failures.fetch_add(1, Ordering::Relaxed);
            }
            out.push(r);
        }
        self.stats
            .write_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Reads the chunk `key` expected at `loc` into `pieces` (in order, `chunk_bytes` in total)
    /// and verifies it. On `Err` the pieces hold unspecified bytes that must not be served.
    pub fn read(
        &self,
        key: Key,
        loc: Location,
        pieces: &mut [&mut [u8]],
    ) -> std::result::Result<(), ReadError> {
        let t0 = Instant::now();
        let slot = u32::try_from(loc.place).unwrap_or(u32::MAX);
        let r = self.read_unverified(key, loc, pieces).and_then(|crc| {
            let shared: Vec<&[u8]> = pieces.iter().map(|p| &**p).collect();
            Self::verify_data(slot, &shared, crc)
        });
        self.count_read(r.is_ok());
        self.add_read_ns(t0);
        r
    }

    /// Adds the time since `t0` to the read time.
    pub(super) fn add_read_ns(&self, t0: Instant) {
        self.stats
            .read_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Counts one chunk read (`ok`: verified) or refused.
    pub(super) fn count_read(&self, ok: bool) {
        let counter = if ok {
            self.stats
                .bytes_read
                .fetch_add(self.layout.chunk_bytes, Ordering::Relaxed);
            &self.stats.chunks_read
        } else {
            &self.stats.read_failures
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads the chunk `key` expected at `loc` into `pieces` and checks its header; returns
    /// the checksum its data must have ([`SlabFile::verify_data`]).
    pub(super) fn read_unverified(
        &self,
        key: Key,
        loc: Location,
        pieces: &mut [&mut [u8]],
    ) -> std::result::Result<u32, ReadError> {
        #[cfg(feature = "fault-injection")]
        crate::tier::fault::before_read(self.path());
        let slot = u32::try_from(loc.place).unwrap_or(u32::MAX);
        let io = |e: io::Error| ReadError::Io {
            slot,
            msg: e.to_string(),
        };
        self.check_slot(slot).map_err(io)?;
        let len: u64 = pieces.iter().map(|p| p.len() as u64).sum();
        if len != self.layout.chunk_bytes {
            return Err(ReadError::Io {
                slot,
                msg: format!(
                    "{len} bytes asked for, the slab's chunks have {}",
                    self.layout.chunk_bytes
                ),
            });
        }
        // The header block and the data in one vectored read (one request, as a plain read of
        // the slot's bytes), `O_DIRECT` when every piece is aligned.
        let mut hb = AlignedBlock::new();
        let (f, direct) = self.fd_for(pieces.iter().all(|p| aligned(p)));
        {
            let mut bufs: Vec<&mut [u8]> = Vec::with_capacity(pieces.len() + 1);
            bufs.push(hb.get_mut());
            bufs.extend(pieces.iter_mut().map(|p| &mut **p));
            vio::read_at(f, &mut bufs, self.layout.header_offset(slot)).map_err(io)?;
        }
        self.count_pieces(direct, pieces.len());
        let h = ChunkHeader::decode(&hb.get()[..HEADER_LEN])
            .map_err(|err| ReadError::Header { slot, err })?;
        let expect = [
            ("namespace", h.namespace, self.namespace),
            ("key", h.key.0, key.0),
            ("group", u128::from(h.group), u128::from(self.group)),
            (
                "length",
                u128::from(h.length),
                u128::from(self.layout.chunk_bytes),
            ),
            (
                "generation",
                u128::from(h.generation),
                u128::from(loc.generation),
            ),
        ];
        if let Some(&(field, found, expected)) = expect.iter().find(|(_, f, e)| f != e) {
            return Err(ReadError::Mismatch {
                slot,
                field,
                found,
                expected,
            });
        }
        Ok(h.checksum)
    }

    /// Checks the data of a chunk read into `pieces` against its header's checksum.
    pub(super) fn verify_data(
        slot: u32,
        pieces: &[&[u8]],
        expected: u32,
    ) -> std::result::Result<(), ReadError> {
        let found = checksum(pieces.iter().copied());
        if found != expected {
            return Err(ReadError::Checksum {
                slot,
                found,
                expected,
            });
        }
        Ok(())
    }

    /// Marks `slot` quarantined: its header can never decode again, so no reopen serves it.
    pub fn quarantine(&self, slot: u32) -> io::Result<()> {
        self.check_slot(slot)?;
        let mut b = [0u8; HEADER_LEN];
        b[..8].copy_from_slice(&QUARANTINE);
        self.file.write_all_at(&b, self.layout.header_offset(slot))
    }

    /// Reads and verifies the chunk in `slot`, whatever its key and generation (for `verify`).
    pub fn verify_slot(&self, slot: u32) -> std::result::Result<ChunkHeader, ReadError> {
        let mut hb = [0u8; HEADER_LEN];
        self.file
            .read_exact_at(&mut hb, self.layout.header_offset(slot))
            .map_err(|e| ReadError::Io {
                slot,
                msg: e.to_string(),
            })?;
        let h = ChunkHeader::decode(&hb).map_err(|err| ReadError::Header { slot, err })?;
        let mut buf = vec![0u8; self.layout.chunk_bytes as usize];
        self.read(
            h.key,
            Location {
                place: u64::from(slot),
                generation: h.generation,
            },
            &mut [&mut buf[..]],
        )?;
        Ok(h)
    }
}

/// Reserves the file's blocks so that the bytes it takes on disk are known up front (best
/// effort: a file system without `fallocate` keeps a sparse file, which is smaller).
fn preallocate(file: &File, len: u64) {
    use std::os::fd::AsRawFd;
    #[allow(unsafe_code)]
    // SAFETY: a plain syscall on an open descriptor; no memory is passed.
    let _ = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
}

/// Opens the slab file of `dir` again with `O_DIRECT` and reads its first block into aligned
/// memory; `None` when the file system refuses either (or the name no longer is `file`).
fn probe_direct(dir: &TierDir, file: &File) -> Option<File> {
    let f = dir.reopen(SLAB_FILE, libc::O_DIRECT, file)?;
    let mut buf = vec![0u8; 2 * BLOCK as usize];
    let at = buf.as_ptr().align_offset(BLOCK as usize);
    f.read_exact_at(&mut buf[at..at + BLOCK as usize], 0)
        .ok()
        .map(|()| f)
}
