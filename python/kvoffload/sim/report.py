"""Figures of a simulation as a flat dict (the JSON document) and a table.

The chart of the same run is :mod:`kvoffload.sim.plot`.
"""

from __future__ import annotations

from typing import Any

from kvoffload.sim.result import SimResult

__all__ = ["figures", "format_table"]


def _gb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def figures(run: SimResult, baseline: SimResult | None) -> dict[str, Any]:
    """Every figure of the table, as a flat JSON-able dict."""
    saved = None if baseline is None else baseline.prefill_tokens - run.prefill_tokens
    return {
        "workload": run.config["workload"],
        "requests": run.requests,
        "steps": run.steps,
        "lookup_tokens": run.lookup_tokens,
        "gpu_prefix_hit_tokens": run.gpu_hit_tokens,
        "cpu_hit_tokens": run.cpu_hit_tokens,
        "hit_rate": run.hit_rate,
        "prefill_tokens": run.prefill_tokens,
        "prefill_tokens_without_offload": None if baseline is None else baseline.prefill_tokens,
        "prefill_tokens_saved": saved,
        "prefill_saved_fraction": (
            None if baseline is None else saved / max(1, baseline.prefill_tokens)  # type: ignore[operator]
        ),
        "preemptions": run.preemptions,
        "store_jobs": run.store_jobs,
        "load_jobs": run.load_jobs,
        "bytes_stored": run.bytes_stored,
        "bytes_loaded": run.bytes_loaded,
        "store_gb_per_s": _gb_s(run.bytes_stored, run.store_seconds),
        "load_gb_per_s": _gb_s(run.bytes_loaded, run.load_seconds),
        "flushes_necessary": run.flushes_necessary,
        "flushes_conservative": run.flushes_conservative,
        "flushes_vllm_rule": run.flushes_vllm_rule,
        "flush_wait_ms": run.flush_wait_seconds * 1e3,
        "scheduler_us_per_step_mean": run.sched_step_us_mean,
        "scheduler_us_per_step_p99": run.sched_step_us_p99,
        "blocks_verified": run.blocks_verified,
        "hit_blocks_verified": run.hit_blocks_verified,
        "integrity_mismatches": run.mismatches,
        "hit_mismatches": run.hit_mismatches,
        "torn_stores": run.torn_stores,
        "leaked_requests": run.leaked_requests,
        "leaked_jobs": run.leaked_jobs,
        "wall_seconds": run.wall_seconds + (0.0 if baseline is None else baseline.wall_seconds),
        "disk_path": run.config.get("disk_path"),
        "remote_url": run.config.get("remote_url"),
        **{k: v for m in _media(run) for k, v in _tier_figures(run, m).items()},
    }


def _media(run: SimResult) -> list[str]:
    """The lower tiers of the run, nearest first (``disk``, ``remote``)."""
    c = run.config
    return [m for m, key in (("disk", "disk_path"), ("remote", "remote_url")) if c.get(key)]


def _tier_figures(run: SimResult, medium: str) -> dict[str, Any]:
    """``<medium>_*`` figures of one lower tier."""
    held = run.tiers.get(medium, {})
    return {
        f"{medium}_written_chunks": run.tier_written_chunks.get(medium, 0),
        f"{medium}_promoted_chunks": run.tier_promoted_chunks.get(medium, 0),
        f"{medium}_promoted_tokens": run.tier_promoted_tokens.get(medium, 0),
        f"{medium}_failed_jobs": run.tier_failed_jobs.get(medium, 0),
        f"{medium}_chunks_held": held.get("used", 0),
        f"{medium}_quarantined": held.get("quarantined", 0),
        f"{medium}_skipped_writes": held.get("skipped_writes", 0),
    }


def _tier_rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    """Table rows of the lower tiers whose figures are in ``f``."""
    rows = []
    for m in ("disk", "remote"):
        if f"{m}_written_chunks" not in f:
            continue
        rows += [
            (
                f"promoted from {m} first",
                f"{f[f'{m}_promoted_tokens']:,} tokens ({f[f'{m}_promoted_chunks']:,} chunks)",
            ),
            (
                f"{m} tier",
                f"{f[f'{m}_written_chunks']:,} chunks written, {f[f'{m}_chunks_held']:,} "
                f"held, {f[f'{m}_quarantined']} quarantined, {f[f'{m}_failed_jobs']} failed jobs, "
                f"{f[f'{m}_skipped_writes']:,} writes skipped (the tier did not keep up)",
            ),
        ]
    return rows


def _si(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} "


def format_table(f: dict[str, Any]) -> str:
    """The human-readable table of :func:`figures`."""
    saved = f["prefill_tokens_saved"]
    rows = [
        ("workload", f"{f['workload']}, {f['requests']} requests, {f['steps']} steps"),
        ("GPU prefix hits", f"{f['gpu_prefix_hit_tokens']:,} tokens"),
        ("CPU hits (loaded)", f"{f['cpu_hit_tokens']:,} tokens"),
        *_tier_rows(f),
        ("hit rate", f"{f['hit_rate']:.1%} of {f['lookup_tokens']:,} looked-up tokens"),
        (
            "prefill tokens saved",
            "n/a (no baseline)"
            if saved is None
            else f"{saved:,} ({f['prefill_saved_fraction']:.1%}): "
            f"{f['prefill_tokens']:,} computed vs {f['prefill_tokens_without_offload']:,} "
            "without offload",
        ),
        ("preemptions", f"{f['preemptions']:,}"),
        (
            "stored",
            f"{_si(f['bytes_stored'])}B in {f['store_jobs']:,} jobs, "
            f"{f['store_gb_per_s']:.2f} GB/s",
        ),
        (
            "loaded",
            f"{_si(f['bytes_loaded'])}B in {f['load_jobs']:,} jobs, {f['load_gb_per_s']:.2f} GB/s",
        ),
        (
            "flushes (necessary / conservative)",
            f"{f['flushes_necessary']:,} / {f['flushes_conservative']:,} jobs, "
            f"{f['flush_wait_ms']:.1f} ms waited",
        ),
        (
            "flushes under vLLM's rule (same run)",
            f"{f['flushes_vllm_rule']:,} jobs",
        ),
        (
            "scheduler time per step",
            f"{f['scheduler_us_per_step_mean']:.1f} us mean, "
            f"{f['scheduler_us_per_step_p99']:.1f} us p99",
        ),
        (
            "integrity mismatches",
            f"{f['integrity_mismatches']} (loads; {f['blocks_verified']:,} blocks verified), "
            f"{f['hit_mismatches']} (GPU hits; {f['hit_blocks_verified']:,} verified), "
            f"{f['torn_stores']} torn stores",
        ),
        ("leaks at the end", f"{f['leaked_requests']} requests, {f['leaked_jobs']} jobs"),
        ("wall time", f"{f['wall_seconds']:.1f} s"),
    ]
    w = max(len(k) for k, _ in rows)
    line = "-" * (w + 3 + max(len(v) for _, v in rows))
    body = "\n".join(f"{k:<{w}} : {v}" for k, v in rows)
    return f"{line}\n{body}\n{line}"
