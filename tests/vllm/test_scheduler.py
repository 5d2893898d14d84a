"""vLLM's real scheduler with the connector and one fake worker (see ``harness``): every load is
checked against the KV oracle when vLLM schedules the request again. The fence scenarios check
what vLLM frees and re-allocates: a finished request's and a preempted request's blocks are
handed to another request while their stores are pending, and the plan flushes exactly those
stores; a prefix-cache hit on those blocks flushes nothing.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm import KvOffloadConnector, KvOffloadStats
from tests.vllm.harness import BS, LAYERS, Harness, job_blocks, load_jobs, make_config, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ---------------------------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_sched(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_reload_after_prefix_cache_reset_loads_correct_kv(async_sched: bool) -> None:
    h = Harness(64, async_scheduling=async_sched)
    p = prompt(1, 100)
    h.add("a", p)
    h.run_until_done()
    h.drain()
    assert h.sched.reset_prefix_cache()
    h.add("b", p)
    h.run_until_done()
    h.drain()
    (job,) = load_jobs(h.plans)
    assert load_jobs(h.plans, "b") == [job]
    assert job_blocks(h.plans, job) * BS == 96  # every full block of the 100-token prompt
    assert h.loads_checked >= 2
    core = h.conn.scheduler_side.sched
    assert core.pending_jobs() == []
    assert core.armed_pairs == 0


def test_aborted_and_finished_requests_are_released_as_such(async_sched: bool) -> None:
    # The adapter keeps no Request objects: vLLM's request_finished tells it which of the freed
    # requests were aborted. With the copies held, both requests stay in the core (pending
    # stores) under the status vLLM gave them; an abort of a request the connector never saw
    # changes nothing.
    h = Harness(64, async_scheduling=async_sched)
    h.gates[0].clear()
    h.add("a", prompt(3, 64), max_tokens=40)
    h.add("b", prompt(4, 64), max_tokens=2)
    core = h.conn.scheduler_side.sched
    h.step_until(lambda: "b" in h.finished(), "b to finish")
    h.step()
    h.step()
    assert core.status("b") == "finished"
    h.sched.finish_requests(["a", "never-added"], RequestStatus.FINISHED_ABORTED)
    assert h.conn.scheduler_side.aborted == {"a"}
    h.step()
    assert core.status("a") == "aborted"
    assert not h.conn.scheduler_side.aborted
    assert "a" not in h.conn.scheduler_side.hashes
    h.gates[0].set()
    h.drain()
    h.assert_clean()


def test_a_finished_request_hands_its_hashes_over_in_request_finished(async_sched: bool) -> None:
    # request_finished gives the core the request's last hashes and lets go of its hash list
    # (vLLM drops the last reference); the next step releases it with every hash in place:
    # its stores, completed, cover every full block its computed tokens reached.
    h = Harness(64, async_scheduling=async_sched)
    req = h.add("b", prompt(4, 60), max_tokens=9)
    side = h.conn.scheduler_side
    h.step_until(lambda: "b" in h.finished(), "b to finish")
    assert "b" not in side.hashes
    assert side.released == {"b"}
    hashes = req.block_hashes
    assert sys.getrefcount(hashes) == 3  # `req`'s, the local's and getrefcount's argument
    h.step()
    assert not side.released
    h.drain()
    assert side.sched.num_requests == 0  # released as finished and dropped once stored
    # 60 prompt tokens and 9 sampled: the KV of the first 68 tokens is computed.
    assert sum(job_blocks(h.plans, j) for m in h.plans for j in m.store_jobs) == 68 // BS
    h.assert_clean()


def test_finished_request_blocks_reallocated_flush_its_pending_store(async_sched: bool) -> None:
    # Few blocks and no prefix hit: the second request gets the first one's freed blocks
    # while the first one's last store is still pending (stores start a step late).
    h = Harness(12, async_scheduling=async_sched, copy_delay_s=0.05)
    h.add("a", prompt(2, 64), max_tokens=2)
    while "a" not in h.finished():
        h.step()
    a_blocks = set(h.tables["a"])
    pending_before = set(h.conn.scheduler_side.sched.pending_jobs())
    assert pending_before, "a store of 'a' should still be pending"
    h.add("b", prompt(3, 150), max_tokens=2)
    so = h.step()
    b_blocks = set(h.tables["b"])
    reused = a_blocks & b_blocks
    assert reused, "vLLM should hand a's freed blocks to b"
    meta = h.plans[-1]
    # Exactly the pending stores reading a re-allocated block are flushed.
    assert set(meta.flush)
    assert set(meta.flush) <= pending_before
    assert so.preempted_req_ids in (None, set())
    h.run_until_done()
    h.drain()
    assert h.conn.scheduler_side.sched.armed_pairs == 0


def test_prefix_cache_hit_on_freed_blocks_flushes_nothing(async_sched: bool) -> None:
    h = Harness(64, async_scheduling=async_sched, copy_delay_s=0.05)
    p = prompt(4, 96)
    h.add("a", p, max_tokens=2)
    while "a" not in h.finished():
        h.step()
    assert h.conn.has_pending_push_work()
    h.add("b", [*p, 7, 8, 9], max_tokens=2)
    h.step()
    # b re-uses a's cached blocks read-only: they are not written, so nothing is flushed.
    assert h.plans[-1].flush == []
    h.run_until_done()
    h.drain()


def test_preempted_request_blocks_reallocated_flush(async_sched: bool) -> None:
    h = Harness(14, async_scheduling=async_sched)
    h.add("a", prompt(5, 90), max_tokens=60)
    h.add("b", prompt(6, 90), max_tokens=60)
    preempted = False
    for _ in range(300):
        if not h.sched.has_requests():
            break
        so = h.step()
        preempted |= bool(so.preempted_req_ids)
    h.drain()
    assert preempted, "the scenario must preempt"
    st = h.conn.scheduler_side.sched.stats()
    assert st["pending_jobs"] == 0
    assert st["armed_pairs"] == 0
    assert h.loads_checked >= 2


def test_conservative_fence_flushes_at_least_as_much() -> None:
    def run(exact: bool) -> int:
        h = Harness(12, copy_delay_s=0.05, exact_fence=exact)
        h.add("a", prompt(2, 64), max_tokens=2)
        while "a" not in h.finished():
            h.step()
        h.add("b", prompt(3, 150), max_tokens=2)
        h.run_until_done()
        h.drain()
        return sum(len(m.flush) for m in h.plans)

    assert run(False) >= run(True) >= 1


@pytest.mark.parametrize("kv_events", [True, False], ids=["events", "no-events"])
def test_stats_and_events_surface(kv_events: bool) -> None:
    h = Harness(64, kv_events=kv_events)
    seen: list[Any] = []
    take = h.conn.take_events

    def spy() -> list[Any]:
        events = list(take())
        seen.extend(events)
        return events

    stats = KvOffloadStats()
    get_stats = h.conn.get_kv_connector_stats

    def stats_spy() -> Any:
        got = get_stats()
        if got is not None:
            stats.aggregate(got)
        return got

    # vLLM drains both every step (and publishes / logs them); record what it got.
    h.conn.take_events = spy  # type: ignore[method-assign]
    h.conn.get_kv_connector_stats = stats_spy  # type: ignore[method-assign]
    h.add("a", prompt(7, 80), max_tokens=2)
    h.run_until_done()
    h.drain()
    stored = [e for e in seen if type(e).__name__ == "BlockStored"]
    pool = h.conn.scheduler_side.sched.stats()["pools"][0]
    if kv_events:
        assert sum(len(e.block_hashes) for e in stored) == 5  # 80 tokens: 5 full blocks
        assert all(e.medium == "CPU" for e in seen)
        # The keys are vLLM's own 64-bit event ints of the request's block hashes.
        want = [int.from_bytes(x, "big") & ((1 << 64) - 1) for x in h.reqs["a"].block_hashes]
        assert [k for e in stored for k in e.block_hashes] == want[:5]
    else:
        # KV events off: the core queues none (the pool counts them as dropped).
        assert seen == []
        assert pool["event_keys_queued"] == 0
        assert pool["events_dropped"] >= 1
    assert pool["used"] == 5
    red = stats.reduce()
    assert red["store_jobs"] == 1
    assert red["sched_steps"] >= 3
    assert red["bytes_stored"] == 5 * BS * LAYERS * 2 * 4 * 4
    assert red["sched_us_per_step"] > 0


# ------------------------------------------------------------------------- failed loads


def _stored_then_local_reset(h: Harness, p: list[int]) -> None:
    """Computes ``p`` once (stored to the CPU tier) and empties vLLM's prefix cache."""
    h.add("a", p)
    h.run_until_done()
    h.drain()
    assert h.sched.reset_prefix_cache()


