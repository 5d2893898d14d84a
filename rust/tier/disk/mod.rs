//! The disk tier: a bounded, crash-safe, restart-safe, self-validating slab store of chunks.
//!
//! On disk, one directory per [`Namespace`] (its [`Namespace::dir_name`]) holds one
//! preallocated slab file, [`SLAB_FILE`], of fixed-size slots ([`SlabLayout`]): each slot is a
//! [`BLOCK`]-byte header block (the [`ChunkHeader`]) followed by the chunk's data, rounded up to
//! whole blocks. The file never grows past `slots × slot_bytes ≤ disk_bytes`: the bound holds by
//! construction, whatever the workload.
//!
//! Two halves, for the two sides of an engine (see [`super`]):
//! - [`DiskIndex`] (scheduler side, no I/O): key → slot through the CPU pool's own bookkeeping
//!   ([`Pool`]: LRU/ARC, admission filter, pins, all-or-nothing reservations, events), plus the
//!   generation each slot must hold. [`DiskIndex::recover`] rebuilds it from the headers found by
//!   [`SlabFile::scan`] on every rank: a slot is readable only when every rank committed the same
//!   key and generation in it.
//! - [`SlabFile`] (worker side, the I/O): [`SlabFile::write`] publishes a batch in two phases —
//!   each slot's header block zeroed together with its data (one write), one `fdatasync`,
//!   then the new headers — so a crash at
//!   any point leaves every slot either free, or holding the old chunk's header never over new
//!   data that fails its checksum, or holding the new, complete chunk. [`SlabFile::read`] checks
//!   the header against what the index expects (namespace, key, group, length, generation) and
//!   the data against the header's checksum; anything else is an error, the chunk a miss.
//!   `O_DIRECT` is probed at open and used for every piece that is block-aligned in memory; other
//!   I/O is buffered ([`IoStats`] counts both).
//!
//! [`DiskTier`] puts both halves in one process (simulator, CLI, tests, benches).
//!
//! Why not `foyer` (evaluated first): its hybrid cache owns the index
//! and the I/O in one process behind an async (tokio) API, and rebuilds its index in the
//! process that opens the device. In vLLM the scheduler (which must answer lookups
//! synchronously, in microseconds, and plan which chunk goes where) and the workers (which
//! hold the pool memory, one per tensor-parallel rank, each with its own bytes) are different
//! processes: a foyer instance per worker gives the scheduler no index to look up, and one in
//! the scheduler cannot read or write the workers' pool memory. It also has no notion of "a
//! chunk is readable only when every rank committed it" ([`DiskIndex::recover`]). The missed
//! acceptance points are therefore the scheduler-side lookup (the criterion bench at 10 M
//! slots has no foyer equivalent in the scheduler process) and restart recovery across ranks;
//! no throughput measurement could change that, so none was made.
//!
//! A namespace directory has one owner at a time, never follows a symbolic link and holds
//! owner-only files (`dir.rs`: [`TierDir`]); its layout note is replaced atomically; a clean
//! close makes every acknowledged chunk durable ([`SlabFile::close`]).
//!
//! Files: this one the geometry ([`SlabLayout`]) and the namespaces both sides derive
//! ([`engine_namespace`], [`layout_namespace`]); `dir.rs` the directory; `slab.rs` the worker side, `vio.rs` its vectored I/O (a slot's
//! header block and data in one request) and `batch.rs` its checksums beside the I/O;
//! `scan.rs` the header scan of a restart; `index.rs` the scheduler side; `tier.rs` both in
//! one process; `inspect.rs` what `kvoffload disk inspect|verify` reports.

mod batch;
mod dir;
mod index;
mod inspect;
mod scan;
mod slab;
mod tier;
mod vio;

pub use batch::{ChunkRead, BESIDE_MIN_BYTES};
pub use dir::{TierDir, LOCK_FILE};
pub use index::{write_items, DiskIndex};
pub use inspect::{inspect, NamespaceReport};
pub use scan::{scan_namespace, ScanReport};
pub use slab::{IoSnapshot, IoStats, ReadError, SlabFile, WriteItem};
pub use tier::{DiskOptions, DiskTier};

