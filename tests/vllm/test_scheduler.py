"""vLLM's real scheduler with the connector, driven by fake model outputs (no model).

A fake worker runs the connector's worker side over real CPU tensors with a real
:class:`~kvoffload.transfer.TransferEngine`; the fake forward pass writes, for every computed
token, a value derived from the whole token prefix into the KV tensor. Every load is checked
against that oracle when vLLM schedules the request again. The fence scenarios check what vLLM
frees and re-allocates: a finished request's and a preempted request's blocks are handed to
another request while their stores are pending, and the plan flushes exactly those stores; a
prefix-cache hit on those blocks flushes nothing.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm import (
    KvOffloadConnector,
    KvOffloadMetadata,
    KvOffloadStats,
)
from vllm import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL = str(Path(__file__).resolve().parent / "tiny-llama")
BS = 16
LAYERS = 2


def make_config(
    num_blocks: int,
    extra: dict[str, Any] | None = None,
    async_scheduling: bool = False,
    failure_policy: str = "fail",
    tensor_parallel_size: int = 1,
) -> tuple[VllmConfig, KVCacheConfig]:
    model = ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype="float32", seed=0)
    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    ktc = KVTransferConfig(
        kv_connector="KvOffloadConnector",
        kv_connector_module_path="kvoffload.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra if extra is not None else {"cpu_chunks": 256},
        kv_load_failure_policy=failure_policy,  # type: ignore[arg-type]
    )
    vc = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32)
    names = [f"layer{i}" for i in range(LAYERS)]
    kcc = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],  # the scheduler does not read them; the harness makes its own
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    return vc, kcc


def build_scheduler(
    vc: VllmConfig, kcc: KVCacheConfig, async_scheduling: bool
) -> tuple[Any, Any, KvOffloadConnector]:
    """vLLM's real (async) scheduler with our connector, and the request block hasher."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    cls = AsyncScheduler if async_scheduling else Scheduler
    sched = cls(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BS,
        log_stats=True,
    )
    conn = sched.get_kv_connector()
    assert isinstance(conn, KvOffloadConnector)
    return hasher, sched, conn


def token_value(prefix_digest: bytes) -> float:
    return float(int.from_bytes(prefix_digest[:3], "big"))