def test_failed_load_recompute_policy_readmits_and_recomputes(async_sched: bool) -> None:
    # failed_recving: vLLM (policy "recompute") zeroes the request's computed tokens, frees
    # its blocks and asks the connector again; the core still had it running.
    h = Harness(64, async_scheduling=async_sched, failure_policy="recompute")
    p = prompt(11, 100)
    _stored_then_local_reset(h, p)
    h.fail_loads["b"] = 1
    h.add("b", p)
    h.run_until_done()
    h.drain()
    assert [rid for _, rid in h.failed_jobs] == ["b"]
    # The failed load's chunks were dropped from the CPU tier (a persistent fault cannot loop):
    # vLLM re-asks, nothing is loadable, and b recomputes its prompt.
    jobs = load_jobs(h.plans, "b")
    assert jobs == [h.failed_jobs[0][0]]
    assert h.reqs["b"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.true_tokens["b"] == h.true_tokens["a"]
    st = h.conn.scheduler_side.sched.stats()
    assert st["failed_loads"] == 1
    h.assert_clean()


def test_failed_load_fail_policy_finishes_request_with_error(async_sched: bool) -> None:
    h = Harness(64, async_scheduling=async_sched)  # vLLM's default policy: "fail"
    p = prompt(12, 100)
    _stored_then_local_reset(h, p)
    h.fail_loads["b"] = 1
    h.add("b", p)
    h.run_until_done()
    h.drain()
    assert len(load_jobs(h.plans, "b")) == 1
    assert h.reqs["b"].status == RequestStatus.FINISHED_ERROR
    # The engine goes on: the failed chunks were dropped, so c recomputes and stores them
    # again, and d then loads them (correctly) from the CPU tier.
    h.add("c", p)
    h.run_until_done()
    h.drain()
    assert load_jobs(h.plans, "c") == []
    assert h.sched.reset_prefix_cache()
    h.add("d", p)
    h.run_until_done()
    h.drain()
    assert len(load_jobs(h.plans, "d")) == 1
    assert [c for r, c in h.admitted if r == "d"] == [96]
    h.assert_clean()


def test_failed_load_block_errors_keep_valid_prefix_and_recompute(async_sched: bool) -> None:
    # invalid_block_ids only: vLLM truncates the computed tokens at the first invalid block,
    # keeps the blocks (and the valid local prefix) and recomputes the rest in place.
    h = Harness(
        64, async_scheduling=async_sched, failure_policy="recompute", block_errors_only=True
    )
    p = prompt(13, 100)
    _stored_then_local_reset(h, p)
    h.add("c", p[:40])  # loads 2 blocks from the CPU tier: vLLM's prefix cache has them
    h.run_until_done()
    h.drain()
    h.fail_loads["b"] = 1
    h.add("b", p)
    h.run_until_done()
    h.drain()
    assert [rid for _, rid in h.failed_jobs] == ["b"]
    assert len(load_jobs(h.plans, "b")) == 1
    # Not asked again: scheduled with the valid local prefix only, the rest recomputed.
    assert [c for r, c in h.admitted if r == "b"] == [32]
    assert h.reqs["b"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    # b's recomputed blocks are what the next request gets (prefix cache), verified.
    h.add("d", [*p, 5])
    h.run_until_done()
    h.drain()
    assert [c for r, c in h.admitted if r == "d"] == [96]
    h.assert_clean()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_reset_cache_with_loads_in_flight(async_sched: bool, policy: str) -> None:
    h = Harness(64, async_scheduling=async_sched, copy_delay_s=0.05, failure_policy=policy)
    p = prompt(14, 100)
    _stored_then_local_reset(h, p)
    h.add("b", p)
    for _ in range(3):
        h.step()
        if load_jobs(h.plans, "b"):
            break
    s = h.conn.scheduler_side
    assert s.sched.loading_requests == 1, "b's load should be in flight"
    if policy == "fail":
        # A cancelled load would fail the request: refused while loads are in flight.
        assert not h.conn.reset_cache()
        h.run_until_done()
        h.drain()
        assert [c for r, c in h.admitted if r == "b"] == [96]
        assert h.conn.reset_cache()
    else:
        assert h.conn.reset_cache()
        assert s.sched.loading_requests == 0
        h.run_until_done()
        h.drain()
        # The cancelled load was reported as failed: vLLM asked again, the CPU tier was
        # empty, and b was computed from scratch.
        assert len(load_jobs(h.plans, "b")) == 1
        assert [c for r, c in h.admitted if r == "b"] == [0]
        assert h.reqs["b"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    h.assert_clean(late_reports=policy == "recompute")


# --------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({}, "give exactly one of cpu_chunks and cpu_bytes"),
        ({"cpu_bytes": -5}, r"cpu_bytes must be in 0\.\.=\d+, got -5"),
        ({"cpu_bytes": "lots"}, r"cpu_bytes must be an integer, got 'lots' \(str\)"),
        ({"cpu_chunks": 8.0}, r"cpu_chunks must be an integer, got 8.0 \(float\)"),
        ({"cpu_chunks": 8, "cpu_bytes": 1 << 20}, "give exactly one of"),
        ({"cpu_chunks": 8, "policy": "fifo"}, 'unknown eviction policy "fifo"'),
        ({"cpu_chunks": 8, "blocks_per_chunk": 0}, r"blocks_per_chunk must be in 1\.\.=\d+, got 0"),
        ({"cpu_chunks": 8, "chunk": 4}, r"unknown kv_connector_extra_config key\(s\) \['chunk'\]"),
        ({"cpu_chunks": 8, "offload_prompt_only": 1}, r"offload_prompt_only must be a bool, got 1"),
        ({"cpu_chunks": 8, "exact_fence": "yes"}, r"exact_fence must be a bool, got 'yes' \(str\)"),
        ({"cpu_bytes": 10}, "holds no chunk"),
    ],
)
def test_bad_extra_config_is_a_clear_error(extra: dict[str, Any], match: str) -> None:
    vc, kcc = make_config(32, extra)
    with pytest.raises(ConfigError, match=match):
        KvOffloadConnector(vc, KVConnectorRole.SCHEDULER, kcc)


def test_a_request_freed_before_its_first_lookup_is_released_once(async_sched: bool) -> None:
    # on_new_request only keeps the hash list; the first lookup registers the request. One
    # aborted while still waiting (never looked up) is registered by request_finished, so
    # the next step releases it as aborted and the core drops it; nothing is left behind.
    h = Harness(64, async_scheduling=async_sched)
    side = h.conn.scheduler_side
    h.add("w", prompt(5, 64), max_tokens=4)
    assert "w" in side.hashes
    assert side.sched.num_requests == 0  # not registered before its lookup
    h.sched.finish_requests(["w"], RequestStatus.FINISHED_ABORTED)
    assert side.sched.status("w") == "waiting"
    assert side.aborted == {"w"}
    h.step()
    assert side.sched.num_requests == 0
    assert not side.hashes
    assert not side.aborted
    assert not side.released
    h.add("x", prompt(5, 64), max_tokens=4)  # the same prompt runs normally afterwards
    h.run_until_done()
    h.drain()
    h.assert_clean()


def _side() -> Any:
    from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
    from kvoffload.scheduler import KvGroup, OffloadConfig

    cfg = OffloadConfig(groups=(KvGroup(block_size=BS),), num_gpu_blocks=64, cpu_chunks=32)
    return SchedulerSide(cfg, exact_fence=True, kv_events=False)


def _request(rid: str, n: int) -> Any:
    from types import SimpleNamespace

    hashes = [i.to_bytes(32, "big") for i in range(1, n // BS + 1)]
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_prompt_tokens=n, num_tokens=n)


def _freed_output(done: set[str]) -> Any:
    """A step that schedules nothing and reports ``done`` freed."""
    from types import SimpleNamespace

    cached = SimpleNamespace(
        req_ids=[], num_computed_tokens=[], new_block_ids=[], resumed_req_ids=set()
    )
    return SimpleNamespace(
        scheduled_cached_reqs=cached,
        scheduled_new_reqs=[],
        num_scheduled_tokens={},
        finished_req_ids=done,
        preempted_req_ids=set(),
    )


def test_requests_freed_without_request_finished_are_released_only_if_tracked() -> None:
    # vLLM 0.32 calls request_finished for every freed request; a freed id it did not report
    # (the adapter's safety net) is released when the core tracks it (it was looked up) and
    # only forgotten when not (it never was): no unknown id reaches the core's step.
    side = _side()
    side.on_new_request(_request("seen", 4 * BS))
    side.on_new_request(_request("unseen", 4 * BS))
    assert side.get_num_new_matched_tokens(_request("seen", 4 * BS), 0) == (0, False)
    assert side.sched.status("seen") == "waiting"
    side.build_connector_meta(_freed_output({"seen", "unseen"}))
    assert not side.hashes
    # "seen" released (as finished, nothing pending: dropped); "unseen" never reached the core.
    assert side.sched.num_requests == 0
