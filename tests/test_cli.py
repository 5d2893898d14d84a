"""The ``kvoffload`` command (:mod:`kvoffload.cli`)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from kvoffload.cli import main
from kvoffload.sim import SimResult, simulate
from kvoffload.sim.plot import PlotUnavailableError, check_plot_path, make_figure, write_plot
from tests.support.sim import PRESSURE

SMALL = ["simulate", "--requests", "12", "--scale", "0.3", "--gpu-blocks", "96", "--quiet"]
FIGURES = {
    "gpu_prefix_hit_tokens",
    "cpu_hit_tokens",
    "hit_rate",
    "prefill_tokens",
    "prefill_tokens_without_offload",
    "prefill_tokens_saved",
    "bytes_stored",
    "bytes_loaded",
    "store_gb_per_s",
    "load_gb_per_s",
    "flushes_necessary",
    "flushes_conservative",
    "scheduler_us_per_step_mean",
    "scheduler_us_per_step_p99",
    "integrity_mismatches",
}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "COMMAND"),
        (["simulate", "--requests", "0"], "positive integer"),
        (["simulate", "--requests", "many"], "positive integer"),
        (["simulate", "--workload", "nope"], "invalid choice"),
        (["simulate", "--fence", "sometimes"], "invalid choice"),
        (["simulate", "--device", "tpu"], "invalid choice"),
        (["simulate", "--seed", "-1"], "integer >= 0"),
        (["simulate", "--copy-delay-ms", "-1"], "--copy-delay-ms: expected a finite number >= 0"),
        (["simulate", "--copy-delay-ms", "inf"], "--copy-delay-ms: expected a finite number"),
        (["simulate", "--copy-delay-ms", "nan"], "--copy-delay-ms: expected a finite number"),
        (["simulate", "--scale", "inf"], "--scale: expected a finite positive number, got 'inf'"),
        (["simulate", "--scale", "nan"], "--scale: expected a finite positive number"),
        (["simulate", "--fail-loads", "1.5"], "--fail-loads: expected a share in [0, 1]"),
        (["simulate", "--fail-stores", "-0.1"], "--fail-stores: expected a finite number >= 0"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_argument_errors_exit_non_zero_with_a_message(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code != 0
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--gpu-blocks", "4"], "GPU blocks"),
        (["--sliding-window", "8"], "sliding_window"),
        (["--copy-delay-ms", "120000"], "copy_delay_s must be a number in [0, 60]"),
    ],
)
def test_impossible_runs_exit_non_zero_with_a_message(
    extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *extra]) == 2
    assert needle in capsys.readouterr().err


def test_json_has_every_figure_of_the_table(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fig.json"
    png = tmp_path / "fig.png"
    assert main([*SMALL, "--json", str(out), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    doc = json.loads(out.read_text())
    figs = doc["figures"]
    assert set(figs) >= FIGURES
    assert figs["integrity_mismatches"] == 0
    assert figs["prefill_tokens_without_offload"] >= figs["prefill_tokens"]
    assert doc["config"]["num_gpu_blocks"] == 96
    for label in ("GPU prefix hits", "CPU hits", "prefill tokens saved", "flushes", "mismatches"):
        assert label in table
    assert f"chart: {png}" in table
    assert_png(png.read_bytes())


def test_options_set_the_config_fields_they_name(tmp_path) -> None:
    out = tmp_path / "fig.json"
    argv = [
        *SMALL,
        "--sliding-window",
        "0",
        "--copy-delay-ms",
        "0.5",
        "--fail-loads",
        "0.25",
        "--fail-stores",
        "0.125",
        "--seed",
        "3",
        "--no-baseline",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    cfg = json.loads(out.read_text())["config"]
    assert cfg["num_requests"] == 12
    assert cfg["num_gpu_blocks"] == 96
    assert cfg["scale"] == 0.3
    assert cfg["sliding_window"] is None
    assert cfg["copy_delay_s"] == pytest.approx(0.0005)
    assert cfg["load_fault_rate"] == 0.25
    assert cfg["store_fault_rate"] == 0.125
    assert cfg["seed"] == 3
    assert cfg["completion"] == "poll"  # the command's default, not SimConfig's


def test_broken_fence_fails_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "simulate",
        "--workload",
        "docs",
        "--requests",
        "40",
        "--scale",
        "0.5",
        "--gpu-blocks",
        "96",
        "--fence",
        "off",
        "--completion",
        "poll",
        "--copy-delay-ms",
        "2",
        "--sliding-window",
        "0",
        "--no-baseline",
        "--quiet",
    ]
    assert main(argv) == 1
    assert "mismatch:" in capsys.readouterr().out


def test_python_dash_m_runs_the_command() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvoffload", *SMALL, "--no-baseline"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "integrity mismatches" in res.stdout


def test_injected_faults_are_reported_and_the_run_stays_exact(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*SMALL, "--sliding-window", "64", "--fail-loads", "0.5", "--fail-stores", "0.3"]
    assert main(argv) == 0
    assert "FAILED" not in capsys.readouterr().err


def test_a_failed_copy_without_injected_faults_fails_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A data plane whose copies fail (here: every store, as --copy-delay-ms inf once made them)
    must not end in exit status 0."""
    import kvoffload.sim.offload as sim_offload
    from kvoffload.transfer import TransferEngine

    def fail(job_id: int) -> None:
        raise RuntimeError(f"copy of job {job_id} failed")

    class Failing(TransferEngine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["_fault_injector"] = fail
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_offload, "TransferEngine", Failing)
    assert main([*SMALL, "--no-baseline"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err
    assert "failed jobs" in err


# ---------------------------------------------------------------------- --plot


def assert_png(data: bytes) -> None:
    """A complete PNG of a size a screen shows whole, with drawn content."""
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 800 <= width <= 2500
    assert 500 <= height <= 2000
    assert data.endswith(b"IEND\xaeB`\x82")
    assert len(data) > 20_000  # four panels of lines and text, not a blank canvas


PLOT_RUN = replace(PRESSURE, workload="docs", completion="step", copy_delay_s=0.0)


@pytest.fixture(scope="module")
def runs():
    """A small run with offloading and its baseline without."""
    return simulate(PLOT_RUN), simulate(replace(PLOT_RUN, offload=False))


def panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_plot_writes_a_png_with_the_four_comparisons(tmp_path, runs) -> None:
    run, base = runs
    path = tmp_path / "run.png"
    fig = write_plot(str(path), run, base)
    assert_png(path.read_bytes())
    ax = panels(fig)
    assert set(ax) == {
        "Prefill tokens computed",
        "Hit rate by tier",
        "Bytes moved",
        "Flushes: store jobs waited for",
    }
    for a in ax.values():
        assert a.get_xlabel() == "engine step"
    assert ax["Prefill tokens computed"].get_ylabel() == "tokens (cumulative)"
    assert ax["Hit rate by tier"].get_ylabel() == "% of looked-up prompt tokens"
    assert ax["Bytes moved"].get_ylabel() in {"kB (cumulative)", "MB (cumulative)"}
    assert ax["Flushes: store jobs waited for"].get_ylabel() == "jobs (cumulative)"
    assert legend(ax["Prefill tokens computed"]) == ["with offloading", "without offloading"]
    assert legend(ax["Hit rate by tier"]) == ["GPU prefix cache", "CPU tier", "all tiers"]
    assert legend(ax["Bytes moved"]) == ["stored (GPU to CPU)", "loaded (CPU to GPU)"]
    assert legend(ax["Flushes: store jobs waited for"]) == [
        "kvoffload fence",
        "vLLM's rule (same run)",
    ]


def test_plot_lines_end_at_the_runs_totals(runs) -> None:
    run, base = runs
    assert base.prefill_tokens > run.prefill_tokens  # the comparison has something to show
    ax = panels(make_figure(run, base))
    ends = {line.get_label(): line.get_ydata()[-1] for a in ax.values() for line in a.get_lines()}
    assert ends["with offloading"] == run.prefill_tokens
    assert ends["without offloading"] == base.prefill_tokens
    assert ends["kvoffload fence"] == run.flushed_jobs
    assert ends["vLLM's rule (same run)"] == run.flushes_vllm_rule
    scale = 1e6 if ax["Bytes moved"].get_ylabel().startswith("MB") else 1e3
    assert ends["stored (GPU to CPU)"] == pytest.approx(run.bytes_stored / scale)
    assert ends["loaded (CPU to GPU)"] == pytest.approx(run.bytes_loaded / scale)
    rates = [line.get_ydata() for line in ax["Hit rate by tier"].get_lines()]
    for pct in rates:
        seen = pct[~np.isnan(pct)]
        assert len(seen) > 0
        assert ((seen >= 0) & (seen <= 100)).all()
    gpu, cpu, total = rates
    assert np.nanmax(cpu) > 0  # the CPU tier served something
    assert np.allclose(gpu + cpu, total, equal_nan=True)


def test_plot_without_baseline_draws_the_offloaded_run_only(runs) -> None:
    ax = panels(make_figure(runs[0]))
    assert legend(ax["Prefill tokens computed"]) == ["with offloading"]


def test_plot_without_matplotlib_says_how_to_install_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], runs
) -> None:
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(PlotUnavailableError, match=r"pip install 'kvoffload\[plot\]'"):
        check_plot_path("x.png")
    with pytest.raises(ImportError, match="matplotlib"):
        make_figure(runs[0])
    path = tmp_path / "run.png"
    assert main([*SMALL, "--plot", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "--plot" in err
    assert "pip install 'kvoffload[plot]'" in err
    assert out == ""  # refused before running anything
    assert not path.exists()


def test_plot_to_an_unknown_format_is_refused_before_the_run(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.xyz"
    assert main([*SMALL, "--plot", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "unknown format 'xyz'" in err
    assert out == ""
    assert not path.exists()


def test_plot_of_an_empty_timeline_still_has_every_panel_and_legend(tmp_path) -> None:
    fig = write_plot(str(tmp_path / "empty.png"), SimResult(config={"workload": "chat"}))
    ax = panels(fig)
    assert len(ax) == 4
    assert legend(ax["Hit rate by tier"]) == ["GPU prefix cache", "CPU tier", "all tiers"]
    assert all(len(line.get_xdata()) == 0 for a in ax.values() for line in a.get_lines())
    assert (tmp_path / "empty.png").read_bytes().startswith(b"\x89PNG")
