//! Conversion of the step's and the requests' inputs: every argument becomes an owned Rust
//! value (before the core lock is taken), or a `kvoffload.errors` exception naming it.

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::PyList;

use super::super::convert::{self, At};
use super::super::engine;
use super::super::errors::{InvalidRequestError, StepInputError};
use crate::ids::BlockId;

/// Per group, a list of block ids or of the engine's block objects ([`engine::engine_blocks`]).
pub(super) fn block_lists(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Vec<BlockId>>> {
    convert::items(
        obj,
        what,
        "a sequence of block id lists, one per group",
        super::super::errors::InvalidBlockError::new_err,
    )?
    .iter()
    .enumerate()
    .map(|(g, item)| engine::engine_blocks(item, &At(what, g)))
    .collect()
}

/// A token count argument of a request call (`InvalidRequestError` naming it).
pub(super) fn request_tokens(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u32> {
    convert::tokens(obj, what, InvalidRequestError::new_err)
}

/// The items of a tuple or list of exactly `n` items, else `StepInputError` naming `what()`
/// (formatted only for an error).
pub(super) fn fields<'py>(
    item: &Bound<'py, PyAny>,
    n: usize,
    what: impl FnOnce() -> String,
    shape: &str,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let bad = |what: String| {
        StepInputError::new_err(format!(
            "{what} must be a {shape}, got {}",
            convert::describe(item)
        ))
    };
    let items: Vec<_> = if let Ok(t) = item.cast::<pyo3::types::PyTuple>() {
        t.iter().collect()
    } else if let Ok(l) = item.cast::<PyList>() {
        l.iter().collect()
    } else {
        return Err(bad(what()));
    };
    if items.len() == n {
        Ok(items)
    } else {
        Err(bad(what()))
    }
}

/// The items of `obj`, a sequence of `N`-field tuples (or lists) each described by `shape`
/// (`"(request_id, tokens) pair"`), as their fields, in order; anything else raises
/// `StepInputError` naming `what` or, when its turn comes, the item (`what[i]`).
pub(super) fn tuples<'a, 'py: 'a, const N: usize>(
    obj: &Bound<'py, PyAny>,
    what: &'a str,
    shape: &'a str,
) -> PyResult<impl ExactSizeIterator<Item = PyResult<[Bound<'py, PyAny>; N]>> + 'a> {
    let items = convert::items(obj, what, &SequenceOf(shape), StepInputError::new_err)?;
    Ok(items.into_iter().enumerate().map(move |(i, item)| {
        let f = fields(&item, N, || format!("{what}[{i}]"), shape)?;
        Ok(<[_; N]>::try_from(f).expect("N fields"))
    }))
}

/// "a sequence of {shape}s", written only for a message.
struct SequenceOf<'a>(&'a str);

impl std::fmt::Display for SequenceOf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a sequence of {}s", self.0)
    }
}

/// The scheduled requests and their computed tokens: `(request_id, tokens)` pairs when
/// `computed` is `None`, else two parallel sequences of equal length.
pub(super) fn scheduled_input(
    scheduled: &Bound<'_, PyAny>,
    computed: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Vec<PyBackedStr>, Vec<u32>)> {
    match computed.filter(|c| !c.is_none()) {
        None => {
            let pairs = tuples::<2>(scheduled, "scheduled", "(request_id, tokens) pair")?;
            let mut ids = Vec::with_capacity(pairs.len());
            let mut tokens = Vec::with_capacity(pairs.len());
            for (i, pair) in pairs.enumerate() {
                let [id, n] = pair?;
                ids.push(convert::request_id_owned(id, || {
                    format!("scheduled[{i}][0]")
                })?);
                tokens.push(step_tokens(&n, || format!("scheduled[{i}][1]"))?);
            }
            Ok((ids, tokens))
        }
        Some(computed) => {
            let ids = convert::request_ids(scheduled, "scheduled")?;
            let counts = computed_counts(computed, ids.len())?;
            let tokens = counts
                .iter()
                .enumerate()
                .map(|(i, c)| step_tokens(c, || format!("computed[{i}]")))
                .collect::<PyResult<Vec<_>>>()?;
            Ok((ids, tokens))
        }
    }
}

/// A token count of the step (`StepInputError` naming `what()`, formatted only for an error).
pub(super) fn step_tokens(obj: &Bound<'_, PyAny>, what: impl FnOnce() -> String) -> PyResult<u32> {
    match convert::int_value(obj) {
        Some(Ok(v)) if (0..=i128::from(u32::MAX)).contains(&v) => Ok(v as u32),
        _ => convert::tokens(obj, &what(), StepInputError::new_err),
    }
}

/// `(request_id, group, blocks)` triples appended this step.
pub(super) fn new_blocks_input(
    obj: &Bound<'_, PyAny>,
) -> PyResult<Vec<(PyBackedStr, u32, Vec<BlockId>)>> {
    tuples::<3>(obj, "new_blocks", "(request_id, group, block ids) triple")?
        .enumerate()
        .map(|(i, item)| {
            let [id, group, blocks] = item?;
            let what = format!("new_blocks[{i}]");
            let id = convert::request_id_owned(id, || format!("{what}[0]"))?;
            let group = match convert::int_value(&group) {
                Some(Ok(g)) if (0..=i128::from(u32::MAX)).contains(&g) => g as u32,
                _ => {
                    return Err(StepInputError::new_err(format!(
                        "{what}[1] (the group) must be an integer in 0..2**32, got {}",
                        convert::describe(&group)
                    )))
                }
            };
            let blocks = convert::blocks(&blocks, &format!("{what}[2]"))?;
            Ok((id, group, blocks))
        })
        .collect()
}

/// The items of `computed`, one token count per scheduled request (`n` of them).
pub(super) fn computed_counts<'py>(
    computed: &Bound<'py, PyAny>,
    n: usize,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let counts = convert::items(
        computed,
        "computed",
        "a sequence of token counts",
        StepInputError::new_err,
    )?;
    if counts.len() != n {
        return Err(StepInputError::new_err(format!(
            "step input: {n} scheduled request ids but {} computed-token counts",
            counts.len()
        )));
    }
    Ok(counts)
}

/// An optional list of request ids (`None`: empty).
pub(super) fn id_list(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Vec<PyBackedStr>> {
    match obj {
        Some(o) if !o.is_none() => convert::request_ids(o, what),
        _ => Ok(Vec::new()),
    }
}
