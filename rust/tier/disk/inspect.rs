//! `kvoffload disk inspect|verify`: what a tier directory holds, read from its headers, and
//! every fact `verify` cannot vouch for as a problem line.
//!
//! Each namespace directory is read under a shared lock on its lock file ([`DirView`]): while
//! an engine owns it, `inspect` reports a snapshot of its headers and says who holds it, and
//! `verify` reads nothing and reports it as in use (a live writer's half-written batch is no
//! corruption, and no false alarm is raised for it). A problem is: a chunk whose data fails its
//! checksum, a header that does not decode (never written so by the tier), a slab holding
//! headers but no readable layout note (the chunks cannot be attributed), a path the tier would
//! refuse (a symbolic link, a file that is not ours), and, for `verify`, a directory in use.
//! Quarantine marks (bad chunks the tier already invalidated) and chunks of another namespace
//! (left by an engine with another layout) are counted, not problems: the tier serves neither.

use std::path::{Path, PathBuf};

use super::dir::DirView;
use super::scan::{parse_note, scan_file};
use super::slab::io_err;
use super::{IoStats, ReadError, SlabFile, SlabLayout, BLOCK, LAYOUT_FILE, SLAB_FILE};
use crate::error::{Error, Result};
use crate::tier::header::{ChunkHeader, HeaderError, HEADER_LEN};

/// What `kvoffload disk inspect` / `verify` report about one namespace directory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceReport {
    /// The directory.
    pub dir: PathBuf,
    /// Namespace digest (from the layout note; 0 without one).
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
    /// Slots the tier quarantined, and slots holding chunks of another namespace.
    pub quarantined: u32,
    /// Headers that do not decode (a problem).
    pub bad_headers: u32,
    /// Size of the slab file.
    pub file_bytes: u64,
    /// Bytes the slab file occupies on disk.
    pub disk_bytes: u64,
    /// `verify` only: chunks whose data matched their checksum.
    pub verified: u32,
    /// `verify` only: chunks whose data did not.
    pub corrupt: u32,
    /// Who holds the directory while it was read (`None`: nobody).
    pub in_use: Option<String>,
    /// One line per fact `verify` cannot vouch for (empty: all is well).
    pub problems: Vec<String>,
}

/// Reports every namespace directory under `root`, read-only; with `verify`, every committed
/// chunk's data is read and checked against its checksum. `Err` only when `root` itself cannot
/// be read; everything wrong inside it is a problem line of its directory's report.
pub fn inspect(root: &Path, verify: bool) -> Result<Vec<NamespaceReport>> {
    let entries = std::fs::read_dir(root).map_err(|e| io_err(root, "cannot list", &e))?;
    let mut dirs: Vec<(PathBuf, bool)> = entries
        .filter_map(std::result::Result::ok)
        .filter_map(|e| {
            let t = e.file_type().ok()?;
            (t.is_dir() || t.is_symlink()).then(|| (e.path(), t.is_symlink()))
        })
        .collect();
    dirs.sort();
    let mut out = Vec::new();
    for (dir, link) in dirs {
        let mut rep = NamespaceReport {
            dir: dir.clone(),
            ..NamespaceReport::default()
        };
        if link {
            rep.problems.push(format!(
                "{}: a symbolic link in the tier's directory (never followed)",
                dir.display()
            ));
            out.push(rep);
            continue;
        }
        match inspect_dir(&dir, verify, &mut rep) {
            Ok(true) => out.push(rep),
            Ok(false) => {}
            Err(e) => {
                rep.problems.push(e.to_string());
                out.push(rep);
            }
        }
    }
    Ok(out)
}

