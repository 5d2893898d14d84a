//! Request ids resolved by object identity: vLLM hands `schedule_batch` the same `str` objects
//! every step (`cached.req_ids` holds the requests' own `request_id`), in nearly the same order
//! (its running list: new requests appended, finished ones removed). Resolving 512 ids by
//! hashing and comparing their strings costs several cache misses each (the map, the key, the
//! string), since vLLM's own work evicts everything between two steps.
//!
//! [`IdCache`] keeps the previous step's scheduled ids as `(str object, handle)` in order and
//! finds each id of this step by comparing addresses a few entries ahead of a cursor: a
//! sequential scan of one array. It holds a strong reference to every `str` it keeps, so no
//! other object can live at a kept address; a `str`'s content never changes (a subclass's
//! neither), so a kept object names the same request id as when it was resolved. The handle is
//! then checked against the slab's owner id ([`Core::resolved_as`]): a request released (and
//! perhaps registered again under the same id) falls back to the id lookup, so the cache is
//! never wrong, only sometimes slower. The cache is rebuilt from every step's scheduled ids.

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;

use crate::scheduler::{RequestHandle, Resolved, Scheduler as Core};

/// How many entries past the cursor an id is looked for (vLLM drops the requests that
/// finished from its running list: a few per step).
const LOOKAHEAD: usize = 8;

/// The previous step's scheduled ids (see the module doc).
#[derive(Default)]
pub(super) struct IdCache {
    kept: Vec<(Py<PyAny>, RequestHandle)>,
}

/// One step's resolution through the cache: its cursor into the kept ids, and this step's
/// entries, which replace them ([`IdCache::replace`]).
pub(super) struct Pass<'c> {
    cache: &'c IdCache,
    cursor: usize,
    next: Vec<(Py<PyAny>, RequestHandle)>,
}

impl IdCache {
    /// A pass over this step's scheduled ids, `n` of them.
    pub(super) fn pass(&self, n: usize) -> Pass<'_> {
        Pass {
            cache: self,
            cursor: 0,
            next: Vec::with_capacity(n),
        }
    }

    /// Keeps `pass`'s entries; returns the previous ones, to be dropped once no lock is held
    /// (dropping a `str` subclass may run Python code).
    pub(super) fn replace(
        &mut self,
        next: Vec<(Py<PyAny>, RequestHandle)>,
    ) -> Vec<(Py<PyAny>, RequestHandle)> {
        std::mem::replace(&mut self.kept, next)
    }
}

impl Pass<'_> {
    /// `id` (whose object is `obj`) resolved: by a kept handle where `obj` is a kept object,
    /// else by the id. A resolved id is kept for the next step.
    pub(super) fn resolve(
        &mut self,
        core: &Core,
        obj: &Bound<'_, PyAny>,
        id: PyBackedStr,
    ) -> Resolved<PyBackedStr> {
        let kept = &self.cache.kept;
        let end = kept.len().min(self.cursor + LOOKAHEAD);
        let hit = (self.cursor..end).find(|&j| kept[j].0.as_ptr() == obj.as_ptr());
        let resolved = match hit {
            Some(j) => {
                self.cursor = j + 1;
                // The records are cold (vLLM ran in between): fetch one a few ids ahead, so
                // its miss overlaps this step's work.
                if let Some(ahead) = kept.get(j + LOOKAHEAD) {
                    core.warm(ahead.1);
                }
                core.resolved_as(id, kept[j].1)
            }
            None => core.resolved(id),
        };
        if let Some(h) = resolved.resolved_handle() {
            self.next.push((obj.clone().unbind(), h));
        }
        resolved
    }

    /// This step's entries.
    pub(super) fn into_entries(self) -> Vec<(Py<PyAny>, RequestHandle)> {
        self.next
    }
}
