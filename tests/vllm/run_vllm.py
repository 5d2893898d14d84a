"""Runs a tiny Llama (random weights) in vLLM on the CPU and prints greedy outputs as JSON.

Used by ``test_e2e.py`` in a subprocess (vLLM wants its engine built under ``__main__``)::

    python tests/vllm/run_vllm.py --connector on|off [--async-scheduling] --out result.json

Scenarios, all in one engine with a GPU cache small enough to force evictions and preemptions:

* ``batch``: prompts of various lengths, some sharing prefixes, in one ``generate`` call;
* ``reload``: a long prompt, ``reset_prefix_cache()``, the same prompt again;
* ``chat``: multi-turn conversations, each turn's prompt is the last prompt, its answer and
  new user tokens, all conversations batched per turn.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK = 32


def _connector(llm):
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    return core.scheduler.get_kv_connector()


def _randomize(model) -> None:
    """Seeded random weights of a useful scale: outputs depend on the whole context."""
    import torch

    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                std = 1.0 / (p.shape[-1] ** 0.5) if p.dim() > 1 else 0.02
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std * 2.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connector", choices=("on", "off"), required=True)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu-blocks", type=int, default=40)
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm.config import KVTransferConfig

    from vllm import LLM, SamplingParams

    kw: dict = {}
    if args.connector == "on":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvOffloadConnector",
            kv_connector_module_path="kvoffload.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes": 64 << 20, "blocks_per_chunk": 1},
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=str(HERE / "tiny-llama"),
        tokenizer=None,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        num_gpu_blocks_override=args.gpu_blocks,
        enable_prefix_caching=True,
        async_scheduling=args.async_scheduling,
        disable_log_stats=False,
        seed=0,
        **kw,
    )
    llm.apply_model(_randomize)
    t_init = time.perf_counter() - t0
    rng = random.Random(7)

    def tok(n: int) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(n)]

    def gen(prompts: list[list[int]], max_tokens: int = 12):
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]

    result: dict = {"init_seconds": t_init}
    t1 = time.perf_counter()

    # batch: shared prefixes and independent prompts.
    shared = tok(200)
    batch = [shared + tok(40), tok(120), shared + tok(90), tok(33), shared[:100] + tok(60)]
    result["batch"], _ = gen(batch)

    # reload: a long prompt, served from the CPU tier after the GPU prefix cache is reset.
    long = tok(700)
    first, _ = gen([long])
    llm.reset_prefix_cache()
    second, cached = gen([long])
    result["reload"] = {"first": first[0], "second": second[0], "cached_tokens": cached[0]}

    # chat: multi-turn conversations batched per turn, GPU cache too small for all.
    convs = [tok(rng.randrange(80, 260)) for _ in range(8)]
    chat: list[list[list[int]]] = [[] for _ in convs]
    for _turn in range(3):
        outs, _ = gen(convs, max_tokens=48)
        for i, o in enumerate(outs):
            chat[i].append(o)
            convs[i] = convs[i] + o + tok(rng.randrange(20, 90))
    result["chat"] = chat
    result["workload_seconds"] = time.perf_counter() - t1

    if args.connector == "on":
        conn = _connector(llm)
        s = conn.scheduler_side
        steps = s.step_times
        result["connector"] = {
            "steps": len(steps),
            "sched_us_mean": 1e6 * sum(steps) / max(1, len(steps)),
            "sched_us_max": 1e6 * max(steps, default=0.0),
            "core_stats": {k: v for k, v in s.sched.stats().items() if isinstance(v, int)},
        }
    try:
        result["kv_stats"] = {}
        for m in llm.get_metrics():
            if "prefix_cache" in m.name or "preempt" in m.name:
                result["kv_stats"][m.name] = getattr(m, "value", None)
    except Exception as e:
        result["kv_stats_error"] = repr(e)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
