//! The engine-shaped step of `Scheduler.schedule_batch`: an adapter hands over the sequences
//! its engine already holds, and gets back a plan it can ship as it is.
//!
//! * Hashes: a mapping from request id to the request's whole, growing hash list (vLLM's
//!   `Request.block_hashes`). Only requests whose computed tokens passed the hashes the core
//!   holds are read, and only the hashes the core lacks are converted ([`engine::engine_hash`]).
//! * Blocks: per scheduled request, the blocks appended this step (per group), and for new or
//!   resumed requests their whole tables, of which only the blocks beyond the core's table are
//!   converted. Appended blocks count as written.
//! * Tokens: the computed tokens before the step plus the step's scheduled tokens, looked up in
//!   the engine's own dict.
//! * The plan: job ids, the load jobs' requests, the flush set and one little-endian `u32`
//!   buffer of copy runs ([`crate::runs`]: `job index, group, gpu start, cpu start, length`
//!   per run; loads are indexed first, then stores; the core writes it as it plans,
//!   [`PlanForm::Runs`]), instead of a Python object per job and
//!   a list per group; the plan's tier jobs packed the same way, one row per chunk (`tier::encode_tier_jobs`).
//!
//! Every request id is resolved once, under the core lock that also reads the sizes the
//! conversion needs ([`crate::scheduler::Resolved`]); the Python inputs are converted with the
//! lock released, and the step applied by those handles under it again (the module convention:
//! never call Python while holding the core lock). The hashes are appended before the step is
//! validated, all or none ([`Core::extend_hashes_many`]): they are facts of the engine, not
//! part of the step.

use std::fmt::{self, Display};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use rustc_hash::FxHashSet;

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyDict, PyTuple};

use super::super::convert::{self, At};
use super::super::engine::{self, Items};
use super::super::errors::{to_py, InvalidBlockError, InvalidKeyError, StepInputError};
use super::ids::{self, KeptIds, Named};
use super::input::{computed_counts, id_list, step_tokens, tuples};
use super::Scheduler;
use crate::ids::{BlockId, Key};
use crate::scheduler::{PlanForm, Resolved, Scheduler as Core, StepInput, StepPlan};

/// The arguments of `Scheduler.schedule_batch`, as given (see its doc).
pub(super) struct Args<'a, 'py> {
    pub scheduled: &'a Bound<'py, PyAny>,
    pub computed: &'a Bound<'py, PyAny>,
    pub new: Option<&'a Bound<'py, PyAny>>,
    pub added: Option<&'a Bound<'py, PyAny>>,
    pub appended: Option<&'a Bound<'py, PyAny>>,
    pub tables: Option<&'a Bound<'py, PyAny>>,
    pub hashes: Option<&'a Bound<'py, PyAny>>,
    pub finished: Option<&'a Bound<'py, PyAny>>,
    pub aborted: Option<&'a Bound<'py, PyAny>>,
    pub preempted: Option<&'a Bound<'py, PyAny>>,
    pub written: Option<&'a Bound<'py, PyAny>>,
}

impl Scheduler {
    /// Converts `args` and applies the step: the hash tails first, then the step itself.
    /// The input is converted unlocked against sizes read under the lock; if anyone had the
    /// core between that lock and the one that applies the step (Python called back in during
    /// the conversion, or another thread), the hash tails and table appends may start at the
    /// wrong place, so nothing is applied and the input is converted again.
    pub(super) fn batch_step(&self, args: &Args<'_, '_>) -> PyResult<StepPlan> {
        loop {
            let (mut step, seen) = self.batch_input(args)?;
            let core = self.lock()?;
            if self.locks.load(Ordering::Relaxed) != seen + 1 {
                drop(core);
                self.keep_ids(&mut step);
                continue;
            }
            let plan = Self::apply(core, &mut step);
            self.keep_ids(&mut step);
            return plan;
        }
    }

