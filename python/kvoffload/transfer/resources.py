"""What a :class:`~kvoffload.transfer.TransferEngine` must release exactly once.

The copy lanes (CPU engines), the copy streams (CUDA engines) and the pool's page-locked
registration are released by :meth:`_Resources.release`, from ``shutdown`` or from the engine's
finalizer, whichever comes first; the second call does nothing.
"""

from __future__ import annotations

import threading

import torch

from kvoffload.transfer.cpu import _Lane
from kvoffload.transfer.jobs import JobKind


class _Resources:
    """What must be released exactly once: lanes, streams, the registration."""

    def __init__(self) -> None:
        self.lanes: dict[JobKind, _Lane] = {}
        self.streams: dict[JobKind, torch.cuda.Stream] = {}
        self.registered_ptr: int | None = None
        self.released = False
        self._lock = threading.Lock()

    def release(self, *, cancel: bool, join: bool) -> None:
        """Stop the lanes (joining them if ``join``), synchronise the streams, unregister the
        pool. Idempotent.

        The engine's finalizer passes ``join=False``: it may run on any thread, one of the lanes
        included, during a garbage collection; a lane holds what it copies alive until its job
        ends, so nothing needs to wait for it.
        """
        with self._lock:
            if self.released:
                return
            self.released = True
        for lane in self.lanes.values():
            lane.stop(cancel=cancel)
        if join:
            for lane in self.lanes.values():
                lane.join()
        for stream in self.streams.values():
            stream.synchronize()  # GPU copies cannot be cancelled; they must end before unpinning
        if self.registered_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self.registered_ptr)
            self.registered_ptr = None
