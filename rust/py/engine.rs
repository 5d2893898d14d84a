//! The engine's own per-request sequences, read in place: vLLM's block hashes (`bytes`) and its
//! block tables (`KVCacheBlock` objects). A 6k-token prompt has ~375 of each, and every new
//! request hands both over (`sync_request`, `lookup_request`, `allocate`).
//!
//! Both reads are bound by memory latency, not by work: the items are separate objects spread
//! over the engine's heap (a block's `block_id` is one more object, an `int` allocated when the
//! engine built its block pool), and vLLM's scheduler evicts them from the caches between our
//! calls. Read one after the other, each item costs a cache miss or two in turn. The readers
//! here walk the item array with prefetches [`AHEAD`] items in front (for blocks in two
//! stages: the block object, then the `int` its slot points to), so those misses overlap.
//! Every item that is not of the expected shape takes the general conversion, with its error.

use std::fmt::Display;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyTuple, PyType};

use super::convert::{block_error, block_named, describe, for_each_item, key_named};
use super::errors::InvalidKeyError;
use crate::ids::{BlockId, Key};
use crate::prefetch::prefetch_ptr as prefetch;

/// How many items ahead of the one being read the readers prefetch (at ~100 ns a miss and a
/// few ns an item, far enough for the misses to overlap; near enough to stay in L1).
const AHEAD: usize = 16;

/// A list's or a tuple's item array, read without reference counting.
#[derive(Clone, Copy)]
pub struct Items {
    seq: *mut ffi::PyObject,
    is_list: bool,
}

#[allow(unsafe_code)]
impl Items {
    /// `obj`'s items if it is a list or a tuple (subclasses included, as `cast` takes them).
    pub fn of(obj: &Bound<'_, PyAny>) -> Option<Self> {
        let is_list = obj.cast::<PyList>().is_ok();
        (is_list || obj.cast::<PyTuple>().is_ok()).then(|| Self {
            seq: obj.as_ptr(),
            is_list,
        })
    }

    /// The current length (read again after anything that may have run Python code).
    pub fn len(self) -> usize {
        // SAFETY: `seq` is a live list or tuple (held by the caller's `Bound`), GIL attached.
        unsafe {
            if self.is_list {
                ffi::PyList_GET_SIZE(self.seq)
            } else {
                ffi::PyTuple_GET_SIZE(self.seq)
            }
        }
        .unsigned_abs()
    }

    /// Asks for the line of the item array holding item `i` (if there is one), ahead of a read
    /// from `i` on; changes nothing.
    pub fn prefetch_from(self, i: usize) {
        if i < self.len() {
            // SAFETY: as in `get`: the address of item `i < len`, not read here.
            prefetch(unsafe { self.item_ptr(i) }.cast());
        }
    }

    /// The address of item `i < self.len()` in the item array.
    unsafe fn item_ptr(self, i: usize) -> *const *mut ffi::PyObject {
        let base = if self.is_list {
            (*self.seq.cast::<ffi::PyListObject>()).ob_item.cast_const()
        } else {
            (*self.seq.cast::<ffi::PyTupleObject>()).ob_item.as_ptr()
        };
        base.add(i)
    }

    /// Item `i < self.len()`, borrowed: valid only until Python code may run.
    pub fn get(self, i: usize) -> *mut ffi::PyObject {
        // SAFETY: as in `len`, and `i` is below the length just read.
        unsafe {
            if self.is_list {
                ffi::PyList_GET_ITEM(self.seq, i as ffi::Py_ssize_t)
            } else {
                ffi::PyTuple_GET_ITEM(self.seq, i as ffi::Py_ssize_t)
            }
        }
    }
}

/// The items of a list or a tuple as owned references (`None` for anything else), each object
/// prefetched [`AHEAD`] items before it is taken: the engine's per-request sequences (ids,
/// token counts) are objects spread over its heap, and taking a reference touches each one.
pub fn items_prefetched<'py>(obj: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    let items = Items::of(obj)?;
    // Taking references runs no Python code: the length holds for the whole loop.
    let n = items.len();
    for i in 0..AHEAD.min(n) {
        prefetch_object(items.get(i));
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if i + AHEAD < n {
            prefetch_object(items.get(i + AHEAD));
        }
        // SAFETY: item `i < n` of the sequence, live; owned from here on.
        #[allow(unsafe_code)]
        out.push(unsafe { Bound::from_borrowed_ptr(obj.py(), items.get(i)) });
    }
    Some(out)
}