use super::namespace::Namespace;
use super::Medium;
use crate::error::{Error, Result};
use crate::pool::MAX_CAPACITY;

/// The medium of the disk tier's events.
pub const MEDIUM: Medium = Medium::Disk;
/// Alignment unit of the slab file: header blocks, data offsets and slot sizes are multiples.
pub const BLOCK: u64 = 4096;
/// Name of the slab file inside a namespace directory.
pub const SLAB_FILE: &str = "slab.kvo";
/// Name of the layout note beside the slab file (read by `kvoffload disk inspect`).
pub const LAYOUT_FILE: &str = "layout.txt";
/// What an invalidated (quarantined) slot's header holds: never a valid header.
const QUARANTINE: [u8; 8] = *b"KVQUARAN";

/// Slot geometry of one slab file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlabLayout {
    /// Data bytes of one chunk.
    pub chunk_bytes: u64,
    /// Bytes one slot occupies: one header block plus the data rounded up to [`BLOCK`].
    pub slot_bytes: u64,
    /// Number of slots.
    pub slots: u32,
}

impl SlabLayout {
    /// The largest number of `chunk_bytes` slots that fits in `disk_bytes`.
    pub fn new(chunk_bytes: u64, disk_bytes: u64) -> Result<Self> {
        if chunk_bytes == 0 {
            return Err(Error::Config(
                "disk tier: chunk_bytes must be positive, got 0".into(),
            ));
        }
        let slot_bytes = BLOCK + chunk_bytes.div_ceil(BLOCK) * BLOCK;
        let slots = disk_bytes / slot_bytes;
        if slots == 0 || slots > u64::from(MAX_CAPACITY) {
            return Err(Error::Config(format!(
                "disk_bytes={disk_bytes} holds {slots} slots of {slot_bytes} bytes (a chunk of \
                 {chunk_bytes} bytes and its header block): need 1 to {MAX_CAPACITY} slots"
            )));
        }
        Ok(Self {
            chunk_bytes,
            slot_bytes,
            slots: slots as u32,
        })
    }

    /// Size of the slab file (never above the `disk_bytes` it was made for).
    pub fn file_bytes(&self) -> u64 {
        u64::from(self.slots) * self.slot_bytes
    }

    fn header_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_bytes
    }
}

/// The namespace both sides of an engine derive for group `group` of a lower tier: the
/// scheduler from its configuration (`bytes_per_chunk`), each worker from its registered
/// tensors (the same bytes). `model` names the weights and dtype (the engine's choice). It
/// names a chunk's place (the disk tier's directory, the shared tier's keys); what the chunk's
/// bytes mean is the worker's [`layout_namespace`], which its headers carry.
pub fn engine_namespace(
    model: &str,
    chunk_bytes: u64,
    block_size: u32,
    blocks_per_chunk: u32,
    rank: u32,
    world_size: u32,
    group: u32,
) -> Namespace {
    Namespace {
        model: model.to_string(),
        dtype: String::new(),
        tensor_shapes: vec![vec![chunk_bytes]],
        block_size,
        blocks_per_chunk,
        rank,
        world_size,
        group,
        cache_salt: String::new(),
    }
}

/// The namespace of the bytes a worker writes for `place` ([`engine_namespace`]): the same
/// fields with the element type of its tensors (`dtype`, empty if unknown) and the bytes of one
/// chunk of each registered tensor, in the order they follow each other in a chunk
/// (`tensor_chunk_bytes`). Engines whose chunks have the same size but another split into
/// tensors (2 KV tensors per layer against 1, another number of layers) or another element
/// type get another digest: their headers never verify for each other.
pub fn layout_namespace(place: &Namespace, dtype: &str, tensor_chunk_bytes: &[u64]) -> Namespace {
    Namespace {
        dtype: dtype.to_string(),
        tensor_shapes: tensor_chunk_bytes.iter().map(|&b| vec![b]).collect(),
        ..place.clone()
    }
}
