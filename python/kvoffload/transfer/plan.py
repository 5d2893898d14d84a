"""Making jobs: a plan's packed runs checked once in the core, or transfers checked here.

A step plan's jobs share the plan's runs buffer as the core made it (:func:`_plan_packed`: the
core checks every row once, ``rust/runs.rs``, and each job keeps its row range; no per-block
list is built). A job given as transfers ``(group, gpu_blocks, cpu_blocks)`` is checked here and
packed the same way (:func:`_plan`, with numpy: the runs are where both the GPU block ids and
the CPU positions are consecutive). Either way nothing is queued for a bad job, and the error
names the job, transfer or row and the value.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import SupportsIndex

import numpy as np
import numpy.typing as npt

from kvoffload._core import RUN_WORDS, check_runs
from kvoffload.errors import InvalidBlockError, TransferError
from kvoffload.transfer.ids import _ids, _index
from kvoffload.transfer.jobs import JobKind, Transfer, _Job
from kvoffload.transfer.layout import _Group


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
