//! Conversion of Python inputs into owned Rust values, with errors that name the bad value.
//!
//! Integer arrays arrive as lists, tuples, ranges or any iterable of ints (numpy integer arrays
//! included); lists and tuples take a fast path without the iterator protocol. Pool keys are
//! ints in `0..2**128` or `bytes` (opaque hashes, see [`Key::from_bytes`]). The engine's own
//! sequences (hash lists, block objects) are read in `super::engine`.

use std::fmt::Display;
use std::path::PathBuf;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::errors::{
    to_py, CompletionError, InvalidBlockError, InvalidKeyError, InvalidRequestError,
    UnknownJobError,
};
use crate::error::Error;
use crate::ids::{BlockId, JobId, Key, OwnerId};

/// An argument's name followed by an index (`appended[3]`, `At(&At("tables", 2), 1)` for
/// `tables[2][1]`), rendered only when a message names it: the hot paths format nothing.
#[derive(Clone, Copy)]
pub struct At<'a, N: ?Sized>(pub &'a N, pub usize);

impl<N: Display + ?Sized> Display for At<'_, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{}]", self.0, self.1)
    }
}

/// `repr (type)` of a Python value, for messages.
pub fn describe(item: &Bound<'_, PyAny>) -> String {
    let ty = item
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string());
    let repr = item
        .repr()
        .map_or_else(|_| "?".to_owned(), |r| r.to_string());
    format!("{repr} ({ty})")
}

/// Extracts a non-negative integer below `limit`; `err` builds the exception, naming the value
/// `what()` (called only on error: conversions of whole arrays format no names).
fn extract_index(
    item: &Bound<'_, PyAny>,
    what: impl FnOnce() -> String,
    limit: u128,
    err: fn(String) -> PyErr,
) -> PyResult<u64> {
    match int_value(item) {
        Some(Ok(v)) if v >= 0 && (v as u128) < limit => Ok(v as u64),
        Some(Ok(v)) => Err(err(format!("{} must be in 0..{limit}, got {v}", what()))),
        Some(Err(())) => Err(err(format!(
            "{} must be in 0..{limit}, got {}",
            what(),
            describe(item)
        ))),
        None => Err(err(format!(
            "{} must be an integer, got {}",
            what(),
            describe(item)
        ))),
    }
}

/// Calls `f` on every item of a list, a tuple or any iterable.
pub fn for_each_item<'py>(
    obj: &Bound<'py, PyAny>,
    what: &(impl Display + ?Sized),
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
pub fn blocks(obj: &Bound<'_, PyAny>, what: &(impl Display + ?Sized)) -> PyResult<Vec<BlockId>> {
    let mut out = Vec::new();
    blocks_into(obj, 0, what, &mut out)?;
    Ok(out)
}

/// Appends the block ids of `obj` from position `start` on to `out` (a list's or a tuple's
/// are read in place, with room made once). On error `out` may hold some of them.
pub fn blocks_into(
    obj: &Bound<'_, PyAny>,
    start: usize,
    what: &(impl Display + ?Sized),
    out: &mut Vec<BlockId>,
) -> PyResult<()> {
    let item = |i: usize, b: &Bound<'_, PyAny>| block_named(b, || format!("{what}[{i}]"));
    let mut read = || -> PyResult<()> {
        if let Ok(list) = obj.cast::<PyList>() {
            out.reserve(list.len().saturating_sub(start));
            // The length is read again before each item: an item's `__index__` may change it.
            let mut i = start;
            while i < list.len() {
                out.push(item(i, &list.get_item(i)?)?);
                i += 1;
            }
        } else if let Ok(tuple) = obj.cast::<PyTuple>() {
            out.reserve(tuple.len().saturating_sub(start));
            for (i, b) in tuple.iter().enumerate().skip(start) {
                out.push(item(i, &b)?);
            }
        } else {
            for_each_item(obj, what, |i, b| {
                if i >= start {
                    out.push(item(i, b)?);
                }
                Ok(())
            })?;
        }
        Ok(())
    };
    read().map_err(block_error)
}

/// A `TypeError` of a block list (not a sequence) as `InvalidBlockError`.
pub(super) fn block_error(e: PyErr) -> PyErr {
    Python::attach(|py| {
        if e.is_instance_of::<PyTypeError>(py) {
            InvalidBlockError::new_err(e.value(py).to_string())
        } else {
            e
        }
    })
}

