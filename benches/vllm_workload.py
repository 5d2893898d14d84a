"""Scheduler-side cost of two KV-offloading connectors inside vLLM 0.32's real scheduler, on a
closed-loop multi-turn chat workload (issue 12).

Run with the vLLM virtualenv (``make test-vllm`` builds it)::

    make bench-vllm [BENCH_VLLM_ARGS="--b 512 --attention hybrid --profile"]
    .venv-vllm/bin/python benches/vllm_workload.py [--b 64,256,512] [--attention full,hybrid]
        [--steps 300] [--warmup W] [--seed 0] [--connectors vllm,ours] [--cpu-factor 2]
        [--prompt-only] [--clock cpu|wall] [--profile] [--json out.json]

Each run is ``--warmup`` untimed steps (default 300 + B: the first wave of prompts is
prefilled and later turns come back to the CPU tier, about three load jobs a step at B=512),
then ``--steps`` timed steps. The default matrix (B = 64 / 256 / 512, full and hybrid, both
connectors) takes about 4 minutes on a 2-core machine.

**What runs.** vLLM's v1 core ``Scheduler`` (prefix caching on, chunked prefill with
``max_num_batched_tokens=8192``, 16-token blocks, ``max_num_seqs=B``) with no model: a fake
model runner samples each request's next token from the workload, and a fake worker completes
every connector job 1 or 2 steps after the step that planned it (seeded; a load's delay depends
on the request and the step only, so both connectors see the same delays), at once if a plan
flushes it. Two connectors run in the same process on the same request sequences:

* ``vllm``: vLLM's own ``OffloadingConnector`` with its CPU backend (``CPUOffloadingSpec``,
  ``cpu_bytes_to_use``);
* ``ours``: ``KvOffloadConnector`` (``kv_connector_module_path="kvoffload.integrations.vllm"``,
  ``cpu_bytes``).

Both get the same CPU memory: ``--cpu-factor`` (2) times the GPU pool's bytes. Under the same
bytes vLLM's CPU backend gives every key (one block of one group) a chunk sized for all groups,
so with two groups it holds half as many keys as ours. Both store generated tokens too (vLLM's
default ``offload_prompt_only=True`` is turned off so their rules agree; ``--prompt-only``
turns it on for both).

**The workload** (seeded, generated once per conversation id, identical for both connectors):
B requests in flight, 2B conversations; 4 shared system prompts of 512-1,536 tokens; a
conversation's first prompt is 2,048-5,632 tokens (a system prompt and a user message); each
turn decodes 64-256 tokens; the next turn's prompt is the previous prompt, its answer and a
new user message of 32-512 tokens; a conversation has up to 8 turns and ends earlier when the
next prompt would exceed 8,192 tokens; between turns it is idle for 10-100 steps; an ended
conversation is replaced by a new one. Ready turns are admitted first come, first served
whenever fewer than B requests are in flight. The GPU pool holds ``--gpu-tokens-per-seq``
(6,144) tokens per running request: a conversation idle between turns loses its GPU prefix
cache blocks to the others, so later turns hit the CPU tier. Hybrid attention adds a sliding-
window group (1,024-token window) beside the full-attention group, as vLLM's hybrid allocator
builds it for a model with both kinds of layers (2 layers each, 4 KiB pages).

**What the numbers mean.** Every scheduler-side connector method vLLM calls
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output``, ``request_finished_all_groups``, ``take_events``,
``get_kv_connector_stats``, ``on_new_request``, ``has_pending_push_work`` ...) is wrapped with a
timer on the connector instance (outermost calls only; a generator result is drained inside the
timer). The timers read the engine thread's CPU time (``--clock cpu``, the default: what the
connector costs the engine, whatever else runs on the machine) or wall time (``--clock wall``).
*ms/step* is the connector's total time in one engine step (the step's ``add_request``
calls, ``schedule``, ``update_from_output``), median and p90 over the timed steps; per method,
the calls, total and mean per call over the whole run, and the garbage collector's pauses
inside those calls (included: the collector runs when anyone's allocations pass its threshold,
so part of them is the engine's). Over the whole run too: *flushes*, the
jobs the plans told the workers to complete before the forward pass (ours:
``KvOffloadMetadata.flush``; vLLM's: ``OffloadingConnectorMetadata.jobs_to_flush``); *loads*,
the load jobs and the tokens vLLM allocated as externally computed
(``update_state_after_alloc``'s ``num_external_tokens``); GPU blocks stored and loaded per KV
group (read from the plans); *finished*, the requests that finished. The check compares the two
runs: the requests both finished, and their loaded tokens (and GPU hit + loaded tokens). While
both connectors load the same tokens the two runs are the same schedule step for step; where
their rules differ (keys per CPU byte, which sliding-window blocks are stored, how a
sliding-window hit is aligned, eviction order under pressure) the runs drift apart and the
differences are reported, not asserted; where the rules agree (full attention, ``--cpu-factor``
at least 2: nothing is evicted) the bench exits 1 unless both finished the same requests with
the same loaded tokens. *engine ms/step* is vLLM's whole ``schedule``,
``update_from_output`` and ``add_request`` (connector included), for scale. ``--profile`` adds
a run of ours under cProfile (only inside its scheduler-side calls) and prints the top 25
functions by cumulative time. The process is pinned to one core where the OS allows, and runs
with ``PYTHONHASHSEED=0`` unless set (vLLM's connector iterates sets of byte keys: without a
fixed seed its eviction order, so its loads under CPU-pool pressure, change from run to run).
"""

