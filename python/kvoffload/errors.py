"""Exceptions raised by kvoffload.

Every error is a subclass of :class:`KvOffloadError`. Messages name the offending id or value,
and an operation that raises leaves all state unchanged. The classes are defined by the Rust
extension (so the core raises them directly) and re-exported here.
"""

from kvoffload._core import (
    CompletionError,
    ConfigError,
    InvalidBlockError,
    InvalidKeyError,
    InvalidRequestError,
    KeyStateError,
    KvOffloadError,
    RequestStateError,
    UnknownJobError,
    UnknownKeyError,
)

__all__ = [
    "CompletionError",
    "ConfigError",
    "InvalidBlockError",
    "InvalidKeyError",
    "InvalidRequestError",
    "KeyStateError",
    "KvOffloadError",
    "RequestStateError",
    "UnknownJobError",
    "UnknownKeyError",
]
