"""Two builds of the Rust core inside vLLM's real scheduler, in one process and in lockstep: the
workload of ``benches/vllm_workload.py`` (our connector only) run twice side by side, one
engine with the other build's core and one with this build's, their steps interleaved (which
goes first alternates). Across processes this VM's speed drifts by up to 30% within minutes,
and within one run by as much; interleaved, both builds see the same machine at every step,
so the ratio is the evidence for a change of a few percent, where separate runs show noise.

Two ways to give the other build (in ``.venv-vllm``)::

    .venv-vllm/bin/python benches/ab/vllm_ab.py DIR [--b 512] [--attention full] [--rounds 2]

* The core alone: its ``_core*.so`` copied into ``DIR/kvbase/`` with an empty
  ``__init__.py``, as for ``schedule_batch_ab.py``. Both engines run this checkout's
  connector (``kvoffload.integrations.vllm``); the other one builds the other core.
* The whole package: ``benches/ab/ab_prepare.py REV DIR`` builds revision ``REV`` and installs
  its package as ``DIR/kvbase`` (``kvoffload`` renamed in its Python sources). The other
  engine then runs that revision's connector (``kvbase.integrations.vllm``) and its core, so
  a change to the adapter's Python is measured too. The other core still raises this
  checkout's ``kvoffload.errors`` exceptions (the workload raises none).

The engine built first runs 1.5-2.5% slower (an A/A run of one build against itself shows
it), so which one is built first alternates by round too: use an even number of rounds (an
A/A run's mean ratio then stays within 1.5% of 1, per call too). Per round (a fresh pair of
engines) it prints each build's median connector time per step and the ratio; then per
connector method each build's µs per call over all rounds (warmup steps included) and the
ratio. Both engines get the same requests: that they finished the same ones is checked (exit
status 1 otherwise).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

# The workload and its runner live one folder up, in benches/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_workload import _pin
from vllm_workload_gen import Workload
from vllm_workload_run import WorkloadRun, lockstep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("other", help="directory holding kvbase/_core*.so, or a whole kvbase package")
    ap.add_argument("--b", type=int, default=512)
    ap.add_argument("--attention", default="full", choices=("full", "hybrid"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=600, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 300 + B)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    pinned = _pin()
    sys.path.insert(0, a.other)
    import kvoffload.scheduler as facade

    mods = {
        "other": importlib.import_module("kvbase._core"),
        "this": importlib.import_module("kvoffload._core"),
    }
    cores = {build: m.Scheduler for build, m in mods.items()}
    # Whole-package mode: the other engine runs the other revision's adapter too.
    whole = (Path(a.other) / "kvbase" / "integrations" / "vllm").is_dir()
    modules = {
        "other": "kvbase.integrations.vllm" if whole else "kvoffload.integrations.vllm",
        "this": "kvoffload.integrations.vllm",
    }
    warmup = 300 + a.b if a.warmup is None else a.warmup
    w = Workload(b=a.b, attention=a.attention, steps=warmup + a.steps, warmup=warmup, seed=a.seed)
    print(f"# {' '.join(sys.argv)} ({pinned})")
    for build, m in mods.items():
        print(f"# {build}: {m.__file__}, connector {modules[build]}")
    medians: dict[str, list[float]] = {k: [] for k in cores}
    calls: dict[str, dict[str, list[tuple[float, int]]]] = {k: {} for k in cores}
    same = True
    for r in range(a.rounds):
        # Which engine is built first (its memory mapped first) alternates too.
        runs = {}
        for build in list(cores) if r % 2 == 0 else list(reversed(cores)):
            # This checkout's connector builds its core through the facade's name for the
            # class (the other package's, through its own).
            facade.Scheduler = cores[build] if not whole else cores["this"]
            try:
                runs[build] = WorkloadRun(w, "ours", module=modules[build])
            finally:
                facade.Scheduler = cores["this"]
        lockstep([runs["other"], runs["this"]], w.steps)
        res = {build: run.close() for build, run in runs.items()}
        if res["other"].finished != res["this"].finished:
            print(f"round {r}: the two builds finished different requests")
            same = False
        for build, x in res.items():
            medians[build].append(x.summary()["median_ms"])
            for name, m in x.methods.items():
                calls[build].setdefault(name, []).append((m["total_ms"], m["calls"]))
        o, t = medians["other"][-1], medians["this"][-1]
        print(
            f"round {r}: other {1e3 * o:.1f} us/step, this {1e3 * t:.1f}, other/this {o / t:.3f}x",
            flush=True,
        )
    ratios = [o / t for o, t in zip(medians["other"], medians["this"], strict=True)]
    print(
        f"\nB={a.b} {a.attention}, {a.rounds} rounds of {a.steps} timed steps: other/this "
        f"{', '.join(f'{x:.3f}' for x in ratios)}; geometric mean "
        f"{statistics.geometric_mean(ratios):.3f}x"
    )
    print(f"{'method':<32} {'other us':>9} {'this us':>9} {'other/this':>10}")

    def per_call(build: str, name: str) -> float:
        xs = calls[build].get(name, [])
        n = sum(c for _, c in xs)
        return 1e3 * sum(ms for ms, _ in xs) / n if n else float("nan")

    for name in sorted(calls["this"], key=lambda n: -per_call("this", n)):
        o, t = per_call("other", name), per_call("this", name)
        print(f"{name:<32} {o:>9.1f} {t:>9.1f} {o / t:>9.3f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
