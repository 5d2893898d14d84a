//! `kvoffload disk inspect|verify`: what a tier directory holds, read from its headers.

use std::fs::File;
use std::path::{Path, PathBuf};

use rustc_hash::FxHashMap;

use super::scan::scan_file;
use super::slab::io_err;
use super::{IoStats, ReadError, SlabFile, SlabLayout, BLOCK, LAYOUT_FILE, SLAB_FILE};
use crate::error::{Error, Result};

/// What `kvoffload disk inspect` / `verify` report about one namespace directory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceReport {
    /// The directory.
    pub dir: PathBuf,
    /// Namespace digest (from the layout note).
    pub namespace: u128,
    /// KV group.
    pub group: u32,
    /// Data bytes per chunk.
    pub chunk_bytes: u64,
    /// Slots of the slab.
    pub slots: u32,
    /// Committed chunks (headers of this namespace).
    pub chunks: u32,
    /// Free slots.
    pub free: u32,
    /// Quarantined, foreign or undecodable headers.
    pub quarantined: u32,
    /// Size of the slab file.
    pub file_bytes: u64,
    /// Bytes the slab file occupies on disk.
    pub disk_bytes: u64,
    /// `verify` only: chunks whose data matched their checksum.
    pub verified: u32,
    /// `verify` only: chunks whose data did not.
    pub corrupt: u32,
}

fn parse_layout(text: &str) -> Option<(u64, u32, u128, u32)> {
    let mut f = FxHashMap::default();
    for kv in text.split_whitespace() {
        let (k, v) = kv.split_once('=')?;
        f.insert(k, v);
    }
    Some((
        f.get("chunk_bytes")?.parse().ok()?,
        f.get("slots")?.parse().ok()?,
        u128::from_str_radix(f.get("namespace")?, 16).ok()?,
        f.get("group")?.parse().ok()?,
    ))
}

/// Reports every namespace directory under `root`, read-only; with `verify`, every committed
/// chunk's data is read and checked against its checksum.
pub fn inspect(root: &Path, verify: bool) -> Result<Vec<NamespaceReport>> {
    use std::os::unix::fs::MetadataExt;
    let entries = std::fs::read_dir(root).map_err(|e| io_err(root, "cannot list", &e))?;
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(std::result::Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join(SLAB_FILE).is_file() && p.join(LAYOUT_FILE).is_file())
        .collect();
    dirs.sort();
    let mut out = Vec::new();
    for dir in dirs {
        let meta = dir.join(LAYOUT_FILE);
        let text = std::fs::read_to_string(&meta).map_err(|e| io_err(&meta, "cannot read", &e))?;
        let (chunk_bytes, slots, namespace, group) = parse_layout(&text).ok_or_else(|| {
            Error::Config(format!(
                "{}: unreadable layout note {text:?}",
                meta.display()
            ))
        })?;
        let path = dir.join(SLAB_FILE);
        let file = File::open(&path).map_err(|e| io_err(&path, "cannot open", &e))?;
        let md = file
            .metadata()
            .map_err(|e| io_err(&path, "cannot stat", &e))?;
        let slot_bytes = BLOCK + chunk_bytes.div_ceil(BLOCK) * BLOCK;
        let layout = SlabLayout {
            chunk_bytes,
            slot_bytes,
            slots: (md.len() / slot_bytes).min(u64::from(slots)) as u32,
        };
        let scan = scan_file(&file, layout, namespace, group)
            .map_err(|e| io_err(&path, "cannot read headers", &e))?;
        let mut rep = NamespaceReport {
            dir: dir.clone(),
            namespace,
            group,
            chunk_bytes,
            slots,
            chunks: scan.chunks.len() as u32,
            free: scan.free + (slots - layout.slots),
            quarantined: scan.bad,
            file_bytes: md.len(),
            disk_bytes: md.blocks() * 512,
            ..NamespaceReport::default()
        };
        if verify {
            let slab = SlabFile {
                path: path.clone(),
                file,
                direct: None,
                layout,
                namespace,
                group,
                sync: false,
                stats: IoStats::default(),
                zeros: super::vio::AlignedBlock::new(),
            };
            for &(slot, _, _) in &scan.chunks {
                match slab.verify_slot(slot) {
                    Ok(_) => rep.verified += 1,
                    Err(ReadError::Io { msg, .. }) => {
                        return Err(Error::Config(format!(
                            "{}: slot {slot}: {msg}",
                            path.display()
                        )))
                    }
                    Err(_) => rep.corrupt += 1,
                }
            }
        }
        out.push(rep);
    }
    Ok(out)
}
