""":class:`TransferEngine`: the data plane of one worker, and its one call per step.

:meth:`TransferEngine.step` takes one step plan's stores, flush set and loads and does them in
the one correct order (DESIGN.md §3, step 4). It is the only call an engine adapter needs
besides :meth:`~TransferEngine.poll`; an id the engine never saw in a flush set or in
:meth:`~TransferEngine.wait` / :meth:`~TransferEngine.fence` raises
:class:`~kvoffload.errors.UnknownJobError` instead of being skipped. A failed job is reported
only once nothing of it is still running. A load in its own plan's flush set (its request was
released in the same step) is submitted first and waited for (``docs/design-notes.md``).

**Several workers.** Under tensor parallelism each worker holds its shard of the KV cache and
its own engine; all state is per instance, completions are per worker, and the scheduler counts
them (a job is done when every worker reported it).

**Threads and lifetime.** Every method may be called from any thread: one lock guards the job
tables, and no method blocks while holding it (a host wait does not stop another thread's
poll); each result is returned exactly once. :class:`_Resources` releases the lanes, streams and
the pool's registration exactly once, from :meth:`~TransferEngine.shutdown` or the finalizer.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import SupportsIndex

import torch

from kvoffload.errors import (
    ConfigError,
    EngineClosedError,
    TransferError,
    UnknownJobError,
)
from kvoffload.transfer.completions import _Completions
from kvoffload.transfer.cpu import _build_copier, _Lane
from kvoffload.transfer.cuda import _allocate_pool, _submit_on_stream
from kvoffload.transfer.execute import _CANCELLED, _Runtime
from kvoffload.transfer.ids import _id_list, _IdRanges, _index
from kvoffload.transfer.jobs import JobKind, Transfer, TransferResult, _Job
from kvoffload.transfer.layout import (
    GroupCaches,
    Layout,
    _carve_pool,
    _Group,
    _parse_kv_caches,
    _pool_offsets,
)
from kvoffload.transfer.options import _check_memory, _options, _pool_slots
from kvoffload.transfer.plan import _plan, _plan_many, _plan_packed
from kvoffload.transfer.resources import _Resources


class TransferEngine:
    """Executes store and load jobs between registered KV tensors and a CPU pool.

    Example:
        >>> kv = [{"layer0": (k0, v0), "layer1": (k1, v1)}]  # one KV group, K/V separate
        >>> with TransferEngine(kv, blocks_per_chunk=4, num_slots=256) as eng:
        ...     eng.step(stores=[(1, [(0, gpu_blocks, cpu_positions)])])  # queued
        ...     eng.step()  # next step: submitted
        ...     eng.wait([1])
        ...     [r] = eng.poll()

    An engine adapter calls :meth:`step` once per engine step with the step plan; the other
    job methods are the pieces :meth:`step` is made of. Job ids are the scheduler's; an id may
    be reused once its result has been polled. Every method may be called from any thread.
    """

    def __init__(
        self,
        kv_caches: Sequence[GroupCaches],
        *,
        blocks_per_chunk: int,
        num_slots: int | None = None,
        cpu_bytes: int | None = None,
        layout: Layout | Sequence[Layout] = "blocks_first",
        pin_memory: bool | None = None,
        cpu_copy_threads: int | None = None,
        _copy_delay_s: float = 0.0,
        _before_copy: Callable[[int, int], None] | None = None,
        _fault_injector: Callable[[int], None] | None = None,
    ) -> None:
        """Validate and register the KV tensors and allocate the CPU pool.

        Args:
            kv_caches: Per KV group, its layers: a mapping ``name -> layer`` or a sequence of
                layers; a layer is a tensor or a tuple of tensors (e.g. ``(K, V)``). All tensors
                of a group must have the same ``num_blocks`` and dtype; all tensors must be on
                one device (``cpu`` or ``cuda``).
            blocks_per_chunk: GPU blocks per chunk (per slot).
            num_slots: Slots per group. Exactly one of ``num_slots`` and ``cpu_bytes``.
            cpu_bytes: Pool budget; every group gets ``cpu_bytes // sum(bytes_per_slot)`` slots.
            layout: ``"blocks_first"`` or ``"kv_first"``, for all groups or one per group.
            pin_memory: Pin the pool for asynchronous GPU copies; default: the tensors are on
                CUDA.
            cpu_copy_threads: CPU engines: threads a large job (>= 2 MiB) is split over, like
                torch's own parallel ``copy_``; default ``torch.get_num_threads()``. Jobs run
                unsplit while a per-copy test hook (``_copy_delay_s``, ``_before_copy``) is set.
            _copy_delay_s: Test hook: sleep this long before every copy.
            _before_copy: Test hook: called with ``(job_id, copy_index)`` before every copy, on
                the thread that issues it; raising fails the job.
            _fault_injector: Test hook: called with the job id before a job's first copy;
                raising fails the job.

        Raises:
            ConfigError: A bad ``blocks_per_chunk``, capacity, ``layout``, ``pin_memory``,
                ``cpu_copy_threads`` or hook argument; a pool this machine cannot hold.
            RegistrationError: Unusable tensors; the message names group, layer and tensor.
        """
        opts = _options(
            kv_caches,
            blocks_per_chunk=blocks_per_chunk,
            num_slots=num_slots,
            cpu_bytes=cpu_bytes,
            layout=layout,
            pin_memory=pin_memory,
            cpu_copy_threads=cpu_copy_threads,
            copy_delay_s=_copy_delay_s,
            before_copy=_before_copy,
            fault_injector=_fault_injector,
        )
        device, parsed = _parse_kv_caches(kv_caches, opts.layouts)
        bpc = opts.blocks_per_chunk
        slot_bytes = [bpc * sum(r.size(1) for _, r in rows) for rows, _, _ in parsed]
        slots, what = _pool_slots(slot_bytes, num_slots, cpu_bytes)
        pin = device.type == "cuda" if opts.pin_memory is None else opts.pin_memory
        if pin and not torch.cuda.is_available():
            raise ConfigError("pin_memory=True needs CUDA, which is not available")
        offsets, total = _pool_offsets(slot_bytes, slots)
        _check_memory(what, total)
        self._resources = _Resources()
        try:
            pool, pinned, self._resources.registered_ptr = _allocate_pool(total, pin)
        except (RuntimeError, MemoryError, OverflowError) as exc:
            raise ConfigError(
                f"{what}: cannot allocate a CPU pool of {total} bytes: {exc}"
            ) from None
        groups = _carve_pool(parsed, pool, offsets, slots * bpc)
        copier = _build_copier(groups) if device.type == "cpu" else None

        self._device = device
        self._groups: tuple[_Group, ...] = tuple(groups)
        self._shapes = [
            (g.num_blocks, g.num_cpu_blocks, g.bytes_per_block, len(g.regions)) for g in groups
        ]
        self._bpc = bpc
        self._num_slots = slots
        self._pool = pool
        self._pinned = pinned
        self._runtime = _Runtime(self._groups, copier, opts.hooks, opts.parts)
        self._lock = threading.RLock()
        self._queued: dict[int, _Job] = {}
        self._inflight: dict[int, _Job] = {}
        self._seen = _IdRanges()
        self._sink = _Completions()
        self._closed = False
        self._stats = {
            "jobs_submitted": 0,
            "jobs_ok": 0,
            "jobs_failed": 0,
            "copies": 0,
            "bytes_stored": 0,
            "bytes_loaded": 0,
            "flush_waits": 0,
            "flush_wait_us": 0,
        }
        kinds: tuple[JobKind, ...] = ("store", "load")
        for kind in kinds:
            if copier is not None:
                self._resources.lanes[kind] = _Lane(f"kvoffload-{kind}", self._runtime, self._sink)
            else:
                self._resources.streams[kind] = torch.cuda.Stream(device=device)
        self._finalizer = weakref.finalize(self, self._resources.release, cancel=True, join=False)

    @property
    def device(self) -> torch.device:
        """The device of the registered tensors."""
        return self._device

    @property
    def num_groups(self) -> int:
        """Number of registered KV groups."""
        return len(self._groups)

    @property
    def blocks_per_chunk(self) -> int:
        """GPU blocks per chunk (per slot)."""
        return self._bpc

    @property
    def num_slots(self) -> int:
        """Slots per group (every group has the same number)."""
        return self._num_slots

    @property
    def pinned(self) -> bool:
        """Whether the CPU pool is pinned (page-locked)."""
        return self._pinned

    @property
    def pool_bytes(self) -> int:
        """Size of the CPU pool allocation in bytes."""
        return int(self._pool.numel())

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` was called."""
        return self._closed

    def num_blocks(self, group: int) -> int:
        """GPU blocks of ``group``."""
        return self._group(group).num_blocks

    def num_tensors(self, group: int) -> int:
        """Registered block-first tensors (regions) of ``group``; a K/V-first tensor counts 2."""
        return len(self._group(group).regions)

    def bytes_per_slot(self, group: int) -> int:
        """Bytes one slot of ``group`` holds: ``blocks_per_chunk * sum(bytes_per_block)``."""
        return self._bpc * self._group(group).bytes_per_block

    def tensor_names(self, group: int) -> list[str]:
        """Names of ``group``'s regions, in pool order."""
        return [r.name for r in self._group(group).regions]

    def cpu_region(self, group: int, tensor: int) -> torch.Tensor:
        """The CPU region of one registered tensor: ``[num_slots * bpc, bytes_per_block]`` uint8.

        Position ``slot * bpc + offset`` holds the bytes of one block. The view aliases the pool.
        """
        regions = self._group(group).regions
        t = _index(tensor, "tensor", TransferError)
        if not 0 <= t < len(regions):
            raise TransferError(f"group {group} has {len(regions)} tensors, not tensor {t}")
        return regions[t].cpu

    @property
    def flush_wait_us(self) -> int:
        """µs the host waited for flushed jobs so far (``stats()["flush_wait_us"]``, without
        building the dict: read every step)."""
        return self._stats["flush_wait_us"]

    def stats(self) -> dict[str, int]:
        """A snapshot of the counters: jobs submitted; over polled jobs, ok/failed jobs, copies
        and bytes; the steps whose host waited for flushed jobs and the µs it waited (CPU
        devices; on CUDA the compute stream waits instead); plus the number of queued jobs and
        of submitted jobs not yet polled."""
        with self._lock:
            return {**self._stats, "queued": len(self._queued), "in_flight": len(self._inflight)}

    # ----------------------------------------------------------------- the worker step

    def step(
        self,
        stores: Iterable[tuple[SupportsIndex, Iterable[Transfer]]] = (),
        flush: Iterable[SupportsIndex] = (),
        loads: Iterable[tuple[SupportsIndex, Iterable[Transfer]]] = (),
    ) -> None:
        """One engine step's data-plane work, in the one correct order (DESIGN.md §3, step 4).

        1. Submit the stores queued by the previous step: the compute that wrote their blocks
           is enqueued by now (on CUDA the copy stream waits for it).
        2. Of this plan's ``stores``, submit the flushed ones now (a store of a request released
           this step can be in its own step's flush set) and queue the others for the next
           :meth:`step`; submit the flushed ``loads`` now too (a load whose request was released
           in the step that created it no longer writes blocks of its own).
        3. Complete the flush set: on CPU the host waits for the jobs, on CUDA the current
           (compute) stream waits for them.
        4. Submit the other ``loads``.

        Call it before the step's forward pass. Everything is checked before anything starts:
        on error nothing is queued, submitted or waited for.

        Args:
            stores: The plan's store jobs, ``(job_id, transfers)`` each.
            flush: Jobs that must complete before this step writes its blocks. Each must be
                known to this engine (queued, running, finished) or a job of this call.
            loads: The plan's load jobs, ``(job_id, transfers)`` each.

        Raises:
            TransferError: A malformed job, or a job id given twice or already in use.
            InvalidBlockError: A block id or CPU position out of range.
            UnknownJobError: A flushed id this engine never saw, or an id that is not an
                integer.
            EngineClosedError: After shutdown.
        """
        new_stores = _plan_many(self._groups, stores, "store", "step stores")
        new_loads = _plan_many(self._groups, loads, "load", "step loads")
        self._step(new_stores, _id_list(flush, "step flush"), new_loads)

    def step_packed(
        self,
        load_jobs: Iterable[SupportsIndex],
        store_jobs: Iterable[SupportsIndex],
        flush: Iterable[SupportsIndex],
        runs: bytes,
    ) -> None:
        """:meth:`step` for a plan as the core packs it: job ids and one buffer of runs.

        The rows of ``runs`` (``StepPlan.runs``, or ``Scheduler.schedule_batch``'s) are checked
        once, in the core, and read in place by the copies: no per-job or per-block list is
        built. Same order and guarantees as :meth:`step`.

        Args:
            load_jobs: The plan's load job ids.
            store_jobs: The plan's store job ids.
            flush: Jobs that must complete before this step writes its blocks.
            runs: Rows of five little-endian ``uint32`` (index of the job in
                ``load_jobs + store_jobs``, group, first GPU block, first CPU position, length),
                the rows of one job consecutive.

        Raises:
            TransferError: A malformed buffer or row (the message names the row), a job id
                given twice or already in use.
            InvalidBlockError: A row whose blocks or CPU positions are out of range (named).
            UnknownJobError: A flushed id this engine never saw.
            EngineClosedError: After shutdown.
        """
        new_loads, new_stores = _plan_packed(self._shapes, load_jobs, store_jobs, runs)
        self._step(new_stores, _id_list(flush, "step flush"), new_loads)

    def _step(self, new_stores: list[_Job], flush_ids: list[int], new_loads: list[_Job]) -> None:
        """:meth:`step` with its jobs validated."""
        with self._lock:
            self._check_open()
            mine: set[int] = set()
            for job in (*new_stores, *new_loads):
                self._check_free(job.job_id)
                if job.job_id in mine:
                    raise TransferError(f"step: job {job.job_id} is given twice")
                mine.add(job.job_id)
            store_ids = {j.job_id for j in new_stores}
            load_ids = {j.job_id for j in new_loads}
            flushed = set(flush_ids)
            for jid in flush_ids:
                if jid not in store_ids and jid not in load_ids:
                    self._check_known(jid, "step flush")
            # 1. The previous step's stores.
            for jid in list(self._queued):
                self._submit(self._queued.pop(jid))
            # 2. This plan's stores: flushed ones now, the others at the next step.
            for job in new_stores:
                self._seen.add(job.job_id)
                if job.job_id in flushed:
                    self._submit(job)
                else:
                    self._queued[job.job_id] = job
            early = [job for job in new_loads if job.job_id in flushed]
            for job in early:
                self._seen.add(job.job_id)
                self._submit(job)
            waiting = self._unfinished(flush_ids)
            if self._device.type == "cuda":
                stream = torch.cuda.current_stream(self._device)
                for job in waiting:
                    if job.end_event is not None:
                        stream.wait_event(job.end_event)
        # 3. Complete the flush set (the host waits without the lock: polls go on meanwhile).
        if self._device.type != "cuda" and waiting:
            t = time.perf_counter()
            self._sink.block(waiting, None)
            with self._lock:
                self._stats["flush_waits"] += 1
                self._stats["flush_wait_us"] += int(1e6 * (time.perf_counter() - t))
        # 4. The other loads.
        rest = [job for job in new_loads if job.job_id not in flushed]
        with self._lock:
            self._check_open()
            for job in rest:
                self._check_free(job.job_id)
            for job in rest:
                self._seen.add(job.job_id)
                self._submit(job)

    # ----------------------------------------------------------------- jobs

    def queue_store(self, job_id: SupportsIndex, transfers: Iterable[Transfer]) -> None:
        """Accept a store without starting it; :meth:`submit_queued` or a flush starts it.

        The engine's step-N stores are started at the start of step N+1, after the compute that
        wrote their blocks has been enqueued. Adapters use :meth:`step`, which does this.

        Raises:
            TransferError: Malformed job or duplicate id. Nothing is queued.
            InvalidBlockError: A block id or CPU position out of range. Nothing is queued.
            EngineClosedError: After shutdown.
        """
        job = _plan(self._groups, job_id, transfers, "store")
        with self._lock:
            self._check_open()
            self._check_free(job.job_id)
            self._seen.add(job.job_id)
            self._queued[job.job_id] = job

    def submit_queued(self) -> list[int]:
        """Start every queued store, in queue order; return their ids."""
        with self._lock:
            self._check_open()
            ids = list(self._queued)
            for jid in ids:
                self._submit(self._queued.pop(jid))
            return ids

    def submit_store(self, job_id: SupportsIndex, transfers: Iterable[Transfer]) -> None:
        """Start a store (GPU blocks → CPU positions) now.

        Args:
            job_id: The job's id; must not be queued or unpolled already.
            transfers: ``(group, gpu_blocks, cpu_blocks)`` triples; ``cpu_blocks[i]`` is the
                position ``slot * blocks_per_chunk + offset`` in the group's CPU regions.

        Raises:
            TransferError: Malformed job or duplicate id. Nothing is submitted.
            InvalidBlockError: A block id or CPU position out of range. Nothing is submitted.
            EngineClosedError: After shutdown.
        """
        self._start(_plan(self._groups, job_id, transfers, "store"))

    def submit_load(self, job_id: SupportsIndex, transfers: Iterable[Transfer]) -> None:
        """Start a load (CPU positions → GPU blocks) now. Same arguments as :meth:`submit_store`.

        Raises:
            TransferError: Malformed job or duplicate id. Nothing is submitted.
            InvalidBlockError: A block id or CPU position out of range. Nothing is submitted.
            EngineClosedError: After shutdown.
        """
        self._start(_plan(self._groups, job_id, transfers, "load"))

    def poll(self) -> list[TransferResult]:
        """Results of the jobs finished since the last poll, each returned exactly once."""
        with self._lock:
            self._check_open()
            return self._collect()

    def wait(self, job_ids: Iterable[SupportsIndex], timeout: float | None = None) -> None:
        """Block the host until the jobs are done; their results still come from :meth:`poll`.

        A queued job is submitted first, so a flush is never a no-op. Ids of jobs that already
        finished (polled or not) are fine.

        Args:
            job_ids: The jobs to wait for.
            timeout: Give up after this many seconds (``None``: wait as long as it takes).

        Raises:
            UnknownJobError: An id this engine never saw, or one that is not an integer.
                Nothing is submitted or waited for.
            TransferError: A bad timeout, or the timeout passed with jobs still running (the
                jobs keep running).
            EngineClosedError: After shutdown.
        """
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TransferError(f"wait: timeout must be None or seconds, got {timeout!r}")
            if not timeout >= 0:  # also nan
                raise TransferError(f"wait: timeout must be >= 0, got {timeout!r}")
            if timeout >= threading.TIMEOUT_MAX:  # inf, or longer than a lock can wait
                timeout = None
        ids = _id_list(job_ids, "wait")
        with self._lock:
            self._check_open()
            for jid in ids:
                self._check_known(jid, "wait")
            jobs = self._flush(ids)
        self._sink.block(jobs, timeout)

    def fence(self, job_ids: Iterable[SupportsIndex]) -> None:
        """Order the current compute stream after the jobs, without blocking the host.

        On CUDA the current stream waits on each job's end event; on CPU this is :meth:`wait`.
        A queued job is submitted first. Ids of jobs that already finished are fine.

        Raises:
            UnknownJobError: An id this engine never saw, or one that is not an integer.
            EngineClosedError: After shutdown.
        """
        if self._device.type != "cuda":
            self.wait(job_ids)
            return
        ids = _id_list(job_ids, "fence")
        with self._lock:
            self._check_open()
            for jid in ids:
                self._check_known(jid, "fence")
            stream = torch.cuda.current_stream(self._device)
            for job in self._flush(ids):
                if job.end_event is not None:
                    stream.wait_event(job.end_event)

    def shutdown(self, wait: bool = True) -> list[TransferResult]:
        """Stop the engine and return every result not yet polled.

        Args:
            wait: ``True``: submit the queued stores and drain every job. ``False``: queued
                jobs and CPU jobs not yet finished are cancelled and reported failed; GPU
                copies already enqueued cannot be cancelled and are waited for.

        Returns:
            The results :meth:`poll` would have returned, cancelled jobs included. A second
            call returns ``[]``. Every other method raises :class:`EngineClosedError` after.
        """
        cancelled: list[TransferResult] = []
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            if wait:
                for jid in list(self._queued):
                    self._submit(self._queued.pop(jid))
            else:
                for job in self._queued.values():
                    job.error = f"{_CANCELLED} (never submitted)"
                    cancelled.append(job.result())
                self._queued.clear()
        # Join the copy threads without the lock: a finalizer on one of them may call in.
        self._resources.release(cancel=not wait, join=True)
        with self._lock:
            results = cancelled + self._collect(drain=True)
            self._stats["jobs_failed"] += len(cancelled)
        return results

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.shutdown(wait=exc_type is None)

    # ----------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the TransferEngine was shut down; create a new one")

    def _check_free(self, jid: int) -> None:
        if jid in self._queued or jid in self._inflight:
            raise TransferError(f"job {jid} is already queued or not yet polled")

    def _check_known(self, jid: int, where: str) -> None:
        if jid not in self._queued and jid not in self._inflight and jid not in self._seen:
            raise UnknownJobError(f"{where}: job {jid} was never queued or submitted here")

    def _group(self, group: object) -> _Group:
        g = _index(group, "group", TransferError)
        if not 0 <= g < len(self._groups):
            raise TransferError(f"unknown group {g}: {len(self._groups)} groups registered")
        return self._groups[g]

    def _start(self, job: _Job) -> None:
        with self._lock:
            self._check_open()
            self._check_free(job.job_id)
            self._seen.add(job.job_id)
            self._submit(job)

    def _submit(self, job: _Job) -> None:
        """Start a validated job on its lane (CPU) or stream (CUDA). Call with the lock held."""
        job.t_submit = time.perf_counter()
        self._inflight[job.job_id] = job
        self._stats["jobs_submitted"] += 1
        lane = self._resources.lanes.get(job.kind)
        if lane is not None:
            lane.put(job)
            return
        stream = self._resources.streams[job.kind]
        _submit_on_stream(job, self._runtime, stream, self._device, self._sink)

    def _flush(self, ids: list[int]) -> list[_Job]:
        """Submit the queued ones among ``ids``; return the unfinished jobs. Lock held."""
        for jid in ids:
            job = self._queued.pop(jid, None)
            if job is not None:
                self._submit(job)
        return self._unfinished(ids)

    def _unfinished(self, ids: list[int]) -> list[_Job]:
        return [job for jid in ids if (job := self._inflight.get(jid)) is not None]

    def _collect(self, *, drain: bool = False) -> list[TransferResult]:
        """Results of the finished jobs, taken from the in-flight table. Lock held."""
        return self._sink.collect(self._inflight, self._stats, drain=drain)
