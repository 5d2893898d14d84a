//! The engine-shaped step of `Scheduler.schedule_batch`: an adapter hands over the sequences
//! its engine already holds, and gets back a plan it can ship as it is.
//!
//! * Hashes: a mapping from request id to the request's whole, growing hash list (vLLM's
//!   `Request.block_hashes`). Only requests whose computed tokens passed the hashes the core
//!   holds are read, and only the hashes the core lacks are converted ([`convert::engine_hash`]).
//! * Blocks: per scheduled request, the blocks appended this step (per group), and for new or
//!   resumed requests their whole tables, of which only the blocks beyond the core's table are
//!   converted. Appended blocks count as written.
//! * Tokens: the computed tokens before the step plus the step's scheduled tokens, looked up in
//!   the engine's own dict.
//! * The plan: job ids, the load jobs' requests, the flush set and one little-endian `u32`
//!   buffer of copy runs ([`crate::runs`]: `job index, group, gpu start, cpu start, length`
//!   per run; loads are indexed first, then stores), instead of a Python object per job and
//!   a list per group; the plan's tier jobs packed the same way, one row per chunk (`tier::encode_tier_jobs`).
//!
//! The sizes the conversion needs are read under the core lock, the Python inputs converted
//! with the lock released, and the step applied under it again (the module convention: never
//! call Python while holding the core lock). The hashes are appended before the step is
//! validated: they are facts of the engine, not part of the step.

use std::sync::atomic::Ordering;

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use super::super::convert;
use super::super::errors::{to_py, StepInputError};
use super::input::{computed_counts, id_list, step_tokens, tuples};
use super::Scheduler;
use crate::ids::{BlockId, Key};
use crate::scheduler::{Scheduler as Core, StepInput, StepPlan};

/// The arguments of `Scheduler.schedule_batch`, as given (see its doc).
pub(super) struct Args<'a, 'py> {
    pub scheduled: &'a Bound<'py, PyAny>,
    pub computed: &'a Bound<'py, PyAny>,
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
    pub(super) fn batch_step(&self, py: Python<'_>, args: &Args<'_, '_>) -> PyResult<StepPlan> {
        loop {
            let (mut input, hash_tails, seen) = self.batch_input(py, args)?;
            let mut core = self.lock();
            if self.locks.load(Ordering::Relaxed) != seen + 1 {
                continue;
            }
            for (id, tail) in &hash_tails {
                core.extend_hashes(id, tail).map_err(to_py)?;
            }
            if let Some(w) = input.written.as_mut() {
                w.extend_from_slice(core.allocated_beyond_hit());
            }
            return core.schedule(&input).map_err(to_py);
        }
    }

