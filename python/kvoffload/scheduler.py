"""Engine-facing scheduler facade: configuration, step input, and :class:`OffloadScheduler`.

All state lives in the Rust core (:class:`kvoffload._core.Scheduler`); this module turns the
configuration into the core's arguments (the core validates every value, in one place) and
passes each step across the boundary in one call. It is engine-neutral: adapters (vLLM, the
simulator) convert their own objects into :class:`StepInput`. Where the core departs from
DESIGN.md on purpose (ARC variant, lcm-aligned loads, per-group pools, rank-tied completions,
``written`` never dropping a chunk), and why: ``docs/design-notes.md``.

Example:
    >>> from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput
    >>> cfg = OffloadConfig(groups=(KvGroup(block_size=16),), num_gpu_blocks=64, cpu_chunks=32)
    >>> s = OffloadScheduler(cfg)
    >>> s.add_request("r1", prompt_len=40, block_hashes=[11, 12])
    >>> s.lookup("r1", num_computed_tokens=0)
    0
    >>> s.allocate("r1", [[1, 2, 3]], num_computed_tokens=0, num_load_tokens=0)
    >>> plan = s.schedule(StepInput(scheduled=[("r1", 40)]))
    >>> [j.kind for j in plan.stores], plan.flush
    (['store'], [])
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal

from kvoffload._core import CompletedJob, Scheduler, StepPlan, TransferJob, check_io_cpus
from kvoffload.errors import ConfigError, StepInputError

__all__ = [
    "OPTION_DEFAULTS",
    "CompletedJob",
    "KvGroup",
    "OffloadConfig",
    "OffloadScheduler",
    "ResetResult",
    "StepInput",
    "StepPlan",
    "TransferJob",
]

BlockHash = int | bytes


@dataclass(frozen=True)
class KvGroup:
    """One KV group: layers sharing one block table.

    Attributes:
        block_size: Tokens per GPU block.
        sliding_window: Window in tokens for sliding-window attention; None for full attention.
        bytes_per_block: Bytes of one GPU block of this group on one worker, all layers (used to
            size the CPU tier from bytes and for the byte counters; 0 if unknown).
    """

    block_size: int
    sliding_window: int | None = None
    bytes_per_block: int = 0


@dataclass(frozen=True)
class OffloadConfig:
    """Configuration of the offloading scheduler: the one list of its options, their defaults
    and their meaning. The core takes them by these names (:meth:`to_core`) and checks every
    value; invalid ones raise :class:`ConfigError`.

    Attributes:
        groups: The engine's KV groups, in order.
        num_gpu_blocks: GPU blocks of the engine (block ids are ``0..num_gpu_blocks``).
        blocks_per_chunk: GPU blocks per chunk, the unit of offloading.
        hash_block_size: Tokens per chained prefix hash the engine computes; defaults to the
            first group's block size.
        cpu_chunks: CPU capacity in chunks (slots) per group.
        cpu_bytes: CPU capacity in bytes, all groups together (needs ``bytes_per_block``).
        policy: Eviction policy, ``"lru"`` or ``"arc"``.
        num_workers: Workers (tensor-parallel ranks) that report each job.
        max_loading_requests: At most this many requests loading at once (0: no limit).
        offload_prompt_only: Store prompt tokens only.
        max_offload_tokens: Store at most this many tokens per request.
        store_threshold: Store a chunk only after it was looked up this many times (0: always).
        null_block: The engine's null block id (never copied), or None.
        debug_skip_deferred_arming: Testing only: a deliberately broken fence.
        disk_path: Directory of a persistent disk tier below the CPU pool (None: no disk tier).
            Chunks ready in the CPU pool are written behind to it; lookups that miss the CPU
            pool promote chunks from it; a restart on the same directory finds them again.
        disk_bytes: Bytes the disk tier may occupy, per group and worker (needs ``disk_path``).
        disk_model: Names the weights and dtype in the disk tier's namespace: engines with
            another model never read its chunks.
        disk_deadline_ms: Longest time a promotion from the disk tier may take; later, it
            expires and its requests recompute (its CPU slots stay held until the late I/O
            is reported). Failed or expired disk jobs put the tier on probation.
        disk_probation_after: Failed or expired disk jobs in a row that put the disk tier on
            probation (chunks are not written behind, lookups skip it); an integer >= 1.
        disk_probation_ms: How long a probation lasts; the first disk job after it is a trial
            whose success ends it (a failure starts another one).
        disk_write_mbps: Most MB/s written behind to the disk tier (0: no limit), so that an
            engine's write-behind never moves more than that (its I/O threads' CPU and the
            disk's bandwidth); chunks past the rate are skipped (``skipped_writes``), reused
            ones offered again when loaded.
        remote_url: ``redis://[user:password@]host:port[/db]`` of a shared tier (Redis) below
            the CPU pool, or ``redis+cluster://[user:password@]host:port[,host:port...]``
            (seed nodes of a Redis Cluster; None: none). Engines configured with the same URL,
            model and layout share chunks:
            chunks ready in the CPU pool are written behind, lookups that miss the CPU pool ask
            the server (asynchronously: "ask later") and promote what it holds. With
            ``disk_path`` too, chunks are written behind to both and lookups promote from the
            disk first, from the shared tier what the disk lacks.
        remote_model: Names the weights and dtype in the shared tier's namespace.
        cache_salt: Tenant salt in the shared tier's namespace: different salts share nothing.
        remote_tls_ca: For a ``rediss://`` (TLS) ``remote_url``: the PEM file of the CA
            certificates that sign the servers' (None: no TLS).
        remote_deadline_ms: Longest wait for one operation of the shared tier; later is a miss
            (the request recomputes), and repeated failures put the tier on probation.
        disk_min_hits: Admission filter of the disk tier: write a chunk behind once it was
            loaded from the CPU pool this many times (0: as soon as it is stored).
        remote_min_hits: The same for the shared tier. ``1`` sends only reused chunks (system
            prompts, documents) to the fleet's server, not every request's private tail.
        tier_write_share: At most this share of each group's CPU slots is pinned by
            write-behind jobs to the lower tiers at once (a number in (0, 1]; at least one
            slot). Past it a chunk is not written behind (counted as ``skipped_writes`` per
            tier), never a store dropped: a tier that cannot keep up (slow, stuck, its I/O
            threads starved) never takes more than this share of the CPU pool's room. When the
            share is tight, reused chunks (loaded from the CPU pool) get all of it and fresh
            ones only half, so the tier's bandwidth goes to chunks known to be reused.
        io_cpus: CPU ids the lower tiers' I/O threads (and their checksum helpers and
            connections) are pinned to on each worker (None: not pinned). Keep the engine's
            thread off them: on a small machine the tier's checksums and copies then cannot
            take its CPU. Linux only; each id must be one this process may run on
            (``os.sched_getaffinity(0)``), none twice.
    """

    groups: tuple[KvGroup, ...]
    num_gpu_blocks: int
    blocks_per_chunk: int = 1
    hash_block_size: int | None = None
    cpu_chunks: int | None = None
    cpu_bytes: int | None = None
    policy: Literal["lru", "arc"] = "lru"
    num_workers: int = 1
    max_loading_requests: int = 0
    offload_prompt_only: bool = False
    max_offload_tokens: int | None = None
    store_threshold: int = 0
    null_block: int | None = 0
    debug_skip_deferred_arming: bool = False
    disk_path: str | os.PathLike[str] | None = None
    disk_bytes: int | None = None
    disk_model: str = ""
    disk_deadline_ms: float = 5000.0
    disk_probation_after: int = 3
    disk_probation_ms: float = 5000.0
    disk_write_mbps: float = 0.0
    remote_url: str | None = None
    remote_model: str = ""
    cache_salt: str = ""
    remote_deadline_ms: float = 1000.0
    remote_tls_ca: str | None = None
    disk_min_hits: int = 0
    remote_min_hits: int = 0
    tier_write_share: float = 0.125
    io_cpus: Sequence[int] | None = None

    def _core_kwargs(self) -> dict[str, Any]:
        """The core's keyword arguments: every field, by its name, values as given (the core
        checks them)."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(self.groups, (list, tuple)):
            kwargs["groups"] = [
                (g.block_size, g.sliding_window, g.bytes_per_block) if isinstance(g, KvGroup) else g
                for g in self.groups
            ]
        return kwargs

    def bytes_per_chunk(self, group: int) -> int:
        """Bytes of one chunk of ``group`` on one worker (0 if unknown); validates the config."""
        per_group = Scheduler.check_config(**self._core_kwargs())[1]
        if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < len(per_group):
            raise ConfigError(
                f"group must be an integer in 0..{len(per_group) - 1}, got {group!r} "
                f"({type(group).__name__})"
            )
        return per_group[group]

    def resolved_cpu_chunks(self) -> int:
        """CPU slots per group, from ``cpu_chunks`` or ``cpu_bytes``; validates the config."""
        return Scheduler.check_config(**self._core_kwargs())[0]

    def checked_io_cpus(self) -> list[int] | None:
        """``io_cpus`` checked as the tier workers check it when they open (None: not
        pinned); raises :class:`ConfigError` naming the offending id."""
        return check_io_cpus(self.io_cpus)

    def to_core(self) -> Scheduler:
        """Builds the Rust core, which validates every value, the tiers' too
        (:class:`ConfigError` naming the field and the value), and attaches the disk tier if
        ``disk_path`` is set and the shared tier if ``remote_url`` is (both may be)."""
        return Scheduler(**self._core_kwargs())


