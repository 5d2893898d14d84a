//! Python bindings: the only place that mentions pyo3.
//!
//! Each submodule wraps one domain type in a `#[pyclass(frozen)]` holding a lock, converts
//! Python inputs into owned Rust values before taking the lock, and maps [`crate::Error`] to
//! the exceptions of `kvoffload.errors`.

mod convert;
mod copy;
mod engine;
mod errors;
mod pool;
mod remote;
mod scheduler;
mod sync;
mod tier;
mod tier_worker;
mod tracker;

use pyo3::prelude::*;

/// The extension's allocator. Inside an engine the process heap is glibc's, large and
/// fragmented by the engine's own objects: there a step's short-lived vectors cost several
/// hundred nanoseconds each in `malloc` (a fifth of the connector's time inside vLLM at 512
/// requests). mimalloc keeps the extension's allocations in its own thread-local pages.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The extension module `kvoffload._core`.
#[pymodule]
mod _core {
    #[pymodule_export]
    use super::copy::{check_runs, Copier};
    #[pymodule_export]
    use super::errors::{
        CompletionError, ConfigError, DuplicateReportError, InternalError, InvalidBlockError,
        InvalidKeyError, InvalidRequestError, KeyStateError, KvOffloadError, RequestStateError,
        StepInputError, TierIOError, TierInUseError, TierPathError, UnknownJobError,
        UnknownKeyError, UnknownRequestError,
    };
    #[pymodule_export]
    use super::pool::{CpuPool, StorePlan};
    #[pymodule_export]
    use super::remote::{namespace_digest, RemoteClient, RemoteWorker};
    #[pymodule_export]
    use super::scheduler::{CompletedJob, Scheduler, StepPlan, TransferJob};
    #[pymodule_export]
    use super::tier_worker::{check_io_cpus, disk_inspect, DiskWorker, TierWorker};
    #[pymodule_export]
    use super::tracker::JobTracker;

    use pyo3::prelude::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("RUN_WORDS", crate::runs::RUN_WORDS)?;
        m.add("TIER_ROW_WORDS", super::tier::TIER_ROW_WORDS)
    }
}
