//! The header scan a restart starts from: every slot's header read, committed chunks of the
//! namespace and group kept, free and bad slots counted (quarantine marks, chunks of another
//! namespace, headers that do not decode, apart).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::dir::DirView;
use super::slab::io_err;
use super::{SlabLayout, LAYOUT_FILE, QUARANTINE, SLAB_FILE};
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
    /// Slots holding a quarantine mark, a foreign or undecodable header (the sum of the next
    /// three).
    pub bad: u32,
    /// Slots the tier quarantined (found bad and invalidated).
    pub marked: u32,
    /// Slots holding a valid header of another namespace, group or chunk size.
    pub foreign: u32,
    /// Slots whose header does not decode (a flipped bit, another format): never written so
    /// by this tier, whose headers are whole or zero.
    pub broken: u32,
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
            Ok(_) => rep.foreign += 1,
            Err(_) if hb[..QUARANTINE.len()] == QUARANTINE => rep.marked += 1,
            Err(_) => rep.broken += 1,
        }
    }
    rep.bad = rep.marked + rep.foreign + rep.broken;
    Ok(rep)
}

/// Scans the slab file of `ns` under `root` read-only (the scheduler's view of a rank's file),
/// never through a link; a missing directory or file is an empty tier. Chunks count when their
/// headers carry the namespace digest the directory's layout note names (the one its worker
/// writes: the whole layout of its tensors, which the scheduler does not know), or `ns`'s own
/// digest when there is no readable note.
pub fn scan_namespace(root: &Path, ns: &Namespace, layout: SlabLayout) -> Result<ScanReport> {
    let Some(dir) = DirView::open(root, &ns.dir_name())? else {
        return Ok(ScanReport::default());
    };
    let path = dir.path().join(SLAB_FILE);
    let Some(file) = dir.open_file(SLAB_FILE)? else {
        return Ok(ScanReport::default());
    };
    let digest = dir
        .read(LAYOUT_FILE)?
        .and_then(|t| parse_note(&String::from_utf8_lossy(&t)))
        .filter(|n| n.chunk_bytes == layout.chunk_bytes && n.group == ns.group)
        .map_or_else(|| ns.digest(), |n| n.namespace);
    let len = file
        .metadata()
        .map_err(|e| io_err(&path, "cannot stat", &e))?
        .len();
    // Slots past the end of a shorter (truncated) file are free.
    let present = SlabLayout {
        slots: (len / layout.slot_bytes).min(u64::from(layout.slots)) as u32,
        ..layout
    };
    let mut rep = scan_file(&file, present, digest, ns.group)
        .map_err(|e| io_err(&path, "cannot read headers", &e))?;
    rep.free += layout.slots - present.slots;
    Ok(rep)
}

/// What a layout note says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Note {
    /// Data bytes per chunk.
    pub chunk_bytes: u64,
    /// Slots of the slab.
    pub slots: u32,
    /// Namespace digest every header carries.
    pub namespace: u128,
    /// KV group.
    pub group: u32,
}

/// Parses a layout note (`None`: not one).
pub(super) fn parse_note(text: &str) -> Option<Note> {
    let mut f = rustc_hash::FxHashMap::default();
    for kv in text.split_whitespace() {
        let (k, v) = kv.split_once('=')?;
        f.insert(k, v);
    }
    Some(Note {
        chunk_bytes: f.get("chunk_bytes")?.parse().ok()?,
        slots: f.get("slots")?.parse().ok()?,
        namespace: u128::from_str_radix(f.get("namespace")?, 16).ok()?,
        group: f.get("group")?.parse().ok()?,
    })
}
