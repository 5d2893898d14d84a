"""The connector's scheduler side: vLLM's scheduler-side calls mapped onto the Rust core.

* ``on_new_request`` keeps the request's live list of chained block hashes (vLLM's
  ``BlockHash`` bytes, which the core turns into the 64-bit ints vLLM publishes in its KV
  events); hashes of generated tokens are read as they appear.
* ``get_num_new_matched_tokens`` is ``lookup``, which registers the request with the core at
  its first ask: ``None`` (vLLM 0.32 supports "ask again later"), ``0``, or tokens to load
  asynchronously (``load_kv_async=True``).
* ``update_state_after_alloc`` is ``allocate`` with the request's whole block table, vLLM's
  block lists as they are (the core reads each ``KVCacheBlock.block_id``). Written blocks are
  told from prefix-cache re-use with what vLLM provides: the positions below the block-aligned
  local hit passed to the lookup are re-used read-only; every other allocated block (the core
  adds those to the step's written set itself), and every block vLLM appends to a running
  request, is written (by the forward pass, a load, zeroing or a copy-on-write). Where the hit
  is unknown (an allocation without a lookup) the step falls back to the conservative fence
  (``written=None``).
* ``build_connector_meta`` turns the ``SchedulerOutput`` into one core step (scheduled
  requests and their computed tokens, new blocks, finished / aborted / preempted requests,
  written blocks) and ships the plan (loads, stores, flush) to the workers.
* ``request_finished`` returns ``(False, None)``: vLLM frees the blocks at once; the fence
  flushes a pending store before any of its blocks is written again.
* **Failed loads.** Under ``kv_load_failure_policy="fail"`` (vLLM's default) vLLM finishes the
  request with an error. Under ``"recompute"`` it either keeps the blocks and recomputes from
  the first invalid block (block-level report with a valid prefix: the request held those
  blocks since the step that allocated them and counted them written, so no store read them
  since and no flush is due), or frees them and asks ``get_num_new_matched_tokens`` again:
  the adapter then calls the core's ``preempt``. ``reset_cache`` with loads in flight reports
  those loads as failed (``"recompute"`` only; refused under ``"fail"``).

**Lower tiers** (``disk_path`` or ``remote_url``): the core plans write-behind and promotion
jobs itself (a lookup that finds chunks only below the CPU pool promotes them and answers
``None``, "ask later"); each plan ships them to the workers as one packed buffer, and they are
completed from the workers' reports like copies. After a reset the core's plan names the tier
jobs in flight apart from the copies (``tier_flush``). Stats gain the tier's counters per
snapshot (``disk_*`` / ``remote_*``); events carry the medium (``CPU``, ``DISK``, ``REMOTE``),
and with KV events off the tiers' events are drained and dropped every step.

Request state lives in the core; the adapter keeps the requests' live hash lists (vLLM appends
to them as tokens are generated; the core reads the hashes it lacks), not the ``Request``
objects (holding the objects made the adapter drop the last reference to each finished request:
about 60 µs a request, freeing its prompt). ``request_finished`` hands a request's last hashes
to the core and lets go of its list, so vLLM drops that last reference too (freeing a list of
hundreds of hashes was a twentieth of a step), and tells the aborted ones apart. The adapter
also keeps the local hit of this step's lookups and this step's written blocks. No Python loop
runs over blocks or hashes: hashes (bytes), block tables and the step's sequences go to the core
as vLLM holds them (:meth:`~kvoffload._core.Scheduler.schedule_batch`), and the plan comes back
as job ids and one buffer of copy runs. With KV events off (vLLM's ``kv_events_config``) the CPU
pools record none.

**Stats and metrics.** The adapter counts what it sees as it happens (lookups, tokens, jobs
planned, the workers' bytes, seconds and per-job samples) into one interval's stats;
``get_stats`` hands the interval out, with a snapshot of the core's counters and gauges
(:func:`~kvoffload.integrations.vllm.metrics.core_snapshot`), at most every
``metrics_interval_ms`` and when the engine falls quiet: two core calls and one stats object a
second, none per step.
"""

from __future__ import annotations

import logging
import time
from time import perf_counter
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.request import RequestStatus