class Stepping:
    """Stepping helpers shared by the harnesses: ``self.sched``, ``self.conn``, ``self.prev`` and
    ``self.step()`` come from the subclass."""

    sched: Any
    conn: Any
    prev: Any

    def step(self) -> Any:
        raise NotImplementedError

    @staticmethod
    def _start(so: Any, rid: str) -> int:
        """Tokens computed before this step for a scheduled request."""
        for nr in so.scheduled_new_reqs:
            if nr.req_id == rid:
                return nr.num_computed_tokens
        cached = so.scheduled_cached_reqs
        return cached.num_computed_tokens[cached.req_ids.index(rid)]

    def flush_outputs(self) -> None:
        """Asynchronous scheduling: deliver the outputs held back one step."""
        if self.prev is not None:
            prev, self.prev = self.prev, None
            self.sched.update_from_output(*prev)

    def run_until_done(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sched.has_requests():
                self.flush_outputs()
                if not self.sched.has_requests():
                    return
            self.step()
            time.sleep(0.001)
        raise AssertionError("requests did not finish")

    def drain(self) -> None:
        """Steps until every job completed (the engine keeps stepping for pending work)."""
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            if not self.conn.has_pending_push_work() and not self.sched.has_requests():
                self.flush_outputs()
                if not self.conn.has_pending_push_work():
                    return
            self.step()
            time.sleep(0.002)
        raise AssertionError("jobs did not complete")


class Harness(Stepping):
    """vLLM's Scheduler + our worker side over CPU tensors, with a KV oracle."""

    def __init__(
        self,
        num_blocks: int,
        async_scheduling: bool = False,
        copy_delay_s: float = 0.0,
        failure_policy: str = "fail",
        block_errors_only: bool = False,
        **extra: Any,
    ) -> None:
        ex = {"cpu_chunks": 256, **extra}
        vc, kcc = make_config(num_blocks, ex, async_scheduling, failure_policy)
        self.vc = vc
        self.hasher, self.sched, self.conn = build_scheduler(vc, kcc, async_scheduling)
        self.worker = KvOffloadConnector(vc, KVConnectorRole.WORKER, kcc)
        # [2, num_blocks, block_size, heads, head] per layer, like vLLM's CPU backend.
        self.kv = {f"layer{i}": torch.zeros(2, num_blocks, BS, 1, 4) for i in range(LAYERS)}
        assert self.worker.worker_side is not None
        # Load jobs to fail per request id (the worker's TransferEngine raises for them).
        self.fail_loads: dict[str, int] = {}
        self.failed_jobs: list[tuple[int, str]] = []
        # Emulates a worker reporting failed loads by block only (no failed_recving): vLLM
        # then keeps the valid prefix and recomputes from the first invalid block.
        self.block_errors_only = block_errors_only
        self.worker.worker_side.engine_kwargs = {
            "_copy_delay_s": copy_delay_s,
            "_fault_injector": self._inject,
        }
        self.worker.register_kv_caches(self.kv)
        self.async_scheduling = async_scheduling
        self.prev: tuple[Any, Any] | None = None
        self.true_tokens: dict[str, list[int]] = {}
        self.reqs: dict[str, Request] = {}
        self.tables: dict[str, list[int]] = {}
        self.plans: list[KvOffloadMetadata] = []
        self.loads_checked = 0
        self.steps = 0
        self.admitted: list[tuple[str, int]] = []  # (request, computed tokens) when scheduled

    def _inject(self, job: int) -> None:
        for m in list(self.plans):
            for j, rid, _ in m.loads:
                if j == job and self.fail_loads.get(rid, 0) > 0:
                    self.fail_loads[rid] -= 1
                    self.failed_jobs.append((job, rid))
                    raise RuntimeError(f"injected failure of load job {job} ({rid})")

    # ------------------------------------------------------------------ requests

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
        req = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.reqs[rid] = req
        self.true_tokens[rid] = list(prompt)
        self.sched.add_request(req)
        return req

    def expected(self, req: Request, pos: int) -> float:
        toks = self.true_tokens[req.request_id][: pos + 1]
        h = hashlib.blake2b(repr(toks).encode(), digest_size=8).digest()
        return token_value(h)

    # ------------------------------------------------------------------ one step

    def step(self) -> Any:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, KvOffloadMetadata)
        self.plans.append(meta)
        self.steps += 1
        # Tables as the worker sees them.
        for nr in so.scheduled_new_reqs:
            self.tables[nr.req_id] = list(nr.block_ids[0])
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.tables[rid] = list(ids[0]) if ids else []
            elif ids:
                self.tables.setdefault(rid, []).extend(ids[0])
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        # Newly scheduled requests: verify what a load put into their blocks.
        for nr in so.scheduled_new_reqs:
            req = self.reqs[nr.req_id]
            self.admitted.append((nr.req_id, nr.num_computed_tokens))
            self.verify_prefix(req, nr.num_computed_tokens)
        # The forward pass.
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.reqs[rid]
            start = self._start(so, rid)
            table = self.tables[rid]
            true = self.true_tokens[rid]
            for pos in range(start, start + n):
                v = self.expected(req, pos)
                b = table[pos // BS]
                for t in self.kv.values():
                    t[:, b, pos % BS] = v
            if start + n >= req.num_prompt_tokens and start + n == len(true):
                tok = 1000 + (start + n) % 500
                true.append(tok)
                sampled[rid] = [tok]
        w.start_load_kv(None)  # type: ignore[arg-type]
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_recving=res.finished_recving,
            failed_recving=set() if self.block_errors_only else res.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=kv_out,
        )
        if self.async_scheduling:
            # Outputs arrive one step late: after the next schedule() call.
            prev, self.prev = self.prev, (so, out)
            if prev is not None:
                self.sched.update_from_output(*prev)
        else:
            self.sched.update_from_output(so, out)
        return so

    def idle(self) -> bool:
        return not self.sched.has_requests() and self.prev is None

    def verify_prefix(self, req: Request, upto: int) -> None:
        table = self.tables[req.request_id]
        for pos in range(upto):
            b = table[pos // BS]
            got = self.kv["layer0"][0, b, pos % BS, 0, 0].item()
            assert got == self.expected(req, pos), (req.request_id, pos, b)
        self.loads_checked += 1

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1500 + 3 for i in range(n)]


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
    loads = [j for m in h.plans for j in m.loads]
    assert [rid for _, rid, _ in loads] == ["b"]
    loaded = sum(len(gpu) for _, _, transfers in loads for _, gpu, _ in transfers)
    assert loaded * BS == 96  # every full block of the 100-token prompt
    assert h.loads_checked >= 2
    core = h.conn.scheduler_side.sched
    assert core.pending_jobs() == []
    assert core.armed_pairs == 0


def test_finished_request_blocks_reallocated_flush_its_pending_store(async_sched: bool) -> None:
    # Few blocks and no prefix hit: the second request gets the first one's freed blocks
    # while the first one's last store is still pending (stores start a step late).
    h = Harness(12, async_scheduling=async_sched, copy_delay_s=0.05)
    h.add("a", prompt(2, 64), max_tokens=2)
    while "a" not in _finished(h):
        h.step()
    a_blocks = set(h.tables["a"])
    pending_before = set(h.conn.scheduler_side.pending)
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
    while "a" not in _finished(h):
        h.step()
    assert h.conn.scheduler_side.pending
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
        while "a" not in _finished(h):
            h.step()
        h.add("b", prompt(3, 150), max_tokens=2)
        h.run_until_done()
        h.drain()
        return sum(len(m.flush) for m in h.plans)

    assert run(False) >= run(True) >= 1


def test_stats_and_events_surface() -> None:
    h = Harness(64)
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
    assert sum(len(e.block_hashes) for e in stored) == 5  # 80 tokens: 5 full blocks
    assert all(e.medium == "CPU" for e in seen)
    red = stats.reduce()
    assert red["store_jobs"] == 1
    assert red["sched_steps"] >= 3
    assert red["bytes_stored"] == 5 * BS * LAYERS * 2 * 4 * 4
    assert red["sched_us_per_step"] > 0


