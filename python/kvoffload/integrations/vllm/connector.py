"""``KvOffloadConnector``: vLLM's connector interface, each call handed to the scheduler side
(:mod:`~kvoffload.integrations.vllm.scheduler_side`) or the worker side
(:mod:`~kvoffload.integrations.vllm.worker_side`) of the role vLLM built it for."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm.config import build_offload_config, connector_options
from kvoffload.integrations.vllm.messages import KvOffloadMetadata, KvOffloadStats
from kvoffload.integrations.vllm.metrics import KvOffloadPromMetrics
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
from kvoffload.integrations.vllm.worker_side import WorkerSide, worker_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvOffloadConnector"]


class KvOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector backed by kvoffload (see the package docstring)."""

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
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            ktc = vllm_config.kv_transfer_config
            policy = getattr(ktc, "kv_load_failure_policy", "fail")
            _, interval_ms = connector_options(
                dict(getattr(ktc, "kv_connector_extra_config", None) or {})
            )
            events = vllm_config.kv_events_config
            self.scheduler_side = SchedulerSide(
                cfg,
                exact,
                recompute=policy == "recompute",
                kv_events=events is not None and bool(events.enable_kv_cache_events),
                metrics_interval_ms=interval_ms,
            )
            # vLLM makes about 21 of these calls a step: each is bound straight to the
            # scheduler side's method (an instance attribute shadows the class's method, kept
            # below for its documentation), so a call runs one Python frame, not three.
            s = self.scheduler_side
            for name, target in (
                ("on_new_request", s.on_new_request),
                ("get_num_new_matched_tokens", s.get_num_new_matched_tokens),
                ("update_state_after_alloc", s.update_state_after_alloc),
                ("build_connector_meta", s.build_connector_meta),
                ("update_connector_output", s.update_connector_output),
                ("request_finished", s.request_finished),
                ("request_finished_all_groups", s.request_finished),
                ("take_events", s.take_events),
                ("has_pending_push_work", s.has_pending),
                ("get_kv_connector_stats", s.get_stats),
            ):
                setattr(self, name, target)
        else:
            self.worker_side = WorkerSide(cfg, kv_cache_config, worker_rank(vllm_config))

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is a future miss."""
        return False

    # ------------------------------------------------------------------ worker side

    def _w(self) -> WorkerSide:
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

    def _s(self) -> SchedulerSide:
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
        return self._s().request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once: the fence protects pending stores."""
        return self._s().request_finished(request)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """CPU-tier stored / removed events."""
        return self._s().take_events() if self.scheduler_side is not None else ()

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while jobs are pending (stores start on the next step)."""
        return self.scheduler_side is not None and self.scheduler_side.has_pending()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler-side counters of the last interval (worker bytes included)."""
        return self.scheduler_side.get_stats() if self.scheduler_side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Stats objects for vLLM's logger."""
        return KvOffloadStats(data=dict(data)) if data is not None else KvOffloadStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """The connector's Prometheus metrics on vLLM's ``/metrics``
        (:mod:`~kvoffload.integrations.vllm.metrics`)."""
        return KvOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool | None:
        """Empties the CPU tier. Loads in flight are reported to vLLM as failed (it
        recomputes them) under ``kv_load_failure_policy="recompute"``; under ``"fail"`` the
        reset is refused while loads are in flight."""
        return self._s().reset_cache() if self.scheduler_side is not None else None
