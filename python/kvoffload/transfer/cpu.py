"""CPU engines: the core copier and one background copy thread (lane) per direction.

Copies run on one thread per direction, so they really overlap with the caller, with the same
API and guarantees as on CUDA. The :class:`kvoffload._core.Copier` is built once from the
storages of the registered tensors and the pool (it holds them, so the memory outlives it): a
job names rows by group, region and row index, and the core checks every row against the
registration before a byte moves, so no call can read or write outside registered memory. A
lane takes the GIL once per job: a caller that holds the GIL (an engine loop spinning while it
waits for a load) cannot stall the copies. A lane holds the engine's runtime only while a job
runs, never the engine itself, so an engine dropped without ``shutdown`` (even in a reference
cycle, even collected on its own copy thread) stops its lanes and frees its pool. Why the CPU copy
runs in the core rather than in torch: ``docs/design-notes.md``.

Lanes are daemon threads (an engine never shut down must not hold the interpreter open), so at
interpreter exit every live lane is stopped, its queued jobs cancelled, and joined while the
interpreter is still whole (``atexit`` runs before daemon threads are torn down): a lane torn
down inside a copy, with the GIL released in the core, would abort the process.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import torch

from kvoffload._core import Copier
from kvoffload.transfer.completions import _Completions
from kvoffload.transfer.execute import _CANCELLED, _execute, _Runtime
from kvoffload.transfer.jobs import _Job
from kvoffload.transfer.layout import _Group


def _lane_main(
    jobs: queue.SimpleQueue[_Job | None],
    runtime: weakref.ReferenceType[_Runtime],
    sink: _Completions,
    cancel: threading.Event,
) -> None:
    """A copy thread: runs one direction's jobs in submission order until it gets ``None``.

    Holds the runtime only while a job runs, so the engine can be collected (and its finalizer
    stop this thread) while the thread waits for work.
    """
    while True:
        job = jobs.get()
        if job is None:
            return
        rt = runtime()
        try:
            if rt is None:
                job.error = f"{_CANCELLED} (the engine was collected)"
            else:
                _execute(job, rt, cancel, non_blocking=False)
        except BaseException as exc:  # pragma: no cover - _execute catches Exception
            job.error = f"{type(exc).__name__}: {exc}"
        finally:
            rt = None
            job.t_done = time.perf_counter()
            sink.push(job)


class _Lane:
    """A background thread that runs one direction's jobs in submission order (CPU engines)."""

    # Every lane not collected yet, for the exit hook.
    live: ClassVar[weakref.WeakSet[_Lane]] = weakref.WeakSet()

    def __init__(self, name: str, runtime: _Runtime, sink: _Completions) -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.cancel = threading.Event()
        self._thread = threading.Thread(
            target=_lane_main,
            args=(self._queue, weakref.ref(runtime), sink, self.cancel),
            name=name,
            daemon=True,
        )
        self._thread.start()
        _Lane.live.add(self)

    def put(self, job: _Job) -> None:
        self._queue.put(job)

    def stop(self, *, cancel: bool) -> None:
        """Ask the thread to end after the jobs already put (cancelling them if ``cancel``)."""
        if cancel:
            self.cancel.set()
        self._queue.put(None)

    def join(self) -> None:
        """Wait for the thread to end, unless this is that thread (it ends after this job)."""
        if self._thread is not threading.current_thread():
            self._thread.join()


@atexit.register
def _stop_lanes_at_exit() -> None:
    """Stops every live lane (queued jobs cancelled, the running copy finished) and joins it."""
    lanes = list(_Lane.live)
    for lane in lanes:
        lane.stop(cancel=True)
    for lane in lanes:
        lane.join()


def _storage_bytes(x: torch.Tensor) -> npt.NDArray[np.uint8]:
    """All bytes of a CPU tensor's storage, as a 1-D uint8 numpy array sharing its memory."""
    flat = torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage())
    return flat.numpy()


def _build_copier(groups: Sequence[_Group]) -> Copier:
    """The core copier of a CPU engine: every KV tensor's storage and the pool, registered.

    The copier holds numpy views of those storages (so the memory outlives it) and checks
    every copied row against them.
    """
    buffers: list[npt.NDArray[np.uint8]] = []
    index: dict[tuple[int, int], int] = {}

    def buffer_of(t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in index:
            index[key] = len(buffers)
            buffers.append(_storage_bytes(t))
        return index[key]

    layout = []
    for g in groups:
        regions = []
        for r in g.regions:
            regions.append(
                (
                    buffer_of(r.gpu),
                    int(r.gpu.storage_offset()),
                    r.gpu.stride(0),
                    buffer_of(r.cpu),
                    int(r.cpu.storage_offset()),
                    r.cpu.stride(0),
                    r.bytes_per_block,
                )
            )
        layout.append((g.num_blocks, g.num_cpu_blocks, regions))
    return Copier(buffers, layout)
