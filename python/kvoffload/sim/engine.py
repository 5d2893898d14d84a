"""A simulated paged inference engine that drives kvoffload exactly as a real engine would.

The engine has what makes KV offloading hard in vLLM-like engines, and nothing else:

* a **block pool** with reference counts and a **prefix cache** keyed by chained hashes; freed
  blocks go to an LRU free queue (a request's blocks are freed tail first) and are re-used
  either as cache hits (content kept, not written) or evicted and re-written;
* **chunked prefill** under a per-step token budget, then **decode** one token per step;
* an optional **sliding-window** KV group whose blocks are freed as they leave the window while
  the request still runs (the engine's null block takes their place);
* **preemption** of the latest-admitted running request when blocks run out;
* an optional **one-step lag** between scheduling and outputs (asynchronous scheduling): a
  request is scheduled once more after its last token, and learns it finished a step late.

Each forward step writes the bytes of :mod:`kvoffload.sim.oracle` into real torch tensors, so
the correct content of every block is known. The engine drives
:class:`~kvoffload.scheduler.OffloadScheduler` and :class:`~kvoffload.transfer.TransferEngine`
in the order of DESIGN.md §3: per step, completions → admission (``lookup`` then ``allocate``)
→ ``schedule`` → workers (one :meth:`~kvoffload.transfer.TransferEngine.step` call with the
plan, then the forward pass) → outputs. Every load is compared byte for byte
with the oracle when it completes, before any forward pass reads it; so is every prefix-cache
hit (a sanity check of the simulator itself).

Two switches break the fence on purpose, for mutation checks: ``fence="off"`` ignores the flush
set, and ``skip_deferred_arming=True`` builds the scheduler with deferred pairs never armed.
With either, runs with block re-use and slow copies (``copy_delay_s``) report mismatches.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.errors import ConfigError
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput
from kvoffload.sim.oracle import Stream, token_bytes
from kvoffload.sim.vllm_rule import VllmRuleFence
from kvoffload.sim.workloads import WORKLOADS, RequestSpec, make_workload
from kvoffload.transfer import TransferEngine

__all__ = [
    "BlockPool",
    "Mismatch",
    "SimConfig",
    "SimError",
    "SimResult",
    "Simulator",
    "TimelinePoint",
    "simulate",
]

FenceMode = Literal["exact", "conservative", "off"]
Completion = Literal["step", "poll"]
NULL_BLOCK = 0
"""The engine's null block: never allocated, stands for sliding-window positions left behind."""


