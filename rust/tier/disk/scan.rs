//! The header scan a restart starts from: every slot's header read, committed chunks of the
//! namespace and group kept, free and bad slots counted.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::slab::io_err;
use super::{SlabLayout, SLAB_FILE};
use crate::error::Result;
use crate::ids::Key;
use crate::tier::header::{ChunkHeader, HeaderError, HEADER_LEN};
use crate::tier::namespace::Namespace;

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
