"""The torch data plane: moves KV-cache blocks between the engine's tensors and a CPU pool.

:class:`TransferEngine` runs on each worker (one per tensor-parallel rank) and executes the jobs
of a step plan. It is the only place in kvoffload that touches tensors; the Rust core never sees
a device pointer.

**Registration.** The engine hands over its KV cache tensors per KV group and per layer. A layer
is one tensor or a tuple of tensors (K and V separate). Each tensor has one of two layouts:

* ``"blocks_first"``: ``[num_blocks, ...]``. K and V may be separate tensors or joined in one
  (``[num_blocks, 2, ...]``): either way the bytes of one block are one dense range.
* ``"kv_first"``: ``[2, num_blocks, ...]``, the layout of vLLM's FlashAttention backend. K and V
  are split into two block-first views.

Inner dimensions may be permuted (vLLM's ``kv_cache_stride_order``) as long as the bytes of one
block form one dense range; the data plane copies raw bytes (``uint8``), so every dtype works,
fp8 included. Shapes, dtypes and devices are validated up front (:class:`RegistrationError`).

**CPU pool layout (a deliberate deviation from DESIGN.md §6).** The design says a slot holds one
chunk for every layer, contiguous. Here the pool is *tensor-major*: per KV group it is
``[num_tensors, num_slots * blocks_per_chunk, bytes_per_block]``, one region per registered
(block-first) tensor, and slot ``s`` is the block positions ``[s * bpc, (s + 1) * bpc)`` in
every region. With this layout consecutive slots are consecutive in memory per tensor, so a job
whose GPU blocks and CPU positions both form a run becomes ONE copy per tensor per run, even
across slot boundaries. With the slot-major layout a run could never cross a slot, and with
``blocks_per_chunk=1`` every block of every layer would be its own tiny copy. CPU positions are
addressed as ``slot * bpc + offset_in_chunk``, so a store may start in the middle of a chunk.
Each group has its own regions and its own position space; all groups get the same number of
slots.

**Copies.** A job is a list of transfers ``(group, gpu_blocks, cpu_blocks)``. Runs where both the
GPU block ids and the CPU positions are consecutive are found with numpy and copied with one
copy per run per tensor; :attr:`TransferResult.copies` reports how many were issued.

* On CUDA: one ``copy_(non_blocking=True)`` per run per tensor, on one stream per direction.
  Before a job's copies, an event is recorded on the current (compute) stream and the copy
  stream waits on it, so a store reads its blocks after the compute that wrote them and a load
  writes its blocks after the compute that last used them. An end event per job tells
  completion; :meth:`TransferEngine.wait` blocks the host on it and
  :meth:`TransferEngine.fence` makes the compute stream wait on it instead. The pool is pinned
  with ``cudaHostRegister`` on a plain allocation (torch's pinned allocator rounds sizes up to a
  power of two, which would nearly double a large pool). Each copy costs a few µs of host time,
  so many scattered small blocks are bound by that (``benches/gpu_transfer.py`` measures it).
* On CPU: copies run on one background thread per direction, so they really overlap with the
  caller, with the same API and guarantees. Copies go through the Rust core's
  :class:`kvoffload._core.Copier`, built once from the storages of the registered tensors and
  the pool (it holds them, so the memory outlives it): a job names rows by group, region and
  row index, and the core checks every row against the registration before a byte moves, so
  no call can read or write outside registered memory. A job is one call, which copies with
  the GIL released, in 256 KiB pieces, and splits a large job (>= 2 MiB) over
  ``cpu_copy_threads`` threads. The lane takes the GIL once per job: a caller that holds the
  GIL (an engine loop spinning while it waits for a load) cannot stall the copies. With a
  per-copy test hook set, the same core copy runs once per run per tensor, the hook before
  each. ``benches/bench_transfer.py`` compares the result with a plain ``copy_``.

**Failures.** A copy that raises marks its job failed (``ok=False`` from :meth:`poll`); the job
never hangs. Nothing becomes visible on failure because visibility is the scheduler's decision:
it does not publish a failed store, and it recomputes the blocks of a failed load. A failed
job is reported only once nothing of it is still running.

**The worker step.** :meth:`TransferEngine.step` takes one step plan's stores, flush set and
loads and does them in the one correct order (DESIGN.md §3, step 4). It is the only call an
engine adapter needs besides :meth:`~TransferEngine.poll`; an id the engine never saw in a
flush set or in :meth:`~TransferEngine.wait` / :meth:`~TransferEngine.fence` raises
:class:`~kvoffload.errors.UnknownJobError` instead of being skipped.

**Several workers.** Under tensor parallelism each worker holds its shard of the KV cache and
its own :class:`TransferEngine`; all state is per instance, completions are per worker, and the
scheduler counts them (a job is done when every worker reported it).

**Threads and lifetime.** Every method may be called from any thread: one lock guards the job
tables, and no method blocks while holding it (a host wait does not stop another thread's
poll); each result is returned exactly once. The copy threads hold the engine's tensors only
while a job runs and never the engine itself, so an engine dropped without :meth:`shutdown`
(even in a reference cycle, even collected on its own copy thread) stops its threads and frees
its pool.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import operator
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, SupportsIndex, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvoffload._core import Copier
from kvoffload.errors import (
    ConfigError,
    EngineClosedError,
    InvalidBlockError,
    RegistrationError,
    TransferError,
    UnknownJobError,
)

__all__ = [
    "BlockIds",
    "GroupCaches",
    "JobKind",
    "LayerCache",
    "Layout",
    "Transfer",
    "TransferEngine",
    "TransferResult",
]

Layout: TypeAlias = Literal["blocks_first", "kv_first"]
"""Layout of a registered tensor: ``[num_blocks, ...]`` or ``[2, num_blocks, ...]``."""
LayerCache: TypeAlias = torch.Tensor | Sequence[torch.Tensor]
"""One layer's KV cache: one tensor (joined K/V or a single latent) or several (K, V)."""
GroupCaches: TypeAlias = Mapping[str, LayerCache] | Sequence[LayerCache]
"""One KV group's layers, by name (a mapping, as vLLM registers them) or by position."""
BlockIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
"""A one-dimensional sequence of integer block ids or CPU positions."""
Transfer: TypeAlias = tuple[SupportsIndex, BlockIds, BlockIds]
"""``(group, gpu_blocks, cpu_blocks)``; ``cpu_blocks[i] = slot * blocks_per_chunk + offset``."""
JobKind: TypeAlias = Literal["store", "load"]
"""``"store"`` copies GPU blocks to the CPU pool, ``"load"`` copies them back."""

