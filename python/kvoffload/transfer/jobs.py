"""What a job is: its rows of a packed runs buffer, its progress, its result.

A job's copies are *runs*: rows of a packed little-endian ``uint32`` buffer (job index, group,
first GPU block, first CPU position, length; ``RUN_WORDS`` words, ``rust/runs.rs``) where both
the GPU blocks and the CPU positions are consecutive; each run is one copy per registered tensor
(:attr:`TransferResult.copies` counts them). How jobs are checked and made:
:mod:`~kvoffload.transfer.plan`. Executors record progress on the :class:`_Job`; the engine
turns it into a :class:`TransferResult` once (:mod:`~kvoffload.transfer.completions`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, SupportsIndex, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvoffload._core import RUN_WORDS

BlockIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
"""A one-dimensional sequence of integer block ids or CPU positions."""
Transfer: TypeAlias = tuple[SupportsIndex, BlockIds, BlockIds]
"""``(group, gpu_blocks, cpu_blocks)``; ``cpu_blocks[i] = slot * blocks_per_chunk + offset``."""
JobKind: TypeAlias = Literal["store", "load"]
"""``"store"`` copies GPU blocks to the CPU pool, ``"load"`` copies them back."""


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


@dataclass(slots=True, eq=False)
class _Job:
    """A validated job: its rows of a packed runs buffer, plus progress written by whoever
    executes it."""

    job_id: int
    kind: JobKind
    runs: bytes
    start: int
    end: int
    planned_bytes: int
    planned_copies: int
    bytes: int = 0
    copies: int = 0
    error: str | None = None
    t_submit: float = 0.0
    t_done: float | None = None
    finished: bool = False
    """Set by ``_Completions.push`` (CPU lanes, failed CUDA enqueues)."""
    end_event: torch.cuda.Event | None = None

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
