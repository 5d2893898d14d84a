"""The offloading side of the simulated engine: kvoffload driven as a real engine drives it.

:class:`Offload` owns the :class:`~kvoffload.scheduler.OffloadScheduler` (the scheduler side),
the :class:`~kvoffload.transfer.TransferEngine` (the one worker), the shadow of vLLM's fence
rule (:mod:`kvoffload.sim.vllm_rule`) and the table of jobs in flight. The engine
(:mod:`kvoffload.sim.engine`) calls it where a real engine calls its connector: when a request
arrives, at admission (``lookup``, ``allocate``), once per step (:meth:`Offload.step`: the
scheduler's plan, then the workers' :meth:`~kvoffload.transfer.TransferEngine.step`), with new
block hashes, and when a failed load gives a request's blocks back. Completed copies are taken
by :meth:`Offload.collect`: stores are checked against the oracle, loads are handed back to the
engine (``on_load``), which checks them and lets the request run.

This is the seam for the tiers below the CPU pool (DESIGN.md §9): their configuration goes into
:meth:`~kvoffload.sim.config.SimConfig.offload_config`, their jobs complete here like the
others, and their hits count as tier hits in the run's timeline; the engine does not change.
Scheduler time is measured around every scheduler call (:attr:`Offload.clock`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvoffload._core import DiskWorker, RemoteWorker
from kvoffload.scheduler import OffloadScheduler, StepInput
from kvoffload.sim.config import NULL_BLOCK, SIM_STEP_MS, SimConfig
from kvoffload.sim.kv import KvCache, Transfers
from kvoffload.sim.request import SimRequest
from kvoffload.sim.result import SimResult
from kvoffload.sim.vllm_rule import VllmRuleFence
from kvoffload.transfer import TransferEngine
from kvoffload.transfer.disk import open_disk_worker
from kvoffload.transfer.remote import open_remote_worker

__all__ = ["MODEL", "LoadDone", "Offload"]

MODEL = "kvoffload-sim"
"""The model name in the simulator's tier namespaces."""

LoadDone = Callable[[str, int, bool, Transfers], None]
"""Called as ``on_load(request_id, job_id, ok, transfers)`` when a load job completes."""