    /// The step input and the hash tails to append, converted from `args` against the sizes
    /// read under one lock; and the lock count after that lock.
    #[allow(clippy::type_complexity)]
    fn batch_input(
        &self,
        py: Python<'_>,
        args: &Args<'_, '_>,
    ) -> PyResult<(StepInput<PyBackedStr>, Vec<(String, Vec<Key>)>, u64)> {
        let added = dict_arg(args.added, "added")?;
        let hashes = dict_arg(args.hashes, "hashes")?;
        let sched = scheduled(args.scheduled)?;
        let tokens = tokens(args.computed, added, &sched)?;
        let finished = id_list(args.finished, "finished")?;
        let aborted = id_list(args.aborted, "aborted")?;
        let preempted = id_list(args.preempted, "preempted")?;
        let whole = whole_tables(args.tables)?;
        let released: Vec<&str> = finished.iter().chain(&aborted).map(|id| &**id).collect();
        let table_ids: Vec<&str> = whole.iter().map(|(_, name, _)| &**name).collect();
        let (sizes, seen) = {
            let core = self.lock();
            let sizes = sizes(&core, &sched, &released, &table_ids);
            (sizes, self.locks.load(Ordering::Relaxed))
        };

        let mut hash_tails = Vec::new();
        if let Some(lists) = hashes {
            for (k, (s, held)) in sched.iter().zip(&sizes.hashes).enumerate() {
                let Some(held) = *held else { continue };
                if (tokens[k] / sizes.hash_block_size) as usize <= held {
                    continue;
                }
                if let Some(tail) = hash_tail(lists, &s.obj, held)? {
                    hash_tails.push((s.id.to_string(), tail));
                }
            }
            for (id, held) in released.iter().zip(&sizes.released_hashes) {
                let Some(held) = *held else { continue };
                let key = PyString::new(py, id);
                if let Some(tail) = hash_tail(lists, key.as_any(), held)? {
                    hash_tails.push(((*id).to_owned(), tail));
                }
            }
        }
        let mut new_blocks = Vec::new();
        let mut fresh = Vec::new();
        if let Some(app) = args.appended.filter(|a| !a.is_none()) {
            let items = convert::items(
                app,
                "appended",
                "a sequence of per-group block lists (or None), one per scheduled request",
                StepInputError::new_err,
            )?;
            if items.len() != sched.len() {
                return Err(StepInputError::new_err(format!(
                    "step input: {} scheduled request ids but {} appended block lists",
                    sched.len(),
                    items.len()
                )));
            }
            for (k, (item, s)) in items.iter().zip(&sched).enumerate() {
                if item.is_none() {
                    continue;
                }
                let what = format!("appended[{k}]");
                let lists = group_lists(item, &what)?;
                append_groups(&s.obj, &lists, &[], &what, &mut new_blocks, &mut fresh)?;
            }
        }
        for (k, ((id, _, lists), held)) in whole.iter().zip(&sizes.tables).enumerate() {
            let what = format!("tables[{k}][1]");
            append_groups(id, lists, held, &what, &mut new_blocks, &mut fresh)?;
        }
        let written = match args.written {
            Some(w) if !w.is_none() => {
                let mut w = convert::engine_blocks(w, "written")?;
                w.append(&mut fresh);
                Some(w)
            }
            _ => None,
        };
        let input = StepInput {
            scheduled: sched.into_iter().map(|s| s.id).collect(),
            computed: tokens,
            new_blocks,
            resumed: Vec::new(),
            finished,
            aborted,
            preempted,
            written,
        };
        Ok((input, hash_tails, seen))
    }
}

/// The scheduled request ids, each with its object (a key of `added` and `hashes`).
fn scheduled<'py>(scheduled: &Bound<'py, PyAny>) -> PyResult<Vec<Scheduled<'py>>> {
    convert::items(
        scheduled,
        "scheduled",
        "a sequence of request ids (str)",
        StepInputError::new_err,
    )?
    .into_iter()
    .enumerate()
    .map(|(i, obj)| {
        let id = convert::request_id_owned(obj.clone(), || format!("scheduled[{i}]"))?;
        Ok(Scheduled { obj, id })
    })
    .collect()
}

/// Per scheduled request its `computed` tokens plus `added[id]` where given.
fn tokens(
    computed: &Bound<'_, PyAny>,
    added: Option<&Bound<'_, PyDict>>,
    sched: &[Scheduled<'_>],
) -> PyResult<Vec<u32>> {
    let counts = computed_counts(computed, sched.len())?;
    let mut tokens = Vec::with_capacity(sched.len());
    for (i, (c, s)) in counts.iter().zip(sched).enumerate() {
        let mut n = step_tokens(c, || format!("computed[{i}]"))?;
        if let Some(more) = added.map(|a| a.get_item(&s.obj)).transpose()?.flatten() {
            let what = || format!("added[{:?}]", &*s.id);
            let more = step_tokens(&more, what)?;
            n = n.checked_add(more).ok_or_else(|| {
                StepInputError::new_err(format!("computed[{i}] + {} overflows 2**32", what()))
            })?;
        }
        tokens.push(n);
    }
    Ok(tokens)
}

/// The `tables` argument: per item the id object, the owned id and the per-group block lists.
#[allow(clippy::type_complexity)]
fn whole_tables<'py>(
    tables: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<(Bound<'py, PyAny>, PyBackedStr, Vec<Bound<'py, PyAny>>)>> {
    let Some(t) = tables.filter(|t| !t.is_none()) else {
        return Ok(Vec::new());
    };
    tuples::<2>(t, "tables", "(request_id, block tables) pair")?
        .enumerate()
        .map(|(i, pair)| {
            let [id, lists] = pair?;
            let what = format!("tables[{i}]");
            let name = convert::request_id_owned(id.clone(), || format!("{what}[0]"))?;
            Ok((id, name, group_lists(&lists, &format!("{what}[1]"))?))
        })
        .collect()
}

/// A scheduled request's items: its id object (a dict key) and owned id.
struct Scheduled<'py> {
    obj: Bound<'py, PyAny>,
    id: PyBackedStr,
}