/// A block id goes back to Python as a plain `int`.
impl<'py> IntoPyObject<'py> for BlockId {
    type Target = PyInt;
    type Output = Bound<'py, PyInt>;
    type Error = std::convert::Infallible;

    fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Self::Error> {
        self.0.into_pyobject(py)
    }
}

/// Extracts one block id.
pub fn block(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<BlockId> {
    block_named(obj, || what.to_owned())
}

/// Extracts one block id, named `what()` in an error.
pub(super) fn block_named(
    obj: &Bound<'_, PyAny>,
    what: impl FnOnce() -> String,
) -> PyResult<BlockId> {
    extract_index(obj, what, u128::from(u32::MAX), InvalidBlockError::new_err)
        .map(|b| BlockId(b as u32))
}

/// Extracts a request id used as a job owner (a non-negative 64-bit integer).
pub fn owner(obj: &Bound<'_, PyAny>) -> PyResult<OwnerId> {
    extract_index(
        obj,
        || "request id".to_owned(),
        1 << 64,
        InvalidRequestError::new_err,
    )
    .map(OwnerId)
}

/// Extracts one pool key: an `int` in `0..2**128` (numpy integers included) or `bytes`.
/// Negative ints, bools, floats, strings and everything else raise `InvalidKeyError`.
pub fn key(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Key> {
    key_named(obj, || what.to_owned())
}

/// [`key`], naming the value `what()` (called only on error).
pub(super) fn key_named(obj: &Bound<'_, PyAny>, what: impl FnOnce() -> String) -> PyResult<Key> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Key::from_bytes(b.as_bytes()));
    }
    if !obj.is_instance_of::<PyBool>() {
        if let Ok(v) = obj.extract::<u128>() {
            return Ok(Key(v));
        }
        if obj.is_instance_of::<PyInt>() || obj.extract::<i128>().is_ok() {
            return Err(InvalidKeyError::new_err(format!(
                "{} must be an int in 0..2**128 or bytes, got {}",
                what(),
                describe(obj)
            )));
        }
    }
    Err(InvalidKeyError::new_err(format!(
        "{} must be an int or bytes, got {}",
        what(),
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
        out.push(key_named(item, || format!("{what}[{i}]"))?);
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

/// Extracts an integer argument; anything else raises `err` naming the value and its type.
fn int_arg(obj: &Bound<'_, PyAny>, what: &str, err: fn(String) -> PyErr) -> PyResult<i128> {
    if obj.is_exact_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<i64>() {
            return Ok(i128::from(v));
        }
    }
    if obj.is_instance_of::<PyBool>() {
        return Err(err(format!(
            "{what} must be an integer, got {}",
            describe(obj)
        )));
    }
    obj.extract::<i128>()
        .map_err(|_| err(format!("{what} must be an integer, got {}", describe(obj))))
}

/// A completion report from Python: the job id and the reporting worker's rank (default 0).
/// A rank beyond `u32` is clamped so that the core checks the report in its usual order
/// (late, unknown, rank out of range, already completed, duplicate); [`completion_error`] then
/// names the rank the caller passed.
pub fn completion(job: &Bound<'_, PyAny>, worker: &Arg<'_>) -> PyResult<(JobId, u32, i128)> {
    let id = int_arg(job, "job id", UnknownJobError::new_err)?;
    let id = u64::try_from(id).map(JobId).map_err(|_| {
        UnknownJobError::new_err(format!("unknown job {id}: job ids are non-negative"))
    })?;
    let worker = match worker {
        // An explicit `None` is no rank: a worker that lost its rank must not report as rank 0.
        Arg::Given(w) => int_arg(w, "worker rank", CompletionError::new_err)?,
        Arg::Omitted => 0,
    };
    if worker < 0 {
        return Err(CompletionError::new_err(format!(
            "job {id}: worker rank must be >= 0, got {worker}"
        )));
    }
    let clamped = u32::try_from(worker.min(i128::from(u32::MAX))).expect("clamped");
    Ok((id, clamped, worker))
}

/// The arguments of a `complete(job, worker, ok)` call, converted.
pub struct Report {
    /// The job reported.
    pub job: JobId,
    /// The reporting worker's rank, clamped to `u32` (see [`completion`]).
    pub worker: u32,
    /// Whether the worker's part succeeded.
    pub ok: bool,
    /// The rank as given, for messages.
    given: i128,
}

impl Report {
    /// Converts the arguments (`worker` defaults to 0, `ok` to `True` when omitted; given, they
    /// must be an int and a bool: `None` or a truthy object fails closed, naming the value).
    pub fn new(job: &Bound<'_, PyAny>, worker: &Arg<'_>, ok: &Arg<'_>) -> PyResult<Self> {
        let (job, worker, given) = completion(job, worker)?;
        let ok = flag(ok, "ok", true, CompletionError::new_err)?;
        Ok(Self {
            job,
            worker,
            ok,
            given,
        })
    }

    /// The core's error for this report, naming the rank the caller passed.
    pub fn error(&self, e: Error) -> PyErr {
        completion_error(e, self.job, self.given, self.worker)
    }
}

/// Job ids of one worker report (`complete_many`): any iterable of integers; anything else
/// raises `UnknownJobError` naming the value.
pub fn report_ids(ids: &Bound<'_, PyAny>, worker: &Arg<'_>) -> PyResult<Vec<(JobId, u32, i128)>> {
    let iter = ids.try_iter().map_err(|_| {
        UnknownJobError::new_err(format!(
            "job ids must be an iterable of integers, got {}",
            describe(ids)
        ))
    })?;
    // Sized once from the sequence's length (a collect through `?` would grow it job by job).
    let mut out = Vec::with_capacity(ids.len().unwrap_or(0));
    for job in iter {
        out.push(completion(&job?, worker)?);
    }
    Ok(out)
}

/// Maps a core error of a completion, naming the rank the caller passed.
pub fn completion_error(e: Error, id: JobId, worker: i128, clamped: u32) -> PyErr {
    match e {
        Error::WorkerOutOfRange { num_workers, .. } if worker != i128::from(clamped) => {
            CompletionError::new_err(format!(
                "job {id}: worker rank {worker} is out of range, the engine has {num_workers} workers"
            ))
        }
        e => to_py(e),
    }
}

// ------------------------------------------------------------------------------------------
// Arguments of the scheduler, the tracker and the pool: every value of the wrong type or range
// raises a `kvoffload.errors` exception that names the argument and the value as given.
// ------------------------------------------------------------------------------------------

/// An integer argument: `Some(Ok(v))`, `Some(Err(()))` for an integer beyond `i128` (out of
/// every range), `None` for anything that is not an integer. Bools are not integers here;
/// numpy integers and other `__index__` types are.
pub fn int_value(obj: &Bound<'_, PyAny>) -> Option<Result<i128, ()>> {
    // The fast path: a plain `int` (never a bool: that is a subclass) within 64 bits.
    if obj.is_exact_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<i64>() {
            return Some(Ok(i128::from(v)));
        }
    }
    if obj.is_instance_of::<PyBool>() {
        return None;
    }
    match obj.extract::<i128>() {
        Ok(v) => Some(Ok(v)),
        Err(_) if obj.is_instance_of::<PyInt>() || obj.hasattr("__index__").unwrap_or(false) => {
            // An integer that does not fit in 128 bits (or an `__index__` that failed).
            obj.call_method0("__index__").ok().map(|_| Err(()))
        }
        Err(_) => None,
    }
}

/// A keyword argument of a constructor: omitted, or given (`None` included).
pub enum Arg<'py> {
    /// Not passed: the default applies.
    Omitted,
    /// Passed, with this value.
    Given(Bound<'py, PyAny>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Arg<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Arg::Given(obj.to_owned()))
    }
}

fn config_err(e: Error) -> PyErr {
    to_py(e)
}

/// A configuration integer (range checked by [`crate::config`]).
pub fn config_int(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<i128> {
    match int_value(obj) {
        Some(Ok(v)) => Ok(v),
        Some(Err(())) => Err(config_err(crate::config::type_error(
            field,
            "an integer below 2**127",
            describe(obj),
        ))),
        None => Err(config_err(crate::config::type_error(
            field,
            "an integer",
            describe(obj),
        ))),
    }
}

/// A configuration integer with a default when omitted; `None` is refused.
pub fn config_int_or(arg: &Arg<'_>, field: &str, default: i128) -> PyResult<i128> {
    match arg {
        Arg::Omitted => Ok(default),
        Arg::Given(v) => config_int(v, field),
    }
}

/// An optional configuration integer: omitted or `None` give `default`.
pub fn config_opt_int(arg: &Arg<'_>, field: &str, default: Option<i128>) -> PyResult<Option<i128>> {
    match arg {
        Arg::Omitted => Ok(default),
        Arg::Given(v) if v.is_none() => Ok(None),
        Arg::Given(v) => config_int(v, field).map(Some),
    }
}

/// A configuration number (an `int` or a `float`, not a `bool`) with a default when omitted,
/// else a `ConfigError`: `<field> must be <expected>, got <value>`; its range is checked by
/// [`crate::config`].
pub fn config_float_as(arg: &Arg<'_>, field: &str, expected: &str, default: f64) -> PyResult<f64> {
    match arg {
        Arg::Omitted => Ok(default),
        Arg::Given(v)
            if !is_bool(v) && (v.is_instance_of::<PyFloat>() || v.is_instance_of::<PyInt>()) =>
        {
            v.extract::<f64>()
                .map_err(|_| config_err(crate::config::type_error(field, expected, describe(v))))
        }
        Arg::Given(v) => Err(config_err(crate::config::type_error(
            field,
            expected,
            describe(v),
        ))),
    }
}

/// An optional configuration string: omitted gives `default`, `None` gives `None`.
pub fn config_opt_str(
    arg: &Arg<'_>,
    field: &str,
    default: Option<String>,
) -> PyResult<Option<String>> {
    match arg {
        Arg::Omitted => Ok(default),
        Arg::Given(v) if v.is_none() => Ok(None),
        Arg::Given(_) => config_str(arg, field, "a string", "").map(Some),
    }
}

/// An optional configuration path (a `str` or an `os.PathLike`): omitted gives `default`,
/// `None` gives `None`.
pub fn config_opt_path(
    arg: &Arg<'_>,
    field: &str,
    default: Option<PathBuf>,
) -> PyResult<Option<PathBuf>> {
    match arg {
        Arg::Omitted => Ok(default),
        Arg::Given(v) if v.is_none() => Ok(None),
        Arg::Given(v) if v.is_instance_of::<PyBytes>() => Err(config_err(
            crate::config::type_error(field, "a path", describe(v)),
        )),
        Arg::Given(v) => v
            .extract::<PathBuf>()
            .map(Some)
            .map_err(|_| config_err(crate::config::type_error(field, "a path", describe(v)))),
    }
}

/// CPU ids (`io_cpus`): a collection of integers, not a string; the core checks the ids.
pub fn cpu_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let expected = "a collection of CPU ids (integers)";
    let not_ids = || {
        config_err(crate::config::type_error(
            "io_cpus",
            expected,
            describe(obj),
        ))
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(not_ids());
    }
    let mut ids = Vec::new();
    for item in obj.try_iter().map_err(|_| not_ids())? {
        let item = item?;
        if is_bool(&item) {
            return Err(not_ids());
        }
        match int_value(&item).and_then(Result::ok).map(i64::try_from) {
            Some(Ok(id)) => ids.push(id),
            _ => {
                return Err(config_err(Error::Config(format!(
                    "io_cpus: {item:?} is not a CPU id (an integer)"
                ))))
            }
        }
    }
    Ok(ids)
}

/// A configuration flag: a `bool` (numpy bools included), nothing else.
pub fn config_bool(arg: &Arg<'_>, field: &str, default: bool) -> PyResult<bool> {
    match arg {
        Arg::Omitted => Ok(default),
        Arg::Given(v) if is_bool(v) => v.is_truthy(),
        Arg::Given(v) => Err(config_err(crate::config::type_error(
            field,
            "a bool",
            describe(v),
        ))),
    }
}

/// A `bool` argument (numpy bools included); anything else raises `err` naming it.
pub fn flag(arg: &Arg<'_>, what: &str, default: bool, err: fn(String) -> PyErr) -> PyResult<bool> {
    match arg {
        Arg::Omitted => Ok(default),
        Arg::Given(v) if is_bool(v) => v.is_truthy(),
        Arg::Given(v) => Err(err(format!("{what} must be a bool, got {}", describe(v)))),
    }
}

fn is_bool(v: &Bound<'_, PyAny>) -> bool {
    v.is_instance_of::<PyBool>()
        || v.get_type()
            .fully_qualified_name()
            .is_ok_and(|n| n == "numpy.bool" || n == "numpy.bool_")
}

/// A configuration string.
pub fn config_str(arg: &Arg<'_>, field: &str, expected: &str, default: &str) -> PyResult<String> {
    match arg {
        Arg::Omitted => Ok(default.to_owned()),
        Arg::Given(v) => v
            .cast::<PyString>()
            .ok()
            .and_then(|s| s.to_str().ok().map(str::to_owned))
            .ok_or_else(|| config_err(crate::config::type_error(field, expected, describe(v)))),
    }
}

/// A request id: a `str` (valid UTF-8), else `InvalidRequestError` naming `what` and the value.
pub fn request_id<'a>(obj: &'a Bound<'_, PyAny>, what: &str) -> PyResult<&'a str> {
    obj.cast::<PyString>()
        .ok()
        .and_then(|s| s.to_str().ok())
        .ok_or_else(|| bad_request_id(obj, what))
}

fn bad_request_id(obj: &Bound<'_, PyAny>, what: &str) -> PyErr {
    if obj.is_instance_of::<PyString>() {
        InvalidRequestError::new_err(format!(
            "{what} must be a str of valid UTF-8, got {}",
            describe(obj)
        ))
    } else {
        InvalidRequestError::new_err(format!("{what} must be a str, got {}", describe(obj)))
    }
}

/// An owned request id borrowed from its Python string (no copy).
pub fn request_id_owned(
    obj: Bound<'_, PyAny>,
    what: impl FnOnce() -> String,
) -> PyResult<pyo3::pybacked::PyBackedStr> {
    match obj.cast_into::<PyString>() {
        Ok(s) => pyo3::pybacked::PyBackedStr::try_from(s.clone())
            .map_err(|_| bad_request_id(s.as_any(), &what())),
        Err(e) => Err(bad_request_id(&e.into_inner(), &what())),
    }
}

/// The items of a sequence argument (a list, a tuple or any iterable, not a lone `str` or
/// `bytes`); anything else raises `err` naming `what` and the value.
pub fn items<'py>(
    obj: &Bound<'py, PyAny>,
    what: &(impl Display + ?Sized),
    expected: &(impl Display + ?Sized),
    err: fn(String) -> PyErr,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let bad = || err(format!("{what} must be {expected}, got {}", describe(obj)));
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(bad());
    }
    if let Some(items) = super::engine::items_prefetched(obj) {
        return Ok(items);
    }
    let iter = obj.try_iter().map_err(|_| bad())?;
    iter.collect::<PyResult<Vec<_>>>()
}

