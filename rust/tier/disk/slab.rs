//! The worker side of the disk tier: the slab file of one namespace (two-phase publish,
//! checked reads, quarantine, `O_DIRECT` probe) and the header scan a restart starts from.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

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

/// What a header scan found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Committed headers of this namespace and group: `(slot, key, generation)`.
    pub chunks: Vec<(u32, Key, u64)>,
    /// Slots with no chunk (never written, or a write that never committed).
    pub free: u32,
    /// Slots holding a quarantine mark, a foreign or undecodable header.
    pub bad: u32,
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
    /// Two blocks of zeros, one of them block-aligned ([`SlabFile::zero_block`]).
    pub(super) zeros: Vec<u8>,
}

pub(super) fn io_err(path: &Path, what: &str, e: &io::Error) -> Error {
    Error::Config(format!("disk tier {}: {what}: {e}", path.display()))
}

fn aligned(p: &[u8]) -> bool {
    (p.as_ptr() as usize) % BLOCK as usize == 0 && p.len() as u64 % BLOCK == 0
}

impl SlabFile {
    /// Opens (creating and preallocating if needed) the slab file of `ns` under `root`, sized
    /// for `layout`. A file of another size is resized to the layout: slots past the new end
    /// are gone, new slots are free. `direct` asks for `O_DIRECT` where the file system allows
    /// it; `sync` makes every batch durable before its headers are written.
    pub fn open(
        root: &Path,
        ns: &Namespace,
        layout: SlabLayout,
        direct: bool,
        sync: bool,
    ) -> Result<Self> {
        let dir = root.join(ns.dir_name());
        std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, "cannot create", &e))?;
        let path = dir.join(SLAB_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io_err(&path, "cannot open", &e))?;
        let want = layout.file_bytes();
        let len = file
            .metadata()
            .map_err(|e| io_err(&path, "cannot stat", &e))?
            .len();
        if len != want {
            file.set_len(want)
                .map_err(|e| io_err(&path, "cannot size", &e))?;
        }
        preallocate(&file, want);
        let meta = dir.join(LAYOUT_FILE);
        std::fs::write(
            &meta,
            format!(
                "chunk_bytes={} slots={} namespace={:032x} group={}\n",
                layout.chunk_bytes,
                layout.slots,
                ns.digest(),
                ns.group
            ),
        )
        .map_err(|e| io_err(&meta, "cannot write", &e))?;
        let direct = if direct { probe_direct(&path) } else { None };
        Ok(Self {
            path,
            file,
            direct,
            layout,
            namespace: ns.digest(),
            group: ns.group,
            sync,
            stats: IoStats::default(),
            zeros: vec![0; 2 * BLOCK as usize],
        })
    }

    /// A block-aligned block of zeros (written over a slot's header block with its data).
    fn zero_block(&self) -> &[u8] {
        let at = self.zeros.as_ptr().align_offset(BLOCK as usize);
        &self.zeros[at..at + BLOCK as usize]
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

    fn write_data(&self, mut offset: u64, pieces: &[&[u8]]) -> io::Result<()> {
        let direct = self
            .direct
            .as_ref()
            .filter(|_| pieces.iter().all(|p| aligned(p)));
        let f = direct.unwrap_or(&self.file);
        for p in pieces {
            f.write_all_at(p, offset)?;
            offset += p.len() as u64;
        }
        self.count_pieces(direct.is_some(), pieces.len());
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
        let mut results: Vec<io::Result<u32>> = items
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
                Ok(0)
            })
            .collect();
        // Phase 1: each slot's header block zeroed (no old header may stand over new data)
        // and its data, in one write; then one barrier for the whole batch. The checksum is
        // computed on this I/O thread (a second thread would take a core from the engine).
        for (it, r) in items.iter().zip(&mut results) {
            if r.is_ok() {
                let crc = checksum(it.pieces.iter().copied());
                let mut pieces = Vec::with_capacity(it.pieces.len() + 1);
                pieces.push(self.zero_block());
                pieces.extend_from_slice(&it.pieces);
                *r = self
                    .write_data(self.layout.header_offset(it.slot), &pieces)
                    .map(|()| crc);
            }
        }
        if self.sync && results.iter().any(Result::is_ok) {
            let synced = self.file.sync_data();
            if let Err(e) = synced {
                for r in &mut results {
                    if r.is_ok() {
                        *r = Err(io::Error::new(e.kind(), e.to_string()));
                    }
                }
            }
        }
        // Phase 2: the headers that make the chunks visible.
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
                self.file
                    .write_all_at(&h.encode(), self.layout.header_offset(it.slot))
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
        #[cfg(feature = "fault-injection")]
        crate::tier::fault::before_read(self.path());
        let r = self.read_inner(key, loc, pieces);
        let counter = if r.is_ok() {
            self.stats
                .bytes_read
                .fetch_add(self.layout.chunk_bytes, Ordering::Relaxed);
            &self.stats.chunks_read
        } else {
            &self.stats.read_failures
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.stats
            .read_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    fn read_inner(
        &self,
        key: Key,
        loc: Location,
        pieces: &mut [&mut [u8]],
    ) -> std::result::Result<(), ReadError> {
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
        let mut hb = [0u8; HEADER_LEN];
        self.file
            .read_exact_at(&mut hb, self.layout.header_offset(slot))
            .map_err(io)?;
        let h = ChunkHeader::decode(&hb).map_err(|err| ReadError::Header { slot, err })?;
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
        let direct = self
            .direct
            .as_ref()
            .filter(|_| pieces.iter().all(|p| aligned(p)));
        let f = direct.unwrap_or(&self.file);
        let mut offset = self.layout.data_offset(slot);
        for p in pieces.iter_mut() {
            f.read_exact_at(p, offset).map_err(io)?;
            offset += p.len() as u64;
        }
        self.count_pieces(direct.is_some(), pieces.len());
        let found = checksum(pieces.iter().map(|p| &**p));
        if found != h.checksum {
            return Err(ReadError::Checksum {
                slot,
                found,
                expected: h.checksum,
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

/// Opens `path` with `O_DIRECT` and reads its first block into aligned memory; `None` when the
/// file system refuses either.
fn probe_direct(path: &Path) -> Option<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()?;
    let mut buf = vec![0u8; 2 * BLOCK as usize];
    let at = buf.as_ptr().align_offset(BLOCK as usize);
    f.read_exact_at(&mut buf[at..at + BLOCK as usize], 0)
        .ok()
        .map(|()| f)
}

/// Headers of every slot of a slab file, read in large sequential batches.
pub(super) fn scan_file(
    file: &File,
    layout: SlabLayout,
    namespace: u128,
    group: u32,
) -> io::Result<ScanReport> {
    let mut rep = ScanReport::default();
    let mut hb = [0u8; HEADER_LEN];
    for slot in 0..layout.slots {
        file.read_exact_at(&mut hb, layout.header_offset(slot))?;
        match ChunkHeader::decode(&hb) {
            Err(HeaderError::Empty) => rep.free += 1,
            Ok(h)
                if h.namespace == namespace
                    && h.group == group
                    && h.length == layout.chunk_bytes =>
            {
                rep.chunks.push((slot, h.key, h.generation));
            }
            _ => rep.bad += 1,
        }
    }
    Ok(rep)
}

/// Scans the slab file of `ns` under `root` read-only (the scheduler's view of a rank's file);
/// a missing file is an empty tier.
pub fn scan_namespace(root: &Path, ns: &Namespace, layout: SlabLayout) -> Result<ScanReport> {
    let path = root.join(ns.dir_name()).join(SLAB_FILE);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ScanReport::default()),
        Err(e) => return Err(io_err(&path, "cannot open", &e)),
    };
    let len = file
        .metadata()
        .map_err(|e| io_err(&path, "cannot stat", &e))?
        .len();
    // Slots past the end of a shorter (truncated) file are free.
    let present = SlabLayout {
        slots: (len / layout.slot_bytes).min(u64::from(layout.slots)) as u32,
        ..layout
    };
    let mut rep = scan_file(&file, present, ns.digest(), ns.group)
        .map_err(|e| io_err(&path, "cannot read headers", &e))?;
    rep.free += layout.slots - present.slots;
    Ok(rep)
}
