"""The engine thread's stall under disk I/O (DESIGN.md §7: the engine's Python thread loses < 1% of
its time to the disk tier), measured by a probe that is itself validated in the same run, and
set against a floor: what moving the same bytes costs the engine thread without our tier.

Run (``--pairs 120``: about 3 minutes on a quiet 2-core machine, each rate in ``--mbps``
adds about 1 minute; longer on a loaded one, where the drains wait for the starved nice-19 I/O
threads' jobs). The long reading, the one that decides::

    cd benches && ../.venv/bin/python disk_stall.py --pairs 1000 --mbps 250 500 0
    cd benches && ../.venv/bin/python disk_stall.py --pairs 1000 --mbps 250 0 --io-cpus 1

To narrow the tier's interval alone (±2 s.e. shrinks as 1/sqrt(pairs): 4000 pairs halve the
±1% of 1000), ``--no-floor`` leaves out the floor's experiments and ``--check-pairs`` runs the
control and the stall, which only validate the probe, on fewer pairs::

    cd benches && ../.venv/bin/python disk_stall.py --pairs 3500 --check-pairs 1500 \
        --mbps 250 0 --io-cpus 1 --no-floor

**The probe.** This thread is the engine: it runs steps of 5 ms, each a busy loop standing for
the model's work, then what an engine does between forward passes: it polls for finished jobs
and submits the next ones (two jobs of 16 chunks of 2 MiB in flight: a write-behind, then a
promotion of the same slots, round the slab). No other Python thread runs, so no GIL is
handed over. Its speed is busy-loop iterations per wall second over a phase. Phases of
``--phase-s`` alternate between two conditions A and B (ABBA order, so drift cancels);
between phases, steps without submitting let the jobs in flight finish (not measured). The
loss is ``1 - rate(B) / rate(A)``, the ratio's geometric mean over the pairs, ± 2 standard
errors. Every experiment has A = *idle*, where the same calls run with ``DiskWorker`` jobs
that fail at once without I/O (and count as in flight as long as the last real job of their
kind took, so polls and submits come alike):

* **control**: B = idle too. Must read 0 within its ± (else the probe is biased).
* **stall**: B = idle plus a Python thread that holds the GIL for ``--stall-ms`` every 10 ms
  (one C call, ``sum`` over a range, which never lets the GIL go). It must read what the thread
  held, ``expected`` (at least that: the engine also waits to get the GIL back), so a loss of
  that size is seen.
* **disk**, per rate: B = the jobs do their I/O on the tier's thread. The goal is met when
  the whole interval ``mean ± 2 s.e.`` lies below 1%.
* **floor**, per rate: B = the same jobs' bytes moved by ``benches/tools/disk_floor.rs`` in a child
  process (no GIL, none of the tier's code) at the tier's I/O threads' priority, on the same
  file system: per chunk its CRC-32C and its header block and data in one positioned write
  (``O_DIRECT`` when the tier uses it), one ``fdatasync`` per job, then the header blocks; a
  promotion reads each slot in one positioned read and checks the CRC-32C. The engine submits
  and polls these jobs (a pipe) as it does the tier's. What the floor loses is this machine's
  price of moving the bytes; *tier over floor* (disk - floor, ± from both) is what our tier
  adds.

``--mbps`` paces submissions (idle, disk and floor alike) to at most that many MB/s over the
phases (0: flat out, as fast as jobs finish): an engine's write-behind rate is what its
prefills produce. The report ends with a table by rate and the verdicts: the probe's validity
(when the control or the stall row fails, the run measured nothing), then per rate whether
the tier's loss, and the tier's own part over the floor, lie below 1% (met, NOT met, or not
decided by this run).

``--io-cpus N`` (``io_cpus``) pins the tier's I/O thread (and its checksum helper) and the
floor's process to CPU(s) N, and this thread (the engine, and the GIL-stall thread it starts)
to the other CPUs this process may use, for every experiment alike; the report's header says
which CPUs each runs on, as read back from the threads. Without it nothing is pinned.

Per condition the report gives what explains a loss: the engine thread's share of the wall time
on a CPU and waiting for one (schedstat), and the cores used by the tier's I/O threads (and
their checksum helpers), this process, the floor's process, other processes with the kernel,
and the hypervisor (steal), and the jobs' throughput: a phase whose jobs moved nothing (an I/O
thread starved by other load) measured nothing.
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

from disk_jobs import CHUNK, PER_JOB, Floor, job, jobs, pool, run, worker

from kvoffload._core import DiskWorker, check_io_cpus
from kvoffload.errors import ConfigError

STEP_S = 0.005
KINDS = ("write", "promote")


class Engine:
    """The engine's step loop on the calling thread (see the module documentation).

    Jobs of each source (``disk``: the worker; ``floor``: the floor's child process) follow
    one sequence: per pass over the slab (a new generation), each range of 16 slots is written
    then promoted; each source runs its jobs in order, so a promotion always reads what the
    write before it committed. Idle jobs take the shape of the next job of the source they
    stand in for (``like``) without advancing its sequence. With ``mbps``, jobs of every mode
    are submitted at most at that rate of bytes (counted over the phases only)."""

    def __init__(
        self, w: DiskWorker, n: int, first_id: int, gen: int, floor: Floor | None = None
    ) -> None:
        self.w, self.floor, self.n, self.next_id, self.gen0 = w, floor, n, first_id, gen
        self.depth, self.mbps, self.like = 2, 0.0, "disk"
        self.pos = {"disk": 0, "floor": 0}  # next job of each source in its sequence
        self.ranges = (n + PER_JOB - 1) // PER_JOB
        self.inflight: dict[int, tuple[str, str, float]] = {}  # id: mode, kind, submitted
        self.failed: set[int] = set()  # idle jobs reported, waiting out a real job's time
        self.took = {(m, k): 0.03 for m in self.pos for k in KINDS}
        self.iters = 0
        self.moved = 0  # bytes the disk or floor jobs wrote or read
        self.credit, self.last = 0.0, 0.0  # bytes that may be submitted (``mbps``), as of

    def _submit(self, mode: str, now: float) -> None:
        source = self.like if mode == "idle" else mode
        rnd, within = divmod(self.pos[source], 2 * self.ranges)
        r, kind = within // 2, KINDS[within % 2]
        slots = range(r * PER_JOB, min(self.n, (r + 1) * PER_JOB))
        self.inflight[self.next_id] = (mode, kind, now)
        if mode == "floor":
            assert self.floor is not None
            self.floor.submit(self.next_id, kind, slots)
        else:
            gen = self.gen0 + rnd + 1
            self.w.submit([job(self.next_id, kind, self.n, slots, gen, idle=mode == "idle")])
        if mode != "idle":
            self.pos[mode] += 1
        self.next_id += 1

    def step(self, mode: str | None) -> None:
        """One step: busy until the step's end, then poll, then submit jobs of ``mode`` up to
        the depth and the rate (``None``: submit nothing, and idle jobs end when reported)."""
        end, n = time.perf_counter() + STEP_S, 0
        while True:
            for _ in range(200):
                n += 1
            if time.perf_counter() >= end:
                break
        self.iters += n
        now = time.perf_counter()
        done = self.w.poll()
        if self.floor is not None:
            done += self.floor.poll()
        for job_id, ok in done:
            m, kind, t0 = self.inflight[job_id]
            assert ok == (m != "idle"), (job_id, m, ok)
            if m != "idle":
                self.took[m, kind] = now - t0
                self.moved += PER_JOB * CHUNK
                del self.inflight[job_id]
            else:
                self.failed.add(job_id)
        for job_id in [j for j in self.failed if mode is None or self._waited(j, now)]:
            self.failed.discard(job_id)
            del self.inflight[job_id]
        if mode is None:
            return
        size = PER_JOB * CHUNK
        if self.mbps:
            self.credit = min(size, self.credit + (now - self.last) * self.mbps * 1e6)
            self.last = now
        while len(self.inflight) < self.depth and (not self.mbps or self.credit >= size):
            self._submit(mode, now)
            self.credit -= size if self.mbps else 0

    def _waited(self, job_id: int, now: float) -> bool:
        """Whether idle job ``job_id`` has been in flight as long as a job of its kind from
        the source it stands in for."""
        _, kind, t0 = self.inflight[job_id]
        return now - t0 >= self.took[self.like, kind]

    def drain(self) -> None:
        """Steps without submitting until no job is in flight (idle jobs do not wait out a
        real job's time)."""
        limit = time.perf_counter() + 600
        while self.inflight:
            assert time.perf_counter() < limit, f"jobs never finished: {self.inflight}"
            self.step(None)

    def phase(self, mode: str, seconds: float) -> tuple[float, float]:
        """Steps in ``mode`` for ``seconds``; (iterations per wall second, wall seconds)."""
        i0, t0 = self.iters, time.perf_counter()
        self.last = t0  # the rate's credit grows over phases only
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


def _name(tid: str) -> str:
    """Thread ``tid``'s name (empty: it ended)."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _threads_cpu() -> dict[str, int]:
    """CPU nanoseconds used so far by this process's threads, by name (schedstat)."""
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        name = _name(tid)
        try:
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
        self.wall = self.on_cpu = self.waiting = self.tier = self.ours = self.floor = 0.0
        self.moved = 0
        self.machine = [0, 0, 0]

    def measure(self, e: Engine, mode: str, seconds: float) -> None:
        me = threading.get_native_id()
        f0 = e.floor.cpu_ns() if e.floor is not None else 0
        c0, m0, s0, b0 = _threads_cpu(), _machine(), _sched(me), e.moved
        rate, wall = e.phase(mode, seconds)
        s1, m1, c1 = _sched(me), _machine(), _threads_cpu()
        self.floor += ((e.floor.cpu_ns() if e.floor is not None else 0) - f0) / 1e9
        self.moved += e.moved - b0
        self.rates.append(rate)
        self.speeds.append(rate * wall / max((s1[0] - s0[0]) / 1e9, 1e-9))
        self.wall += wall
        self.on_cpu += (s1[0] - s0[0]) / 1e9
        self.waiting += (s1[1] - s0[1]) / 1e9
        used = {k: (v - c0.get(k, 0)) / 1e9 for k, v in c1.items()}
        self.tier += sum(
            v for k, v in used.items() if k.startswith(("kvoffload-tier", "kvoffload-crc"))
        )
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
            "floor": self.floor / self.wall,
            "others": max(0.0, busy * cores - (self.ours + self.floor) / self.wall),
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
    e: Engine,
    b_mode: str,
    pairs: int,
    phase_s: float,
    stall: GilStall | None = None,
    mbps: float = 0.0,
) -> dict[str, Any]:
    """``pairs`` pairs of phases, A idle and B in ``b_mode`` (with ``stall`` on in B), jobs
    submitted at most at ``mbps`` MB/s (0: as fast as they finish)."""
    e.like, e.mbps, e.credit = b_mode if b_mode != "idle" else "disk", mbps, 0.0
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
    floor: Floor | None = None,
    rates: tuple[float, ...] = (0.0,),
    check_pairs: int | None = None,
) -> dict[str, Any]:
    """The experiments on worker ``w`` (``n`` slots whose generation is ``gen``): control and
    stall (``check_pairs`` pairs each, default ``pairs``), then per rate in ``rates`` (MB/s, 0:
    flat out) disk, and floor when ``floor`` is given (a floor over ``n`` slots)."""
    checks = pairs if check_pairs is None else check_pairs
    e = Engine(w, n, first_id, gen, floor)
    for source in ("disk", "floor") if floor is not None else ("disk",):
        while e.pos[source] < 2 * e.ranges:  # warm up: each slab written once, the code hot
            e.step(source)
        e.drain()
    out: dict[str, Any] = {"control": experiment(e, "idle", checks, phase_s)}
    gil = GilStall(stall_ms / 1e3)
    try:
        out["stall"] = experiment(e, "idle", checks, phase_s, gil)
    finally:
        gil.close()
    out["rates"] = []
    for mbps in rates:
        row: dict[str, Any] = {
            "mbps": mbps,
            "disk": experiment(e, "disk", pairs, phase_s, None, mbps),
        }
        if floor is not None:
            row["floor"] = experiment(e, "floor", pairs, phase_s, None, mbps)
        out["rates"].append(row)
    out["disk"] = out["rates"][0]["disk"]  # what bench_disk.py and older readers look for
    out["pairs"], out["check_pairs"] = pairs, checks
    out["phase_s"], out["stall_ms"] = phase_s, stall_ms
    return out


