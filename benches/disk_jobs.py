"""What the disk benches share: the slot layout, a registered pool and a ``DiskWorker`` over it,
and tier jobs of 16 chunks of 2 MiB (``bench_disk.py``, ``disk_stall.py``), and the floor
(the same bytes moved by a plain loop in a child process, ``disk_stall.py``)."""

from __future__ import annotations

import collections
import mmap
import os
import subprocess
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


def worker(path: str, n: int, view: np.ndarray, io_cpus: list[int] | None = None) -> DiskWorker:
    """A worker with one I/O thread over ``n`` slots of ``view``, a slab file of ``n`` slots
    (the thread pinned to ``io_cpus`` when given)."""
    return DiskWorker(
        path,
        n * SLOT,
        [view],
        [(n, 16, [(0, 0, CHUNK, CHUNK)])],
        blocks_per_chunk=1,
        threads=1,
        io_cpus=io_cpus,
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


def floor_exe() -> str:
    """The floor's binary (``benches/tools/disk_floor.rs``), built first (a no-op if up to date)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = ["cargo", "build", "--release", "-q", "--example", "disk_floor"]
    subprocess.run(cmd, cwd=root, check=True)
    return os.path.join(root, "target", "release", "examples", "disk_floor")


class Floor:
    """The floor (``benches/tools/disk_floor.rs``): the tier's jobs' bytes moved by a plain
    positioned write / read loop with CRC-32C, in a child process at CPU priority ``nice``
    (and on CPUs ``cpus`` when given, as the tier's pinned I/O threads), over a slab file of
    ``n`` slots at ``path``; jobs are submitted and polled like a worker's."""

    def __init__(
        self, path: str, n: int, direct: bool, nice: int, cpus: list[int] | None = None
    ) -> None:
        args = [floor_exe(), path, str(n), "1" if direct else "0"]
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if nice:
            os.setpriority(os.PRIO_PROCESS, self.p.pid, nice)
        if cpus is not None:  # single-threaded: its one thread is the process
            os.sched_setaffinity(self.p.pid, cpus)
        assert self.p.stdin is not None
        assert self.p.stdout is not None
        self.tx, self.rx = self.p.stdin.fileno(), self.p.stdout.fileno()
        ready = self.p.stdout.readline()
        if ready != b"ready\n":
            raise RuntimeError(f"disk_floor did not start: {ready!r}, rc {self.p.wait()}")
        os.set_blocking(self.rx, False)
        self.pending: collections.deque[int] = collections.deque()
        self.buf = b""

    def submit(self, job_id: int, kind: str, slots: range) -> None:
        os.write(
            self.tx, f"{'w' if kind == 'write' else 'r'} {slots.start} {len(slots)}\n".encode()
        )
        self.pending.append(job_id)

    def poll(self) -> list[tuple[int, bool]]:
        """Jobs finished since the last poll, as ``(job id, ok)``."""
        try:
            data = os.read(self.rx, 4096)
        except BlockingIOError:
            return []
        if not data:
            raise RuntimeError(f"disk_floor ended: rc {self.p.wait()}")
        *lines, self.buf = (self.buf + data).split(b"\n")
        return [(self.pending.popleft(), line == b"ok") for line in lines]

    def cpu_ns(self) -> int:
        """CPU nanoseconds the child has used so far (schedstat)."""
        with open(f"/proc/{self.p.pid}/schedstat") as f:
            return int(f.read().split()[0])

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        self.p.wait(timeout=60)