    /// Applies the converted `step` under `core`: the hash tails first, then the step itself
    /// (its token counts, blocks and written set are moved out).
    fn apply(mut core: MutexGuard<'_, Core>, step: &mut Converted) -> PyResult<StepPlan> {
        let ids = &step.ids;
        let tails: Vec<(Resolved<&str>, &[Key])> = step
            .hash_tails
            .iter()
            .map(|(k, tail)| (ids[*k].borrowed(), &step.keys[tail.clone()]))
            .collect();
        core.extend_hashes_many(&tails).map_err(to_py)?;
        let mut written = step.written.take();
        if let Some(w) = written.as_mut() {
            w.extend_from_slice(core.allocated_beyond_hit());
        }
        let names = |r: &std::ops::Range<usize>| ids[r.clone()].iter().map(Resolved::borrowed);
        let input = StepInput {
            scheduled: names(&step.scheduled).collect(),
            computed: std::mem::take(&mut step.tokens),
            new_blocks: step
                .new_blocks
                .iter()
                .map(|(k, g, blocks)| (ids[*k].borrowed(), *g, &step.blocks[blocks.clone()]))
                .collect(),
            resumed: Vec::new(),
            finished: names(&step.finished).collect(),
            aborted: names(&step.aborted).collect(),
            preempted: names(&step.preempted).collect(),
            written,
        };
        core.schedule_with(&input, PlanForm::Runs).map_err(to_py)
    }

    /// Keeps `step`'s scheduled ids for the next step's [`ids::match_items`] (called with no
    /// lock held: the ids it replaces are dropped, which may run Python code).
    fn keep_ids(&self, step: &mut Converted) {
        let mut kept = std::mem::take(&mut step.old_ids);
        let scheduled = step.ids.drain(step.scheduled.clone());
        ids::keep(scheduled, &step.ptrs, &mut kept);
        let replaced = super::super::sync::lock_cache(&self.ids).put(kept);
        drop(replaced);
    }

