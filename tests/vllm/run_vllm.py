"""Runs a tiny Llama (random weights) in vLLM on the CPU and prints greedy outputs as JSON.

One engine per run (vLLM wants its engine built under ``__main__``)::

    python tests/vllm/run_vllm.py --connector on|off [--async-scheduling] --out result.json \
        [--model tiny-llama|tiny-llama-sw|tiny-llama-bench] [--workload mixed|bench] \
        [--fail-loads N]

or many runs from one process, one after another (what ``test_e2e.py`` and ``test_e2e_tiers.py``
use)::

    python tests/vllm/run_vllm.py --runs runs.json

``runs.json`` maps each run's name to its arguments as above (``--out`` included). The process
imports vLLM once (half of a run's start-up), then forks one child per run, before any engine
exists: the child builds its engine, runs its workload, writes its JSON and its log (``--out``
with ``.log``) and exits; the next child starts when it has exited (so a restart run sees its
writer's directory complete and unlocked). The exit status is 1 if any child failed. One child
at a time: vLLM's CPU backend binds its OpenMP threads to every core, and two engines side by
side each ran almost four times slower than alone on two cores.

``--fail-loads N`` (connector on) fails the first, third, ... load job on the worker, N in all,
through the ``TransferEngine``'s ``_fault_injector`` hook, under
``kv_load_failure_policy="recompute"``.

Workload ``mixed``, all in one engine with a GPU cache small enough to force evictions and
preemptions:

* ``batch``: prompts of various lengths, some sharing prefixes, in one ``generate`` call;
* ``reload``: a long prompt, ``reset_prefix_cache()``, the same prompt again;
* ``chat``: multi-turn conversations, each turn's prompt is the last prompt, its answer and
  new user tokens, all conversations batched per turn.

Workload ``tiers`` (connector on, with ``--disk DIR`` or ``--remote URL [--cache-salt S]``):
``--docs`` distinct prompts of ``--doc-tokens`` tokens, one request at a time with one output
token (the time to the first token, and vLLM's ``num_cached_tokens``: what was not prefilled),
then all of them batched for 12 greedy tokens, then the engine steps until the connector has
no pending job (the write-behind to the lower tier is complete when the process exits). A
second engine on the same directory or server serves the prompts from the lower tier.

Workload ``bench``: long documents (``--doc-tokens``) computed once, ``reset_prefix_cache()``,
then each document plus a new question, one request at a time: time to first token and total
time per request (the connector serves the documents from the CPU tier; without it vLLM
recomputes them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import traceback
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


def _inject_load_faults(count: int, failed: list[int]) -> None:
    """Fails the 1st, 3rd, ... load job submitted on the worker, ``count`` in all."""
    from kvoffload.integrations.vllm.worker_side import WorkerSide

    loads: list[int] = []
    init, before = WorkerSide.__init__, WorkerSide.before_forward

    def fault(job: int) -> None:
        if job in loads and loads.index(job) % 2 == 0 and len(failed) < count:
            failed.append(job)
            raise RuntimeError(f"injected failure of load job {job}")

    def patched_init(self, *a, **k) -> None:  # type: ignore[no-untyped-def]
        init(self, *a, **k)
        self.engine_kwargs = {"_fault_injector": fault}

    def patched_before(self, meta) -> None:  # type: ignore[no-untyped-def]
        # Recorded before submission (the plan's worker step submits the loads): the injector
        # runs on the copy thread.
        loads.extend(j for j, _ in meta.load_requests() if j not in loads)
        before(self, meta)

    WorkerSide.__init__ = patched_init  # type: ignore[method-assign]
    WorkerSide.before_forward = patched_before  # type: ignore[method-assign]


def _mixed(llm, rng, tok, gen, result: dict) -> None:  # type: ignore[no-untyped-def]
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


def _bench(llm, args, tok, gen, result: dict) -> None:  # type: ignore[no-untyped-def]
    """Documents computed once, the prefix cache reset, then re-read one request at a time."""
    docs = [tok(args.doc_tokens) for _ in range(args.docs)]
    t = time.perf_counter()
    gen(docs, max_tokens=1)
    result["bench_first_pass_seconds"] = time.perf_counter() - t
    # The connector's stores complete in the engine steps of the first pass; a reset now
    # empties vLLM's prefix cache only.
    llm.reset_prefix_cache()
    outputs, ttft, total, cached = [], [], [], []
    t = time.perf_counter()
    for d in docs:
        prompt = d + tok(32)
        # Time to first token: a one-token request (prefill, or a load and the question).
        t_req = time.perf_counter()
        first, _ = gen([prompt], max_tokens=1)
        ttft.append(time.perf_counter() - t_req)
        llm.reset_prefix_cache()
        t_req = time.perf_counter()
        outs, hit = gen([prompt], max_tokens=16)
        total.append(time.perf_counter() - t_req)
        outputs.append(outs[0])
        assert first[0] == outs[0][:1]
        cached.append(hit[0])
        llm.reset_prefix_cache()
    result["bench"] = {
        "docs": args.docs,
        "doc_tokens": args.doc_tokens,
        "outputs": outputs,
        "cached_tokens": cached,
        "ttft_seconds": ttft,
        "total_seconds": total,
        "second_pass_seconds": time.perf_counter() - t,
    }


def _tiers(llm, tok, gen, result: dict) -> None:  # type: ignore[no-untyped-def]
    """The prompts one at a time (time to first token, cached tokens), then batched."""
    args = result["args"]
    rng = random.Random(11)  # the same prompts in every engine
    docs = [[rng.randrange(3, 2000) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    ttft, cached, first = [], [], []
    for d in docs:
        t = time.perf_counter()
        out, hit = gen([d], max_tokens=1)
        ttft.append(time.perf_counter() - t)
        first.append(out[0])
        cached.append(hit[0])
    outputs, _ = gen(docs, max_tokens=12)
    conn = _connector(llm)
    steps = 0
    while conn.has_pending_push_work() and steps < 500:  # finish the write-behind
        gen([tok(4)], max_tokens=1)
        steps += 1
    s = conn.scheduler_side
    result["tiers"] = {
        "prompt_tokens": [len(d) for d in docs],
        "cached_tokens": cached,
        "prefill_tokens": sum(len(d) for d in docs) - sum(cached),
        "ttft_seconds": ttft,
        "first_tokens": first,
        "outputs": outputs,
        "drain_steps": steps,
        "pending_after_drain": len(s.sched.pending_jobs()),
        "tier_stats": s.sched.tier_stats(),
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connector", choices=("on", "off"), required=True)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--workload", choices=("mixed", "bench", "tiers"), default="mixed")
    ap.add_argument("--disk", default=None)
    ap.add_argument("--remote", default=None)
    ap.add_argument("--cache-salt", default="")
    ap.add_argument("--gpu-blocks", type=int, default=40)
    ap.add_argument("--fail-loads", type=int, default=0)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    return ap


def _import_vllm() -> None:
    """vLLM's imports (most of a run's start-up), its environment set first."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # OpenMP threads that wait sleep instead of spinning (read when torch loads libgomp): on a
    # shared 2-core machine spinning threads starved the connector's copy threads and the other
    # processes, and runs took 2-4 times longer. Outputs do not depend on it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import vllm.config  # noqa: F401  (imported for its cost, before any fork)