class SimError(Exception):
    """The simulation cannot run or cannot make progress (a configuration that cannot work)."""


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulation run depends on. Same config, same figures (except timings).

    Attributes:
        workload: ``chat``, ``sysprompt``, ``docs`` or ``mixed`` (see
            :mod:`kvoffload.sim.workloads`).
        num_requests: Requests in the workload.
        seed: Seed of the workload.
        scale: Multiplies every length of the workload (< 1 for quick runs).
        arrival_gap: Mean steps between arrivals.
        block_size: Tokens per GPU block (and per hash block).
        num_gpu_blocks: GPU blocks, the null block included.
        cpu_chunks: CPU slots per KV group.
        blocks_per_chunk: GPU blocks per chunk (the unit of offloading).
        policy: CPU eviction policy, ``lru`` or ``arc``.
        sliding_window: Window in tokens of a second, sliding-window KV group; None: one
            full-attention group only.
        num_layers: Layers per KV group (every group shares the same tensors, as in a hybrid
            allocator: a block id is one piece of memory whichever group holds it).
        token_bytes: KV bytes per token per layer.
        max_num_seqs: Requests holding blocks at once (running or loading).
        token_budget: Tokens computed per step (chunked prefill).
        device: ``cpu`` or ``cuda``.
        offload: Drive the offloading scheduler; False: the same engine without offloading.
        fence: ``exact`` (pass the blocks written this step), ``conservative`` (pass None: every
            allocated block) or ``off`` (ignore the flush set: a broken fence, for tests).
        skip_deferred_arming: Build the scheduler with deferred pairs never armed (a broken
            fence, for tests).
        async_scheduling: One-step lag between scheduling and outputs.
        completion: ``step``: wait at the start of every step for the copies submitted before it
            (copies still overlap the forward pass; runs are reproducible); ``poll``: only take
            what has finished (timing dependent).
        copy_delay_s: Sleep this long before the first copy of every store job (makes the race
            of a broken fence certain).
        max_loading_requests: Scheduler backpressure on concurrent loads (0: none).
        load_fault_rate: Share of load jobs the data plane fails on purpose (seeded by
            ``seed``): the run must stay exact, the requests recompute.
        store_fault_rate: Share of store jobs failed on purpose (never published).
        max_steps: Give up after this many steps.
    """

    workload: str = "mixed"
    num_requests: int = 150
    seed: int = 0
    scale: float = 1.0
    arrival_gap: float = 2.0
    block_size: int = 16
    num_gpu_blocks: int = 1024
    cpu_chunks: int = 8192
    blocks_per_chunk: int = 1
    policy: str = "lru"
    sliding_window: int | None = None
    num_layers: int = 2
    token_bytes: int = 16
    max_num_seqs: int = 32
    token_budget: int = 512
    device: str = "cpu"
    offload: bool = True
    fence: FenceMode = "exact"
    skip_deferred_arming: bool = False
    async_scheduling: bool = False
    completion: Completion = "step"
    copy_delay_s: float = 0.0
    max_loading_requests: int = 0
    load_fault_rate: float = 0.0
    store_fault_rate: float = 0.0
    max_steps: int = 1_000_000

    @property
    def windows(self) -> list[int | None]:
        """Per KV group, its sliding window (None: full attention): one full-attention group,
        then the sliding-window group if there is one."""
        return [None] if self.sliding_window is None else [None, self.sliding_window]

    def offload_config(self) -> OffloadConfig:
        """The scheduler's configuration for this run (the one mapping from the simulator's
        values to the scheduler's)."""
        bytes_per_block = self.num_layers * self.block_size * self.token_bytes
        return OffloadConfig(
            groups=tuple(
                KvGroup(
                    block_size=self.block_size, sliding_window=w, bytes_per_block=bytes_per_block
                )
                for w in self.windows
            ),
            num_gpu_blocks=self.num_gpu_blocks,
            blocks_per_chunk=self.blocks_per_chunk,
            hash_block_size=self.block_size,
            cpu_chunks=self.cpu_chunks,
            policy=self.policy,  # type: ignore[arg-type]
            num_workers=1,
            max_loading_requests=self.max_loading_requests,
            null_block=NULL_BLOCK,
            debug_skip_deferred_arming=self.skip_deferred_arming,
        )

    def validate(self) -> None:
        """Raises :class:`~kvoffload.errors.ConfigError` naming the first bad value.

        What the scheduler takes (block size, GPU blocks, CPU chunks, blocks per chunk, policy,
        sliding window, load backpressure) is checked by the core, in one place, with its
        messages, also for a run without offloading; the simulator checks only its own values.
        """
        for name in _POSITIVE:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name, lo, hi, closed in _BOUNDED:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            # also rejects nan and inf
            if not ok or not (lo <= v <= hi if closed else lo < v <= hi):
                interval = f"[{lo:g}, {hi:g}]" if closed else f"({lo:g}, {hi:g}]"
                raise ConfigError(f"{name} must be a number in {interval}, got {v!r}")
        for name, choices in _CHOICES:
            v = getattr(self, name)
            if v not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {v!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for, but CUDA is not available here")
        self.offload_config().resolved_cpu_chunks()  # the core checks the scheduler's values


_POSITIVE = (
    "num_requests",
    "num_layers",
    "token_bytes",
    "max_num_seqs",
    "token_budget",
    "max_steps",
)
"""The simulator's own integer values (the scheduler's are checked by the core)."""
_BOUNDED = (
    ("scale", 0.0, 1e6, False),
    ("arrival_gap", 0.0, 1e9, True),
    ("copy_delay_s", 0.0, 60.0, True),
    ("load_fault_rate", 0.0, 1.0, True),
    ("store_fault_rate", 0.0, 1.0, True),
)
"""The simulator's own numbers: (name, low, high, low included)."""
_CHOICES = (
    ("workload", tuple(WORKLOADS)),
    ("fence", get_args(FenceMode)),
    ("completion", get_args(Completion)),
    ("device", ("cpu", "cuda")),
)


@dataclass(frozen=True)
class Mismatch:
    """A block whose bytes differ from the oracle's.

    Attributes:
        kind: ``load`` (a block loaded from the CPU tier) or ``hit`` (a GPU prefix-cache hit).
        request: The request that received it.
        group: KV group.
        chunk: Chunk index within the request (position // blocks_per_chunk).
        position: Block position within the request.
        block: GPU block id.
        step: Engine step at which it was detected.
        job: Load job id (None for a hit).
    """

    kind: str
    request: str
    group: int
    chunk: int
    position: int
    block: int
    step: int
    job: int | None


class TimelinePoint(NamedTuple):
    """Cumulative figures of a run at the end of one step (one entry of
    :attr:`SimResult.timeline`)."""

    step: int
    lookup_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    prefill_tokens: int
    bytes_stored: int
    bytes_loaded: int
    flushed_jobs: int
    flushes_vllm_rule: int


@dataclass
class SimResult:
    """Figures of one run. :meth:`to_dict` gives them as plain JSON-able values."""

    config: dict[str, Any]
    requests: int = 0
    steps: int = 0
    wall_seconds: float = 0.0
    lookup_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    readmissions: int = 0
    store_jobs: int = 0
    load_jobs: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    failed_jobs: int = 0
    flushes_necessary: int = 0
    flushes_conservative: int = 0
    flushes_vllm_rule: int = 0
    """Store jobs vLLM's own offloading rule would have flushed on the same run
    (:mod:`kvoffload.sim.vllm_rule`)."""
    flushed_jobs: int = 0
    """Jobs in the plans' flush sets (our fence), whatever the fence mode."""
    flush_steps: int = 0
    flush_wait_seconds: float = 0.0
    sched_seconds: float = 0.0
    sched_step_us_mean: float = 0.0
    sched_step_us_p99: float = 0.0
    blocks_verified: int = 0
    hit_blocks_verified: int = 0
    mismatches: int = 0
    hit_mismatches: int = 0
    torn_stores: int = 0
    mismatch_details: list[Mismatch] = field(default_factory=list)
    leaked_requests: int = 0
    leaked_jobs: int = 0
    scheduler_stats: dict[str, Any] = field(default_factory=dict)
    timeline: list[TimelinePoint] = field(default_factory=list)
    """Per step, the cumulative figures at its end."""

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens served by the GPU cache or the CPU tier."""
        return (self.gpu_hit_tokens + self.cpu_hit_tokens) / max(1, self.lookup_tokens)

    def to_dict(self) -> dict[str, Any]:
        """All figures, JSON-able."""
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["mismatch_details"] = [asdict(m) for m in self.mismatch_details]
        return d


class BlockPool:
    """GPU blocks with reference counts, a prefix cache and an LRU free queue.

    Block 0 is the null block and never allocated. A freed block keeps its cached content and
    hash until it is allocated again: then its hash is evicted and it will be re-written. A
    cache hit on a free block takes it out of the free queue, content intact.
    """

    def __init__(self, num_blocks: int) -> None:
        """``num_blocks`` blocks, block 0 reserved."""
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key: list[tuple[int, int] | None] = [None] * num_blocks
        self.cache: dict[tuple[int, int], int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.evictions = 0

    def num_free(self) -> int:
        """Blocks in the free queue (cached or not)."""
        return len(self.free)

    def cached(self, group: int, h: int) -> int | None:
        """The block caching ``(group, hash)``, or None."""
        return self.cache.get((group, h))

    def touch(self, block: int) -> None:
        """Takes a reference on a cache hit (out of the free queue if it was free)."""
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def take(self, n: int) -> list[int]:
        """Allocates ``n`` blocks from the front of the free queue (evicting their hashes)."""
        if n > len(self.free):
            raise SimError(f"asked for {n} blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            k = self.key[b]
            if k is not None:
                del self.cache[k]
                self.key[b] = None
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drops one reference of each block, in the order given; free blocks join the tail."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
            elif self.ref[b] < 0:  # pragma: no cover - a simulator bug
                raise SimError(f"block {b} released more often than taken")

    def register(self, block: int, group: int, h: int) -> None:
        """Caches a full block under ``(group, hash)`` unless that content is cached already."""
        k = (group, h)
        if self.key[block] is None and k not in self.cache:
            self.cache[k] = block
            self.key[block] = k


class _Req:
    """Runtime state of one request."""

    __slots__ = (
        "arrived",
        "cached",
        "computed",
        "done",
        "hashes_sent",
        "id",
        "inflight",
        "left",
        "load_end",
        "load_hit",
        "load_job",
        "max_computed",
        "num_output",
        "output_len",
        "prompt_len",
        "released",
        "spec",
        "state",
        "stream",
        "tables",
    )

    def __init__(self, spec: RequestSpec, num_groups: int) -> None:
        self.spec = spec
        self.id = spec.req_id
        self.stream: Stream = spec.stream
        self.prompt_len = spec.prompt_len
        self.output_len = spec.output_len
        self.state = "pending"  # pending, waiting, loading, ready, running, done
        self.arrived = False
        self.done = False
        self.computed = 0
        self.max_computed = 0
        self.num_output = 0
        self.inflight = 0
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.released: list[list[int]] = [[] for _ in range(num_groups)]
        self.left: list[dict[int, int]] = [{} for _ in range(num_groups)]
        """Per group: blocks that left the sliding window -> their position (freed, and still
        holding that position's bytes until re-allocated)."""
        self.cached = [0] * num_groups
        self.hashes_sent = 0
        self.load_job: int | None = None
        self.load_hit = 0
        self.load_end = 0

    @property
    def known(self) -> int:
        """Tokens whose ids the engine knows: prompt plus processed outputs."""
        return self.prompt_len + self.num_output


class Simulator:
    """One simulation run. Use :func:`simulate` unless you need to step it yourself."""

    def __init__(
        self,
        cfg: SimConfig,
        specs: Sequence[RequestSpec] | None = None,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """Builds the engine, its tensors, and (with ``offload``) the scheduler and data plane.

        Args:
            cfg: The run's configuration.
            specs: The workload; default: ``make_workload`` from ``cfg``.
            progress: Called as ``progress(finished_requests, total_requests, step)``.

        Raises:
            ConfigError: A bad configuration value.
            SimError: A request that can never fit in the GPU blocks.
        """
        cfg.validate()
        self.cfg = cfg
        self.progress = progress
        bs = cfg.block_size
        self.bs = bs
        self.specs = list(
            specs
            if specs is not None
            else make_workload(
                cfg.workload,
                cfg.num_requests,
                cfg.seed,
                bs,
                scale=cfg.scale,
                gap=cfg.arrival_gap,
            )
        )
        self.windows = cfg.windows
        self.ng = len(self.windows)
        self.vllm_rule = VllmRuleFence(self.windows)
        self._check_fits()
        self.reqs = {s.req_id: _Req(s, self.ng) for s in self.specs}
        if len(self.reqs) != len(self.specs):
            raise SimError("request ids of the workload are not unique")
        self.followers: dict[str, list[str]] = {}
        self.arrivals: list[tuple[int, int, str]] = []
        for i, s in enumerate(self.specs):
            if s.after is None:
                heapq.heappush(self.arrivals, (s.arrival, i, s.req_id))
            else:
                self.followers.setdefault(s.after, []).append(s.req_id)
        self.order = {s.req_id: i for i, s in enumerate(self.specs)}
        self.pool = BlockPool(cfg.num_gpu_blocks)
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.loading: dict[str, _Req] = {}
        self.ready: list[_Req] = []
        self.finished_ids: list[str] = []
        self.pending_outputs: list[list[tuple[_Req, bool]]] = []
        self.step_no = 0
        self.num_done = 0
        self.width = cfg.token_bytes
        dev = torch.device(cfg.device)
        self.device = dev
        self.kv = [
            torch.zeros((cfg.num_gpu_blocks, bs, self.width), dtype=torch.uint8, device=dev)
            for _ in range(cfg.num_layers)
        ]
        self.kv_np = [t.numpy() for t in self.kv] if dev.type == "cpu" else None
        self.result = SimResult(config=asdict(cfg))
        self.result.requests = len(self.specs)
        self.step_times: list[float] = []
        self.sched: OffloadScheduler | None = None
        self.xfer: TransferEngine | None = None
        self.jobs: dict[int, tuple[str, str, list[tuple[int, list[int], list[int]]]]] = {}
        self.inflight_ids: set[int] = set()
        self.store_ids: set[int] = set()
        self.store_pos: dict[int, list[tuple[int, list[int], list[int]]]] = {}
        self.closed = False
        if cfg.offload:
            self.sched = OffloadScheduler(cfg.offload_config())
            hook = self._delay_hook if cfg.copy_delay_s > 0 else None
            faults = cfg.load_fault_rate > 0 or cfg.store_fault_rate > 0
            self.xfer = TransferEngine(
                [list(self.kv) for _ in range(self.ng)],
                blocks_per_chunk=cfg.blocks_per_chunk,
                num_slots=cfg.cpu_chunks,
                _before_copy=hook,
                _fault_injector=self._inject_fault if faults else None,
            )

    # ------------------------------------------------------------------ setup helpers

    def _check_fits(self) -> None:
        """Every request must fit alone in the GPU blocks, or the run could never finish."""
        bs = self.bs
        worst = 0
        for s in self.specs:
            total = s.prompt_len + s.output_len + 1
            need = -(-total // bs)  # full attention group
            for w in self.windows[1:]:
                assert w is not None
                need += min(-(-total // bs), -(-(w + self.cfg.token_budget) // bs) + 2)
            worst = max(worst, need)
        if worst > self.cfg.num_gpu_blocks - 1:
            raise SimError(
                f"the longest request needs {worst} GPU blocks but only "
                f"{self.cfg.num_gpu_blocks - 1} exist: raise num_gpu_blocks or lower scale"
            )

    def _inject_fault(self, job_id: int) -> None:
        """Fails a job with the configured probability (the same jobs for the same config)."""
        store = job_id in self.store_ids
        rate = self.cfg.store_fault_rate if store else self.cfg.load_fault_rate
        draw = np.random.default_rng((self.cfg.seed, job_id)).random()
        if draw < rate:
            raise RuntimeError(f"injected failure of {'store' if store else 'load'} {job_id}")

    def _delay_hook(self, job_id: int, copy_index: int) -> None:
        if copy_index == 0 and job_id in self.store_ids:
            time.sleep(self.cfg.copy_delay_s)

    # ------------------------------------------------------------------ scheduler calls

    def _sc(self, fn: Callable[..., Any], *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._sched_t += time.perf_counter() - t

    # ------------------------------------------------------------------ the run

    def run(self) -> SimResult:
        """Runs every request to completion and returns the figures."""
        t0 = time.perf_counter()
        try:
            while not self._finished():
                if self.step_no >= self.cfg.max_steps:
                    raise SimError(f"gave up after {self.step_no} steps")
                self.step()
            self._drain()
            self._record_timeline(if_changed=True)  # copies completed after the last step
        finally:
            self.close()
        r = self.result
        r.steps = self.step_no
        r.wall_seconds = time.perf_counter() - t0
        if self.step_times:
            arr = np.array(self.step_times) * 1e6
            r.sched_step_us_mean = float(arr.mean())
            r.sched_step_us_p99 = float(np.percentile(arr, 99))
        if self.sched is not None:
            st: dict[str, Any] = dict(self.sched.stats())
            r.scheduler_stats = st
            r.flushes_necessary = int(st.get("flushes_necessary", 0))
            r.flushes_conservative = int(st.get("flushes_conservative", 0))
            r.leaked_requests = self.sched.num_requests
            r.leaked_jobs = len(self.sched.pending_jobs())
        return r

    def close(self) -> None:
        """Shuts the data plane down (idempotent)."""
        if not self.closed and self.xfer is not None:
            self.xfer.shutdown(wait=False)
        self.closed = True

    def _finished(self) -> bool:
        return (
            self.num_done == len(self.specs)
            and not self.finished_ids
            and not any(self.pending_outputs)
        )

    def _drain(self) -> None:
        """After the last request: run every queued copy, complete every job, and give the
        scheduler empty steps until it lets go of every finished request (it drops one at the
        step after its last job completed, and may still create stores for it)."""
        if self.xfer is None or self.sched is None:
            return
        self.xfer.step()  # one more worker step submits the last step's stores
        self.xfer.wait(list(self.inflight_ids))
        self._collect(block=False)
        left = -1
        for _ in range(10_000):  # each round completes jobs or drops requests; bounded anyway
            if not self.sched.num_requests or self.sched.num_requests == left:
                break
            left = self.sched.num_requests
            plan = self._sc(self.sched.schedule, StepInput(scheduled=[], written=[]))
            self._workers(plan)
            self.xfer.step()
            self.xfer.wait(list(self.inflight_ids))
            self._collect(block=False)
            if plan.stores:
                left = -1  # progress: more stores of finished requests

    def step(self) -> None:
        """One engine step: completions, admission, schedule, workers, outputs."""
        cfg = self.cfg
        self._sched_t = 0.0
        self.step_no += 1
        self._collect(block=cfg.completion == "step")
        if not self.running and not self.ready and self.loading and self.inflight_ids:
            # Nothing can run until a load lands; a real step lasts long enough for it, so do
            # not spin empty steps (they would skew arrivals and the per-step figures).
            assert self.xfer is not None
            self.xfer.wait(list(self.inflight_ids))
            self._collect(block=False)
        self._arrive()
        if (
            not self.running
            and not self.waiting
            and not self.ready
            and not self.loading
            and not self.finished_ids
            and not self.inflight_ids
            and not any(self.pending_outputs)
            and self.arrivals
            and (self.xfer is None or self.xfer.stats()["queued"] == 0)
        ):
            # Idle until the next arrival: skip ahead.
            self.step_no = max(self.step_no, self.arrivals[0][0])
            self._arrive()

        scheduled: list[tuple[_Req, int, int]] = []  # (req, start, n)
        new_blocks: list[tuple[str, int, list[int]]] = []
        written: list[int] = []
        preempted: list[str] = []
        budget = cfg.token_budget

        # Requests whose load completed join the running list.
        self.running.extend(self.ready)
        for r in self.ready:
            r.state = "running"
        self.ready.clear()

        # 1. Running requests, in order; preempt from the tail when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            todo = r.known + r.inflight - r.computed
            if todo <= 0:
                i += 1
                continue
            n = min(todo, budget)
            self._free_window(r)
            need = self._blocks_needed(r, r.computed + n)
            while sum(need) > self.pool.num_free():
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.id)
                if victim is r:
                    break
            if r.state != "running":
                break
            appended = self._append_blocks(r, need)
            for g, blocks in enumerate(appended):
                if blocks:
                    new_blocks.append((r.id, g, blocks))
                    written.extend(blocks)
                    self.vllm_rule.allocated(blocks)
            scheduled.append((r, r.computed, n))
            budget -= n
            i += 1

        # 2. Admission (not in a step that preempted, as vLLM).
        if not preempted:
            budget = self._admit(budget, scheduled, written)

        # 3. Schedule.
        outputs: list[tuple[_Req, bool]] = []
        for r, start, n in scheduled:
            r.computed = start + n
            sampled = r.computed >= r.known + r.inflight
            if sampled:
                r.inflight += 1  # this step samples a token
            outputs.append((r, sampled))
        plan = None
        if self.sched is not None:
            self.vllm_rule.step(self.finished_ids, preempted)
            inp = StepInput(
                scheduled=[(r.id, r.computed) for r, _, _ in scheduled],
                new_blocks=new_blocks,
                finished=list(self.finished_ids),
                preempted=preempted,
                written=None if cfg.fence == "conservative" else written,
            )
            plan = self._sc(self.sched.schedule, inp)
            self.sched.take_events()  # nothing indexes the CPU tier here: drain every step
            self.vllm_rule.stores((j.job_id, j.request_id, j.transfers) for j in plan.stores)
            self.result.flushes_vllm_rule = self.vllm_rule.flushed
        self.finished_ids.clear()

        # 4. Workers: the data plane's step, then the forward pass.
        if plan is not None:
            self._workers(plan)
        self._forward(scheduled)

        # 5. Outputs (one step late with asynchronous scheduling).
        self.pending_outputs.append(outputs)
        lag = 1 if cfg.async_scheduling else 0
        while len(self.pending_outputs) > lag:
            self._outputs(self.pending_outputs.pop(0))
        if lag and self.num_done == len(self.specs):
            for batch in self.pending_outputs:
                self._outputs(batch)
            self.pending_outputs.clear()

        self.step_times.append(self._sched_t)
        self.result.sched_seconds += self._sched_t
        self._record_timeline()

    def _record_timeline(self, *, if_changed: bool = False) -> None:
        """Appends the run's cumulative figures at this point (``if_changed``: unless they are
        the last point's)."""
        res = self.result
        point = TimelinePoint(
            step=self.step_no,
            lookup_tokens=res.lookup_tokens,
            gpu_hit_tokens=res.gpu_hit_tokens,
            cpu_hit_tokens=res.cpu_hit_tokens,
            prefill_tokens=res.prefill_tokens,
            bytes_stored=res.bytes_stored,
            bytes_loaded=res.bytes_loaded,
            flushed_jobs=res.flushed_jobs,
            flushes_vllm_rule=res.flushes_vllm_rule,
        )
        if not (if_changed and res.timeline and res.timeline[-1][1:] == point[1:]):
            res.timeline.append(point)

    # ------------------------------------------------------------------ arrivals / admission

    def _arrive(self) -> None:
        while self.arrivals and self.arrivals[0][0] <= self.step_no:
            _, _, rid = heapq.heappop(self.arrivals)
            r = self.reqs[rid]
            r.arrived = True
            r.state = "waiting"
            self.waiting.append(r)
            if self.sched is not None:
                hashes = r.stream.hash_list[: r.known // self.bs]
                r.hashes_sent = len(hashes)
                self._sc(self.sched.add_request, r.id, r.prompt_len, hashes)

    def _gpu_hit(self, r: _Req) -> tuple[int, list[list[int]]]:
        """The engine's prefix-cache hit: tokens, and the hit blocks per group (with nulls)."""
        bs = self.bs
        max_blocks = (r.known - 1) // bs
        hl = r.stream.hash_list
        pool = self.pool
        fa_limit = max_blocks
        for g, w in enumerate(self.windows):
            if w is not None:
                continue
            j = 0
            while j < fa_limit and pool.cached(g, hl[j]) is not None:
                j += 1
            fa_limit = j
        hb = fa_limit
        for g, w in enumerate(self.windows):
            if w is None or hb == 0:
                continue
            ok = [pool.cached(g, hl[j]) is not None for j in range(hb)]
            prefix = np.concatenate(([0], np.cumsum(ok)))
            while hb > 0:
                first = max(0, hb * bs - w + 1) // bs
                if prefix[hb] - prefix[first] == hb - first:
                    break
                hb -= 1
        tables: list[list[int]] = []
        for g, w in enumerate(self.windows):
            first = 0 if w is None else max(0, hb * bs - w + 1) // bs
            row = [NULL_BLOCK] * first
            for j in range(first, hb):
                b = pool.cached(g, hl[j])
                assert b is not None
                row.append(b)
            tables.append(row)
        return hb * bs, tables

    def _admit(
        self, budget: int, scheduled: list[tuple[_Req, int, int]], written: list[int]
    ) -> int:
        cfg = self.cfg
        skipped: list[_Req] = []
        while self.waiting and budget > 0:
            holding = len(self.running) + len(self.loading) + len(self.ready)
            if holding >= cfg.max_num_seqs:
                break
            r = self.waiting.popleft()
            h, hit_tables = self._gpu_hit(r)
            ext = 0
            if self.sched is not None:
                got = self._sc(self.sched.lookup, r.id, h)
                if got is None:
                    skipped.append(r)
                    continue
                ext = int(got)
            target = h + ext if ext > 0 else h + min(r.known - h, budget)
            # Blocks: hit blocks (touched), nulls below the window, new ones up to target.
            touch_free = sum(
                1 for row in hit_tables for b in row if b != NULL_BLOCK and self.pool.ref[b] == 0
            )
            tables: list[list[int]] = []
            counts: list[int] = []
            for g, w in enumerate(self.windows):
                row = list(hit_tables[g])
                nblocks = -(-target // self.bs)
                if w is not None:
                    # Positions wholly before the window of the first token to compute are null.
                    first = max(0, h + ext - w + 1) // self.bs
                    while len(row) < min(first, nblocks):
                        row.append(NULL_BLOCK)
                counts.append(max(0, nblocks - len(row)))
                tables.append(row)
            if sum(counts) + touch_free > self.pool.num_free():
                skipped.append(r)
                break
            self._verify_hits(r, hit_tables)
            for row in hit_tables:
                for b in row:
                    if b != NULL_BLOCK:
                        self.pool.touch(b)
            for g, c in enumerate(counts):
                fresh = self.pool.take(c)
                tables[g].extend(fresh)
                written.extend(fresh)
            # vLLM's rule counts prefix-cache re-use as a write.
            self.vllm_rule.allocated(b for row in tables for b in row if b != NULL_BLOCK)
            r.tables = tables
            r.cached = [len(row) for row in hit_tables]
            r.computed = h
            self.result.lookup_tokens += r.known
            self.result.gpu_hit_tokens += h
            if self.sched is not None:
                job = self._sc(self.sched.allocate, r.id, tables, h, ext)
            else:
                job = None
            if ext > 0:
                if job is None:
                    raise SimError(f"{r.id}: lookup promised {ext} tokens but no load was created")
                r.state = "loading"
                r.load_job = int(job)
                r.load_hit = h
                r.load_end = h + ext
                self.loading[r.id] = r
                continue
            n = target - h
            r.state = "running"
            self.running.append(r)
            scheduled.append((r, h, n))
            budget -= n
        for r in reversed(skipped):
            self.waiting.appendleft(r)
        return budget

    # ------------------------------------------------------------------ blocks

    def _free_window(self, r: _Req) -> None:
        """Frees sliding-window blocks wholly before the window of the next token."""
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            skip = max(0, r.computed - w + 1) // self.bs
            row = r.tables[g]
            gone = []
            for j in range(min(skip, len(row))):
                if row[j] != NULL_BLOCK:
                    gone.append(row[j])
                    r.left[g][row[j]] = j
                    row[j] = NULL_BLOCK
            if gone:
                self.pool.release(gone[::-1])

    def _blocks_needed(self, r: _Req, target: int) -> list[int]:
        nb = -(-target // self.bs)
        return [max(0, nb - len(row)) for row in r.tables]

    def _append_blocks(self, r: _Req, need: list[int]) -> list[list[int]]:
        out = []
        for g, c in enumerate(need):
            fresh = self.pool.take(c) if c else []
            r.tables[g].extend(fresh)
            out.append(fresh)
        return out

    def _release_all(self, r: _Req) -> None:
        self._register(r)
        for row in r.tables:
            self.pool.release(row[::-1])
        r.released = r.tables
        r.tables = [[] for _ in range(self.ng)]
        r.cached = [0] * self.ng

    def _window_gap(self, r: _Req) -> bool:
        """Whether a sliding-window group left null a position the request must now compute
        (after a failed load: the window was placed after the tokens the load would bring)."""
        first = r.computed // self.bs
        return any(
            NULL_BLOCK in r.tables[g][first:] for g, w in enumerate(self.windows) if w is not None
        )

    def _readmit(self, r: _Req) -> None:
        """A failed load whose blocks cannot be recomputed in place: drop the request's blocks
        and admit it again (the engine tells the scheduler it released them)."""
        self._release_all(r)
        r.computed = 0
        r.state = "waiting"
        self.waiting.appendleft(r)
        self.result.readmissions += 1
        assert self.sched is not None
        self._sc(self.sched.preempt, r.id)

    def _preempt(self, r: _Req) -> None:
        self.running.remove(r)
        self._release_all(r)
        r.computed = 0
        r.state = "waiting"
        self.waiting.appendleft(r)
        self.result.preemptions += 1

    def _register(self, r: _Req) -> None:
        """Caches the request's full, computed blocks under their chained hashes."""
        limit = min(r.computed, r.known) // self.bs
        hl = r.stream.hash_list
        for g, row in enumerate(r.tables):
            end = min(limit, len(row))
            for j in range(r.cached[g], end):
                b = row[j]
                if b != NULL_BLOCK:
                    self.pool.register(b, g, hl[j])
            r.cached[g] = max(r.cached[g], end)

    # ------------------------------------------------------------------ workers

    def _track_store(self, job: Any) -> tuple[int, list[tuple[int, list[int], list[int]]]]:
        """Records a plan's store job for verification; returns it as ``step`` takes it."""
        transfers = [(int(g), list(gb), list(cb)) for g, gb, cb in job.transfers]
        self.store_ids.add(job.job_id)
        self.jobs[job.job_id] = ("store", job.request_id, transfers)
        r = self.reqs[job.request_id]
        # A released request's stores read the blocks it held (if not re-written since); a
        # store may also read a sliding-window block that left the window but was not
        # re-allocated yet (its bytes are intact; the fence guards a re-allocation).
        tables = r.tables if r.state in ("running", "loading", "ready") else r.released
        where = [
            {**left, **{b: j for j, b in enumerate(row) if b != NULL_BLOCK}}
            for left, row in zip(r.left, tables, strict=True)
        ]
        self.store_pos[job.job_id] = [
            (g, [where[g].get(b, -1) for b in gb], cb) for g, gb, cb in transfers
        ]
        self.inflight_ids.add(job.job_id)
        return job.job_id, transfers

    def _workers(self, plan: Any) -> None:
        """The workers' part of the step: one :meth:`TransferEngine.step` call with the plan
        (it submits the previous step's stores, completes the flush set, submits the loads and
        queues this step's stores for the next step)."""
        assert self.xfer is not None
        stores = [self._track_store(job) for job in plan.stores]
        loads = []
        for job in plan.loads:
            transfers = [(int(g), list(gb), list(cb)) for g, gb, cb in job.transfers]
            self.jobs[job.job_id] = ("load", job.request_id, transfers)
            self.inflight_ids.add(job.job_id)
            loads.append((job.job_id, transfers))
        self.result.flushed_jobs += len(plan.flush)
        flush = list(plan.flush) if self.cfg.fence != "off" else []
        t = time.perf_counter()
        self.xfer.step(stores, flush, loads)
        if flush:
            self.result.flush_wait_seconds += time.perf_counter() - t
            self.result.flush_steps += 1

    def _collect(self, *, block: bool) -> None:
        """Takes finished copies and completes them in the scheduler (loads are verified)."""
        if self.xfer is None:
            return
        if block and self.inflight_ids:
            self.xfer.wait(list(self.inflight_ids))
        results = sorted(self.xfer.poll(), key=lambda res: res.job_id)
        res_acc = self.result
        for res in results:
            self.inflight_ids.discard(res.job_id)
            self.store_ids.discard(res.job_id)
            kind, rid, transfers = self.jobs.pop(res.job_id)
            if res.ok:
                if kind == "store":
                    self._verify_store(rid, res.job_id)
                    res_acc.bytes_stored += res.bytes
                    res_acc.store_seconds += res.seconds
                    res_acc.store_jobs += 1
                else:
                    res_acc.bytes_loaded += res.bytes
                    res_acc.load_seconds += res.seconds
                    res_acc.load_jobs += 1
            else:
                res_acc.failed_jobs += 1
            assert self.sched is not None
            done = self._sc(self.sched.complete, res.job_id, 0, res.ok)
            if done is not None:
                self.vllm_rule.completed(done.job_id)
            if done is None or kind != "load":
                continue
            r = self.reqs[rid]
            if r.load_job != res.job_id:  # pragma: no cover - a simulator bug
                raise SimError(f"load {res.job_id} completed for {rid}, which waits for no load")
            del self.loading[rid]
            r.load_job = None
            if done.ok:
                self._verify_load(r, res.job_id, transfers)
                r.computed = r.load_end
                res_acc.cpu_hit_tokens += r.load_end - r.load_hit
                self._register(r)
            else:
                r.computed = r.load_hit
                if self._window_gap(r):
                    self._readmit(r)
                    continue
            r.state = "ready"
            self.ready.append(r)
        self.ready.sort(key=lambda q: self.order[q.id])

    def _forward(self, scheduled: list[tuple[_Req, int, int]]) -> None:
        """Writes the oracle's bytes for every token computed this step."""
        if not scheduled:
            return
        bs = self.bs
        pos_l, par_l, tok_l = [], [], []
        blk_l: list[list[npt.NDArray[np.int64]]] = [[] for _ in range(self.ng)]
        res = self.result
        for r, start, n in scheduled:
            pos = np.arange(start, start + n, dtype=np.int64)
            pos_l.append(pos)
            par_l.append(r.stream.parents[pos // bs])
            tok_l.append(r.stream.tokens[pos])
            for g in range(self.ng):
                blk_l[g].append(np.asarray(r.tables[g], dtype=np.int64)[pos // bs])
            decode = max(0, start + n - max(r.prompt_len, r.max_computed))
            res.decode_tokens += decode
            res.prefill_tokens += n - decode
            r.max_computed = max(r.max_computed, start + n)
        pos = np.concatenate(pos_l)
        par = np.concatenate(par_l)
        tok = np.concatenate(tok_l)
        off = pos % bs

        for g in range(self.ng):
            blk = np.concatenate(blk_l[g])
            if (blk == NULL_BLOCK).any():  # pragma: no cover - a simulator bug
                raise SimError(f"step {self.step_no}: a computed token maps to the null block")
            for layer in range(self.cfg.num_layers):
                vals = token_bytes(par, pos, tok, g, layer, self.width)
                if self.kv_np is not None:
                    self.kv_np[layer][blk, off] = vals
                else:
                    t = self.kv[layer]
                    t[torch.from_numpy(blk).to(t.device), torch.from_numpy(off).to(t.device)] = (
                        torch.from_numpy(vals).to(t.device)
                    )

    def _outputs(self, batch: list[tuple[_Req, bool]]) -> None:
        """Processes one step's outputs: cache registration, sampled tokens, new hashes and
        finished requests."""
        for r, sampled in batch:
            if r.done:
                continue
            self._register(r)
            if not sampled:
                continue
            r.inflight -= 1
            r.num_output += 1
            if self.sched is not None:
                n = r.known // self.bs
                if n > r.hashes_sent:
                    new = r.stream.hash_list[r.hashes_sent : n]
                    r.hashes_sent = n
                    self._sc(self.sched.extend_hashes, r.id, new)
            if r.num_output >= r.output_len:
                self._finish(r)

    def _finish(self, r: _Req) -> None:
        r.done = True
        r.state = "done"
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:  # preempted while its last output was in flight
            self.waiting.remove(r)
        self._release_all(r)
        self.finished_ids.append(r.id)
        self.num_done += 1
        for fid in self.followers.get(r.id, ()):
            f = self.reqs[fid]
            heapq.heappush(self.arrivals, (self.step_no + f.spec.arrival, self.order[fid], fid))
        if self.progress is not None:
            self.progress(self.num_done, len(self.specs), self.step_no)

    # ------------------------------------------------------------------ verification

    def _expected(self, r: _Req, g: int, positions: Sequence[int], layer: int) -> np.ndarray:
        bs = self.bs
        pos = (np.asarray(positions, dtype=np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
        return r.stream.content(pos, g, layer, self.width).reshape(len(positions), bs, self.width)

    def _actual(self, blocks: Sequence[int], layer: int) -> np.ndarray:
        idx = np.asarray(blocks, dtype=np.int64)
        if self.kv_np is not None:
            return self.kv_np[layer][idx]
        return self.kv[layer][torch.from_numpy(idx).to(self.device)].cpu().numpy()

    def _compare(
        self, r: _Req, g: int, blocks: list[int], positions: list[int]
    ) -> npt.NDArray[np.bool_]:
        bad = np.zeros(len(blocks), dtype=bool)
        for layer in range(self.cfg.num_layers):
            exp = self._expected(r, g, positions, layer)
            bad |= (self._actual(blocks, layer) != exp).reshape(len(blocks), -1).any(axis=1)
        return bad

    def _verify_load(self, r: _Req, job: int, transfers: list[tuple[int, list[int], list[int]]]):
        bpc = self.cfg.blocks_per_chunk
        for g, gpu, _cpu in transfers:
            where = {b: j for j, b in enumerate(r.tables[g]) if b != NULL_BLOCK}
            positions = []
            for b in gpu:
                if b not in where:
                    raise SimError(f"load {job} of {r.id} writes block {b}, not in its table")
                positions.append(where[b])
            bad = self._compare(r, g, gpu, positions)
            self.result.blocks_verified += len(gpu)
            seen: set[int] = set()
            for k in np.flatnonzero(bad):
                chunk = positions[k] // bpc
                if chunk not in seen:
                    seen.add(chunk)
                    self.result.mismatches += 1
                    self._detail("load", r, g, positions[k], gpu[k], job)

    def _verify_store(self, rid: str, job: int) -> None:
        """Diagnostic: compares what a store wrote to the CPU pool with the oracle."""
        assert self.xfer is not None
        r = self.reqs[rid]
        for g, positions, cpu in self.store_pos.pop(job):
            for layer in range(self.cfg.num_layers):
                region = self.xfer.cpu_region(g, layer).numpy()
                got = region[np.asarray(cpu)].reshape(len(cpu), self.bs, self.width)
                for k, pos in enumerate(positions):
                    if pos < 0:
                        self.result.torn_stores += 1
                        continue
                    exp = self._expected(r, g, [pos], layer)[0]
                    if not np.array_equal(got[k], exp):
                        self.result.torn_stores += 1
                        if len(self.result.mismatch_details) < 100:
                            self._detail("store", r, g, pos, -1, job)

    def _verify_hits(self, r: _Req, hit_tables: list[list[int]]) -> None:
        for g, row in enumerate(hit_tables):
            pairs = [(b, j) for j, b in enumerate(row) if b != NULL_BLOCK]
            if not pairs:
                continue
            blocks = [b for b, _ in pairs]
            positions = [j for _, j in pairs]
            bad = self._compare(r, g, blocks, positions)
            self.result.hit_blocks_verified += len(blocks)
            for k in np.flatnonzero(bad):
                self.result.hit_mismatches += 1
                self._detail("hit", r, g, positions[k], blocks[k], None)

    def _detail(self, kind: str, r: _Req, g: int, pos: int, block: int, job: int | None) -> None:
        if len(self.result.mismatch_details) < 100:
            self.result.mismatch_details.append(
                Mismatch(
                    kind=kind,
                    request=r.id,
                    group=g,
                    chunk=pos // self.cfg.blocks_per_chunk,
                    position=pos,
                    block=int(block),
                    step=self.step_no,
                    job=job,
                )
            )


def simulate(
    cfg: SimConfig,
    specs: Sequence[RequestSpec] | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> SimResult:
    """Runs one simulation; see :class:`Simulator`."""
    return Simulator(cfg, specs, progress).run()