    /// The step converted from `args` against the sizes read under one lock, which also
    /// resolves every request id once; and the lock count after that lock.
    fn batch_input(&self, args: &Args<'_, '_>) -> PyResult<(Converted, u64)> {
        let added = dict_arg(args.added, "added")?;
        let hashes = dict_arg(args.hashes, "hashes")?;
        // The new requests are scheduled first, their tables read after `tables`' own; the
        // others are matched against the previous step's ids (`ids.rs`).
        let new = new_requests(args.new)?;
        let n_new = new.objs.len();
        let mut old_ids = super::super::sync::lock_cache(&self.ids).take();
        let mut named = Vec::new();
        for (id, obj) in new.ids.into_iter().zip(&new.objs) {
            named.push(Named::new(id, obj.as_ptr() as usize));
        }
        ids::match_items(args.scheduled, "scheduled", &mut old_ids, &mut named)?;
        let counts = computed_counts(args.computed, named.len() - n_new)?;
        let tokens = tokens(&new.counts, &counts, added, &named)?;
        let finished_ids = id_list(args.finished, "finished")?;
        let aborted_ids = id_list(args.aborted, "aborted")?;
        let preempted_ids = id_list(args.preempted, "preempted")?;
        let (mut table_ids, mut table_lists) = whole_tables(args.tables)?;
        let n_tables = table_ids.len();
        table_ids.extend(new.table_ids);
        table_lists.extend(new.tables);
        // One list of ids, in ranges: scheduled, finished, aborted, preempted, tables.
        let mut ranges = Vec::with_capacity(5);
        let mut end = 0;
        for n in [
            named.len(),
            finished_ids.len(),
            aborted_ids.len(),
            preempted_ids.len(),
            table_ids.len(),
        ] {
            ranges.push(end..end + n);
            end += n;
        }
        let [scheduled, finished, aborted, preempted, tables] =
            <[_; 5]>::try_from(ranges).expect("five ranges");
        let mut ids = Vec::with_capacity(end);
        let mut ptrs = Vec::with_capacity(named.len());
        let (sizes, seen) = {
            let core = self.lock()?;
            ids::resolve_named(&core, named, &mut ids, &mut ptrs);
            for list in [finished_ids, aborted_ids, preempted_ids, table_ids] {
                ids.extend(list.into_iter().map(|id| core.resolved(id)));
            }
            let sizes = sizes(
                &core,
                &ids,
                &scheduled,
                &(finished.start..aborted.end),
                &tables,
            );
            (sizes, self.locks.load(Ordering::Relaxed))
        };

        let (mut hash_tails, mut keys) = (Vec::new(), Vec::new());
        if let Some(lists) = hashes {
            // A request named twice (scheduled and released: the step fails) gets one tail.
            let mut seen_handles =
                FxHashSet::with_capacity_and_hasher(64, rustc_hash::FxBuildHasher);
            let mut due = Vec::new();
            for (k, held) in scheduled.clone().zip(&sizes.hashes) {
                let Some(held) = *held else { continue };
                let s = k - scheduled.start;
                if (tokens[s] / sizes.hash_block_size) as usize > held
                    && seen_handles.insert(ids[k].resolved_handle())
                {
                    due.push((k, held));
                }
            }
            for (k, held) in (finished.start..aborted.end).zip(&sizes.released_hashes) {
                let Some(held) = *held else { continue };
                if seen_handles.insert(ids[k].resolved_handle()) {
                    due.push((k, held));
                }
            }
            read_hash_tails(lists, &ids, &due, &mut hash_tails, &mut keys)?;
        }
        // Every new block, in one list: `new_blocks` names ranges of it.
        let (mut new_blocks, mut blocks) = (Vec::new(), Vec::new());
        if let Some(app) = args.appended.filter(|a| !a.is_none()) {
            let items = convert::items(
                app,
                "appended",
                "a sequence of per-group block lists (or None), one per scheduled request",
                StepInputError::new_err,
            )?;
            if items.len() != scheduled.len() - n_new {
                return Err(StepInputError::new_err(format!(
                    "step input: {} scheduled request ids but {} appended block lists",
                    scheduled.len() - n_new,
                    items.len()
                )));
            }
            for (k, item) in items.iter().enumerate() {
                if item.is_none() {
                    continue;
                }
                let what = At("appended", k);
                let who = scheduled.start + n_new + k;
                if let Ok(lists) = item.cast::<PyTuple>() {
                    // vLLM's own: a tuple per request, one list per group (no copy).
                    let lists = lists.as_slice();
                    append_groups(who, lists, &[], &what, &mut new_blocks, &mut blocks)?;
                } else {
                    let lists = group_lists(item, &what)?;
                    append_groups(who, &lists, &[], &what, &mut new_blocks, &mut blocks)?;
                }
            }
        }
        for (k, (lists, held)) in table_lists.iter().zip(&sizes.tables).enumerate() {
            let who = tables.start + k;
            if let Some(i) = k.checked_sub(n_tables) {
                let what = At(&At("new", i), 2);
                append_groups(who, lists, held, &what, &mut new_blocks, &mut blocks)?;
            } else {
                let what = At(&At("tables", k), 1);
                append_groups(who, lists, held, &what, &mut new_blocks, &mut blocks)?;
            }
        }
        let written = match args.written {
            Some(w) if !w.is_none() => {
                let mut w = engine::engine_blocks(w, "written")?;
                w.extend_from_slice(&blocks);
                Some(w)
            }
            _ => None,
        };
        let step = Converted {
            ids,
            scheduled,
            finished,
            aborted,
            preempted,
            tokens,
            new_blocks,
            blocks,
            hash_tails,
            keys,
            written,
            ptrs,
            old_ids,
        };
        Ok((step, seen))
    }
}

/// The step as converted: every request id once, resolved (in ranges by role), and the rest
/// naming requests by their position in `ids`.
struct Converted {
    ids: Vec<Resolved<PyBackedStr>>,
    scheduled: Range<usize>,
    finished: Range<usize>,
    aborted: Range<usize>,
    preempted: Range<usize>,
    tokens: Vec<u32>,
    /// `(request, group, range of blocks)` per list of new blocks.
    new_blocks: Vec<(usize, u32, Range<usize>)>,
    /// The new blocks of every request and group, one after the other.
    blocks: Vec<BlockId>,
    /// `(request, range of keys)` per request with hashes the core lacks.
    hash_tails: Vec<(usize, Range<usize>)>,
    /// Those hashes, one request after the other.
    keys: Vec<Key>,
    written: Option<Vec<BlockId>>,
    /// The scheduled ids' object addresses, in order (`ids.rs`).
    ptrs: Vec<usize>,
    /// The previous step's kept ids, those this step did not take: their room serves the ids
    /// this step keeps.
    old_ids: KeptIds,
}

