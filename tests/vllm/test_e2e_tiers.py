"""The lower tiers end to end in real vLLM engines (CPU backend, one forked process per engine).

* Disk restart: engine 1 runs the prompts with ``disk_path`` set and exits after its
  write-behind finished; engine 2, a new process on the same directory, serves the same prompts:
  equal greedy outputs, and its prefill skips what the disk tier held (vLLM's
  ``num_cached_tokens``; a fresh engine has nothing in its GPU prefix cache or CPU pool).
* Shared tier: engines A and B configured with the same ``remote_url`` (a
  ``redis-server`` this test starts) and ``cache_salt``: B serves A's prefixes with equal
  outputs and less prefill; engine C with another salt shares nothing.

The engines run one at a time, those that fill the tiers first. Times to first token (one
request at a time) are written to ``.venv-vllm/e2e-tiers-report.json`` beside the prefill
counts; only outputs and token counts are asserted, never wall time.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.support.remote import RedisServer
from tests.vllm.test_e2e import ROOT, run_engines

REPORT = ROOT / ".venv-vllm" / "e2e-tiers-report.json"
DOCS = ("--docs", "4", "--doc-tokens", "300")  # 9 full 32-token blocks each
TIERS = ("--connector", "on", "--workload", "tiers", *DOCS)
SALT_1 = ("--cache-salt", "tenant-1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tiers")
    disk = str(tmp / "disk")
    server = RedisServer(maxmemory=64 << 20)
    try:
        remote = ("--remote", server.url)
        # One engine at a time, in this order: each reader starts after its writer exited.
        res = run_engines(
            tmp,
            {
                "disk_1": (*TIERS, "--disk", disk),
                "remote_a": (*TIERS, *remote, *SALT_1),
                "disk_2": (*TIERS, "--disk", disk),
                "remote_b": (*TIERS, *remote, *SALT_1),
                "remote_other_salt": (*TIERS, *remote, "--cache-salt", "tenant-2"),
            },
        )
        res = {name: r["tiers"] for name, r in res.items()}
    finally:
        server.stop()
    report = {
        name: {
            "prefill_tokens": r["prefill_tokens"],
            "cached_tokens": r["cached_tokens"],
            "median_ttft_seconds": statistics.median(r["ttft_seconds"]),
            "ttft_seconds": r["ttft_seconds"],
            "tier_stats": r["tier_stats"],
        }
        for name, r in res.items()
    }
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2))
    return res


def _promoted(r: dict[str, Any]) -> int:
    return sum(int(g["promoted_chunks"]) for g in r["tier_stats"])


def _served_from_tier(first: dict[str, Any], second: dict[str, Any]) -> None:
    # The first engine computed everything and left its chunks in the tier.
    assert first["cached_tokens"] == [0] * len(first["cached_tokens"])
    assert first["pending_after_drain"] == 0
    assert sum(int(g["writes"]) for g in first["tier_stats"]) >= 4 * 9
    # The second engine: the same greedy tokens, and every full block came from the tier.
    assert second["first_tokens"] == first["first_tokens"]
    assert second["outputs"] == first["outputs"]
    assert min(second["cached_tokens"]) >= 256
    assert second["prefill_tokens"] < first["prefill_tokens"] / 4
    assert _promoted(second) >= 4 * 8
    assert all(int(g["failed_promotions"]) == 0 for g in second["tier_stats"])


def test_disk_tier_survives_an_engine_restart(runs: dict[str, dict[str, Any]]) -> None:
    assert {g["medium"] for g in runs["disk_2"]["tier_stats"]} == {"disk"}
    _served_from_tier(runs["disk_1"], runs["disk_2"])


def test_second_engine_serves_the_first_ones_prefixes_from_redis(
    runs: dict[str, dict[str, Any]],
) -> None:
    assert {g["medium"] for g in runs["remote_b"]["tier_stats"]} == {"remote"}
    _served_from_tier(runs["remote_a"], runs["remote_b"])


def test_another_cache_salt_shares_nothing(runs: dict[str, dict[str, Any]]) -> None:
    a, c = runs["remote_a"], runs["remote_other_salt"]
    assert c["cached_tokens"] == [0] * len(c["cached_tokens"])
    assert c["prefill_tokens"] == a["prefill_tokens"]
    assert _promoted(c) == 0
    assert c["outputs"] == a["outputs"]