OPTION_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {f.name: f.default for f in fields(OffloadConfig) if f.default is not MISSING}
)
"""Each :class:`OffloadConfig` option's default, by field name (the required ones left out):
where the simulator's and the CLI's defaults for these options come from."""


@dataclass
class StepInput:
    """One engine step, as flat lists.

    Attributes:
        scheduled: ``(request_id, tokens computed by the end of this step)`` per scheduled
            request.
        new_blocks: ``(request_id, group, block ids)`` appended this step (for a resumed request,
            its whole new block table). Blocks given to ``allocate`` are not repeated here.
        resumed: Requests resumed from preemption this step.
        finished: Requests that finished (their blocks are released).
        aborted: Requests that were aborted.
        preempted: Requests that were preempted (their blocks are released).
        written: Block ids written this step (by the forward pass or a load), or None to count
            every block allocated since the previous step (conservative, still correct).
        request_ids: Fast path instead of ``scheduled``: the scheduled request ids ...
        computed_tokens: ... and their computed tokens, as two parallel sequences (no per-step
            tuple packing and unpacking on the engine side).
    """

    scheduled: Sequence[tuple[str, int]] = ()
    new_blocks: Sequence[tuple[str, int, Sequence[int]]] = ()
    resumed: Sequence[str] = ()
    finished: Sequence[str] = ()
    aborted: Sequence[str] = ()
    preempted: Sequence[str] = ()
    written: Sequence[int] | None = None
    request_ids: Sequence[str] = ()
    computed_tokens: Sequence[int] = ()


