"""The torch data plane: moves KV-cache blocks between the engine's tensors and a CPU pool.

:class:`TransferEngine` runs on each worker (one per tensor-parallel rank) and executes the jobs
of a step plan. It is the only place in kvoffload that touches tensors; the Rust core never sees
a device pointer. One concept per module:

* :mod:`~kvoffload.transfer.layout`: registration of the engine's KV tensors (layouts, byte
  rows) and the tensor-major CPU pool (docs/design-notes.md, "Tensor-major CPU slots").
* :mod:`~kvoffload.transfer.jobs`: what a job is: its rows of a packed runs buffer, its
  progress, its result.
* :mod:`~kvoffload.transfer.plan`: making jobs: a plan's packed runs checked once in the core
  (:meth:`TransferEngine.step_packed`), or transfers checked and packed with numpy.
* :mod:`~kvoffload.transfer.ids`: job ids as arguments, and the ids an engine has seen.
* :mod:`~kvoffload.transfer.completions`: finished jobs: the hand-over, host waits, results.
* :mod:`~kvoffload.transfer.execute`: issuing one job's copies, on either device; failures.
* :mod:`~kvoffload.transfer.cpu`: CPU engines: the core copier and one copy thread per
  direction.
* :mod:`~kvoffload.transfer.cuda`: CUDA engines: the pinned pool, copy streams and events.
* :mod:`~kvoffload.transfer.options`: the engine's arguments, checked before any allocation.
* :mod:`~kvoffload.transfer.resources`: lanes, streams and the registration, released once.
* :mod:`~kvoffload.transfer.engine`: :class:`TransferEngine`: the worker step, waits and
  fences, polling, shutdown, threads and lifetime.
"""

from kvoffload.transfer.engine import TransferEngine
from kvoffload.transfer.jobs import BlockIds, JobKind, Transfer, TransferResult
from kvoffload.transfer.layout import GroupCaches, LayerCache, Layout

__all__ = [
    "BlockIds",
    "GroupCaches",
    "JobKind",
    "LayerCache",
    "Layout",
    "Transfer",
    "TransferEngine",
    "TransferResult",
]
