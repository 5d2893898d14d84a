"""``kv_connector_extra_config`` and the engine's KV layout -> :class:`OffloadConfig`.

The extra config's keys are :class:`OffloadConfig`'s options plus the connector's own
(``exact_fence``, ``metrics_interval_ms``: :func:`connector_options`); the former go to it as
given, and it validates them (with the core, one validator:
:class:`~kvoffload.errors.ConfigError` naming the field and the value). Unknown keys
raise ``ConfigError`` naming them; so do engine features the connector refuses (other KV-cache
kinds, speculative decoding, HiSparse, mixed block sizes, a role other than ``kv_both``).
``disk_model`` and ``remote_model`` default to the engine's model and dtype.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

from kvoffload.errors import ConfigError
from kvoffload.scheduler import KvGroup, OffloadConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["build_offload_config", "connector_options"]

# The OffloadConfig options the extra config may set: all but what the engine's own
# configuration fixes (and a debug switch); OffloadConfig and the core validate their values
# (one validator, one error style). ``exact_fence`` is the connector's own.
_FROM_ENGINE = (
    "groups",
    "num_gpu_blocks",
    "hash_block_size",
    "num_workers",
    "null_block",
    "debug_skip_deferred_arming",
)
_OPTIONS = tuple(f.name for f in dataclasses.fields(OffloadConfig) if f.name not in _FROM_ENGINE)


def _parse_extra(extra: dict[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config`` as OffloadConfig keyword arguments; unknown keys raise
    :class:`ConfigError` naming them (values are OffloadConfig's to check)."""
    unknown = sorted(k for k in extra if k not in _OPTIONS)
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown} for KvOffloadConnector; "
            f"valid keys: {sorted((*_OPTIONS, *_CONNECTOR_OPTIONS))}"
        )
    return {k: v for k, v in extra.items() if v is not None}


_CONNECTOR_OPTIONS = ("exact_fence", "metrics_interval_ms")
"""The connector's own extra-config keys (not OffloadConfig's)."""


def connector_options(extra: dict[str, Any]) -> tuple[bool, float]:
    """The connector's own options in ``kv_connector_extra_config``: ``exact_fence`` (default
    ``True``) and ``metrics_interval_ms``, the longest time between two stats intervals handed
    to vLLM, each with a snapshot of the core for Prometheus (default 1000; 0: one every step).

    Raises:
        ConfigError: A value of the wrong type or range, naming the option.
    """
    exact = extra.get("exact_fence", True)
    if not isinstance(exact, bool):
        raise ConfigError(
            f"invalid configuration: exact_fence must be a bool, got {exact!r} "
            f"({type(exact).__name__})"
        )
    interval = extra.get("metrics_interval_ms", 1000)
    if (
        isinstance(interval, bool)
        or not isinstance(interval, (int, float))
        or not 0 <= interval <= 3_600_000
    ):
        raise ConfigError(
            f"invalid configuration: metrics_interval_ms must be a number of milliseconds in "
            f"0..3600000, got {interval!r} ({type(interval).__name__})"
        )
    return exact, float(interval)


def model_name(vllm_config: VllmConfig) -> str:
    """The default ``disk_model`` / ``remote_model``: the engine's model and dtype (lower tiers
    key chunks by it, so another model or dtype never reads them)."""
    mc = vllm_config.model_config
    return f"{mc.model}:{str(mc.dtype).removeprefix('torch.')}"


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
    exact, _ = connector_options(extra)
    for k in _CONNECTOR_OPTIONS:
        extra.pop(k, None)
    kwargs = _parse_extra(extra)
    if "disk_path" in kwargs:
        kwargs.setdefault("disk_model", model_name(vllm_config))
    if "remote_url" in kwargs:
        kwargs.setdefault("remote_model", model_name(vllm_config))
    if vllm_config.speculative_config is not None:
        raise ConfigError("KvOffloadConnector does not support speculative decoding yet")
    hisparse = getattr(kv_cache_config, "hisparse_host_num_blocks", None)
    if hisparse is not None:
        # vLLM 0.33 defers a load's allocation past the step that looked it up when HiSparse
        # keeps a host pool (Scheduler.defer_async_loads): the lookup's local hit would no
        # longer be known when the load is planned.
        raise ConfigError(
            f"KvOffloadConnector does not support HiSparse (hisparse_host_num_blocks="
            f"{hisparse}): vLLM defers its loads past the step that planned them"
        )
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
    cfg.resolved_cpu_chunks()  # the core validates every value now (io_cpus too), naming the field
    return cfg, exact
