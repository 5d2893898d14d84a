"""What a job is: validated packed runs, its progress, its result, its id.

A job's copies are *runs*: rows of a packed little-endian ``uint32`` buffer (job index, group,
first GPU block, first CPU position, length; ``RUN_WORDS`` words, ``rust/runs.rs``) where both
the GPU blocks and the CPU positions are consecutive; each run is one copy per registered tensor
(:attr:`TransferResult.copies` counts them). A step plan's jobs share the plan's buffer as the
core made it (:func:`_plan_packed`: checked once, in the core; each job keeps its row range).
A job given as transfers ``(group, gpu_blocks, cpu_blocks)`` is checked here and packed the
same way (:func:`_plan`, with numpy). Nothing is queued for a bad job. Executors record
progress on the :class:`_Job`; finished jobs go to a :class:`_Completions` list that ``poll``
drains, each exactly once. :class:`_IdRanges` remembers which job ids an engine has seen, in
bounded memory (``docs/design-notes.md``, "Bounded memory of job ids").
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

from kvoffload._core import RUN_WORDS, check_runs
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


class _Job:
    """A validated job: its rows of a packed runs buffer, plus progress written by whoever
    executes it."""

    __slots__ = (
        "bytes",
        "copies",
        "end",
        "end_event",
        "error",
        "finished",
        "job_id",
        "kind",
        "planned_bytes",
        "planned_copies",
        "runs",
        "start",
        "t_done",
        "t_submit",
    )

    def __init__(
        self,
        job_id: int,
        kind: JobKind,
        runs: bytes,
        start: int,
        end: int,
        planned_bytes: int,
        planned_copies: int,
    ) -> None:
        self.job_id = job_id
        self.kind: JobKind = kind
        self.runs = runs
        self.start = start
        self.end = end
        self.planned_bytes = planned_bytes
        self.planned_copies = planned_copies
        self.bytes = 0
        self.copies = 0
        self.error: str | None = None
        self.t_submit = 0.0
        self.t_done: float | None = None
        self.finished = False  # set by _Completions.push (CPU lanes, failed CUDA enqueues)
        self.end_event: torch.cuda.Event | None = None

    def rows(self) -> list[list[int]]:
        """The job's runs: ``[job index, group, gpu start, cpu start, length]`` each."""
        packed = np.frombuffer(self.runs, dtype="<u4").reshape(-1, RUN_WORDS)
        return packed[self.start : self.end].tolist()  # type: ignore[no-any-return]

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
    """Thread-safe list of finished jobs, drained by ``poll``; a host waits on it for a job
    (one condition per engine, not an event per job: a step may make hundreds of jobs)."""

    def __init__(self) -> None:
        self._lock = threading.Condition(threading.Lock())
        self._jobs: list[_Job] = []

    def push(self, job: _Job) -> None:
        """Hand over a finished job: it is marked finished and its waiters wake."""
        with self._lock:
            job.finished = True
            self._jobs.append(job)
            self._lock.notify_all()

    def wait(self, job: _Job, timeout: float | None) -> bool:
        """Wait until ``job`` was pushed (at most ``timeout`` seconds); whether it was."""
        with self._lock:
            return self._lock.wait_for(lambda: job.finished, timeout)

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
    runs: list[npt.NDArray[np.int64]] = []
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
        rows = np.empty((starts.size, RUN_WORDS), dtype=np.int64)
        rows[:, 0] = 0
        rows[:, 1] = group
        rows[:, 2] = g[starts]
        rows[:, 3] = c[starts]
        rows[:, 4] = lengths
        runs.append(rows)
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
    packed = np.concatenate(runs).astype("<u4").tobytes() if runs else b""
    return _Job(jid, kind, packed, 0, len(packed) // (4 * RUN_WORDS), planned_bytes, planned_copies)


def _plan_packed(
    shapes: list[tuple[int, int, int, int]],
    load_jobs: object,
    store_jobs: object,
    runs: object,
) -> tuple[list[_Job], list[_Job]]:
    """Validate a plan's packed runs for its load and store jobs (in the core, once) and make
    its jobs, which share the buffer; changes nothing.

    ``shapes`` holds ``(num_blocks, num_cpu_blocks, bytes_per_block, regions)`` per group.
    """
    loads = _ids(load_jobs, "step_packed load_jobs")
    stores = _ids(store_jobs, "step_packed store_jobs")
    if isinstance(runs, bytes):
        buf = runs
    else:
        try:
            buf = memoryview(runs).cast("B").tobytes()  # type: ignore[arg-type]
        except TypeError:
            raise TransferError(
                "step_packed runs must be bytes (or a contiguous buffer), got "
                f"{type(runs).__name__}"
            ) from None
    n = len(loads)
    spans = check_runs(buf, n + len(stores), n, shapes)
    made = [
        _Job(jid, "load" if i < n else "store", buf, *span)
        for i, (jid, span) in enumerate(zip([*loads, *stores], spans, strict=True))
    ]
    return made[:n], made[n:]


def _ids(xs: object, what: str) -> list[int]:
    """Job ids of a plan; raises TransferError naming the bad value."""
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable):
        raise TransferError(f"{what} must be an iterable of job ids, got {xs!r}")
    return [_index(x, f"{what}: job id", TransferError) for x in xs]