def _cpu_line(name: str, c: dict[str, float]) -> str:
    return (
        f"      {name:5}: engine thread on a CPU {c['on_cpu']:.1%} of the time, waiting for one "
        f"{c['waiting']:.1%}; cores used: tier I/O threads {c['tier_threads']:.3f}, this "
        f"process {c['this_process']:.3f}, floor process {c['floor']:.3f}, other processes "
        f"and kernel {c['others']:.3f}, steal {c['steal']:.3f}; jobs moved {c['mb_s']:.0f} MB/s"
    )


def _decide(lo: float, hi: float) -> str:
    """Whether ``[lo, hi]`` lies below 1%: met, NOT met, or not decided."""
    return "met" if hi < 0.01 else "NOT met" if lo >= 0.01 else "not decided by this run"


def _pm(mean: float, se: float) -> str:
    """``mean ± 2 se`` as percentages."""
    return f"{mean:+.2%} ± {2 * se:.2%}"


def _per_gb(mean: float, se: float, gb_s: float) -> str:
    """The loss per GB/s moved, ``mean ± 2 se`` over ``gb_s``."""
    return _pm(mean / gb_s, se / gb_s) if gb_s > 0 else "nothing moved"


def _rate(mbps: float) -> str:
    return f"{mbps:g} MB/s" if mbps else "flat out"


