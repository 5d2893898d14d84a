"""Disk tier throughput against a plain positioned write / read loop of the same bytes, and the
engine thread's stall, in one run (DESIGN.md §7: ≥ 80% of the plain loop for 2 MiB
chunks; the engine's thread loses < 1% to disk I/O).

Run::

    .venv/bin/python benches/bench_disk.py [--dir DIR] [--chunks 128] [--rounds 5] [--pairs 120]

or as part of ``make bench`` (``pytest -s benches/bench_disk.py``). Three measurements:

* **write-behind**: ``DiskWorker`` write jobs of 16 chunks of 2 MiB from a registered CPU pool
  (checksum; each slot's zeroed header block and data in one write; one ``fdatasync`` per job;
  then the headers) against a plain loop that writes the same slots of another file of the same
  layout (the 4 KiB header block and the 2 MiB of data, one ``os.pwritev`` per chunk) with one
  ``fdatasync`` per 16 chunks: the bytes a committed slot holds, the tier's sync policy, the
  tier's ``O_DIRECT`` choice.
* **promotion**: ``DiskWorker`` promote jobs (header block and data read in one request into the
  pool, header and checksum verified) against ``os.preadv`` of the same slots.
* **engine-thread stall**: the probe of ``disk_stall.py`` (its documentation says how it works)
  on the same worker, after the throughput rounds: a control, a validation with a known stall,
  the disk tier's loss, and the floor's (the same bytes moved by a plain loop in a child
  process), flat out.

The plain loop runs on a thread at the tier's I/O threads' CPU priority (nice 19 where the
system allows it): a loop at the engine's priority gets the CPU first on a loaded machine and
the ratio would measure the priority, not the I/O path. Tier and plain loop alternate job by
job (16 chunks, each side first in turn), so both see the same machine; every round's ratio is
reported (other processes move both numbers: compare ratios of one run).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import tempfile
import threading
import time
from typing import Any

import disk_stall
from disk_jobs import CHUNK, HEADER, PER_JOB, SLOT, Floor, aligned, jobs, pool, run, worker


class _Plain:
    """The plain loop on its own thread at CPU priority ``nice`` (Linux: per thread): every
    slot's header block and data, one positioned call per chunk, one ``fdatasync`` per job's
    chunks after writing them."""

    def __init__(self, path: str, buf: memoryview, hdr: memoryview, direct: bool, nice: int):
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o644)
        self.buf, self.hdr, self.nice = buf, hdr, nice
        self.todo: queue.Queue[tuple[bool, range] | None] = queue.Queue()
        self.done: queue.Queue[float] = queue.Queue()
        self.thread = threading.Thread(target=self._loop)
        self.thread.start()

    def _loop(self) -> None:
        if self.nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        while (work := self.todo.get()) is not None:
            write, chunks = work
            t = time.perf_counter()
            for i in chunks:
                piece = [self.hdr, self.buf[i * CHUNK : (i + 1) * CHUNK]]
                if write:
                    os.pwritev(self.fd, piece, i * SLOT)
                else:
                    os.preadv(self.fd, piece, i * SLOT)
            if write:
                os.fdatasync(self.fd)
            self.done.put(time.perf_counter() - t)

    def run(self, write: bool, chunks: range) -> float:
        """Seconds the loop took over ``chunks``."""
        self.todo.put((write, chunks))
        return self.done.get()

    def close(self) -> None:
        self.todo.put(None)
        self.thread.join()
        os.close(self.fd)


def measure(
    root: str, n: int = 128, rounds: int = 5, pairs: int = 120, phase_s: float = 0.1
) -> dict[str, Any]:
    """Runs every measurement; returns the figures."""
    mem, view = pool(n)
    hmem, _ = aligned(HEADER)
    w = worker(os.path.join(root, "tier"), n, view)
    run(w, jobs("write", 1, 1 << 30, 1))  # the I/O thread has started (and set its priority)
    st = w.stats()[0]
    direct = bool(st["direct"])
    nice = 19 if st["io_threads_low_priority"] else 0
    plain = _Plain(os.path.join(root, "plain.bin"), memoryview(mem), memoryview(hmem), direct, nice)
    times: dict[str, list[float]] = {k: [] for k in ("tw", "pw", "tr", "pr")}
    next_id = 1
    # Tier and plain loop alternate job by job (16 chunks, tens of milliseconds), so both see
    # the same machine; the first round warms up (files allocated) and is not counted.
    for r in range(rounds):
        acc = dict.fromkeys(times, 0.0)
        for kind, write in (("write", True), ("promote", False)):
            batch = jobs(kind, n, next_id, gen=r + 1)
            next_id += len(batch)
            for j, job in enumerate(batch):
                chunks = range(j * PER_JOB, j * PER_JOB + len(job[4]))
                for side in ("tier", "plain") if (r + j) % 2 == 0 else ("plain", "tier"):
                    if side == "tier":
                        acc["tw" if write else "tr"] += run(w, [job])
                    else:
                        acc["pw" if write else "pr"] += plain.run(write, chunks)
        if r > 0 or rounds == 1:
            for k, v in acc.items():
                times[k].append(v)
    plain.close()
    gb = n * CHUNK / 1e9
    out: dict[str, Any] = {
        "write_ratios": [p / t for p, t in zip(times["pw"], times["tw"], strict=True)],
        "read_ratios": [p / t for p, t in zip(times["pr"], times["tr"], strict=True)],
    }
    for name, secs in times.items():
        out[name + "_gb_s"] = [gb / x for x in secs]
    floor = Floor(os.path.join(root, "floor.bin"), n, direct, nice)
    try:
        out["stall"] = disk_stall.measure(w, n, next_id, rounds, pairs, phase_s, floor=floor)
    finally:
        floor.close()
    out["direct"] = direct
    out["nice"] = nice
    out["cpus"] = os.cpu_count() or 1
    io = w.stats()[0]
    out["direct_pieces"] = io["direct_pieces"]
    out["buffered_pieces"] = io["buffered_pieces"]
    w.close()
    return out


def _row(xs: list[float], fmt: str) -> str:
    return " ".join(format(x, fmt) for x in xs)


def report(f: dict[str, Any]) -> str:
    mode = "O_DIRECT" if f["direct"] else "buffered (O_DIRECT refused by the file system)"
    med = statistics.median
    lines = [
        f"disk tier, 2 MiB chunks, {mode}, {f['cpus']} CPUs; plain loops at nice {f['nice']} "
        "(the tier's I/O threads' priority)",
        f"  write-behind {med(f['tw_gb_s']):.2f} GB/s vs plain pwritev loop "
        f"{med(f['pw_gb_s']):.2f} GB/s: median {med(f['write_ratios']):.0%} (goal >= 80%); "
        f"rounds: {_row(f['write_ratios'], '.0%')}",
        f"  promotion    {med(f['tr_gb_s']):.2f} GB/s vs plain preadv loop "
        f"{med(f['pr_gb_s']):.2f} GB/s: median {med(f['read_ratios']):.0%} (goal >= 80%); "
        f"rounds: {_row(f['read_ratios'], '.0%')}",
        disk_stall.report(f["stall"]),
    ]
    return "\n".join(lines)


def test_disk_tier_throughput_and_stall(tmp_path: object) -> None:
    """``make bench``: prints the figures (no wall-clock assertion)."""
    print()
    print(report(measure(str(tmp_path))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="directory on the file system to measure (default: a temp dir)")
    p.add_argument("--chunks", type=int, default=128, help="2 MiB chunks per round")
    p.add_argument("--rounds", type=int, default=5, help="throughput rounds (the first warms up)")
    p.add_argument("--pairs", type=int, default=120, help="pairs of phases per stall experiment")
    p.add_argument("--phase-s", type=float, default=0.1, help="seconds of one stall probe phase")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        print(report(measure(d, args.chunks, args.rounds, args.pairs, args.phase_s)))


if __name__ == "__main__":
    main()
