"""vLLM v1 KV connector: offload KV-cache blocks to CPU memory with kvoffload.

Switch it on with configuration alone::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvOffloadConnector",
        "kv_connector_module_path": "kvoffload.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": 8000000000, "blocks_per_chunk": 1}}'

Tested with vLLM ``>=0.32.0,<0.34`` (:data:`SUPPORTED_VLLM`); importing this module under any
other version raises ``ImportError`` naming that range and the installed version. Works on CUDA
and on vLLM's CPU backend (the KV cache in CPU memory).

**Extra config** (``kv_connector_extra_config``; unknown keys and bad values raise
:class:`~kvoffload.errors.ConfigError`, the values checked by ``OffloadConfig`` and the core):
``cpu_bytes`` (CPU memory per worker, bytes) or ``cpu_chunks`` (slots per KV group),
``blocks_per_chunk``, ``policy`` (``"lru"``/``"arc"``), ``max_loading_requests``,
``offload_prompt_only``, ``max_offload_tokens``, ``store_threshold``; a lower tier below the
CPU pool: ``disk_path`` and ``disk_bytes`` (per group and worker) for a persistent disk tier
(``disk_deadline_ms``: a promotion later than that expires and its requests recompute;
``disk_probation_after`` failed or expired jobs in a row put it on probation for
``disk_probation_ms``; ``disk_write_mbps``: the most MB/s written behind to it;
``tier_write_share``: the most of each group's CPU slots that
write-behind to a lower tier pins),
or ``remote_url`` (``redis://host:port``), ``cache_salt`` and ``remote_deadline_ms`` for a
shared Redis tier, with ``disk_model`` / ``remote_model`` naming the weights in the tier's
namespace (default: the engine's model and dtype) -- the
:class:`~kvoffload.scheduler.OffloadConfig` options -- and ``exact_fence`` (default ``True``;
``False`` passes ``written=None``, the conservative fence) and ``metrics_interval_ms`` (default
1000: the longest time between two stats intervals handed to vLLM, each with a snapshot of the
core for Prometheus).

**Layout.** :mod:`~kvoffload.integrations.vllm.config` (extra config and KV layout),
:mod:`~kvoffload.integrations.vllm.scheduler_side` (one Rust core per engine),
:mod:`~kvoffload.integrations.vllm.worker_side` (one :class:`~kvoffload.transfer.TransferEngine`
per worker), :mod:`~kvoffload.integrations.vllm.messages` (plans, reports, stats),
:mod:`~kvoffload.integrations.vllm.metrics` (the Prometheus metrics) and
:mod:`~kvoffload.integrations.vllm.connector` (vLLM's interface, dispatching to the two sides).

**Supported models.** Full-attention and sliding-window KV groups (hybrid models through
vLLM's hybrid allocator, the connector is ``SupportsHMA``) with one block size; tensor and
pipeline parallel workers (each registers its shard; ``cpu_bytes`` is per worker). Other
KV-cache kinds (Mamba, cross-attention, ...), speculative decoding and mixed block sizes are
refused with a ``ConfigError`` at startup.

**Metrics and events.** ``get_kv_connector_stats`` returns :class:`KvOffloadStats` (loaded and
stored tokens, bytes, jobs, flushes, scheduler-side seconds and steps; with a lower tier its
hits, writes, promotions, failures and bytes as ``disk_*`` / ``remote_*``), which vLLM
aggregates and logs like any connector's; stored / removed events are returned by
``take_events`` as vLLM ``BlockStored`` / ``BlockRemoved`` events with medium ``"CPU"``,
``"DISK"`` or ``"REMOTE"``. ``build_prom_metrics`` puts them on vLLM's ``/metrics`` as
Prometheus metrics (:mod:`~kvoffload.integrations.vllm.metrics`, ``docs/metrics.md``), with the
core's gauges and cumulative counters sampled at most once a second and when the engine falls
quiet.
"""

# The version check runs first: it raises ImportError naming the supported range.
from kvoffload.integrations.vllm._version import SUPPORTED_VLLM, VLLM_VERSION
from kvoffload.integrations.vllm.config import build_offload_config
from kvoffload.integrations.vllm.connector import KvOffloadConnector
from kvoffload.integrations.vllm.messages import (
    KvOffloadMetadata,
    KvOffloadStats,
    KvOffloadWorkerMetadata,
)

__all__ = [
    "SUPPORTED_VLLM",
    "VLLM_VERSION",
    "KvOffloadConnector",
    "KvOffloadMetadata",
    "KvOffloadStats",
    "KvOffloadWorkerMetadata",
    "build_offload_config",
]