_PARALLEL_MIN_BYTES = 2 << 20
"""CPU engines split a job of at least this many bytes over their copy threads (a hand-off to a
helper thread costs tens of µs, one 2 MiB memcpy ~100 µs)."""
_GROUP_ALIGN = 4096
"""Each group's regions start on this byte boundary in the pool allocation."""
_CANCELLED = "cancelled by shutdown"
_MAX_ID_RANGES = 4096
"""Ranges of job ids an engine remembers exactly (see :class:`_IdRanges`)."""


@dataclass(frozen=True, slots=True)
class TransferResult:
    """Outcome of one finished job, returned once by :meth:`TransferEngine.poll`.

    Attributes:
        job_id: The job's id.
        kind: ``"store"`` or ``"load"``.
        ok: Whether every copy of the job succeeded. A failed store must not be published and
            a failed load's blocks must be recomputed.
        bytes: Bytes copied (for a successful job, all bytes of the job).
        copies: Copies issued: one per run of consecutive blocks per registered tensor.
        seconds: Host time from submission to completion (on CUDA, to the moment the host
            observed completion). ``0.0`` for a job cancelled before submission.
        error: Why the job failed, or ``None``.
    """

    job_id: int
    kind: JobKind
    ok: bool
    bytes: int
    copies: int
    seconds: float
    error: str | None


@dataclass(frozen=True, slots=True)
class _Region:
    """One registered block-first tensor and its CPU region, both as ``[n, bytes_per_block]``."""

    name: str
    gpu: torch.Tensor
    cpu: torch.Tensor
    bytes_per_block: int


@dataclass(frozen=True, slots=True)
class _Group:
    """A KV group: its regions, GPU block count and CPU position count."""

    regions: tuple[_Region, ...]
    num_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int
    dtype: torch.dtype


_Run = tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]
"""``(group, gpu_starts, cpu_starts, lengths)`` for the runs of one transfer."""


class _Job:
    """A validated job: its runs, plus progress written by whoever executes it."""

    __slots__ = (
        "bytes",
        "copies",
        "done",
        "end_event",
        "error",
        "job_id",
        "kind",
        "planned_bytes",
        "planned_copies",
        "runs",
        "t_done",
        "t_submit",
    )

    def __init__(
        self,
        job_id: int,
        kind: JobKind,
        runs: list[_Run],
        planned_bytes: int,
        planned_copies: int,
    ) -> None:
        self.job_id = job_id
        self.kind: JobKind = kind
        self.runs = runs
        self.planned_bytes = planned_bytes
        self.planned_copies = planned_copies
        self.bytes = 0
        self.copies = 0
        self.error: str | None = None
        self.t_submit = 0.0
        self.t_done: float | None = None
        self.done = threading.Event()
        self.end_event: torch.cuda.Event | None = None

    def result(self) -> TransferResult:
        """The job's result; call once it is done."""
        t_done = self.t_done if self.t_done is not None else time.perf_counter()
        return TransferResult(
            job_id=self.job_id,
            kind=self.kind,
            ok=self.error is None,
            bytes=self.bytes,
            copies=self.copies,
            seconds=max(0.0, t_done - self.t_submit) if self.t_submit else 0.0,
            error=self.error,
        )


@dataclass(frozen=True, slots=True)
class _Hooks:
    """Test hooks: slow copies down, gate them, or make them fail."""

    copy_delay_s: float
    before_copy: Callable[[int, int], None] | None
    fault_injector: Callable[[int], None] | None

    @property
    def per_copy(self) -> bool:
        """Whether a hook runs before every copy (so copies are issued one by one)."""
        return self.copy_delay_s > 0.0 or self.before_copy is not None


class _Runtime:
    """What executing a job needs: the groups, the core copier (CPU engines) and the hooks.

    Only the engine holds it strongly; copy threads hold a weak reference between jobs, so a
    hook that refers back to the engine's owner cannot keep the engine alive.
    """

    __slots__ = ("__weakref__", "copier", "groups", "hooks", "parts")

    def __init__(
        self, groups: tuple[_Group, ...], copier: Copier | None, hooks: _Hooks, parts: int
    ) -> None:
        self.groups = groups
        self.copier = copier
        self.hooks = hooks
        self.parts = parts