from __future__ import annotations

import argparse
import array
import cProfile
import gc
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
import types
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BS = 16
MODEL_DIR = Path(__file__).resolve().parent.parent / "tests" / "vllm"
# Scheduler-side connector methods vLLM 0.32's Scheduler may call; the ones a connector has are
# timed (worker-side methods are never called in this process).
SCHEDULER_METHODS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "get_loaded_kv_cache_group_ids",
    "update_state_after_alloc",
    "get_external_cache_hit_sources",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "register_finished_partial_tail",
    "take_events",
    "get_kv_connector_stats",
    "has_pending_push_work",
    "has_pending_block_frees",
    "get_finished_count",
    "reset_cache",
)
CONNECTORS = ("vllm", "ours")
# --clock: this thread's CPU time (what the connector costs the engine's thread, whatever else
# runs on the machine) or wall time.
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """The closed-loop multi-turn chat workload of issue 12 (defaults) and its engine."""

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


def build_scheduler(w: Workload, connector: str) -> tuple[Any, Any]:
    """vLLM's real Scheduler with ``connector`` ("vllm" or "ours"), and the block hasher."""
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
            kv_connector_module_path="kvoffload.integrations.vllm",
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


# ----------------------------------------------------------------------------- timing


class Timers:
    """Wraps a connector instance's scheduler-side methods with timers (outermost calls)."""

    def __init__(
        self, conn: Any, profile: cProfile.Profile | None = None, clock: str = "cpu"
    ) -> None:
        self.conn = conn
        self.clock = CLOCKS[clock]
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.step = 0.0
        self.depth = 0
        self.profile = profile
        self.loaded: dict[str, int] = {}  # request -> external tokens vLLM allocated
        self.local: dict[str, int] = {}  # request -> GPU prefix-cache hit at its last lookup
        # Python's garbage collector runs when allocations pass a threshold, whoever made
        # them: its pauses inside timed calls are counted per method (``gc_ms``; included in
        # the method's time), so that a method's own cost can be told from the engine's GC.
        self.gc = 0.0
        self.gc_total: dict[str, float] = {}
        self._gc_start = 0.0
        gc.callbacks.append(self._gc_pause)
        for name in SCHEDULER_METHODS:
            fn = getattr(conn, name, None)
            if callable(fn):
                setattr(conn, name, self._wrap(name, fn))

    def _gc_pause(self, phase: str, info: dict[str, int]) -> None:
        if self.depth:
            if phase == "start":
                self._gc_start = self.clock()
            else:
                self.gc += self.clock() - self._gc_start

    def close(self) -> None:
        """Stops counting GC pauses."""
        gc.callbacks.remove(self._gc_pause)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = self.clock
        total, calls, gc_total = self.total, self.calls, self.gc_total
        total[name] = 0.0
        calls[name] = 0
        gc_total[name] = 0.0
        record_loads = name == "update_state_after_alloc"
        record_local = name == "get_num_new_matched_tokens"

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth = 1
            prof = self.profile
            if prof is not None:
                prof.enable()
            gc0 = self.gc
            t = clock()
            try:
                out = fn(*args, **kwargs)
                if isinstance(out, types.GeneratorType):
                    out = list(out)  # vLLM's take_events yields: its work runs when drained
            finally:
                dt = clock() - t
                if prof is not None:
                    prof.disable()
                self.depth = 0
                total[name] += dt
                gc_total[name] += self.gc - gc0
                calls[name] += 1
                self.step += dt
            if record_local:
                n = args[1] if len(args) > 1 else kwargs["num_computed_tokens"]
                self.local[args[0].request_id] = int(n)
            elif record_loads:
                n = args[2] if len(args) > 2 else kwargs.get("num_external_tokens", 0)
                if n:
                    rid = args[0].request_id
                    self.loaded[rid] = self.loaded.get(rid, 0) + int(n)
            return out

        return timed


