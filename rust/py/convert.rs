//! Conversion of Python inputs into owned Rust values, with errors that name the bad value.
//!
//! Integer arrays arrive as lists, tuples, ranges or any iterable of ints (numpy integer arrays
//! included); lists and tuples take a fast path without the iterator protocol. Pool keys are
//! ints in `0..2**128` or `bytes` (opaque hashes, see [`Key::from_bytes`]).

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};

use super::errors::{
    to_py, CompletionError, ConfigError, InvalidBlockError, InvalidKeyError, InvalidRequestError,
    UnknownJobError,
};
use crate::error::Error;
use crate::ids::{BlockId, JobId, Key, OwnerId};

fn describe(item: &Bound<'_, PyAny>) -> String {
    let ty = item
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string());
    let repr = item
        .repr()
        .map_or_else(|_| "?".to_owned(), |r| r.to_string());
    format!("{repr} ({ty})")
}

/// Extracts a non-negative integer below `limit`; `err` builds the exception.
fn extract_index(
    item: &Bound<'_, PyAny>,
    what: &str,
    limit: u128,
    err: fn(String) -> PyErr,
) -> PyResult<u64> {
    match item.extract::<i128>() {
        Ok(v) if v >= 0 && (v as u128) < limit => Ok(v as u64),
        Ok(v) => Err(err(format!("{what} must be in 0..{limit}, got {v}"))),
        Err(_) => Err(err(format!(
            "{what} must be an integer, got {}",
            describe(item)
        ))),
    }
}

/// Calls `f` on every item of a list, a tuple or any iterable.
pub fn for_each_item<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    mut f: impl FnMut(usize, &Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    if let Ok(list) = obj.cast::<PyList>() {
        for (i, item) in list.iter().enumerate() {
            f(i, &item)?;
        }
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        for (i, item) in tuple.iter().enumerate() {
            f(i, &item)?;
        }
    } else {
        let iter = obj.try_iter().map_err(|_| {
            PyTypeError::new_err(format!(
                "{what} must be a sequence of integers, got {}",
                describe(obj)
            ))
        })?;
        for (i, item) in iter.enumerate() {
            f(i, &item?)?;
        }
    }
    Ok(())
}

/// Extracts block ids (each `0 <= b < 2**32 - 1`).
pub fn blocks(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<BlockId>> {
    let mut out = Vec::new();
    for_each_item(obj, what, |i, item| {
        out.push(block(item, &format!("{what}[{i}]"))?);
        Ok(())
    })
    .map_err(|e| {
        Python::attach(|py| {
            if e.is_instance_of::<PyTypeError>(py) {
                InvalidBlockError::new_err(e.value(py).to_string())
            } else {
                e
            }
        })
    })?;
    Ok(out)
}

/// Extracts one block id.
pub fn block(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<BlockId> {
    extract_index(obj, what, u128::from(u32::MAX), InvalidBlockError::new_err)
        .map(|b| BlockId(b as u32))
}

/// Extracts a request id used as a job owner (a non-negative 64-bit integer).
pub fn owner(obj: &Bound<'_, PyAny>) -> PyResult<OwnerId> {
    extract_index(obj, "request id", 1 << 64, InvalidRequestError::new_err).map(OwnerId)
}

/// Extracts one pool key: an `int` in `0..2**128` (numpy integers included) or `bytes`.
/// Negative ints, bools, floats, strings and everything else raise `InvalidKeyError`.
pub fn key(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Key> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Key::from_bytes(b.as_bytes()));
    }
    if !obj.is_instance_of::<PyBool>() {
        if let Ok(v) = obj.extract::<u128>() {
            return Ok(Key(v));
        }
        if obj.is_instance_of::<PyInt>() || obj.extract::<i128>().is_ok() {
            return Err(InvalidKeyError::new_err(format!(
                "{what} must be an int in 0..2**128 or bytes, got {}",
                describe(obj)
            )));
        }
    }
    Err(InvalidKeyError::new_err(format!(
        "{what} must be an int or bytes, got {}",
        describe(obj)
    )))
}

/// Extracts a sequence of pool keys (a list, tuple or any iterable of keys; not a lone `str`,
/// `bytes` or `int`).
pub fn keys(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Key>> {
    let not_a_sequence = || {
        InvalidKeyError::new_err(format!(
            "{what} must be a sequence of keys (int or bytes), got {}",
            describe(obj)
        ))
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(not_a_sequence());
    }
    let mut out = Vec::new();
    for_each_item(obj, what, |i, item| {
        out.push(key(item, &format!("{what}[{i}]"))?);
        Ok(())
    })
    .map_err(|e| {
        Python::attach(|py| {
            if e.is_instance_of::<PyTypeError>(py) {
                not_a_sequence()
            } else {
                e
            }
        })
    })?;
    Ok(out)
}

/// Extracts a configuration size (an integer in `0..2**32`; zero is checked by the core).
pub fn config_size(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u32> {
    extract_index(obj, what, 1 << 32, ConfigError::new_err).map(|v| v as u32)
}

/// Extracts an integer argument; anything else raises `err` naming the value and its type.
fn int_arg(obj: &Bound<'_, PyAny>, what: &str, err: fn(String) -> PyErr) -> PyResult<i128> {
    if obj.is_instance_of::<PyBool>() {
        return Err(err(format!(
            "{what} must be an integer, got {}",
            describe(obj)
        )));
    }
    obj.extract::<i128>()
        .map_err(|_| err(format!("{what} must be an integer, got {}", describe(obj))))
}

/// A completion report from Python: the job id, and the count (default 1) clamped into `u32` so that the
/// core checks the report in its usual order (late, unknown, already completed, zero, over);
/// [`completion_error`] then names the count the caller passed.
pub fn completion(
    job: &Bound<'_, PyAny>,
    count: Option<&Bound<'_, PyAny>>,
) -> PyResult<(JobId, u32, i128)> {
    let id = int_arg(job, "job id", UnknownJobError::new_err)?;
    let id = u64::try_from(id).map(JobId).map_err(|_| {
        UnknownJobError::new_err(format!("unknown job {id}: job ids are non-negative"))
    })?;
    let count = match count {
        Some(c) => int_arg(c, "completion count", CompletionError::new_err)?,
        None => 1,
    };
    let clamped = u32::try_from(count.clamp(0, i128::from(u32::MAX))).expect("clamped");
    Ok((id, clamped, count))
}

/// Maps a core error of a completion, naming the count the caller passed.
pub fn completion_error(e: Error, id: JobId, count: i128, clamped: u32) -> PyErr {
    match e {
        Error::ZeroCompletion(_) if count != 0 => CompletionError::new_err(format!(
            "job {id}: completion count must be at least 1, got {count}"
        )),
        Error::OverCompleted { remaining, .. } if count != i128::from(clamped) => {
            CompletionError::new_err(format!(
                "job {id} over-completed: {count} worker reports but only {remaining} pending"
            ))
        }
        e => to_py(e),
    }
}
