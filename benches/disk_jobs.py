"""What the disk benches share: the slot layout, a registered pool and a ``DiskWorker`` over it,
and tier jobs of 16 chunks of 2 MiB (``bench_disk.py``, ``disk_stall.py``)."""

from __future__ import annotations

import mmap
import time

import numpy as np

from kvoffload._core import DiskWorker

CHUNK = 2 << 20
PER_JOB = 16
HEADER = 4096
SLOT = HEADER + CHUNK


def aligned(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Page-aligned, writable memory (an anonymous mapping) and a uint8 view of it."""
    m = mmap.mmap(-1, nbytes)
    return m, np.frombuffer(m, dtype=np.uint8)


def pool(n: int) -> tuple[mmap.mmap, np.ndarray]:
    """A pool of ``n`` chunks of random bytes."""
    mem, view = aligned(n * CHUNK)
    view[:] = np.random.default_rng(0).integers(0, 256, n * CHUNK, dtype=np.uint8)
    return mem, view


def worker(path: str, n: int, view: np.ndarray) -> DiskWorker:
    """A worker with one I/O thread over ``n`` slots of ``view``, a slab file of ``n`` slots."""
    return DiskWorker(
        path, n * SLOT, [view], [(n, 16, [(0, 0, CHUNK, CHUNK)])], blocks_per_chunk=1, threads=1
    )


def job(job_id: int, kind: str, n: int, slots: range, gen: int, idle: bool = False) -> tuple:
    """One job over disk slots ``slots`` (the same CPU slots of a pool of ``n``); an ``idle``
    job names a CPU slot outside the pool, so the worker fails it at once, before any I/O."""
    cpu = [n + 1] * len(slots) if idle else list(slots)
    keys = [1000 + i for i in slots]
    return (job_id, kind, "disk", 0, keys, cpu, list(slots), [gen] * len(slots))


def jobs(kind: str, n: int, first_id: int, gen: int) -> list[tuple]:
    """Jobs of 16 chunks over slots ``0..n``."""
    starts = range(0, n, PER_JOB)
    return [
        job(first_id + j, kind, n, range(s, min(n, s + PER_JOB)), gen) for j, s in enumerate(starts)
    ]


def run(w: DiskWorker, batch: list[tuple], ok: bool = True) -> float:
    """Seconds from submitting ``batch`` until every job finished (each as ``ok``)."""
    t = time.perf_counter()
    w.submit(batch)
    done = w.wait([j[0] for j in batch], timeout=600)
    dt = time.perf_counter() - t
    assert len(done) == len(batch), done
    assert all(r == ok for _, r in done), done
    return dt
