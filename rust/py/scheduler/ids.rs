//! Request ids resolved by object identity: vLLM hands `schedule_batch` the same `str` objects
//! every step (`cached.req_ids` holds the requests' own `request_id`), in nearly the same order
//! (its running list: new requests appended, finished ones removed). Resolving 512 ids by
//! hashing and comparing their strings costs several cache misses each (the map, the key, the
//! string), since vLLM's own work evicts everything between two steps.
//!
//! [`IdCache`] keeps the previous step's scheduled ids as `(address, id, handle)` in order, the
//! id holding a strong reference to its `str`, so no other object can live at a kept address;
//! a `str`'s content never changes (a subclass's neither), so a kept object names the same
//! request id as when it was resolved. A step takes the kept ids ([`IdCache::take`]) and finds
//! each of its ids by comparing the addresses in the item array with those a few entries ahead
//! of a cursor ([`match_items`]): a sequential scan of two arrays, and a found id is moved over
//! as it is, so the `str` objects themselves are not touched. The handle is then checked
//! against the slab's owner id ([`Core::resolved_as`]): a request released (and perhaps
//! registered again under the same id) falls back to the id lookup, so the cache is never
//! wrong, only sometimes slower. The step's scheduled ids are kept for the next one
//! ([`IdCache::put`]).

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;

use super::super::convert;
use super::super::engine::Items;
use crate::scheduler::{RequestHandle, Resolved, Scheduler as Core};

/// How many entries past the cursor an id is looked for (vLLM drops the requests that
/// finished from its running list: a few per step).
const LOOKAHEAD: usize = 8;

/// A kept id: its `str` object's address, the id (holding the object), its handle.
pub(super) struct Kept {
    ptr: usize,
    id: PyBackedStr,
    handle: RequestHandle,
}

/// The previous step's scheduled ids (see the module doc); `None`: taken by this step.
pub(super) type KeptIds = Vec<Option<Kept>>;

/// The previous step's scheduled ids (see the module doc).
#[derive(Default)]
pub(super) struct IdCache {
    kept: KeptIds,
}

impl IdCache {
    /// The kept ids, for one step to match its ids against.
    pub(super) fn take(&mut self) -> KeptIds {
        std::mem::take(&mut self.kept)
    }

    /// Keeps `ids`; returns what was kept, to be dropped once no lock is held (dropping a
    /// `str` subclass may run Python code).
    pub(super) fn put(&mut self, ids: KeptIds) -> KeptIds {
        std::mem::replace(&mut self.kept, ids)
    }
}

/// A scheduled id before it is resolved: its object's address, the id, and the handle kept
/// for that object by the previous step, if any.
pub(super) struct Named {
    pub ptr: usize,
    pub id: PyBackedStr,
    kept: Option<RequestHandle>,
}

impl Named {
    /// An id not matched against the kept ones.
    pub(super) fn new(id: PyBackedStr, ptr: usize) -> Self {
        Self {
            ptr,
            id,
            kept: None,
        }
    }
}

/// The items of `obj` (a sequence of request ids, `what` in messages) as [`Named`] ids: an
/// object kept in `old` moves over with its handle; any other is converted.
pub(super) fn match_items(
    obj: &Bound<'_, PyAny>,
    what: &str,
    old: &mut KeptIds,
    out: &mut Vec<Named>,
) -> PyResult<()> {
    let Some(items) = Items::of(obj) else {
        // Any other iterable: converted item by item.
        for (i, item) in convert::items(
            obj,
            what,
            "a sequence of request ids (str)",
            super::super::errors::StepInputError::new_err,
        )?
        .into_iter()
        .enumerate()
        {
            let ptr = item.as_ptr() as usize;
            let id = convert::request_id_owned(item, || format!("{what}[{i}]"))?;
            out.push(Named::new(id, ptr));
        }
        return Ok(());
    };
    // No Python code runs in this loop but for an error's message, after which nothing is
    // read: the length and the borrowed items hold throughout.
    let n = items.len();
    out.reserve(n);
    let mut cursor = 0;
    for i in 0..n {
        let ptr = items.get(i) as usize;
        let end = old.len().min(cursor + LOOKAHEAD);
        let hit = (cursor..end).find(|&j| old[j].as_ref().is_some_and(|k| k.ptr == ptr));
        if let Some(kept) = hit.and_then(|j| {
            cursor = j + 1;
            old[j].take()
        }) {
            out.push(Named {
                ptr,
                id: kept.id,
                kept: Some(kept.handle),
            });
            continue;
        }
        // SAFETY: item `i < n` of the sequence, live; owned from here on.
        #[allow(unsafe_code)]
        let item = unsafe { Bound::from_borrowed_ptr(obj.py(), items.get(i)) };
        let id = convert::request_id_owned(item, || format!("{what}[{i}]"))?;
        out.push(Named::new(id, ptr));
    }
    Ok(())
}

/// `named` resolved in order into `ids` (under the core lock): by the kept handle where there
/// is one, else by the id; the records of kept handles a few ids ahead are prefetched (they
/// are cold: vLLM ran in between), so their misses overlap.
pub(super) fn resolve_named(
    core: &Core,
    named: Vec<Named>,
    ids: &mut Vec<Resolved<PyBackedStr>>,
    ptrs: &mut Vec<usize>,
) {
    let mut it = named.into_iter();
    while let Some(n) = it.next() {
        if let Some(h) = it.as_slice().get(LOOKAHEAD).and_then(|a| a.kept) {
            core.warm(h);
        }
        ptrs.push(n.ptr);
        ids.push(match n.kept {
            Some(h) => core.resolved_as(n.id, h),
            None => core.resolved(n.id),
        });
    }
}

/// The scheduled ids of a step (with their objects' addresses) as the ids to keep, in `into`
/// (emptied first; its room is reused): the resolved ones.
pub(super) fn keep(
    ids: impl Iterator<Item = Resolved<PyBackedStr>>,
    ptrs: &[usize],
    into: &mut KeptIds,
) {
    into.clear();
    into.extend(ids.zip(ptrs).filter_map(|(r, &ptr)| {
        let (id, handle) = r.into_parts();
        handle.map(|handle| Some(Kept { ptr, id, handle }))
    }));
}
