"""End to end inside real vLLM (CPU backend): the connector changes no output, only speed.

One ``run_vllm.py --runs`` subprocess runs every engine (vLLM builds its engine under
``__main__``): it imports vLLM once and forks a child per engine, one after another, so nothing
runs beside the bench pair's timed requests.
The GPU cache is small enough that the chat scenario evicts prefix-cache blocks and preempts
requests. Runs, each compared token for token with the same model and workload without the
connector:

* ``on`` / ``on_async``: the 2-layer full-attention Llama (one KV group);
* ``on_failload``: the same, ``kv_load_failure_policy="recompute"``, two load jobs failed on
  the worker (their chunks are dropped from the CPU tier; vLLM recomputes those requests);
* ``sw_on`` / ``sw_on_failload``: a hybrid Llama, sliding-window and full-attention layers
  alternating, which vLLM's hybrid allocator splits into two KV groups;
* ``bench_on``: a bigger Llama (6 layers, hidden 512) where prefill dominates, long documents
  re-read after ``reset_prefix_cache()``: time to first token and total time, on and off.

Wall times, the bench's speedups and the connector's scheduler-side time per step are written to
``.venv-vllm/e2e-report.json``. Only correctness is asserted,
never wall-clock times.
"""

from __future__ import annotations

import json
import os
import statistics
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