# ----------------------------------------------------------------------------- fake worker


class FakeWorker:
    """Completes each job 1-2 steps after it was planned (at once if flushed); speaks the
    connector's plan and report messages, nothing else of it."""

    def __init__(self, connector: str, seed: int) -> None:
        self.connector = connector
        self.seed = seed
        self.due: dict[int, list[tuple[int, str | None]]] = {}
        self.where: dict[int, int] = {}  # job -> due step
        self.flushed = 0
        self.load_jobs = 0
        self.store_jobs = 0
        self.stored_blocks: dict[int, int] = {}  # KV group -> GPU blocks stored
        self.loaded_blocks: dict[int, int] = {}  # KV group -> GPU blocks loaded
        if connector == "vllm":
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
                OffloadingWorkerMetadata,
            )

            self._vllm_meta = OffloadingWorkerMetadata
        else:
            from kvoffload.integrations.vllm import KvOffloadWorkerMetadata

            self._ours_meta = KvOffloadWorkerMetadata

    def _count(self, into: dict[int, int], group: int, n: int) -> None:
        into[group] = into.get(group, 0) + n

    def _plan(self, meta: Any) -> tuple[list[tuple[int, str]], list[int], list[int]]:
        if self.connector == "vllm":
            for jobs, into, side in (
                (meta.load_jobs, self.loaded_blocks, "dst_spec"),
                (meta.store_jobs, self.stored_blocks, "src_spec"),
            ):
                for t in jobs.values():
                    sizes = getattr(getattr(t, side), "group_sizes", None) or ()
                    for g, n in enumerate(sizes):
                        self._count(into, g, int(n))
            loads = [(j, t.req_id) for j, t in meta.load_jobs.items()]
            return loads, list(meta.store_jobs), list(meta.jobs_to_flush or ())
        rows = meta.run_rows()  # job index, group, GPU start, CPU start, length
        nl = len(meta.load_jobs)
        for k, g, n in zip(*(rows[:, c].tolist() for c in (0, 1, 4)), strict=True):
            self._count(self.loaded_blocks if k < nl else self.stored_blocks, g, n)
        return meta.load_requests(), meta.store_ids(), list(meta.flush)

    def _report(self, jobs: list[int]) -> Any:
        if self.connector == "vllm":
            return self._vllm_meta(completed_jobs=dict.fromkeys(jobs, 1))
        return self._ours_meta(done={0: jobs})

    def _add(self, step: int, job: int, rid: str | None, delay: int) -> None:
        self.due.setdefault(step + delay, []).append((job, rid))
        self.where[job] = step + delay

    def step(self, step: int, meta: Any) -> tuple[Any, set[str]]:
        """The worker's report for ``step``: jobs done and loads finished (by request)."""
        loads, stores, flush = self._plan(meta)
        self.load_jobs += len(loads)
        self.store_jobs += len(stores)
        self.flushed += len(flush)
        for j, rid in loads:
            self._add(step, j, rid, 1 + _stable(self.seed, "load", rid, step) % 2)
        rng = random.Random(_stable(self.seed, "stores", step))
        for j in stores:
            self._add(step, j, None, 1 + rng.randrange(2))
        done = self.due.pop(step, [])
        for j in flush:
            d = self.where.get(j)
            if d is not None and d > step:
                entry = next(e for e in self.due[d] if e[0] == j)
                self.due[d].remove(entry)
                done.append(entry)
        for j, _ in done:
            self.where.pop(j, None)
        recv = {rid for _, rid in done if rid is not None}
        return self._report([j for j, _ in done]), recv


