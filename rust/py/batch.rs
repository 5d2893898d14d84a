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

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::convert;
use super::errors::StepInputError;
use crate::ids::{BlockId, Key};
use crate::scheduler::Scheduler as Core;

/// A scheduled request's items: its id object (a dict key) and owned id.
pub struct Scheduled<'py> {
    pub obj: Bound<'py, PyAny>,
    pub id: PyBackedStr,
}

/// What the core must be asked before converting: per scheduled request the hashes it holds,
/// per finished one too, per whole table the lengths it holds.
pub struct Sizes {
    pub hash_block_size: u32,
    pub hashes: Vec<Option<usize>>,
    pub released_hashes: Vec<Option<usize>>,
    pub tables: Vec<Vec<usize>>,
}

/// Reads the [`Sizes`] (under the core lock held by the caller).
pub fn sizes(
    core: &Core,
    scheduled: &[Scheduled<'_>],
    released: &[&str],
    tables: &[&str],
) -> Sizes {
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
pub fn dict_arg<'a, 'py>(
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
pub fn hash_tail(
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
pub fn group_lists<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    convert::items(
        obj,
        what,
        "a sequence of block id lists, one per group",
        StepInputError::new_err,
    )
}

/// The blocks of `list` from position `start` on (a list or tuple is sliced first).
pub fn blocks_from(list: &Bound<'_, PyAny>, start: usize, what: &str) -> PyResult<Vec<BlockId>> {
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
pub fn append_groups(
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
