"""Figures of a simulation as a table, a JSON document and a PNG chart.

The PNG is drawn without matplotlib: a tiny numpy rasteriser (lines, axes, a 3x5 bitmap font for
labels) and a PNG encoder on :mod:`zlib`.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.sim.engine import SimResult

__all__ = ["figures", "format_table", "write_png_plot"]


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
    }


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


# ---------------------------------------------------------------------- PNG

_FONT = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
    ".": "000000000000010",
    "%": "101001010100101",
    " ": "000000000000000",
    "-": "000000111000000",
    ":": "000010000010000",
}
for _c, _rows in {
    "A": "010101111101101",
    "B": "110101110101110",
    "C": "111100100100111",
    "D": "110101101101110",
    "E": "111100110100111",
    "F": "111100110100100",
    "G": "111100101101111",
    "H": "101101111101101",
    "I": "111010010010111",
    "K": "101101110101101",
    "L": "100100100100111",
    "M": "101111111101101",
    "N": "110101101101101",
    "O": "111101101101111",
    "P": "111101111100100",
    "R": "110101110101101",
    "S": "111100111001111",
    "T": "111010010010010",
    "U": "101101101101111",
    "W": "101101111111101",
    "Y": "101101010010010",
}.items():
    _FONT[_c] = _rows


def _text(img: npt.NDArray[np.uint8], x: int, y: int, s: str, color: tuple[int, int, int]) -> None:
    scale = 2
    for ch in s.upper():
        bits = _FONT.get(ch, _FONT[" "])
        for i, bit in enumerate(bits):
            if bit == "1":
                r, c = divmod(i, 3)
                y0, x0 = y + r * scale, x + c * scale
                img[y0 : y0 + scale, x0 : x0 + scale] = color
        x += 4 * scale


def _line(
    img: npt.NDArray[np.uint8],
    xs: npt.NDArray[np.float64],
    ys: npt.NDArray[np.float64],
    color: tuple[int, int, int],
) -> None:
    h, w, _ = img.shape
    for i in range(len(xs) - 1):
        n = int(max(abs(xs[i + 1] - xs[i]), abs(ys[i + 1] - ys[i]), 1)) * 2
        px = np.linspace(xs[i], xs[i + 1], n).round().astype(int)
        py = np.linspace(ys[i], ys[i + 1], n).round().astype(int)
        ok = (px >= 0) & (px < w - 1) & (py >= 0) & (py < h - 1)
        px, py = px[ok], py[ok]
        img[py, px] = color
        img[py + 1, px] = color


def _panel(
    img: npt.NDArray[np.uint8],
    top: int,
    height: int,
    x: npt.NDArray[np.float64],
    series: list[tuple[str, npt.NDArray[np.float64], tuple[int, int, int]]],
    title: str,
    fmt: str,
) -> None:
    _, w, _ = img.shape
    left, right = 70, w - 20
    bottom = top + height
    img[top:bottom, left] = 0
    img[bottom, left:right] = 0
    ymax = max(float(max((s.max() for _, s, _ in series), default=0.0)), 1e-9)
    xmax = max(float(x.max()) if len(x) else 1.0, 1.0)
    for frac in (0.0, 0.5, 1.0):
        yy = int(bottom - frac * height)
        img[yy, left - 4 : left] = 0
        _text(img, 4, yy - 5, fmt.format(frac * ymax), (0, 0, 0))
    _text(img, left + 8, top - 16, title, (0, 0, 0))
    lx = left + 8 + 8 * (len(title) + 2)
    for name, s, color in series:
        px = left + x / xmax * (right - left)
        py = bottom - s / ymax * height
        _line(img, px, py, color)
        _text(img, lx, top - 16, name, color)
        lx += 8 * (len(name) + 2)
    _text(img, right - 8 * 12, bottom + 6, f"STEP {int(xmax)}", (0, 0, 0))


def _png(img: npt.NDArray[np.uint8]) -> bytes:
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def write_png_plot(run: SimResult, path: str, width: int = 900, height: int = 560) -> None:
    """Writes a PNG: hit rate over time (GPU, CPU, total; per 2% of the run) on top and
    cumulative offloaded bytes (stored, loaded) below."""
    t = np.array(run.timeline, dtype=np.float64).reshape(-1, 6)
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    if len(t):
        step, look, gpu, cpu, st, ld = t.T
        win = max(1, len(step) // 50)
        idx = np.arange(0, len(step), win)
        idx = np.append(idx, len(step) - 1) if idx[-1] != len(step) - 1 else idx
        dl = np.diff(np.concatenate(([0.0], look[idx])))
        dg = np.diff(np.concatenate(([0.0], gpu[idx])))
        dc = np.diff(np.concatenate(([0.0], cpu[idx])))
        denom = np.maximum(dl, 1.0)
        # CPU hits count when their load completes, lookups at admission: clip the overlap.
        dc = np.minimum(dc, np.maximum(dl - dg, 0.0))
        x = step[idx]
        ph = (height - 120) // 2
        _panel(
            img,
            40,
            ph,
            x,
            [
                ("GPU", dg / denom * 100, (30, 90, 200)),
                ("CPU", dc / denom * 100, (220, 120, 20)),
                ("TOTAL", (dg + dc) / denom * 100, (20, 150, 60)),
            ],
            "HIT RATE %",
            "{:.0f}%",
        )
        _panel(
            img,
            40 + ph + 60,
            ph,
            step,
            [("STORED", st / 1e6, (200, 40, 40)), ("LOADED", ld / 1e6, (40, 40, 200))],
            "OFFLOADED MB",
            "{:.1f}",
        )
    with open(path, "wb") as fh:
        fh.write(_png(img))
