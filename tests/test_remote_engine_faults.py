"""The shared tier's faults at the engine level: a simulated engine (scheduler,
transfer engine, remote worker, byte oracle) runs a chat workload while the server is killed,
restarted empty, flushed and slowed past the deadline (a delay proxy). Every request finishes,
nothing wrong is served, probation and recovery are counted, and no lookup waits for the
server. The step pace under each fault is a benchmark (``benches/bench_remote.py``), not a
test: tests never assert wall time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.remote import DelayProxy, RedisServer
from tests.support.remote_engine import FAULTS, FaultRun


@pytest.fixture(scope="module")
def faults() -> Iterator[FaultRun]:
    """One engine run through every fault (shared by the tests of this module: it takes a few
    seconds, mostly waiting for the clients' probations to end)."""
    server = RedisServer(maxmemory=64 << 20)
    proxy = DelayProxy(server.port)
    try:
        run = FaultRun(server, proxy)
        run.result = run.run()
        yield run
    finally:
        proxy.close()
        server.close()


def test_every_request_finishes_and_no_wrong_byte_is_served(faults: FaultRun) -> None:
    r = faults.result
    assert faults.phase_of_step[-1] == FAULTS[-1], "the workload outlasted every phase"
    assert (r.mismatches, r.hit_mismatches, r.torn_stores) == (0, 0, 0)
    assert (r.leaked_jobs, r.leaked_requests) == (0, 0)
    assert r.blocks_verified > 0
    # Requests whose promotion failed recomputed; others were served from the tier.
    assert r.tier_failed_jobs["remote"] > 0
    assert r.tier_promoted_chunks["remote"] > 0
    # I/O time and queue depth per tier, as the scheduler sees its jobs.
    t = r.tiers["remote"]
    assert t["write_us"] > 0
    assert t["promote_us"] > 0
    assert t["max_queue_depth"] >= 1
    assert t["queue_depth"] == 0


def test_a_killed_server_puts_both_clients_on_probation(faults: FaultRun) -> None:
    d = faults.delta
    assert d("killed", "probations") >= 1, "the scheduler's existence checks"
    assert d("killed", "skipped_checks") > 0, "lookups answered without asking"
    assert d("killed", "failed_write_jobs") > 0
    assert d("killed", "probations", "worker") >= 1
    assert d("killed", "dropped_writes", "worker") > 0
    assert d("killed", "writes", "worker") <= 1  # at most one in flight when it died


def test_a_restarted_server_is_used_again_after_a_trial(faults: FaultRun) -> None:
    d = faults.delta
    assert d("restarted", "recoveries") >= 1
    assert d("restarted", "recoveries", "worker") >= 1
    assert d("restarted", "writes", "worker") > 0


def test_a_flushed_server_turns_known_chunks_into_failed_promotions(faults: FaultRun) -> None:
    d = faults.delta
    # The index trusted its answers: promotions of chunks the flush removed fail (a miss,
    # counted), and the requests recompute.
    assert d("flushed", "read_misses", "worker") > 0
    assert d("flushed", "failed_promotions") > 0
    assert d("flushed", "checksum_mismatches", "worker") == 0


def test_a_slow_server_costs_deadlines_not_steps(faults: FaultRun) -> None:
    d = faults.delta
    assert d("slow", "deadline_misses", "worker") > 0
    assert d("slow", "probations", "worker") >= 1
    # While an existence check waited for the slow server, lookups were told "ask later" at
    # once, many times per check: no lookup held the step until the server answered.
    assert d("slow", "asked_later") > 2 * d("slow", "checks") > 0
    assert d("slow", "expired_checks") + d("healed", "expired_checks") > 0


def test_a_healed_server_serves_promotions_again(faults: FaultRun) -> None:
    d = faults.delta
    assert d("healed", "recoveries", "worker") >= 1
    assert d("healed", "promoted_chunks") > 0
    assert d("healed", "read_hits", "worker") > 0
