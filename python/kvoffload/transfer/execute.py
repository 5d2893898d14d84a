"""Issuing one job's copies, on either device, and what a failed copy means.

CPU engines copy through the Rust core (:class:`kvoffload._core.Copier`, bounds-checked, the
GIL released): the whole job in one call, split over ``cpu_copy_threads`` threads when large,
or, while a per-copy test hook is set, one call per run per tensor so the hook runs before
each. CUDA engines issue one ``copy_(non_blocking=True)`` per run per tensor on the current
(copy) stream.

**Failures.** A copy that raises marks its job failed (``ok=False`` from ``poll``); the job
never hangs. Nothing becomes visible on failure because visibility is the scheduler's
decision: it does not publish a failed store, and it recomputes the blocks of a failed load.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload._core import Copier
from kvoffload.transfer.jobs import _Job
from kvoffload.transfer.layout import _Group

_PARALLEL_MIN_BYTES = 2 << 20
"""CPU engines split a job of at least this many bytes over their copy threads (a hand-off to a
helper thread costs tens of µs, one 2 MiB memcpy ~100 µs)."""


_CANCELLED = "cancelled by shutdown"


@dataclass(frozen=True, slots=True)
class _Hooks:
    """Test hooks: slow copies down, gate them, or make them fail."""

    copy_delay_s: float
    before_copy: Callable[[int, int], None] | None
    fault_injector: Callable[[int], None] | None

    @property
    def per_copy(self) -> bool:
        """Whether a hook runs before every copy (so copies are issued one by one)."""
        return self.copy_delay_s > 0.0 or self.before_copy is not None


class _Runtime:
    """What executing a job needs: the groups, the core copier (CPU engines) and the hooks.

    Only the engine holds it strongly; copy threads hold a weak reference between jobs, so a
    hook that refers back to the engine's owner cannot keep the engine alive.
    """

    __slots__ = ("__weakref__", "copier", "groups", "hooks", "parts")

    def __init__(
        self, groups: tuple[_Group, ...], copier: Copier | None, hooks: _Hooks, parts: int
    ) -> None:
        self.groups = groups
        self.copier = copier
        self.hooks = hooks
        self.parts = parts


class _CancelledError(Exception):
    """Raised inside a copy loop when shutdown(wait=False) cancels the job."""


def _execute(
    job: _Job,
    rt: _Runtime,
    cancel: threading.Event | None,
    *,
    non_blocking: bool,
) -> None:
    """Issue every copy of ``job``; record progress and the first error on the job. Never raises.

    CPU engines copy through the core (:class:`kvoffload._core.Copier`, bounds-checked, GIL
    released): the whole job in one call, or, while a per-copy test hook is set, one call per
    run per tensor so the hook runs before each. CUDA engines issue one ``copy_`` per run per
    tensor on the current (copy) stream.

    Args:
        job: The job to run.
        rt: The engine's runtime.
        cancel: When set, the job stops before its next copy and is reported cancelled.
        non_blocking: Pass ``non_blocking`` to ``copy_`` (CUDA copies from/to pinned memory).
    """
    store = job.kind == "store"
    hooks = rt.hooks
    copier = rt.copier
    try:
        if cancel is not None and cancel.is_set():
            raise _CancelledError
        if hooks.fault_injector is not None:
            hooks.fault_injector(job.job_id)
        if copier is not None and not hooks.per_copy:
            # One call per job: the lane takes the GIL once per job, not once per run, so an
            # engine loop that holds the GIL cannot stall the copies (measured inside vLLM: a
            # 12.8 MB load took 160-280 ms when copied run by run under a busy engine loop).
            # The rows are read in place from the plan's packed buffer.
            threads = rt.parts if job.planned_bytes >= _PARALLEL_MIN_BYTES else 1
            job.bytes = copier.copy_packed(store, job.runs, job.start, job.end, threads)
            job.copies = job.planned_copies
            return
        for i, (_, group, g0, c0, n) in enumerate(job.rows(), job.start):
            for ri, r in enumerate(rt.groups[group].regions):
                if cancel is not None and cancel.is_set():
                    raise _CancelledError
                if hooks.copy_delay_s > 0.0:
                    time.sleep(hooks.copy_delay_s)
                if hooks.before_copy is not None:
                    hooks.before_copy(job.job_id, job.copies)
                if copier is not None:
                    job.bytes += copier.copy_packed(store, job.runs, i, i + 1, 1, ri)
                elif store:
                    r.cpu[c0 : c0 + n].copy_(r.gpu[g0 : g0 + n], non_blocking=non_blocking)
                    job.bytes += n * r.bytes_per_block
                else:
                    r.gpu[g0 : g0 + n].copy_(r.cpu[c0 : c0 + n], non_blocking=non_blocking)
                    job.bytes += n * r.bytes_per_block
                job.copies += 1
    except _CancelledError:
        job.error = _CANCELLED
    except Exception as exc:  # a failed copy fails its job, never the engine
        job.error = f"{type(exc).__name__}: {exc}"