/// Per scheduled request (`named`: the new requests' first, then the others) its computed
/// tokens (`new_counts`, then `counts`) plus `added[id]` where given.
fn tokens(
    new_counts: &[Bound<'_, PyAny>],
    counts: &[Bound<'_, PyAny>],
    added: Option<&Bound<'_, PyDict>>,
    named: &[Named],
) -> PyResult<Vec<u32>> {
    let n_new = new_counts.len();
    let name = |i: usize| match i.checked_sub(n_new) {
        Some(k) => format!("computed[{k}]"),
        None => format!("new[{i}][1]"),
    };
    let added = added.map(|a| added_values(a, named, n_new)).transpose()?;
    let mut tokens = Vec::with_capacity(named.len());
    for (i, (c, n)) in new_counts.iter().chain(counts).zip(named).enumerate() {
        let mut v = step_tokens(c, || name(i))?;
        if let Some(more) = added.as_ref().and_then(|a| a[i].as_ref()) {
            let what = || format!("added[{:?}]", &*n.id);
            let more = step_tokens(more, what)?;
            v = v.checked_add(more).ok_or_else(|| {
                StepInputError::new_err(format!("{} + {} overflows 2**32", name(i), what()))
            })?;
        }
        tokens.push(v);
    }
    Ok(tokens)
}

/// `added[id]` of each of `named` (`None`: absent). An engine fills the dict in scheduling
/// order with the very `str` objects it lists (vLLM's `num_scheduled_tokens`: the running
/// requests, then the new and resumed ones, interleaved), so one pass over its entries finds
/// nearly every id by address, as two runs (the new requests', `named[..n_new]`, and the
/// others'), without hashing an id or even reading its `str` (a cache miss each, after the
/// engine's own work). An id not found so is looked up by key, as before.
#[allow(unsafe_code)]
fn added_values<'py>(
    added: &Bound<'py, PyDict>,
    named: &[Named],
    n_new: usize,
) -> PyResult<Vec<Option<Bound<'py, PyAny>>>> {
    let py = added.py();
    let mut out: Vec<Option<Bound<'py, PyAny>>> = vec![None; named.len()];
    let (mut new, mut old) = (0, n_new);
    let mut found = 0;
    let (mut pos, mut key, mut value) = (0, std::ptr::null_mut(), std::ptr::null_mut());
    let dict = added.as_ptr();
    // SAFETY: `added` is a dict (checked by `dict_arg`) held for the whole loop, which runs
    // no Python code (it compares addresses and takes references): the entries stay put.
    while unsafe { pyo3::ffi::PyDict_Next(dict, &raw mut pos, &raw mut key, &raw mut value) } != 0 {
        let at = key as usize;
        let k = if let Some(d) = ahead(&named[old..], at) {
            old += d + 1;
            old - 1
        } else if let Some(d) = ahead(&named[new..n_new], at) {
            new += d + 1;
            new - 1
        } else {
            continue;
        };
        if out[k].is_none() {
            // SAFETY: a borrowed reference of the live dict, made owned at once.
            out[k] = Some(unsafe { Bound::from_borrowed_ptr(py, value) });
            found += 1;
        }
    }
    if found < named.len() {
        for (slot, n) in out.iter_mut().zip(named) {
            if slot.is_none() {
                *slot = added.get_item(id_obj(py, &n.id))?;
            }
        }
    }
    Ok(out)
}

/// The offset of the id at address `at` among the first few of `named`, if there.
fn ahead(named: &[Named], at: usize) -> Option<usize> {
    named.iter().take(ADDED_LOOKAHEAD).position(|n| n.ptr == at)
}

