//! Index and slab file of one namespace in one process (simulator, CLI, tests, benches).

use std::path::PathBuf;

use rustc_hash::FxHashMap;

use super::slab::io_err;
use super::{write_items, DiskIndex, IoSnapshot, SlabFile, SlabLayout};
use crate::error::Result;
use crate::ids::Key;
use crate::policy::PolicyKind;
use crate::tier::namespace::Namespace;
use crate::tier::TierIndex;

/// Index and slab file of one namespace in one process: the whole disk tier for a single
/// worker (simulator, CLI, tests, benches).
#[derive(Debug)]
pub struct DiskTier {
    index: DiskIndex,
    file: SlabFile,
}

/// How to open a [`DiskTier`].
#[derive(Clone, Debug)]
pub struct DiskOptions {
    /// Root directory (namespaces are subdirectories).
    pub root: PathBuf,
    /// Bytes the slab may occupy.
    pub disk_bytes: u64,
    /// Data bytes of one chunk.
    pub chunk_bytes: u64,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Ask for `O_DIRECT`.
    pub direct: bool,
    /// Make every batch durable before its headers.
    pub sync: bool,
}

impl DiskTier {
    /// Opens the namespace's slab under `opts.root`, rebuilding the index from its headers.
    pub fn open(opts: &DiskOptions, ns: &Namespace) -> Result<Self> {
        let layout = SlabLayout::new(opts.chunk_bytes, opts.disk_bytes)?;
        let file = SlabFile::open(&opts.root, ns, layout, opts.direct, opts.sync)?;
        let scan = file
            .scan()
            .map_err(|e| io_err(file.path(), "cannot read headers", &e))?;
        let index = DiskIndex::recover(layout, opts.policy, &[scan])?;
        Ok(Self { index, file })
    }

    /// The index.
    pub fn index(&self) -> &DiskIndex {
        &self.index
    }

    /// The index, mutably.
    pub fn index_mut(&mut self) -> &mut DiskIndex {
        &mut self.index
    }

    /// The slab file.
    pub fn file(&self) -> &SlabFile {
        &self.file
    }

    /// Makes every chunk written durable and releases the directory ([`SlabFile::close`]);
    /// returns the final I/O counters. Dropping the tier does the same, without the result.
    pub fn close(self) -> std::io::Result<IoSnapshot> {
        self.file.close()
    }

    /// Writes chunks `(key, pieces)` (keys already present are skipped) and publishes those
    /// that reached the disk. Returns the keys written, or `None` when there is no room.
    pub fn put(&mut self, chunks: &[(Key, Vec<&[u8]>)]) -> Option<Vec<Key>> {
        let keys: Vec<Key> = chunks.iter().map(|c| c.0).collect();
        let plan = self.index.prepare_write(&keys)?;
        let by_key: FxHashMap<Key, &Vec<&[u8]>> = chunks.iter().map(|c| (c.0, &c.1)).collect();
        let items = write_items(&plan, |k| by_key[&k].clone());
        let results = self.file.write(&items);
        let (ok, failed): (Vec<_>, Vec<_>) =
            plan.keys.iter().zip(results).partition(|(_, r)| r.is_ok());
        let ok: Vec<Key> = ok.into_iter().map(|(k, _)| *k).collect();
        let failed: Vec<Key> = failed.into_iter().map(|(k, _)| *k).collect();
        self.index
            .complete_write(&ok, true)
            .expect("keys reserved above");
        self.index
            .complete_write(&failed, false)
            .expect("keys reserved above");
        Some(ok)
    }

    /// Reads `key` into `pieces` if the tier holds it and it verifies; a chunk that fails
    /// verification is quarantined (index and file) and `false` is returned.
    pub fn get(&mut self, key: Key, pieces: &mut [&mut [u8]]) -> bool {
        if self.index.lookup(&[key]) == 0 {
            return false;
        }
        let Ok(locs) = self.index.prepare_read(&[key]) else {
            return false;
        };
        let r = self.file.read(key, locs[0], pieces);
        let bad: &[Key] = match &r {
            Err(e) if e.is_corrupt() => {
                let _ = self.file.quarantine(locs[0].place as u32);
                &[key]
            }
            _ => &[],
        };
        self.index.complete_read(&[key], bad).expect("pinned above");
        r.is_ok()
    }
}
