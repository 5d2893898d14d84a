"""``kv_connector_extra_config`` and the engine's KV layout -> :class:`OffloadConfig`.

Unknown keys and bad values raise :class:`~kvoffload.errors.ConfigError` naming the key and the
value; so do engine features the connector refuses (other KV-cache kinds, speculative decoding,
mixed block sizes, a role other than ``kv_both``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

from kvoffload.errors import ConfigError
from kvoffload.scheduler import KvGroup, OffloadConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["build_offload_config"]

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
