"""Engines sharing the Redis tier end to end: engine A (its own process) computes and writes
behind; engine B promotes A's chunks into its CPU pool and loads them into its KV cache,
byte-exact; other tenants share nothing; a dead server costs recomputation, never bytes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvoffload.errors import ConfigError
from kvoffload.scheduler import OffloadScheduler
from tests.support.remote import NetnsHosts, RedisServer, redis_server
from tests.support.remote_engine import (
    BLOCK,
    HASHES,
    PROMPT,
    ask,
    compute,
    config,
    engine,
    expected_kv,
    load,
)

ROOT = Path(__file__).resolve().parents[1]


def fill_in_another_process(url: str, salt: str = "") -> None:
    subprocess.run(
        [sys.executable, "-m", "tests.support.remote_engine", url, salt],
        cwd=ROOT,
        check=True,
        timeout=120,
    )


def test_engine_b_serves_engine_a_prefix_byte_exact(redis: RedisServer) -> None:
    fill_in_another_process(redis.url)
    sched = OffloadScheduler(config(redis.url))
    kv, worker, remote = engine(redis.url, "", seed=2)
    sched.add_request("b", prompt_len=PROMPT, block_hashes=HASHES)
    assert sched.lookup("b", num_computed_tokens=0) is None  # existence check in flight
    n = ask(sched, remote, "b")
    assert n == 3 * BLOCK
    load(sched, worker, "b", [7, 8, 9, 10], n)
    got = torch.stack([kv[0][f"layer{i}"][7:10] for i in range(2)])
    assert torch.equal(got, expected_kv()), "engine B loaded other bytes than A computed"
    st = sched.stats()["tiers"][0]  # type: ignore[index]
    assert (st["medium"], st["promote_jobs"], st["promoted_chunks"]) == ("remote", 1, 3)
    assert st["failed_promotions"] == 0
    assert remote.stats()["checksum_mismatches"] == 0
    worker.shutdown()


def test_another_cache_salt_shares_nothing(redis: RedisServer) -> None:
    fill_in_another_process(redis.url, "tenant-a")
    sched = OffloadScheduler(config(redis.url, "tenant-b"))
    _, worker, remote = engine(redis.url, "tenant-b", seed=2)
    sched.add_request("b", prompt_len=PROMPT, block_hashes=HASHES)
    assert ask(sched, remote, "b") == 0
    assert sched.stats()["tiers"][0]["promote_jobs"] == 0  # type: ignore[index]
    worker.shutdown()


def test_a_dead_server_means_recompute_and_nothing_written(redis: RedisServer) -> None:
    fill_in_another_process(redis.url)
    url = redis.url
    redis.kill()
    sched = OffloadScheduler(config(url, remote_deadline_ms=200))
    kv, worker, remote = engine(url, "", seed=2)
    before = [t.clone() for t in kv[0].values()]
    sched.add_request("b", prompt_len=PROMPT, block_hashes=HASHES)
    assert ask(sched, remote, "b") == 0  # no answer: the request computes
    assert compute(sched, worker, remote, "b") == [("write", False)]
    st = sched.stats()["tiers"][0]  # type: ignore[index]
    assert (st["writes"], st["failed_writes"]) == (0, 3)
    assert all(torch.equal(a, b) for a, b in zip(before, kv[0].values(), strict=True))
    worker.shutdown()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"remote_url": "http://x"}, "remote_url"),
        ({"remote_url": 5}, "remote_url must be a string, got 5"),
        ({"cache_salt": None}, "cache_salt must be a string, got None"),
        ({"remote_deadline_ms": 0}, "remote_deadline_ms"),
        ({"remote_deadline_ms": "1"}, "remote_deadline_ms must be a number"),
        ({"remote_min_hits": -1}, r"remote_min_hits must be in 0\.\.=4294967295, got -1"),
        ({"disk_min_hits": True}, "disk_min_hits must be an integer"),
    ],
)
def test_bad_remote_config_names_the_value(
    redis: RedisServer, kw: dict[str, object], match: str
) -> None:
    cfg = dataclasses.replace(config(redis.url), **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=match):
        OffloadScheduler(cfg)


def test_simulate_two_engines_share_the_remote_tier_exactly(
    redis: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvoffload.cli import main

    args = ["simulate", "--workload", "sysprompt", "--requests", "40", "--scale", "0.5"]
    args += ["--cpu-chunks", "64", "--remote", redis.url]
    json_path = tmp_path / "run.json"
    assert main([*args, "--quiet", "--json", str(json_path)]) == 0
    out = capsys.readouterr().out
    assert "engine A:" in out
    assert "promoted from remote first" in out
    assert "disk" not in out
    f = json.loads(json_path.read_text())["figures"]
    # Engine B starts with an empty CPU pool while A runs: it promotes what A wrote behind.
    assert f["remote_promoted_chunks"] > 0
    assert f["remote_written_chunks"] > 0
    assert not any(k.startswith("disk_") and k != "disk_path" for k in f)
    assert f["cpu_hit_tokens"] > 0
    assert f["integrity_mismatches"] == 0
    assert f["leaked_jobs"] == 0
    # No bound on B's prefill against the run without offloading: with A running at the same
    # time, B's requests are told "ask later" while their existence checks are in flight, and
    # the order they are admitted in (so the GPU prefix cache's reuse) depends on timing.
    assert redis.dbsize() > 0


def test_hosts_in_network_namespaces_share_one_server_exactly() -> None:
    """Three simulated hosts (network namespaces joined by veth pairs), each running an engine
    (scheduler, worker, oracle) against one server on this namespace's side of their links:
    host 0 computes the system prompts and writes them behind; hosts 1 and 2, at the same time,
    promote them across their links. Every loaded byte is checked by each host's oracle."""
    hosts = NetnsHosts(3)
    try:
        with redis_server(bind=[hosts.gateway(i) for i in range(3)]) as server:

            def start(i: int) -> subprocess.Popen[bytes]:
                cmd = [sys.executable, "-m", "tests.support.remote_engine", "--host"]
                return subprocess.Popen(
                    [*hosts.exec_prefix(i), *cmd, server.url_at(hosts.gateway(i))],
                    cwd=ROOT,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )

            def figures(p: subprocess.Popen[bytes]) -> dict[str, Any]:
                out, _ = p.communicate(b"go\n", timeout=120)
                assert p.returncode == 0
                return dict(json.loads(out))

            procs = [start(i) for i in range(3)]  # start up together, run when told
            first = figures(procs[0])
            for p in procs[1:]:
                assert p.stdin is not None
                p.stdin.write(b"go\n")
                p.stdin.flush()
            others = [figures(p) for p in procs[1:]]
    finally:
        hosts.close()
    assert first["remote_written_chunks"] > 0
    for f in [first, *others]:
        assert (f["integrity_mismatches"], f["hit_mismatches"], f["torn_stores"]) == (0, 0, 0)
        assert (f["leaked_jobs"], f["remote_failed_jobs"]) == (0, 0)
    for f in others:
        assert f["remote_promoted_chunks"] > 0, "a host found no chunk of host 0"
        # Host 0 loaded nothing from its CPU pool (each prompt's first use was on the GPU);
        # these hosts load what they promoted, every block checked.
        assert f["cpu_hit_tokens"] > first["cpu_hit_tokens"] == 0, (f, first)
        assert f["blocks_verified"] > 0