/// How far ahead of its cursor [`added_values`] looks for an id (one the dict lacks, or
/// holds out of order, is passed over and looked up by key).
const ADDED_LOOKAHEAD: usize = 4;

/// The `str` object of a converted request id (a new reference to the object itself, the key
/// the engine's dicts hold).
fn id_obj<'py>(py: Python<'py>, id: &PyBackedStr) -> Bound<'py, PyAny> {
    match id.into_pyobject(py) {
        Ok(obj) => obj,
        Err(never) => match never {},
    }
}

/// The `new` argument: per new request its id object, its id (twice: as scheduled and as the
/// owner of a whole table), its computed-tokens object and its per-group block lists.
#[derive(Default)]
struct NewRequests<'py> {
    objs: Vec<Bound<'py, PyAny>>,
    ids: Vec<PyBackedStr>,
    table_ids: Vec<PyBackedStr>,
    counts: Vec<Bound<'py, PyAny>>,
    tables: Vec<Vec<Bound<'py, PyAny>>>,
}

/// Reads `new`, `(request_id, computed tokens, block tables)` triples (`None`: none).
fn new_requests<'py>(new: Option<&Bound<'py, PyAny>>) -> PyResult<NewRequests<'py>> {
    let mut out = NewRequests::default();
    let Some(new) = new.filter(|n| !n.is_none()) else {
        return Ok(out);
    };
    let shape = "(request_id, computed tokens, block tables) triple";
    for (i, triple) in tuples::<3>(new, "new", shape)?.enumerate() {
        let [id, count, lists] = triple?;
        let what = At("new", i);
        let name = || At(&what, 0).to_string();
        out.ids.push(convert::request_id_owned(id.clone(), name)?);
        out.table_ids
            .push(convert::request_id_owned(id.clone(), name)?);
        out.objs.push(id);
        out.counts.push(count);
        out.tables.push(group_lists(&lists, &At(&what, 2))?);
    }
    Ok(out)
}

/// The `tables` argument: the owned ids, and per item the per-group block lists.
#[allow(clippy::type_complexity)]
fn whole_tables<'py>(
    tables: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Vec<PyBackedStr>, Vec<Vec<Bound<'py, PyAny>>>)> {
    let Some(t) = tables.filter(|t| !t.is_none()) else {
        return Ok((Vec::new(), Vec::new()));
    };
    tuples::<2>(t, "tables", "(request_id, block tables) pair")?
        .enumerate()
        .map(|(i, pair)| {
            let [id, lists] = pair?;
            let what = At("tables", i);
            let name = convert::request_id_owned(id, || At(&what, 0).to_string())?;
            Ok((name, group_lists(&lists, &At(&what, 1))?))
        })
        .collect()
}

/// What the core must be asked before converting: per scheduled request the hashes it holds,
/// per finished or aborted one too, per whole table the lengths it holds.
struct Sizes {
    hash_block_size: u32,
    hashes: Vec<Option<usize>>,
    released_hashes: Vec<Option<usize>>,
    tables: Vec<Vec<usize>>,
}

/// Reads the [`Sizes`] of the requests `ids[scheduled]`, `ids[released]` and `ids[tables]`
/// (under the core lock held by the caller).
fn sizes(
    core: &Core,
    ids: &[Resolved<PyBackedStr>],
    scheduled: &Range<usize>,
    released: &Range<usize>,
    tables: &Range<usize>,
) -> Sizes {
    let groups = core.config().groups.len();
    let held = |r: &Range<usize>| -> Vec<Option<usize>> {
        ids[r.clone()]
            .iter()
            .map(|id| id.resolved_handle().and(core.num_hashes(id).ok()))
            .collect()
    };
    Sizes {
        hash_block_size: core.config().hash_block_size,
        hashes: held(scheduled),
        released_hashes: held(released),
        tables: ids[tables.clone()]
            .iter()
            .map(|id| {
                (0..groups)
                    .map(|g| core.table_len(id, g).unwrap_or(0))
                    .collect()
            })
            .collect(),
    }
}

