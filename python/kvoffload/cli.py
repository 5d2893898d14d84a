"""The ``kvoffload`` command.

``kvoffload simulate`` runs a seeded workload through the simulated engine twice — with
offloading and without — and prints a table: GPU prefix hits, CPU hits, prefill tokens saved,
bytes moved and bandwidth, flushes, scheduler time per step, and integrity mismatches. The exit
status is 1 unless mismatches, torn stores and leaks are 0, and failed jobs too (unless
``--fail-loads`` / ``--fail-stores`` injects failures); 2 for a configuration that cannot run.
``--json`` writes the same figures; ``--plot`` a chart of prefill tokens with and without
offloading, hit rate by tier, bytes moved and flushes over the run (needs the ``plot`` extra,
matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
    return v


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def _rate(text: str) -> float:
    v = _non_negative_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``kvoffload`` command."""
    p = argparse.ArgumentParser(
        prog="kvoffload", description="KV-cache offloading to CPU memory, with an exact fence."
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    s = sub.add_parser(
        "simulate",
        help="run a simulated engine with and without offloading and compare",
        description=(
            "Run a seeded workload through a simulated paged engine with offloading, and again "
            "without, verifying every loaded block byte for byte. Exit status 1 if any "
            "integrity mismatch, torn store, leak or (without injected faults) failed job was "
            "found."
        ),
    )
    s.add_argument(
        "--workload",
        choices=["chat", "sysprompt", "docs", "mixed"],
        default="mixed",
        help="request mix (default: mixed)",
    )
    s.add_argument("--requests", type=_positive, default=400, help="requests (default: 400)")
    s.add_argument(
        "--gpu-blocks", type=_positive, default=512, help="GPU blocks of 16 tokens (default: 512)"
    )
    s.add_argument(
        "--cpu-chunks", type=_positive, default=8192, help="CPU slots per KV group (default: 8192)"
    )
    s.add_argument("--policy", choices=["lru", "arc"], default="lru", help="CPU eviction policy")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="KV tensors' device")
    s.add_argument("--seed", type=_non_negative, default=0, help="workload seed (default: 0)")
    s.add_argument(
        "--fence",
        choices=["exact", "conservative", "off"],
        default="exact",
        help="written blocks passed to the fence: exact, conservative (all allocated), or off "
        "(flush set ignored: a deliberately broken run)",
    )
    s.add_argument(
        "--sliding-window",
        type=_non_negative,
        default=128,
        metavar="TOKENS",
        help="window of the second, sliding-window KV group (default: 128; 0: none)",
    )
    s.add_argument(
        "--async-scheduling", action="store_true", help="one-step lag between schedule and outputs"
    )
    s.add_argument(
        "--completion",
        choices=["step", "poll"],
        default="poll",
        help="poll: jobs complete as copies finish (default); step: every copy completes by the "
        "next step (figures reproducible run to run)",
    )
    s.add_argument(
        "--copy-delay-ms",
        type=_non_negative_float,
        default=0.0,
        help="sleep before each store job's first copy (default: 0)",
    )
    s.add_argument(
        "--fail-loads",
        type=_rate,
        default=0.0,
        metavar="SHARE",
        help="fail this share of load jobs on purpose (seeded; default: 0)",
    )
    s.add_argument(
        "--fail-stores",
        type=_rate,
        default=0.0,
        metavar="SHARE",
        help="fail this share of store jobs on purpose (seeded; default: 0)",
    )
    s.add_argument(
        "--scale", type=_positive_float, default=1.0, help="multiply every length (default: 1)"
    )
    s.add_argument(
        "--token-bytes", type=_positive, default=64, help="KV bytes per token per layer (64)"
    )
    s.add_argument("--max-num-seqs", type=_positive, default=32, help="requests holding blocks")
    s.add_argument("--token-budget", type=_positive, default=512, help="tokens per step")
    s.add_argument("--no-baseline", action="store_true", help="skip the run without offloading")
    s.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    s.add_argument(
        "--plot",
        metavar="PATH",
        help="write a chart (PNG): prefill tokens with and without offloading, hit rate by tier, "
        "bytes moved and flushes over the run; needs pip install 'kvoffload[plot]'",
    )
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


