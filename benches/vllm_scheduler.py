"""Scheduler-side cost of the kvoffload vLLM connector, inside vLLM's real scheduler.

Run with the vLLM virtualenv (``make test-vllm`` builds it)::

    .venv-vllm/bin/python benches/vllm_scheduler.py [--requests 64 256 512] [--steps 100]

vLLM's ``Scheduler`` runs with fake model outputs (one sampled token per request per step) and
a fake worker that reports every job of a plan done in the next step, so only scheduler-side
work is timed. Each request has a 512-token prompt (a shared 256-token system prompt plus its
own part) and keeps decoding. After every request reached decode, ``--steps`` steady decode
steps are timed: the connector's own time per step (``get_num_new_matched_tokens`` through
``build_connector_meta`` and ``update_connector_output``), and vLLM's whole ``schedule`` +
``update_from_output`` with and without the connector. The numbers are per step, in
microseconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.integrations.vllm import KvOffloadMetadata, KvOffloadWorkerMetadata

MODEL = str(Path(__file__).resolve().parent.parent / "tests" / "vllm" / "tiny-llama")
BS = 16


def build(n: int, connector: bool) -> Scheduler:
    model = ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype="float32", seed=0)
    sched = SchedulerConfig(
        max_num_seqs=n,
        max_num_batched_tokens=max(8192, n),
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=True)
    num_blocks = n * 64 + 1024
    cache.num_gpu_blocks = num_blocks
    ktc = (
        KVTransferConfig(
            kv_connector="KvOffloadConnector",
            kv_connector_module_path="kvoffload.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_chunks": 1 << 20},
        )
        if connector
        else None
    )
    vc = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32)
    kcc = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer0", "layer1"], spec)],
    )
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BS,
        log_stats=False,
    )


def run(n: int, steps: int, connector: bool) -> dict[str, float]:
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    s = build(n, connector)
    rng = random.Random(n)
    system = [rng.randrange(1, 30_000) for _ in range(256)]
    reqs: dict[str, Request] = {}
    for i in range(n):
        rid = f"r{i}"
        prompt = system + [rng.randrange(1, 30_000) for _ in range(256)]
        req = Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=100_000, ignore_eos=True),
            pooling_params=None,
            block_hasher=hasher,
        )
        reqs[rid] = req
        s.add_request(req)
    conn: Any = s.get_kv_connector() if connector else None
    prev_jobs: list[int] = []
    prev_loads: set[str] = set()
    timed: list[float] = []
    conn_times: list[float] = []
    decode_steps = 0
    while decode_steps < steps:
        t0 = time.perf_counter()
        so = s.schedule()
        t1 = time.perf_counter()
        meta = so.kv_connector_metadata
        kv_out = None
        if connector:
            assert isinstance(meta, KvOffloadMetadata)
            kv_out = KVConnectorOutput(
                finished_recving=prev_loads,
                kv_connector_worker_meta=KvOffloadWorkerMetadata(done={0: prev_jobs}),
            )
            prev_jobs = [j for j, _ in meta.load_requests()] + meta.store_ids()
            prev_loads = {rid for _, rid in meta.load_requests()}
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = reqs[rid]
            done = so.num_scheduled_tokens[rid] + r.num_computed_tokens
            sampled.append([1 + len(r.all_token_ids) % 500] if done >= r.num_tokens else [])
        out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        t2 = time.perf_counter()
        s.update_from_output(so, out)
        t3 = time.perf_counter()
        all_decoding = len(ids) == n and all(
            reqs[r].num_computed_tokens >= reqs[r].num_prompt_tokens for r in ids
        )
        if all_decoding:
            decode_steps += 1
            timed.append((t1 - t0) + (t3 - t2))
            if connector:
                conn_times.append(conn.scheduler_side.step_times[-1])
    return {
        "vllm_us": 1e6 * statistics.median(timed),
        "conn_us": 1e6 * statistics.median(conn_times) if conn_times else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    print(f"{'running':>8} {'vLLM off (us)':>14} {'vLLM on (us)':>13} {'connector (us)':>15}")
    for n in args.requests:
        off = run(n, args.steps, connector=False)
        on = run(n, args.steps, connector=True)
        print(f"{n:>8} {off['vllm_us']:>14.0f} {on['vllm_us']:>13.0f} {on['conn_us']:>15.1f}")


if __name__ == "__main__":
    main()
