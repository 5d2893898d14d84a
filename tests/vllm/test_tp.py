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

import hashlib
import threading
import time
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvoffload.integrations.vllm import (
    KvOffloadConnector,
    KvOffloadMetadata,
    KvOffloadWorkerMetadata,
)
from tests.vllm.test_scheduler import (
    BS,
    LAYERS,
    Stepping,
    build_scheduler,
    make_config,
    prompt,
    token_value,
)
from vllm import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TP = 2


class TpHarness(Stepping):
    """vLLM's Scheduler (TP=2) + two worker-side connectors, outputs merged by vLLM."""

    def __init__(self, num_blocks: int, async_scheduling: bool = False) -> None:
        vc, kcc = make_config(num_blocks, None, async_scheduling, tensor_parallel_size=TP)
        assert vc.parallel_config.world_size == TP
        self.hasher, self.sched, self.conn = build_scheduler(vc, kcc, async_scheduling)
        assert self.conn.scheduler_side is not None
        # What EngineCore does: executor.init_kv_output_aggregator(scheduler.connector).
        self.aggregator = KVOutputAggregator.from_connector(
            self.conn, vc.parallel_config.world_size
        )
        # Per rank: an open gate lets its copies run; a closed one holds them.
        self.gates = [threading.Event() for _ in range(TP)]
        for g in self.gates:
            g.set()
        self.fail_load_ranks: set[int] = set()  # ranks whose load jobs fail
        self.workers: list[KvOffloadConnector] = []
        self.kv: list[dict[str, torch.Tensor]] = []
        for rank in range(TP):
            w = KvOffloadConnector(vc, KVConnectorRole.WORKER, kcc)
            assert w.worker_side is not None
            w.worker_side.rank = rank  # one process plays both ranks: no parallel state
            w.worker_side.engine_kwargs = {
                "_before_copy": self._gate(rank),
                "_fault_injector": self._fault(rank),
            }
            kv = {f"layer{i}": torch.zeros(2, num_blocks, BS, 1, 4) for i in range(LAYERS)}
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.kv.append(kv)
        self.async_scheduling = async_scheduling
        self.prev: tuple[Any, Any] | None = None
        self.true_tokens: dict[str, list[int]] = {}
        self.reqs: dict[str, Request] = {}
        self.tables: dict[str, list[int]] = {}
        self.plans: list[KvOffloadMetadata] = []
        # Per step: what each rank reported (job ids done), before aggregation.
        self.reports: list[list[set[int]]] = []
        self.loads_checked = 0
        self.admitted: list[tuple[str, int]] = []

    def _fault(self, rank: int) -> Any:
        def hook(job: int) -> None:
            loads = {j for m in self.plans for j, _, _ in m.loads}
            if rank in self.fail_load_ranks and job in loads:
                self.gates[rank].wait(timeout=30.0)  # runs before the copies' gate
                raise RuntimeError(f"injected failure of load job {job} on rank {rank}")

        return hook

    def _gate(self, rank: int) -> Any:
        def hook(job: int, copy: int) -> None:
            if not self.gates[rank].wait(timeout=30.0):
                raise RuntimeError(f"rank {rank} gate not opened (job {job})")

        return hook

    def add(self, rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
        req = Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.reqs[rid] = req
        self.true_tokens[rid] = list(tokens)
        self.sched.add_request(req)
        return req

    def expected(self, rid: str, pos: int, rank: int) -> float:
        """Rank-dependent KV value of token ``pos``: each shard holds different bytes."""
        toks = self.true_tokens[rid][: pos + 1]
        h = hashlib.blake2b(repr((rank, toks)).encode(), digest_size=8).digest()
        return token_value(h)

    def step(self) -> Any:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, KvOffloadMetadata)
        self.plans.append(meta)
        for nr in so.scheduled_new_reqs:
            self.tables[nr.req_id] = list(nr.block_ids[0])
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.tables[rid] = list(ids[0]) if ids else []
            elif ids:
                self.tables.setdefault(rid, []).extend(ids[0])
        for nr in so.scheduled_new_reqs:
            self.admitted.append((nr.req_id, nr.num_computed_tokens))
        # Model outputs (the same on every rank, as with TP).
        sampled: dict[str, list[int]] = {}
        starts = {rid: self._start(so, rid) for rid in so.num_scheduled_tokens}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.reqs[rid]
            true = self.true_tokens[rid]
            if starts[rid] + n >= req.num_prompt_tokens and starts[rid] + n == len(true):
                sampled[rid] = [1000 + (starts[rid] + n) % 500]
        outputs: list[ModelRunnerOutput] = []
        reported: list[set[int]] = []
        for rank, w in enumerate(self.workers):
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            for nr in so.scheduled_new_reqs:
                self.verify_prefix(nr.req_id, nr.num_computed_tokens, rank)
            for rid, n in so.num_scheduled_tokens.items():
                table = self.tables[rid]
                for pos in range(starts[rid], starts[rid] + n):
                    v = self.expected(rid, pos, rank)
                    for t in self.kv[rank].values():
                        t[:, table[pos // BS], pos % BS] = v
            w.start_load_kv(None)  # type: ignore[arg-type]
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            wmeta = w.build_connector_worker_meta()
            assert wmeta is None or isinstance(wmeta, KvOffloadWorkerMetadata)
            reported.append(set(wmeta.done) if wmeta is not None else set())
            kv_out = KVConnectorOutput(
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
                kv_connector_worker_meta=wmeta,
            )
            w.clear_connector_metadata()
            req_ids = list(so.num_scheduled_tokens)
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=[sampled.get(r, []) for r in req_ids],
                    kv_connector_output=kv_out,
                )
            )
        self.reports.append(reported)
        for rid, toks in sampled.items():
            self.true_tokens[rid].extend(toks)
        out = self.aggregator.aggregate(outputs)
        assert out is not None
        if self.async_scheduling:
            prev, self.prev = self.prev, (so, out)
            if prev is not None:
                self.sched.update_from_output(*prev)
        else:
            self.sched.update_from_output(so, out)
        return so

    def verify_prefix(self, rid: str, upto: int, rank: int) -> None:
        table = self.tables[rid]
        for pos in range(upto):
            b = table[pos // BS]
            want = self.expected(rid, pos, rank)
            for name, t in self.kv[rank].items():
                got = t[:, b, pos % BS]
                assert bool((got == want).all()), (rank, name, rid, pos, b)
        self.loads_checked += 1

    def step_until(self, cond: Any, what: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            self.step()
            time.sleep(0.002)

    def reported_by(self, rank: int, job: int) -> bool:
        return any(job in r[rank] for r in self.reports)

    def shutdown(self) -> None:
        for g in self.gates:
            g.set()
        for w in self.workers:
            w.shutdown()


def _load_jobs(h: TpHarness, rid: str) -> list[int]:
    return [j for m in h.plans for j, r, _ in m.loads if r == rid]


def _store_jobs(h: TpHarness) -> list[int]:
    return [j for m in h.plans for j, _ in m.stores]


def _assert_clean(h: TpHarness) -> None:
    s = h.conn.scheduler_side
    assert s is not None
    core = s.sched
    assert core.pending_jobs() == []
    assert core.armed_pairs == 0
    assert core.num_requests == 0
    assert core.stats()["late_reports"] == 0
    assert not s.running
    assert not s.known
    assert not s.loading
    assert not s.pending
    for w in h.workers:
        assert w.worker_side is not None
        assert not w.worker_side.load_req
        assert not w.worker_side.cancelled
    # vLLM's aggregator waits for no rank.
    assert not h.aggregator._recv_remaining_count
    assert not h.aggregator._failed_recving_pending


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_sched(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def harness(async_sched: bool) -> Any:
    h = TpHarness(64, async_scheduling=async_sched)
    yield h
    h.shutdown()


def test_scheduler_side_expects_one_report_per_worker(harness: TpHarness) -> None:
    s = harness.conn.scheduler_side
    assert s is not None
    assert s.sched.config.num_workers == TP
    assert harness.aggregator._expected_finished_count == TP


def test_reload_after_prefix_cache_reset_loads_each_shard(harness: TpHarness) -> None:
    h = harness
    p = prompt(21, 100)
    h.add("a", p)
    h.run_until_done()
    h.drain()
    stores = _store_jobs(h)
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
    jobs = _load_jobs(h, "b")
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
    _assert_clean(h)


def test_load_completes_only_when_both_workers_reported(harness: TpHarness) -> None:
    h = harness
    s = h.conn.scheduler_side
    assert s is not None
    core = s.sched
    p = prompt(22, 100)
    h.add("a", p)
    h.run_until_done()
    h.drain()
    assert h.sched.reset_prefix_cache()
    completed0 = core.stats()["jobs_completed"]

    h.gates[1].clear()  # worker 1 is slow: its copies wait
    h.add("b", p)
    h.step_until(lambda: bool(_load_jobs(h, "b")), "b's load job")
    (job,) = _load_jobs(h, "b")
    h.step_until(lambda: h.reported_by(0, job), "worker 0's report")
    # Worker 0 reported, worker 1 did not: the job is pending everywhere.
    for _ in range(5):
        assert not h.reported_by(1, job)
        assert job in core.pending_jobs()
        assert job in s.pending
        assert s.loading.get("b") == job
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
    assert "b" not in s.loading
    assert [c for r, c in h.admitted if r == "b"] == [96]  # verified on both ranks
    st = core.stats()
    assert st["jobs_completed"] == completed0 + 1
    assert st["loading_requests"] == 0
    h.run_until_done()
    h.drain()
    _assert_clean(h)


def test_store_visible_only_when_both_workers_reported(harness: TpHarness) -> None:
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
    h.step_until(lambda: bool(_store_jobs(h)), "a's store job")
    jobs = _store_jobs(h)
    h.step_until(lambda: all(h.reported_by(0, j) for j in jobs), "worker 0's reports")
    # vLLM keeps stepping while the connector has pending work (has_requests stays true).
    h.step_until(lambda: RequestStatus.is_finished(h.reqs["a"].status), "a finished")
    jobs = _store_jobs(h)
    for _ in range(3):
        h.step()
    assert all(h.reported_by(0, j) for j in jobs)
    assert not any(h.reported_by(1, j) for j in jobs)
    assert set(jobs) <= set(core.pending_jobs())
    assert set(jobs) <= s.pending
    assert h.conn.has_pending_push_work()
    assert core.stats()["jobs_completed"] == 0
    assert core.stats()["pools"][0]["storing"] > 0
    assert not [e for e in events if type(e).__name__ == "BlockStored"]
    # Not loadable yet: b, with a's prompt, gets no load while the store is pending.
    assert h.sched.reset_prefix_cache()
    h.add("b", p, max_tokens=2)
    for _ in range(3):
        h.step()
    assert _load_jobs(h, "b") == []

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
    assert len(_load_jobs(h, "c")) == 1
    assert [c for r, c in h.admitted if r == "c"] == [96]
    _assert_clean(h)


def test_load_failed_on_one_worker_fails_the_job(harness: TpHarness) -> None:
    # Worker 0 loads fine and reports first; worker 1's copy fails, reported steps later:
    # the job is failed (not done), vLLM reports b in failed_recving (policy "fail").
    h = harness
    s = h.conn.scheduler_side
    assert s is not None
    core = s.sched
    p = prompt(24, 100)
    h.add("a", p)
    h.run_until_done()
    h.drain()
    assert h.sched.reset_prefix_cache()
    h.fail_load_ranks = {1}
    h.gates[1].clear()
    h.add("b", p)
    h.step_until(lambda: bool(_load_jobs(h, "b")), "b's load job")
    (job,) = _load_jobs(h, "b")
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
    _assert_clean(h)