def _given(field: object) -> bool:
    """Whether a sequence field of a :class:`StepInput` was given (not None, not empty)."""
    return field is not None and not (isinstance(field, (tuple, list)) and not field)


@dataclass
class ResetResult:
    """What a reset left for the engine and workers.

    Attributes:
        flushed: Job ids that were pending and handed to workers; the next plan holds them:
            copies in its ``flush``, tier jobs in its ``tier_flush``.
        cancelled_loads: ``(request_id, job_id)`` of loads that will never be reported: the
            engine must treat those requests' loaded tokens as not computed.
    """

    flushed: list[int] = field(default_factory=list)
    cancelled_loads: list[tuple[str, int]] = field(default_factory=list)


class OffloadScheduler:
    """The engine-facing scheduler. One instance per engine (scheduler process).

    Per step: ``lookup`` each waiting request; ``allocate`` each admitted one; ``schedule`` once;
    ``complete`` as workers report jobs. See DESIGN.md §3.
    """

    def __init__(self, config: OffloadConfig) -> None:
        """Validates ``config`` and builds the core."""
        if not isinstance(config, OffloadConfig):
            raise ConfigError(
                f"config must be an OffloadConfig, got {config!r} ({type(config).__name__})"
            )
        self.config = config
        self._core = config.to_core()

    def add_request(
        self, request_id: str, prompt_len: int, block_hashes: Iterable[BlockHash]
    ) -> None:
        """Registers a request with the chained hashes of its complete hash blocks."""
        self._core.add_request(request_id, prompt_len, block_hashes)

    def extend_hashes(self, request_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Appends hashes as the request's generated tokens complete hash blocks."""
        self._core.extend_hashes(request_id, block_hashes)

    def lookup(self, request_id: str, num_computed_tokens: int) -> int | None:
        """Tokens loadable from the CPU tier beyond the engine's own prefix hit.

        Returns:
            The number of tokens (0 if none), or None: ask again in a later step (a chunk is
            still being stored, the request has pending jobs, another request is loading
            these chunks, or too many requests are loading).
        """
        return self._core.lookup(request_id, num_computed_tokens)

    def allocate(
        self,
        request_id: str,
        block_ids: Sequence[Sequence[int]],
        num_computed_tokens: int,
        num_load_tokens: int,
    ) -> int | None:
        """Records an admitted request's block table (one list per group).

        Args:
            request_id: The request.
            block_ids: Its whole block table per group, prefix-cache hits included.
            num_computed_tokens: The engine's own prefix hit in tokens.
            num_load_tokens: Tokens to load, as returned by this step's ``lookup`` (or 0).

        Returns:
            The load job id, or None when nothing is loaded.
        """
        return self._core.allocate(request_id, block_ids, num_computed_tokens, num_load_tokens)

    def schedule(self, step: StepInput) -> StepPlan:
        """Applies one step and returns its plan (loads, stores, flush).

        Raises:
            StepInputError: A field of the wrong type or shape, or lists of different lengths
                (the core names the field and the value); nothing changes.
        """
        if not isinstance(step, StepInput):
            raise StepInputError(f"step must be a StepInput, got {step!r} ({type(step).__name__})")
        if _given(step.request_ids) or _given(step.computed_tokens):
            if _given(step.scheduled):
                raise StepInputError(
                    "StepInput: give scheduled or request_ids/computed_tokens, not both"
                )
            ids: Any = step.request_ids
            computed: Any = step.computed_tokens
            if computed is None:
                raise StepInputError("StepInput.computed_tokens must be a sequence, got None")
        else:
            ids, computed = step.scheduled, None  # (request_id, tokens) pairs
        return self._core.schedule(
            ids,
            computed,
            step.new_blocks,
            step.resumed,
            step.finished,
            step.aborted,
            step.preempted,
            step.written,
        )

    def preempt(self, request_id: str) -> None:
        """The engine released a running request's blocks outside a step (e.g. it dropped the
        blocks of a failed load and will admit the request again). Idempotent."""
        self._core.preempt(request_id)

    def complete(self, job_id: int, worker: int = 0, ok: bool = True) -> CompletedJob | None:
        """Records worker ``worker``'s report of ``job_id``; returns the job once every worker
        reported. A second report from the same worker raises
        :class:`~kvoffload.errors.DuplicateReportError` and changes nothing."""
        return self._core.complete(job_id, worker, ok)

    def complete_many(
        self, finished: Iterable[int], failed: Iterable[int] = (), worker: int = 0
    ) -> list[CompletedJob]:
        """Records one worker's report (jobs it finished and jobs it failed), all or nothing:
        one bad report raises and applies none of them."""
        return self._core.complete_many(finished, failed, worker)

    def reset(self) -> ResetResult:
        """Forgets every pending job and empties the CPU tier (e.g. on a prefix-cache reset)."""
        flushed, cancelled = self._core.reset()
        return ResetResult(flushed, cancelled)

    def take_events(self) -> list[tuple[str, int, list[int], str]]:
        """Drains ``(kind, group, keys, medium)`` events: kind is "stored" or "removed"."""
        return self._core.take_events()

    def status(self, request_id: str) -> str:
        """Status of a tracked request."""
        return self._core.status(request_id)

    def stats(self) -> dict[str, object]:
        """Counters of the scheduler, job table, fence and CPU pools (and, with a disk tier,
        ``tiers``: per group, its counters)."""
        st = self._core.stats()
        tiers = self._core.tier_stats()
        if tiers:
            st["tiers"] = tiers
        return st

    @property
    def num_requests(self) -> int:
        """Tracked requests."""
        return self._core.num_requests

    @property
    def armed_pairs(self) -> int:
        """Armed (block, job) pairs in the fence."""
        return self._core.armed_pairs

    def pending_jobs(self) -> list[int]:
        """Ids of pending jobs."""
        return self._core.pending_jobs()
