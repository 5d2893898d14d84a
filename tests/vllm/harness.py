"""vLLM's real scheduler with the connector, driven by fake model outputs (no model).

One harness for every vLLM test: vLLM's ``Scheduler`` (or ``AsyncScheduler``) with our
connector's scheduler side, and ``tp`` fake workers, each running its own worker-side connector
with a real :class:`~kvoffload.transfer.TransferEngine` over its own CPU tensors. The fake
forward pass writes, for every computed token, a value derived from the rank and the whole
token prefix into every layer of the rank's KV shard; every load is checked against that
oracle when vLLM schedules the request again. The per-rank outputs are merged by vLLM's own
``KVOutputAggregator`` (what the executors do before the engine core calls
``update_from_output``). Per rank, a gate holds the worker's copies while closed, and load
faults can be injected by request (``fail_loads``) or by rank (``fail_load_ranks``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.integrations.vllm import (
    KvOffloadConnector,
    KvOffloadMetadata,
    KvOffloadWorkerMetadata,
)
from vllm import SamplingParams

MODEL = str(Path(__file__).resolve().parent / "tiny-llama")
BS = 16
LAYERS = 2


def make_config(
    num_blocks: int,
    extra: dict[str, Any] | None = None,
    async_scheduling: bool = False,
    failure_policy: str = "fail",
    tensor_parallel_size: int = 1,
    kv_events: bool = False,
) -> tuple[VllmConfig, KVCacheConfig]:
    """A vLLM config with our connector (``extra``: its ``kv_connector_extra_config``); with
    ``kv_events``, vLLM collects KV events (published nowhere)."""
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
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
        ),
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


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1500 + 3 for i in range(n)]


def load_jobs(plans: list[KvOffloadMetadata], rid: str | None = None) -> list[int]:
    """Load job ids planned (for request ``rid``, or all), in plan order."""
    return [j for m in plans for j, r in m.load_requests() if rid is None or r == rid]


def store_jobs(plans: list[KvOffloadMetadata]) -> list[int]:
    """Store job ids planned, in plan order."""
    return [j for m in plans for j in m.store_ids()]


def job_blocks(plans: list[KvOffloadMetadata], job: int) -> int:
    """GPU blocks job ``job`` copies, over all groups."""
    for m in plans:
        if job in m.store_ids() or job in [j for j, _ in m.load_requests()]:
            return len(m.gpu_blocks(job))
    raise KeyError(job)


class Harness:
    """vLLM's Scheduler + ``tp`` worker-side connectors over CPU tensors, with a KV oracle."""

    def __init__(
        self,
        num_blocks: int,
        tp: int = 1,
        async_scheduling: bool = False,
        copy_delay_s: float = 0.0,
        failure_policy: str = "fail",
        block_errors_only: bool = False,
        kv_events: bool = False,
        **extra: Any,
    ) -> None:
        ex = {"cpu_chunks": 256, **extra}
        vc, kcc = make_config(num_blocks, ex, async_scheduling, failure_policy, tp, kv_events)
        assert vc.parallel_config.world_size == tp
        self.vc = vc
        self.hasher, self.sched, self.conn = build_scheduler(vc, kcc, async_scheduling)
        assert self.conn.scheduler_side is not None
        # What EngineCore does: executor.init_kv_output_aggregator(scheduler.connector).
        self.aggregator = KVOutputAggregator.from_connector(self.conn, tp)
        # Per rank: an open gate lets its copies run; a closed one holds them.
        self.gates = [threading.Event() for _ in range(tp)]
        for g in self.gates:
            g.set()
        # Load jobs to fail per request id, and ranks whose load jobs all fail.
        self.fail_loads: dict[str, int] = {}
        self.fail_load_ranks: set[int] = set()
        self.failed_jobs: list[tuple[int, str]] = []
        # Emulates a worker reporting failed loads by block only (no failed_recving): vLLM
        # then keeps the valid prefix and recomputes from the first invalid block.
        self.block_errors_only = block_errors_only
        self.workers: list[KvOffloadConnector] = []
        # Per rank: [2, num_blocks, block_size, heads, head] per layer, like vLLM's CPU backend.
        self.kv: list[dict[str, torch.Tensor]] = []
        for rank in range(tp):
            w = KvOffloadConnector(vc, KVConnectorRole.WORKER, kcc)
            assert w.worker_side is not None
            w.worker_side.rank = rank  # one process plays every rank: no parallel state
            w.worker_side.engine_kwargs = {
                "_copy_delay_s": copy_delay_s,
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
        self.steps = 0
        self.admitted: list[tuple[str, int]] = []  # (request, computed tokens) when scheduled

    @property
    def worker(self) -> KvOffloadConnector:
        """The rank-0 worker."""
        return self.workers[0]

    def _fault(self, rank: int) -> Any:
        def hook(job: int) -> None:
            for m in list(self.plans):
                for j, rid in m.load_requests():
                    if j != job:
                        continue
                    if rank in self.fail_load_ranks:
                        self.gates[rank].wait(timeout=30.0)  # runs before the copies' gate
                        raise RuntimeError(f"injected failure of load job {job} on rank {rank}")
                    if self.fail_loads.get(rid, 0) > 0:
                        self.fail_loads[rid] -= 1
                        self.failed_jobs.append((job, rid))
                        raise RuntimeError(f"injected failure of load job {job} ({rid})")

        return hook

    def _gate(self, rank: int) -> Any:
        def hook(job: int, copy: int) -> None:
            if not self.gates[rank].wait(timeout=30.0):
                raise RuntimeError(f"rank {rank} gate not opened (job {job})")

        return hook

    # ------------------------------------------------------------------ requests

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

    def expected(self, rid: str, pos: int, rank: int = 0) -> float:
        """Rank-dependent KV value of token ``pos``: each shard holds different bytes."""
        toks = self.true_tokens[rid][: pos + 1]
        h = hashlib.blake2b(repr((rank, toks)).encode(), digest_size=8).digest()
        return token_value(h)

    def finished(self) -> set[str]:
        return {rid for rid, r in self.reqs.items() if RequestStatus.is_finished(r.status)}

    # ------------------------------------------------------------------ one step

    @staticmethod
    def _start(so: Any, rid: str) -> int:
        """Tokens computed before this step for a scheduled request."""
        for nr in so.scheduled_new_reqs:
            if nr.req_id == rid:
                return nr.num_computed_tokens
        cached = so.scheduled_cached_reqs
        return cached.num_computed_tokens[cached.req_ids.index(rid)]

    def step(self) -> Any:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, KvOffloadMetadata)
        self.plans.append(meta)
        self.steps += 1
        # Tables as the workers see them.
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
            end = starts[rid] + n
            if end >= self.reqs[rid].num_prompt_tokens and end == len(self.true_tokens[rid]):
                sampled[rid] = [1000 + end % 500]
        outputs: list[ModelRunnerOutput] = []
        reported: list[set[int]] = []
        req_ids = list(so.num_scheduled_tokens)
        for rank, w in enumerate(self.workers):
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            # Newly scheduled requests: verify what a load put into their blocks.
            for nr in so.scheduled_new_reqs:
                self.verify_prefix(nr.req_id, nr.num_computed_tokens, rank)
            # The forward pass.
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
            reported.append(set(wmeta.done.get(rank, ())) if wmeta is not None else set())
            kv_out = KVConnectorOutput(
                finished_recving=res.finished_recving or None,
                failed_recving=set() if self.block_errors_only else res.failed_recving,
                invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
                kv_connector_worker_meta=wmeta,
            )
            w.clear_connector_metadata()
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
            # Outputs arrive one step late: after the next schedule() call.
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

    # ------------------------------------------------------------------ stepping

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

    def assert_clean(self, late_reports: bool = False) -> None:
        """Nothing pending, armed, tracked or loading: in the core, the adapter, the workers
        and vLLM's aggregator; no late report unless ``late_reports`` (a reset's cancelled
        loads are reported late)."""
        s = self.conn.scheduler_side
        assert s is not None
        core = s.sched
        assert core.pending_jobs() == []
        assert core.armed_pairs == 0
        assert core.num_requests == 0
        assert core.loading_requests == 0
        assert not s.hashes
        assert not s.aborted
        assert late_reports or core.stats()["late_reports"] == 0
        assert not self.conn.has_pending_push_work()
        for w in self.workers:
            assert w.worker_side is not None
            assert not w.worker_side.load_req
            assert not w.worker_side.cancelled
        assert not self.aggregator._recv_remaining_count
        assert not self.aggregator._failed_recving_pending