/// Extracts one engine hash as the engine publishes it: `bytes` become the integer of their
/// last 8 bytes, big-endian (vLLM's 32-byte `BlockHash` -> the 64-bit int of its KV events);
/// ints are taken as [`super::convert::key`] takes them.
pub fn engine_hash(obj: &Bound<'_, PyAny>, what: impl FnOnce() -> String) -> PyResult<Key> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(bytes_hash(b.as_bytes()));
    }
    key_named(obj, what)
}

/// The engine hash of a `bytes` value: the integer of its last 8 bytes, big-endian.
fn bytes_hash(b: &[u8]) -> Key {
    let mut be = [0u8; 8];
    let tail = &b[b.len().saturating_sub(8)..];
    be[8 - tail.len()..].copy_from_slice(tail);
    Key(u128::from(u64::from_be_bytes(be)))
}

/// Extracts the engine hashes of a hash list (a list or a tuple) from position `start` on.
///
/// Items that are exact `bytes` are read in place through the item array, with no reference
/// counting and no Python call, the objects [`AHEAD`] items on prefetched; any other item takes
/// [`engine_hash`] (which may call Python, so the length is read again before each item).
///
/// The vector has room for `spare` more keys: a list that becomes a request's own (a new
/// request's hashes, moved into the core) grows while the request decodes, and without room
/// its first append would copy the whole list.
pub fn engine_hashes_from(
    obj: &Bound<'_, PyAny>,
    start: usize,
    spare: usize,
    what: &(impl Display + ?Sized),
) -> PyResult<Vec<Key>> {
    let mut out = Vec::new();
    engine_hashes_into(obj, start, spare, what, &mut out)?;
    Ok(out)
}

/// [`engine_hashes_from`], appending to `out` (room made once, `spare` more than the hashes).
/// On error `out` may hold some of them.
pub fn engine_hashes_into(
    obj: &Bound<'_, PyAny>,
    start: usize,
    spare: usize,
    what: &(impl Display + ?Sized),
    out: &mut Vec<Key>,
) -> PyResult<()> {
    let Some(items) = Items::of(obj) else {
        return Err(InvalidKeyError::new_err(format!(
            "{what} must be a list or tuple of hashes (bytes or int), got {}",
            describe(obj)
        )));
    };
    out.reserve(items.len().saturating_sub(start) + spare);
    for i in start..start + AHEAD.min(items.len().saturating_sub(start)) {
        prefetch_bytes(items.get(i));
    }
    let mut i = start;
    while i < items.len() {
        if i + AHEAD < items.len() {
            prefetch_bytes(items.get(i + AHEAD));
        }
        let p = items.get(i);
        // SAFETY: `p` is a live item of the sequence (GIL attached); the exact-`bytes` branch
        // reads the immutable bytes in place while nothing can run Python code, every other
        // item is first turned into an owned reference (`from_borrowed_ptr`).
        #[allow(unsafe_code)]
        unsafe {
            if ffi::PyBytes_CheckExact(p) != 0 {
                let n = ffi::Py_SIZE(p).unsigned_abs();
                let data = std::slice::from_raw_parts(ffi::PyBytes_AS_STRING(p).cast::<u8>(), n);
                out.push(bytes_hash(data));
            } else {
                let item = Bound::from_borrowed_ptr(obj.py(), p);
                out.push(engine_hash(&item, || format!("{what}[{i}]"))?);
            }
        }
        i += 1;
    }
    Ok(())
}

/// Asks for the hashes of `items` from position `start` on (the first [`AHEAD`]: the
/// conversion asks for the others as it goes) ahead of [`engine_hashes_from`]; changes nothing.
pub fn prefetch_hashes(items: Items, start: usize) {
    for i in start..items.len().min(start + AHEAD) {
        prefetch_bytes(items.get(i));
    }
}

/// Prefetches a `bytes` object's header and the line of a 32-byte hash's last 8 bytes.
fn prefetch_bytes(p: *mut ffi::PyObject) {
    let p = p.cast::<u8>().cast_const();
    prefetch(p);
    // 64-bit CPython: a 32-byte header, so a 32-byte hash ends 64 bytes into its object.
    prefetch(p.wrapping_add(56));
}

