"""``Scheduler.schedule_batch`` of two builds of the extension, in one process, on the same
decode-heavy step sequence (the shape of ``benches/vllm_workload.py`` at B=512, full attention,
without vLLM): B running requests decoding one token per step, a request finishing after
64-256 decoded tokens and replaced by one with a 2-5.5k-token prompt prefilled in one step,
16-token blocks, every store and load of a plan completed before the next step in one
``complete_counts`` call (as vLLM's connector reports them). Before every timed call a 64 MiB
buffer is rewritten, so each call starts with cold caches, as inside vLLM.

Run (the other build's ``_core*.so`` copied into ``DIR/kvbase/`` with an empty
``__init__.py``)::

    .venv/bin/python benches/ab/schedule_batch_ab.py DIR [--b 512] [--steps 400]

It prints the median µs per ``schedule_batch`` call and per ``complete_counts`` call of each
build (calls alternate which build goes first) and their ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from ab_builds import BLOCK, Cold, schedulers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("other", help="directory holding kvbase/_core*.so (the other build)")
    ap.add_argument("--b", type=int, default=512)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cores = schedulers(a.other, 200_000)
    rng = random.Random(a.seed)
    free = list(range(1, 200_000))
    reqs: dict[str, dict[str, Any]] = {}
    hashes: dict[str, list[bytes]] = {}
    times: dict[str, list[float]] = {k: [] for k in cores}
    done_times: dict[str, list[float]] = {k: [] for k in cores}
    cold = Cold()
    n = 0

    def new_request() -> tuple[str, list[int]]:
        nonlocal n
        rid = f"cmpl-{rng.getrandbits(96):024x}-{n}"
        n += 1
        prompt = rng.randrange(2048, 5632)
        blocks = [free.pop() for _ in range(prompt // BLOCK + 1)]
        hashes[rid] = [rng.randbytes(32) for _ in range(prompt // BLOCK)]
        left = rng.randrange(64, 257)
        reqs[rid] = {"tokens": prompt, "computed": 0, "blocks": blocks, "left": left}
        for s in cores.values():
            s.sync_request(rid, prompt, hashes[rid])
            s.allocate(rid, [blocks], 0, 0)
        return rid, blocks

    for step in range(a.steps):
        fresh = [new_request() for _ in range(a.b - len(reqs))]
        finished = [rid for rid, r in reqs.items() if r["left"] == 0]
        new_ids = {rid for rid, _ in fresh}
        scheduled, computed, added, appended = [], [], {}, []
        for rid, r in reqs.items():
            if r["left"] == 0:
                continue
            scheduled.append(rid)
            computed.append(r["computed"])
            if rid in new_ids:
                added[rid] = r["tokens"]
                appended.append(None)
                r["computed"] = r["tokens"]
                continue
            added[rid] = 1
            r["computed"] += 1
            r["left"] -= 1
            if r["computed"] % BLOCK == 0:
                hashes[rid].append(rng.randbytes(32))
            if r["computed"] >= BLOCK * len(r["blocks"]):
                b = free.pop()
                r["blocks"].append(b)
                appended.append([[b]])
            else:
                appended.append(None)
        tables = [(rid, [blocks]) for rid, blocks in fresh]
        order = list(cores) if step % 2 else list(reversed(cores))
        plans = {}
        for k in order:
            cold()
            t = time.perf_counter()
            plans[k] = cores[k].schedule_batch(
                scheduled,
                computed,
                added=added,
                appended=appended,
                tables=tables,
                hashes=hashes,
                finished=finished,
                written=[],
            )
            times[k].append(time.perf_counter() - t)
        assert plans["this"][:4] == plans["other"][:4], step
        for k in order:
            loads, _, stores, *_ = plans[k]
            cold()
            t = time.perf_counter()
            counts = cores[k].complete_counts(loads + stores)
            done_times[k].append(time.perf_counter() - t)
            assert counts == (len(loads) + len(stores), 0), step
        for rid in finished:
            free.extend(reqs.pop(rid)["blocks"])
            del hashes[rid]
    skip = a.steps // 4  # the first steps prefill every request at once
    for name, ts in (("schedule_batch", times), ("complete_counts", done_times)):
        med = {k: statistics.median(v[skip:]) * 1e6 for k, v in ts.items()}
        print(
            f"{name} B={a.b}, {a.steps - skip} steps: other {med['other']:.1f} us, "
            f"this {med['this']:.1f} us, other/this {med['other'] / med['this']:.2f}x"
        )


if __name__ == "__main__":
    main()
