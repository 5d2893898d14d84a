"""End to end inside real vLLM (CPU backend): the connector changes no output, only speed.

Each engine runs ``run_vllm.py`` in a subprocess (vLLM builds its engine under ``__main__``).
The GPU cache is small enough that the chat scenario evicts prefix-cache blocks and preempts
requests. Wall times and the connector's scheduler-side time per step are written to
``.venv-vllm/e2e-report.json`` (``make test-vllm`` prints it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REPORT = ROOT / ".venv-vllm" / "e2e-report.json"

pytest.importorskip("vllm")


def _run(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_vllm.py"), "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        pytest.fail(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    result["wall_seconds"] = wall
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm")
    t = time.perf_counter()
    res = {
        "off": _run(tmp, "off", "--connector", "off"),
        "on": _run(tmp, "on", "--connector", "on"),
        "on_async": _run(tmp, "on_async", "--connector", "on", "--async-scheduling"),
    }
    report = {
        "e2e_wall_seconds": time.perf_counter() - t,
        **{
            name: {
                "wall_seconds": r["wall_seconds"],
                "workload_seconds": r["workload_seconds"],
                "connector": r.get("connector", {}),
                "vllm_metrics": r.get("kv_stats", {}),
            }
            for name, r in res.items()
        },
    }
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2))
    return res


@pytest.mark.parametrize("mode", ["on", "on_async"])
def test_greedy_outputs_equal_without_connector(runs: dict, mode: str) -> None:
    off, on = runs["off"], runs[mode]
    assert on["batch"] == off["batch"]
    assert on["chat"] == off["chat"]
    assert on["reload"]["first"] == off["reload"]["first"]


@pytest.mark.parametrize("mode", ["on", "on_async"])
def test_reset_prefix_cache_then_served_from_cpu(runs: dict, mode: str) -> None:
    off, on = runs["off"], runs[mode]
    # Without the connector the reset prefix cache leaves nothing to reuse.
    assert off["reload"]["cached_tokens"] == 0
    # With it, all full blocks but the last token's come back from the CPU tier, and the
    # answer is the same.
    assert on["reload"]["cached_tokens"] >= 640
    assert on["reload"]["second"] == off["reload"]["second"] == off["reload"]["first"]
    metrics = on["kv_stats"]
    assert metrics["vllm:external_prefix_cache_hits"] >= on["reload"]["cached_tokens"]
    core = on["connector"]["core_stats"]
    assert core["load_tokens"] > 0
    assert core["failed_loads"] == core["failed_stores"] == 0


@pytest.mark.parametrize("mode", ["on", "on_async"])
def test_chat_scenario_really_evicts_and_preempts(runs: dict, mode: str) -> None:
    on = runs[mode]
    # The scenario is only meaningful if vLLM preempted requests and loaded chunks back.
    assert on["kv_stats"]["vllm:num_preemptions"] > 0
    assert on["connector"]["core_stats"]["load_jobs"] >= 3
    assert on["connector"]["core_stats"]["pending_jobs"] == 0
    assert on["connector"]["core_stats"]["armed_pairs"] == 0