/// A sequence of request ids.
pub fn request_ids(
    obj: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<Vec<pyo3::pybacked::PyBackedStr>> {
    items(
        obj,
        what,
        "a sequence of request ids (str)",
        super::errors::StepInputError::new_err,
    )?
    .into_iter()
    .enumerate()
    .map(|(i, item)| request_id_owned(item, || format!("{what}[{i}]")))
    .collect()
}

/// A token count (`0..2**32`); anything else raises `err` naming `what` and the value.
pub fn tokens(obj: &Bound<'_, PyAny>, what: &str, err: fn(String) -> PyErr) -> PyResult<u32> {
    match int_value(obj) {
        Some(Ok(v)) if (0..=i128::from(u32::MAX)).contains(&v) => Ok(v as u32),
        Some(Ok(v)) => Err(err(format!("{what} must be in 0..2**32, got {v}"))),
        Some(Err(())) => Err(err(format!(
            "{what} must be in 0..2**32, got {}",
            describe(obj)
        ))),
        None => Err(err(format!(
            "{what} must be an integer, got {}",
            describe(obj)
        ))),
    }
}

/// A job id as given: an integer (`UnknownJobError` naming the value otherwise); ids that no
/// tracker could have issued (negative, beyond 64 bits) are unknown jobs.
pub fn job_id(obj: &Bound<'_, PyAny>) -> PyResult<JobId> {
    match int_value(obj) {
        Some(Ok(v)) => u64::try_from(v).map(JobId).map_err(|_| {
            UnknownJobError::new_err(format!("unknown job {v}: job ids are in 0..2**64"))
        }),
        Some(Err(())) => Err(UnknownJobError::new_err(format!(
            "unknown job {}: job ids are in 0..2**64",
            obj.repr()
                .map_or_else(|_| "?".to_owned(), |r| r.to_string())
        ))),
        None => Err(UnknownJobError::new_err(format!(
            "job id must be an integer, got {}",
            describe(obj)
        ))),
    }
}
