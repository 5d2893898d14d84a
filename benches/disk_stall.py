"""The engine thread's stall under disk I/O (issue 14: the engine's Python thread loses < 1% of
its time to the disk tier), measured by a probe that is itself validated in the same run.

Run (about 2 minutes on a quiet 2-core machine, ``--pairs`` scales it; longer on a loaded
one, where the drains wait for the starved nice-19 I/O thread's jobs)::

    .venv/bin/python benches/disk_stall.py [--dir DIR] [--pairs 120] [--phase-s 0.1]

**The probe.** This thread is the engine: it runs steps of 5 ms, each a busy loop standing for
the model's work, then what an engine does between forward passes: it polls the ``DiskWorker``
for finished jobs and submits the next ones (two jobs of 16 chunks of 2 MiB in flight: a
write-behind, then a promotion of the same slots, round the slab). No other Python thread
runs, so no GIL is handed over. Its speed is busy-loop iterations per wall second over a phase.
Phases of ``--phase-s`` alternate between two conditions A and B (ABBA order, so drift
cancels); between phases, steps without submitting let the jobs in flight finish (not
measured). The loss is ``1 - rate(B) / rate(A)``, the ratio's geometric mean over the pairs,
± 2 standard errors. Three experiments, each A = *idle*, where the same calls run with
jobs that fail at once without I/O (and count as in flight as long as the last disk job of
their kind took, so polls and submits come alike):

* **control**: B = idle too. Must read 0 within its ± (else the probe is biased).
* **stall**: B = idle plus a Python thread that holds the GIL for ``--stall-ms`` every 10 ms
  (one C call, ``sum`` over a range, which never lets the GIL go). It must read what the thread
  held, ``expected`` (at least that: the engine also waits to get the GIL back), so a loss of
  that size is seen.
* **disk**: B = the jobs do their I/O on the tier's thread. The goal is met when the whole
  interval ``mean ± 2 s.e.`` lies below 1%.

Per condition the report gives what explains a loss: the engine thread's share of the wall time
on a CPU and waiting for one (schedstat), and the cores used by the tier's I/O threads, this
process, other processes with the kernel, and the hypervisor (steal), and the disk jobs'
throughput: a disk phase whose jobs moved nothing (an I/O thread starved by other load)
measured nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import threading
import time
from typing import Any

from disk_jobs import CHUNK, PER_JOB, job, pool, worker

from kvoffload._core import DiskWorker

STEP_S = 0.005
KINDS = ("write", "promote")


class Engine:
    """The engine's step loop on the calling thread (see the module documentation).

    Disk jobs follow one sequence: per pass over the slab (a new generation), each range of 16
    slots is written then promoted; the worker's single I/O thread runs them in order, so a
    promotion always reads what the write before it committed. Idle jobs take the shape of the
    next disk job without advancing the sequence."""

    def __init__(self, w: DiskWorker, n: int, first_id: int, gen: int, depth: int = 2) -> None:
        self.w, self.n, self.next_id, self.gen0, self.depth = w, n, first_id, gen, depth
        self.pos = 0  # next disk job in the sequence
        self.ranges = (n + PER_JOB - 1) // PER_JOB
        self.inflight: dict[int, tuple[str, str, float]] = {}  # id: mode, kind, submitted
        self.failed: set[int] = set()  # idle jobs reported, waiting out a disk job's time
        self.took = {"write": 0.03, "promote": 0.03}
        self.iters = 0
        self.moved = 0  # bytes the disk jobs wrote or read

    def _submit(self, mode: str, now: float) -> None:
        rnd, within = divmod(self.pos, 2 * self.ranges)
        r, kind = within // 2, KINDS[within % 2]
        slots = range(r * PER_JOB, min(self.n, (r + 1) * PER_JOB))
        one = job(self.next_id, kind, self.n, slots, self.gen0 + rnd + 1, idle=mode == "idle")
        if mode == "disk":
            self.pos += 1
        self.inflight[self.next_id] = (mode, kind, now)
        self.next_id += 1
        self.w.submit([one])

    def step(self, mode: str | None) -> None:
        """One step: busy until the step's end, then poll, then submit jobs of ``mode`` up to
        the depth (``None``: submit nothing, and idle jobs end when reported)."""
        end, n = time.perf_counter() + STEP_S, 0
        while True:
            for _ in range(200):
                n += 1
            if time.perf_counter() >= end:
                break
        self.iters += n
        now = time.perf_counter()
        for job_id, ok in self.w.poll():
            m, kind, t0 = self.inflight[job_id]
            assert ok == (m == "disk"), (job_id, m, ok)
            if m == "disk":
                self.took[kind] = now - t0
                self.moved += PER_JOB * CHUNK
                del self.inflight[job_id]
            else:
                self.failed.add(job_id)
        for job_id in [j for j in self.failed if mode is None or self._waited(j, now)]:
            self.failed.discard(job_id)
            del self.inflight[job_id]
        while mode is not None and len(self.inflight) < self.depth:
            self._submit(mode, now)

    def _waited(self, job_id: int, now: float) -> bool:
        """Whether idle job ``job_id`` has been in flight as long as a disk job of its kind."""
        _, kind, t0 = self.inflight[job_id]
        return now - t0 >= self.took[kind]

    def drain(self) -> None:
        """Steps without submitting until no job is in flight (idle jobs do not wait out a
        disk job's time)."""
        limit = time.perf_counter() + 600
        while self.inflight:
            assert time.perf_counter() < limit, f"jobs never finished: {self.inflight}"
            self.step(None)

    def phase(self, mode: str, seconds: float) -> tuple[float, float]:
        """Steps in ``mode`` for ``seconds``; (iterations per wall second, wall seconds)."""
        i0, t0 = self.iters, time.perf_counter()
        while (t := time.perf_counter()) - t0 < seconds:
            self.step(mode)
        return (self.iters - i0) / (t - t0), t - t0


class GilStall:
    """A Python thread that, while ``on``, holds the GIL for ``hold_s`` every ``every_s`` in
    one C call that never lets it go, and adds up the time it held it (``held``)."""

    def __init__(self, hold_s: float, every_s: float = 0.01) -> None:
        t = min(_timed(lambda: sum(range(200_000))) for _ in range(20))
        self.k = max(1, int(200_000 * hold_s / t))
        self.pause = every_s - hold_s
        self.on = threading.Event()
        self.stop = False
        self.held = 0.0
        self.thread = threading.Thread(target=self._loop, name="gil-stall")
        self.thread.start()

    def _loop(self) -> None:
        while self.on.wait() and not self.stop:
            time.sleep(self.pause)
            if not self.on.is_set():
                continue
            t = time.perf_counter()
            sum(range(self.k))
            self.held += time.perf_counter() - t

    def close(self) -> None:
        self.stop = True
        self.on.set()
        self.thread.join()


def _timed(f: Any) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _threads_cpu() -> dict[str, int]:
    """CPU nanoseconds used so far by this process's threads, by name (schedstat)."""
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:  # a thread that ended meanwhile
            continue
        out[name] = out.get(name, 0) + ns
    return out


def _sched(tid: int) -> tuple[int, int]:
    """(on-CPU ns, ns waiting on a run queue) of thread ``tid`` so far (schedstat)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run, wait, _ = (int(x) for x in f.read().split())
    return run, wait


def _machine() -> tuple[int, int, int]:
    """(busy, steal, total) jiffies of the whole machine so far (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    steal = v[7] if len(v) > 7 else 0
    return sum(v) - idle - steal, steal, sum(v)


class _Tally:
    """One condition's phases: rates and what the CPUs did meanwhile."""

    def __init__(self) -> None:
        self.rates: list[float] = []
        self.speeds: list[float] = []  # iterations per second on a CPU
        self.wall = self.on_cpu = self.waiting = self.tier = self.ours = 0.0
        self.moved = 0
        self.machine = [0, 0, 0]

    def measure(self, e: Engine, mode: str, seconds: float) -> None:
        me = threading.get_native_id()
        c0, m0, s0, b0 = _threads_cpu(), _machine(), _sched(me), e.moved
        rate, wall = e.phase(mode, seconds)
        s1, m1, c1 = _sched(me), _machine(), _threads_cpu()
        self.moved += e.moved - b0
        self.rates.append(rate)
        self.speeds.append(rate * wall / max((s1[0] - s0[0]) / 1e9, 1e-9))
        self.wall += wall
        self.on_cpu += (s1[0] - s0[0]) / 1e9
        self.waiting += (s1[1] - s0[1]) / 1e9
        used = {k: (v - c0.get(k, 0)) / 1e9 for k, v in c1.items()}
        self.tier += sum(v for k, v in used.items() if k.startswith("kvoffload-tier"))
        self.ours += sum(used.values())
        self.machine = [a + b - c for a, b, c in zip(self.machine, m1, m0, strict=True)]

    def cpu(self) -> dict[str, float]:
        busy, steal, total = self.machine
        cores = (os.cpu_count() or 1) / max(total, 1)
        return {
            "on_cpu": self.on_cpu / self.wall,
            "waiting": self.waiting / self.wall,
            "tier_threads": self.tier / self.wall,
            "this_process": self.ours / self.wall,
            "others": max(0.0, busy * cores - self.ours / self.wall),
            "steal": steal * cores,
            "mb_s": self.moved / self.wall / 1e6,
        }


def _loss(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """B's loss against A over pairs: ``1 - exp(mean(log(b / a)))`` (a mean of ratios would
    read B slower by the noise alone), its standard error (delta method) and the median."""
    logs = [math.log(y / x) for x, y in zip(a, b, strict=True)]
    m = statistics.fmean(logs)
    se = math.exp(m) * statistics.stdev(logs) / len(logs) ** 0.5
    return 1 - math.exp(m), se, 1 - math.exp(statistics.median(logs))


def experiment(
    e: Engine, b_mode: str, pairs: int, phase_s: float, stall: GilStall | None = None
) -> dict[str, Any]:
    """``pairs`` pairs of phases, A idle and B in ``b_mode`` (with ``stall`` on in B)."""
    a, b = _Tally(), _Tally()
    held = 0.0
    for i in range(pairs):
        for side in "ab" if i % 2 == 0 else "ba":
            if side == "b" and stall is not None:
                h0 = stall.held
                stall.on.set()
                b.measure(e, b_mode, phase_s)
                stall.on.clear()
                held += stall.held - h0
            else:
                (a if side == "a" else b).measure(e, "idle" if side == "a" else b_mode, phase_s)
            e.drain()
    mean, se, median = _loss(a.rates, b.rates)
    slower, slower_se, _ = _loss(a.speeds, b.speeds)
    return {
        "mean": mean,
        "se": se,
        "median": median,
        "slower": slower,
        "slower_se": slower_se,
        "expected": held / b.wall if stall is not None else 0.0,
        "a": a.cpu(),
        "b": b.cpu(),
    }


def measure(
    w: DiskWorker,
    n: int,
    first_id: int,
    gen: int,
    pairs: int = 120,
    phase_s: float = 0.1,
    stall_ms: float = 1.0,
) -> dict[str, Any]:
    """The three experiments on worker ``w`` (``n`` slots whose generation is ``gen``)."""
    e = Engine(w, n, first_id, gen)
    while e.pos < 2 * e.ranges:  # warm up: the slab written once, the loop's code hot
        e.step("disk")
    e.drain()
    out = {"control": experiment(e, "idle", pairs, phase_s)}
    gil = GilStall(stall_ms / 1e3)
    try:
        out["stall"] = experiment(e, "idle", pairs, phase_s, gil)
    finally:
        gil.close()
    out["disk"] = experiment(e, "disk", pairs, phase_s)
    out["pairs"], out["phase_s"], out["stall_ms"] = pairs, phase_s, stall_ms
    return out


def _cpu_line(name: str, c: dict[str, float]) -> str:
    return (
        f"      {name:5}: engine thread on a CPU {c['on_cpu']:.1%} of the time, waiting for one "
        f"{c['waiting']:.1%}; cores used: tier I/O threads {c['tier_threads']:.3f}, this "
        f"process {c['this_process']:.3f}, other processes and kernel {c['others']:.3f}, "
        f"steal {c['steal']:.3f}; disk jobs moved {c['mb_s']:.0f} MB/s"
    )


def report(f: dict[str, Any]) -> str:
    """The experiments' results, each with its verdict."""
    lines = [
        f"engine-thread stall probe: {f['pairs']} pairs of {f['phase_s']:g} s phases per "
        f"experiment, steps of {STEP_S * 1e3:g} ms; loss = 1 - rate(B) / rate(A) of busy-loop "
        "iterations per wall second, geometric mean over the pairs ± 2 s.e. (median); the "
        "goal is decided when the whole interval lies on one side of 1%"
    ]
    for name, b in (
        ("control", "idle again"),
        ("stall", f"idle + a thread holding the GIL {f['stall_ms']:g} ms every 10 ms"),
        ("disk", "disk I/O on the tier's thread"),
    ):
        x = f[name]
        lo, hi = x["mean"] - 2 * x["se"], x["mean"] + 2 * x["se"]
        if name == "control":
            verdict = "unbiased: 0 within ±" if lo <= 0 <= hi else "BIASED: 0 outside ±"
        elif name == "stall":
            ok = lo <= x["expected"] * 1.5 and hi >= x["expected"]
            verdict = f"expected >= {x['expected']:.2%}: " + ("seen" if ok else "NOT seen")
        else:
            verdict = "goal < 1%: " + (
                "met" if hi < 0.01 else "NOT met" if lo >= 0.01 else "not decided by this run"
            )
        lines.append(
            f"  {name:7} A idle, B {b}: loss {x['mean']:+.2%} ± {2 * x['se']:.2%} "
            f"({x['median']:+.2%}); {verdict}"
        )
        lines.append(_cpu_line("A", x["a"]))
        lines.append(_cpu_line("B", x["b"]))
        lines.append(
            f"      iterations per second on a CPU (interference, not scheduling): "
            f"{x['slower']:+.2%} ± {2 * x['slower_se']:.2%} fewer in B"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="directory on the file system to measure (default: a temp dir)")
    p.add_argument("--chunks", type=int, default=128, help="2 MiB chunks in the slab")
    p.add_argument("--pairs", type=int, default=120, help="pairs of phases per experiment")
    p.add_argument("--phase-s", type=float, default=0.1, help="seconds of one phase")
    p.add_argument("--stall-ms", type=float, default=1.0, help="GIL held per 10 ms (stall)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        _, view = pool(args.chunks)
        w = worker(os.path.join(d, "tier"), args.chunks, view)
        try:
            f = measure(w, args.chunks, 1, 0, args.pairs, args.phase_s, args.stall_ms)
        finally:
            w.close()
        print(report(f))


if __name__ == "__main__":
    main()