def run(args: argparse.Namespace) -> None:
    """One engine, one workload: writes the result to ``args.out``."""
    bench = args.workload == "bench"
    failed: list[int] = []
    if args.fail_loads:
        _inject_load_faults(args.fail_loads, failed)

    _import_vllm()
    from vllm.config import KVTransferConfig

    from vllm import LLM, SamplingParams

    kw: dict = {}
    if args.connector == "on":
        extra: dict = {"cpu_bytes": (256 if bench else 64) << 20, "blocks_per_chunk": 1}
        if args.disk:
            extra.update(disk_path=args.disk, disk_bytes=64 << 20)
        if args.remote:
            extra.update(remote_url=args.remote, cache_salt=args.cache_salt)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvOffloadConnector",
            kv_connector_module_path="kvoffload.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute" if args.fail_loads else "fail",
        )
    max_len = args.doc_tokens + 256 if bench else 1024
    t0 = time.perf_counter()
    llm = LLM(
        model=str(HERE / args.model),
        tokenizer=None,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=max_len,
        max_num_seqs=8,
        max_num_batched_tokens=max_len if bench else 1024,
        num_gpu_blocks_override=None if bench else args.gpu_blocks,
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

    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    result: dict = {
        "init_seconds": t_init,
        "model": args.model,
        "kv_groups": [
            type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups
        ],
    }
    t1 = time.perf_counter()
    if bench:
        _bench(llm, args, tok, gen, result)
    elif args.workload == "tiers":
        result["args"] = args
        _tiers(llm, tok, gen, result)
        del result["args"]
    else:
        _mixed(llm, rng, tok, gen, result)
    result["workload_seconds"] = time.perf_counter() - t1
    result["failed_load_jobs"] = failed

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


def _child(argv: list[str]) -> int:
    """A forked child: runs one engine with its output in ``--out`` + ``.log``; its exit code."""
    t = time.perf_counter()
    args = _parser().parse_args(argv)
    log = os.open(args.out + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        run(args)
        # The engine's objects finalized as at an interpreter's exit (a lower tier closes).
        gc.collect()
        # Wall time of this run (start-up after the shared imports included).
        out = Path(args.out)
        res = json.loads(out.read_text())
        res["wall_seconds"] = time.perf_counter() - t
        out.write_text(json.dumps(res))
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def run_all(runs: dict[str, list[str]]) -> int:
    """Each run in a forked child, one after another; 1 if any failed."""
    _import_vllm()
    failed = 0
    for name, argv in runs.items():
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child leaves through os._exit, never back into this loop
            code = 1
            try:
                code = _child(argv)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            print(f"{name} failed: exit status {code}", file=sys.stderr)
            failed = 1
    return failed


def main() -> None:
    if sys.argv[1:2] == ["--runs"]:
        sys.exit(run_all(json.loads(Path(sys.argv[2]).read_text())))
    run(_parser().parse_args())


if __name__ == "__main__":
    main()
