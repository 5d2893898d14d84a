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
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import Any, TypeVar

from kvoffload.scheduler import OPTION_DEFAULTS

__all__ = ["build_parser", "main"]

_N = TypeVar("_N", int, float)

_OPTION = OPTION_DEFAULTS
"""The defaults of the options that set a scheduler option: that option's."""


def _number(
    convert: Callable[[str], _N], ok: Callable[[_N], bool], expected: str
) -> Callable[[str], _N]:
    """An argparse type: ``convert`` the text, accept it if ``ok``, else say what was
    ``expected``."""

    def parse(text: str) -> _N:
        try:
            v = convert(text)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return v

    return parse


_positive = _number(int, lambda v: v > 0, "a positive integer")
_non_negative = _number(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _number(float, lambda v: v > 0 and math.isfinite(v), "a finite positive number")
_non_negative_float = _number(float, lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0")


def _config_option(s: argparse.ArgumentParser, flag: str, name: str, what: str, **kw: Any) -> None:
    """Adds ``flag``, which sets ``OffloadConfig.<name>``: that field's default is the option's,
    its help says so (the field's documentation says more), and the core checks the value."""
    default = _OPTION[name]
    s.add_argument(
        flag,
        dest=name,
        default=default,
        help=f"{what} (OffloadConfig.{name}; default: {default})",
        **kw,
    )


def _cpu_ids(text: str) -> tuple[int, ...]:
    """``--io-cpus``: comma-separated CPU ids (which ones the process may use is checked with
    the rest of the configuration)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected CPU ids separated by commas (e.g. 1,2), got {text!r}"
        ) from None


def _rate(text: str) -> float:
    v = _non_negative_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got {text!r}")
    return v


def _window(text: str) -> int | None:
    return _non_negative(text) or None  # 0: no sliding-window group


def _milliseconds(text: str) -> float:
    return _non_negative_float(text) / 1e3  # to seconds


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
    # Each option's dest is the SimConfig field it sets (converted by its type).
    sizes = (
        ("--requests", "num_requests", 400, "requests"),
        ("--gpu-blocks", "num_gpu_blocks", 512, "GPU blocks of 16 tokens"),
        ("--cpu-chunks", "cpu_chunks", 8192, "CPU slots per KV group"),
        ("--token-bytes", "token_bytes", 64, "KV bytes per token per layer"),
        ("--max-num-seqs", "max_num_seqs", 32, "requests holding blocks"),
        ("--token-budget", "token_budget", 512, "tokens computed per step"),
    )
    for flag, dest, default, what in sizes:
        s.add_argument(
            flag,
            dest=dest,
            type=_positive,
            default=default,
            metavar="N",
            help=f"{what} (default: {default})",
        )
    _config_option(s, "--policy", "policy", "CPU eviction policy", choices=["lru", "arc"])
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
        type=_window,
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
        dest="copy_delay_s",
        type=_milliseconds,
        metavar="MS",
        default=0.0,
        help="sleep before each store job's first copy (default: 0)",
    )
    for kind in ("load", "store"):
        s.add_argument(
            f"--fail-{kind}s",
            dest=f"{kind}_fault_rate",
            type=_rate,
            default=0.0,
            metavar="SHARE",
            help=f"fail this share of {kind} jobs on purpose (seeded; default: 0)",
        )
    s.add_argument(
        "--scale", type=_positive_float, default=1.0, help="multiply every length (default: 1)"
    )
    s.add_argument("--no-baseline", action="store_true", help="skip the run without offloading")
    s.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    s.add_argument(
        "--plot",
        metavar="PATH",
        help="write a chart (PNG): prefill tokens with and without offloading, hit rate by tier, "
        "bytes moved and flushes over the run; needs pip install 'kvoffload[plot]'",
    )
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument(
        "--disk",
        dest="disk_path",
        metavar="DIR",
        help="a disk tier below the CPU pool in DIR (kept across runs)",
    )
    s.add_argument(
        "--disk-bytes",
        dest="disk_bytes",
        type=_positive,
        default=1 << 30,
        metavar="N",
        help="bytes of the disk tier per KV group (default: 1 GiB)",
    )
    _config_option(
        s,
        "--disk-deadline-ms",
        "disk_deadline_ms",
        "with --disk: a promotion from disk later than this expires and its requests recompute",
        type=float,
        metavar="MS",
    )
    _config_option(
        s,
        "--disk-probation-after",
        "disk_probation_after",
        "with --disk: this many failed or expired disk jobs in a row put the disk tier on "
        "probation (no writes, lookups skip it)",
        type=int,
        metavar="N",
    )
    _config_option(
        s,
        "--disk-probation-ms",
        "disk_probation_ms",
        "with --disk: how long a probation lasts before a trial job",
        type=float,
        metavar="MS",
    )
    s.add_argument(
        "--restart",
        action="store_true",
        help="with --disk: run the workload, close, reopen the same directory and run it "
        "again; the table is the second run's (its first requests hit disk)",
    )
    s.add_argument(
        "--remote",
        dest="remote_url",
        metavar="URL",
        help="a shared tier below the CPU pool: Redis (redis://[user:password@]host:port) or a "
        "Redis Cluster (redis+cluster://[user:password@]host:port[,host:port...]): --engines "
        "engines run the workload at the same time against it, each starting once the one "
        "before finished a quarter of it; the table is the last engine's (it promotes what the "
        "others wrote behind), followed by the share of keys and bytes per server. With --disk: "
        "one engine with both tiers",
    )
    s.add_argument(
        "--remote-tls-ca",
        dest="remote_tls_ca",
        metavar="FILE",
        help="with a rediss:// (TLS) --remote: the PEM file of the CA that signs the servers'",
    )
    s.add_argument(
        "--engines",
        type=int,
        default=2,
        metavar="N",
        help="with --remote: how many engines share the tier (default: 2)",
    )
    s.add_argument(
        "--io-cpus",
        dest="io_cpus",
        type=_cpu_ids,
        metavar="IDS",
        help="pin the lower tiers' I/O threads to these CPUs, e.g. 1,2 (Linux; default: not "
        "pinned); keep the engine off them",
    )
    _config_option(
        s,
        "--tier-write-share",
        "tier_write_share",
        "at most this share of each group's CPU slots is pinned by write-behind to the "
        "lower tiers; past it a write is skipped",
        type=float,
        metavar="SHARE",
    )
    s.add_argument(
        "--tier-delay-ms-per-chunk",
        dest="tier_delay_ms_per_chunk",
        type=_non_negative_float,
        default=0.0,
        metavar="MS",
        help="simulate a slow lower tier: it runs its jobs one after another, each chunk taking "
        "MS of simulated time (10 ms per step; counted in steps, reproducible with --completion "
        "step; default: 0, the real I/O's speed)",
    )
    s.add_argument(
        "--tier-stall",
        dest="tier_stall",
        action="store_true",
        help="simulate a stuck lower tier: no tier job completes until the run drains",
    )
    _add_disk_parser(sub)
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


def _add_disk_parser(sub: Any) -> None:
    """``kvoffload disk inspect DIR`` and ``kvoffload disk verify DIR``."""
    d = sub.add_parser(
        "disk",
        help="inspect or verify a disk tier directory",
        description="Report a disk tier directory (read-only): one line per namespace.",
    )
    dsub = d.add_subparsers(dest="disk_command", metavar="ACTION")
    dsub.required = True
    for name, what in (
        ("inspect", "namespaces, chunks, bytes and quarantined slots (headers only)"),
        (
            "verify",
            "read every chunk and check every checksum; exit status 1 for any problem (a bad "
            "chunk or header, a slab without its layout note, a link, a directory in use)",
        ),
    ):
        a = dsub.add_parser(name, help=what, description=what)
        a.add_argument("dir", metavar="DIR", help="the disk tier's directory (disk_path)")
        a.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _disk(args: argparse.Namespace) -> int:
    from kvoffload._core import disk_inspect
    from kvoffload.errors import KvOffloadError

    verify = args.disk_command == "verify"
    if not os.path.isdir(args.dir):
        print(f"kvoffload disk: error: {args.dir!r} is not a directory", file=sys.stderr)
        return 2
    try:
        reports = disk_inspect(args.dir, verify=verify)
    except KvOffloadError as e:
        print(f"kvoffload disk: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{**r, "dir": str(r["dir"])} for r in reports], indent=2))
    else:
        cols = ["namespace", "group", "chunk_bytes", "slots", "chunks", "free", "quarantined"]
        cols += ["bad_headers", "disk_bytes"] + (["verified", "corrupt"] if verify else [])
        rows = [cols] + [[str(r[c]) for c in cols] for r in reports]
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        for row in rows:
            print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
        chunks = sum(r["chunks"] for r in reports)
        used = sum(r["disk_bytes"] for r in reports)
        print(f"{len(reports)} namespaces, {chunks} chunks, {used} bytes on disk")
        for r in reports:
            if r["in_use"] is not None and not verify:
                print(f"{r['dir']}: in use by {r['in_use']} (a snapshot of a live directory)")
    problems = [p for r in reports for p in r["problems"]]
    for p in problems:
        print(f"kvoffload disk {args.disk_command}: {p}", file=sys.stderr)
    if verify and problems:
        bad = sum(r.get("corrupt", 0) for r in reports)
        print(
            f"kvoffload disk verify: FAILED: {len(problems)} problems, {bad} corrupt chunks",
            file=sys.stderr,
        )
        return 1
    return 0


def _engine_name(i: int) -> str:
    """A, B, ..., Z, then E27, E28, ..."""
    return chr(ord("A") + i) if i < 26 else f"E{i + 1}"


def _redacted(url: str) -> str:
    """``url`` with its password replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    cred, at, hosts = rest.rpartition("@")
    if not sep or not at:
        return url
    user = cred.split(":", 1)[0] if ":" in cred else ""
    return f"{scheme}://{user}:***@{hosts}"


def _node_table(runs: list[Any]) -> str:
    """The shared tier's servers: keys and bytes written (and their shares) and chunks read,
    summed over every engine."""
    total: dict[str, dict[str, int]] = {}
    for r in runs:
        for node, st in r.remote_nodes.items():
            into = total.setdefault(node, {})
            for k, v in st.items():
                into[k] = into.get(k, 0) + v
    if not total:
        return ""
    keys = sum(st["writes"] for st in total.values()) or 1
    nbytes = sum(st["bytes_written"] for st in total.values()) or 1
    lines = [
        f"{'server':<24} {'chunks written':>15} {'share':>7} {'bytes written':>15} "
        f"{'share':>7} {'chunks read':>12} {'failed ops':>11}"
    ]
    for node in sorted(total):
        st = total[node]
        lines.append(
            f"{node:<24} {st['writes']:>15,} {st['writes'] / keys:>7.1%} "
            f"{st['bytes_written']:>15,} {st['bytes_written'] / nbytes:>7.1%} "
            f"{st['read_hits']:>12,} {st['errors'] + st['deadline_misses']:>11,}"
        )
    return "\n".join(lines)


def _simulate(args: argparse.Namespace) -> int:
    from kvoffload.errors import ConfigError, TierInUseError
    from kvoffload.sim import SimConfig, SimError, simulate, simulate_fleet
    from kvoffload.sim.plot import check_plot_path, write_plot
    from kvoffload.sim.report import figures, format_table

    if args.plot:
        try:  # before the runs, not after minutes of them
            check_plot_path(args.plot)
        except (ImportError, ValueError) as e:
            print(f"kvoffload simulate: error: --plot: {e}", file=sys.stderr)
            return 2
    remote_nodes = ""
    try:
        given = vars(args)
        cfg = SimConfig(**{f.name: given[f.name] for f in fields(SimConfig) if f.name in given})
        cfg.validate()
        if args.restart and cfg.disk_path is None:
            raise ConfigError("--restart needs --disk DIR")
        if args.restart:
            first = simulate(cfg, progress=_Progress("offload (fill disk)", not args.quiet))
            print(
                f"before the restart: {first.tier_written_chunks.get('disk', 0):,} chunks "
                "written to "
                f"{cfg.disk_path}, {first.prefill_tokens:,} prefill tokens"
            )
        if args.engines != 2 and cfg.remote_url is None:
            raise ConfigError(f"--engines {args.engines} needs --remote URL")
        if cfg.remote_url is not None and cfg.disk_path is None:
            runs = simulate_fleet(
                cfg,
                engines=args.engines,
                progress=lambda i: _Progress(f"engine {_engine_name(i)}", not args.quiet),
            )
            run = runs[-1]
            for i, first in enumerate(runs[:-1]):
                print(
                    f"engine {_engine_name(i)}: "
                    f"{first.tier_written_chunks.get('remote', 0):,} chunks written to "
                    f"{_redacted(cfg.remote_url)}, {first.prefill_tokens:,} prefill tokens, "
                    f"{first.tier_promoted_chunks.get('remote', 0):,} chunks promoted from it"
                )
            print(f"engine {_engine_name(len(runs) - 1)} (concurrently):")
            remote_nodes = _node_table(runs)
        else:
            run = simulate(cfg, progress=_Progress("offload", not args.quiet))
        base = None
        if not args.no_baseline:
            base = simulate(
                replace(cfg, offload=False), progress=_Progress("no offload", not args.quiet)
            )
    except (ConfigError, TierInUseError, SimError) as e:
        print(f"kvoffload simulate: error: {e}", file=sys.stderr)
        return 2
    figs = figures(run, base)
    print(format_table(figs))
    if remote_nodes:
        print(remote_nodes)
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
        "failed jobs": 0 if cfg.load_fault_rate or cfg.store_fault_rate else run.failed_jobs,
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
    if args.command == "disk":
        return _disk(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
