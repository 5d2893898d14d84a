"""Scheduler-side cost of two KV-offloading connectors inside vLLM 0.32's real scheduler, on a
closed-loop multi-turn chat workload.

Run with the vLLM virtualenv (``make test-vllm`` builds it)::

    make bench-vllm [BENCH_VLLM_ARGS="--b 512 --attention hybrid --profile"]
    .venv-vllm/bin/python benches/vllm_workload.py [--b 64,256,512] [--attention full,hybrid]
        [--steps 300] [--warmup W] [--seed 0] [--connectors vllm,ours] [--cpu-factor 2,1]
        [--solo] [--prompt-only] [--clock cpu|wall] [--profile] [--json out.json]

Each run is ``--warmup`` untimed steps (default 300 + B: the first wave of prompts is
prefilled and later turns come back to the CPU tier, about three load jobs a step at B=512),
then ``--steps`` timed steps. The default matrix (B = 64 / 256 / 512, full and hybrid, CPU
tier twice the GPU pool and half of it, both connectors) takes 10-30 minutes on a 2-core
machine, most of it in vLLM's connector at B=512.

**Interleaved.** Both connectors' engines run in one process in lockstep (``lockstep`` in
``vllm_workload_run.py``): step k of both before step k + 1 of either, which one goes first
alternating by step, so the machine's drift over the minutes of a run hits both alike. Each
engine has its own scheduler, connector, fake worker and copy of the seeded workload, so its
decisions are those of a run alone (``tests/vllm/test_workload_bench.py`` checks finished
requests, per-step loads and loaded tokens against solo runs); ``--solo`` runs them one after
the other instead.

**What runs.** vLLM's v1 core ``Scheduler`` (prefix caching on, chunked prefill with
``max_num_batched_tokens=8192``, 16-token blocks, ``max_num_seqs=B``) with no model: a fake
model runner samples each request's next token from the workload, and a fake worker completes
every connector job 1 or 2 steps after the step that planned it (seeded; a load's delay depends
on the request and the step only, so both connectors see the same delays), at once if a plan
flushes it. Two connectors run in the same process on the same request sequences:

* ``vllm``: vLLM's own ``OffloadingConnector`` with its CPU backend (``CPUOffloadingSpec``,
  ``cpu_bytes_to_use``);
* ``ours``: ``KvOffloadConnector`` (``kv_connector_module_path="kvoffload.integrations.vllm"``,
  ``cpu_bytes``).

Both get the same CPU memory: ``--cpu-factor`` times the GPU pool's bytes, one run per value
(default 2, where nothing is evicted, and 1, where the CPU pool evicts under every store: the
cost of eviction is measured too). Under the same
bytes vLLM's CPU backend gives every key (one block of one group) a chunk sized for all groups,
so with two groups it holds half as many keys as ours. Both store generated tokens too (vLLM's
default ``offload_prompt_only=True`` is turned off so their rules agree; ``--prompt-only``
turns it on for both).

**The workload** (seeded, generated once per conversation id, identical for both connectors):
B requests in flight, 2B conversations; 4 shared system prompts of 512-1,536 tokens; a
conversation's first prompt is 2,048-5,632 tokens (a system prompt and a user message); each
turn decodes 64-256 tokens; the next turn's prompt is the previous prompt, its answer and a
new user message of 32-512 tokens; a conversation has up to 8 turns and ends earlier when the
next prompt would exceed 8,192 tokens; between turns it is idle for 10-100 steps; an ended
conversation is replaced by a new one. Ready turns are admitted first come, first served
whenever fewer than B requests are in flight. The GPU pool holds ``--gpu-tokens-per-seq``
(6,144) tokens per running request: a conversation idle between turns loses its GPU prefix
cache blocks to the others, so later turns hit the CPU tier. Hybrid attention adds a sliding-
window group (1,024-token window) beside the full-attention group, as vLLM's hybrid allocator
builds it for a model with both kinds of layers (2 layers each, 4 KiB pages).

**What the numbers mean.** Every scheduler-side connector method vLLM calls
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output``, ``request_finished_all_groups``, ``take_events``,
``get_kv_connector_stats``, ``on_new_request``, ``has_pending_push_work`` ...) is wrapped with a
timer on the connector instance (outermost calls only; a generator result is drained inside the
timer). The timers read the engine thread's CPU time (``--clock cpu``, the default: what the
connector costs the engine, whatever else runs on the machine) or wall time (``--clock wall``).
Each call's time is less the clock's own cost, an empty interval's median measured at start
(printed in the header; about 1.4 µs with the thread clock on a VM, where reading it is a
system call): without that, a connector's time per step grew with the number of its calls.
*ms/step* is the connector's total time in one engine step (the step's ``add_request``
calls, ``schedule``, ``update_from_output``): median, p90 and mean (its total time over the
timed steps / their number: what it costs the engine per step, rare slow steps included) over
the timed steps; the same median and mean without the garbage collector's pauses inside its
calls, and those pauses apart (ms/step, how many, in how many steps): the collector runs when
anyone's allocations pass its threshold, so part of them is the engine's. Per method, the
calls, total and mean per call over the whole run, GC pauses included and also given apart.
Over the whole run too: *flushes*, the jobs the plans told the workers to complete before the
forward pass (ours: ``KvOffloadMetadata.flush``; vLLM's:
``OffloadingConnectorMetadata.jobs_to_flush``); *loads*, the load jobs and the tokens vLLM
allocated as externally computed
(``update_state_after_alloc``'s ``num_external_tokens``); GPU blocks stored and loaded per KV
group (read from the plans); *finished*, the requests that finished. The check compares the two
runs: the requests both finished, and their loaded tokens (and GPU hit + loaded tokens). While
both connectors load the same tokens the two runs are the same schedule step for step; where
their rules differ (keys per CPU byte, which sliding-window blocks are stored, how a
sliding-window hit is aligned, eviction order under pressure) the runs drift apart and the
differences are reported, not asserted; where the rules agree (full attention, ``--cpu-factor``
at least 2: nothing is evicted) the bench exits 1 unless both finished the same requests with
the same loaded tokens. *engine ms/step* is vLLM's whole ``schedule``,
``update_from_output`` and ``add_request`` (connector included), for scale. ``--profile`` adds
a run of ours under cProfile (only inside its scheduler-side calls) and prints the top 25
functions by cumulative time. The process is pinned to one core where the OS allows, and runs
with ``PYTHONHASHSEED=0`` unless set (vLLM's connector iterates sets of byte keys: without a
fixed seed its eviction order, so its loads under CPU-pool pressure, change from run to run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

# The bench's modules sit beside it (also when a test loads this file by its path).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_workload_gen import (
    BS,
    Conversations,
    Workload,
    _import_vllm,
    build_scheduler,
)
from vllm_workload_run import (
    CLOCKS,
    CONNECTORS,
    SCHEDULER_METHODS,
    FakeWorker,
    RunResult,
    Timers,
    calibrate,
    compare,
    run_interleaved,
    run_workload,
)

__all__ = [
    "BS",
    "CLOCKS",
    "CONNECTORS",
    "SCHEDULER_METHODS",
    "Conversations",
    "FakeWorker",
    "RunResult",
    "Timers",
    "Workload",
    "_import_vllm",
    "build_scheduler",
    "compare",
    "main",
    "run_interleaved",
    "run_workload",
]

# ----------------------------------------------------------------------------- main


def _pin() -> str:
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[-1]})
        return f"pinned to CPU {cpus[-1]}"
    return "not pinned"


def main(argv: list[str] | None = None) -> int:
    doc = (__doc__ or "").splitlines()
    ap = argparse.ArgumentParser(description=doc[0] if doc else None)
    ap.add_argument("--b", default="64,256,512", help="requests in flight, comma separated")
    ap.add_argument("--attention", default="full,hybrid", help="full, hybrid or both")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per run (after warmup)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default 300 + B)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--connectors", default="vllm,ours")
    ap.add_argument("--prompt-only", action="store_true", help="offload prompt tokens only")
    ap.add_argument(
        "--cpu-factor",
        default=f"{Workload.cpu_factor:g},{EVICTING_CPU_FACTOR:g}",
        help="CPU bytes / GPU pool bytes, comma separated (below 1: the CPU pool evicts)",
    )
    ap.add_argument(
        "--solo",
        action="store_true",
        help="run the connectors one after the other instead of interleaved",
    )
    ap.add_argument("--gpu-tokens-per-seq", type=int, default=Workload.gpu_tokens_per_seq)
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: the engine thread's CPU time (default; unaffected by other processes); wall",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile ours (an extra run)")
    ap.add_argument("--json", type=Path, help="write all results here")
    args = ap.parse_args(argv)
    pinned = _pin()
    bs = [int(x) for x in args.b.split(",") if x]
    attns = [x for x in args.attention.split(",") if x]
    conns = [x for x in args.connectors.split(",") if x]
    factors = [float(x) for x in args.cpu_factor.split(",") if x]
    for a in attns:
        if a not in ("full", "hybrid"):
            ap.error(f"--attention: {a!r} is not full or hybrid")
    for c in conns:
        if c not in CONNECTORS:
            ap.error(f"--connectors: {c!r} is not one of {CONNECTORS}")
    print(f"# {' '.join(sys.argv)}")
    print(
        f"# vllm_workload: {args.steps} timed steps, seed {args.seed}, "
        f"{args.clock} clock ({pinned}); connectors "
        f"{'one after the other' if args.solo else 'interleaved step by step'}; "
        f"each timed call less the clock's own "
        f"{1e6 * calibrate(CLOCKS[args.clock]):.2f} us"
    )
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    for attention, b, cpu_factor in itertools.product(attns, bs, factors):
        warmup = 300 + b if args.warmup is None else args.warmup
        w = Workload(
            b=b,
            attention=attention,
            steps=warmup + args.steps,
            warmup=warmup,
            seed=args.seed,
            prompt_only=args.prompt_only,
            gpu_tokens_per_seq=args.gpu_tokens_per_seq,
            cpu_factor=cpu_factor,
            clock=args.clock,
        )
        t = time.perf_counter()
        solo = args.solo
        runs = {c: run_workload(w, c) for c in conns} if solo else run_interleaved(w, conns)
        for c, r in runs.items():
            print(
                f"  B={b} {attention} cpu x{cpu_factor:g} {c}: "
                f"{r.submitted} submitted, {len(r.finished)} finished, CPU {r.cpu_capacity}",
                file=sys.stderr,
            )
        print(f"  ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
        row: dict[str, Any] = {
            "b": b,
            "attention": attention,
            "cpu_factor": cpu_factor,
            "workload": asdict(w),
        }
        for c, r in runs.items():
            row[c] = {
                **r.summary(),
                "methods": r.methods,
                "flushed_jobs": r.flushed_jobs,
                "load_jobs": r.load_jobs,
                "store_jobs": r.store_jobs,
                "loaded_tokens": r.loaded_tokens,
                "finished": len(r.finished),
                "submitted": r.submitted,
                "preemptions": r.preemptions,
                "gc_pauses": r.gc_pauses,
                "prompt_tokens": r.prompt_tokens,
                "cpu_capacity": r.cpu_capacity,
                "stored_blocks_per_group": r.stored_blocks,
                "loaded_blocks_per_group": r.loaded_blocks,
                "step_ms": [round(x, 4) for x in r.step_ms],
                "step_load_jobs": r.step_loads,
            }
        if "vllm" in runs and "ours" in runs:
            row["check"] = chk = compare(runs["vllm"], runs["ours"])
            if rules_agree(w) and not (chk["same_finished"] and chk["loaded_differ"] == 0):
                failed.append(f"B={b} {attention} cpu x{cpu_factor:g}")
            o, om = row["ours"]["median_ms"], row["ours"]["mean_ms"]
            row["ratio"] = row["vllm"]["median_ms"] / o if o else float("inf")
            row["ratio_mean"] = row["vllm"]["mean_ms"] / om if om else float("inf")
        if args.profile and "ours" in conns:
            row["profile"] = run_workload(w, "ours", profile=True).profile
        rows.append(row)
        _print_detail(row)
    _print_table(rows, args)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "pinned": pinned, "rows": rows}))
    if failed:
        print(
            f"FAILED: the connectors finished different requests or loaded different tokens "
            f"where their rules agree: {', '.join(failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


def rules_agree(w: Workload) -> bool:
    """Whether both connectors must finish the same requests with the same loaded tokens:
    full attention (no sliding-window alignment rules) with a CPU tier that holds everything
    stored (no eviction order decides a load): at least twice the GPU pool."""
    return w.attention == "full" and w.cpu_factor >= 2.0


# The default run's second CPU pool size: as large as the GPU pool, so the CPU pool evicts
# under every store and eviction's cost is measured too, while later turns still load from it
# at full attention (at B=512: 1,397 load jobs against 1,864 at twice the GPU pool). At 0.5
# nothing stored outlives the GPU's own prefix cache: no loads at all. No check: eviction
# order decides later loads, and the two connectors' orders differ.
EVICTING_CPU_FACTOR = 1.0


def _print_detail(row: dict[str, Any]) -> None:
    print(f"\n## B={row['b']} {row['attention']} cpu x{row['cpu_factor']:g}")
    for c in CONNECTORS:
        r = row.get(c)
        if r is None:
            continue
        print(
            f"{c:>5}: median {r['median_ms']:.3f} ms/step, p90 {r['p90_ms']:.3f}, "
            f"mean {r['mean_ms']:.3f}; without GC pauses: median {r['median_nogc_ms']:.3f}, "
            f"mean {r['mean_nogc_ms']:.3f}; GC pauses {r['gc_ms_per_step']:.3f} ms/step "
            f"({r['gc_pauses']} in {r['gc_steps']} of {r['timed_steps']} steps)"
        )
        print(
            f"       engine {r['engine_median_ms']:.2f} ms/step; {r['timed_load_jobs']} load "
            f"jobs in the timed steps; {r['preemptions']} preemptions; {r['store_jobs']} store "
            f"jobs, GPU blocks stored per group {r['stored_blocks_per_group']}, loaded "
            f"{r['loaded_blocks_per_group']}; CPU {r['cpu_capacity']}"
        )
        for name, m in sorted(r["methods"].items(), key=lambda x: -x[1]["total_ms"]):
            print(
                f"       {name:<32} {m['calls']:>8} calls {m['total_ms']:>10.1f} ms "
                f"{m['us_per_call']:>9.1f} us/call, of which GC {m['gc_ms']:.1f} ms"
            )
    chk = row.get("check")
    if chk:
        print(f"check: {json.dumps(chk)}")
    if row.get("profile"):
        print("profile of ours (cProfile, top 25 by cumulative time; an extra run):")
        print(row["profile"])


def _print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n# connector scheduler-side time, ms/step over the timed steps: median, mean (total / "
        f"steps), mean without the GC pauses inside its calls, GC pauses; seed {args.seed}"
    )
    hdr = (
        f"{'B':>4} {'attention':>9} {'cpu':>4} {'vLLM med':>8} {'mean':>7} {'-GC':>7} "
        f"{'ours med':>8} {'mean':>7} {'-GC':>7} {'GC':>6} {'ratio':>11} "
        f"{'flush vLLM':>10} {'flush ours':>10} {'loads vLLM (tok)':>22} "
        f"{'loads ours (tok)':>22} {'fin vLLM':>8} {'fin ours':>8}"
    )
    print(hdr)
    for row in rows:
        a, o = row.get("vllm"), row.get("ours")

        def g(r: dict[str, Any] | None, k: str, fmt: str = "{}") -> str:
            return fmt.format(r[k]) if r else "-"

        def loads(r: dict[str, Any] | None) -> str:
            return f"{r['load_jobs']} ({r['loaded_tokens']})" if r else "-"

        ratio = f"{row['ratio']:.1f}/{row['ratio_mean']:.1f}x" if "ratio" in row else "-"
        print(
            f"{row['b']:>4} {row['attention']:>9} x{row['cpu_factor']:<3g} "
            f"{g(a, 'median_ms', '{:.3f}'):>8} {g(a, 'mean_ms', '{:.3f}'):>7} "
            f"{g(a, 'mean_nogc_ms', '{:.3f}'):>7} {g(o, 'median_ms', '{:.3f}'):>8} "
            f"{g(o, 'mean_ms', '{:.3f}'):>7} {g(o, 'mean_nogc_ms', '{:.3f}'):>7} "
            f"{g(o, 'gc_ms_per_step', '{:.3f}'):>6} {ratio:>11} {g(a, 'flushed_jobs'):>10} "
            f"{g(o, 'flushed_jobs'):>10} {loads(a):>22} {loads(o):>22} "
            f"{g(a, 'finished'):>8} {g(o, 'finished'):>8}"
        )
    print("ratio: vLLM's / ours, of the medians / of the means")


if __name__ == "__main__":
    if "PYTHONHASHSEED" not in os.environ:
        # vLLM's connector keeps offload keys (bytes) in sets: their order, hence its eviction
        # order under pressure, follows the per-process string hash seed. Fix it.
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sys.exit(main())
