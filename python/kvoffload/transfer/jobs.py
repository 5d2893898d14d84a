"""What a job is: transfers validated into runs, its progress, its result, its id.

A job is a list of transfers ``(group, gpu_blocks, cpu_blocks)``. :func:`_plan` checks every
value against the registered groups (nothing is queued for a bad job) and finds, with numpy, the
runs where both the GPU block ids and the CPU positions are consecutive: each run is one copy
per registered tensor (:attr:`TransferResult.copies` counts them). Executors record progress on
the :class:`_Job`; finished jobs go to a :class:`_Completions` list that ``poll`` drains, each
exactly once. :class:`_IdRanges` remembers which job ids an engine has seen, in bounded memory
(``docs/design-notes.md``, "Bounded memory of job ids").
"""

from __future__ import annotations

import bisect
import operator
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, SupportsIndex, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.errors import (
    InvalidBlockError,
    TransferError,
    UnknownJobError,
)
from kvoffload.transfer.layout import _Group

BlockIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
"""A one-dimensional sequence of integer block ids or CPU positions."""
Transfer: TypeAlias = tuple[SupportsIndex, BlockIds, BlockIds]
"""``(group, gpu_blocks, cpu_blocks)``; ``cpu_blocks[i] = slot * blocks_per_chunk + offset``."""
JobKind: TypeAlias = Literal["store", "load"]
"""``"store"`` copies GPU blocks to the CPU pool, ``"load"`` copies them back."""


_MAX_ID_RANGES = 4096
"""Ranges of job ids an engine remembers exactly (see :class:`_IdRanges`)."""


@dataclass(frozen=True, slots=True)
class TransferResult:
    """Outcome of one finished job, returned once by :meth:`TransferEngine.poll`.

    Attributes:
        job_id: The job's id.
        kind: ``"store"`` or ``"load"``.
        ok: Whether every copy of the job succeeded. A failed store must not be published and
            a failed load's blocks must be recomputed.
        bytes: Bytes copied (for a successful job, all bytes of the job).
        copies: Copies issued: one per run of consecutive blocks per registered tensor.
        seconds: Host time from submission to completion (on CUDA, to the moment the host
            observed completion). ``0.0`` for a job cancelled before submission.
        error: Why the job failed, or ``None``.
    """

    job_id: int
    kind: JobKind
    ok: bool
    bytes: int
    copies: int
    seconds: float
    error: str | None


_Run = tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]
"""``(group, gpu_starts, cpu_starts, lengths)`` for the runs of one transfer."""


class _Job:
    """A validated job: its runs, plus progress written by whoever executes it."""

    __slots__ = (
        "bytes",
        "copies",
        "done",
        "end_event",
        "error",
        "job_id",
        "kind",
        "planned_bytes",
        "planned_copies",
        "runs",
        "t_done",
        "t_submit",
    )

    def __init__(
        self,
        job_id: int,
        kind: JobKind,
        runs: list[_Run],
        planned_bytes: int,
        planned_copies: int,
    ) -> None:
        self.job_id = job_id
        self.kind: JobKind = kind
        self.runs = runs
        self.planned_bytes = planned_bytes
        self.planned_copies = planned_copies
        self.bytes = 0
        self.copies = 0
        self.error: str | None = None
        self.t_submit = 0.0
        self.t_done: float | None = None
        self.done = threading.Event()
        self.end_event: torch.cuda.Event | None = None

    def result(self) -> TransferResult:
        """The job's result; call once it is done."""
        t_done = self.t_done if self.t_done is not None else time.perf_counter()
        return TransferResult(
            job_id=self.job_id,
            kind=self.kind,
            ok=self.error is None,
            bytes=self.bytes,
            copies=self.copies,
            seconds=max(0.0, t_done - self.t_submit) if self.t_submit else 0.0,
            error=self.error,
        )