def _lines(name: str, what: str, x: dict[str, Any], verdict: str) -> list[str]:
    return [
        f"  {name:7} A idle, B {what}: loss {x['mean']:+.2%} ± {2 * x['se']:.2%} "
        f"({x['median']:+.2%}); {verdict}",
        _cpu_line("A", x["a"]),
        _cpu_line("B", x["b"]),
        f"      iterations per second on a CPU (interference, not scheduling): "
        f"{x['slower']:+.2%} ± {2 * x['slower_se']:.2%} fewer in B",
    ]


def report(f: dict[str, Any]) -> str:
    """The experiments' results, each with its verdict, a table by rate and the verdicts."""
    lines = [
        f"engine-thread stall probe: {f['pairs']} pairs of {f['phase_s']:g} s phases per "
        f"disk and floor experiment ({f.get('check_pairs', f['pairs'])} for control and "
        f"stall), steps of {STEP_S * 1e3:g} ms; loss = 1 - rate(B) / rate(A) of busy-loop "
        "iterations per wall second, geometric mean over the pairs ± 2 s.e. (median); the "
        "goal is decided when the whole interval lies on one side of 1%",
        f"  CPUs: {f.get('pinning', 'not recorded')}",
    ]
    c, st = f["control"], f["stall"]
    unbiased = abs(c["mean"]) <= 2 * c["se"]
    lo, hi = st["mean"] - 2 * st["se"], st["mean"] + 2 * st["se"]
    seen = lo <= st["expected"] * 1.5 and hi >= st["expected"]
    lines += _lines(
        "control", "idle again", c, "unbiased: 0 within ±" if unbiased else "BIASED: 0 outside ±"
    )
    held = f"idle + a thread holding the GIL {f['stall_ms']:g} ms every 10 ms"
    ok = f"expected >= {st['expected']:.2%}: " + ("seen" if seen else "NOT seen")
    lines += _lines("stall", held, st, ok)
    table, verdicts = [], []
    for row in f.get("rates", [{"mbps": 0.0, "disk": f["disk"]}]):
        rate, d = _rate(row["mbps"]), row["disk"]
        dv = _decide(d["mean"] - 2 * d["se"], d["mean"] + 2 * d["se"])
        lines += _lines("disk", f"the tier's jobs, {rate}", d, f"goal < 1%: {dv}")
        d_gb = d["b"]["mb_s"] / 1e3
        cells = f"  {rate:>10}  {d['b']['mb_s']:6.0f}  {_pm(d['mean'], d['se']):>17}"
        cells += f"  {_per_gb(d['mean'], d['se'], d_gb):>17}"
        verdict = (
            f"  at {rate} ({d_gb * 1e3:.0f} MB/s moved): the tier's loss "
            f"{_pm(d['mean'], d['se'])} < 1%: {dv}"
        )
        if "floor" in row:
            fl = row["floor"]
            lines += _lines("floor", f"a plain loop moving the same bytes, {rate}", fl, "")
            # The floor's loss at the tier's bytes per second (taken as proportional to them:
            # paced phases of the two may move somewhat different amounts).
            k = d_gb / max(fl["b"]["mb_s"] / 1e3, 1e-9)
            diff, se = d["mean"] - k * fl["mean"], math.hypot(d["se"], k * fl["se"])
            own = _decide(diff - 2 * se, diff + 2 * se)
            raw = _pm(d["mean"] - fl["mean"], math.hypot(d["se"], fl["se"]))
            lines.append(
                f"  tier over floor at {rate}: {_pm(diff, se)} (the floor's loss scaled by "
                f"{k:.2f} to the tier's MB/s; unscaled {raw}); "
                f"goal < 1%: {own}"
            )
            cells += (
                f"  {fl['b']['mb_s']:6.0f}  {_pm(fl['mean'], fl['se']):>17}"
                f"  {_per_gb(fl['mean'], fl['se'], fl['b']['mb_s'] / 1e3):>17}"
                f"  {_pm(diff, se):>17}"
            )
            verdict += (
                f"; the floor's loss {_pm(fl['mean'], fl['se'])}; the tier over the floor "
                f"{_pm(diff, se)} < 1%: {own}"
            )
        table.append(cells)
        verdicts.append(verdict)
    lines.append(
        "  table (MB/s moved in B phases; losses ± 2 s.e.; per GB/s: the loss over the GB/s "
        "moved; tier over floor: the floor's loss scaled to the tier's MB/s):\n"
        f"  {'rate':>10}  {'disk':>6}  {'disk loss':>17}  {'per GB/s':>17}  {'floor':>6}  "
        f"{'floor loss':>17}  {'per GB/s':>17}  {'tier over floor':>17}"
    )
    lines += table
    valid = unbiased and seen
    lines.append(
        "verdict: probe valid (control unbiased, known stall seen)"
        if valid
        else "verdict: PROBE INVALID (control biased or known stall not seen): this run measured "
        "nothing"
    )
    if valid:
        lines += verdicts
    return "\n".join(lines)


