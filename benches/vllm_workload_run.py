"""One run of ``benches/vllm_workload.py``: the connector timers, the fake worker
that completes the plans' jobs, the step loop (:func:`run_workload`) and the comparison of two
runs (:func:`compare`). See that file's docstring.
"""

from __future__ import annotations

import array
import cProfile
import gc
import importlib
import io
import os
import pstats
import random
import statistics
import time
import types
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_workload_gen import Conversations, Workload, _import_vllm, build_scheduler

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


# ----------------------------------------------------------------------------- timing


def calibrate(clock: Callable[[], float], n: int = 2000) -> float:
    """The median of ``n`` empty intervals of ``clock`` (seconds)."""
    empty = []
    for _ in range(n):
        t = clock()
        empty.append(clock() - t)
    return statistics.median(empty)


class Timers:
    """Wraps a connector instance's scheduler-side methods with timers (outermost calls)."""

    def __init__(
        self, conn: Any, profile: cProfile.Profile | None = None, clock: str = "cpu"
    ) -> None:
        self.conn = conn
        self.clock = CLOCKS[clock]
        # What one timed interval reads with nothing inside it (two clock reads: on this VM
        # the thread clock is a system call of about 1.4 us), subtracted from every call so
        # that a connector's per-step time does not grow with the number of its calls.
        self.overhead = calibrate(self.clock)
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.step = 0.0
        self.step_gc = 0.0  # GC pauses inside this step's calls (included in ``step``)
        self.depth = 0
        self.profile = profile
        self.loaded: dict[str, int] = {}  # request -> external tokens vLLM allocated
        self.local: dict[str, int] = {}  # request -> GPU prefix-cache hit at its last lookup
        # Python's garbage collector runs when allocations pass a threshold, whoever made
        # them: its pauses inside timed calls are counted per method (``gc_ms``; included in
        # the method's time) and per step (``step_gc``), so that the connector's own cost can
        # be told from the engine's GC.
        self.gc = 0.0
        self.gc_pauses = 0
        self.gc_total: dict[str, float] = {}
        self._gc_start = 0.0
        # KVOFFLOAD_BENCH_TRACE=FILE: every outermost call's name and CLOCK_MONOTONIC interval
        # is written to FILE at close, to pick the connector's samples out of a
        # `perf record -k CLOCK_MONOTONIC` profile of the whole run (benches/ab/perf_calls.py).
        self.trace_path = os.environ.get("KVOFFLOAD_BENCH_TRACE")
        self.trace: list[tuple[str, float, float]] = []
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
                self.gc_pauses += 1

    def close(self) -> None:
        """Stops counting GC pauses."""
        gc.callbacks.remove(self._gc_pause)
        if self.trace_path:
            with open(self.trace_path, "w") as f:
                f.writelines(f"{n} {a:.9f} {b:.9f}\n" for n, a, b in self.trace)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = self.clock
        total, calls, gc_total = self.total, self.calls, self.gc_total
        total[name] = 0.0
        calls[name] = 0
        gc_total[name] = 0.0
        record_loads = name == "update_state_after_alloc"
        record_local = name == "get_num_new_matched_tokens"
        trace = self.trace if self.trace_path else None

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth = 1
            prof = self.profile
            if prof is not None:
                prof.enable()
            gc0 = self.gc
            t0 = time.perf_counter() if trace is not None else 0.0
            t = clock()
            try:
                out = fn(*args, **kwargs)
                if isinstance(out, types.GeneratorType):
                    out = list(out)  # vLLM's take_events yields: its work runs when drained
            finally:
                dt = max(0.0, clock() - t - self.overhead)
                if prof is not None:
                    prof.disable()
                self.depth = 0
                if trace is not None:
                    trace.append((name, t0, time.perf_counter()))
                total[name] += dt
                gc_total[name] += self.gc - gc0
                calls[name] += 1
                self.step += dt
                self.step_gc += self.gc - gc0
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

    def __init__(
        self, connector: str, seed: int, module: str = "kvoffload.integrations.vllm"
    ) -> None:
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
            # The report class of the adapter under test (its scheduler side checks it).
            self._ours_meta = importlib.import_module(module).KvOffloadWorkerMetadata

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
    step_gc_ms: list[float] = field(default_factory=list)  # GC pauses inside step_ms
    gc_pauses: int = 0  # collections that ran inside the connector's calls (timed steps)
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
        """Per-step median, p90 and mean (the connector's total time over the timed steps /
        their number) over the timed steps (after ``warmup``); the same without the GC pauses
        inside the connector's calls, and those pauses alone."""
        warmup = self.warmup if warmup is None else warmup
        timed = slice(warmup, None) if self.step_ms[warmup:] else slice(None)
        xs = sorted(self.step_ms[timed])
        gcs = self.step_gc_ms[timed]
        nogc = sorted(x - g for x, g in zip(self.step_ms[timed], gcs, strict=True))
        es = sorted(self.engine_ms[timed])
        return {
            "median_ms": statistics.median(xs) if xs else 0.0,
            "p90_ms": xs[int(0.9 * (len(xs) - 1))] if xs else 0.0,
            "mean_ms": statistics.fmean(xs) if xs else 0.0,
            "median_nogc_ms": statistics.median(nogc) if nogc else 0.0,
            "mean_nogc_ms": statistics.fmean(nogc) if nogc else 0.0,
            "gc_ms_per_step": statistics.fmean(gcs) if gcs else 0.0,
            "gc_steps": sum(1 for g in gcs if g > 0),
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
    """Runs ``w.steps`` engine steps of the workload with ``connector`` alone."""
    run = WorkloadRun(w, connector, profile)
    for step in range(w.steps):
        run.step(step)
    return run.close()


def lockstep(runs: list[WorkloadRun], steps: int) -> None:
    """Steps ``runs`` (one engine each, in one process) through ``steps`` steps in lockstep:
    step ``k`` of every run before step ``k + 1`` of any, which one goes first alternating
    by step, so the machine's drift hits all of them alike. Each run's decisions depend on
    its own state only (seeded workload, its own scheduler and connector): its results are
    those of a run alone (``tests/vllm/test_workload_bench.py`` checks it)."""
    for step in range(steps):
        for run in runs if step % 2 == 0 else reversed(runs):
            run.step(step)


def run_interleaved(w: Workload, connectors: list[str]) -> dict[str, RunResult]:
    """Runs the workload with every connector of ``connectors`` at once, in :func:`lockstep`;
    the bench's core."""
    runs = [WorkloadRun(w, c) for c in connectors]
    lockstep(runs, w.steps)
    return {run.res.connector: run.close() for run in runs}


class WorkloadRun:
    """One run of the workload, a step at a time (``benches/ab/vllm_ab.py`` interleaves two)."""

    def __init__(
        self,
        w: Workload,
        connector: str,
        profile: bool = False,
        module: str = "kvoffload.integrations.vllm",
    ) -> None:
        self.w = w
        self.v = _import_vllm()
        self.s, self.hasher = build_scheduler(w, connector, module)
        conn = self.s.get_kv_connector()
        self.prof = cProfile.Profile() if profile else None
        self.timers = Timers(conn, self.prof, w.clock)
        self.clock = self.timers.clock
        self.worker = FakeWorker(connector, w.seed, module)
        self.convs = Conversations(w)
        self.res = RunResult(
            connector, w.b, w.attention, w.steps, w.warmup, cpu_capacity=_capacity(conn, connector)
        )
        # 2B live conversations: their context so far and next turn; ready ones queue for a
        # slot.
        n_slots = w.conversations_per_slot * w.b
        self.next_cid = n_slots
        self.context: dict[int, array.array] = {}
        self.turn_of: dict[int, int] = {}
        self.ready: deque[tuple[int, int]] = deque((0, k) for k in range(n_slots))
        self.waiting: list[tuple[int, int]] = []  # idle conversations: (ready step, cid)
        self.inflight: dict[str, tuple[int, Any, array.array]] = {}  # rid -> (cid, req, answer)
        self.params_cache: dict[int, Any] = {}

    def submit(self, cid: int) -> float:
        """Adds conversation ``cid``'s next turn; returns the seconds in ``add_request`` (the
        request's block hashes are computed before, untimed, as a frontend would)."""
        v, res = self.v, self.res
        c = self.convs.get(cid)
        t = self.turn_of.get(cid, 0)
        ctx = self.context.get(cid, array.array("H")) + c.turns[t].user
        self.context[cid] = ctx
        answer = c.turns[t].answer
        n = len(answer)
        sp = self.params_cache.get(n)
        if sp is None:
            sp = self.params_cache[n] = v.SamplingParams(max_tokens=n, ignore_eos=True)
        rid = f"c{cid}t{t}"
        req = v.Request(
            request_id=rid,
            prompt_token_ids=ctx.tolist(),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.inflight[rid] = (cid, req, answer)
        res.submitted += 1
        res.prompt_tokens += len(ctx)
        t_add = self.clock()
        self.s.add_request(req)
        return self.clock() - t_add

    def step(self, step: int) -> None:
        """Engine step ``step`` (0, 1, ... in order)."""
        w, v, s, res, timers, clock = self.w, self.v, self.s, self.res, self.timers, self.clock
        inflight, waiting, ready = self.inflight, self.waiting, self.ready
        timers.step = timers.step_gc = 0.0
        if step == w.warmup:
            timers.gc_pauses = 0
        # Idle conversations whose gap is over join the queue (ordered by ready step, id).
        if waiting:
            due = sorted(x for x in waiting if x[0] <= step)
            if due:
                waiting[:] = [x for x in waiting if x[0] > step]
                ready.extend(due)
        adding = 0.0
        while ready and len(inflight) < w.b:
            adding += self.submit(ready.popleft()[1])
        t1 = clock()
        so = s.schedule()
        t2 = clock()
        res.preemptions += len(so.preempted_req_ids or ())
        loads_before = self.worker.load_jobs
        report, recv = self.worker.step(step, so.kv_connector_metadata)
        res.step_loads.append(self.worker.load_jobs - loads_before)
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
        res.step_gc_ms.append(1e3 * timers.step_gc)
        res.engine_ms.append(1e3 * (adding + (t2 - t1) + (t4 - t3)))
        for rid in [r for r in ids if inflight[r][1].is_finished()]:
            cid, req, answer = inflight.pop(rid)
            res.finished.append(rid)
            self.context[cid] = self.context[cid] + answer
            c = self.convs.get(cid)
            t = self.turn_of.get(cid, 0)
            gap = c.turns[t].gap
            if t + 1 < len(c.turns):
                self.turn_of[cid] = t + 1
                waiting.append((step + 1 + gap, cid))
            else:
                self.context.pop(cid, None)
                self.turn_of.pop(cid, None)
                self.convs.cache.pop(cid, None)
                waiting.append((step + 1 + gap, self.next_cid))
                self.next_cid += 1

    def close(self) -> RunResult:
        """The run's result; shuts the engine down."""
        res, timers, worker = self.res, self.timers, self.worker
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
        res.gc_pauses = timers.gc_pauses
        res.load_jobs = worker.load_jobs
        res.store_jobs = worker.store_jobs
        res.stored_blocks = dict(sorted(worker.stored_blocks.items()))
        res.loaded_blocks = dict(sorted(worker.loaded_blocks.items()))
        res.loaded = dict(timers.loaded)
        res.local = dict(timers.local)
        res.loaded_tokens = sum(timers.loaded.values())
        timers.close()
        if self.prof is not None:
            buf = io.StringIO()
            pstats.Stats(self.prof, stream=buf).sort_stats("cumulative").print_stats(25)
            res.profile = buf.getvalue()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.s.shutdown()
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