class _CancelledError(Exception):
    """Raised inside a copy loop when shutdown(wait=False) cancels the job."""


def _core_runs(job: _Job) -> list[tuple[int, None, list[int], list[int], list[int]]]:
    """A job's runs in the form :meth:`Copier.copy` takes (every region of each group)."""
    return [(g, None, gs.tolist(), cs.tolist(), ns.tolist()) for g, gs, cs, ns in job.runs]


def _execute(
    job: _Job,
    rt: _Runtime,
    cancel: threading.Event | None,
    *,
    non_blocking: bool,
) -> None:
    """Issue every copy of ``job``; record progress and the first error on the job. Never raises.

    CPU engines copy through the core (:class:`kvoffload._core.Copier`, bounds-checked, GIL
    released): the whole job in one call, or, while a per-copy test hook is set, one call per
    run per tensor so the hook runs before each. CUDA engines issue one ``copy_`` per run per
    tensor on the current (copy) stream.

    Args:
        job: The job to run.
        rt: The engine's runtime.
        cancel: When set, the job stops before its next copy and is reported cancelled.
        non_blocking: Pass ``non_blocking`` to ``copy_`` (CUDA copies from/to pinned memory).
    """
    store = job.kind == "store"
    hooks = rt.hooks
    copier = rt.copier
    try:
        if cancel is not None and cancel.is_set():
            raise _CancelledError
        if hooks.fault_injector is not None:
            hooks.fault_injector(job.job_id)
        if copier is not None and not hooks.per_copy:
            # One call per job: the lane takes the GIL once per job, not once per run, so an
            # engine loop that holds the GIL cannot stall the copies (measured inside vLLM: a
            # 12.8 MB load took 160-280 ms when copied run by run under a busy engine loop).
            threads = rt.parts if job.planned_bytes >= _PARALLEL_MIN_BYTES else 1
            job.bytes = copier.copy(store, _core_runs(job), threads)
            job.copies = job.planned_copies
            return
        for group, g_starts, c_starts, lengths in job.runs:
            regions = rt.groups[group].regions
            spans = zip(g_starts.tolist(), c_starts.tolist(), lengths.tolist(), strict=True)
            for g0, c0, n in spans:
                for ri, r in enumerate(regions):
                    if cancel is not None and cancel.is_set():
                        raise _CancelledError
                    if hooks.copy_delay_s > 0.0:
                        time.sleep(hooks.copy_delay_s)
                    if hooks.before_copy is not None:
                        hooks.before_copy(job.job_id, job.copies)
                    if copier is not None:
                        job.bytes += copier.copy(store, [(group, ri, [g0], [c0], [n])], 1)
                    elif store:
                        r.cpu[c0 : c0 + n].copy_(r.gpu[g0 : g0 + n], non_blocking=non_blocking)
                        job.bytes += n * r.bytes_per_block
                    else:
                        r.gpu[g0 : g0 + n].copy_(r.cpu[c0 : c0 + n], non_blocking=non_blocking)
                        job.bytes += n * r.bytes_per_block
                    job.copies += 1
    except _CancelledError:
        job.error = _CANCELLED
    except Exception as exc:  # a failed copy fails its job, never the engine
        job.error = f"{type(exc).__name__}: {exc}"


class _Completions:
    """Thread-safe list of finished jobs, drained by ``poll``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[_Job] = []

    def push(self, job: _Job) -> None:
        with self._lock:
            self._jobs.append(job)

    def push_back(self, jobs: list[_Job]) -> None:
        """Return drained jobs that could not be handed out (they come first next time)."""
        with self._lock:
            self._jobs[:0] = jobs

    def drain(self) -> list[_Job]:
        with self._lock:
            jobs, self._jobs = self._jobs, []
        return jobs


def _lane_main(
    jobs: queue.SimpleQueue[_Job | None],
    runtime: weakref.ReferenceType[_Runtime],
    sink: _Completions,
    cancel: threading.Event,
) -> None:
    """A copy thread: runs one direction's jobs in submission order until it gets ``None``.

    Holds the runtime only while a job runs, so the engine can be collected (and its finalizer
    stop this thread) while the thread waits for work.
    """
    while True:
        job = jobs.get()
        if job is None:
            return
        rt = runtime()
        try:
            if rt is None:
                job.error = f"{_CANCELLED} (the engine was collected)"
            else:
                _execute(job, rt, cancel, non_blocking=False)
        except BaseException as exc:  # pragma: no cover - _execute catches Exception
            job.error = f"{type(exc).__name__}: {exc}"
        finally:
            rt = None
            job.t_done = time.perf_counter()
            sink.push(job)
            job.done.set()


class _Lane:
    """A background thread that runs one direction's jobs in submission order (CPU engines)."""

    def __init__(self, name: str, runtime: _Runtime, sink: _Completions) -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.cancel = threading.Event()
        self._thread = threading.Thread(
            target=_lane_main,
            args=(self._queue, weakref.ref(runtime), sink, self.cancel),
            name=name,
            daemon=True,
        )
        self._thread.start()

    def put(self, job: _Job) -> None:
        self._queue.put(job)

    def stop(self, *, cancel: bool) -> None:
        """Ask the thread to end after the jobs already put (cancelling them if ``cancel``)."""
        if cancel:
            self.cancel.set()
        self._queue.put(None)

    def join(self) -> None:
        """Wait for the thread to end, unless this is that thread (it ends after this job)."""
        if self._thread is not threading.current_thread():
            self._thread.join()