/// An optional dict argument (`None`: absent); anything else raises `StepInputError`.
fn dict_arg<'a, 'py>(
    obj: Option<&'a Bound<'py, PyAny>>,
    what: &str,
) -> PyResult<Option<&'a Bound<'py, PyDict>>> {
    match obj {
        Some(o) if !o.is_none() => o.cast::<PyDict>().map(Some).map_err(|_| {
            StepInputError::new_err(format!(
                "{what} must be a dict, got {}",
                convert::describe(o)
            ))
        }),
        _ => Ok(None),
    }
}

/// The hashes beyond the held ones of each of `due` (`(k, held)`: the request `ids[k]`, which
/// holds `held`), read from `lists[id]` into `keys`, with `(k, range of keys)` in `tails` where
/// the list is longer. A request with no list, or a list no longer, gets none. The reads go in
/// stages over all of `due`, each starting the next stage's cache misses (the id objects, the
/// lists, their item arrays, the new hashes: each cold after the engine's own work, and each
/// read only through the one before), so the misses of different requests overlap instead of
/// a chain per request.
fn read_hash_tails(
    lists: &Bound<'_, PyDict>,
    ids: &[Resolved<PyBackedStr>],
    due: &[(usize, usize)],
    tails: &mut Vec<(usize, Range<usize>)>,
    keys: &mut Vec<Key>,
) -> PyResult<()> {
    let py = lists.py();
    let names: Vec<_> = due
        .iter()
        .map(|&(k, _)| id_obj(py, ids[k].name()))
        .collect();
    let mut found = Vec::with_capacity(due.len());
    for (name, &(_, held)) in names.iter().zip(due) {
        let list = lists.get_item(name)?;
        if let Some(items) = list.as_ref().and_then(Items::of) {
            items.prefetch_from(held);
        }
        found.push(list);
    }
    for (list, &(_, held)) in found.iter().zip(due) {
        if let Some(items) = list.as_ref().and_then(Items::of) {
            engine::prefetch_hashes(items, held);
        }
    }
    for ((list, name), &(k, held)) in found.iter().zip(&names).zip(due) {
        let Some(list) = list else { continue };
        let n = list.len().map_err(|_| {
            InvalidKeyError::new_err(format!(
                "{} must be a list or tuple of hashes (bytes or int), got {}",
                HashesOf(name),
                convert::describe(list)
            ))
        })?;
        if n > held {
            let start = keys.len();
            engine::engine_hashes_into(list, held, 0, &HashesOf(name), keys)?;
            tails.push((k, start..keys.len()));
        }
    }
    Ok(())
}

/// The name of `hashes[key]` in messages (`key` rendered by `str`, only for a message).
struct HashesOf<'a, 'py>(&'a Bound<'py, PyAny>);

impl Display for HashesOf<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.str() {
            Ok(key) => write!(f, "hashes[{key}]"),
            Err(_) => write!(f, "hashes[?]"),
        }
    }
}

/// The per-group block lists of one request (a sequence with one item per group).
fn group_lists<'py>(
    obj: &Bound<'py, PyAny>,
    what: &(impl Display + ?Sized),
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    convert::items(
        obj,
        what,
        "a sequence of block id lists, one per group",
        StepInputError::new_err,
    )
}

/// Appends `(who, group, range)` for every non-empty group list of `lists` (each from its
/// position in `from`), the blocks to `blocks`.
fn append_groups(
    who: usize,
    lists: &[Bound<'_, PyAny>],
    from: &[usize],
    what: &(impl Display + ?Sized),
    new_blocks: &mut Vec<(usize, u32, Range<usize>)>,
    blocks: &mut Vec<BlockId>,
) -> PyResult<()> {
    for (g, list) in lists.iter().enumerate() {
        let start = from.get(g).copied().unwrap_or(0);
        let n = list.len().map_err(|_| {
            InvalidBlockError::new_err(format!(
                "{} must be a sequence of integers, got {}",
                At(what, g),
                convert::describe(list)
            ))
        })?;
        if n <= start {
            continue;
        }
        let first = blocks.len();
        convert::blocks_into(list, start, &At(what, g), blocks)?;
        new_blocks.push((who, g as u32, first..blocks.len()));
    }
    Ok(())
}
