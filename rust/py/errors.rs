//! The exception hierarchy of `kvoffload.errors` and the one mapping from [`crate::Error`].

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::PyErr;

use crate::error::Error;

create_exception!(
    kvoffload.errors,
    KvOffloadError,
    PyException,
    "Base class of every kvoffload error."
);
create_exception!(
    kvoffload.errors,
    ConfigError,
    KvOffloadError,
    "A configuration value is out of range or inconsistent."
);
create_exception!(
    kvoffload.errors,
    UnknownJobError,
    KvOffloadError,
    "A job id that was never issued."
);
create_exception!(
    kvoffload.errors,
    CompletionError,
    KvOffloadError,
    "A completion report the job table refuses: the job already completed, or the worker rank is out of range."
);
create_exception!(
    kvoffload.errors,
    DuplicateReportError,
    CompletionError,
    "A second report of one job from the same worker rank (nothing changes)."
);
create_exception!(
    kvoffload.errors,
    InvalidBlockError,
    KvOffloadError,
    "A GPU block id that is not an integer in the engine's block range."
);
create_exception!(
    kvoffload.errors,
    InvalidRequestError,
    KvOffloadError,
    "A request id of the wrong type or range."
);
create_exception!(
    kvoffload.errors,
    RequestStateError,
    KvOffloadError,
    "An operation the request's current state does not allow."
);

create_exception!(
    kvoffload.errors,
    UnknownKeyError,
    KvOffloadError,
    "A key the CPU pool holds no entry for."
);
create_exception!(
    kvoffload.errors,
    KeyStateError,
    KvOffloadError,
    "An operation the key's current state in the CPU pool does not allow."
);
create_exception!(
    kvoffload.errors,
    InvalidKeyError,
    KvOffloadError,
    "A key that is not an int in 0..2**128 or bytes."
);

create_exception!(
    kvoffload.errors,
    StepInputError,
    KvOffloadError,
    "A malformed step input: a field of the wrong type or shape, or lists of different lengths."
);

create_exception!(
    kvoffload.errors,
    UnknownRequestError,
    KvOffloadError,
    "A request id that is not registered (or was dropped after it finished)."
);

create_exception!(
    kvoffload.errors,
    InternalError,
    KvOffloadError,
    "A bug inside kvoffload (a Rust panic). The object it happened in refuses every later call \
     with this error, since its state may be half-applied: build a new one."
);
create_exception!(
    kvoffload.errors,
    TierIOError,
    KvOffloadError,
    "An operating-system I/O failure of a lower tier (a full disk, a read error): not a configuration error."
);
create_exception!(
    kvoffload.errors,
    TierInUseError,
    KvOffloadError,
    "A disk tier directory another engine (or a `kvoffload disk verify`) holds: one owner per directory."
);
create_exception!(
    kvoffload.errors,
    TierPathError,
    ConfigError,
    "A path in a disk tier directory the tier will not use (a symbolic link, not a regular file, hard-linked elsewhere, another user's)."
);

/// Maps a core error to its Python exception.
// By value so that call sites read `.map_err(to_py)`.
#[allow(clippy::needless_pass_by_value)]
pub fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Config(_) => ConfigError::new_err(msg),
        Error::UnknownJob(_) => UnknownJobError::new_err(msg),
        Error::JobAlreadyCompleted(_)
        | Error::JobNotPlanned(_)
        | Error::WorkerOutOfRange { .. } => CompletionError::new_err(msg),
        Error::DuplicateReport { .. } => DuplicateReportError::new_err(msg),
        Error::BlockOutOfRange { .. } | Error::EmptyJob(_) => InvalidBlockError::new_err(msg),
        Error::OwnerBusy { .. } | Error::RequestState { .. } => RequestStateError::new_err(msg),
        Error::UnknownRequest(_) => UnknownRequestError::new_err(msg),
        Error::StepInputLength { .. } => StepInputError::new_err(msg),
        Error::UnknownKey(_) => UnknownKeyError::new_err(msg),
        Error::KeyNotReady(_) | Error::KeyNotPinned(_) => KeyStateError::new_err(msg),
        Error::Io(_) => TierIOError::new_err(msg),
        Error::TierInUse { .. } => TierInUseError::new_err(msg),
        Error::TierPath { .. } => TierPathError::new_err(msg),
    }
}