/// Prefetches an object's first 64 bytes (an `int`; a short `str`'s header and characters,
/// which start 48 bytes in), wherever the object starts in its cache line.
fn prefetch_object(p: *mut ffi::PyObject) {
    let p = p.cast::<u8>().cast_const();
    prefetch(p);
    prefetch(p.wrapping_add(63));
}

/// Where the objects of one type keep their `block_id`, when it is an object slot read as
/// `getattr` would read it: vLLM's `KVCacheBlock` is a `dataclass(slots=True)`.
struct SlotField<'py> {
    ty: Bound<'py, PyType>,
    offset: isize,
}

impl<'py> SlotField<'py> {
    /// The `block_id` slot of `item`'s type, if `getattr(item, "block_id")` is a plain slot
    /// read there: the type's metatype is `type` and its instances use the generic attribute
    /// lookup (which finds the slot's member descriptor on the type first: a data descriptor,
    /// never shadowed by an instance attribute), and the descriptor is an object member with
    /// no flag that changes a read.
    #[allow(unsafe_code)]
    fn of(item: &Bound<'py, PyAny>) -> Option<Self> {
        let ty = item.get_type();
        let type_ptr = ty.as_type_ptr();
        let generic: ffi::getattrofunc = ffi::PyObject_GenericGetAttr;
        // SAFETY: `type_ptr` is a live type object (held by `ty`), GIL attached; the member
        // descriptor is read only after its exact type was checked, and its `d_member` (a
        // `PyMemberDef` in CPython, typed otherwise by pyo3) lives as long as the type.
        unsafe {
            if ffi::Py_TYPE(type_ptr.cast()) != std::ptr::addr_of_mut!(ffi::PyType_Type)
                || (*type_ptr).tp_getattro.map(|f| f as usize) != Some(generic as usize)
            {
                return None;
            }
            let descr = ty.getattr(pyo3::intern!(item.py(), "block_id")).ok()?;
            if ffi::Py_TYPE(descr.as_ptr()) != std::ptr::addr_of_mut!(ffi::PyMemberDescr_Type) {
                return None;
            }
            let member = (*descr.as_ptr().cast::<ffi::PyMemberDescrObject>())
                .d_member
                .cast::<ffi::PyMemberDef>();
            let m = &*member;
            let readonly = 1; // CPython's READONLY / Py_READONLY: only writes differ
            let descr_type = (*descr.as_ptr().cast::<ffi::PyDescrObject>()).d_type;
            if m.type_code != ffi::Py_T_OBJECT_EX
                || m.flags & !readonly != 0
                || m.offset < std::mem::size_of::<ffi::PyObject>() as isize
                || ffi::PyType_IsSubtype(type_ptr, descr_type) == 0
            {
                return None;
            }
            Some(Self {
                ty,
                offset: m.offset,
            })
        }
    }

    /// Prefetches the lines of `item` that [`Self::read`] reads: its type and its slot.
    fn prefetch(&self, item: *mut ffi::PyObject) {
        let p = item.cast::<u8>().cast_const();
        prefetch(p);
        prefetch(p.wrapping_offset(self.offset));
    }

    /// The object in `item`'s slot, if `item` is of this type exactly and the slot is set
    /// (borrowed: valid only until Python code may run).
    #[allow(unsafe_code)]
    fn read(&self, item: *mut ffi::PyObject) -> Option<*mut ffi::PyObject> {
        // SAFETY: `item` is a live object; for an object of exactly this type the slot at
        // `offset` lies inside it (checked against the descriptor in `of`).
        unsafe {
            if ffi::Py_TYPE(item) != self.ty.as_type_ptr() {
                return None;
            }
            let v = *item.byte_offset(self.offset).cast::<*mut ffi::PyObject>();
            (!v.is_null()).then_some(v)
        }
    }
}

/// A block id from an exact `int` in range, read without a Python call; `None` for anything
/// else (the general conversion then raises, naming it).
#[allow(unsafe_code)]
fn exact_block_id(v: *mut ffi::PyObject) -> Option<BlockId> {
    // SAFETY: `v` is a live object; `PyLong_AsLongLong` of an exact `int` runs no Python code
    // (an overflow sets an error, cleared here: the general conversion reports it).
    unsafe {
        if ffi::PyLong_CheckExact(v) == 0 {
            return None;
        }
        let x = ffi::PyLong_AsLongLong(v);
        if x == -1 && !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        u32::try_from(x)
            .ok()
            .filter(|&b| b != u32::MAX)
            .map(BlockId)
    }
}