from kvoffload.errors import (
    DuplicateReportError,
    KvOffloadError,
    UnknownJobError,
    UnknownRequestError,
)
from kvoffload.integrations.vllm.messages import (
    SNAPSHOT,
    TIER_COUNTERS,
    KvOffloadMetadata,
    KvOffloadStats,
    KvOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm.metrics import core_snapshot
from kvoffload.scheduler import OffloadConfig

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class SchedulerSide:
    """Maps vLLM's scheduler-side connector calls onto the Rust core scheduler."""

    def __init__(
        self,
        cfg: OffloadConfig,
        exact_fence: bool,
        recompute: bool = False,
        kv_events: bool = True,
        metrics_interval_ms: float = 1000.0,
    ) -> None:
        self.cfg = cfg
        self.exact_fence = exact_fence
        self.recompute = recompute  # vLLM's kv_load_failure_policy is "recompute"
        self.kv_events = kv_events
        self.sched = cfg.to_core()
        if not kv_events:
            self.sched.set_event_limit(0)
        self.block_size = cfg.groups[0].block_size
        self.chunk_tokens = self.block_size * cfg.blocks_per_chunk
        # Request id -> vLLM's live block_hashes list: the requests the core tracks. The
        # Request objects themselves are not kept (the last reference to a finished request,
        # its prompt and its hashes, is vLLM's to drop).
        self.hashes: dict[str, Any] = {}
        # Tracked requests vLLM freed since the last step (request_finished), and the aborted
        # ones among them.
        self.released: set[str] = set()
        self.aborted: set[str] = set()
        self.hit: dict[str, int] = {}  # block-aligned local hit passed to this step's lookup
        self.written: list[Any] = []  # block ids or vLLM's KVCacheBlocks written this step
        self.conservative = False
        self.cancelled: list[int] = []  # loads cancelled by a reset, for the next plan
        self.stats = KvOffloadStats()
        # Lower tiers (disk, shared or both), if configured: the tier counters at the last
        # stats interval.
        self.tiers = cfg.disk_path is not None or cfg.remote_url is not None
        self.tier_seen: dict[str, int] = {}
        self.t = 0.0
        self.step_times: list[float] = []
        # The core's snapshot for Prometheus: at most every metrics_interval_ms (the first
        # stats call takes one), and when the engine falls quiet.
        self.snapshot_every = metrics_interval_ms / 1000.0
        self.next_snapshot = 0.0  # perf_counter() time
        self.snapshot_due = False  # a step found next_snapshot passed (the step's own clock)
        self.chunk_bytes = [
            cfg.bytes_per_chunk(g) * cfg.num_workers for g in range(len(cfg.groups))
        ]

    def has_pending(self) -> bool:
        """Whether some job is still pending in the core."""
        return self.sched.num_pending > 0

    # vLLM's three calls for a new request (about three of each per step): the time of the
    # two that call the core joins the step's (``sched_seconds``). Each reads what it needs
    # of the request once.

    def on_new_request(self, request: Request) -> None:
        # Only the live hash list is kept: the request's first lookup registers it with the
        # core (one core call per new request fewer), and ``request_finished`` registers one
        # freed before any lookup, so its step can release it.
        self.hashes[request.request_id] = request.block_hashes

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        t = perf_counter()
        try:
            rid = request.request_id
            hashes = request.block_hashes
            n = request.num_prompt_tokens
            # One core call: registers the request or appends its new hashes, releases it if
            # vLLM asks again for a request it admitted (it freed the blocks of a failed load
            # under kv_load_failure_policy "recompute", nothing valid kept), and looks it up.
            got = self.sched.lookup_request(rid, n if n > 1 else 1, hashes, num_computed_tokens)
            self.hashes.setdefault(rid, hashes)
            d = self.stats.data
            d["lookups"] += 1
            self.hit[rid] = num_computed_tokens
            if got is None:
                d["lookups_deferred"] += 1
                return None, False
            # vLLM recomputes the last prompt token after a full hit; never load past it.
            room = request.num_tokens - num_computed_tokens
            if got > room:
                got = room if room > 0 else 0
            return got, got > 0
        finally:
            self.t += perf_counter() - t

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        t = perf_counter()
        rid = request.request_id
        try:
            hit = self.hit.pop(rid, None)
            if hit is None:
                # A call without this step's lookup is the second one after an asynchronous
                # load (the core holds the request as running), or an allocation the adapter
                # cannot tell written blocks of (the conservative fence).
                if self.sched.status(rid) == "running":
                    # The blocks allocated since arrive with the scheduler output (its whole
                    # table: the core appends them, written). The others, the load's and, after
                    # a failed load, those vLLM recomputes from the first invalid block on, were
                    # written in the step of the first call (its flush covered them), and the
                    # request has held them since: no store can have read them meanwhile (it
                    # had a load pending), so writing them again needs no flush.
                    return
                self.conservative = True
                hit = 0
            # The blocks beyond the hit are written this step: the core adds them to the
            # step's written set itself (Scheduler.schedule_batch). It reads each
            # KVCacheBlock's block_id itself.
            job = self.sched.allocate(rid, blocks.blocks, hit, num_external_tokens)
            if num_external_tokens > 0:
                if job is None:
                    raise KvOffloadError(
                        f"{rid}: {num_external_tokens} tokens to load but no load job was created"
                    )
                self.stats.data["loaded_tokens"] += num_external_tokens
        finally:
            self.t += perf_counter() - t

    def build_connector_meta(self, so: SchedulerOutput) -> KvOffloadMetadata:
        t = time.perf_counter()
        if t >= self.next_snapshot:
            self.snapshot_due = True
        cached = so.scheduled_cached_reqs
        appended: list[Any] = cached.new_block_ids
        # New requests bring their whole tables (the core appends what it lacks: blocks
        # allocated after an asynchronous load), and so do resumed ones. vLLM's lists of the
        # running requests go to the core as they are (no concatenated copies).
        new = [(nr.req_id, nr.num_computed_tokens, nr.block_ids) for nr in so.scheduled_new_reqs]
        tables: list[tuple[str, Any]] = []
        if cached.resumed_req_ids:
            appended = list(appended)
            for i, rid in enumerate(cached.req_ids):
                if rid in cached.resumed_req_ids:
                    if appended[i]:
                        tables.append((rid, appended[i]))
                    appended[i] = None
        # The tracked requests among those vLLM freed since the last step (request_finished
        # saw most of them), the aborted ones told apart (set operations: no loop over
        # requests).
        done = so.finished_req_ids
        released = self.released & done
        stray = self.hashes.keys() & done
        if stray:
            # Freed without request_finished (vLLM 0.32 always calls it): released if the
            # core tracks them (a request never looked up is not), forgotten either way.
            released |= {rid for rid in stray if self._tracked(rid)}
            for rid in stray - released:
                del self.hashes[rid]
        self.released -= released
        aborted = released & self.aborted
        finished = released - aborted
        self.aborted -= aborted
        exact = self.exact_fence and not self.conservative
        load_jobs, load_reqs, store_jobs, flush, runs, tier_jobs, tier_flush = (
            self.sched.schedule_batch(
                cached.req_ids,
                cached.num_computed_tokens,
                new=new,
                added=so.num_scheduled_tokens,
                appended=appended,
                tables=tables,
                hashes=self.hashes,
                finished=list(finished),
                aborted=list(aborted),
                preempted=list(so.preempted_req_ids or ()),
                written=self.written if exact else None,
            )
        )
        for rid in released:
            self.hashes.pop(rid, None)
        self.written = []
        self.conservative = False
        self.hit.clear()
        meta = KvOffloadMetadata(
            load_jobs=load_jobs,
            load_reqs=load_reqs,
            store_jobs=store_jobs,
            flush=flush,
            runs=runs,
            cancelled=self.cancelled,
            tier_jobs=tier_jobs,
            tier_flush=tier_flush,
        )
        self.cancelled = []
        if self.tiers and not self.kv_events:
            self.sched.take_events()  # the tiers' event queues are not bounded: drain them
        d = self.stats.data
        d["load_jobs"] += len(load_jobs)
        d["store_jobs"] += len(store_jobs)
        d["flushed_jobs"] += len(flush)
        self.t += time.perf_counter() - t
        d["sched_seconds"] += self.t
        d["sched_steps"] += 1
        self.step_times.append(self.t)
        if len(self.step_times) > 100_000:
            del self.step_times[:50_000]
        self.t = 0.0
        return meta

    def _tracked(self, rid: str) -> bool:
        """Whether the core tracks request ``rid``."""
        try:
            self.sched.status(rid)
        except UnknownRequestError:
            return False
        return True

    def request_finished(
        self, request: Request, block_ids: Any = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM frees ``request`` (its id joins the next step's finished ids): the core gets
        the hashes of its last tokens now, and the adapter lets go of its hash list, so the
        last reference to the list (and its hashes) stays vLLM's to drop, outside the step.
        An aborted one is remembered, so the step releases it as aborted. vLLM's
        ``request_finished`` (``_all_groups``) itself: ``block_ids`` is not read, and the
        blocks are freed at once (``(False, None)``); the fence protects pending stores."""
        rid = request.request_id
        hashes = self.hashes.pop(rid, None)
        if hashes is None:
            return False, None
        t = perf_counter()
        try:
            n = request.num_prompt_tokens
            self.sched.sync_request(rid, n if n > 1 else 1, hashes)
        finally:
            self.released.add(rid)
            if request.status == RequestStatus.FINISHED_ABORTED:
                self.aborted.add(rid)
            self.t += perf_counter() - t
        return False, None

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        t = time.perf_counter()
        meta = out.kv_connector_worker_meta
        if isinstance(meta, KvOffloadWorkerMetadata):
            d = self.stats.data
            d["bytes_loaded"] += meta.bytes_loaded
            d["bytes_stored"] += meta.bytes_stored
            d["load_seconds"] += meta.load_seconds
            d["store_seconds"] += meta.store_seconds
            d["flush_seconds"] += meta.flush_seconds
            # The samples of an interval (many steps) grow in place.
            if meta.load_sizes:
                d.setdefault("load_sizes", []).extend(meta.load_sizes)
                d.setdefault("load_times", []).extend(meta.load_times)
            if meta.store_sizes:
                d.setdefault("store_sizes", []).extend(meta.store_sizes)
                d.setdefault("store_times", []).extend(meta.store_times)
            for medium, (written, read) in meta.tier_bytes.items():
                d[f"{medium}_bytes_written"] += written
                d[f"{medium}_bytes_read"] += read
            ok = bad = 0
            for rank, (done, failed) in meta.by_rank().items():
                try:
                    n_ok, n_failed = self.sched.complete_counts(done, failed, rank)
                except (UnknownJobError, DuplicateReportError):
                    n_ok, n_failed = self._complete_each(done, failed, rank)
                ok += n_ok
                bad += n_failed
            d["jobs_completed"] += ok
            d["jobs_failed"] += bad
        self.t += time.perf_counter() - t

    def _complete_each(self, done: list[int], failed: list[int], rank: int) -> tuple[int, int]:
        """A report with a job vLLM delivered twice or this scheduler never made: the valid
        ones are applied one by one, the others counted and ignored. Returns the jobs that
        completed, ``(ok, failed)``."""
        out = [0, 0]
        for jobs, ok in ((done, True), (failed, False)):
            for job in jobs:
                try:
                    c = self.sched.complete(job, rank, ok)
                except (UnknownJobError, DuplicateReportError) as e:
                    logger.debug("kvoffload: ignoring a report: %s", e)
                    self.stats.data["reports_ignored"] += 1
                    continue
                if c is not None:
                    out[0 if c.ok else 1] += 1
        return out[0], out[1]

    def take_events(self) -> list[KVCacheEvent]:
        if not self.kv_events:
            return []
        events: list[KVCacheEvent] = []
        for kind, group, keys, medium in self.sched.take_events():
            if kind == "stored":
                events.append(
                    BlockStored(
                        block_hashes=list(keys),
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=self.chunk_tokens,
                        lora_id=None,
                        medium=medium.upper(),
                        lora_name=None,
                        group_idx=group,
                    )
                )
            else:
                events.append(
                    BlockRemoved(block_hashes=list(keys), medium=medium.upper(), group_idx=group)
                )
        return events

    def get_stats(self) -> KvOffloadStats | None:
        """The stats of the interval that ends now, with a snapshot of the core, when one is
        due: ``metrics_interval_ms`` passed, or the engine fell quiet (no request tracked, no
        job pending: its figures are final until it steps again); else ``None``. vLLM calls it
        once a step: between snapshots the counters and samples keep adding up in one object
        (vLLM sums intervals anyway), so a step builds none and reads no clock (the step's
        ``build_connector_meta`` tells when the interval is over)."""
        if not self.snapshot_due and (self.hashes or self.sched.num_pending):
            return None
        self.snapshot_due = False
        self._snapshot(time.perf_counter())
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KvOffloadStats()
        return out

    def _snapshot(self, now: float) -> None:
        """Puts the core's cumulative counters and gauges in this interval's stats, and adds
        each lower tier's counters since the last snapshot (summed over groups)."""
        self.next_snapshot = now + self.snapshot_every
        tiers = self.sched.tier_stats() if self.tiers else []
        self.stats.data[SNAPSHOT] = core_snapshot(
            self.sched.stats(), tiers, self.chunk_bytes, self.chunk_tokens
        )
        seen: dict[str, int] = {}
        for g in tiers:
            for k in TIER_COUNTERS:
                key = f"{g['medium']}_{k}"
                seen[key] = seen.get(key, 0) + int(g[k])
        for k, v in seen.items():
            self.stats.data[k] += v - self.tier_seen.get(k, 0)
        self.tier_seen = seen

    def reset_cache(self) -> bool:
        loading = self.sched.loading_requests
        if loading and not self.recompute:
            # A cancelled load is reported to vLLM as failed: under the "fail" policy that
            # would fail the request.
            logger.warning(
                "kvoffload: not resetting the CPU tier while %d load(s) are in flight "
                "(kv_load_failure_policy 'recompute' allows it)",
                loading,
            )
            return False
        # The flushed jobs join the next plan's flush set. The workers still run the cancelled
        # loads (they are in the flush set) but report them as failed: vLLM frees those
        # requests' blocks and asks for them again.
        _, cancelled = self.sched.reset()
        self.cancelled.extend(job for _, job in cancelled)
        return True
