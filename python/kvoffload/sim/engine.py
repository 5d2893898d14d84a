"""A simulated paged inference engine that drives kvoffload exactly as a real engine would.

The engine has what makes KV offloading hard in vLLM-like engines, and nothing else:

* a **block pool** with reference counts and a **prefix cache** keyed by chained hashes
  (:mod:`kvoffload.sim.blocks`); freed blocks go to an LRU free queue (a request's blocks are
  freed tail first) and are re-used either as cache hits (content kept, not written) or evicted
  and re-written;
* **chunked prefill** under a per-step token budget, then **decode** one token per step;
* an optional **sliding-window** KV group whose blocks are freed as they leave the window while
  the request still runs (the engine's null block takes their place);
* **preemption** of the latest-admitted running request when blocks run out;
* an optional **one-step lag** between scheduling and outputs (asynchronous scheduling): a
  request is scheduled once more after its last token, and learns it finished a step late.

Each forward step writes the bytes of :mod:`kvoffload.sim.oracle` into real torch tensors
(:mod:`kvoffload.sim.kv`), so the correct content of every block is known. With offloading,
the engine drives kvoffload through :class:`~kvoffload.sim.offload.Offload` in the order of
DESIGN.md §3: per step, completions → admission (``lookup`` then ``allocate``) → ``schedule`` →
workers (one :meth:`~kvoffload.transfer.TransferEngine.step_packed` call with the plan, then the
forward pass) → outputs. Every load is compared byte for byte with the oracle when it completes,
before any forward pass reads it; so is every prefix-cache hit (a sanity check of the simulator
itself).
Without offloading (``offload=False``) the same engine is the baseline.

Two switches break the fence on purpose, for mutation checks: ``fence="off"`` ignores the flush
set, and ``skip_deferred_arming=True`` builds the scheduler with deferred pairs never armed.
With either, runs with block re-use and slow copies (``copy_delay_s``) report mismatches.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict

import numpy as np

from kvoffload.scheduler import StepInput
from kvoffload.sim.blocks import BlockPool
from kvoffload.sim.config import NULL_BLOCK, SimConfig, SimError
from kvoffload.sim.kv import KvCache, Transfers
from kvoffload.sim.offload import Offload
from kvoffload.sim.request import SimRequest
from kvoffload.sim.result import SimResult, TimelinePoint
from kvoffload.sim.workloads import RequestSpec, make_workload

__all__ = ["Simulator", "simulate"]


class Simulator:
    """One simulation run. Use :func:`simulate` unless you need to step it yourself."""

    def __init__(
        self,
        cfg: SimConfig,
        specs: Sequence[RequestSpec] | None = None,
        progress: Callable[[int, int, int], None] | None = None,
        before_step: Callable[[int], None] | None = None,
    ) -> None:
        """Builds the engine, its tensors, and (with ``offload``) the scheduler and data plane.

        Args:
            cfg: The run's configuration.
            specs: The workload; default: ``make_workload`` from ``cfg``.
            progress: Called as ``progress(finished_requests, total_requests, step)``.
            before_step: Called as ``before_step(step)`` before every step (a test's fault
                schedule: kill or slow a server at a given step).

        Raises:
            ConfigError: A bad configuration value.
            SimError: A request that can never fit in the GPU blocks.
        """
        cfg.validate()
        self.cfg = cfg
        self.progress = progress
        self.before_step = before_step
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
        self._check_fits()
        self.reqs = {s.req_id: SimRequest(s, self.ng) for s in self.specs}
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
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.loading: dict[str, SimRequest] = {}
        self.ready: list[SimRequest] = []
        self.finished_ids: list[str] = []
        self.pending_outputs: list[list[tuple[SimRequest, bool]]] = []
        self.step_no = 0
        self.num_done = 0
        self.result = SimResult(config=asdict(cfg))
        self.result.requests = len(self.specs)
        self.step_times: list[float] = []
        self.kv = KvCache(cfg, self.result)
        self.offload = (
            Offload(cfg, self.kv, self.result, self.reqs, self._load_done) if cfg.offload else None
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

    # ------------------------------------------------------------------ the run

    def run(self) -> SimResult:
        """Runs every request to completion and returns the figures."""
        t0 = time.perf_counter()
        try:
            while not self._finished():
                if self.step_no >= self.cfg.max_steps:
                    raise SimError(f"gave up after {self.step_no} steps")
                if self.before_step is not None:
                    self.before_step(self.step_no + 1)
                self.step()
            if self.offload is not None:
                self.offload.drain(self.step_no)
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
        if self.offload is not None:
            self.offload.finish()
        return r

    def close(self) -> None:
        """Shuts the data plane down (idempotent)."""
        if self.offload is not None:
            self.offload.close()

    def _finished(self) -> bool:
        return (
            self.num_done == len(self.specs)
            and not self.finished_ids
            and not any(self.pending_outputs)
        )

    def step(self) -> None:
        """One engine step: completions, admission, schedule, workers, outputs."""
        cfg = self.cfg
        off = self.offload
        self.step_no += 1
        if off is not None:
            off.clock = 0.0
            off.collect(block=cfg.completion == "step", step=self.step_no)
            if not self.running and not self.ready and self.loading:
                # Nothing can run until a load lands; a real step lasts long enough for it, so
                # do not spin empty steps (they would skew arrivals and the per-step figures).
                off.wait_inflight(self.step_no)
        self.ready.sort(key=lambda q: self.order[q.id])
        self._arrive()
        if (
            not self.running
            and not self.waiting
            and not self.ready
            and not self.loading
            and not self.finished_ids
            and not any(self.pending_outputs)
            and self.arrivals
            and not (off is not None and off.busy())
        ):
            # Idle until the next arrival: skip ahead.
            self.step_no = max(self.step_no, self.arrivals[0][0])
            self._arrive()

        scheduled: list[tuple[SimRequest, int, int]] = []  # (req, start, n)
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
                    if off is not None:
                        off.allocated(blocks)
            scheduled.append((r, r.computed, n))
            budget -= n
            i += 1

        # 2. Admission (not in a step that preempted, as vLLM).
        if not preempted:
            budget = self._admit(budget, scheduled, written)

        # 3. Schedule.
        outputs: list[tuple[SimRequest, bool]] = []
        for r, start, n in scheduled:
            r.computed = start + n
            sampled = r.computed >= r.known + r.inflight
            if sampled:
                r.inflight += 1  # this step samples a token
            outputs.append((r, sampled))
        if off is not None:
            off.step(
                StepInput(
                    scheduled=[(r.id, r.computed) for r, _, _ in scheduled],
                    new_blocks=new_blocks,
                    finished=list(self.finished_ids),
                    preempted=preempted,
                    written=None if cfg.fence == "conservative" else written,
                )
            )
        self.finished_ids.clear()
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

        sched_t = 0.0 if off is None else off.clock
        self.step_times.append(sched_t)
        self.result.sched_seconds += sched_t
        self._record_timeline()

    def _record_timeline(self, *, if_changed: bool = False) -> None:
        """Appends the run's cumulative figures at this point (``if_changed``: unless they are
        the last point's)."""
        res = self.result
        # Every field but the step is the result's figure of the same name.
        point = TimelinePoint(self.step_no, *(getattr(res, f) for f in TimelinePoint._fields[1:]))
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
            if self.offload is not None:
                # Not the block of the last prompt token: the engine computes at least one
                # token to sample (as its own prefix cache does), so the offload tier must not
                # answer the whole prompt (a repeated prompt, e.g. after a restart, stalled).
                hashes = r.stream.hash_list[: (r.known - 1) // self.bs]
                r.hashes_sent = len(hashes)
                self.offload.add_request(r, hashes)

    def _gpu_hit(self, r: SimRequest) -> tuple[int, list[list[int]]]:
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
        self, budget: int, scheduled: list[tuple[SimRequest, int, int]], written: list[int]
    ) -> int:
        cfg = self.cfg
        skipped: list[SimRequest] = []
        while self.waiting and budget > 0:
            holding = len(self.running) + len(self.loading) + len(self.ready)
            if holding >= cfg.max_num_seqs:
                break
            r = self.waiting.popleft()
            h, hit_tables = self._gpu_hit(r)
            ext = 0
            if self.offload is not None:
                got = self.offload.lookup(r.id, h)
                if got is None:
                    skipped.append(r)
                    continue
                ext = got
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
            self.kv.verify_hits(r, hit_tables, self.step_no)
            for row in hit_tables:
                for b in row:
                    if b != NULL_BLOCK:
                        self.pool.touch(b)
            for g, c in enumerate(counts):
                fresh = self.pool.take(c)
                tables[g].extend(fresh)
                written.extend(fresh)
            # vLLM's rule counts prefix-cache re-use as a write.
            if self.offload is not None:
                self.offload.allocated(b for row in tables for b in row if b != NULL_BLOCK)
            r.tables = tables
            r.cached = [len(row) for row in hit_tables]
            r.computed = h
            self.result.lookup_tokens += r.known
            self.result.gpu_hit_tokens += h
            job = None if self.offload is None else self.offload.allocate(r.id, tables, h, ext)
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

    def _free_window(self, r: SimRequest) -> None:
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

    def _blocks_needed(self, r: SimRequest, target: int) -> list[int]:
        nb = -(-target // self.bs)
        return [max(0, nb - len(row)) for row in r.tables]

    def _append_blocks(self, r: SimRequest, need: list[int]) -> list[list[int]]:
        out = []
        for g, c in enumerate(need):
            fresh = self.pool.take(c) if c else []
            r.tables[g].extend(fresh)
            out.append(fresh)
        return out

    def _release_all(self, r: SimRequest) -> None:
        self._register(r)
        for row in r.tables:
            self.pool.release(row[::-1])
        r.released = r.tables
        r.tables = [[] for _ in range(self.ng)]
        r.cached = [0] * self.ng

    def _window_gap(self, r: SimRequest) -> bool:
        """Whether a sliding-window group left null a position the request must now compute
        (after a failed load: the window was placed after the tokens the load would bring)."""
        first = r.computed // self.bs
        return any(
            NULL_BLOCK in r.tables[g][first:] for g, w in enumerate(self.windows) if w is not None
        )

    def _readmit(self, r: SimRequest) -> None:
        """A failed load whose blocks cannot be recomputed in place: drop the request's blocks
        and admit it again (the engine tells the scheduler it released them)."""
        self._release_all(r)
        r.computed = 0
        r.state = "waiting"
        self.waiting.appendleft(r)
        self.result.readmissions += 1
        assert self.offload is not None
        self.offload.preempt(r.id)

    def _preempt(self, r: SimRequest) -> None:
        self.running.remove(r)
        self._release_all(r)
        r.computed = 0
        r.state = "waiting"
        self.waiting.appendleft(r)
        self.result.preemptions += 1

    def _register(self, r: SimRequest) -> None:
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

    # ------------------------------------------------------------------ offloading

    def _load_done(self, rid: str, job: int, ok: bool, transfers: Transfers) -> None:
        """A load job completed: the request runs from the loaded tokens (checked byte for
        byte), or from its GPU hit after a failed load."""
        r = self.reqs[rid]
        if r.load_job != job:  # pragma: no cover - a simulator bug
            raise SimError(f"load {job} completed for {rid}, which waits for no load")
        del self.loading[rid]
        r.load_job = None
        if ok:
            self.kv.verify_load(r, job, transfers, self.step_no)
            r.computed = r.load_end
            self.result.cpu_hit_tokens += r.load_end - r.load_hit
            self._register(r)
        else:
            r.computed = r.load_hit
            if self._window_gap(r):
                self._readmit(r)
                return
        r.state = "ready"
        self.ready.append(r)

    def _forward(self, scheduled: list[tuple[SimRequest, int, int]]) -> None:
        """The forward pass: counts prefill and decode tokens, writes the oracle's bytes."""
        res = self.result
        for r, start, n in scheduled:
            decode = max(0, start + n - max(r.prompt_len, r.max_computed))
            res.decode_tokens += decode
            res.prefill_tokens += n - decode
            r.max_computed = max(r.max_computed, start + n)
        self.kv.forward(scheduled, self.step_no)

    def _outputs(self, batch: list[tuple[SimRequest, bool]]) -> None:
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
            if self.offload is not None:
                n = r.known // self.bs
                if n > r.hashes_sent:
                    new = r.stream.hash_list[r.hashes_sent : n]
                    r.hashes_sent = n
                    self.offload.extend_hashes(r.id, new)
            if r.num_output >= r.output_len:
                self._finish(r)

    def _finish(self, r: SimRequest) -> None:
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


def simulate(
    cfg: SimConfig,
    specs: Sequence[RequestSpec] | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> SimResult:
    """Runs one simulation; see :class:`Simulator`."""
    return Simulator(cfg, specs, progress).run()
