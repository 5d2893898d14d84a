"""The lower tiers through the connector, in vLLM's real scheduler (fake workers, KV oracle).

Each engine is a :class:`~tests.vllm.harness.Harness`: vLLM's ``Scheduler`` (or
``AsyncScheduler``) with the connector's scheduler side, and one or two fake workers whose
worker-side connectors open a real ``DiskWorker`` / ``RemoteWorker`` over their CPU pools. A
second engine on the same disk directory (a restart) or the same Redis server (another replica)
must serve the first one's prefixes: its lookups promote the chunks into its CPU pool, the
loads follow, and every loaded block is checked against the oracle on every rank (each rank
holds its own shard, under its own namespace). Nothing here is asserted on wall time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm import KvOffloadConnector, KvOffloadStats
from tests.support.remote import DelayProxy, RedisServer
from tests.vllm.harness import Harness, load_jobs, make_config, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DISK = {"disk_bytes": 1 << 20}


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    server = RedisServer(maxmemory=64 << 20)
    yield server
    server.stop()


def _serve(h: Harness, rid: str, tokens: list[int]) -> int:
    """Runs request ``rid`` to the end and drains every job; returns the tokens it was
    admitted with (vLLM's prefix hit plus what the connector loaded)."""
    h.add(rid, tokens)
    h.run_until_done()
    h.drain()
    return next(c for r, c in h.admitted if r == rid)


class _Seen:
    """What vLLM drained from the connector every step: its stats and its KV events."""

    def __init__(self, h: Harness) -> None:
        self.stats = KvOffloadStats()
        self.events: list[Any] = []
        get_stats, take = h.conn.get_kv_connector_stats, h.conn.take_events

        def stats_spy() -> Any:
            got = get_stats()
            if got is not None:
                self.stats.aggregate(got)
            return got

        def events_spy() -> list[Any]:
            got = list(take())
            self.events.extend(got)
            return got

        h.conn.get_kv_connector_stats = stats_spy  # type: ignore[method-assign]
        h.conn.take_events = events_spy  # type: ignore[method-assign]


SEEN: dict[int, _Seen] = {}


def _engine(tp: int, async_sched: bool, **extra: Any) -> Harness:
    h = Harness(64, tp=tp, async_scheduling=async_sched, kv_events=True, **extra)
    SEEN[id(h)] = _Seen(h)
    return h


def _stats(h: Harness) -> dict[str, Any]:
    """The connector's stats so far, summed over the intervals vLLM took."""
    seen = SEEN[id(h)]
    # The interval in progress too.
    h.conn.get_kv_connector_stats()
    return seen.stats.data


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_restart_on_the_same_disk_directory_serves_every_shard(
    tmp_path: Path, tp: int, async_sched: bool
) -> None:
    p = prompt(5, 100)
    first = _engine(tp, async_sched, disk_path=str(tmp_path), **DISK)
    assert _serve(first, "a", p) == 0
    st = _stats(first)
    assert st["disk_write_jobs"] >= 1
    assert st["disk_writes"] == 6  # six full 16-token blocks, one chunk each
    assert st["disk_bytes_written"] >= 6 * 1024 * tp
    first.assert_clean()
    first.shutdown()

    second = _engine(tp, async_sched, disk_path=str(tmp_path), **DISK)
    # A fresh engine: empty GPU prefix cache and CPU pool; the disk tier has a's chunks.
    assert _serve(second, "b", p) == 96
    # The load of b's prefix was verified against the oracle on every rank.
    assert second.loads_checked >= tp
    assert len(load_jobs(second.plans, "b")) == 1
    st = _stats(second)
    assert st["disk_promoted_chunks"] == 6
    assert st["disk_failed_promotions"] == 0
    assert st["disk_bytes_read"] >= 6 * 1024 * tp
    assert st["lookups_deferred"] >= 1  # "ask later" while the promotion ran
    core = second.conn.scheduler_side.sched  # type: ignore[union-attr]
    assert core.stats()["failed_loads"] == 0
    second.assert_clean()
    second.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_corrupt_chunks_on_disk_are_recomputed_never_served(tmp_path: Path, tp: int) -> None:
    p = prompt(9, 100)
    first = _engine(tp, False, disk_path=str(tmp_path), **DISK)
    _serve(first, "a", p)
    first.shutdown()
    # Flip the first data byte of every slot (a 4 KiB header block, then the data) of rank
    # 0's slab files: the headers still name a's chunks, the bytes fail their checksums.
    slabs = sorted(f for f in tmp_path.rglob("slab*.kvo") if f.is_file())
    assert slabs
    for f in slabs[:1]:
        data = bytearray(f.read_bytes())
        for off in range(4096, len(data), 8192):
            data[off] ^= 0xFF
        f.write_bytes(bytes(data))
    second = _engine(tp, False, disk_path=str(tmp_path), **DISK)
    # The promotion fails (on the rank that found bad bytes): b recomputes, nothing loaded.
    assert _serve(second, "b", p) == 0
    assert load_jobs(second.plans, "b") == []
    st = _stats(second)
    assert st["disk_failed_promotions"] >= 1
    assert st["disk_promoted_chunks"] == 0
    second.assert_clean()
    second.shutdown()


def test_a_bad_tier_value_is_refused_when_the_connector_is_built(tmp_path: Path) -> None:
    # The core checks every option, the tiers' included, with the configuration: neither role
    # gets as far as opening a tier (the directory stays empty).
    vc, kcc = make_config(32, {"cpu_chunks": 8, "disk_path": str(tmp_path), "disk_bytes": "1G"})
    for role in (KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER):
        with pytest.raises(ConfigError, match=r"disk_bytes must be an integer, got '1G'"):
            KvOffloadConnector(vc, role, kcc)
    assert list(tmp_path.iterdir()) == []


def test_another_model_on_the_same_directory_finds_nothing(tmp_path: Path) -> None:
    p = prompt(6, 70)
    first = _engine(1, False, disk_path=str(tmp_path), **DISK)
    _serve(first, "a", p)
    first.shutdown()
    other = _engine(1, False, disk_path=str(tmp_path), disk_model="another-model", **DISK)
    assert _serve(other, "b", p) == 0
    assert load_jobs(other.plans) == []
    other.assert_clean()
    other.shutdown()


def test_disk_events_carry_their_medium(tmp_path: Path) -> None:
    h = _engine(1, False, disk_path=str(tmp_path), **DISK)
    _serve(h, "a", prompt(7, 40))
    media = {e.medium for e in SEEN[id(h)].events if isinstance(e, BlockStored)}
    assert media == {"CPU", "DISK"}
    h.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_second_engine_serves_the_first_ones_prefix_from_redis(redis: RedisServer, tp: int) -> None:
    salt = f"shared-{tp}"
    p = prompt(8 + tp, 100)
    a = _engine(tp, False, remote_url=redis.url, cache_salt=salt)
    assert _serve(a, "a", p) == 0
    assert _stats(a)["remote_writes"] == 6
    a.shutdown()
    b = _engine(tp, True, remote_url=redis.url, cache_salt=salt)
    assert _serve(b, "b", p) == 96
    st = _stats(b)
    assert st["remote_promoted_chunks"] == 6
    assert st["remote_bytes_read"] >= 6 * 1024 * tp
    b.assert_clean()
    b.shutdown()


def test_another_tenant_salt_shares_nothing(redis: RedisServer) -> None:
    p = prompt(20, 100)
    a = _engine(1, False, remote_url=redis.url, cache_salt="tenant-a")
    _serve(a, "a", p)
    a.shutdown()
    b = _engine(1, False, remote_url=redis.url, cache_salt="tenant-b")
    assert _serve(b, "b", p) == 0
    assert load_jobs(b.plans) == []
    assert _stats(b).get("remote_promoted_chunks", 0) == 0
    b.shutdown()
    # The same tenant still finds them.
    c = _engine(1, False, remote_url=redis.url, cache_salt="tenant-a")
    assert _serve(c, "c", p) == 96
    c.shutdown()


def test_dead_server_costs_recomputation_only(redis: RedisServer) -> None:
    p = prompt(30, 100)
    a = _engine(1, False, remote_url=redis.url, cache_salt="dead", remote_deadline_ms=200)
    _serve(a, "a", p)
    a.shutdown()
    redis.kill()
    try:
        b = _engine(1, False, remote_url=redis.url, cache_salt="dead", remote_deadline_ms=200)
        assert _serve(b, "b", p) == 0  # recomputed: the tier did not answer
        b.assert_clean()
        b.shutdown()
    finally:
        redis.start()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_reset_with_a_promotion_in_flight(redis: RedisServer, async_sched: bool) -> None:
    """A cache reset while a promotion still writes into its CPU slots: the next plan names
    it apart from the copies, the worker waits for it before anything reuses the slots, and
    what the CPU pool serves afterwards is verified."""
    p, q = prompt(40 + async_sched, 100), prompt(42 + async_sched, 100)
    salt = f"reset-{async_sched}"
    a = _engine(1, False, remote_url=redis.url, cache_salt=salt)
    _serve(a, "a", p)
    a.shutdown()
    slow = DelayProxy(redis.port, delay=0.3)  # every reply 0.3 s late: the promotion lasts
    try:
        h = _engine(1, async_sched, remote_url=slow.url, cache_salt=salt, remote_deadline_ms=5000)
        s = h.conn.scheduler_side
        assert s is not None
        h.add("b", p)
        h.step_until(
            lambda: any(pl.tier_job_ids() for pl in h.plans), "a promotion handed to the worker"
        )
        assert h.sched.reset_prefix_cache(reset_connector=True)
        h.step()
        plan = h.plans[-1]
        assert plan.tier_flush == sorted(plan.tier_flush) != []
        assert not set(plan.tier_flush) & set(plan.flush)
        worker = h.worker.worker_side
        assert worker is not None
        assert not set(plan.tier_flush) & worker.tier_inflight.keys()  # waited for first
        h.run_until_done()
        h.drain()
        # After the reset: c is computed and stored, the local prefix cache emptied, and d
        # loads c's prefix from the CPU pool (slots the flushed promotion held), verified.
        assert _serve(h, "c", q) == 0
        assert h.sched.reset_prefix_cache()
        checked = h.loads_checked
        assert _serve(h, "d", q) == 96
        assert h.loads_checked > checked
        h.assert_clean(late_reports=True)
        h.shutdown()
    finally:
        slow.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_both_tiers_promote_from_the_nearest_and_refill_the_other(
    tmp_path: Path, redis: RedisServer, tp: int
) -> None:
    """Disk and shared tier at once: every chunk is written behind to both; an engine with
    an empty disk promotes from the server and refills its disk; a restart on a full disk
    promotes from the disk, never the server (each worker runs its own medium's jobs)."""
    p = prompt(50 + tp, 100)
    salt = f"both-{tp}"
    both = {"remote_url": redis.url, "cache_salt": salt, **DISK}
    a = _engine(tp, False, disk_path=str(tmp_path / "a"), **both)
    assert _serve(a, "a", p) == 0
    st = _stats(a)
    assert (st["disk_writes"], st["remote_writes"]) == (6, 6)
    a.assert_clean()
    a.shutdown()

    b = _engine(tp, True, disk_path=str(tmp_path / "b"), **both)
    assert _serve(b, "b", p) == 96
    assert b.loads_checked >= tp
    st = _stats(b)
    assert (st["remote_promoted_chunks"], st["disk_promoted_chunks"]) == (6, 0)
    assert st["disk_writes"] == 6  # promoted chunks refill the empty disk
    assert st["disk_bytes_written"] >= 6 * 1024 * tp
    b.assert_clean()
    b.shutdown()

    c = _engine(tp, False, disk_path=str(tmp_path / "a"), **both)
    assert _serve(c, "c", p) == 96
    st = _stats(c)
    assert (st["disk_promoted_chunks"], st["remote_promoted_chunks"]) == (6, 0)
    assert st["remote_bytes_read"] == 0
    c.assert_clean()
    c.shutdown()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"disk_path": "/tmp/x", "disk_bytes": -1}, "disk_bytes must be a positive integer"),
        ({"disk_bytes": 1 << 20}, "disk_bytes=1048576 needs disk_path"),
        ({"remote_url": "redis://127.0.0.1:1", "remote_deadline_ms": 0}, "remote_deadline_ms"),
        ({"disk_path": "/tmp/x", "disk_bytes": 1 << 20, "disk_min_hits": -1}, "disk_min_hits"),
    ],
)
def test_bad_tier_config_is_a_clear_error(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _engine(1, False, **extra)
