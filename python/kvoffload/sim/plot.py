"""The chart of a simulation (``kvoffload simulate --plot``): what offloading bought, over time.

Four panels against the engine step, each with labelled axes and a legend:

* **prefill tokens computed**, with offloading and without (the baseline run), cumulative;
* **hit rate by tier**: the share of looked-up prompt tokens served by each tier (GPU prefix
  cache, CPU tier) and by all of them, per window of about 2% of the run;
* **bytes moved**: stored (GPU to CPU) and loaded (CPU to GPU), cumulative;
* **flushes**: store jobs our fence flushed, and those vLLM's own rule would have flushed on the
  same run (:mod:`kvoffload.sim.vllm_rule`), cumulative.

matplotlib is the optional extra ``plot`` (``pip install 'kvoffload[plot]'``). It is imported
here only, when a chart is drawn, through :class:`matplotlib.figure.Figure`: no pyplot, no
global state, no GUI backend.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvoffload.sim.result import SimResult, TimelinePoint

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["INSTALL_HINT", "PlotUnavailableError", "check_plot_path", "make_figure", "write_plot"]

INSTALL_HINT = "pip install 'kvoffload[plot]'"

HIT_TIERS = (("GPU prefix cache", "gpu_hit_tokens"), ("CPU tier", "cpu_hit_tokens"))
"""The tiers of the hit-rate panel, top first: (legend label, cumulative column of the
timeline). A lower tier adds its column to :class:`TimelinePoint` and a row here."""

_WINDOWS = 50
"""Hit rates are drawn per window of about 1/50 of the run."""


class PlotUnavailableError(ImportError):
    """matplotlib (the ``plot`` extra) is not installed; the message says how to install it."""


def check_plot_path(path: str) -> None:
    """Checks that a chart can be written to ``path``, before a long run is started for it.

    Raises:
        PlotUnavailableError: matplotlib is not installed.
        ValueError: matplotlib cannot write the format of ``path``'s suffix (none: PNG).
    """
    formats = _figure_class()().canvas.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix and suffix not in formats:
        raise ValueError(
            f"cannot write a chart to {path!r}: unknown format {suffix!r}; use one of "
            f"{', '.join(sorted(formats))}"
        )


def _figure_class() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailableError(
            f"drawing the chart needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from e
    return Figure


def _columns(run: SimResult) -> dict[str, npt.NDArray[np.float64]]:
    """The run's timeline as one array per :class:`TimelinePoint` field."""
    fields = TimelinePoint._fields
    t = np.asarray(run.timeline, dtype=np.float64).reshape(-1, len(fields))
    return dict(zip(fields, t.T, strict=True))


def _windowed_rates(
    c: dict[str, npt.NDArray[np.float64]],
) -> tuple[npt.NDArray[np.float64], list[tuple[str, npt.NDArray[np.float64]]]]:
    """Hit rate (%) of each tier and of all tiers per window: (window end steps, series).

    A window where nothing was looked up has no rate (NaN: a gap in the line). Hits of lower
    tiers count when their load completes, lookups at admission: a tier's hits in a window are
    clipped to the lookups the tiers above it left unserved.
    """
    n = len(c["step"])
    idx = np.arange(0, n, max(1, n // _WINDOWS))
    if n and idx[-1] != n - 1:
        idx = np.append(idx, n - 1)  # the last window ends at the last step
    looked = np.diff(c["lookup_tokens"][idx], prepend=0.0)
    left = looked.copy()
    series = []
    for label, column in HIT_TIERS:
        hits = np.minimum(np.diff(c[column][idx], prepend=0.0), np.maximum(left, 0.0))
        left -= hits
        series.append((label, hits))
    series.append(("all tiers", looked - left))
    rate = []
    for label, hits in series:
        pct = np.full(len(idx), np.nan)
        np.divide(hits * 100.0, looked, out=pct, where=looked > 0)
        rate.append((label, pct))
    return c["step"][idx], rate


def _byte_unit(peak: float) -> tuple[float, str]:
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if peak >= div:
            return div, unit
    return 1.0, "bytes"


def _finish(ax: Axes, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("engine step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")


def make_figure(run: SimResult, baseline: SimResult | None = None) -> Figure:
    """Draws the four panels of a run (and of its baseline without offloading, if given).

    Raises:
        PlotUnavailableError: matplotlib is not installed.
    """
    fig = _figure_class()(figsize=(13, 8.5), dpi=100, layout="constrained")
    (prefill, hits), (moved, flushes) = fig.subplots(2, 2)
    c = _columns(run)
    step = c["step"]
    fig.suptitle(
        f"kvoffload simulate: {run.config.get('workload')} workload, {run.requests} requests, "
        f"{run.steps} steps"
    )

    prefill.plot(step, c["prefill_tokens"], label="with offloading")
    if baseline is not None:
        b = _columns(baseline)
        prefill.plot(b["step"], b["prefill_tokens"], "--", label="without offloading")
    _finish(prefill, "Prefill tokens computed", "tokens (cumulative)")

    x, rates = _windowed_rates(c)
    for label, pct in rates:
        hits.plot(x, pct, label=label)
    hits.set_ylim(0, 100)
    _finish(hits, "Hit rate by tier", "% of looked-up prompt tokens")

    div, unit = _byte_unit(
        float(max(c["bytes_stored"].max(initial=0), c["bytes_loaded"].max(initial=0)))
    )
    moved.plot(step, c["bytes_stored"] / div, label="stored (GPU to CPU)")
    moved.plot(step, c["bytes_loaded"] / div, label="loaded (CPU to GPU)")
    _finish(moved, "Bytes moved", f"{unit} (cumulative)")

    flushes.plot(step, c["flushed_jobs"], label="kvoffload fence")
    flushes.plot(step, c["flushes_vllm_rule"], "--", label="vLLM's rule (same run)")
    _finish(flushes, "Flushes: store jobs waited for", "jobs (cumulative)")
    return fig


def write_plot(path: str, run: SimResult, baseline: SimResult | None = None) -> Figure:
    """Writes the chart of :func:`make_figure` to ``path`` (PNG unless the suffix says
    otherwise) and returns the figure.

    Raises:
        PlotUnavailableError: matplotlib is not installed.
    """
    fig = make_figure(run, baseline)
    fig.savefig(path)
    return fig
