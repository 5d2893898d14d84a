"""Smoke test of ``benches/vllm_workload.py``: its core function at B=8 on a scaled-down
multi-turn chat, with vLLM's ``OffloadingConnector`` and ours in vLLM's real scheduler.

It asserts outcomes, never times: both connectors finish requests, ours loads tokens for later
turns (a multi-turn workload must hit the CPU tier), both finish the same requests, and with
full attention (where their rules agree) both load the same tokens for every request.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# The A/B harness's runs (``benches/ab/vllm_ab.py``, a minute and more): ``make bench-vllm`` runs
# them, ``make test-vllm`` deselects them.
ab_harness = pytest.mark.ab_harness

BENCH = Path(__file__).resolve().parents[2] / "benches" / "vllm_workload.py"
AB = BENCH.parent / "ab"


def _bench() -> Any:
    name = "vllm_workload_bench"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, BENCH)
        assert spec is not None
        assert spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


def _small(attention: str) -> Any:
    """B=8, short prompts and answers, short idle gaps, a GPU pool of 1k tokens per request:
    idle conversations lose their GPU blocks within a few dozen steps.

    The CPU tier holds every chunk the run stores (no eviction): with a sliding-window group
    vLLM's connector gives each key a chunk sized for all groups, so the same bytes hold half
    as many keys, and its evictions would make the two runs drift apart (the bench reports
    that; this test checks the mechanics).
    """
    m = _bench()
    return m.Workload(
        b=8,
        attention=attention,
        steps=60,
        warmup=0,
        seed=3,
        system_tokens=(256, 512),
        first_prompt_tokens=(600, 1200),
        max_prompt_tokens=2048,
        answer_tokens=(4, 16),
        user_tokens=(16, 64),
        idle_steps=(2, 6),
        gpu_tokens_per_seq=1024,
        cpu_factor=8.0,
        window=256,
    )


def _later_turn(rid: str) -> bool:
    return not rid.endswith("t0")  # request ids are c{conversation}t{turn}


@pytest.mark.parametrize("attention", ["full", "hybrid"])
def test_both_connectors_run_the_same_chat(attention: str) -> None:
    m = _bench()
    w = _small(attention)
    vllm_run = m.run_workload(w, "vllm")
    ours = m.run_workload(w, "ours")
    for r in (vllm_run, ours):
        assert r.finished, f"{r.connector}: no request finished in {w.steps} steps"
        assert len(r.step_ms) == w.steps
        assert r.methods["build_connector_meta"]["calls"] == w.steps
        assert r.store_jobs > 0
    later = {rid: n for rid, n in ours.loaded.items() if _later_turn(rid)}
    assert sum(later.values()) > 0, f"ours loaded nothing for later turns: {ours.loaded}"
    assert ours.load_jobs > 0
    assert ours.loaded_tokens > 0
    check = m.compare(vllm_run, ours)
    assert check["same_finished"], check
    if attention == "full":
        # Same rules with one full-attention group: the same tokens load for every request.
        assert check["loaded_differ"] == 0, check
        assert vllm_run.loaded == ours.loaded


@pytest.mark.parametrize("attention", ["full", "hybrid"])
def test_interleaved_runs_match_solo_runs(attention: str) -> None:
    """The bench steps both connectors' engines in lockstep: each one's decisions (requests
    finished, per-step load jobs, tokens loaded) are those of its run alone; and with a CPU
    pool smaller than the GPU pool (the bench's eviction run) too."""
    m = _bench()
    for w in (_small(attention), replace(_small(attention), cpu_factor=0.5)):
        together = m.run_interleaved(w, ["vllm", "ours"])
        for c in ("vllm", "ours"):
            solo, both = m.run_workload(w, c), together[c]
            assert both.finished == solo.finished, (c, w.cpu_factor)
            assert both.step_loads == solo.step_loads, (c, w.cpu_factor)
            assert both.loaded == solo.loaded, (c, w.cpu_factor)
            assert (both.store_jobs, both.flushed_jobs) == (solo.store_jobs, solo.flushed_jobs)
            summary = both.summary()
            assert summary["mean_nogc_ms"] <= summary["mean_ms"]
            assert len(both.step_gc_ms) == w.steps


def test_workload_is_seeded() -> None:
    m = _bench()
    w = _small("full")
    a, b = m.Conversations(w), m.Conversations(w)
    for k in (0, 5, 17):
        ca, cb = a.get(k), b.get(k)
        assert [(t.user, t.answer, t.gap) for t in ca.turns] == [
            (t.user, t.answer, t.gap) for t in cb.turns
        ]
        prompt = sum(len(t.user) for t in ca.turns) + sum(len(t.answer) for t in ca.turns[:-1])
        assert prompt <= w.max_prompt_tokens
        assert 1 <= len(ca.turns) <= w.max_turns


@ab_harness
def test_ab_bench_runs_one_build_against_itself(tmp_path: Path) -> None:
    """``benches/ab/vllm_ab.py`` with this build as the other one too (an A/A run): both engines
    finish the same requests in every round, and it reports each round and each method."""
    import subprocess

    import kvoffload._core as core

    kvbase = tmp_path / "kvbase"
    kvbase.mkdir()
    (kvbase / "__init__.py").write_text("")
    so = Path(core.__file__)
    (kvbase / so.name).write_bytes(so.read_bytes())
    ab = AB / "vllm_ab.py"
    argv = [sys.executable, str(ab), str(tmp_path), "--b", "8", "--rounds", "2"]
    out = subprocess.run(
        [*argv, "--steps", "12", "--warmup", "12"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"# other: {kvbase / so.name}" in out.stdout  # the other engine ran that copy
    assert "round 0: other" in out.stdout
    assert "round 1: other" in out.stdout
    assert "finished different" not in out.stdout
    assert "build_connector_meta" in out.stdout


@ab_harness
def test_ab_bench_whole_package_mode_runs_the_other_connector(tmp_path: Path) -> None:
    """``benches/ab/vllm_ab.py`` against a whole package installed by ``ab_prepare.py``'s
    ``install_package`` (this build's, renamed ``kvbase``): the other engine runs the renamed
    connector and its core, and both finish the same requests."""
    import subprocess

    import kvoffload

    sys.path.insert(0, str(AB))
    try:
        from ab_prepare import install_package
    finally:
        sys.path.remove(str(AB))
    dest = install_package(Path(kvoffload.__file__).parent, tmp_path)
    side = (dest / "integrations" / "vllm" / "scheduler_side.py").read_text()
    assert "from kvbase.errors import" in side
    assert "kvoffload" not in side
    ab = AB / "vllm_ab.py"
    argv = [sys.executable, str(ab), str(tmp_path), "--b", "8", "--rounds", "2"]
    out = subprocess.run(
        [*argv, "--steps", "12", "--warmup", "12"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "connector kvbase.integrations.vllm" in out.stdout
    assert f"# other: {dest}" in out.stdout
    assert "round 1: other" in out.stdout
    assert "finished different" not in out.stdout
