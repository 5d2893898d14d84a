"""The workload and the engine of ``benches/vllm_workload.py``: the seeded multi-turn
chat generator (:class:`Workload`, :class:`Conversations`) and vLLM 0.32's real ``Scheduler``
built with either connector (:func:`build_scheduler`). See that file's docstring.
"""

from __future__ import annotations

import array
import os
import random
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BS = 16
MODEL_DIR = Path(__file__).resolve().parent.parent / "tests" / "vllm"


# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """The closed-loop multi-turn chat workload (defaults) and its engine."""

    b: int = 64
    attention: str = "full"  # "full" or "hybrid"
    steps: int = 400  # the whole run, warmup included
    warmup: int = 100  # untimed first steps (the summary leaves them out)
    seed: int = 0
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (512, 1536)
    first_prompt_tokens: tuple[int, int] = (2048, 5632)
    max_prompt_tokens: int = 8192
    answer_tokens: tuple[int, int] = (64, 256)
    user_tokens: tuple[int, int] = (32, 512)
    max_turns: int = 8
    idle_steps: tuple[int, int] = (10, 100)
    clock: str = "cpu"  # "cpu": this thread's CPU time; "wall": wall time
    conversations_per_slot: int = 2
    gpu_tokens_per_seq: int = 6144
    cpu_factor: float = 2.0
    window: int = 1024
    max_num_batched_tokens: int = 8192
    prompt_only: bool = False
    vocab: int = 2048

    @property
    def num_gpu_blocks(self) -> int:
        return max(64, self.b * self.gpu_tokens_per_seq // BS) + 1  # + vLLM's null block

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_tokens + self.answer_tokens[1] + BS


@dataclass
class Turn:
    user: array.array  # new prompt tokens of this turn (the first turn: system prompt + user)
    answer: array.array
    gap: int  # idle steps after this turn


@dataclass
class Conversation:
    cid: int
    turns: list[Turn]


class Conversations:
    """Conversation ``k``'s content depends on (seed, k) only, never on timing."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        rng = random.Random(f"{w.seed}:system")
        self.system = [self._tokens(rng, rng.randint(*w.system_tokens)) for _ in range(4)][
            : w.system_prompts
        ]
        self.cache: dict[int, Conversation] = {}

    def _tokens(self, rng: random.Random, n: int) -> array.array:
        return array.array("H", rng.choices(range(3, self.w.vocab), k=n))

    def get(self, k: int) -> Conversation:
        c = self.cache.get(k)
        if c is not None:
            return c
        w = self.w
        rng = random.Random(f"{w.seed}:conv:{k}")
        system = self.system[rng.randrange(len(self.system))]
        first = rng.randint(*w.first_prompt_tokens)
        user = system + self._tokens(rng, max(1, first - len(system)))
        turns: list[Turn] = []
        length = len(user)
        while True:
            answer = self._tokens(rng, rng.randint(*w.answer_tokens))
            turns.append(Turn(user, answer, rng.randint(*w.idle_steps)))
            length += len(answer)
            if len(turns) >= w.max_turns:
                break
            user = self._tokens(rng, rng.randint(*w.user_tokens))
            if length + len(user) > w.max_prompt_tokens:
                break
            length += len(user)
        c = Conversation(k, turns)
        self.cache[k] = c
        return c


# ----------------------------------------------------------------------------- engine


def _import_vllm() -> Any:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        import vllm.config as vc
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        from vllm import SamplingParams

    return types.SimpleNamespace(
        torch=torch,
        vc=vc,
        sha256=sha256,
        get_request_block_hasher=get_request_block_hasher,
        init_none_hash=init_none_hash,
        Scheduler=Scheduler,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        SlidingWindowSpec=SlidingWindowSpec,
        KVConnectorOutput=KVConnectorOutput,
        ModelRunnerOutput=ModelRunnerOutput,
        Request=Request,
        StructuredOutputManager=StructuredOutputManager,
        SamplingParams=SamplingParams,
    )


def build_scheduler(
    w: Workload, connector: str, module: str = "kvoffload.integrations.vllm"
) -> tuple[Any, Any]:
    """vLLM's real Scheduler with ``connector`` ("vllm" or "ours", whose adapter ``module``
    holds), and the block hasher."""
    v = _import_vllm()
    hybrid = w.attention == "hybrid"
    model = v.vc.ModelConfig(
        model=str(MODEL_DIR / ("tiny-llama-sw" if hybrid else "tiny-llama")),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=w.max_model_len,
        hf_overrides={
            "max_position_embeddings": w.max_model_len,
            **({"sliding_window": w.window} if hybrid else {}),
        },
    )
    sched = v.vc.SchedulerConfig(
        max_num_seqs=w.b,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = v.vc.CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=True)
    num_blocks = w.num_gpu_blocks
    cache.num_gpu_blocks = num_blocks
    # 2 layers per group, 1 KV head of 32 float32: a 4 KiB page (page-aligned, so vLLM's CPU
    # backend pads nothing).
    kw = {"block_size": BS, "num_kv_heads": 1, "head_size": 32, "dtype": v.torch.float32}
    full = v.FullAttentionSpec(**kw)
    groups = [v.KVCacheGroupSpec(["layer1", "layer3"] if hybrid else ["layer0", "layer1"], full)]
    if hybrid:
        sw = v.SlidingWindowSpec(**kw, sliding_window=w.window)
        groups.insert(0, v.KVCacheGroupSpec(["layer0", "layer2"], sw))
    # GPU pool bytes: one block id holds a page in every layer of one group.
    gpu_bytes = num_blocks * full.page_size_bytes * 2
    cpu_bytes = int(w.cpu_factor * gpu_bytes)
    if connector == "vllm":
        ktc = v.vc.KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": cpu_bytes,
                "offload_prompt_only": w.prompt_only,
            },
        )
    elif connector == "ours":
        ktc = v.vc.KVTransferConfig(
            kv_connector="KvOffloadConnector",
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes": cpu_bytes,
                "offload_prompt_only": w.prompt_only,
            },
        )
    else:
        raise ValueError(f"unknown connector {connector!r}")
    config = v.vc.VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=ktc,
        device_config=v.vc.DeviceConfig("cpu"),
    )
    kcc = v.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    v.init_none_hash(v.sha256)
    hasher = v.get_request_block_hasher(BS, v.sha256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = v.Scheduler(
            vllm_config=config,
            kv_cache_config=kcc,
            structured_output_manager=v.StructuredOutputManager(config),
            block_size=BS,
            log_stats=True,
        )
    return s, hasher