def run_engines(tmp_path: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, dict[str, Any]]:
    """Runs the engines from one ``run_vllm.py --runs`` process (vLLM imported once, one forked
    child per engine, one after another, in order); returns each one's result."""
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        OMP_WAIT_POLICY="PASSIVE",  # see run_vllm.py
    )
    spec = {name: ["--out", str(tmp_path / f"{name}.json"), *args] for name, args in runs.items()}
    (tmp_path / "runs.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_vllm.py"), "--runs", str(tmp_path / "runs.json")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=1800,
    )
    out = {}
    for name in runs:
        path = tmp_path / f"{name}.json"
        if not path.exists():
            log = tmp_path / f"{name}.json.log"
            tail = log.read_text()[-6000:] if log.exists() else "(no log)"
            pytest.fail(f"{name} failed (rc {proc.returncode}):\n{tail}\n{proc.stderr[-2000:]}")
        out[name] = json.loads(path.read_text())
    if proc.returncode != 0:
        pytest.fail(f"run_vllm.py --runs failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return out


SW = ("--model", "tiny-llama-sw", "--gpu-blocks", "80")
BENCH = ("--model", "tiny-llama-bench", "--workload", "bench")
RUNS: dict[str, tuple[str, ...]] = {
    "off": ("--connector", "off"),
    "on": ("--connector", "on"),
    "on_async": ("--connector", "on", "--async-scheduling"),
    "on_failload": ("--connector", "on", "--fail-loads", "2"),
    "sw_off": ("--connector", "off", *SW),
    "sw_on": ("--connector", "on", *SW),
    "sw_on_failload": ("--connector", "on", "--fail-loads", "2", *SW),
    "bench_off": ("--connector", "off", *BENCH),
    "bench_on": ("--connector", "on", *BENCH),
}
# Each run against the run without the connector, same model and workload.
BASELINE = {name: ("sw_off" if name.startswith("sw_") else "off") for name in RUNS}
BASELINE["bench_on"] = "bench_off"


def _bench_report(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """Median time to first token and total time per request, on and off, and speedups."""
    out: dict[str, Any] = {
        "docs": on["bench"]["docs"],
        "doc_tokens": on["bench"]["doc_tokens"],
        "cached_tokens_on": on["bench"]["cached_tokens"],
    }
    for key in ("ttft_seconds", "total_seconds"):
        a = statistics.median(off["bench"][key])
        b = statistics.median(on["bench"][key])
        out[f"median_{key}_off"] = a
        out[f"median_{key}_on"] = b
        out[f"{key.removesuffix('_seconds')}_speedup"] = a / b if b else None
        out[f"{key}_off"] = off["bench"][key]
        out[f"{key}_on"] = on["bench"][key]
    out["second_pass_seconds_off"] = off["bench"]["second_pass_seconds"]
    out["second_pass_seconds_on"] = on["bench"]["second_pass_seconds"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm")
    t = time.perf_counter()
    res = run_engines(tmp, RUNS)
    report = {
        "e2e_wall_seconds": time.perf_counter() - t,
        "bench": _bench_report(res["bench_off"], res["bench_on"]),
        **{
            name: {
                "model": r["model"],
                "kv_groups": r["kv_groups"],
                "wall_seconds": r["wall_seconds"],
                "workload_seconds": r["workload_seconds"],
                "failed_load_jobs": r["failed_load_jobs"],
                "connector": r.get("connector", {}),
                "vllm_metrics": r.get("kv_stats", {}),
            }
            for name, r in res.items()
        },
    }
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2))
    return res


@pytest.mark.parametrize("mode", ["on", "on_async", "on_failload", "sw_on", "sw_on_failload"])
def test_greedy_outputs_equal_without_connector(runs: dict, mode: str) -> None:
    off, on = runs[BASELINE[mode]], runs[mode]
    assert on["kv_groups"] == off["kv_groups"]
    assert on["batch"] == off["batch"]
    assert on["chat"] == off["chat"]
    assert on["reload"]["first"] == off["reload"]["first"]
    assert on["reload"]["second"] == off["reload"]["second"] == off["reload"]["first"]


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


# ----------------------------------------------------------------------- hybrid model


def test_hybrid_model_has_a_sliding_window_group(runs: dict) -> None:
    assert runs["on"]["kv_groups"] == ["FullAttentionSpec"]
    assert sorted(runs["sw_on"]["kv_groups"]) == ["FullAttentionSpec", "SlidingWindowSpec"]


def test_hybrid_model_served_from_cpu_after_reset(runs: dict) -> None:
    off, on = runs["sw_off"], runs["sw_on"]
    assert off["reload"]["cached_tokens"] == 0
    # Every full block but the last token's: the full-attention group's whole prefix and the
    # sliding-window group's blocks in the window come back from the CPU tier.
    assert on["reload"]["cached_tokens"] >= 640
    core = on["connector"]["core_stats"]
    assert core["load_tokens"] > 0
    assert core["load_jobs"] >= 3
    assert core["failed_loads"] == core["failed_stores"] == 0
    assert core["pending_jobs"] == core["armed_pairs"] == 0
    assert on["kv_stats"]["vllm:external_prefix_cache_hits"] >= on["reload"]["cached_tokens"]


# ----------------------------------------------------------------------- failed loads


@pytest.mark.parametrize("mode", ["on_failload", "sw_on_failload"])
def test_failed_loads_are_recomputed(runs: dict, mode: str) -> None:
    on = runs[mode]
    # Two load jobs failed on the worker (the first and third); the outputs are those of the
    # engine without the connector (test above), other loads still succeeded.
    assert len(on["failed_load_jobs"]) == 2
    core = on["connector"]["core_stats"]
    assert core["failed_loads"] == 2
    assert core["load_jobs"] > 2
    assert core["load_tokens"] > 0
    assert on["kv_stats"]["vllm:external_prefix_cache_hits"] > 0
    assert core["pending_jobs"] == core["armed_pairs"] == 0
    assert core["loading_requests"] == 0


# ----------------------------------------------------------------------------- bench


def test_bench_outputs_equal_and_served_from_cpu(runs: dict) -> None:
    off, on = runs["bench_off"], runs["bench_on"]
    assert on["bench"]["outputs"] == off["bench"]["outputs"]
    assert off["bench"]["cached_tokens"] == [0] * off["bench"]["docs"]
    # Every document (and its question's full block) loaded from the CPU tier.
    assert min(on["bench"]["cached_tokens"]) >= on["bench"]["doc_tokens"]
    core = on["connector"]["core_stats"]
    assert core["load_tokens"] >= 2 * on["bench"]["docs"] * on["bench"]["doc_tokens"]
    assert core["failed_loads"] == core["failed_stores"] == 0