def _stable(*parts: object) -> int:
    return random.Random(repr(parts)).getrandbits(31)


# ----------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    connector: str
    b: int
    attention: str
    steps: int
    warmup: int = 0
    step_ms: list[float] = field(default_factory=list)
    engine_ms: list[float] = field(default_factory=list)
    step_loads: list[int] = field(default_factory=list)  # load jobs planned per step
    step_tokens: list[int] = field(default_factory=list)  # tokens scheduled per step
    methods: dict[str, dict[str, float]] = field(default_factory=dict)
    flushed_jobs: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    loaded_tokens: int = 0
    stored_blocks: dict[int, int] = field(default_factory=dict)
    loaded_blocks: dict[int, int] = field(default_factory=dict)
    loaded: dict[str, int] = field(default_factory=dict)
    local: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    submitted: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cpu_capacity: str = ""
    profile: str = ""

    def summary(self, warmup: int | None = None) -> dict[str, Any]:
        """Per-step medians and p90 over the timed steps (after ``warmup``)."""
        warmup = self.warmup if warmup is None else warmup
        xs = sorted(self.step_ms[warmup:] or self.step_ms)
        es = sorted(self.engine_ms[warmup:] or self.engine_ms)
        return {
            "median_ms": statistics.median(xs) if xs else 0.0,
            "p90_ms": xs[int(0.9 * (len(xs) - 1))] if xs else 0.0,
            "mean_ms": statistics.fmean(xs) if xs else 0.0,
            "engine_median_ms": statistics.median(es) if es else 0.0,
            "timed_steps": len(xs),
            "timed_load_jobs": sum(self.step_loads[warmup:]),
        }


def _capacity(conn: Any, connector: str) -> str:
    """CPU capacity as each connector resolved it (reporting only)."""
    try:
        if connector == "vllm":
            return f"{conn.connector_scheduler.manager._num_chunks} chunks (one per key)"
        return f"{conn.scheduler_side.cfg.resolved_cpu_chunks()} chunks per group"
    except Exception as e:  # pragma: no cover - internals moved: the report says so
        return f"? ({type(e).__name__})"