class _Resources:
    """What must be released exactly once: lanes, streams, the registration."""

    def __init__(self) -> None:
        self.lanes: dict[JobKind, _Lane] = {}
        self.streams: dict[JobKind, torch.cuda.Stream] = {}
        self.registered_ptr: int | None = None
        self.released = False
        self._lock = threading.Lock()

    def release(self, *, cancel: bool, join: bool) -> None:
        """Stop the lanes (joining them if ``join``), synchronise the streams, unregister the
        pool. Idempotent.

        The engine's finalizer passes ``join=False``: it may run on any thread, one of the lanes
        included, during a garbage collection; a lane holds what it copies alive until its job
        ends, so nothing needs to wait for it.
        """
        with self._lock:
            if self.released:
                return
            self.released = True
        for lane in self.lanes.values():
            lane.stop(cancel=cancel)
        if join:
            for lane in self.lanes.values():
                lane.join()
        for stream in self.streams.values():
            stream.synchronize()  # GPU copies cannot be cancelled; they must end before unpinning
        if self.registered_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self.registered_ptr)
            self.registered_ptr = None


class _IdRanges:
    """The job ids an engine has accepted, as sorted disjoint ranges ``[lo, hi)``.

    The scheduler's ids grow by one, so this is one range in practice. Past ``limit`` ranges the
    two lowest merge: an id in a gap that old then counts as known (finished), never the
    reverse, so a live job is never reported unknown and memory stays bounded.
    """

    def __init__(self, limit: int = _MAX_ID_RANGES) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        self._limit = limit

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self._lo, x) - 1
        return i >= 0 and x < self._hi[i]

    def __len__(self) -> int:
        return len(self._lo)

    def add(self, x: int) -> None:
        lo, hi = self._lo, self._hi
        i = bisect.bisect_right(lo, x) - 1  # the range starting at or before x
        if i >= 0 and x < hi[i]:
            return
        if i >= 0 and hi[i] == x:
            hi[i] = x + 1
            if i + 1 < len(lo) and lo[i + 1] == x + 1:  # joins the next range
                hi[i] = hi[i + 1]
                del lo[i + 1], hi[i + 1]
        elif i + 1 < len(lo) and lo[i + 1] == x + 1:
            lo[i + 1] = x
        else:
            lo.insert(i + 1, x)
            hi.insert(i + 1, x + 1)
            if len(lo) > self._limit:
                hi[0] = hi[1]
                del lo[1], hi[1]


def _job_id(x: object, where: str) -> int:
    """A job id: an integer (not a bool); raises UnknownJobError naming ``x``."""
    if isinstance(x, bool):
        raise UnknownJobError(f"{where}: job id must be an integer, got {x!r}")
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise UnknownJobError(
            f"{where}: job id must be an integer, got {x!r} ({type(x).__name__})"
        ) from None


def _id_list(xs: object, where: str) -> list[int]:
    """Job ids from an iterable; raises UnknownJobError naming the bad value."""
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable):
        raise UnknownJobError(
            f"{where}: job ids must be an iterable of integers, got {xs!r} ({type(xs).__name__})"
        )
    return [_job_id(x, where) for x in xs]


def _size(x: object, name: str, *, minimum: int = 1) -> int:
    """A size argument: an integer (not a bool) >= ``minimum``; raises ConfigError naming it."""
    if isinstance(x, bool):
        raise ConfigError(f"{name} must be an integer, got {x!r}")
    try:
        v = operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {x!r} ({type(x).__name__})") from None
    if v < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {v}")
    return v


def _memory_bytes() -> int | None:
    """Physical memory of this machine, if the OS tells."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return None


def _storage_bytes(x: torch.Tensor) -> npt.NDArray[np.uint8]:
    """All bytes of a CPU tensor's storage, as a 1-D uint8 numpy array sharing its memory."""
    flat = torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage())
    return flat.numpy()


def _index(x: object, name: str, exc: type[Exception]) -> int:
    """An integer argument (not a bool); raises ``exc`` naming ``name`` and the value."""
    if isinstance(x, bool):
        raise exc(f"{name} must be an integer, got {x!r}")
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise exc(f"{name} must be an integer, got {x!r} ({type(x).__name__})") from None


def _cuda_ok(err: object) -> bool:
    """Whether a ``torch.cuda.cudart()`` return value is ``cudaSuccess``."""
    return int(getattr(err, "value", err)) == 0  # type: ignore[call-overload]