class Offload:
    """kvoffload's scheduler and data plane for one simulated engine."""

    def __init__(
        self,
        cfg: SimConfig,
        kv: KvCache,
        result: SimResult,
        reqs: dict[str, SimRequest],
        on_load: LoadDone,
    ) -> None:
        """Builds the scheduler and the data plane over ``kv``'s tensors (every KV group shares
        them); counts into ``result``; reads the requests' block tables in ``reqs``."""
        self.cfg = cfg
        self.kv = kv
        self.result = result
        self.reqs = reqs
        self.on_load = on_load
        self.clock = 0.0
        """Seconds spent in scheduler calls since the engine last reset it."""
        self.vllm_rule = VllmRuleFence(cfg.windows)
        self.jobs: dict[int, tuple[str, str, Transfers]] = {}
        self.inflight_ids: set[int] = set()
        self.store_ids: set[int] = set()
        self.store_pos: dict[int, Transfers] = {}
        self.closed = False
        self.sched = OffloadScheduler(cfg.offload_config())
        hook = self._delay_hook if cfg.copy_delay_s > 0 else None
        faults = cfg.load_fault_rate > 0 or cfg.store_fault_rate > 0
        self.xfer = TransferEngine(
            [list(kv.kv) for _ in cfg.windows],
            blocks_per_chunk=cfg.blocks_per_chunk,
            num_slots=cfg.cpu_chunks,
            _before_copy=hook,
            _fault_injector=self._inject_fault if faults else None,
        )
        self.tiers: dict[str, DiskWorker | RemoteWorker] = {}
        """The workers of the lower tiers, by medium (``disk``, ``remote``; both may be)."""
        self.tier_ids: dict[int, str] = {}
        """Tier jobs (write-behind, promotion) submitted and not completed yet: their medium."""
        self.held_tiers = cfg.tier_stall or cfg.tier_delay_ms_per_chunk > 0
        """Whether tier completions wait for the simulated tier speed (see :meth:`_tier_due`)."""
        self.tier_step = 0
        """The engine step as of the last collection (the simulated tier clock)."""
        self.tier_due: dict[int, float] = {}
        """Per tier job in flight: the simulated step at which its I/O ends (inf: stalled)."""
        self.tier_free: dict[str, float] = {}
        """Per medium: the simulated step at which its queue of jobs runs dry."""
        self.tier_done: dict[int, bool] = {}
        """Tier jobs the worker finished whose simulated end has not come yet."""
        self.draining = False
        """Set by :meth:`drain`: stalled tier jobs are released."""
        block_sizes = [cfg.block_size] * len(cfg.windows)
        if cfg.disk_path is not None:
            self.tiers["disk"] = open_disk_worker(
                self.xfer,
                cfg.disk_path,
                cfg.disk_bytes or 0,  # given with disk_path: validate checked it
                block_sizes,
                model=MODEL,
                io_cpus=cfg.io_cpus,
            )
        if cfg.remote_url is not None:
            self.tiers["remote"] = open_remote_worker(
                self.xfer,
                cfg.remote_url,
                block_sizes,
                model=MODEL,
                deadline_ms=cfg.remote_deadline_ms,
                io_cpus=cfg.io_cpus,
                tls_ca=cfg.remote_tls_ca,
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
            self.clock += time.perf_counter() - t

    def add_request(self, r: SimRequest, hashes: list[int]) -> None:
        """A request arrived, with the hashes of its known full blocks."""
        self._sc(self.sched.add_request, r.id, r.prompt_len, hashes)

    def lookup(self, rid: str, gpu_hit_tokens: int) -> int | None:
        """Tokens loadable from the CPU tier beyond the GPU hit, or None: ask again later."""
        got = self._sc(self.sched.lookup, rid, gpu_hit_tokens)
        return None if got is None else int(got)

    def allocate(
        self, rid: str, tables: list[list[int]], gpu_hit_tokens: int, load_tokens: int
    ) -> int | None:
        """The request's blocks are allocated; returns the load job, if one was created."""
        job = self._sc(self.sched.allocate, rid, tables, gpu_hit_tokens, load_tokens)
        return None if job is None else int(job)

    def preempt(self, rid: str) -> None:
        """The engine released the request's blocks outside a step (a failed load)."""
        self._sc(self.sched.preempt, rid)

    def extend_hashes(self, rid: str, hashes: list[int]) -> None:
        """New full blocks of a request's output were hashed."""
        self._sc(self.sched.extend_hashes, rid, hashes)

    def allocated(self, blocks: Iterable[int]) -> None:
        """Blocks the engine allocated this step (for vLLM's rule, which counts them written)."""
        self.vllm_rule.allocated(blocks)

    # ------------------------------------------------------------------ the step

    def step(self, inp: StepInput) -> None:
        """The scheduler's plan for the step, then the workers' part of it."""
        self.vllm_rule.step(inp.finished, inp.preempted)
        plan = self._sc(self.sched.schedule, inp)
        self.sched.take_events()  # nothing indexes the CPU tier here: drain every step
        self.vllm_rule.stores((j.job_id, j.request_id, j.transfers) for j in plan.stores)
        self.result.flushes_vllm_rule = self.vllm_rule.flushed
        self._workers(plan)

    def _tiers(self, plan: Any) -> None:
        """Hands the plan's tier jobs to the worker of their medium (its threads run them)."""
        by_medium: dict[str, list[Any]] = {}
        for j in plan.tier_jobs:
            by_medium.setdefault(j[2], []).append(j)
        res = self.result
        for medium, jobs in by_medium.items():
            self.tiers[medium].submit(jobs)
            for j in jobs:
                self.tier_ids[j[0]] = medium
                if self.held_tiers:
                    self.tier_due[j[0]] = self._tier_due(medium, len(j[4]))
                n = len(j[4])
                if j[1] == "write":
                    res.tier_written_chunks[medium] = res.tier_written_chunks.get(medium, 0) + n
                else:
                    res.tier_promoted_chunks[medium] = res.tier_promoted_chunks.get(medium, 0) + n
                    if j[3] == 0:
                        tokens = n * self.cfg.blocks_per_chunk * self.cfg.block_size
                        res.tier_promoted_tokens[medium] = (
                            res.tier_promoted_tokens.get(medium, 0) + tokens
                        )

    def _tier_due(self, medium: str, chunks: int) -> float:
        """The simulated step at which a tier job of ``chunks`` submitted now ends: the tier
        runs its jobs one after another, each chunk taking ``tier_delay_ms_per_chunk``."""
        if self.cfg.tier_stall:
            return float("inf")
        start = max(float(self.tier_step), self.tier_free.get(medium, 0.0))
        end = start + chunks * self.cfg.tier_delay_ms_per_chunk / SIM_STEP_MS
        self.tier_free[medium] = end
        return end

    def _held_tier_results(self, worker: DiskWorker | RemoteWorker, ids: list[int]) -> None:
        """With a simulated tier speed: waits for the jobs of ``ids`` whose simulated end has
        come (all of them when draining) and keeps every result until its end comes."""
        due = [
            i
            for i in ids
            if i not in self.tier_done and (self.draining or self.tier_due[i] <= self.tier_step)
        ]
        got = worker.wait(due) if due else worker.poll()
        self.tier_done.update(got)

    def _collect_tiers(self, block: bool) -> int:
        """Completes finished tier jobs (with ``block``, waits for every one first); returns
        how many. With a simulated tier speed, a job completes once its simulated end has come
        and its I/O finished, whatever ``block`` says (reproducible by steps)."""
        if not self.tier_ids:
            return 0
        done: list[tuple[int, bool]] = []
        for medium, worker in self.tiers.items():
            ids = [i for i, m in self.tier_ids.items() if m == medium]
            if ids and self.held_tiers:
                self._held_tier_results(worker, ids)
            elif ids:
                done += worker.wait(ids) if block else worker.poll()
        if self.held_tiers:
            ready = [
                i for i in self.tier_done if self.draining or self.tier_due[i] <= self.tier_step
            ]
            done = [(i, self.tier_done.pop(i)) for i in ready]
            for i in ready:
                del self.tier_due[i]
        for job_id, ok in sorted(done):
            medium = self.tier_ids.pop(job_id)
            self.result.tier_failed_jobs[medium] = self.result.tier_failed_jobs.get(medium, 0) + (
                not ok
            )
            self._sc(self.sched.complete, job_id, 0, ok)
        return len(done)

    def _track_store(self, job: Any) -> None:
        """Records a plan's store job for verification."""
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

    def _workers(self, plan: Any) -> None:
        """The workers' part of the step: one :meth:`TransferEngine.step_packed` call with the
        plan's packed runs (it submits the previous step's stores, completes the flush set,
        submits the loads and queues this step's stores for the next step). The jobs'
        transfers are kept only to verify their bytes."""
        for job in plan.stores:
            self._track_store(job)
        for job in plan.loads:
            transfers = [(int(g), list(gb), list(cb)) for g, gb, cb in job.transfers]
            self.jobs[job.job_id] = ("load", job.request_id, transfers)
            self.inflight_ids.add(job.job_id)
        self.result.flushed_jobs += len(plan.flush)
        flush = list(plan.flush) if self.cfg.fence != "off" else []
        self._tiers(plan)
        t = time.perf_counter()
        self.xfer.step_packed(
            [j.job_id for j in plan.loads], [j.job_id for j in plan.stores], flush, plan.runs
        )
        if flush:
            self.result.flush_wait_seconds += time.perf_counter() - t
            self.result.flush_steps += 1

    # ------------------------------------------------------------------ completions

    def busy(self) -> bool:
        """Whether a job is in flight or a copy is queued."""
        return bool(self.inflight_ids) or bool(self.tier_ids) or self.xfer.stats()["queued"] > 0

    def wait_inflight(self, step: int) -> None:
        """Waits for every job in flight and completes them."""
        self.tier_step = step
        if self.inflight_ids:
            self.xfer.wait(list(self.inflight_ids))
            self.collect(block=False, step=step)
        self._collect_tiers(block=True)

    def collect(self, *, block: bool, step: int) -> None:
        """Takes finished copies (with ``block``, waits for every job in flight first) and
        completes them in the scheduler; stores are checked, loads go to ``on_load``."""
        self.tier_step = step
        if block and self.inflight_ids:
            self.xfer.wait(list(self.inflight_ids))
        self._collect_tiers(block)
        results = sorted(self.xfer.poll(), key=lambda res: res.job_id)
        res_acc = self.result
        for res in results:
            self.inflight_ids.discard(res.job_id)
            self.store_ids.discard(res.job_id)
            kind, rid, transfers = self.jobs.pop(res.job_id)
            if res.ok:
                if kind == "store":
                    self.kv.verify_store(
                        self.reqs[rid],
                        res.job_id,
                        self.store_pos.pop(res.job_id),
                        self.xfer.cpu_region,
                        step,
                    )
                    res_acc.bytes_stored += res.bytes
                    res_acc.store_seconds += res.seconds
                    res_acc.store_jobs += 1
                else:
                    res_acc.bytes_loaded += res.bytes
                    res_acc.load_seconds += res.seconds
                    res_acc.load_jobs += 1
            else:
                res_acc.failed_jobs += 1
            done = self._sc(self.sched.complete, res.job_id, 0, res.ok)
            if done is not None:
                self.vllm_rule.completed(done.job_id)
            if done is not None and kind == "load":
                self.on_load(rid, res.job_id, done.ok, transfers)

    def drain(self, step: int) -> None:
        """After the last request: run every queued copy, complete every job, and give the
        scheduler empty steps until it lets go of every finished request (it drops one at the
        step after its last job completed, and may still create stores for it). A simulated
        tier's jobs complete now, stalled ones too."""
        self.draining = True
        self.xfer.step()  # one more worker step submits the last step's stores
        self.xfer.wait(list(self.inflight_ids))
        self.collect(block=False, step=step)
        left = -1
        for _ in range(10_000):  # each round completes jobs or drops requests; bounded anyway
            # With a disk tier, the last stores' write-behind jobs may still be to run.
            tiers_busy = bool(self.tiers) and bool(self.sched.pending_jobs())
            if not self.sched.num_requests and not tiers_busy:
                break
            if self.sched.num_requests == left:
                break
            left = self.sched.num_requests
            plan = self._sc(self.sched.schedule, StepInput(scheduled=[], written=[]))
            self._workers(plan)
            self.xfer.step()
            self.xfer.wait(list(self.inflight_ids))
            self.collect(block=False, step=step)
            if self._collect_tiers(block=True):
                left = -1  # progress: unpinned CPU slots may make room for retried stores
            if plan.stores:
                left = -1  # progress: more stores of finished requests

    def finish(self) -> None:
        """Puts the scheduler's figures and what it still holds (leaks) into the result."""
        st: dict[str, Any] = dict(self.sched.stats())
        r = self.result
        r.scheduler_stats = st
        r.flushes_necessary = int(st.get("flushes_necessary", 0))
        r.flushes_conservative = int(st.get("flushes_conservative", 0))
        r.leaked_requests = self.sched.num_requests
        r.leaked_jobs = len(self.sched.pending_jobs())
        for t in st.get("tiers") or []:  # per medium, summed over the groups
            into = r.tiers.setdefault(t["medium"], {})
            for k, v in t.items():
                if k not in ("medium", "group"):
                    into[k] = into.get(k, 0) + v

    def close(self) -> None:
        """Shuts the data plane down (idempotent)."""
        if not self.closed:
            self.xfer.shutdown(wait=False)
            remote = self.tiers.get("remote")
            if isinstance(remote, RemoteWorker):
                self.result.remote_nodes = remote.node_stats()
            self.tiers.clear()  # their threads end once the workers are dropped
        self.closed = True