# ------------------------------------------------------------------------- failed loads


def _assert_clean(h: Harness) -> None:
    """Nothing pending, armed or tracked: in the core and in the adapter."""
    s = h.conn.scheduler_side
    assert s is not None
    core = s.sched
    assert core.pending_jobs() == []
    assert core.armed_pairs == 0
    assert core.num_requests == 0
    assert not s.running
    assert not s.known
    assert not s.loading
    assert not s.pending
    assert h.worker.worker_side is not None
    assert not h.worker.worker_side.load_req
    assert not h.worker.worker_side.cancelled


def _load_jobs(h: Harness, rid: str) -> list[int]:
    return [j for m in h.plans for j, r, _ in m.loads if r == rid]


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
    jobs = _load_jobs(h, "b")
    assert jobs == [h.failed_jobs[0][0]]
    assert h.reqs["b"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.true_tokens["b"] == h.true_tokens["a"]
    st = h.conn.scheduler_side.sched.stats()
    assert st["failed_loads"] == 1
    _assert_clean(h)


def test_failed_load_fail_policy_finishes_request_with_error(async_sched: bool) -> None:
    h = Harness(64, async_scheduling=async_sched)  # vLLM's default policy: "fail"
    p = prompt(12, 100)
    _stored_then_local_reset(h, p)
    h.fail_loads["b"] = 1
    h.add("b", p)
    h.run_until_done()
    h.drain()
    assert len(_load_jobs(h, "b")) == 1
    assert h.reqs["b"].status == RequestStatus.FINISHED_ERROR
    # The engine goes on: the failed chunks were dropped, so c recomputes and stores them
    # again, and d then loads them (correctly) from the CPU tier.
    h.add("c", p)
    h.run_until_done()
    h.drain()
    assert _load_jobs(h, "c") == []
    assert h.sched.reset_prefix_cache()
    h.add("d", p)
    h.run_until_done()
    h.drain()
    assert len(_load_jobs(h, "d")) == 1
    assert [c for r, c in h.admitted if r == "d"] == [96]
    _assert_clean(h)


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
    assert len(_load_jobs(h, "b")) == 1
    # Not asked again: scheduled with the valid local prefix only, the rest recomputed.
    assert [c for r, c in h.admitted if r == "b"] == [32]
    assert h.reqs["b"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    # b's recomputed blocks are what the next request gets (prefix cache), verified.
    h.add("d", [*p, 5])
    h.run_until_done()
    h.drain()
    assert [c for r, c in h.admitted if r == "d"] == [96]
    _assert_clean(h)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_reset_cache_with_loads_in_flight(async_sched: bool, policy: str) -> None:
    h = Harness(64, async_scheduling=async_sched, copy_delay_s=0.05, failure_policy=policy)
    p = prompt(14, 100)
    _stored_then_local_reset(h, p)
    h.add("b", p)
    for _ in range(3):
        h.step()
        if _load_jobs(h, "b"):
            break
    s = h.conn.scheduler_side
    assert s.loading, "b's load should be in flight"
    if policy == "fail":
        # A cancelled load would fail the request: refused while loads are in flight.
        assert not h.conn.reset_cache()
        h.run_until_done()
        h.drain()
        assert [c for r, c in h.admitted if r == "b"] == [96]
        assert h.conn.reset_cache()
    else:
        assert h.conn.reset_cache()
        assert not s.loading
        h.run_until_done()
        h.drain()
        # The cancelled load was reported as failed: vLLM asked again, the CPU tier was
        # empty, and b was computed from scratch.
        assert len(_load_jobs(h, "b")) == 1
        assert [c for r, c in h.admitted if r == "b"] == [0]
        assert h.reqs["b"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    _assert_clean(h)


def _finished(h: Harness) -> set[str]:
    return {rid for rid, r in h.reqs.items() if RequestStatus.is_finished(r.status)}


# --------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({}, "CPU capacity"),
        ({"cpu_bytes": -5}, "cpu_bytes must be >= 1"),
        ({"cpu_bytes": "lots"}, "cpu_bytes must be an integer"),
        ({"cpu_chunks": 8, "cpu_bytes": 1 << 20}, "not both"),
        ({"cpu_chunks": 8, "policy": "fifo"}, "policy must be 'lru' or 'arc'"),
        ({"cpu_chunks": 8, "blocks_per_chunk": 0}, "blocks_per_chunk must be >= 1"),
        ({"cpu_chunks": 8, "chunk": 4}, "unknown kv_connector_extra_config"),
        ({"cpu_chunks": 8, "offload_prompt_only": 1}, "true or false"),
        ({"cpu_bytes": 10}, "holds no chunk"),
    ],
)
def test_bad_extra_config_is_a_clear_error(extra: dict[str, Any], match: str) -> None:
    vc, kcc = make_config(32, extra)
    with pytest.raises(ConfigError, match=match):
        KvOffloadConnector(vc, KVConnectorRole.SCHEDULER, kcc)
