"""Soak test of the data plane (``make fuzz``; not part of the default test run).

Several threads drive one :class:`~kvoffload.transfer.TransferEngine` at once for a bounded time
(``--seconds``): one runs worker steps (stores queued and flushed, loads), others poll, wait and
fence, and one keeps creating engines in reference cycles and dropping them without shutdown.
Garbage collections are forced between calls, and finalizers call back into the engine. A
watchdog thread aborts the process (exit 3) if no progress is made for ``--hang-seconds``.

Checked at the end: every submitted job's result came back exactly once, nothing raised that is
not a ``kvoffload.errors`` exception the test provoked on purpose, the copies are byte-exact, and
resident memory did not grow after warm-up (beyond ``--rss-slack-mb``).

Run::

    .venv/bin/python tests/soak/soak_dataplane.py --seconds 60
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
import weakref

import torch

from kvoffload.errors import UnknownJobError
from kvoffload.transfer import TransferEngine

NB = 64
BPB = 4096


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Soak:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        g = torch.Generator().manual_seed(0)
        self.kv = [
            torch.randint(0, 256, (NB, BPB), dtype=torch.uint8, generator=g) for _ in range(2)
        ]
        self.ref = [t.clone() for t in self.kv]  # the KV tensors are only read (stores)
        self.eng = TransferEngine([self.kv], blocks_per_chunk=1, num_slots=NB)
        self.lock = threading.Lock()
        self.submitted: set[int] = set()
        self.results: list[int] = []
        self.failures: list[str] = []
        self.progress = 0
        self.next_id = 0

    def done(self) -> bool:
        return time.monotonic() > self.deadline or bool(self.failures)

    def record(self, results: list) -> None:  # type: ignore[type-arg]
        with self.lock:
            for r in results:
                if not r.ok:
                    self.failures.append(f"job {r.job_id} failed: {r.error}")
                self.results.append(r.job_id)
            self.progress += 1

    def guard(self, fn):  # type: ignore[no-untyped-def]
        def run() -> None:
            try:
                while not self.done():
                    fn()
                    gc.collect(0)
            except BaseException as e:  # reported at the end
                self.failures.append(f"{threading.current_thread().name}: {e!r}")

        return run

    def stepper(self) -> None:
        """Worker steps: this step's stores queued, one of them flushed at once, loads."""
        with self.lock:
            base = self.next_id
            self.next_id += 3
        b = base % NB
        stores = [(base, [(0, [b], [b])]), (base + 1, [(0, [(b + 1) % NB], [(b + 1) % NB])])]
        self.eng.step(stores=stores, flush=[base + 1], loads=[])
        with self.lock:  # known to the engine from here on (fenced by the pollers)
            self.submitted.update((base, base + 1))
        # The load writes back the bytes the store took, so the KV bytes never change.
        self.eng.wait([base])
        self.eng.step(loads=[(base + 2, [(0, [b], [b])])])
        with self.lock:
            self.submitted.add(base + 2)
            self.progress += 1

    def poller(self) -> None:
        self.record(self.eng.poll())
        with self.lock:
            known = max(self.submitted, default=None)
        if known is not None:
            self.eng.fence([known])
            try:
                self.eng.wait([known + 10**9])
            except UnknownJobError:
                pass
            else:
                self.failures.append(f"wait accepted the unknown job {known + 10**9}")

    def dropper(self) -> None:
        """Engines dropped in cycles, with finalizers that call the shared engine."""
        e = TransferEngine(
            [[torch.zeros(8, 256, dtype=torch.uint8)]], blocks_per_chunk=1, num_slots=8
        )
        e.cycle = e  # type: ignore[attr-defined]
        e.submit_store(0, [(0, [1], [1])])
        weakref.finalize(e, lambda: self.record(self.eng.poll()))
        del e
        gc.collect()

    def watchdog(self, hang_s: float) -> None:
        last, since = -1, time.monotonic()
        while not self.done():
            time.sleep(0.5)
            with self.lock:
                p = self.progress
            if p != last:
                last, since = p, time.monotonic()
            elif time.monotonic() - since > hang_s:
                sys.stderr.write(f"soak: no progress for {hang_s}s: hang\n")
                os._exit(3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--hang-seconds", type=float, default=60.0)
    ap.add_argument("--rss-slack-mb", type=float, default=64.0)
    args = ap.parse_args()
    s = Soak(args.seconds)
    threads = [
        threading.Thread(target=s.guard(s.stepper), name="stepper"),
        threading.Thread(target=s.guard(s.poller), name="poller-1"),
        threading.Thread(target=s.guard(s.poller), name="poller-2"),
        threading.Thread(target=s.guard(s.dropper), name="dropper"),
    ]
    threading.Thread(target=s.watchdog, args=(args.hang_seconds,), daemon=True).start()
    warm = args.seconds / 4
    for t in threads:
        t.start()
    time.sleep(min(warm, args.seconds))
    gc.collect()
    rss_warm = rss_mb()
    for t in threads:
        t.join()
    s.record(s.eng.shutdown())
    gc.collect()
    growth = rss_mb() - rss_warm
    ids = sorted(s.results)
    problems = list(s.failures)
    if ids != sorted(s.submitted):
        missing = sorted(s.submitted - set(ids))[:10]
        problems.append(f"{len(s.submitted)} jobs submitted, {len(ids)} results; missing {missing}")
    for a, b in zip(s.kv, s.ref, strict=True):
        if not torch.equal(a, b):
            problems.append("KV bytes changed")
    if growth > args.rss_slack_mb:
        problems.append(f"RSS grew {growth:.0f} MiB after warm-up")
    print(f"soak: {len(ids)} jobs, RSS growth {growth:.1f} MiB, {len(problems)} problems")
    for p in problems:
        print("  ", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