class _Completions:
    """Thread-safe list of finished jobs, drained by ``poll``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[_Job] = []

    def push(self, job: _Job) -> None:
        with self._lock:
            self._jobs.append(job)

    def push_back(self, jobs: list[_Job]) -> None:
        """Return drained jobs that could not be handed out (they come first next time)."""
        with self._lock:
            self._jobs[:0] = jobs

    def drain(self) -> list[_Job]:
        with self._lock:
            jobs, self._jobs = self._jobs, []
        return jobs


class _IdRanges:
    """The job ids an engine has accepted, as sorted disjoint ranges ``[lo, hi)``.

    The scheduler's ids grow by one, so this is one range in practice. Past ``limit`` ranges the
    two lowest merge: an id in a gap that old then counts as known (finished), never the
    reverse, so a live job is never reported unknown and memory stays bounded.
    """

    def __init__(self, limit: int = _MAX_ID_RANGES) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        self._limit = limit

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self._lo, x) - 1
        return i >= 0 and x < self._hi[i]

    def __len__(self) -> int:
        return len(self._lo)

    def add(self, x: int) -> None:
        lo, hi = self._lo, self._hi
        i = bisect.bisect_right(lo, x) - 1  # the range starting at or before x
        if i >= 0 and x < hi[i]:
            return
        if i >= 0 and hi[i] == x:
            hi[i] = x + 1
            if i + 1 < len(lo) and lo[i + 1] == x + 1:  # joins the next range
                hi[i] = hi[i + 1]
                del lo[i + 1], hi[i + 1]
        elif i + 1 < len(lo) and lo[i + 1] == x + 1:
            lo[i + 1] = x
        else:
            lo.insert(i + 1, x)
            hi.insert(i + 1, x + 1)
            if len(lo) > self._limit:
                hi[0] = hi[1]
                del lo[1], hi[1]


def _job_id(x: object, where: str) -> int:
    """A job id: an integer (not a bool); raises UnknownJobError naming ``x``."""
    return _index(x, f"{where}: job id", UnknownJobError)


def _id_list(xs: object, where: str) -> list[int]:
    """Job ids from an iterable; raises UnknownJobError naming the bad value."""
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable):
        raise UnknownJobError(
            f"{where}: job ids must be an iterable of integers, got {xs!r} ({type(xs).__name__})"
        )
    return [_job_id(x, where) for x in xs]


def _index(x: object, name: str, exc: type[Exception]) -> int:
    """An integer argument (not a bool); raises ``exc`` naming ``name`` and the value."""
    if isinstance(x, bool):
        raise exc(f"{name} must be an integer, got {x!r}")
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise exc(f"{name} must be an integer, got {x!r} ({type(x).__name__})") from None


def _as_ids(x: object, what: str) -> npt.NDArray[np.int64]:
    """``x`` as a one-dimensional int64 array; raises TransferError naming ``what``."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise TransferError(f"{what} must be one-dimensional, got shape {a.shape}")
    if a.size == 0:
        return np.empty(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise TransferError(f"{what} must be integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_range(ids: npt.NDArray[np.int64], limit: int, what: str) -> None:
    """Raise InvalidBlockError naming the first id of ``ids`` outside ``[0, limit)``."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise InvalidBlockError(f"{what}[{bad}] = {int(ids[bad])} is out of range [0, {limit})")


def _plan_many(
    groups: Sequence[_Group],
    jobs: Iterable[tuple[SupportsIndex, Iterable[Transfer]]],
    kind: JobKind,
    what: str,
) -> list[_Job]:
    """Validate ``(job_id, transfers)`` pairs with :func:`_plan`; the first bad one raises."""
    if isinstance(jobs, (str, bytes)) or not isinstance(jobs, Iterable):
        raise TransferError(
            f"{what} must be an iterable of (job_id, transfers) pairs, got {jobs!r}"
        )
    out = []
    for i, item in enumerate(jobs):
        if not isinstance(item, Sequence) or isinstance(item, (str, bytes)) or len(item) != 2:
            raise TransferError(f"{what}[{i}] is not a (job_id, transfers) pair: {item!r}")
        out.append(_plan(groups, item[0], item[1], kind))
    return out


def _plan(
    groups: Sequence[_Group], job_id: SupportsIndex, transfers: Iterable[Transfer], kind: JobKind
) -> _Job:
    """Validate a job against the registered ``groups`` and compute its runs; changes nothing."""
    jid = _index(job_id, "job id", TransferError)
    runs: list[_Run] = []
    dests: dict[int, list[npt.NDArray[np.int64]]] = {}
    planned_bytes = 0
    planned_copies = 0
    if isinstance(transfers, (str, bytes)) or not isinstance(transfers, Iterable):
        raise TransferError(
            f"job {jid}: transfers must be an iterable of (group, gpu_blocks, cpu_blocks), "
            f"got {transfers!r}"
        )
    items = list(transfers)
    for i, transfer in enumerate(items):
        try:
            group_arg, gpu_arg, cpu_arg = transfer
            if isinstance(group_arg, bool):
                raise TypeError
            group = operator.index(group_arg)
        except (TypeError, ValueError):
            raise TransferError(
                f"job {jid}: transfer {i} is not a (group, gpu_blocks, cpu_blocks) triple: "
                f"{transfer!r}"
            ) from None
        if not 0 <= group < len(groups):
            raise TransferError(
                f"job {jid}: transfer {i} names group {group}, but "
                f"{len(groups)} groups are registered"
            )
        g = _as_ids(gpu_arg, f"job {jid}: transfer {i} gpu_blocks")
        c = _as_ids(cpu_arg, f"job {jid}: transfer {i} cpu_blocks")
        if g.size != c.size:
            raise TransferError(
                f"job {jid}: transfer {i} has {g.size} gpu_blocks but {c.size} cpu_blocks"
            )
        grp = groups[group]
        _check_range(g, grp.num_blocks, f"job {jid}: transfer {i} (group {group}) gpu_blocks")
        _check_range(c, grp.num_cpu_blocks, f"job {jid}: transfer {i} (group {group}) cpu_blocks")
        if g.size == 0:
            continue
        breaks = np.flatnonzero((np.diff(g) != 1) | (np.diff(c) != 1)) + 1
        starts = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
        lengths = np.diff(np.append(starts, g.size))
        runs.append((group, g[starts], c[starts], lengths))
        dests.setdefault(group, []).append(c if kind == "store" else g)
        planned_bytes += g.size * grp.bytes_per_block
        planned_copies += starts.size * len(grp.regions)
    for group, arrays in dests.items():
        d = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
        if d.size > 1 and not bool((np.diff(d) > 0).all()):  # increasing: distinct
            d = np.sort(d)
            same = np.flatnonzero(d[1:] == d[:-1])
            if same.size:
                side = "cpu_blocks" if kind == "store" else "gpu_blocks"
                raise TransferError(
                    f"job {jid}: group {group} writes {side} {int(d[same[0]])} twice"
                )
    return _Job(jid, kind, runs, planned_bytes, planned_copies)