def run_workload(w: Workload, connector: str, profile: bool = False) -> RunResult:
    """Runs ``w.steps`` engine steps of the workload with ``connector``; the bench's core."""
    v = _import_vllm()
    s, hasher = build_scheduler(w, connector)
    conn = s.get_kv_connector()
    prof = cProfile.Profile() if profile else None
    timers = Timers(conn, prof, w.clock)
    clock = timers.clock
    worker = FakeWorker(connector, w.seed)
    convs = Conversations(w)
    res = RunResult(
        connector, w.b, w.attention, w.steps, w.warmup, cpu_capacity=_capacity(conn, connector)
    )

    # 2B live conversations: their context so far and next turn; ready ones queue for a slot.
    n_slots = w.conversations_per_slot * w.b
    next_cid = n_slots
    context: dict[int, array.array] = {}
    turn_of: dict[int, int] = {}
    ready: deque[tuple[int, int]] = deque((0, k) for k in range(n_slots))  # (ready step, cid)
    waiting: list[tuple[int, int]] = []  # idle conversations: (ready step, cid)
    inflight: dict[str, tuple[int, Any, array.array]] = {}  # rid -> (cid, request, answer)
    params_cache: dict[int, Any] = {}

    def submit(cid: int) -> float:
        """Adds conversation ``cid``'s next turn; returns the seconds in ``add_request`` (the
        request's block hashes are computed before, untimed, as a frontend would)."""
        c = convs.get(cid)
        t = turn_of.get(cid, 0)
        ctx = context.get(cid, array.array("H")) + c.turns[t].user
        context[cid] = ctx
        answer = c.turns[t].answer
        n = len(answer)
        sp = params_cache.get(n)
        if sp is None:
            sp = params_cache[n] = v.SamplingParams(max_tokens=n, ignore_eos=True)
        rid = f"c{cid}t{t}"
        req = v.Request(
            request_id=rid,
            prompt_token_ids=ctx.tolist(),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=hasher,
        )
        inflight[rid] = (cid, req, answer)
        res.submitted += 1
        res.prompt_tokens += len(ctx)
        t_add = clock()
        s.add_request(req)
        return clock() - t_add

    for step in range(w.steps):
        timers.step = 0.0
        # Idle conversations whose gap is over join the queue (ordered by ready step, id).
        if waiting:
            due = sorted(x for x in waiting if x[0] <= step)
            if due:
                waiting[:] = [x for x in waiting if x[0] > step]
                ready.extend(due)
        adding = 0.0
        while ready and len(inflight) < w.b:
            adding += submit(ready.popleft()[1])
        t1 = clock()
        so = s.schedule()
        t2 = clock()
        res.preemptions += len(so.preempted_req_ids or ())
        loads_before = worker.load_jobs
        report, recv = worker.step(step, so.kv_connector_metadata)
        res.step_loads.append(worker.load_jobs - loads_before)
        res.step_tokens.append(so.total_num_scheduled_tokens)
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            _, req, answer = inflight[rid]
            # schedule() advanced num_computed_tokens: all known tokens computed -> sample.
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append([answer[len(req.output_token_ids)]])
            else:
                sampled.append([])
        out = v.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=v.KVConnectorOutput(
                finished_recving=recv or None, kv_connector_worker_meta=report
            ),
        )
        t3 = clock()
        s.update_from_output(so, out)
        t4 = clock()
        res.step_ms.append(1e3 * timers.step)
        res.engine_ms.append(1e3 * (adding + (t2 - t1) + (t4 - t3)))
        for rid in [r for r in ids if inflight[r][1].is_finished()]:
            cid, req, answer = inflight.pop(rid)
            res.finished.append(rid)
            context[cid] = context[cid] + answer
            c = convs.get(cid)
            t = turn_of.get(cid, 0)
            gap = c.turns[t].gap
            if t + 1 < len(c.turns):
                turn_of[cid] = t + 1
                waiting.append((step + 1 + gap, cid))
            else:
                context.pop(cid, None)
                turn_of.pop(cid, None)
                convs.cache.pop(cid, None)
                waiting.append((step + 1 + gap, next_cid))
                next_cid += 1
    res.methods = {
        name: {
            "calls": timers.calls[name],
            "total_ms": 1e3 * timers.total[name],
            "us_per_call": 1e6 * timers.total[name] / timers.calls[name],
            "gc_ms": 1e3 * timers.gc_total[name],
        }
        for name in timers.total
        if timers.calls[name]
    }
    res.flushed_jobs = worker.flushed
    res.load_jobs = worker.load_jobs
    res.store_jobs = worker.store_jobs
    res.stored_blocks = dict(sorted(worker.stored_blocks.items()))
    res.loaded_blocks = dict(sorted(worker.loaded_blocks.items()))
    res.loaded = dict(timers.loaded)
    res.local = dict(timers.local)
    res.loaded_tokens = sum(timers.loaded.values())
    timers.close()
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
        res.profile = buf.getvalue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.shutdown()
    return res


def compare(a: RunResult, b: RunResult) -> dict[str, Any]:
    """Finished requests and loaded tokens of two runs of the same workload.

    ``cached`` is a request's GPU prefix-cache hit plus its loaded tokens: once two runs drift
    apart their GPU caches differ, and a load can differ only because the GPU hit did.
    """
    fa, fb = set(a.finished), set(b.finished)
    both = sorted(fa & fb)

    def cached(r: RunResult, rid: str) -> int:
        return r.local.get(rid, 0) + r.loaded.get(rid, 0)

    diff = {r: (a.loaded.get(r, 0), b.loaded.get(r, 0)) for r in both}
    diff = {r: x for r, x in diff.items() if x[0] != x[1]}
    cdiff = [r for r in both if cached(a, r) != cached(b, r)]
    return {
        "finished_both": len(both),
        f"finished_only_{a.connector}": len(fa - fb),
        f"finished_only_{b.connector}": len(fb - fa),
        "same_finished": fa == fb,
        "loaded_equal": len(both) - len(diff),
        "loaded_differ": len(diff),
        "cached_differ": len(cdiff),
        f"{b.connector}_loaded_more": sum(1 for x, y in diff.values() if y > x),
        f"{a.connector}_loaded_more": sum(1 for x, y in diff.values() if x > y),
        f"loaded_tokens_{a.connector}_on_both": sum(a.loaded.get(r, 0) for r in both),
        f"loaded_tokens_{b.connector}_on_both": sum(b.loaded.get(r, 0) for r in both),
        f"cached_tokens_{a.connector}_on_both": sum(cached(a, r) for r in both),
        f"cached_tokens_{b.connector}_on_both": sum(cached(b, r) for r in both),
        "examples": {
            r: {"loaded": x, "gpu_hit": (a.local.get(r, 0), b.local.get(r, 0))}
            for r, x in list(diff.items())[:5]
        },
    }


