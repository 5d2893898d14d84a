"""vLLM v1 KV connector: offload KV-cache blocks to CPU memory with kvoffload.

Switch it on with configuration alone::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvOffloadConnector",
        "kv_connector_module_path": "kvoffload.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": 8000000000, "blocks_per_chunk": 1}}'

Tested with vLLM ``>=0.32.0,<0.33`` (:data:`SUPPORTED_VLLM`); importing this module under any
other version raises ``ImportError`` naming that range. Works on CUDA and on vLLM's CPU
backend (the KV cache in CPU memory).

**Extra config** (``kv_connector_extra_config``; unknown keys and bad values raise
:class:`~kvoffload.errors.ConfigError`): ``cpu_bytes`` (CPU memory per worker, bytes) or
``cpu_chunks`` (slots per KV group), ``blocks_per_chunk``, ``policy`` (``"lru"``/``"arc"``),
``max_loading_requests``, ``offload_prompt_only``, ``max_offload_tokens``, ``store_threshold``
-- the :class:`~kvoffload.scheduler.OffloadConfig` options -- and ``exact_fence`` (default
``True``; ``False`` passes ``written=None``, the conservative fence).

**Scheduler side** (one :class:`~kvoffload.scheduler.OffloadScheduler` per engine):

* ``on_new_request`` registers the request with its chained block hashes (vLLM's ``BlockHash``
  bytes, turned into the 64-bit ints vLLM publishes in its KV events); hashes of generated
  tokens are sent as they appear.
* ``get_num_new_matched_tokens`` is ``lookup``: ``None`` (vLLM 0.32 supports "ask again
  later"), ``0``, or tokens to load asynchronously (``load_kv_async=True``).
* ``update_state_after_alloc`` is ``allocate`` with the request's whole block table. Written
  blocks are told from prefix-cache re-use with what vLLM provides: the positions below the
  block-aligned local hit passed to the lookup are re-used read-only; every other allocated
  block, and every block vLLM appends to a running request, is written (by the forward pass,
  a load, zeroing or a copy-on-write). Where the hit is unknown (an allocation without a
  lookup) the step falls back to the conservative fence (``written=None``).
* ``build_connector_meta`` turns the ``SchedulerOutput`` into one
  :class:`~kvoffload.scheduler.StepInput` (scheduled requests and their computed tokens, new
  blocks, finished / aborted / preempted requests, written blocks) and ships the
  :class:`~kvoffload.scheduler.StepPlan` (loads, stores, flush) to the workers.
* ``request_finished`` returns ``(False, None)``: vLLM frees the blocks at once; the fence
  flushes a pending store before any of its blocks is written again.
* **Failed loads** are reported as ``failed_recving`` (and, with one KV group, as
  ``get_block_ids_with_load_errors``; vLLM refuses block ids with several groups). Under
  ``kv_load_failure_policy="fail"`` (vLLM's default) vLLM finishes the request with an error.
  Under ``"recompute"`` it either keeps the blocks and recomputes from the first invalid block
  (block-level report with a valid prefix: the recomputed blocks count as written again), or
  frees them and asks ``get_num_new_matched_tokens`` again: the adapter then calls
  ``OffloadScheduler.preempt`` and forgets the old block table. ``reset_cache`` with loads in
  flight reports those loads as failed (``"recompute"`` only; refused under ``"fail"``).

**How job ids travel back.** Each worker reports the ids of the jobs it finished (or failed)
in a :class:`KvOffloadWorkerMetadata`, vLLM's worker-to-scheduler side channel
(``build_connector_worker_meta``); vLLM sums the per-job counts over workers and hands them to
``update_connector_output``, which passes them to ``OffloadScheduler.complete`` (a job is done
when every worker reported it). Loads are also reported by request id through
``get_finished`` / ``finished_recving``, which vLLM itself counts over workers to keep a
request in ``WAITING_FOR_REMOTE_KVS`` until its load is done everywhere. No other state is
shared.

**Worker side** (one :class:`~kvoffload.transfer.TransferEngine` per worker), in vLLM's call
order: ``handle_preemptions`` (before the forward pass) submits the previous step's stores and
every flushed job, then completes the flush set (a host wait on CPU, a compute-stream wait on
CUDA); ``start_load_kv`` submits the loads (vLLM calls it after the forward launch for
asynchronous loads; the blocks belong to a request that does not run); ``wait_for_save`` queues
this step's stores, submitted at the start of the next step; ``get_finished`` polls results.

**Supported models.** Full-attention and sliding-window KV groups (hybrid models through
vLLM's hybrid allocator, the connector is ``SupportsHMA``) with one block size; tensor and
pipeline parallel workers (each registers its shard; ``cpu_bytes`` is per worker). Other
KV-cache kinds (Mamba, cross-attention, ...), speculative decoding and mixed block sizes are
refused with a ``ConfigError`` at startup.

**Metrics and events.** ``get_kv_connector_stats`` returns :class:`KvOffloadStats` (loaded and
stored tokens, bytes, jobs, flushes, scheduler-side seconds and steps), which vLLM aggregates
and logs like any connector's; the CPU tier's stored / removed events are returned by
``take_events`` as vLLM ``BlockStored`` / ``BlockRemoved`` events with medium ``"CPU"``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.errors import ConfigError, DuplicateReportError, KvOffloadError, UnknownJobError
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput

SUPPORTED_VLLM = ">=0.32.0,<0.33"
"""vLLM versions this connector is tested with."""


def _check_vllm_version() -> str:
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - the connector is loaded by vLLM
        raise ImportError(f"kvoffload.integrations.vllm needs vLLM {SUPPORTED_VLLM}: {e}") from e
    raw = str(getattr(vllm, "__version__", "0"))
    base = raw.split("+")[0]
    parts = []
    for p in base.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    if not ((0, 32, 0) <= tuple(parts) < (0, 33, 0)):
        raise ImportError(
            f"kvoffload.integrations.vllm supports vLLM {SUPPORTED_VLLM}, but vLLM {raw} is "
            "installed: install a supported vLLM or a kvoffload release that supports yours"
        )
    return raw


VLLM_VERSION = _check_vllm_version()

import torch  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvoffload.transfer import TransferEngine  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "SUPPORTED_VLLM",
    "KvOffloadConnector",
    "KvOffloadMetadata",
    "KvOffloadStats",
    "KvOffloadWorkerMetadata",
    "build_offload_config",
]

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_Transfers = list[tuple[int, list[int], list[int]]]

# ----------------------------------------------------------------------------- configuration

_INT_OPTIONS = {
    "cpu_bytes": 1,
    "cpu_chunks": 1,
    "blocks_per_chunk": 1,
    "max_loading_requests": 0,
    "max_offload_tokens": 0,
    "store_threshold": 0,
}
_BOOL_OPTIONS = ("offload_prompt_only", "exact_fence")
_OPTIONS = (*_INT_OPTIONS, *_BOOL_OPTIONS, "policy")


@dataclass(frozen=True)
class _Options:
    config: OffloadConfig
    exact_fence: bool


def _parse_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """Validates ``kv_connector_extra_config``; returns OffloadConfig keyword arguments."""
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k not in _OPTIONS)
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown} for KvOffloadConnector; "
            f"valid keys: {sorted(_OPTIONS)}"
        )
    out: dict[str, Any] = {}
    for name, least in _INT_OPTIONS.items():
        if name not in extra or extra[name] is None:
            continue
        v = extra[name]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"kv_connector_extra_config.{name} must be an integer, got {v!r}")
        if v < least:
            raise ConfigError(f"kv_connector_extra_config.{name} must be >= {least}, got {v}")
        out[name] = v
    for name in _BOOL_OPTIONS:
        if name in extra and not isinstance(extra[name], bool):
            raise ConfigError(
                f"kv_connector_extra_config.{name} must be true or false, got {extra[name]!r}"
            )
    if "offload_prompt_only" in extra:
        out["offload_prompt_only"] = extra["offload_prompt_only"]
    if "policy" in extra:
        if extra["policy"] not in ("lru", "arc"):
            raise ConfigError(
                f"kv_connector_extra_config.policy must be 'lru' or 'arc', got {extra['policy']!r}"
            )
        out["policy"] = extra["policy"]
    if "cpu_bytes" in out and "cpu_chunks" in out:
        raise ConfigError(
            "give one of kv_connector_extra_config.cpu_bytes and cpu_chunks, not both"
        )
    if "cpu_bytes" not in out and "cpu_chunks" not in out:
        raise ConfigError(
            "KvOffloadConnector needs the CPU capacity: set kv_connector_extra_config.cpu_bytes "
            "(bytes per worker) or cpu_chunks"
        )
    return out


def build_offload_config(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[OffloadConfig, bool]:
    """The :class:`OffloadConfig` for a vLLM engine, and whether the fence is exact.

    Raises:
        ConfigError: A bad extra-config value or an engine feature the connector refuses.
    """
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    if ktc.kv_role not in (None, "kv_both"):
        raise ConfigError(
            f"KvOffloadConnector offloads to local CPU memory; use kv_role 'kv_both', "
            f"not {ktc.kv_role!r}"
        )
    extra = dict(ktc.kv_connector_extra_config or {})
    exact = extra.pop("exact_fence", True)
    if not isinstance(exact, bool):
        raise ConfigError(
            f"kv_connector_extra_config.exact_fence must be true or false, got {exact!r}"
        )
    kwargs = _parse_extra(extra)
    if vllm_config.speculative_config is not None:
        raise ConfigError("KvOffloadConnector does not support speculative decoding yet")
    block_size = int(vllm_config.cache_config.block_size)
    groups = []
    for g, spec_group in enumerate(kv_cache_config.kv_cache_groups):
        spec = spec_group.kv_cache_spec
        layers = len(spec_group.layer_names)
        if isinstance(spec, SlidingWindowSpec):
            window: int | None = int(spec.sliding_window)
        elif isinstance(spec, FullAttentionSpec) and type(spec).__name__ in (
            "FullAttentionSpec",
            "MLAAttentionSpec",
        ):
            window = None
        else:
            raise ConfigError(
                f"KvOffloadConnector supports full-attention and sliding-window KV groups; "
                f"group {g} is {type(spec).__name__} (layers {spec_group.layer_names[:3]}...)"
            )
        if int(spec.block_size) != block_size:
            raise ConfigError(
                f"KvOffloadConnector needs one block size: group {g} has {spec.block_size}, "
                f"the engine {block_size}"
            )
        groups.append(
            KvGroup(
                block_size=block_size,
                sliding_window=window,
                bytes_per_block=int(spec.page_size_bytes) * layers,
            )
        )
    if not groups:
        raise ConfigError("KvOffloadConnector: the model has no KV cache groups")
    pc = vllm_config.parallel_config
    workers = int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)
    cfg = OffloadConfig(
        groups=tuple(groups),
        num_gpu_blocks=int(kv_cache_config.num_blocks),
        hash_block_size=block_size,
        num_workers=workers,
        null_block=0,
        **kwargs,
    )
    cfg.resolved_cpu_chunks()  # validates the capacity now, with a clear message
    return cfg, exact


# ----------------------------------------------------------------------------- messages


@dataclass
class KvOffloadMetadata(KVConnectorMetadata):
    """Scheduler → workers, one per step: the step plan.

    Attributes:
        loads: ``(job_id, request_id, transfers)`` per load job.
        stores: ``(job_id, transfers)`` per store job.
        flush: Jobs that must complete before this step writes its blocks.
        cancelled: Load jobs a cache reset cancelled: workers report them as failed.
    """

    loads: list[tuple[int, str, _Transfers]] = field(default_factory=list)
    stores: list[tuple[int, _Transfers]] = field(default_factory=list)
    flush: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)


@dataclass
class KvOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler, one per step: job reports (job → reporting worker ranks) and bytes."""

    done: dict[int, list[int]] = field(default_factory=dict)
    failed: dict[int, list[int]] = field(default_factory=dict)
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merges the reports of two workers (each report keeps its worker's rank)."""
        assert isinstance(other, KvOffloadWorkerMetadata)
        done = {j: list(r) for j, r in self.done.items()}
        for j, ranks in other.done.items():
            done.setdefault(j, []).extend(ranks)
        failed = {j: list(r) for j, r in self.failed.items()}
        for j, ranks in other.failed.items():
            failed.setdefault(j, []).extend(ranks)
        return KvOffloadWorkerMetadata(
            done=done,
            failed=failed,
            bytes_loaded=self.bytes_loaded + other.bytes_loaded,
            bytes_stored=self.bytes_stored + other.bytes_stored,
            load_seconds=self.load_seconds + other.load_seconds,
            store_seconds=self.store_seconds + other.store_seconds,
        )


_STAT_KEYS = (
    "lookups",
    "lookups_deferred",
    "loaded_tokens",
    "load_jobs",
    "store_jobs",
    "jobs_completed",
    "jobs_failed",
    "flushed_jobs",
    "reports_ignored",
    "bytes_loaded",
    "bytes_stored",
    "load_seconds",
    "store_seconds",
    "sched_seconds",
    "sched_steps",
)


@dataclass
class KvOffloadStats(KVConnectorStats):
    """Counters of one interval, summed over steps and workers (vLLM logs them)."""

    def __post_init__(self) -> None:
        for k in _STAT_KEYS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        """Zeroes every counter."""
        self.data = dict.fromkeys(_STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Adds ``other``'s counters."""
        for k, v in other.data.items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, plus the mean scheduler-side time per step in µs."""
        out = {k: v for k, v in self.data.items() if isinstance(v, (int, float))}
        steps = out.get("sched_steps", 0)
        out["sched_us_per_step"] = 1e6 * out.get("sched_seconds", 0.0) / steps if steps else 0.0
        return out

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(self.data.get(k) for k in _STAT_KEYS)


# ----------------------------------------------------------------------------- scheduler side


def _keys(hashes: Iterable[Any]) -> list[int]:
    """vLLM ``BlockHash`` bytes → the 64-bit ints vLLM publishes in its KV events."""
    return [
        int.from_bytes(h, "big") & _MASK64 if isinstance(h, (bytes, bytearray)) else int(h)
        for h in hashes
    ]


class _SchedulerSide:
    """Maps vLLM's scheduler-side connector calls onto :class:`OffloadScheduler`."""

    def __init__(self, cfg: OffloadConfig, exact_fence: bool, recompute: bool = False) -> None:
        self.cfg = cfg
        self.exact_fence = exact_fence
        self.recompute = recompute  # vLLM's kv_load_failure_policy is "recompute"
        self.sched = OffloadScheduler(cfg)
        self.block_size = cfg.groups[0].block_size
        self.chunk_tokens = self.block_size * cfg.blocks_per_chunk
        self.reqs: dict[str, Request] = {}
        self.sent: dict[str, int] = {}  # hashes sent per request
        self.running: set[str] = set()  # allocated in the core and not released
        self.known: dict[str, list[int]] = {}  # blocks the core knows per group
        self.hit: dict[str, int] = {}  # block-aligned local hit passed to this step's lookup
        self.loading: dict[str, int] = {}  # request -> load job in flight
        self.written: list[int] = []
        self.conservative = False
        self.pending: set[int] = set()
        self.cancelled: list[int] = []  # loads cancelled by a reset, for the next plan
        self.stats = KvOffloadStats()
        self.t = 0.0
        self.step_times: list[float] = []

    def _sync_hashes(self, rid: str, request: Request) -> None:
        n = len(request.block_hashes)
        sent = self.sent.get(rid, 0)
        if n > sent:
            self.sched.extend_hashes(rid, _keys(request.block_hashes[sent:n]))
            self.sent[rid] = n

    def on_new_request(self, request: Request) -> None:
        t = time.perf_counter()
        rid = request.request_id
        self.reqs[rid] = request
        self.sched.add_request(rid, max(1, request.num_prompt_tokens), _keys(request.block_hashes))
        self.sent[rid] = len(request.block_hashes)
        self.t += time.perf_counter() - t

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        t = time.perf_counter()
        rid = request.request_id
        try:
            if rid not in self.reqs:
                self.on_new_request(request)
            if rid in self.running:
                # vLLM asks again for a request it admitted: it freed the blocks of a failed
                # load (kv_load_failure_policy "recompute", nothing valid kept) and re-queued
                # it. Release it in the core and start afresh.
                self._released(rid)
            self._sync_hashes(rid, request)
            got = self.sched.lookup(rid, num_computed_tokens)
            self.stats.data["lookups"] += 1
            self.hit[rid] = num_computed_tokens
            if got is None:
                self.stats.data["lookups_deferred"] += 1
                return None, False
            # vLLM recomputes the last prompt token after a full hit; never load past it.
            got = min(int(got), max(0, request.num_tokens - num_computed_tokens))
            return got, got > 0
        finally:
            self.t += time.perf_counter() - t

    def _released(self, rid: str) -> None:
        """vLLM released ``rid``'s blocks outside a step: forget its block table."""
        self.sched.preempt(rid)
        self.running.discard(rid)
        self.known.pop(rid, None)
        self.loading.pop(rid, None)
        self.hit.pop(rid, None)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        t = time.perf_counter()
        rid = request.request_id
        try:
            if rid in self.running:
                # Second call after an asynchronous load: the new blocks arrive with the
                # scheduler output. After a failed load vLLM kept the valid prefix and
                # recomputes from the first invalid block: those blocks are written again.
                known = self.known.get(rid)
                if known is not None:
                    first = request.num_computed_tokens // self.block_size
                    for g, tb in enumerate(blocks.get_block_ids()):
                        self.written.extend(b for b in tb[first : known[g]] if b != 0)
                return
            tables = [list(ids) for ids in blocks.get_block_ids()]
            hit = self.hit.pop(rid, None)
            if hit is None:
                self.conservative = True
                hit = 0
            job = self.sched.allocate(rid, tables, hit, num_external_tokens)
            self.running.add(rid)
            self.known[rid] = [len(tb) for tb in tables]
            first = hit // self.block_size
            for tb in tables:
                self.written.extend(b for b in tb[first:] if b != 0)
            if num_external_tokens > 0:
                if job is None:
                    raise KvOffloadError(
                        f"{rid}: {num_external_tokens} tokens to load but no load job was created"
                    )
                self.loading[rid] = int(job)
                self.stats.data["loaded_tokens"] += num_external_tokens
        finally:
            self.t += time.perf_counter() - t

    def build_connector_meta(self, so: SchedulerOutput) -> KvOffloadMetadata:
        t = time.perf_counter()
        scheduled: list[tuple[str, int]] = []
        new_blocks: list[tuple[str, int, list[int]]] = []
        written = self.written
        nst = so.num_scheduled_tokens
        for nr in so.scheduled_new_reqs:
            rid = nr.req_id
            if rid not in self.running:
                continue
            known = self.known[rid]
            for g, ids in enumerate(nr.block_ids):
                if len(ids) > known[g]:
                    tail = list(ids[known[g] :])
                    new_blocks.append((rid, g, tail))
                    written.extend(tail)
                    known[g] = len(ids)
            scheduled.append((rid, nr.num_computed_tokens + nst.get(rid, 0)))
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        running = self.running
        reqs, sent = self.reqs, self.sent
        for i in [i for i, ids in enumerate(cached.new_block_ids) if ids]:
            rid = cached.req_ids[i]
            if rid not in running:
                continue
            known = self.known[rid]
            for g, ids in enumerate(cached.new_block_ids[i]):
                if rid in resumed:
                    if len(ids) <= known[g]:
                        continue
                    ids = ids[known[g] :]
                if ids:
                    tail = list(ids)
                    new_blocks.append((rid, g, tail))
                    written.extend(tail)
                    known[g] += len(tail)
        # Steady decode is the hot path: one pass over the scheduled requests, no tuples.
        ids = [rid for rid in cached.req_ids if rid in running]
        if len(ids) == len(cached.req_ids):
            computed = [c + nst[r] for r, c in zip(ids, cached.num_computed_tokens, strict=True)]
        else:
            computed = [
                c + nst[r]
                for r, c in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
                if r in running
            ]
        # Hashes matter once computed tokens cross a block boundary (a store may need them);
        # _sync_hashes then sends every hash vLLM made since the last sync.
        bs = self.block_size
        crossing = [r for r, c in zip(ids, computed, strict=True) if c % bs < nst[r]]
        for rid in [rid for rid, _ in scheduled] + crossing:
            req = reqs.get(rid)
            if req is not None and len(req.block_hashes) > sent.get(rid, 0):
                self._sync_hashes(rid, req)
        ids = [rid for rid, _ in scheduled] + ids
        computed = [c for _, c in scheduled] + computed
        preempted = [r for r in (so.preempted_req_ids or ()) if r in self.running]
        for rid in preempted:
            self.running.discard(rid)
        finished: list[str] = []
        aborted: list[str] = []
        for rid in so.finished_req_ids:
            req = self.reqs.pop(rid, None)
            if req is None:
                continue
            self._sync_hashes(rid, req)
            self.running.discard(rid)
            self.known.pop(rid, None)
            self.sent.pop(rid, None)
            self.hit.pop(rid, None)
            (aborted if req.status == RequestStatus.FINISHED_ABORTED else finished).append(rid)
        exact = self.exact_fence and not self.conservative
        plan = self.sched.schedule(
            StepInput(
                request_ids=ids,
                computed_tokens=computed,
                new_blocks=new_blocks,
                finished=finished,
                aborted=aborted,
                preempted=preempted,
                written=[b for b in written if b != 0] if exact else None,
            )
        )
        self.written = []
        self.conservative = False
        self.hit.clear()
        meta = KvOffloadMetadata(
            loads=[(j.job_id, j.request_id, j.transfers) for j in plan.loads],
            stores=[(j.job_id, j.transfers) for j in plan.stores],
            flush=list(plan.flush),
            cancelled=self.cancelled,
        )
        self.cancelled = []
        self.pending.update(j for j, _, _ in meta.loads)
        self.pending.update(j for j, _ in meta.stores)
        d = self.stats.data
        d["load_jobs"] += len(meta.loads)
        d["store_jobs"] += len(meta.stores)
        d["flushed_jobs"] += len(meta.flush)
        self.t += time.perf_counter() - t
        d["sched_seconds"] += self.t
        d["sched_steps"] += 1
        self.step_times.append(self.t)
        if len(self.step_times) > 100_000:
            del self.step_times[:50_000]
        self.t = 0.0
        return meta

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        t = time.perf_counter()
        meta = out.kv_connector_worker_meta
        if isinstance(meta, KvOffloadWorkerMetadata):
            d = self.stats.data
            d["bytes_loaded"] += meta.bytes_loaded
            d["bytes_stored"] += meta.bytes_stored
            d["load_seconds"] += meta.load_seconds
            d["store_seconds"] += meta.store_seconds
            for reports, ok in ((meta.done, True), (meta.failed, False)):
                for job, ranks in reports.items():
                    done = None
                    for rank in ranks:
                        try:
                            done = self.sched.complete(job, rank, ok) or done
                        except (UnknownJobError, DuplicateReportError) as e:
                            # A report vLLM delivered twice, or of a job this scheduler never
                            # made: nothing changes in the core; count it and go on.
                            logger.debug("kvoffload: ignoring a report: %s", e)
                            d["reports_ignored"] += 1
                    if done is None:
                        continue
                    self.pending.discard(done.job_id)
                    d["jobs_completed" if done.ok else "jobs_failed"] += 1
                    if done.kind == "load" and self.loading.get(done.request_id) == done.job_id:
                        del self.loading[done.request_id]
        self.t += time.perf_counter() - t

    def take_events(self) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        for kind, group, keys, _medium in self.sched.take_events():
            if kind == "stored":
                events.append(
                    BlockStored(
                        block_hashes=list(keys),
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=self.chunk_tokens,
                        lora_id=None,
                        medium="CPU",
                        lora_name=None,
                        group_idx=group,
                    )
                )
            else:
                events.append(BlockRemoved(block_hashes=list(keys), medium="CPU", group_idx=group))
        return events

    def get_stats(self) -> KvOffloadStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KvOffloadStats()
        return out

    def reset_cache(self) -> bool:
        if self.loading and not self.recompute:
            # A cancelled load is reported to vLLM as failed: under the "fail" policy that
            # would fail the request.
            logger.warning(
                "kvoffload: not resetting the CPU tier while %d load(s) are in flight "
                "(kv_load_failure_policy 'recompute' allows it)",
                len(self.loading),
            )
            return False
        res = self.sched.reset()  # the flushed jobs join the next plan's flush set
        # The workers still run the cancelled loads (they are in the flush set) but report
        # them as failed: vLLM frees those requests' blocks and asks for them again.
        self.cancelled.extend(job for _, job in res.cancelled_loads)
        for rid, _ in res.cancelled_loads:
            self.loading.pop(rid, None)
        self.pending.clear()
        return True


# ----------------------------------------------------------------------------- worker side


def _layout(t: torch.Tensor, num_blocks: int, name: str) -> str:
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks and num_blocks != 2:
        return "kv_first"
    if t.shape[0] == num_blocks:
        return "blocks_first"
    raise ConfigError(
        f"KvOffloadConnector: cannot tell the block dimension of layer {name}'s KV cache "
        f"(shape {tuple(t.shape)}, {num_blocks} blocks)"
    )


def _worker_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank among the engine's ``num_workers`` (TP x PP): reports carry it, so the
    scheduler completes a job only once every rank reported it. 0 before vLLM's parallel state
    exists (a single worker)."""
    from vllm.distributed import parallel_state as ps

    try:
        tp = ps.get_tensor_model_parallel_rank()
        pp = ps.get_pp_group().rank_in_group
    except (AssertionError, AttributeError):
        return 0
    return pp * int(vllm_config.parallel_config.tensor_parallel_size) + tp


class _WorkerSide:
    """Drives one :class:`TransferEngine` in vLLM's worker call order."""

    def __init__(self, cfg: OffloadConfig, kv_cache_config: KVCacheConfig, rank: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank  # reported with every job
        self.kv_cache_config = kv_cache_config
        self.xfer: TransferEngine | None = None
        self.load_req: dict[int, tuple[str, list[int]]] = {}
        self.before_done: KvOffloadMetadata | None = None
        self.meta = KvOffloadWorkerMetadata()
        self.invalid: set[int] = set()
        self.cancelled: set[int] = set()
        # vLLM refuses block-level load errors with several KV groups (block ids are per
        # group); failed_recving alone then reports the failed request.
        self.report_blocks = len(kv_cache_config.kv_cache_groups) == 1
        self.engine_kwargs: dict[str, Any] = {}  # tests: TransferEngine hooks (copy delays)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        nb = int(self.kv_cache_config.num_blocks)
        groups: list[dict[str, torch.Tensor]] = []
        layouts: list[str] = []
        for g, spec_group in enumerate(self.kv_cache_config.kv_cache_groups):
            layers = {n: kv_caches[n] for n in spec_group.layer_names}
            found = {_layout(t, nb, n) for n, t in layers.items()}
            if len(found) != 1:
                raise ConfigError(f"KvOffloadConnector: group {g} mixes KV layouts {found}")
            groups.append(layers)
            layouts.append(found.pop())
        self.xfer = TransferEngine(
            groups,
            blocks_per_chunk=self.cfg.blocks_per_chunk,
            num_slots=self.cfg.resolved_cpu_chunks(),
            layout=layouts,  # type: ignore[arg-type]
            **self.engine_kwargs,
        )
        logger.info(
            "kvoffload: %d KV group(s) registered on %s, CPU pool %.1f MiB (%d slots)",
            len(groups),
            self.xfer.device,
            self.xfer.pool_bytes / 2**20,
            self.xfer.num_slots,
        )

    def before_forward(self, meta: KvOffloadMetadata) -> None:
        """The data plane's step for this plan, once per plan: one :meth:`TransferEngine.step`
        submits the previous step's stores, completes the flush set (submitting a flushed
        store of this same plan first), submits the loads and queues this step's stores."""
        if self.before_done is meta:
            return
        self.before_done = meta
        x = self.xfer
        assert x is not None
        self.cancelled.update(j for j in meta.cancelled if j in self.load_req)
        for job, rid, transfers in meta.loads:
            self.load_req[job] = (rid, [b for _, gb, _ in transfers for b in gb])
        x.step(meta.stores, meta.flush, [(job, transfers) for job, _, transfers in meta.loads])

    def start_load(self, meta: KvOffloadMetadata) -> None:
        self.before_forward(meta)

    def wait_for_save(self, meta: KvOffloadMetadata) -> None:
        # The step queued this plan's stores (they start at the next step); a plan whose step
        # has not run yet (no forward pass this step) runs it now.
        self.before_forward(meta)

    def transfer_results(self) -> KVConnectorTransferResults:
        x = self.xfer
        out = KVConnectorTransferResults()
        if x is None:
            return out
        m = self.meta
        for r in x.poll():
            ok = r.ok and r.job_id not in self.cancelled
            self.cancelled.discard(r.job_id)
            (m.done if ok else m.failed)[r.job_id] = [self.rank]
            if r.kind == "load":
                m.bytes_loaded += r.bytes
                m.load_seconds += r.seconds
                rid, blocks = self.load_req.pop(r.job_id, ("", []))
                if rid:
                    out.finished_recving.add(rid)
                    if not ok:
                        out.failed_recving.add(rid)
                        if self.report_blocks:
                            self.invalid.update(blocks)
            else:
                m.bytes_stored += r.bytes
                m.store_seconds += r.seconds
            if not r.ok:
                logger.warning("kvoffload: %s job %d failed: %s", r.kind, r.job_id, r.error)
        return out

    def take_invalid(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out

    def take_meta(self) -> KvOffloadWorkerMetadata | None:
        m = self.meta
        if not m.done and not m.failed:
            return None
        self.meta = KvOffloadWorkerMetadata()
        return m

    def shutdown(self) -> None:
        if self.xfer is not None:
            self.xfer.shutdown(wait=False)
            self.xfer = None


# ----------------------------------------------------------------------------- the connector


class KvOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector backed by kvoffload (see the module docstring)."""

    _cache_hit_source = (
        CacheHitSource.HOST
        if hasattr(CacheHitSource, "HOST")
        else (CacheHitSource.EXTERNAL_UNSPECIFIED)
    )

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg, exact = build_offload_config(vllm_config, kv_cache_config)
        self.offload_config = cfg
        self.scheduler_side: _SchedulerSide | None = None
        self.worker_side: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            ktc = vllm_config.kv_transfer_config
            policy = getattr(ktc, "kv_load_failure_policy", "fail")
            self.scheduler_side = _SchedulerSide(cfg, exact, recompute=policy == "recompute")
        else:
            self.worker_side = _WorkerSide(cfg, kv_cache_config, _worker_rank(vllm_config))

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is a future miss."""
        return False

    # ------------------------------------------------------------------ worker side

    def _w(self) -> _WorkerSide:
        assert self.worker_side is not None, "worker-side call on the scheduler connector"
        return self.worker_side

    def _meta(self) -> KvOffloadMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvOffloadMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Registers the worker's KV tensors and allocates its CPU pool."""
        self._w().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: submit stores, complete the flush set."""
        assert isinstance(kv_connector_metadata, KvOffloadMetadata)
        self._w().before_forward(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Submits this step's loads (asynchronous)."""
        self._w().start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: vLLM waits for the request, not per layer."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Stores are per step, not per layer."""

    def wait_for_save(self) -> None:
        """Queues this step's stores; they start at the beginning of the next step."""
        self._w().wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads (and failed ones) by request; job ids go in the worker metadata."""
        return self._w().transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished loads by request id."""
        r = self._w().transfer_results()
        return None, r.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed loads (vLLM recomputes them)."""
        return self._w().take_invalid() if self.worker_side is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Job ids this worker finished since the last step."""
        return self.worker_side.take_meta() if self.worker_side is not None else None

    def shutdown(self) -> None:
        """Stops the data plane."""
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # ------------------------------------------------------------------ scheduler side

    def _s(self) -> _SchedulerSide:
        assert self.scheduler_side is not None, "scheduler-side call on a worker connector"
        return self.scheduler_side

    def on_new_request(self, request: Request) -> None:
        """Registers the request and its block hashes."""
        self._s().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable from the CPU tier; ``None``: ask again later."""
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Records the block table; creates the load job."""
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """One scheduler step: the plan for the workers."""
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Completes the jobs the workers reported."""
        self._s().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once: the fence protects pending stores."""
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once: the fence protects pending stores."""
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """CPU-tier stored / removed events."""
        return self._s().take_events() if self.scheduler_side is not None else ()

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while jobs are pending (stores start on the next step)."""
        return self.scheduler_side is not None and bool(self.scheduler_side.pending)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler-side counters of the last interval (worker bytes included)."""
        return self.scheduler_side.get_stats() if self.scheduler_side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Stats objects for vLLM's logger."""
        return KvOffloadStats(data=dict(data)) if data is not None else KvOffloadStats()

    def reset_cache(self) -> bool | None:
        """Empties the CPU tier. Loads in flight are reported to vLLM as failed (it
        recomputes them) under ``kv_load_failure_policy="recompute"``; under ``"fail"`` the
        reset is refused while loads are in flight."""
        return self._s().reset_cache() if self.scheduler_side is not None else None
