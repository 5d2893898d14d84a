"""Tensor parallelism: two workers, each with its own KV shard and worker-side connector.

vLLM's real ``Scheduler`` is configured with ``tensor_parallel_size=2`` (the connector's
scheduler side then expects two reports per job). Each fake worker runs its own
:class:`KvOffloadConnector` over its own CPU tensors, written with rank-dependent values, and
the two per-rank ``ModelRunnerOutput``s are merged by vLLM's own ``KVOutputAggregator`` (what
the executors do before the engine core calls ``update_from_output``): a request id is in
``finished_recving`` only once every rank reported it, and the ``KvOffloadWorkerMetadata``
are combined with their ``aggregate``. A gate on one worker's copies makes that worker
report a job steps after the other: the job must stay pending until both reported.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus

from tests.vllm.harness import BS, Harness, load_jobs, prompt, store_jobs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TP = 2


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_sched(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def harness(async_sched: bool) -> Any:
    h = Harness(64, tp=TP, async_scheduling=async_sched, kv_events=True)
    yield h
    h.shutdown()


def test_scheduler_side_expects_one_report_per_worker(harness: Harness) -> None:
    s = harness.conn.scheduler_side
    assert s is not None
    assert s.cfg.num_workers == TP
    assert harness.aggregator._expected_finished_count == TP


def test_reload_after_prefix_cache_reset_loads_each_shard(harness: Harness) -> None:
    h = harness
    p = prompt(21, 100)
    h.add("a", p)
    h.run_until_done()
    h.drain()
    stores = store_jobs(h.plans)
    assert stores
    assert all(h.reported_by(r, j) for r in range(TP) for j in stores)
    # Wipe both shards: whatever b finds in its blocks comes from the loads.
    for kv in h.kv:
        for t in kv.values():
            t.fill_(-1.0)
    assert h.sched.reset_prefix_cache()
    h.add("b", p)
    h.run_until_done()
    h.drain()
    jobs = load_jobs(h.plans, "b")
    assert len(jobs) == 1
    assert all(h.reported_by(r, jobs[0]) for r in range(TP))
    assert [c for r, c in h.admitted if r == "b"] == [96]
    # verify_prefix ran for b on both ranks, with each rank's own values.
    assert h.loads_checked >= 2 * TP
    # The two shards really hold different bytes for b's loaded blocks.
    table = h.tables["b"]
    for pos in range(96):
        b = table[pos // BS]
        v0 = h.kv[0]["layer0"][0, b, pos % BS, 0, 0].item()
        v1 = h.kv[1]["layer0"][0, b, pos % BS, 0, 0].item()
        assert v0 == h.expected("b", pos, 0)
        assert v1 == h.expected("b", pos, 1)
    assert sum(h.expected("b", i, 0) != h.expected("b", i, 1) for i in range(96)) > 90
    st = h.conn.scheduler_side.sched.stats()
    assert st["pending_jobs"] == 0
    h.assert_clean()


def store_a(h: Harness, seed: int) -> list[int]:
    """Request "a" runs a 100-token prompt to the end (its chunks are stored), then vLLM's
    prefix cache is reset: the prompt can come back only by a load. Returns the prompt."""
    p = prompt(seed, 100)
    h.add("a", p)
    h.run_until_done()
    h.drain()
    assert h.sched.reset_prefix_cache()
    return p


def test_load_completes_only_when_both_workers_reported(harness: Harness) -> None:
    h = harness
    s = h.conn.scheduler_side
    assert s is not None
    core = s.sched
    p = store_a(h, 22)
    completed0 = core.stats()["jobs_completed"]

    h.gates[1].clear()  # worker 1 is slow: its copies wait
    h.add("b", p)
    h.step_until(lambda: bool(load_jobs(h.plans, "b")), "b's load job")
    (job,) = load_jobs(h.plans, "b")
    h.step_until(lambda: h.reported_by(0, job), "worker 0's report")
    # Worker 0 reported, worker 1 did not: the job is pending everywhere.
    for _ in range(5):
        assert not h.reported_by(1, job)
        assert job in core.pending_jobs()
        st = core.stats()
        assert st["jobs_completed"] == completed0
        assert st["loading_requests"] == 1
        assert h.reqs["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert "b" not in [r for r, _ in h.admitted]
        # vLLM's aggregator counted rank 0's finished_recving and waits for rank 1.
        assert h.aggregator._recv_remaining_count == {"b": 1}
        h.step()
    h.gates[1].set()
    h.step_until(lambda: "b" in [r for r, _ in h.admitted], "b admitted")
    assert h.reported_by(1, job)
    assert job not in core.pending_jobs()
    assert core.loading_requests == 0
    assert [c for r, c in h.admitted if r == "b"] == [96]  # verified on both ranks
    st = core.stats()
    assert st["jobs_completed"] == completed0 + 1
    assert st["loading_requests"] == 0
    h.run_until_done()
    h.drain()
    h.assert_clean()


def test_store_visible_only_when_both_workers_reported(harness: Harness) -> None:
    h = harness
    s = h.conn.scheduler_side
    assert s is not None
    core = s.sched
    events: list[Any] = []
    take = h.conn.take_events

    def spy() -> list[Any]:  # vLLM drains the events every step: record them
        got = list(take())
        events.extend(got)
        return got

    h.conn.take_events = spy  # type: ignore[method-assign]
    p = prompt(23, 100)

    h.gates[1].clear()
    h.add("a", p, max_tokens=2)
    h.step_until(lambda: bool(store_jobs(h.plans)), "a's store job")
    jobs = store_jobs(h.plans)
    h.step_until(lambda: all(h.reported_by(0, j) for j in jobs), "worker 0's reports")
    # vLLM keeps stepping while the connector has pending work (has_requests stays true).
    h.step_until(lambda: RequestStatus.is_finished(h.reqs["a"].status), "a finished")
    jobs = store_jobs(h.plans)
    for _ in range(3):
        h.step()
    assert all(h.reported_by(0, j) for j in jobs)
    assert not any(h.reported_by(1, j) for j in jobs)
    assert set(jobs) <= set(core.pending_jobs())
    assert h.conn.has_pending_push_work()
    assert core.stats()["jobs_completed"] == 0
    assert core.stats()["pools"][0]["storing"] > 0
    assert not [e for e in events if type(e).__name__ == "BlockStored"]
    # Not loadable yet: b, with a's prompt, gets no load while the store is pending.
    assert h.sched.reset_prefix_cache()
    h.add("b", p, max_tokens=2)
    for _ in range(3):
        h.step()
    assert load_jobs(h.plans, "b") == []

    h.gates[1].set()
    h.run_until_done()
    h.drain()
    assert all(h.reported_by(1, j) for j in jobs)
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    assert sum(len(e.block_hashes) for e in stored) >= 6
    # Now it is: after another reset, c loads a's blocks, verified on both shards.
    assert h.sched.reset_prefix_cache()
    h.add("c", p, max_tokens=2)
    h.run_until_done()
    h.drain()
    assert len(load_jobs(h.plans, "c")) == 1
    assert [c for r, c in h.admitted if r == "c"] == [96]
    h.assert_clean()


def test_load_failed_on_one_worker_fails_the_job(harness: Harness) -> None:
    # Worker 0 loads fine and reports first; worker 1's copy fails, reported steps later:
    # the job is failed (not done), vLLM reports b in failed_recving (policy "fail").
    h = harness
    s = h.conn.scheduler_side
    assert s is not None
    core = s.sched
    p = store_a(h, 24)
    h.fail_load_ranks = {1}
    h.gates[1].clear()
    h.add("b", p)
    h.step_until(lambda: bool(load_jobs(h.plans, "b")), "b's load job")
    (job,) = load_jobs(h.plans, "b")
    h.step_until(lambda: h.reported_by(0, job), "worker 0's report")
    for _ in range(3):
        h.step()
    assert job in core.pending_jobs()
    assert core.stats()["failed_loads"] == 0
    assert h.reqs["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.gates[1].set()
    h.run_until_done()
    h.drain()
    assert h.reqs["b"].status == RequestStatus.FINISHED_ERROR
    assert "b" not in [r for r, _ in h.admitted]
    assert core.stats()["failed_loads"] == 1
    h.assert_clean()