/// Fills `rep` for the namespace directory `dir`; `Ok(false)` when it holds no slab.
fn inspect_dir(dir: &Path, verify: bool, rep: &mut NamespaceReport) -> Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let Some(view) = DirView::at(dir)? else {
        return Ok(false);
    };
    let _shared = match view.reader_lock()? {
        Ok(guard) => guard,
        Err(holder) => {
            if verify {
                rep.problems.push(format!(
                    "{}: in use by {holder}; not verified (stop its engine, then verify)",
                    dir.display()
                ));
            }
            rep.in_use = Some(holder);
            None
        }
    };
    let path = dir.join(SLAB_FILE);
    let Some(file) = view.open_file(SLAB_FILE)? else {
        return Ok(false);
    };
    let md = file
        .metadata()
        .map_err(|e| io_err(&path, "cannot stat", &e))?;
    rep.file_bytes = md.len();
    rep.disk_bytes = md.blocks() * 512;
    let meta = dir.join(LAYOUT_FILE);
    let note = view
        .read(LAYOUT_FILE)?
        .map(|t| String::from_utf8_lossy(&t).into_owned());
    let Some(n) = note.as_deref().and_then(parse_note) else {
        let headers =
            count_headers(&file, md.len()).map_err(|e| io_err(&path, "cannot read headers", &e))?;
        rep.chunks = headers;
        if headers > 0 {
            rep.problems.push(format!(
                "{}: {headers} chunk headers but {}: cannot attribute them",
                path.display(),
                match note {
                    None => format!("no layout note ({})", meta.display()),
                    Some(t) => format!("an unreadable layout note {t:?} ({})", meta.display()),
                }
            ));
        }
        return Ok(true);
    };
    let slot_bytes = BLOCK + n.chunk_bytes.div_ceil(BLOCK) * BLOCK;
    let layout = SlabLayout {
        chunk_bytes: n.chunk_bytes,
        slot_bytes,
        slots: (md.len() / slot_bytes).min(u64::from(n.slots)) as u32,
    };
    let scan = scan_file(&file, layout, n.namespace, n.group)
        .map_err(|e| io_err(&path, "cannot read headers", &e))?;
    rep.namespace = n.namespace;
    rep.group = n.group;
    rep.chunk_bytes = n.chunk_bytes;
    rep.slots = n.slots;
    rep.chunks = scan.chunks.len() as u32;
    rep.free = scan.free + (n.slots - layout.slots);
    rep.quarantined = scan.marked + scan.foreign;
    rep.bad_headers = scan.broken;
    if scan.broken > 0 && rep.in_use.is_none() {
        rep.problems.push(format!(
            "{}: {} slot headers do not decode (a flipped bit or a foreign write)",
            path.display(),
            scan.broken
        ));
    }
    if verify && rep.in_use.is_none() {
        let slab = SlabFile {
            path: path.clone(),
            file,
            direct: None,
            layout,
            namespace: n.namespace,
            group: n.group,
            sync: false,
            stats: IoStats::default(),
            zeros: super::vio::AlignedBlock::new(),
            owner: None,
        };
        for &(slot, _, _) in &scan.chunks {
            match slab.verify_slot(slot) {
                Ok(_) => rep.verified += 1,
                Err(ReadError::Io { msg, .. }) => {
                    return Err(Error::Io(format!("{}: slot {slot}: {msg}", path.display())))
                }
                Err(e) => {
                    rep.corrupt += 1;
                    rep.problems
                        .push(format!("{}: corrupt chunk: {e}", path.display()));
                }
            }
        }
    }
    Ok(true)
}

/// Headers that decode, at every [`BLOCK`] of a slab of `len` bytes whose layout is unknown.
fn count_headers(file: &std::fs::File, len: u64) -> std::io::Result<u32> {
    use std::os::unix::fs::FileExt;
    let mut hb = [0u8; HEADER_LEN];
    let mut n = 0;
    for at in (0..len / BLOCK).map(|b| b * BLOCK) {
        file.read_exact_at(&mut hb, at)?;
        if !matches!(
            ChunkHeader::decode(&hb),
            Err(HeaderError::Empty | HeaderError::Magic)
        ) {
            n += 1;
        }
    }
    Ok(n)
}