def _cpus(tid: int) -> str:
    """The CPUs thread (or process) ``tid`` may run on, as read back (``?``: it ended)."""
    try:
        return ",".join(map(str, sorted(os.sched_getaffinity(tid))))
    except OSError:
        return "?"


def _pinning(io_cpus: list[int] | None, floor: Floor | None) -> str:
    """Where the engine thread, the tier's I/O threads and the floor's process may run, read
    back from them (the report's header)."""
    tier = sorted(
        {_cpus(int(t)) for t in os.listdir("/proc/self/task") if _name(t).startswith("kvoffload")}
    )
    where = (
        f"engine thread on {_cpus(threading.get_native_id())}, tier I/O threads on "
        f"{' / '.join(tier) or '?'}, floor process on "
        f"{_cpus(floor.p.pid) if floor is not None else 'none (--no-floor)'}"
    )
    if io_cpus is None:
        return f"not pinned (--io-cpus not given): {where}"
    return f"pinned with --io-cpus {','.join(map(str, io_cpus))}: {where}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="directory on the file system to measure (default: a temp dir)")
    p.add_argument("--chunks", type=int, default=128, help="2 MiB chunks in the slab")
    p.add_argument("--pairs", type=int, default=120, help="pairs of phases per experiment")
    p.add_argument("--phase-s", type=float, default=0.1, help="seconds of one phase")
    p.add_argument(
        "--check-pairs",
        type=int,
        help="pairs of phases for the control and stall experiments (default: --pairs)",
    )
    p.add_argument(
        "--no-floor",
        action="store_true",
        help="measure only our tier: no floor experiments (the floor's reading needs its own run)",
    )
    p.add_argument("--stall-ms", type=float, default=1.0, help="GIL held per 10 ms (stall)")
    p.add_argument(
        "--mbps",
        type=float,
        nargs="+",
        default=[0.0],
        help="rates to submit disk and floor jobs at, MB/s (0: flat out)",
    )
    p.add_argument(
        "--io-cpus",
        type=int,
        nargs="+",
        metavar="N",
        help="pin the tier's I/O thread and the floor's process to these CPUs and this (the "
        "engine's) thread to the others (default: nothing pinned)",
    )
    args = p.parse_args()
    if any(r < 0 for r in args.mbps):
        p.error(f"--mbps: rates are >= 0 (0: flat out), got {args.mbps}")
    engine_cpus = None
    if args.io_cpus is not None:
        try:
            check_io_cpus(args.io_cpus)
        except ConfigError as e:
            p.error(f"--io-cpus: {e}")
        engine_cpus = sorted(os.sched_getaffinity(0) - set(args.io_cpus))
        if not engine_cpus:
            p.error(f"--io-cpus {args.io_cpus}: no CPU would be left for the engine thread")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        _, view = pool(args.chunks)
        w = worker(os.path.join(d, "tier"), args.chunks, view, args.io_cpus)
        floor = None
        try:
            run(w, jobs("write", 1, 1 << 30, 1))  # the I/O thread has started (its priority set)
            st = w.stats()[0]
            nice = 19 if st["io_threads_low_priority"] else 0
            direct = bool(st["direct"])
            if not args.no_floor:
                floor = Floor(os.path.join(d, "floor"), args.chunks, direct, nice, args.io_cpus)
            if engine_cpus is not None:  # after the worker opened: it checks against our CPUs
                os.sched_setaffinity(0, engine_cpus)
            pinning = _pinning(args.io_cpus, floor)
            f = measure(
                w,
                args.chunks,
                1,
                0,
                args.pairs,
                args.phase_s,
                args.stall_ms,
                floor,
                args.mbps,
                args.check_pairs,
            )
            f["pinning"] = pinning
        finally:
            if floor is not None:
                floor.close()
            w.close()
        print(report(f))


if __name__ == "__main__":
    main()