/// What the core must be asked before converting: per scheduled request the hashes it holds,
/// per finished one too, per whole table the lengths it holds.
struct Sizes {
    hash_block_size: u32,
    hashes: Vec<Option<usize>>,
    released_hashes: Vec<Option<usize>>,
    tables: Vec<Vec<usize>>,
}

/// Reads the [`Sizes`] (under the core lock held by the caller).
fn sizes(core: &Core, scheduled: &[Scheduled<'_>], released: &[&str], tables: &[&str]) -> Sizes {
    let groups = core.config().groups.len();
    Sizes {
        hash_block_size: core.config().hash_block_size,
        hashes: scheduled
            .iter()
            .map(|s| core.num_hashes(&s.id).ok())
            .collect(),
        released_hashes: released.iter().map(|id| core.num_hashes(id).ok()).collect(),
        tables: tables
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

/// The hashes of `id` beyond the `held` ones, read from `lists[key]` (nothing when the mapping
/// has no list for it or the list is not longer).
fn hash_tail(
    lists: &Bound<'_, PyDict>,
    key: &Bound<'_, PyAny>,
    held: usize,
) -> PyResult<Option<Vec<Key>>> {
    let Some(list) = lists.get_item(key)? else {
        return Ok(None);
    };
    if list.len()? <= held {
        return Ok(None);
    }
    let what = format!("hashes[{}]", key.str()?);
    convert::engine_hashes_from(&list, held, &what).map(Some)
}

/// The per-group block lists of one request (a sequence with one item per group).
fn group_lists<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    convert::items(
        obj,
        what,
        "a sequence of block id lists, one per group",
        StepInputError::new_err,
    )
}

/// The blocks of `list` from position `start` on (a list or tuple is sliced first).
fn blocks_from(list: &Bound<'_, PyAny>, start: usize, what: &str) -> PyResult<Vec<BlockId>> {
    if start == 0 {
        return convert::blocks(list, what);
    }
    if let Ok(l) = list.cast::<PyList>() {
        return convert::blocks(&l.get_slice(start, l.len()).into_any(), what);
    }
    if let Ok(t) = list.cast::<PyTuple>() {
        return convert::blocks(&t.get_slice(start, t.len()).into_any(), what);
    }
    Ok(convert::blocks(list, what)?.split_off(start))
}

/// Appends `(request, group, blocks)` for every non-empty group list of `lists` (each from its
/// position in `from`), and the blocks to `written`.
fn append_groups(
    id: &Bound<'_, PyAny>,
    lists: &[Bound<'_, PyAny>],
    from: &[usize],
    what: &str,
    new_blocks: &mut Vec<(PyBackedStr, u32, Vec<BlockId>)>,
    written: &mut Vec<BlockId>,
) -> PyResult<()> {
    for (g, list) in lists.iter().enumerate() {
        let start = from.get(g).copied().unwrap_or(0);
        if list.len()? <= start {
            continue;
        }
        let blocks = blocks_from(list, start, &format!("{what}[{g}]"))?;
        written.extend_from_slice(&blocks);
        let id = convert::request_id_owned(id.clone(), || what.to_owned())?;
        new_blocks.push((id, g as u32, blocks));
    }
    Ok(())
}