# ----------------------------------------------------------------------------- main


def _pin() -> str:
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[-1]})
        return f"pinned to CPU {cpus[-1]}"
    return "not pinned"


def main(argv: list[str] | None = None) -> int:
    doc = (__doc__ or "").splitlines()
    ap = argparse.ArgumentParser(description=doc[0] if doc else None)
    ap.add_argument("--b", default="64,256,512", help="requests in flight, comma separated")
    ap.add_argument("--attention", default="full,hybrid", help="full, hybrid or both")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per run (after warmup)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default 300 + B)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--connectors", default="vllm,ours")
    ap.add_argument("--prompt-only", action="store_true", help="offload prompt tokens only")
    ap.add_argument(
        "--cpu-factor", type=float, default=Workload.cpu_factor, help="CPU bytes / GPU pool bytes"
    )
    ap.add_argument("--gpu-tokens-per-seq", type=int, default=Workload.gpu_tokens_per_seq)
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: the engine thread's CPU time (default; unaffected by other processes); wall",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile ours (an extra run)")
    ap.add_argument("--json", type=Path, help="write all results here")
    args = ap.parse_args(argv)
    pinned = _pin()
    bs = [int(x) for x in args.b.split(",") if x]
    attns = [x for x in args.attention.split(",") if x]
    conns = [x for x in args.connectors.split(",") if x]
    for a in attns:
        if a not in ("full", "hybrid"):
            ap.error(f"--attention: {a!r} is not full or hybrid")
    for c in conns:
        if c not in CONNECTORS:
            ap.error(f"--connectors: {c!r} is not one of {CONNECTORS}")
    print(f"# {' '.join(sys.argv)}")
    print(
        f"# vllm_workload: {args.steps} timed steps, seed {args.seed}, "
        f"{args.clock} clock ({pinned})"
    )
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    for attention in attns:
        for b in bs:
            warmup = 300 + b if args.warmup is None else args.warmup
            w = Workload(
                b=b,
                attention=attention,
                steps=warmup + args.steps,
                warmup=warmup,
                seed=args.seed,
                prompt_only=args.prompt_only,
                gpu_tokens_per_seq=args.gpu_tokens_per_seq,
                cpu_factor=args.cpu_factor,
                clock=args.clock,
            )
            runs = {}
            for c in conns:
                t = time.perf_counter()
                runs[c] = run_workload(w, c)
                r = runs[c]
                print(
                    f"  B={b} {attention} {c}: {time.perf_counter() - t:.0f} s, "
                    f"{r.submitted} submitted, {len(r.finished)} finished, "
                    f"CPU {r.cpu_capacity}",
                    file=sys.stderr,
                )
            row: dict[str, Any] = {"b": b, "attention": attention, "workload": asdict(w)}
            for c, r in runs.items():
                row[c] = {
                    **r.summary(),
                    "methods": r.methods,
                    "flushed_jobs": r.flushed_jobs,
                    "load_jobs": r.load_jobs,
                    "store_jobs": r.store_jobs,
                    "loaded_tokens": r.loaded_tokens,
                    "finished": len(r.finished),
                    "submitted": r.submitted,
                    "preemptions": r.preemptions,
                    "prompt_tokens": r.prompt_tokens,
                    "cpu_capacity": r.cpu_capacity,
                    "stored_blocks_per_group": r.stored_blocks,
                    "loaded_blocks_per_group": r.loaded_blocks,
                    "step_ms": [round(x, 4) for x in r.step_ms],
                    "step_load_jobs": r.step_loads,
                }
            if "vllm" in runs and "ours" in runs:
                row["check"] = chk = compare(runs["vllm"], runs["ours"])
                if rules_agree(w) and not (chk["same_finished"] and chk["loaded_differ"] == 0):
                    failed.append(f"B={b} {attention}")
                o = row["ours"]["median_ms"]
                row["ratio"] = row["vllm"]["median_ms"] / o if o else float("inf")
            if args.profile and "ours" in conns:
                row["profile"] = run_workload(w, "ours", profile=True).profile
            rows.append(row)
            _print_detail(row)
    _print_table(rows, args)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "pinned": pinned, "rows": rows}))
    if failed:
        print(
            f"FAILED: the connectors finished different requests or loaded different tokens "
            f"where their rules agree: {', '.join(failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


def rules_agree(w: Workload) -> bool:
    """Whether both connectors must finish the same requests with the same loaded tokens:
    full attention (no sliding-window alignment rules) with a CPU tier that holds everything
    stored (no eviction order decides a load): at least twice the GPU pool."""
    return w.attention == "full" and w.cpu_factor >= 2.0


def _print_detail(row: dict[str, Any]) -> None:
    print(f"\n## B={row['b']} {row['attention']}")
    for c in CONNECTORS:
        r = row.get(c)
        if r is None:
            continue
        print(
            f"{c:>5}: median {r['median_ms']:.3f} ms/step, p90 {r['p90_ms']:.3f}, "
            f"mean {r['mean_ms']:.3f}; engine {r['engine_median_ms']:.2f} ms/step; "
            f"{r['timed_load_jobs']} load jobs in the timed steps; {r['preemptions']} preemptions"
        )
        print(
            f"       {r['store_jobs']} store jobs, GPU blocks stored per group "
            f"{r['stored_blocks_per_group']}, loaded {r['loaded_blocks_per_group']}; "
            f"CPU {r['cpu_capacity']}"
        )
        for name, m in sorted(r["methods"].items(), key=lambda x: -x[1]["total_ms"]):
            print(
                f"       {name:<32} {m['calls']:>8} calls {m['total_ms']:>10.1f} ms "
                f"{m['us_per_call']:>9.1f} us/call, of which GC {m['gc_ms']:.1f} ms"
            )
    chk = row.get("check")
    if chk:
        print(f"check: {json.dumps(chk)}")
    if row.get("profile"):
        print("profile of ours (cProfile, top 25 by cumulative time; an extra run):")
        print(row["profile"])


def _print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n# connector scheduler-side time, ms/step (median after warmup); seed {args.seed}")
    hdr = (
        f"{'B':>4} {'attention':>9} {'vLLM ms':>8} {'ours ms':>8} {'ratio':>7} "
        f"{'flush vLLM':>10} {'flush ours':>10} {'loads vLLM (tok)':>22} "
        f"{'loads ours (tok)':>22} {'fin vLLM':>8} {'fin ours':>8}"
    )
    print(hdr)
    for row in rows:
        a, o = row.get("vllm"), row.get("ours")

        def g(r: dict[str, Any] | None, k: str, fmt: str = "{}") -> str:
            return fmt.format(r[k]) if r else "-"

        def loads(r: dict[str, Any] | None) -> str:
            return f"{r['load_jobs']} ({r['loaded_tokens']})" if r else "-"

        ratio = f"{row['ratio']:.1f}x" if "ratio" in row else "-"
        print(
            f"{row['b']:>4} {row['attention']:>9} {g(a, 'median_ms', '{:.3f}'):>8} "
            f"{g(o, 'median_ms', '{:.3f}'):>8} {ratio:>7} {g(a, 'flushed_jobs'):>10} "
            f"{g(o, 'flushed_jobs'):>10} {loads(a):>22} {loads(o):>22} "
            f"{g(a, 'finished'):>8} {g(o, 'finished'):>8}"
        )


if __name__ == "__main__":
    if "PYTHONHASHSEED" not in os.environ:
        # vLLM's connector keeps offload keys (bytes) in sets: their order, hence its eviction
        # order under pressure, follows the per-process string hash seed. Fix it.
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sys.exit(main())
