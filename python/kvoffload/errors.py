"""Exceptions raised by kvoffload.

Every error is a subclass of :class:`KvOffloadError`. Messages name the offending id or value,
and an operation that raises leaves all state unchanged. Most classes are defined by the Rust
extension (so the core raises them directly) and re-exported here; the data plane's own errors
(:class:`RegistrationError`, :class:`TransferError`, :class:`EngineClosedError`) are plain Python
subclasses defined below.
"""

from kvoffload._core import (
    CompletionError,
    ConfigError,
    DuplicateReportError,
    InternalError,
    InvalidBlockError,
    InvalidKeyError,
    InvalidRequestError,
    KeyStateError,
    KvOffloadError,
    RequestStateError,
    StepInputError,
    TierInUseError,
    TierIOError,
    TierPathError,
    UnknownJobError,
    UnknownKeyError,
    UnknownRequestError,
)

__all__ = [
    "CompletionError",
    "ConfigError",
    "DuplicateReportError",
    "EngineClosedError",
    "InternalError",
    "InvalidBlockError",
    "InvalidKeyError",
    "InvalidRequestError",
    "KeyStateError",
    "KvOffloadError",
    "RegistrationError",
    "RequestStateError",
    "StepInputError",
    "TierIOError",
    "TierInUseError",
    "TierPathError",
    "TransferError",
    "UnknownJobError",
    "UnknownKeyError",
    "UnknownRequestError",
]


class RegistrationError(KvOffloadError):
    """The KV cache tensors handed to the data plane are unusable.

    Raised up front, before anything is allocated, for a wrong layout, mismatched ``num_blocks``
    within a KV group, mixed dtypes or devices, or an unsupported device. The message names the
    group, layer and tensor, and the offending value.
    """


class TransferError(KvOffloadError):
    """A transfer job is malformed: unknown group, length mismatch, duplicate job id, etc.

    Nothing of the job was queued or submitted. Out-of-range block ids raise
    :class:`InvalidBlockError` instead.
    """


class EngineClosedError(KvOffloadError):
    """The :class:`~kvoffload.transfer.TransferEngine` was used after ``shutdown()``."""
