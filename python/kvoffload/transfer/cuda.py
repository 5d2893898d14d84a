"""CUDA engines: the pinned CPU pool, copy streams and per-job events.

One stream per direction. Before a job's copies, an event is recorded on the current (compute)
stream and the copy stream waits on it, so a store reads its blocks after the compute that
wrote them and a load writes its blocks after the compute that last used them. An end event per
job tells completion; ``wait`` blocks the host on it and ``fence`` makes the compute stream
wait on it instead. The pool is pinned with ``cudaHostRegister`` on a plain allocation (torch's
pinned allocator rounds sizes up to a power of two, which would nearly double a large pool).
Each copy costs a few µs of host time, so many scattered small blocks are bound by that
(``benches/gpu_transfer.py`` measures it).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import time
from typing import Any

import torch

from kvoffload.transfer.completions import _Completions
from kvoffload.transfer.execute import _execute, _Runtime
from kvoffload.transfer.jobs import _Job


def _cuda_ok(err: object) -> bool:
    """Whether a ``torch.cuda.cudart()`` return value is ``cudaSuccess``."""
    code: Any = getattr(err, "value", err)
    return int(code) == 0


def _clear_cuda_last_error() -> None:
    """Reset the CUDA runtime's last error after a failed ``cudaHostRegister``.

    The runtime keeps the error until ``cudaGetLastError`` reads it, and torch's next kernel
    launch check would report it as its own. ``torch.cuda.cudart()`` does not expose
    ``cudaGetLastError``; call it on the libcudart torch loaded (best effort, Linux).
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception:  # pragma: no cover - best effort on a path only a GPU reaches
        return


def _allocate_pool(nbytes: int, pin: bool) -> tuple[torch.Tensor, bool, int | None]:
    """Allocate the pool; pin it with cudaHostRegister when ``pin`` (no power-of-2 growth).

    The registered range is page-aligned and page-rounded inside a slightly larger plain
    allocation, so it never shares a page with another registration (which would fail).

    Returns:
        The pool, whether it is pinned, and the pointer to pass to ``cudaHostUnregister``
        when it was registered here (None otherwise).
    """
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8), False, None
    page = mmap.PAGESIZE
    raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
    start = (-raw.data_ptr()) % page
    pool = raw[start : start + nbytes]
    ptr = pool.data_ptr()
    cudart = torch.cuda.cudart()
    if _cuda_ok(cudart.cudaHostRegister(ptr, -(-nbytes // page) * page, 0)):
        if pool.is_pinned():
            return pool, True, ptr
        cudart.cudaHostUnregister(ptr)
    else:
        _clear_cuda_last_error()
    # Fallback: torch's pinned allocator (may round the allocation up to a power of two).
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True, None


def _submit_on_stream(
    job: _Job, rt: _Runtime, stream: torch.cuda.Stream, device: torch.device, sink: _Completions
) -> None:
    """Enqueue ``job``'s copies on ``stream``, ordered after the current (compute) stream.

    The job's end event tells completion. A CUDA error while enqueueing fails the job once the
    stream is idle and hands it to ``sink`` at once (it has no end event to wait on).
    """
    try:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            _execute(job, rt, None, non_blocking=True)
            end = torch.cuda.Event()
            end.record(stream)
        job.end_event = end
    except Exception as exc:  # no end event (a CUDA error): fail it once the stream is idle
        job.error = job.error or f"{type(exc).__name__}: {exc}"
        job.end_event = None
        with contextlib.suppress(Exception):  # the job's error is already recorded
            stream.synchronize()
        job.t_done = time.perf_counter()
        sink.push(job)
