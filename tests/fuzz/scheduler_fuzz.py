"""Random-call fuzzer of the offloading scheduler with a ground-truth byte model.

A small simulated paged engine drives the scheduler as a real one would, and every worker has its
own GPU memory (block -> content) and CPU memory (group, CPU block -> content). Nothing here
trusts the scheduler's own bookkeeping: the truth is the content.

Engine:
  * KV groups: one full-attention group, optionally a sliding-window group (window a few chunks);
    4-token blocks; 1 or 2 blocks per chunk; block 0 is the null block. One free list of blocks
    shared by the groups (so block ids are unique across groups, as the fence requires).
  * A GPU prefix cache: a block whose content is complete is registered under (group, chained
    hash). Freed blocks keep content and registration until they are taken from the free list for
    new content; a request with the same chained hashes re-uses them read-only (not written).
  * Requests: a few families of system prompts, follow-up turns that extend a finished request's
    tokens, chunked prefill, decode; chained hashes per full block reported with
    ``extend_hashes`` eagerly, late, or only with the finish; sliding-window blocks freed (null in
    the engine's table) as they leave the window and re-allocated at once; finish, abort,
    preemption (when blocks run out, and at random) and resumption (``lookup`` + ``allocate``
    with a GPU hit and a CPU load, or ``StepInput.resumed`` with a whole new block table).

Truth: a full block at position ``p`` of group ``g`` of a request holds ``(g, H[p])`` where ``H``
is the chained hash of blocks ``0..p``; a partial block holds a distinct "partial" marker.

Workers (1-3): a step's stores are submitted at the start of the next step (after the forward
pass that filled them), loads when their plan is handed out; each executes at a moment drawn
0-3 steps after its natural submission, and each worker reports each job once, 0-4 steps after
that, in random order across workers, sometimes duplicated, sometimes failed, through
``complete`` or ``complete_many``. A job in a plan's flush set is submitted (if it was not yet)
and executed on every worker before that step's forward pass. Execution and report times come
from a stream seeded by the job id alone, so flushes never change what the scheduler sees: a run
with a superset ``written`` (or ``written=None``) must plan exactly the same stores.

Checks, after every call and at every copy:
  1. a load reads CPU content equal to the truth of the positions it fills;
  2. a store that completes successfully left the truth of its keys in every worker's CPU slots;
  3. no CPU slot is written while a load that reads it (or another submitted store that writes
     it) has not executed; no GPU block is written (by a forward pass or a load) while a job that
     reads or writes it has not executed, unless it is the request's own store planned this step;
  4. loads and stores of a plan are new jobs (never one from before a reset, never a cancelled
     load); a flush set holds only jobs handed out earlier or in this plan (pre-reset ones only in
     the first plan after the reset that flushed them); ``reset()`` reports exactly the pending
     jobs handed out and the pending loads; late reports of pre-reset jobs return None and change
     nothing; every report completes a job exactly when the last worker reports it;
  5. after finishing every request and draining: no pending job, armed pair, tracked request,
     loading request, pinned or storing slot (invariant 6).
Also: a forward pass reads its context (full attention: every earlier block; sliding window: the
window) and it must hold the truth on every worker; a prefix-cache hit must hold the truth; each
flushed job (not from a reset) touches a written block through a pair the fence had armed
(invariant 2); a plan's load fills exactly the blocks the engine allocated for it.

Invalid calls are interleaved at random (unknown ids, wrong types, out-of-range or repeated blocks,
a request released twice or scheduled and released, a load size no lookup returned, completions
of unknown or completed jobs, bad worker ranks, complete_many with one bad report, ...): each must
raise a :class:`~kvoffload.errors.KvOffloadError` and leave the observable state unchanged.

Usage: ``run(seed, steps, **options)`` returns counters (see :class:`Options`); the command line
``python -m tests.fuzz.scheduler_fuzz --seeds 2000`` runs many seeds with varied options.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

from kvoffload.errors import (
    DuplicateReportError,
    InternalError,
    KvOffloadError,
    UnknownRequestError,
)
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput

BS = 4  # tokens per block (and per hash block)
NULL = 0  # the engine's null block
_MASK = (1 << 62) - 1
_ROOT = 0x5EED_5EED


class FuzzViolationError(AssertionError):
    """A ground-truth check failed (bytes torn, stale or lost) or the API contract was broken."""


@dataclass
class Options:
    """What :func:`run` accepts as keyword options.

    Attributes:
        window: Sliding window of a second KV group in tokens, or None (full attention only).
        blocks_per_chunk: GPU blocks per chunk (1 or 2).
        workers: Workers (tensor-parallel ranks) reporting each job.
        written: ``"exact"`` (the blocks truly written), ``"superset"`` (every block of every
            table and random others) or ``"conservative"`` (``written=None``).
        num_gpu_blocks: GPU blocks (None: sized from the groups).
        cpu_chunks: CPU slots per group.
        policy: ``"lru"`` or ``"arc"``.
        max_loading_requests: Load backpressure of the scheduler (0: none).
        debug_skip_deferred_arming: The deliberately broken fence (mutation check).
        raise_on_violation: Raise :class:`FuzzViolationError` at the first data violation; otherwise
            count them (``violations`` and ``violation_kinds`` in the result). Contract
            violations (wrong answers of the API) always raise.
        reset_rate: Probability of a reset at each call point.
        invalid_rate: Probability of an invalid call at each call point.
        fail_rate: Probability that a worker fails a job.
        dup_rate: Probability that a worker's report is duplicated.
        max_running: Most requests holding blocks at once.
        skip_flush_rate: Self-test of the checks: the workers skip each flushed job with this
            probability (a broken data plane); the checks must fire.
    """

    window: int | None = None
    blocks_per_chunk: int = 1
    workers: int = 2
    written: str = "exact"
    num_gpu_blocks: int | None = None
    cpu_chunks: int = 12
    policy: str = "lru"
    max_loading_requests: int = 0
    debug_skip_deferred_arming: bool = False
    raise_on_violation: bool = True
    reset_rate: float = 0.004
    invalid_rate: float = 0.04
    fail_rate: float = 0.03
    dup_rate: float = 0.06
    max_running: int = 6
    skip_flush_rate: float = 0.0


def options_for_seed(seed: int) -> dict[str, Any]:
    """A varied option set derived from the seed (every combination recurs every 36 seeds)."""
    rng = random.Random(f"options/{seed}")
    window = (None, rng.choice([8, 12, 16, 24]))[seed % 2]
    return {
        "window": window,
        "blocks_per_chunk": 1 + (seed // 2) % 2,
        "workers": 1 + (seed // 4) % 3,
        "written": ("exact", "superset", "conservative")[(seed // 12) % 3],
        "cpu_chunks": rng.choice([6, 10, 16, 24]),
        "policy": rng.choice(["lru", "arc"]),
        "max_loading_requests": rng.choice([0, 0, 1, 2]),
    }


def _chain(prev: int, block: tuple[int, ...]) -> int:
    return (hash((prev, block)) & _MASK) or 1


class _Req:
    """One request as the engine sees it."""

    def __init__(self, rid: str, tokens: list[int], prompt_len: int, hash_mode: str) -> None:
        self.id = rid
        self.tokens = tokens  # every token it will ever have (prompt, then outputs)
        self.prompt_len = prompt_len
        self.known = prompt_len  # tokens known so far (prompt + sampled)
        self.computed = 0  # tokens whose KV the engine holds
        self.H: list[int] = []  # chained hashes of the full blocks of known tokens
        self.reported = 0  # hashes given to the scheduler
        self.hash_mode = hash_mode  # "eager", "lag", "finish"
        self.state = "waiting"  # waiting, loading, running, finished, aborted
        self.sched_status = "waiting"  # what the scheduler must say
        self.tables: list[list[int]] | None = None
        self.load: int | None = None
        self.load_hit = 0
        self.load_end = 0
        self.released = False  # arming model: released and not re-acquired
        self.releases = 0
        self.lookup: tuple[int, int, int | None] | None = None  # (sched step, hit, answer)


class _Job:
    """One job as the engine and the workers see it."""

    def __init__(self, jid: int, kind: str, rid: str, gen: int, workers: int) -> None:
        self.id = jid
        self.kind = kind
        self.rid = rid
        self.gen = gen  # reset generation at creation
        self.transfers: list[tuple[int, list[int], list[int]]] = []
        self.keys: list[tuple[int, list[int]]] = []
        self.planned = False
        self.plan_step = -1
        self.exec_at = [0] * workers
        self.report_at = [0] * workers
        self.oks = [True] * workers
        self.dups = [False] * workers
        self.submitted = [False] * workers
        self.executed = [False] * workers
        self.reported: set[int] = set()
        self.done = False
        self.cancelled = False
        self.blocks: set[int] = set()
        self.sw_blocks: set[int] = set()
        self.slots: set[tuple[int, int]] = set()
        self.expected: dict[int, Any] = {}  # load: GPU block -> content it must bring
        self.truth: dict[tuple[int, int], Any] = {}  # store: CPU block -> content of its key
        self.armed0 = False
        self.releases0 = 0


class _Worker:
    def __init__(self) -> None:
        self.gpu: dict[int, Any] = {}
        self.cpu: dict[tuple[int, int], Any] = {}
        self.open_gpu: dict[int, set[int]] = defaultdict(set)  # block -> unexecuted jobs
        self.open_cpu: dict[tuple[int, int], set[int]] = defaultdict(set)
        self.queue: list[int] = []  # submitted, not executed


_STAT_IGNORED_FOR_LATE = ("late_reports",)


class Fuzzer:
    """One fuzzing run; see the module documentation."""

    def __init__(self, seed: int, opts: Options) -> None:
        self.seed = seed
        self.o = opts
        self.rng = random.Random(f"engine/{seed}")
        self.irng = random.Random(f"invalid/{seed}")
        self.srng = random.Random(f"superset/{seed}")
        self.frng = random.Random(f"skip-flush/{seed}")
        self.W = opts.workers
        self.bpc = opts.blocks_per_chunk
        self.window = opts.window
        self.ng = 2 if self.window else 1
        self.num_blocks = opts.num_gpu_blocks or (96 if self.ng == 1 else 160)
        groups = (KvGroup(BS),) + (
            (KvGroup(BS, sliding_window=self.window),) if self.window else ()
        )
        self.cfg = OffloadConfig(
            groups=groups,
            num_gpu_blocks=self.num_blocks,
            blocks_per_chunk=self.bpc,
            cpu_chunks=opts.cpu_chunks,
            policy=opts.policy,  # type: ignore[arg-type]
            num_workers=self.W,
            max_loading_requests=opts.max_loading_requests,
            null_block=NULL,
            debug_skip_deferred_arming=opts.debug_skip_deferred_arming,
        )
        self.s = OffloadScheduler(self.cfg)
        self.align = BS * self.bpc
        # Engine.
        self.free = list(range(1, self.num_blocks))
        self.rng.shuffle(self.free)
        self.ref = [0] * self.num_blocks
        self.cache: dict[tuple[int, int], int] = {}
        self.meta: dict[int, tuple[int, int]] = {}
        self.reqs: dict[str, _Req] = {}
        self.live: list[str] = []  # requests not finished / aborted, in arrival order
        self.parent: dict[int, int] = {}
        self.families = [
            [self.rng.randrange(1000) for _ in range(self.rng.choice([8, 12, 16, 20, 32]))]
            for _ in range(3)
        ]
        self.done_reqs: list[_Req] = []
        self.nreq = 0
        # Jobs and workers.
        self.jobs: dict[int, _Job] = {}
        self.gen = 0
        self.max_id = -1
        self.new_loads: list[int] = []  # loads created since the last plan
        self.to_submit: list[int] = []  # stores of the last plan
        self.allowed_flush: set[int] = set()  # pre-reset jobs the next plan may flush
        self.wk = [_Worker() for _ in range(self.W)]
        self.due: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.available: list[tuple[int, int, bool]] = []
        self.sched_steps = 0
        self.t = 0
        self.in_point = False
        self.pre_forward = False
        self.fwd_blocks: set[int] = set()
        self.alloc_since: set[int] = set()  # conservative mode's written set
        self.ok_store_keys: set[tuple[int, int]] = set()
        self.c: dict[str, Any] = defaultdict(int)
        self.c["violation_kinds"] = defaultdict(int)
        self.store_plan: list[tuple[int, str, tuple[tuple[int, tuple[int, ...]], ...]]] = []
        self.flush_sets: list[list[int]] = []

    # ------------------------------------------------------------------ failures

    def violation(self, kind: str, msg: str) -> None:
        self.c["violations"] += 1
        self.c["violation_kinds"][kind] += 1
        if self.o.raise_on_violation:
            raise FuzzViolationError(f"seed {self.seed} step {self.t}: {kind}: {msg}")

    def contract(self, ok: bool, msg: str) -> None:
        if not ok:
            raise FuzzViolationError(f"seed {self.seed} step {self.t}: contract: {msg}")

    # ------------------------------------------------------------------ calls

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.c["calls"] += 1
        return getattr(self.s, name)(*args, **kwargs)

    def snapshot(self) -> tuple[Any, ...]:
        statuses: dict[str, Any] = {}
        for rid in self.live + [r.id for r in self.done_reqs[-8:]]:
            try:
                statuses[rid] = self.s.status(rid)
            except UnknownRequestError:
                statuses[rid] = None
        return (
            self.s.stats(),
            self.s.pending_jobs(),
            self.s.armed_pairs,
            self.s.num_requests,
            statuses,
        )

    @staticmethod
    def _without(snap: tuple[Any, ...], keys: tuple[str, ...]) -> tuple[Any, ...]:
        stats = {k: v for k, v in snap[0].items() if k not in keys}
        return (stats, *snap[1:])

    def expect_error(self, what: str, thunk: Callable[[], Any]) -> None:
        """An invalid call: a KvOffloadError and no change."""
        self.c["invalid_calls"] += 1
        self.c["calls"] += 1
        before = self.snapshot()
        try:
            got = thunk()
        except InternalError as e:
            self.c["panics"] += 1
            self.contract(False, f"invalid call {what} panicked inside the core: {e}")
        except KvOffloadError:
            pass
        except BaseException as e:  # a PanicException is a BaseException
            self.contract(False, f"invalid call {what} raised {type(e).__name__}: {e}")
        else:
            self.contract(False, f"invalid call {what} was accepted (returned {got!r})")
        after = self.snapshot()
        self.contract(before == after, f"invalid call {what} changed state: {before} -> {after}")

    def point(self, deliver: bool = True) -> None:
        """A moment between two calls: reports, a reset or an invalid call may happen here."""
        if self.in_point:
            return
        self.in_point = True
        try:
            if deliver and self.available:
                self.deliver_some()
            if self.rng.random() < self.o.reset_rate:
                self.reset()
            if self.irng.random() < self.o.invalid_rate:
                self.invalid_call()
        finally:
            self.in_point = False

    # ------------------------------------------------------------------ tokens and hashes

    def ensure_hashes(self, r: _Req) -> None:
        while len(r.H) < r.known // BS:
            p = len(r.H)
            prev = r.H[-1] if r.H else _ROOT
            h = _chain(prev, tuple(r.tokens[p * BS : (p + 1) * BS]))
            self.parent[h] = prev
            r.H.append(h)

    def report_hashes(self, r: _Req) -> None:
        self.ensure_hashes(r)
        if r.reported < len(r.H):
            self.point()
            self.call("extend_hashes", r.id, r.H[r.reported :])
            r.reported = len(r.H)

    def add_request(self) -> None:
        rng = self.rng
        if self.done_reqs and rng.random() < 0.45:
            prev = rng.choice(self.done_reqs[-6:])
            prompt = prev.tokens[: prev.known] + [
                rng.randrange(1000) for _ in range(rng.randint(1, 10))
            ]
        else:
            fam = rng.choice(self.families)
            prompt = fam + [rng.randrange(1000) for _ in range(rng.randint(1, 24))]
        prompt = prompt[:72]
        out = [rng.randrange(1000) for _ in range(rng.randint(1, 14))]
        rid = f"r{self.nreq}"
        self.nreq += 1
        r = _Req(rid, prompt + out, len(prompt), rng.choice(["eager", "eager", "lag", "finish"]))
        self.ensure_hashes(r)
        n = len(r.H) if rng.random() < 0.7 else rng.randint(0, len(r.H))
        self.point()
        self.call("add_request", rid, r.prompt_len, r.H[:n])
        r.reported = n
        self.reqs[rid] = r
        self.live.append(rid)
        self.c["requests"] += 1

    # ------------------------------------------------------------------ blocks

    def take(self) -> int:
        i = len(self.free) - 1 if self.rng.random() < 0.75 else self.rng.randrange(len(self.free))
        b = self.free.pop(i)
        m = self.meta.pop(b, None)
        if m is not None and self.cache.get(m) == b:
            del self.cache[m]
        self.ref[b] = 1
        self.alloc_since.add(b)
        return b

    def hold(self, b: int) -> None:
        if self.ref[b] == 0:
            self.free.remove(b)
        self.ref[b] += 1
        self.alloc_since.add(b)

    def unref(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free.append(b)

    def release(self, r: _Req) -> None:
        for t in r.tables or []:
            for b in t:
                if b != NULL:
                    self.unref(b)
        r.tables = None

    def mark_released(self, r: _Req) -> None:
        r.released = True
        r.releases += 1

    def gpu_hit(self, r: _Req) -> tuple[int, list[list[int]]]:
        """The engine's prefix-cache hit: tokens and the hit rows per group."""
        self.ensure_hashes(r)
        maxb = (r.known - 1) // BS
        j = 0
        while j < maxb and (0, r.H[j]) in self.cache:
            j += 1
        hb = j if self.rng.random() < 0.7 else self.rng.randint(0, j)
        w = self.window
        while w and hb > 0:
            first = max(0, hb * BS - w + 1) // BS
            if all((1, r.H[p]) in self.cache for p in range(first, hb)):
                break
            hb -= 1
        rows = [[self.cache[(0, r.H[p])] for p in range(hb)]]
        if w:
            first = max(0, hb * BS - w + 1) // BS
            rows.append([NULL] * first + [self.cache[(1, r.H[p])] for p in range(first, hb)])
        # A prefix-cache hit must hold the truth on every worker.
        for g, row in enumerate(rows):
            for p, b in enumerate(row):
                if b != NULL:
                    for wi, wk in enumerate(self.wk):
                        if wk.gpu.get(b) != (g, r.H[p]):
                            self.violation(
                                "cache",
                                f"worker {wi} block {b} cached as ({g}, pos {p}) of {r.id} holds "
                                f"{wk.gpu.get(b)}",
                            )
        return hb * BS, rows

    # ------------------------------------------------------------------ the step

    def step(self) -> None:
        rng = self.rng
        t = self.t
        w = self.window
        self.point()
        if rng.random() < 0.02:
            # The engine drops its GPU prefix cache (blocks keep their content, unregistered):
            # later prefixes come from the CPU tier.
            self.cache.clear()
            self.meta.clear()
        if len(self.live) < 9 and rng.random() < 0.5:
            self.add_request()
        finished: list[str] = []
        aborted: list[str] = []
        preempted: list[str] = []
        released: set[str] = set()
        # B: releases.
        for rid in list(self.live):
            r = self.reqs[rid]
            x = rng.random()
            if (
                r.state == "running"
                and r.computed >= r.known - 1
                and (r.known >= len(r.tokens) or x < 0.05)
            ):
                self.report_hashes(r)
                self.release(r)
                r.state = r.sched_status = "finished"
                finished.append(rid)
            elif x > 0.99:
                self.release(r)
                r.state = r.sched_status = "aborted"
                aborted.append(rid)
            elif r.state == "running" and x > 0.97:
                self.release(r)
                r.state, r.sched_status = "waiting", "preempted"
                preempted.append(rid)
                self.c["preemptions"] += 1
            else:
                continue
            released.add(rid)
            self.live.remove(rid)
            if r.state != "waiting":
                self.done_reqs.append(r)
            else:
                self.live.append(rid)
        # Sliding-window blocks that left the window are freed (null in the engine's table).
        if w:
            for rid in self.live:
                r = self.reqs[rid]
                if r.state != "running" or rng.random() < 0.2:
                    continue
                row = r.tables[1]  # type: ignore[index]
                for p in range(min(max(0, r.computed - w + 1) // BS, len(row))):
                    if row[p] != NULL:
                        self.unref(row[p])
                        row[p] = NULL
                        self.c["sw_frees"] += 1
        # C: admissions.
        scheduled: list[tuple[str, int]] = []
        forward: list[tuple[_Req, int, int]] = []
        new_blocks: list[tuple[str, int, list[int]]] = []
        resumed: list[str] = []
        admitted: set[str] = set()
        holding = sum(1 for rid in self.live if self.reqs[rid].tables is not None)
        for rid in list(self.live):
            r = self.reqs[rid]
            if r.state != "waiting" or rid in released:
                continue
            if len(admitted) >= 2 or holding >= self.o.max_running or rng.random() < 0.25:
                continue
            if r.sched_status == "preempted" and rng.random() < 0.25:
                if self.resume(r, scheduled, forward, new_blocks):
                    resumed.append(rid)
                    admitted.add(rid)
                    holding += 1
                continue
            if self.admit(r, scheduled, forward):
                admitted.add(rid)
                holding += 1
        # D: running requests compute; blocks run out -> preempt from the tail.
        for rid in list(self.live):
            r = self.reqs[rid]
            if r.state != "running" or rid in admitted or rid in released:
                continue
            if rng.random() < 0.1 or r.computed >= r.known:
                continue
            c0 = r.computed
            n = 1 if c0 == r.known - 1 else min(r.known - c0, rng.randint(1, 12))
            c1 = c0 + n
            tables = r.tables
            assert tables is not None
            need = [max(0, -(-c1 // BS) - len(row)) for row in tables]
            if rng.random() < 0.1:
                need = [x + 1 for x in need]
            while sum(need) > len(self.free):
                victims = [
                    v
                    for v in self.live
                    if self.reqs[v].state == "running"
                    and v not in admitted
                    and v != rid
                    and v not in {s for s, _ in scheduled}
                ]
                if not victims:
                    break
                v = self.reqs[victims[-1]]
                self.release(v)
                v.state, v.sched_status = "waiting", "preempted"
                preempted.append(v.id)
                released.add(v.id)
                self.c["preemptions"] += 1
            if sum(need) > len(self.free):
                continue
            for g, k in enumerate(need):
                if k:
                    fresh = [self.take() for _ in range(k)]
                    tables[g].extend(fresh)
                    new_blocks.append((rid, g, fresh))
            scheduled.append((rid, c1))
            forward.append((r, c0, c1))
        # E: hashes.
        for rid in list(self.live):
            r = self.reqs[rid]
            if r.hash_mode == "eager" or (r.hash_mode == "lag" and rng.random() < 0.35):
                self.report_hashes(r)
        # F: schedule.
        self.point()
        written = self.written(forward)
        rest: dict[str, Any] = {
            "new_blocks": new_blocks,
            "resumed": resumed,
            "finished": finished,
            "aborted": aborted,
            "preempted": preempted,
            "written": written,
        }
        if rng.random() < 0.3:  # the two parallel sequences instead of pairs
            ids, tokens = [a for a, _ in scheduled], [b for _, b in scheduled]
            inp = StepInput(request_ids=ids, computed_tokens=tokens, **rest)
        else:
            inp = StepInput(scheduled=scheduled, **rest)
        if self.irng.random() < 0.15:
            self.invalid_schedule(inp)
        for rid in finished + aborted + preempted:
            self.mark_released(self.reqs[rid])
        was_released = {rid: self.reqs[rid].released for rid in self.reqs}
        plan = self.call("schedule", inp)
        self.sched_steps += 1
        self.c["steps"] += 1
        for rid in resumed:
            self.reqs[rid].released = False
            self.reqs[rid].sched_status = "running"
        self.check_plan(plan, written, was_released)
        for r, _, c1 in forward:
            r.computed = c1
        # G: workers.
        self.workers_step(plan, forward, drain=False)
        # H: outputs.
        for r, c0, c1 in forward:
            if c1 >= r.known and r.known < len(r.tokens):
                r.known += 1
            self.ensure_hashes(r)
            for p in range(c0 // BS, c1 // BS):
                for g in range(self.ng):
                    self.register(r, g, p)
        self.make_available(2 * t + 1)
        self.point()
        self.check_events()
        self.check_statuses()
        self.t += 1

    def written(self, forward: list[tuple[_Req, int, int]]) -> list[int] | None:
        mode = self.o.written
        if mode == "conservative":
            return None
        out: list[int] = []
        for r, c0, c1 in forward:
            assert r.tables is not None
            for row in r.tables:
                out.extend(row[c0 // BS : -(-c1 // BS)])
        for jid in self.new_loads:
            j = self.jobs[jid]
            if not j.cancelled:
                out.extend(j.blocks)
        if mode == "superset":
            for rid in self.live:
                r = self.reqs[rid]
                for row in r.tables or []:
                    out.extend(b for b in row if b != NULL)
            out.extend(self.srng.randrange(self.num_blocks) for _ in range(self.srng.randint(0, 8)))
        self.srng.shuffle(out)
        return out

    def register(self, r: _Req, g: int, p: int) -> None:
        assert r.tables is not None
        b = r.tables[g][p]
        key = (g, r.H[p])
        if b != NULL and key not in self.cache and b not in self.meta:
            self.cache[key] = b
            self.meta[b] = key

    def admit(
        self, r: _Req, scheduled: list[tuple[str, int]], forward: list[tuple[_Req, int, int]]
    ) -> bool:
        rng = self.rng
        hit, rows = self.gpu_hit(r)
        self.point()
        ans = self.call("lookup", r.id, hit)
        r.lookup = (self.sched_steps, hit, ans)
        if ans is None:
            return False
        self.contract(
            isinstance(ans, int)
            and ans >= 0
            and (ans == 0 or (hit + ans) % self.align == 0)
            and hit + ans <= r.known,
            f"lookup({r.id}, {hit}) returned {ans!r} (known {r.known})",
        )
        w = self.window
        if ans > 0:
            end = hit + ans
            fresh_pos = [list(range(hit // BS, end // BS))]
            if w:
                first_end = max(0, end - w + 1) // BS
                fresh_pos.append(list(range(max(hit // BS, first_end), end // BS)))
        else:
            end = hit + min(r.known - hit, rng.randint(1, 16))
            last = -(-end // BS) + (1 if rng.random() < 0.2 else 0)
            fresh_pos = [list(range(hit // BS, last)) for _ in range(self.ng)]
        hit_free = sum(1 for row in rows for b in row if b != NULL and self.ref[b] == 0)
        if sum(map(len, fresh_pos)) + hit_free > len(self.free):
            return False
        # No report arrives between a lookup and its allocate (an engine does both in one
        # scheduling pass), but a reset may: the lookup is void, ask again next step.
        gen = self.gen
        self.point(deliver=False)
        if gen != self.gen:
            return False
        if self.irng.random() < 0.15:
            self.invalid_allocate(r, rows, fresh_pos, hit)
        for row in rows:
            for b in row:
                if b != NULL:
                    self.hold(b)
        tables: list[list[int]] = []
        for g, row in enumerate(rows):
            row = list(row)
            pos = fresh_pos[g]
            if pos:
                row += [NULL] * (pos[0] - len(row))
            row += [self.take() for _ in pos]
            tables.append(row)
        jid = self.call("allocate", r.id, tables, hit, ans)
        self.c["prefix_hit_tokens"] += hit
        r.tables = tables
        r.released = False
        r.sched_status = "running"
        r.lookup = None
        if ans == 0:
            self.contract(jid is None, f"allocate({r.id}) without a load returned {jid!r}")
            r.state = "running"
            r.computed = hit
            scheduled.append((r.id, end))
            forward.append((r, hit, end))
            return True
        self.contract(isinstance(jid, int) and jid > self.max_id, f"load id {jid!r} not new")
        self.max_id = jid
        j = _Job(jid, "load", r.id, self.gen, self.W)
        for g in range(self.ng):
            for p in fresh_pos[g]:
                b = tables[g][p]
                j.blocks.add(b)
                j.expected[b] = (g, r.H[p])
                if g == 1:
                    j.sw_blocks.add(b)
        j.armed0, j.releases0 = False, r.releases
        self.jobs[jid] = j
        self.new_loads.append(jid)
        if self.irng.random() < self.o.invalid_rate:
            # A report before the plan that hands the load out: refused, the plan still
            # carries it.
            ok = self.irng.random() < 0.5
            self.expect_error(
                f"complete(unplanned {jid}, ok={ok})", lambda: self.s.complete(jid, 0, ok)
            )
        r.state = "loading"
        r.load, r.load_hit, r.load_end = jid, hit, end
        r.computed = hit
        return True

    def resume(
        self,
        r: _Req,
        scheduled: list[tuple[str, int]],
        forward: list[tuple[_Req, int, int]],
        new_blocks: list[tuple[str, int, list[int]]],
    ) -> bool:
        """A preempted request resumes with a whole new block table (``StepInput.resumed``)."""
        end = min(r.known, self.rng.randint(1, 16))
        n = -(-end // BS)
        if n * self.ng > len(self.free):
            return False
        r.tables = [[self.take() for _ in range(n)] for _ in range(self.ng)]
        for g, row in enumerate(r.tables):
            new_blocks.append((r.id, g, list(row)))
        r.state = "running"  # the scheduler says "preempted" until this step's schedule()
        r.computed = 0
        scheduled.append((r.id, end))
        forward.append((r, 0, end))
        return True

    def recompute(self, r: _Req, hit: int) -> None:
        """The loaded tokens of ``r`` are not valid: recompute them in place, or re-admit the
        request when a sliding-window position it must now compute is null."""
        r.load = None
        r.computed = hit
        assert r.tables is not None
        w = self.window
        if w and NULL in r.tables[1][max(0, hit - w + 1) // BS :]:
            self.release(r)
            self.call("preempt", r.id)
            self.mark_released(r)
            r.state, r.sched_status = "waiting", "preempted"
            self.c["readmissions"] += 1
        else:
            r.state = "running"

    # ------------------------------------------------------------------ plans

    def check_plan(
        self, plan: Any, written: Sequence[int] | None, was_released: dict[str, Any]
    ) -> None:
        t = self.t
        live_loads = [j for j in self.new_loads if not self.jobs[j].cancelled]
        got_loads = [j.job_id for j in plan.loads]
        self.contract(got_loads == live_loads, f"plan loads {got_loads}, expected {live_loads}")
        for pj in plan.loads:
            j = self.jobs[pj.job_id]
            j.transfers = [(g, list(gb), list(cb)) for g, gb, cb in pj.transfers]
            got = {b for _, gb, _ in j.transfers for b in gb}
            self.contract(
                got == j.blocks and sum(len(gb) for _, gb, _ in j.transfers) == len(got),
                f"load {j.id} copies into {sorted(got)}, the engine allocated {sorted(j.blocks)}",
            )
            self.plan_job(j, natural_sub=2 * t)
        for pj in plan.stores:
            jid = pj.job_id
            self.contract(jid > self.max_id, f"store {jid} is not a new job (max {self.max_id})")
            self.max_id = jid
            r = self.reqs.get(pj.request_id)
            self.contract(r is not None, f"store {jid} of unknown request {pj.request_id}")
            assert r is not None
            j = _Job(jid, "store", r.id, self.gen, self.W)
            j.transfers = [(g, list(gb), list(cb)) for g, gb, cb in pj.transfers]
            j.keys = [(g, list(k)) for g, k in pj.keys]
            keys = dict(j.keys)
            for g, gb, cb in j.transfers:
                ks = keys.get(g, [])
                self.contract(
                    len(gb) == len(cb) == len(ks) * self.bpc,
                    f"store {jid} group {g}: {len(gb)} blocks, {len(ks)} keys",
                )
                for i, (b, c) in enumerate(zip(gb, cb, strict=True)):
                    self.contract(c % self.bpc == i % self.bpc, f"store {jid}: cpu block {c}")
                    h = ks[i // self.bpc]
                    for _ in range(self.bpc - 1 - i % self.bpc):
                        self.contract(h in self.parent, f"store {jid}: unknown key {h}")
                        h = self.parent[h]
                    self.contract(h in self.parent, f"store {jid}: unknown key {h}")
                    j.truth[(g, c)] = (g, h)
                    j.blocks.add(b)
                    if g == 1:
                        j.sw_blocks.add(b)
            j.armed0, j.releases0 = was_released.get(r.id, False), r.releases
            self.jobs[jid] = j
            self.plan_job(j, natural_sub=2 * t + 2)
            self.store_plan.append((jid, r.id, tuple((g, tuple(k)) for g, k in j.keys)))
            self.c["stores"] += 1
        # Flush set.
        flush = list(plan.flush)
        self.flush_sets.append(flush)
        self.c["flushes"] += len(flush)
        self.c["flush_steps"] += bool(flush)
        wset = set(self.alloc_since) if written is None else set(written)
        for jid in flush:
            fj = self.jobs.get(jid)
            if fj is None or not fj.planned:
                self.violation("plan", f"flush set names job {jid}, never handed to a worker")
                continue
            j = fj
            if j.gen < self.gen:
                if jid not in self.allowed_flush:
                    self.violation("plan", f"pre-reset job {jid} in a later plan's flush set")
                continue
            if jid in self.allowed_flush:
                continue
            # Invariant 2: a flushed job has an armed pair on a written block.
            r = self.reqs[j.rid]
            armed = j.armed0 or r.releases > j.releases0
            on = [b for b in j.blocks & wset if armed or b in j.sw_blocks]
            if not on:
                self.violation(
                    "minimal-flush",
                    f"job {jid} ({j.kind} of {j.rid}) flushed without an armed pair on a written "
                    f"block (blocks {sorted(j.blocks)}, armed deferred {armed})",
                )
            if j.kind == "load" and jid in got_loads and not r.released:
                self.violation("plan", f"load {jid} is in the flush set of its own step")
        self.allowed_flush = set()
        self.new_loads = []
        self.alloc_since = set()
        self.c["loads"] += len(got_loads)

    def plan_job(self, j: _Job, natural_sub: int) -> None:
        j.planned = True
        j.plan_step = self.t
        for g, _gb, cb in j.transfers:
            for c in cb:
                j.slots.add((g, c))
        trng = random.Random(f"timing/{self.seed}/{j.id}")
        for w in range(self.W):
            j.exec_at[w] = natural_sub + trng.randrange(7)
            j.report_at[w] = j.exec_at[w] + trng.choice([0, 0, 1, 1, 2, 3, 4, 6, 8])
            j.oks[w] = trng.random() >= self.o.fail_rate
            j.dups[w] = trng.random() < self.o.dup_rate
            self.due[j.report_at[w]].append((j.id, w))
            wk = self.wk[w]
            for b in j.blocks:
                wk.open_gpu[b].add(j.id)
            for s in j.slots:
                wk.open_cpu[s].add(j.id)

    # ------------------------------------------------------------------ workers

    def submit(self, j: _Job, w: int) -> None:
        if not j.submitted[w]:
            j.submitted[w] = True
            self.wk[w].queue.append(j.id)

    def workers_step(self, plan: Any, forward: list[tuple[_Req, int, int]], drain: bool) -> None:
        t = self.t
        stores = [pj.job_id for pj in plan.stores]
        self.fwd_blocks = {
            b
            for r, c0, c1 in forward
            for row in r.tables or []
            for b in row[c0 // BS : -(-c1 // BS)]
        }
        for w in range(self.W):
            self.pre_forward = True
            for jid in self.to_submit:
                self.submit(self.jobs[jid], w)
            for jid in plan.flush:
                j = self.jobs.get(jid)
                if j is None or not j.planned:
                    continue
                if self.o.skip_flush_rate and self.frng.random() < self.o.skip_flush_rate:
                    continue
                self.submit(j, w)
                if not j.executed[w]:
                    self.execute(j, w)
            for pj in plan.loads:
                self.submit(self.jobs[pj.job_id], w)
            self.run_due(w, 2 * t, drain)
            self.forward(w, forward)
            self.pre_forward = False
            self.run_due(w, 2 * t + 1, drain)
        self.to_submit = stores

    def run_due(self, w: int, now: int, drain: bool) -> None:
        wk = self.wk[w]
        due = [jid for jid in wk.queue if drain or self.jobs[jid].exec_at[w] <= now]
        due.sort(key=lambda jid: (self.jobs[jid].exec_at[w], jid))
        for jid in due:
            self.execute(self.jobs[jid], w)

    def execute(self, j: _Job, w: int) -> None:
        wk = self.wk[w]
        ok = j.oks[w]
        jobs = self.jobs
        if j.kind == "store":
            for g, gb, cb in j.transfers:
                for b, c in zip(gb, cb, strict=True):
                    slot = (g, c)
                    for o in wk.open_cpu.get(slot, ()):
                        other = jobs[o]
                        if o == j.id:
                            continue
                        if other.kind == "load":
                            self.violation(
                                "cpu-write-under-load",
                                f"worker {w}: store {j.id} writes CPU block {slot} that load "
                                f"{o} has not read yet",
                            )
                        elif other.submitted[w]:
                            self.violation(
                                "cpu-write-twice",
                                f"worker {w}: stores {j.id} and {o} both pending on CPU block "
                                f"{slot}",
                            )
                    wk.cpu[slot] = wk.gpu.get(b) if ok else ("garbage", j.id, w)
        else:
            for g, gb, cb in j.transfers:
                for b, c in zip(gb, cb, strict=True):
                    slot = (g, c)
                    content = wk.cpu.get(slot)
                    if content != j.expected[b]:
                        self.violation(
                            "stale-load",
                            f"worker {w}: load {j.id} of {j.rid} reads {content} from CPU block "
                            f"{slot}, truth {j.expected[b]}",
                        )
                    for o in wk.open_cpu.get(slot, ()):
                        if o != j.id and jobs[o].kind == "store" and jobs[o].submitted[w]:
                            self.violation(
                                "cpu-read-under-store",
                                f"worker {w}: load {j.id} reads CPU block {slot} that store {o} "
                                f"is writing",
                            )
                    for o in wk.open_gpu.get(b, ()):
                        other = jobs[o]
                        if o == j.id or (other.kind == "load" and not other.submitted[w]):
                            continue  # a load handed out later writes after this one
                        if (
                            # A store of this plan reads after this step's forward pass, which
                            # rewrites the block first.
                            self.pre_forward
                            and other.kind == "store"
                            and other.plan_step == self.t
                            and not other.submitted[w]
                            and b in self.fwd_blocks
                        ):
                            continue
                        self.violation(
                            "gpu-write-under-job",
                            f"worker {w}: load {j.id} writes block {b} that {other.kind} {o} of "
                            f"{other.rid} has not copied yet",
                        )
                    wk.gpu[b] = content if ok else ("garbage", j.id, w)
        j.executed[w] = True
        wk.queue.remove(j.id)
        for b in j.blocks:
            wk.open_gpu[b].discard(j.id)
        for s in j.slots:
            wk.open_cpu[s].discard(j.id)

    def forward(self, w: int, forward: list[tuple[_Req, int, int]]) -> None:
        wk = self.wk[w]
        win = self.window
        for r, c0, c1 in forward:
            assert r.tables is not None
            # The context this forward pass reads must hold the truth.
            for g, row in enumerate(r.tables):
                first = 0 if g == 0 else max(0, c0 - (win or 0) + 1) // BS
                for p in range(first, -(-c0 // BS)):
                    b = row[p]
                    want = (
                        (g, r.H[p]) if (p + 1) * BS <= c0 else ("partial", g, r.id, p, c0 - p * BS)
                    )
                    if b == NULL or wk.gpu.get(b) != want:
                        self.violation(
                            "context",
                            f"worker {w}: {r.id} computes tokens {c0}..{c1} reading block {b} "
                            f"(group {g}, pos {p}) = {wk.gpu.get(b)}, truth {want}",
                        )
            for g, row in enumerate(r.tables):
                for p in range(c0 // BS, -(-c1 // BS)):
                    b = row[p]
                    assert b != NULL, (r.id, g, p, row)
                    for o in wk.open_gpu.get(b, ()):
                        j = self.jobs[o]
                        if (
                            j.kind == "store"
                            and j.plan_step == self.t
                            and not j.submitted[w]
                            and j.rid == r.id
                        ):
                            continue  # its own chunk, copied after this forward pass
                        self.violation(
                            "torn",
                            f"worker {w}: forward pass of {r.id} writes block {b} (group {g}, "
                            f"pos {p}) while {j.kind} {o} of {j.rid} (plan {j.plan_step}) has not "
                            f"copied it",
                        )
                    if (p + 1) * BS <= c1:
                        wk.gpu[b] = (g, r.H[p])
                    else:
                        wk.gpu[b] = ("partial", g, r.id, p, c1 - p * BS)

    # ------------------------------------------------------------------ reports

    def make_available(self, now: int) -> None:
        for tm in sorted(tm for tm in self.due if tm <= now):
            for jid, w in self.due.pop(tm):
                assert self.jobs[jid].executed[w], (jid, w)
                self.available.append((jid, w, False))

    def deliver_some(self, everything: bool = False) -> None:
        rng = self.rng
        if not everything and rng.random() < 0.12:
            w = rng.randrange(self.W)
            batch = [e for e in self.available if e[1] == w and not e[2]]
            if batch:
                self.available = [e for e in self.available if e not in batch]
                self.deliver_many(w, [jid for jid, _, _ in batch])
                return
        keep: list[tuple[int, int, bool]] = []
        todo: list[tuple[int, int, bool]] = []
        for e in self.available:
            (todo if everything or rng.random() < 0.3 else keep).append(e)
        rng.shuffle(todo)
        self.available = keep
        for jid, w, dup in todo:
            self.deliver(jid, w, dup)

    def expected_completion(self, j: _Job, w: int) -> bool:
        """Records worker ``w``'s first report of ``j``; whether it completes the job."""
        j.reported.add(w)
        return len(j.reported) == self.W

    def deliver(self, jid: int, w: int, dup: bool) -> None:
        j = self.jobs[jid]
        ok = j.oks[w]
        self.c["reports"] += 1
        late = j.gen < self.gen
        if dup:
            self.c["duplicate_reports"] += 1
            before = self._without(self.snapshot(), _STAT_IGNORED_FOR_LATE)
            try:
                got = self.call("complete", jid, worker=w, ok=ok)
            except DuplicateReportError:
                self.contract(not late and not j.done, f"job {jid}: duplicate error after done")
            except KvOffloadError as e:
                self.contract(j.done and not late, f"job {jid} worker {w} duplicate: {e}")
            else:
                self.contract(late and got is None, f"duplicate report of {jid} returned {got}")
            after = self._without(self.snapshot(), _STAT_IGNORED_FOR_LATE)
            self.contract(before == after, f"duplicate report of {jid} changed state")
            return
        if j.dups[w]:
            self.available.append((jid, w, True))
        if not ok:
            self.c["failed_reports"] += 1
        if late:
            self.c["late_reports"] += 1
            before = self._without(self.snapshot(), _STAT_IGNORED_FOR_LATE)
            got = self.call("complete", jid, worker=w, ok=ok)
            self.contract(got is None, f"late report of pre-reset job {jid} returned {got}")
            after = self._without(self.snapshot(), _STAT_IGNORED_FOR_LATE)
            self.contract(before == after, f"late report of pre-reset job {jid} changed state")
            return
        done = self.expected_completion(j, w)
        got = self.call("complete", jid, worker=w, ok=ok)
        if not done:
            self.contract(got is None, f"job {jid} completed with {len(j.reported)} reports")
            return
        self.contract(got is not None, f"job {jid}: last report did not complete it")
        self.completed(j, got)

    def deliver_many(self, w: int, jids: list[int]) -> None:
        self.c["complete_many"] += 1
        fin = [jid for jid in jids if self.jobs[jid].oks[w]]
        bad = [jid for jid in jids if not self.jobs[jid].oks[w]]
        expected = []
        for jid in fin + bad:
            j = self.jobs[jid]
            self.c["reports"] += 1
            if j.dups[w]:
                self.available.append((jid, w, True))
            if j.gen < self.gen:
                self.c["late_reports"] += 1
                continue
            if self.expected_completion(j, w):
                expected.append(jid)
        got = self.call("complete_many", fin, bad, worker=w)
        ids = sorted(d.job_id for d in got)
        self.contract(ids == sorted(expected), f"complete_many completed {ids}, not {expected}")
        for d in got:
            self.completed(self.jobs[d.job_id], d)

    def completed(self, j: _Job, d: Any) -> None:
        ok = all(j.oks)
        self.contract(
            d.job_id == j.id and d.kind == j.kind and d.request_id == j.rid and d.ok == ok,
            f"completion {d} of job {j.id} ({j.kind} of {j.rid}, ok {ok})",
        )
        j.done = True
        if j.kind == "store":
            if ok:
                for wi, wk in enumerate(self.wk):
                    for slot, truth in j.truth.items():
                        if wk.cpu.get(slot) != truth:
                            self.violation(
                                "store-content",
                                f"worker {wi}: store {j.id} of {j.rid} completed with CPU block "
                                f"{slot} = {wk.cpu.get(slot)}, truth {truth}",
                            )
                self.ok_store_keys.update((g, k) for g, ks in j.keys for k in ks)
            else:
                self.c["failed_stores"] += 1
            return
        inval = sorted(d.invalid_blocks)
        want = [] if ok else sorted(j.blocks)
        self.contract(inval == want, f"load {j.id}: invalid_blocks {inval}, expected {want}")
        r = self.reqs[j.rid]
        if r.state != "loading" or r.load != j.id:
            return  # aborted or preempted while loading
        if ok:
            r.load = None
            r.computed = r.load_end
            assert r.tables is not None
            for g, row in enumerate(r.tables):
                for p in range(r.load_hit // BS, r.load_end // BS):
                    if row[p] != NULL:
                        self.register(r, g, p)
            if r.computed >= r.known and r.known < len(r.tokens):
                r.known += 1
                self.ensure_hashes(r)
            r.state = "running"
        else:
            self.c["failed_loads"] += 1
            self.recompute(r, r.load_hit)

    # ------------------------------------------------------------------ reset

    def reset(self) -> None:
        pending = [j for j in self.jobs.values() if j.gen == self.gen and not j.done]
        unplanned = {j.id for j in pending if not j.planned}
        want_flushed = sorted(j.id for j in pending if j.planned)
        want_cancelled = sorted(
            ((j.rid, j.id) for j in pending if j.kind == "load"), key=lambda x: x[1]
        )
        res = self.call("reset")
        self.c["resets"] += 1
        self.contract(
            sorted(res.flushed) == want_flushed,
            f"reset flushed {sorted(res.flushed)}, pending handed out {want_flushed}",
        )
        self.contract(
            sorted(res.cancelled_loads, key=lambda x: x[1]) == want_cancelled,
            f"reset cancelled {res.cancelled_loads}, pending loads {want_cancelled}",
        )
        self.gen += 1
        self.allowed_flush |= set(res.flushed)
        for j in pending:
            if j.id in unplanned:
                j.cancelled = True
        for rid in self.live:
            r = self.reqs[rid]
            r.lookup = None
            r.released = False  # the fence forgot every release
        self.c["cancelled_loads"] += len(res.cancelled_loads)
        for rid, jid in res.cancelled_loads:
            r = self.reqs[rid]
            if r.state == "loading" and r.load == jid:
                self.recompute(r, r.load_hit)

    # ------------------------------------------------------------------ state checks

    def check_statuses(self) -> None:
        for rid in self.live:
            r = self.reqs[rid]
            got = self.s.status(rid)
            self.contract(got == r.sched_status, f"{rid}: status {got}, expected {r.sched_status}")

    def check_events(self) -> None:
        for kind, g, keys, _medium in self.s.take_events():
            if kind == "stored":
                for k in keys:
                    self.contract(
                        (g, k) in self.ok_store_keys,
                        f"'stored' event for key {k} (group {g}) no store completed",
                    )
        self.ok_store_keys.clear()

    # ------------------------------------------------------------------ invalid calls

    def pick(self, states: tuple[str, ...]) -> _Req | None:
        c = [
            r
            for r in (self.reqs[x] for x in self.live)
            if r.state in states and (r.state != "running" or r.sched_status == "running")
        ]
        return self.irng.choice(c) if c else None

    def invalid_call(self) -> None:
        rng = self.irng
        s = self.s
        kind = rng.randrange(19)
        ghost = f"ghost-{rng.randrange(10**6)}"
        waiting = self.pick(("waiting",))
        running = self.pick(("running",))
        pending = [j for j in self.jobs.values() if j.gen == self.gen and not j.done and j.planned]
        unplanned = [
            j for j in self.jobs.values() if j.gen == self.gen and not j.done and not j.planned
        ]
        if kind == 16 and unplanned:
            j = rng.choice(unplanned)
            rank = rng.randrange(self.W)
            ok = rng.random() < 0.5
            self.expect_error(
                f"complete(unplanned {j.id}, ok={ok})", lambda: s.complete(j.id, rank, ok)
            )
            return
        if kind == 17 and (pending or unplanned):
            j = rng.choice(pending or unplanned)
            bad_ok: Any = rng.choice([None, 1, 0, "True", 1.0])  # wrong on purpose
            self.expect_error(f"complete(ok={bad_ok!r})", lambda: s.complete(j.id, 0, bad_ok))
            return
        if kind == 18 and pending:
            j = rng.choice(pending)
            bad_w: Any = rng.choice([None, 0.0, "0", True])  # wrong on purpose
            self.expect_error(
                f"complete_many(worker={bad_w!r})",
                lambda: s._core.complete_many([j.id], None, bad_w),
            )
            return
        if kind == 0:
            self.expect_error("lookup(unknown)", lambda: s.lookup(ghost, 0))
        elif kind == 1 and waiting:
            bad: Any = rng.choice(["4", -4, 2**40, None, 1.5])  # wrong on purpose
            self.expect_error(f"lookup(hit={bad!r})", lambda: s.lookup(waiting.id, bad))
        elif kind == 2 and running:
            self.expect_error("lookup(running)", lambda: s.lookup(running.id, 0))
        elif kind == 3:
            self.expect_error("allocate(unknown)", lambda: s.allocate(ghost, [[]] * self.ng, 0, 0))
        elif kind == 4 and running:
            rows = [[b] for b in self.free[: self.ng]]
            self.expect_error("allocate(running)", lambda: s.allocate(running.id, rows, 0, 0))
        elif kind == 5 and waiting:
            rows = [[b] for b in self.free[: self.ng + 1]]
            self.expect_error("allocate(groups)", lambda: s.allocate(waiting.id, rows, 0, 0))
        elif kind == 6 and waiting:
            self.invalid_allocate(waiting, [[] for _ in range(self.ng)], None, 0)
        elif kind == 7:
            self.expect_error(
                "complete(unknown)", lambda: s.complete(self.max_id + 1 + rng.randrange(99))
            )
        elif kind == 8:
            done = [j for j in self.jobs.values() if j.gen == self.gen and j.done]
            if done:
                j = rng.choice(done)
                w: Any = rng.randrange(self.W)  # below, wrong workers on purpose
                self.expect_error("complete(done)", lambda: s.complete(j.id, worker=w))
        elif kind == 9 and pending:
            j = rng.choice(pending)
            w = rng.choice([self.W, self.W + 3, -1, "0", None if self.W > 1 else -2])
            if w is None:
                return
            self.expect_error(f"complete(worker={w!r})", lambda: s.complete(j.id, worker=w))
        elif kind == 10:
            bad = rng.choice(["7", 1.0, -1, None, [1]])
            self.expect_error(f"complete({bad!r})", lambda: s.complete(bad))
        elif kind == 11 and pending:
            w = rng.randrange(self.W)
            good = [j.id for j in pending if w not in j.reported][:3]
            bad = rng.choice([self.max_id + 50, "x", -3])
            ids = [*good, bad]
            rng.shuffle(ids)
            self.expect_error(
                f"complete_many({ids})",
                lambda: s.complete_many(ids, [], worker=w),
            )
        elif kind == 12 and pending:
            w = rng.randrange(self.W)
            good = [j.id for j in pending if w not in j.reported]
            if good:
                jid = rng.choice(good)
                self.expect_error(
                    "complete_many(twice)", lambda: s.complete_many([jid], [jid], worker=w)
                )
        elif kind == 13:
            r = self.pick(("waiting", "running", "loading"))
            if r:
                dup = r.id
                self.expect_error("add_request(dup)", lambda: s.add_request(dup, 5, []))
            else:
                self.expect_error("add_request(0)", lambda: s.add_request(ghost, 0, []))
        elif kind == 14:
            self.expect_error("extend_hashes(unknown)", lambda: s.extend_hashes(ghost, [1]))
        elif kind == 15:
            r = self.pick(("waiting",))
            if r and r.sched_status == "waiting":
                self.expect_error("preempt(waiting)", lambda: s.preempt(r.id))
            else:
                self.expect_error("preempt(unknown)", lambda: s.preempt(ghost))

    def invalid_allocate(
        self,
        r: _Req,
        rows: list[list[int]],
        fresh_pos: list[list[int]] | None,
        hit: int,
    ) -> None:
        """An allocate of waiting request ``r`` that must be refused."""
        rng = self.irng
        lk = r.lookup
        ans = lk[2] if lk and lk[0] == self.sched_steps and lk[1] == hit else None
        free = [b for b in self.free if b not in {x for row in rows for x in row}]
        if len(free) < 2:
            return
        tables = [list(row) for row in rows]
        for g in range(self.ng):
            n = len(fresh_pos[g]) if fresh_pos else 2
            if fresh_pos and fresh_pos[g]:
                tables[g] += [NULL] * (fresh_pos[g][0] - len(tables[g]))
            tables[g] += free[:n]
            free = free[n:]
        kind = rng.randrange(4)
        load = ans or 0
        if kind == 0 and any(len(t) >= 1 for t in tables):
            g = next(g for g, t in enumerate(tables) if t)
            tables[g].append(tables[g][-1])
            what = "repeated block"
        elif kind == 1:
            tables[0].append(self.num_blocks + rng.randrange(5))
            what = "out-of-range block"
        elif kind == 2 and load > 0 and fresh_pos and len(fresh_pos[0]) >= 2:
            tables[0][fresh_pos[0][1]] = NULL
            what = "null block where a load writes"
        else:
            load = load + self.align * rng.randint(1, 3)
            what = f"load of {load} tokens no lookup returned"
        self.expect_error(
            f"allocate({r.id}: {what})", lambda: self.s.allocate(r.id, tables, hit, load)
        )

    def invalid_schedule(self, inp: StepInput) -> None:
        rng = self.irng
        kind = rng.randrange(13)
        sched = list(inp.scheduled) or list(zip(inp.request_ids, inp.computed_tokens, strict=True))
        args = {f.name: getattr(inp, f.name) for f in fields(StepInput)}
        args["request_ids"], args["computed_tokens"] = (), ()
        args["scheduled"] = list(sched)
        running = [x for x in self.live if self.reqs[x].state == "running"]
        waiting = [x for x in self.live if self.reqs[x].sched_status in ("waiting",)]
        if kind == 0:
            args["scheduled"] = [*sched, (f"ghost-{rng.randrange(999)}", 4)]
            what = "unknown request"
        elif kind == 1 and sched:
            args["finished"] = [*inp.finished, sched[0][0]]
            what = "scheduled and finished"
        elif kind == 2 and (inp.finished or running):
            rid = inp.finished[0] if inp.finished else running[0]
            args["finished"] = [*inp.finished, rid] if inp.finished else [rid]
            args["aborted"] = [*inp.aborted, rid]
            what = "released twice"
        elif kind == 3:
            bad = rng.choice([self.num_blocks, self.num_blocks + 7, -1, "x"])
            args["written"] = [*(inp.written or []), bad]
            what = f"written {bad!r}"
        elif kind == 4 and running and self.free:
            args["new_blocks"] = [*inp.new_blocks, (running[0], self.ng, [self.free[-1]])]
            what = "group out of range"
        elif kind == 5 and running and self.free:
            b = self.free[0]
            args["new_blocks"] = [*inp.new_blocks, (running[0], 0, [b, b])]
            what = "repeated new block"
        elif kind == 6 and waiting:
            args["scheduled"] = [*sched, (waiting[0], 4)]
            what = "scheduled a waiting request"
        elif kind == 7:
            self.expect_error("schedule(not a StepInput)", lambda: self.s.schedule(sched))  # type: ignore[arg-type]
            return
        elif kind == 8:
            args["scheduled"] = ()
            args["request_ids"] = [a for a, _ in sched] + ["x"]
            args["computed_tokens"] = [b for _, b in sched]
            what = "lengths differ"
        elif kind == 9 and waiting:
            args["resumed"] = [*inp.resumed, waiting[0]]
            what = "resumed a waiting request"
        elif kind == 10 and (inp.finished or inp.aborted or inp.preempted) and self.free:
            rid = rng.choice([*inp.finished, *inp.aborted, *inp.preempted])
            args["new_blocks"] = [*inp.new_blocks, (rid, 0, [self.free[-1]])]
            what = "new blocks for a request released in the same step"
        elif kind == 11 and running and self.free:
            rid = rng.choice(running)
            release = rng.choice(["finished", "aborted", "preempted"])
            args["scheduled"] = [x for x in sched if x[0] != rid]
            args[release] = [*args[release], rid]
            args["new_blocks"] = [*inp.new_blocks, (rid, 0, [self.free[-1]])]
            what = f"new blocks for a request {release} in the same step"
        elif kind == 12 and inp.resumed:
            rid = inp.resumed[0]
            args["preempted"] = [*inp.preempted, rid]
            what = "resumed and preempted in one step"
        else:
            return
        bad_inp = StepInput(**args)
        self.expect_error(f"schedule({what})", lambda: self.s.schedule(bad_inp))

    # ------------------------------------------------------------------ the end

    def drain(self) -> None:
        """Finish every request, let every job run and report, and check invariant 6."""
        finished, aborted = [], []
        for rid in list(self.live):
            r = self.reqs[rid]
            self.report_hashes(r)
            self.release(r)
            if r.state == "running":
                finished.append(rid)
                r.state = r.sched_status = "finished"
            else:
                aborted.append(rid)
                r.state = r.sched_status = "aborted"
        self.live = []
        first = True
        for _ in range(60):
            inp = StepInput(
                finished=finished if first else (),
                aborted=aborted if first else (),
                written=None if self.o.written == "conservative" else [],
            )
            first = False
            plan = self.call("schedule", inp)
            self.check_plan(plan, inp.written, {})
            self.workers_step(plan, [], drain=True)
            for w in range(self.W):
                self.run_due(w, 2 * self.t + 1, drain=True)
            for jid in self.to_submit:
                for w in range(self.W):
                    self.submit(self.jobs[jid], w)
                    self.run_due(w, 0, drain=True)
            self.to_submit = []
            self.make_available(max(self.due, default=0))
            while self.available:
                self.deliver_some(everything=True)
            self.check_events()
            self.t += 1
            if not self.s.pending_jobs() and self.s.num_requests == 0 and not plan.stores:
                break
        st = self.s.stats()
        self.contract(self.s.pending_jobs() == [], f"leak: pending {self.s.pending_jobs()}")
        self.contract(self.s.armed_pairs == 0, f"leak: {self.s.armed_pairs} armed pairs")
        self.contract(self.s.num_requests == 0, f"leak: {self.s.num_requests} requests")
        self.contract(st["loading_requests"] == 0, "leak: loading requests")
        for p in cast("list[dict[str, int]]", st["pools"]):
            self.contract(p["pinned"] == 0 and p["storing"] == 0, f"leak: pool {p}")

    def result(self) -> dict[str, Any]:
        st = self.s.stats()
        out = dict(self.c)
        out.setdefault("violations", 0)
        out["violation_kinds"] = dict(self.c["violation_kinds"])
        for k in (
            "chunks_dropped",
            "store_no_room",
            "store_chunks",
            "flushes_necessary",
            "flushes_conservative",
            "flushes_reset",
            "lookups_deferred",
        ):
            out[k] = st[k]
        out["store_plan"] = self.store_plan
        out["flush_sets"] = self.flush_sets
        return out


def run(seed: int, steps: int, **options: Any) -> dict[str, Any]:
    """One fuzzing run of ``steps`` engine steps and a drain; returns counters.

    Options are the fields of :class:`Options`. Raises :class:`FuzzViolationError` on a broken check
    (data violations are counted instead with ``raise_on_violation=False``).
    """
    f = Fuzzer(seed, Options(**options))
    for _ in range(steps):
        f.step()
    f.drain()
    return f.result()


def run_compare(seed: int, steps: int, **options: Any) -> dict[str, dict[str, Any]]:
    """The same seed with exact, superset and conservative ``written``: the same stores must be
    planned and the same chunks dropped; superset flush sets contain the exact ones."""
    options = {k: v for k, v in options.items() if k != "written"}
    res = {mode: run(seed, steps, written=mode, **options) for mode in ("exact", "superset")}
    res["conservative"] = run(seed, steps, written="conservative", **options)
    ex = res["exact"]
    for mode in ("superset", "conservative"):
        other = res[mode]
        if other["store_plan"] != ex["store_plan"]:
            a, b = ex["store_plan"], other["store_plan"]
            i = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            raise FuzzViolationError(
                f"seed {seed}: {mode} written planned other stores than exact: first difference "
                f"at store #{i}: exact {a[i : i + 1]}, {mode} {b[i : i + 1]}"
            )
        if other["chunks_dropped"] != ex["chunks_dropped"]:
            raise FuzzViolationError(
                f"seed {seed}: chunks_dropped {ex['chunks_dropped']} (exact) vs "
                f"{other['chunks_dropped']} ({mode})"
            )
    for t, (e, s) in enumerate(zip(ex["flush_sets"], res["superset"]["flush_sets"], strict=True)):
        if not set(e) <= set(s):
            raise FuzzViolationError(f"seed {seed} step {t}: superset flush {s} misses exact {e}")
    if res["superset"]["flushes"] < ex["flushes"]:
        raise FuzzViolationError(f"seed {seed}: superset flushed fewer jobs than exact")
    return res


_SUMMED = (
    "steps",
    "calls",
    "loads",
    "stores",
    "flushes",
    "resets",
    "invalid_calls",
    "panics",
    "reports",
    "duplicate_reports",
    "late_reports",
    "failed_reports",
    "preemptions",
    "readmissions",
    "cancelled_loads",
    "chunks_dropped",
)


def _one(args: tuple[int, int, bool]) -> tuple[int, str | None, dict[str, int]]:
    seed, steps, compare = args
    opts = options_for_seed(seed)
    try:
        res = run_compare(seed, steps, **opts)["exact"] if compare else run(seed, steps, **opts)
    except FuzzViolationError as e:
        return seed, f"{e} (options {opts})", {}
    return seed, None, {k: res.get(k, 0) for k in _SUMMED}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=200, help="number of seeds")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--steps", type=int, default=300, help="engine steps per seed")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    ap.add_argument(
        "--compare-every",
        type=int,
        default=4,
        help="every Nth seed also runs superset/conservative",
    )
    a = ap.parse_args(argv)
    work = [(s, a.steps, s % a.compare_every == 0) for s in range(a.start, a.start + a.seeds)]
    t0 = time.perf_counter()
    totals: dict[str, int] = defaultdict(int)
    failures = []
    if a.jobs > 1:
        import multiprocessing

        with multiprocessing.Pool(a.jobs) as pool:
            results = pool.imap_unordered(_one, work)
            for seed, err, counts in results:
                if err:
                    failures.append((seed, err))
                    print(f"FAIL {err}", flush=True)
                for k, v in counts.items():
                    totals[k] += v
    else:
        for item in work:
            seed, err, counts = _one(item)
            if err:
                failures.append((seed, err))
                print(f"FAIL {err}", flush=True)
            for k, v in counts.items():
                totals[k] += v
    dt = time.perf_counter() - t0
    print(
        f"{a.seeds} seeds ({a.start}..{a.start + a.seeds - 1}), {a.steps} steps each, "
        f"{dt:.1f} s: " + ", ".join(f"{k} {totals[k]}" for k in _SUMMED)
    )
    if failures:
        print(f"{len(failures)} failing seeds: {sorted(s for s, _ in failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