def _clear_cuda_last_error() -> None:
    """Reset the CUDA runtime's last error after a failed ``cudaHostRegister``.

    The runtime keeps the error until ``cudaGetLastError`` reads it, and torch's next kernel
    launch check would report it as its own. ``torch.cuda.cudart()`` does not expose
    ``cudaGetLastError``; call it on the libcudart torch loaded (best effort, Linux).
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception:  # pragma: no cover - best effort on a path only a GPU reaches
        return


def _block_rows(x: torch.Tensor, where: str) -> torch.Tensor:
    """View a block-first tensor ``[num_blocks, ...]`` as bytes ``[num_blocks, bytes_per_block]``.

    Args:
        x: The tensor, blocks on dimension 0.
        where: Names the tensor in error messages.

    Returns:
        A ``uint8`` view sharing ``x``'s memory, row ``b`` holding the bytes of block ``b``.

    Raises:
        RegistrationError: One block's bytes are not one dense range, or blocks overlap.
    """
    if x.dim() == 1:
        x = x.unsqueeze(1)
    num_blocks = x.size(0)
    inner = [(x.stride(d), x.size(d)) for d in range(1, x.dim()) if x.size(d) != 1]
    inner.sort(reverse=True)  # memory order, so permuted (stride-ordered) layouts are accepted
    expected = 1
    for stride, size in reversed(inner):
        if stride != expected:
            raise RegistrationError(
                f"{where}: the bytes of one block are not one dense range (shape "
                f"{tuple(x.shape)}, strides {x.stride()}); register K/V-first tensors "
                f"[2, num_blocks, ...] with layout='kv_first'"
            )
        expected *= size
    itemsize = x.element_size()
    bytes_per_block = expected * itemsize
    block_stride = x.stride(0) * itemsize
    if bytes_per_block == 0:
        raise RegistrationError(f"{where}: blocks are empty (shape {tuple(x.shape)})")
    if num_blocks > 1 and block_stride < bytes_per_block:
        raise RegistrationError(
            f"{where}: blocks overlap: block stride {block_stride} bytes < "
            f"{bytes_per_block} bytes per block (shape {tuple(x.shape)}, strides {x.stride()})"
        )
    storage = torch.empty(0, dtype=torch.uint8, device=x.device).set_(x.untyped_storage())
    return storage.as_strided(
        (num_blocks, bytes_per_block), (block_stride, 1), x.storage_offset() * itemsize
    )


def _layer_items(group: GroupCaches) -> list[tuple[str, LayerCache]]:
    """``(name, layer)`` pairs of a group given as a mapping or a sequence."""
    if isinstance(group, Mapping):
        return [(str(k), v) for k, v in group.items()]
    if isinstance(group, torch.Tensor) or not isinstance(group, Sequence):
        raise RegistrationError(
            "kv_caches must be a sequence of KV groups, each a mapping name -> layer or a "
            f"sequence of layers; got a group of type {type(group).__name__}"
        )
    return [(f"layer {i}", layer) for i, layer in enumerate(group)]


def _as_ids(x: object, what: str) -> npt.NDArray[np.int64]:
    """``x`` as a one-dimensional int64 array; raises TransferError naming ``what``."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise TransferError(f"{what} must be one-dimensional, got shape {a.shape}")
    if a.size == 0:
        return np.empty(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise TransferError(f"{what} must be integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_range(ids: npt.NDArray[np.int64], limit: int, what: str) -> None:
    """Raise InvalidBlockError naming the first id of ``ids`` outside ``[0, limit)``."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise InvalidBlockError(f"{what}[{bad}] = {int(ids[bad])} is out of range [0, {limit})")


_Parsed = list[tuple[list[tuple[str, torch.Tensor]], int, torch.dtype]]
"""Per group: its ``(name, byte rows)`` regions, num_blocks and dtype."""


def _parse_kv_caches(
    kv_caches: Sequence[GroupCaches], layouts: Sequence[Layout]
) -> tuple[torch.device, _Parsed]:
    """Validate the registered tensors and view each as byte rows ``[num_blocks, bpb]``.

    Raises:
        RegistrationError: The first problem found, naming group, layer, tensor and value.
    """
    device: torch.device | None = None
    device_where = ""
    parsed: _Parsed = []
    for gi, (group, lay) in enumerate(zip(kv_caches, layouts, strict=True)):
        rows: list[tuple[str, torch.Tensor]] = []
        num_blocks: int | None = None
        dtype: torch.dtype | None = None
        first_where = ""
        items = _layer_items(group)
        if not items:
            raise RegistrationError(f"group {gi} has no layers")
        for lname, layer in items:
            if isinstance(layer, torch.Tensor):
                tensors = [(f"group {gi} {lname}", layer)]
            elif (
                isinstance(layer, Sequence)
                and layer
                and all(isinstance(t, torch.Tensor) for t in layer)
            ):
                names = ("k", "v") if len(layer) == 2 else tuple(map(str, range(len(layer))))
                tensors = [
                    (f"group {gi} {lname} [{n}]", t) for n, t in zip(names, layer, strict=True)
                ]
            else:
                raise RegistrationError(
                    f"group {gi} {lname}: a layer must be a tensor or a non-empty tuple of "
                    f"tensors, got {type(layer).__name__}"
                )
            for where, t in tensors:
                if t.layout != torch.strided:
                    raise RegistrationError(f"{where}: unsupported tensor layout {t.layout}")
                if t.device.type not in ("cpu", "cuda"):
                    raise RegistrationError(
                        f"{where}: unsupported device {t.device} (expected cpu or cuda)"
                    )
                if device is None:
                    device, device_where = t.device, where
                elif t.device != device:
                    raise RegistrationError(
                        f"{where} is on {t.device}, but {device_where} is on {device}: "
                        "one engine serves one device"
                    )
                if dtype is None:
                    dtype = t.dtype
                    first_where = where
                elif t.dtype != dtype:
                    raise RegistrationError(
                        f"{where} has dtype {t.dtype}, but {first_where} has {dtype}: "
                        "all tensors of a KV group share one dtype"
                    )
                t = t.detach()
                if lay == "kv_first":
                    if t.dim() < 2 or t.size(0) != 2:
                        raise RegistrationError(
                            f"{where}: layout 'kv_first' needs shape [2, num_blocks, ...], "
                            f"got {tuple(t.shape)}"
                        )
                    views = [(f"{where} k", t[0]), (f"{where} v", t[1])]
                else:
                    if t.dim() < 1:
                        raise RegistrationError(f"{where}: a 0-d tensor has no blocks")
                    views = [(where, t)]
                for vwhere, v in views:
                    nb = v.size(0)
                    if nb < 1:
                        raise RegistrationError(f"{vwhere}: num_blocks is 0")
                    if num_blocks is None:
                        num_blocks = nb
                    elif nb != num_blocks:
                        raise RegistrationError(
                            f"{vwhere} has num_blocks={nb}, but the first tensor of group "
                            f"{gi} ({first_where}) has {num_blocks}: all tensors of a KV "
                            "group share one block table"
                        )
                    rows.append((vwhere, _block_rows(v, vwhere)))
        assert num_blocks is not None
        assert dtype is not None
        parsed.append((rows, num_blocks, dtype))
    assert device is not None
    return device, parsed


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
        bpc = _size(blocks_per_chunk, "blocks_per_chunk")
        if (num_slots is None) == (cpu_bytes is None):
            raise ConfigError("give exactly one of num_slots and cpu_bytes")
        if isinstance(kv_caches, (torch.Tensor, Mapping)) or not isinstance(kv_caches, Sequence):
            raise RegistrationError(
                "kv_caches must be a sequence of KV groups (e.g. [{'layer0': (k, v)}]), got "
                f"{type(kv_caches).__name__}"
            )
        if len(kv_caches) == 0:
            raise RegistrationError("kv_caches is empty: register at least one KV group")
        parts = _size(
            torch.get_num_threads() if cpu_copy_threads is None else cpu_copy_threads,
            "cpu_copy_threads",
        )
        if isinstance(layout, str):
            layouts: list[object] = [layout] * len(kv_caches)
        elif isinstance(layout, Sequence):
            layouts = list(layout)
        else:
            raise ConfigError(f"layout must be a string or a sequence of them, got {layout!r}")
        if len(layouts) != len(kv_caches):
            raise ConfigError(f"{len(layouts)} layouts given for {len(kv_caches)} KV groups")
        for lay in layouts:
            if lay not in ("blocks_first", "kv_first"):
                raise ConfigError(f"layout must be 'blocks_first' or 'kv_first', got {lay!r}")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise ConfigError(f"pin_memory must be None, True or False, got {pin_memory!r}")
        delay = _copy_delay_s
        if isinstance(delay, bool) or not isinstance(delay, (int, float)):
            raise ConfigError(f"_copy_delay_s must be a number of seconds, got {delay!r}")
        if not 0.0 <= delay <= 3600.0:  # also rejects nan and inf
            raise ConfigError(f"_copy_delay_s must be in [0, 3600] seconds, got {delay!r}")
        for name, hook in (("_before_copy", _before_copy), ("_fault_injector", _fault_injector)):
            if hook is not None and not callable(hook):
                raise ConfigError(f"{name} must be callable or None, got {hook!r}")

        device, parsed = _parse_kv_caches(kv_caches, layouts)  # type: ignore[arg-type]

        slot_bytes = [bpc * sum(r.size(1) for _, r in rows) for rows, _, _ in parsed]
        if num_slots is not None:
            slots = _size(num_slots, "num_slots")
            what = f"num_slots={slots}"
        else:
            budget = _size(cpu_bytes, "cpu_bytes")
            slots = budget // sum(slot_bytes)
            what = f"cpu_bytes={budget}"
            if slots < 1:
                raise ConfigError(
                    f"cpu_bytes={budget} is less than one slot in every group "
                    f"({sum(slot_bytes)} bytes)"
                )
        pin = device.type == "cuda" if pin_memory is None else pin_memory
        if pin and not torch.cuda.is_available():
            raise ConfigError("pin_memory=True needs CUDA, which is not available")

        # One allocation; per group its regions back to back, each group aligned.
        offsets: list[int] = []
        total = 0
        for sb in slot_bytes:
            total = -(-total // _GROUP_ALIGN) * _GROUP_ALIGN
            offsets.append(total)
            total += slots * sb
        memory = _memory_bytes()
        if memory is not None and total > memory:
            raise ConfigError(
                f"{what}: the CPU pool would take {total} bytes, more than this machine's "
                f"{memory} bytes of memory"
            )
        self._resources = _Resources()
        try:
            pool, pinned = self._allocate(total, pin)
        except (RuntimeError, MemoryError, OverflowError) as exc:
            raise ConfigError(
                f"{what}: cannot allocate a CPU pool of {total} bytes: {exc}"
            ) from None
        groups: list[_Group] = []
        for (rows, nb, dtype), start in zip(parsed, offsets, strict=True):
            regions: list[_Region] = []
            pos = start
            n_cpu = slots * bpc
            for where, gpu in rows:
                bpb = gpu.size(1)
                cpu = pool[pos : pos + n_cpu * bpb].view(n_cpu, bpb)
                pos += n_cpu * bpb
                regions.append(_Region(name=where, gpu=gpu, cpu=cpu, bytes_per_block=bpb))
            groups.append(
                _Group(
                    regions=tuple(regions),
                    num_blocks=nb,
                    num_cpu_blocks=n_cpu,
                    bytes_per_block=sum(r.bytes_per_block for r in regions),
                    dtype=dtype,
                )
            )
        copier = self._copier(groups, pool) if device.type == "cpu" else None

        self._device = device
        self._groups: tuple[_Group, ...] = tuple(groups)
        self._bpc = bpc
        self._num_slots = slots
        self._pool = pool
        self._pinned = pinned
        self._runtime = _Runtime(
            self._groups, copier, _Hooks(float(delay), _before_copy, _fault_injector), parts
        )
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
        }
        kinds: tuple[JobKind, ...] = ("store", "load")
        for kind in kinds:
            if copier is not None:
                self._resources.lanes[kind] = _Lane(f"kvoffload-{kind}", self._runtime, self._sink)
            else:
                self._resources.streams[kind] = torch.cuda.Stream(device=device)
        self._finalizer = weakref.finalize(self, self._resources.release, cancel=True, join=False)

    @staticmethod
    def _copier(groups: Sequence[_Group], pool: torch.Tensor) -> Copier:
        """The core copier of a CPU engine: every KV tensor's storage and the pool, registered.

        The copier holds numpy views of those storages (so the memory outlives it) and checks
        every copied row against them.
        """
        buffers: list[npt.NDArray[np.uint8]] = []
        index: dict[tuple[int, int], int] = {}

        def buffer_of(t: torch.Tensor) -> int:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in index:
                index[key] = len(buffers)
                buffers.append(_storage_bytes(t))
            return index[key]

        layout = []
        for g in groups:
            regions = []
            for r in g.regions:
                regions.append(
                    (
                        buffer_of(r.gpu),
                        r.gpu.storage_offset(),
                        r.gpu.stride(0),
                        buffer_of(r.cpu),
                        r.cpu.storage_offset(),
                        r.cpu.stride(0),
                        r.bytes_per_block,
                    )
                )
            layout.append((g.num_blocks, g.num_cpu_blocks, regions))
        del pool  # registered through the regions' views
        return Copier(buffers, layout)

    def _allocate(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
        """Allocate the pool; pin it with cudaHostRegister when ``pin`` (no power-of-2 growth).

        The registered range is page-aligned and page-rounded inside a slightly larger plain
        allocation, so it never shares a page with another registration (which would fail).
        """
        if not pin:
            return torch.empty(nbytes, dtype=torch.uint8), False
        page = mmap.PAGESIZE
        raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
        start = (-raw.data_ptr()) % page
        pool = raw[start : start + nbytes]
        ptr = pool.data_ptr()
        cudart = torch.cuda.cudart()
        if _cuda_ok(cudart.cudaHostRegister(ptr, -(-nbytes // page) * page, 0)):
            if pool.is_pinned():
                self._resources.registered_ptr = ptr
                return pool, True
            cudart.cudaHostUnregister(ptr)
        else:
            _clear_cuda_last_error()
        # Fallback: torch's pinned allocator (may round the allocation up to a power of two).
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True

    # ----------------------------------------------------------------- introspection

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
    def stats(self) -> dict[str, int]:
        """Counters: jobs submitted; over polled jobs, ok/failed jobs, copies and bytes; plus
        the number of queued jobs and of submitted jobs not yet polled."""
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
        new_stores = self._plan_many(stores, "store", "step stores")
        new_loads = self._plan_many(loads, "load", "step loads")
        flush_ids = _id_list(flush, "step flush")
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
        if self._device.type != "cuda":
            self._block(waiting, None)
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
        job = self._plan(job_id, transfers, "store")
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
        self._start(self._plan(job_id, transfers, "store"))

    def submit_load(self, job_id: SupportsIndex, transfers: Iterable[Transfer]) -> None:
        """Start a load (CPU positions → GPU blocks) now. Same arguments as :meth:`submit_store`.

        Raises:
            TransferError: Malformed job or duplicate id. Nothing is submitted.
            InvalidBlockError: A block id or CPU position out of range. Nothing is submitted.
            EngineClosedError: After shutdown.
        """
        self._start(self._plan(job_id, transfers, "load"))

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
        self._block(jobs, timeout)

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

    def _plan_many(
        self, jobs: Iterable[tuple[SupportsIndex, Iterable[Transfer]]], kind: JobKind, what: str
    ) -> list[_Job]:
        if isinstance(jobs, (str, bytes)) or not isinstance(jobs, Iterable):
            raise TransferError(
                f"{what} must be an iterable of (job_id, transfers) pairs, got {jobs!r}"
            )
        out = []
        for i, item in enumerate(jobs):
            if not isinstance(item, Sequence) or isinstance(item, (str, bytes)) or len(item) != 2:
                raise TransferError(f"{what}[{i}] is not a (job_id, transfers) pair: {item!r}")
            out.append(self._plan(item[0], item[1], kind))
        return out

    def _plan(self, job_id: SupportsIndex, transfers: Iterable[Transfer], kind: JobKind) -> _Job:
        """Validate a job and compute its runs; reads only immutable state, changes none."""
        if isinstance(job_id, bool):
            raise TransferError(f"job id must be an integer, got {job_id!r}")
        try:
            jid = operator.index(job_id)
        except TypeError:
            raise TransferError(f"job id must be an integer, got {job_id!r}") from None
        runs: list[_Run] = []
        dests: dict[int, list[npt.NDArray[np.int64]]] = {}
        planned_bytes = 0
        planned_copies = 0
        if isinstance(transfers, (str, bytes)) or not isinstance(transfers, Iterable):
            raise TransferError(
                f"job {jid}: transfers must be an iterable of (group, gpu_blocks, cpu_blocks), "
                f"got {transfers!r}"
            )
        items = list(transfers)
        for i, transfer in enumerate(items):
            try:
                group_arg, gpu_arg, cpu_arg = transfer
                if isinstance(group_arg, bool):
                    raise TypeError
                group = operator.index(group_arg)
            except (TypeError, ValueError):
                raise TransferError(
                    f"job {jid}: transfer {i} is not a (group, gpu_blocks, cpu_blocks) triple: "
                    f"{transfer!r}"
                ) from None
            if not 0 <= group < len(self._groups):
                raise TransferError(
                    f"job {jid}: transfer {i} names group {group}, but "
                    f"{len(self._groups)} groups are registered"
                )
            g = _as_ids(gpu_arg, f"job {jid}: transfer {i} gpu_blocks")
            c = _as_ids(cpu_arg, f"job {jid}: transfer {i} cpu_blocks")
            if g.size != c.size:
                raise TransferError(
                    f"job {jid}: transfer {i} has {g.size} gpu_blocks but {c.size} cpu_blocks"
                )
            grp = self._groups[group]
            _check_range(g, grp.num_blocks, f"job {jid}: transfer {i} (group {group}) gpu_blocks")
            _check_range(
                c, grp.num_cpu_blocks, f"job {jid}: transfer {i} (group {group}) cpu_blocks"
            )
            if g.size == 0:
                continue
            breaks = np.flatnonzero((np.diff(g) != 1) | (np.diff(c) != 1)) + 1
            starts = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
            lengths = np.diff(np.append(starts, g.size))
            runs.append((group, g[starts], c[starts], lengths))
            dests.setdefault(group, []).append(c if kind == "store" else g)
            planned_bytes += g.size * grp.bytes_per_block
            planned_copies += starts.size * len(grp.regions)
        for group, arrays in dests.items():
            d = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
            if d.size > 1 and not bool((np.diff(d) > 0).all()):  # increasing: distinct
                d = np.sort(d)
                same = np.flatnonzero(d[1:] == d[:-1])
                if same.size:
                    side = "cpu_blocks" if kind == "store" else "gpu_blocks"
                    raise TransferError(
                        f"job {jid}: group {group} writes {side} {int(d[same[0]])} twice"
                    )
        return _Job(jid, kind, runs, planned_bytes, planned_copies)

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
        try:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                _execute(job, self._runtime, None, non_blocking=True)
                end = torch.cuda.Event()
                end.record(stream)
            job.end_event = end
        except Exception as exc:  # no end event (a CUDA error): fail it once the stream is idle
            job.error = job.error or f"{type(exc).__name__}: {exc}"
            job.end_event = None
            with contextlib.suppress(Exception):  # the job's error is already recorded
                stream.synchronize()
            job.t_done = time.perf_counter()
            job.done.set()
            self._sink.push(job)

    def _flush(self, ids: list[int]) -> list[_Job]:
        """Submit the queued ones among ``ids``; return the unfinished jobs. Lock held."""
        for jid in ids:
            job = self._queued.pop(jid, None)
            if job is not None:
                self._submit(job)
        return self._unfinished(ids)

    def _unfinished(self, ids: list[int]) -> list[_Job]:
        return [job for jid in ids if (job := self._inflight.get(jid)) is not None]

    def _block(self, jobs: list[_Job], timeout: float | None) -> None:
        """Wait on the host for ``jobs`` (without the lock)."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        for job in jobs:
            if job.end_event is None:
                left = None if deadline is None else max(0.0, deadline - time.perf_counter())
                if not job.done.wait(left):
                    raise self._timeout_error(jobs)
            elif deadline is None:
                job.end_event.synchronize()
                self._mark_cuda_done(job)
            else:
                while not job.end_event.query():
                    if time.perf_counter() > deadline:
                        raise self._timeout_error(jobs)
                    time.sleep(1e-4)
                self._mark_cuda_done(job)

    def _mark_cuda_done(self, job: _Job) -> None:
        if job.t_done is None:
            job.t_done = time.perf_counter()

    def _timeout_error(self, jobs: list[_Job]) -> TransferError:
        running = [j.job_id for j in jobs if not self._is_done(j)]
        return TransferError(f"wait timed out with jobs {running} still running")

    def _is_done(self, job: _Job) -> bool:
        if job.end_event is not None:
            return bool(job.end_event.query())
        return job.done.is_set()

    def _collect(self, *, drain: bool = False) -> list[TransferResult]:
        """Remove finished jobs from the in-flight table and turn them into results. Lock held.

        All or nothing: if anything interrupts it (an exception from a signal handler), every
        job it took is put back, so a result is never lost.
        """
        finished = self._sink.drain()
        taken: list[_Job] = []
        try:
            for job in self._inflight.values():
                if job.end_event is not None and (drain or job.end_event.query()):
                    self._mark_cuda_done(job)
                    finished.append(job)
            results = []
            stats = dict(self._stats)
            for job in finished:
                if self._inflight.get(job.job_id) is not job:
                    continue
                result = job.result()
                stats["copies"] += result.copies
                stats["jobs_ok" if result.ok else "jobs_failed"] += 1
                stats["bytes_stored" if job.kind == "store" else "bytes_loaded"] += result.bytes
                results.append(result)
                taken.append(job)
            for job in taken:
                del self._inflight[job.job_id]
            self._stats = stats
        except BaseException:
            for job in taken:
                self._inflight[job.job_id] = job
            self._sink.push_back([j for j in finished if j.end_event is None])
            raise
        return results
