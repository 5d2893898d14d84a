"""kvoffload: offload LLM KV-cache blocks to CPU memory and load them back, safely.

The face of the package, importable from here:

* :class:`OffloadScheduler`, configured by :class:`OffloadConfig` and :class:`KvGroup`, driven
  per step with :class:`StepInput`: the engine-facing scheduler (:mod:`kvoffload.scheduler`).
  Its results are :class:`StepPlan`, :class:`TransferJob`, :class:`CompletedJob` and
  :class:`ResetResult`.
* :class:`TransferEngine` and its :class:`TransferResult`: the torch data plane on each worker
  (:mod:`kvoffload.transfer`). Imported on first use, so ``import kvoffload`` works without
  torch (an optional dependency) until the data plane is needed.
* :class:`KvOffloadError`, the base of every error (:mod:`kvoffload.errors` has the others).

The Rust core's scheduler stays public for engines and tools that drive the core directly:
:class:`Scheduler` (what :class:`OffloadScheduler` wraps). Every class with counters has a
``stats()`` method returning a snapshot dict.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvoffload._core import Scheduler, __version__
from kvoffload.errors import KvOffloadError
from kvoffload.scheduler import (
    CompletedJob,
    KvGroup,
    OffloadConfig,
    OffloadScheduler,
    ResetResult,
    StepInput,
    StepPlan,
    TransferJob,
)

if TYPE_CHECKING:
    from kvoffload.transfer import TransferEngine, TransferResult

__all__ = [
    "CompletedJob",
    "KvGroup",
    "KvOffloadError",
    "OffloadConfig",
    "OffloadScheduler",
    "ResetResult",
    "Scheduler",
    "StepInput",
    "StepPlan",
    "TransferEngine",
    "TransferJob",
    "TransferResult",
    "__version__",
]

_LAZY = {"TransferEngine": "kvoffload.transfer", "TransferResult": "kvoffload.transfer"}
"""Names whose module imports torch: loaded on first access (PEP 562)."""


def __getattr__(name: str) -> object:
    """Imports the data plane on first use of one of its names."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