class _Progress:
    """A plain stderr progress bar (redrawn in place on a terminal, sparse lines otherwise)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last = -1
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int, step: int) -> None:
        if not self.enabled:
            return
        pct = done * 100 // max(1, total)
        if pct == self.last or (not self.tty and pct % 25 and done != total):
            return
        self.last = pct
        bar = "#" * (pct // 4) + "." * (25 - pct // 4)
        msg = (
            f"{self.label:<12} [{bar}] {pct:3d}% {done}/{total} requests, step {step}, "
            f"{time.perf_counter() - self.t0:.1f}s"
        )
        sys.stderr.write(("\r" + msg) if self.tty else (msg + "\n"))
        if self.tty and done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _simulate(args: argparse.Namespace) -> int:
    from kvoffload.errors import ConfigError
    from kvoffload.sim import SimConfig, SimError, simulate
    from kvoffload.sim.plot import check_plot_path, write_plot
    from kvoffload.sim.report import figures, format_table

    if args.plot:
        try:  # before the runs, not after minutes of them
            check_plot_path(args.plot)
        except (ImportError, ValueError) as e:
            print(f"kvoffload simulate: error: --plot: {e}", file=sys.stderr)
            return 2
    try:
        cfg = SimConfig(
            workload=args.workload,
            num_requests=args.requests,
            seed=args.seed,
            scale=args.scale,
            num_gpu_blocks=args.gpu_blocks,
            cpu_chunks=args.cpu_chunks,
            policy=args.policy,
            sliding_window=args.sliding_window or None,
            max_num_seqs=args.max_num_seqs,
            token_budget=args.token_budget,
            token_bytes=args.token_bytes,
            device=args.device,
            fence=args.fence,
            async_scheduling=args.async_scheduling,
            completion=args.completion,
            copy_delay_s=args.copy_delay_ms / 1e3,
            load_fault_rate=args.fail_loads,
            store_fault_rate=args.fail_stores,
        )
        cfg.validate()
        run = simulate(cfg, progress=_Progress("offload", not args.quiet))
        base = None
        if not args.no_baseline:
            from dataclasses import replace

            base = simulate(
                replace(cfg, offload=False), progress=_Progress("no offload", not args.quiet)
            )
    except (ConfigError, SimError) as e:
        print(f"kvoffload simulate: error: {e}", file=sys.stderr)
        return 2
    figs = figures(run, base)
    print(format_table(figs))
    for m in run.mismatch_details[:5]:
        print(
            f"  mismatch: {m.kind} of {m.request} group {m.group} chunk {m.chunk} "
            f"(block {m.block}) at step {m.step}",
        )
    if args.json:
        doc = {"figures": figs, "config": run.config}
        doc["mismatch_details"] = run.to_dict()["mismatch_details"]
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    if args.plot:
        write_plot(args.plot, run, base)
        print(f"chart: {os.path.abspath(args.plot)}")
    problems = {
        "integrity mismatches": run.mismatches + run.hit_mismatches,
        "baseline GPU-hit mismatches": base.hit_mismatches if base else 0,
        "torn stores": run.torn_stores,
        "leaked requests": run.leaked_requests,
        "leaked jobs": run.leaked_jobs,
        # With no fault injected, a failed copy is a fault of the data plane itself.
        "failed jobs": run.failed_jobs if not (args.fail_loads or args.fail_stores) else 0,
    }
    found = [f"{n} {what}" for what, n in problems.items() if n]
    if found:
        print(f"kvoffload simulate: FAILED: {', '.join(found)}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvoffload`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "simulate":
        return _simulate(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