/// Block ids from a list of ints or of the engine's block objects: an item that is not an
/// integer is read through its `block_id` attribute (vLLM's `KVCacheBlock`), so an adapter
/// hands over the engine's own block lists instead of building lists of ints first. An item
/// with neither raises as [`super::convert::blocks`] does.
///
/// The fast path: a list or tuple whose blocks keep `block_id` in an object slot
/// ([`SlotField`]) holding an exact `int` is read in place, prefetched in two stages (the
/// block objects `2 * AHEAD` items ahead, the `int`s `AHEAD` ahead).
pub fn engine_blocks(
    obj: &Bound<'_, PyAny>,
    what: &(impl Display + ?Sized),
) -> PyResult<Vec<BlockId>> {
    let Some(items) = Items::of(obj) else {
        let mut out = Vec::new();
        for_each_item(obj, what, |i, item| {
            out.push(block_from(item, what, i)?);
            Ok(())
        })
        .map_err(block_error)?;
        return Ok(out);
    };
    let py = obj.py();
    let mut out = Vec::with_capacity(items.len());
    // The slot of the block objects' type, once looked up; the last type found without one.
    let mut field: Option<SlotField<'_>> = None;
    let mut unsuitable: *mut ffi::PyTypeObject = std::ptr::null_mut();
    // The item whose type was looked up last (once per item: a lookup that runs Python code
    // may replace the item, whose type is then not looked up again).
    let mut looked_at = usize::MAX;
    let mut i = 0;
    while i < items.len() {
        let p = items.get(i);
        // SAFETY: `p` is a live item of the sequence (GIL attached).
        #[allow(unsafe_code)]
        let (exact_int, item_type) = unsafe { (ffi::PyLong_CheckExact(p) != 0, ffi::Py_TYPE(p)) };
        if exact_int {
            if let Some(b) = exact_block_id(p) {
                out.push(b);
                i += 1;
                continue;
            }
        } else if let Some(f) = &field {
            let n = items.len();
            if i + 2 * AHEAD < n {
                f.prefetch(items.get(i + 2 * AHEAD));
            }
            if i + AHEAD < n {
                if let Some(v) = f.read(items.get(i + AHEAD)) {
                    prefetch(v.cast::<u8>().cast_const());
                }
            }
            if let Some(b) = f.read(p).and_then(exact_block_id) {
                out.push(b);
                i += 1;
                continue;
            }
        } else if item_type != unsuitable && looked_at != i {
            // Looking the slot up may run Python code (a descriptor's `__get__`), which may
            // change the sequence: the item is fetched again after it.
            looked_at = i;
            // SAFETY: `p` is a live item, owned before anything may run Python code.
            #[allow(unsafe_code)]
            let item = unsafe { Bound::from_borrowed_ptr(py, p) };
            field = SlotField::of(&item);
            match &field {
                None => unsuitable = item_type,
                Some(f) => {
                    for k in i + 1..(i + 2 * AHEAD).min(items.len()) {
                        f.prefetch(items.get(k));
                    }
                }
            }
            continue;
        }
        // SAFETY: as above.
        #[allow(unsafe_code)]
        let item = unsafe { Bound::from_borrowed_ptr(py, p) };
        out.push(block_from(&item, what, i).map_err(block_error)?);
        // That may have run Python code, which may have changed the type: look it up again.
        field = None;
        i += 1;
    }
    Ok(out)
}

/// One item of [`engine_blocks`] by the general conversion: an int, else its `block_id`.
fn block_from(
    item: &Bound<'_, PyAny>,
    what: &(impl Display + ?Sized),
    i: usize,
) -> PyResult<BlockId> {
    let at = || format!("{what}[{i}]");
    if !item.is_instance_of::<PyInt>() {
        if let Ok(id) = item.getattr(pyo3::intern!(item.py(), "block_id")) {
            return block_named(&id, || format!("{}.block_id", at()));
        }
    }
    block_named(item, at)
}
