"""The ``kvoffload`` command (:mod:`kvoffload.cli`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvoffload.cli import main

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
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert b"IDAT" in data
    assert len(data) > 1000


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
    import kvoffload.sim.engine as sim_engine
    from kvoffload.transfer import TransferEngine

    def fail(job_id: int) -> None:
        raise RuntimeError(f"copy of job {job_id} failed")

    class Failing(TransferEngine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["_fault_injector"] = fail
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_engine, "TransferEngine", Failing)
    assert main([*SMALL, "--no-baseline"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err
    assert "failed jobs" in err
