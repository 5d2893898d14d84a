"""What crosses vLLM's process boundaries: the plan the scheduler sends the workers each step
(:class:`KvOffloadMetadata`), the job reports the workers send back
(:class:`KvOffloadWorkerMetadata`, vLLM's worker-to-scheduler side channel), and the figures
vLLM aggregates, logs and exports to Prometheus (:class:`KvOffloadStats`). All are picklable
and small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvoffload._core import RUN_WORDS, TIER_ROW_WORDS

__all__ = [
    "SAMPLE_KEYS",
    "SNAPSHOT",
    "TIER_COUNTERS",
    "KvOffloadMetadata",
    "KvOffloadStats",
    "KvOffloadWorkerMetadata",
]


@dataclass
class KvOffloadMetadata(KVConnectorMetadata):
    """Scheduler → workers, one per step: the step plan, as the core returns it.

    Attributes:
        load_jobs: Load job ids.
        load_reqs: The request of each load job.
        store_jobs: Store job ids (they start at the next step).
        flush: Jobs that must complete before this step writes its blocks.
        runs: The jobs' copies as runs of consecutive GPU blocks and CPU positions: rows of
            ``RUN_WORDS`` (5) little-endian ``uint32`` (index of the job in
            ``load_jobs + store_jobs``, group, first GPU block, first CPU position, length),
            handed to :meth:`TransferEngine.step_packed` as they are.
        cancelled: Load jobs a cache reset cancelled: workers report them as failed.
        tier_jobs: Lower-tier jobs (write-behind, promotion) packed as the core returns them:
            rows of eight little-endian ``uint64`` per chunk (job id, kind ``| medium << 8``,
            group, key low and high 64 bits, CPU slot, place, generation); workers hand the
            buffer to their tier worker as it is (``TierWorker.submit_packed``).
        tier_flush: Tier jobs a cache reset flushed: workers wait for them on their tier
            worker before this step's copies and tier jobs start (their CPU slots are free
            again).
    """

    load_jobs: list[int] = field(default_factory=list)
    load_reqs: list[str] = field(default_factory=list)
    store_jobs: list[int] = field(default_factory=list)
    flush: list[int] = field(default_factory=list)
    runs: bytes = b""
    cancelled: list[int] = field(default_factory=list)
    tier_jobs: bytes = b""
    tier_flush: list[int] = field(default_factory=list)

    def tier_rows(self) -> npt.NDArray[np.uint64]:
        """The tier jobs' rows, one per chunk (see ``tier_jobs``)."""
        return np.frombuffer(self.tier_jobs, dtype="<u8").reshape(-1, TIER_ROW_WORDS)

    def tier_job_ids(self) -> list[int]:
        """Ids of the tier jobs, in plan order."""
        if not self.tier_jobs:
            return []
        ids = self.tier_rows()[:, 0]
        first = np.flatnonzero(np.diff(ids, prepend=ids[0] + np.uint64(1)))
        return [int(j) for j in ids[first]]

    def load_requests(self) -> list[tuple[int, str]]:
        """``(job_id, request_id)`` per load job."""
        return list(zip(self.load_jobs, self.load_reqs, strict=True))

    def store_ids(self) -> list[int]:
        """Store job ids."""
        return list(self.store_jobs)

    def run_rows(self) -> npt.NDArray[np.int64]:
        """The runs, one row each: job index, group, GPU start, CPU start, length."""
        return np.frombuffer(self.runs, dtype="<u4").reshape(-1, RUN_WORDS).astype(np.int64)

    def gpu_blocks(self, job: int) -> list[int]:
        """The GPU blocks job ``job`` writes (a load) or reads (a store), in run order."""
        jobs = self.load_jobs + self.store_jobs
        if job not in jobs:
            raise KeyError(job)
        rows = self.run_rows()
        mine = rows[rows[:, 0] == jobs.index(job)]
        if not len(mine):
            return []
        lengths = mine[:, 4]
        firsts = np.repeat(mine[:, 2] - (np.cumsum(lengths) - lengths), lengths)
        return (firsts + np.arange(int(lengths.sum()))).tolist()


@dataclass
class KvOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler, one per step: job reports by worker rank, and bytes.

    Attributes:
        done: Rank → ids of the jobs that worker finished.
        failed: Rank → ids of the jobs that worker failed.
        tier_bytes: Lower tier medium → bytes the workers wrote to and read from it.
        load_sizes: Bytes of each finished load job, one entry per job and worker (as
            ``load_times``: the seconds it took there).
        store_sizes: Bytes of each finished store job, one entry per job and worker (as
            ``store_times``).
        flush_seconds: Seconds the workers' hosts waited for flushed jobs.
    """

    done: dict[int, list[int]] = field(default_factory=dict)
    failed: dict[int, list[int]] = field(default_factory=dict)
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    tier_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)
    load_sizes: list[int] = field(default_factory=list)
    load_times: list[float] = field(default_factory=list)
    store_sizes: list[int] = field(default_factory=list)
    store_times: list[float] = field(default_factory=list)
    flush_seconds: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merges the reports of two workers (each report keeps its worker's rank)."""
        assert isinstance(other, KvOffloadWorkerMetadata)
        return KvOffloadWorkerMetadata(
            done=_merge(self.done, other.done),
            failed=_merge(self.failed, other.failed),
            bytes_loaded=self.bytes_loaded + other.bytes_loaded,
            bytes_stored=self.bytes_stored + other.bytes_stored,
            load_seconds=self.load_seconds + other.load_seconds,
            store_seconds=self.store_seconds + other.store_seconds,
            tier_bytes=_add_bytes(self.tier_bytes, other.tier_bytes),
            load_sizes=self.load_sizes + other.load_sizes,
            load_times=self.load_times + other.load_times,
            store_sizes=self.store_sizes + other.store_sizes,
            store_times=self.store_times + other.store_times,
            flush_seconds=self.flush_seconds + other.flush_seconds,
        )

    def by_rank(self) -> dict[int, tuple[list[int], list[int]]]:
        """Rank → (jobs finished, jobs failed)."""
        done = self.done
        if not self.failed and len(done) == 1:
            # One worker and nothing failed (every step of a single-GPU engine).
            ((r, jobs),) = done.items()
            return {r: (jobs, [])}
        return {
            r: (self.done.get(r, []), self.failed.get(r, []))
            for r in sorted(self.done.keys() | self.failed.keys())
        }


def _add_bytes(
    a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    out = dict(a)
    for m, (w, r) in b.items():
        w0, r0 = out.get(m, (0, 0))
        out[m] = (w0 + w, r0 + r)
    return out


def _merge(a: dict[int, list[int]], b: dict[int, list[int]]) -> dict[int, list[int]]:
    out = {r: list(jobs) for r, jobs in a.items()}
    for r, jobs in b.items():
        out.setdefault(r, []).extend(jobs)
    return out


_STAT_KEYS = (
    # Every step that planned counts these two: first, so that is_empty answers at once.
    "sched_steps",
    "sched_seconds",
    "lookups",
    "lookups_deferred",
    "loaded_tokens",
    "load_jobs",
    "store_jobs",
    "jobs_completed",
    "jobs_failed",
    "flushed_jobs",
    "reports_ignored",
    "bytes_loaded",
    "bytes_stored",
    "load_seconds",
    "store_seconds",
    "flush_seconds",
)
TIER_COUNTERS = (
    "hits",
    "misses",
    "writes",
    "failed_writes",
    "promotions",
    "promoted_chunks",
    "failed_promotions",
    "quarantined",
    "evictions",
    "write_jobs",
    "promote_jobs",
)
"""The lower tiers' counters the stats carry per medium (``disk_hits``, ``remote_writes``,
...), summed over KV groups, with the bytes the workers wrote to and read from the tier."""
_TIER_KEYS = tuple(
    f"{m}_{k}" for m in ("disk", "remote") for k in (*TIER_COUNTERS, "bytes_written", "bytes_read")
)
SAMPLE_KEYS = ("load_sizes", "load_times", "store_sizes", "store_times")
"""The per-job observations the stats carry as lists (bytes and seconds of each finished copy
job on each worker): Prometheus histograms."""
SNAPSHOT = "snapshot"
"""The key of the scheduler's periodic snapshot in the stats: the core's cumulative counters
and its gauges, ``name`` or ``name/label/...`` → value
(:mod:`~kvoffload.integrations.vllm.metrics` names them)."""
# Every counter at 0: a new interval's counters (built once per step).
_ZERO = dict.fromkeys((*_STAT_KEYS, *_TIER_KEYS), 0)


@dataclass
class KvOffloadStats(KVConnectorStats):
    """The figures of one interval (vLLM logs them and exports them to Prometheus).

    ``data`` holds three kinds of figures, each aggregated its own way:

    * counters (the keys of ``_ZERO``: ``lookups``, ``bytes_loaded``, ..., the lower tiers' per
      medium, ``disk_*`` / ``remote_*``): what happened in the interval, added up;
    * :data:`SAMPLE_KEYS` (when a job finished): lists of per-job observations,
      concatenated;
    * :data:`SNAPSHOT` (when the interval took one): the scheduler's cumulative counters and
      gauges at one moment; the later snapshot replaces the earlier.

    Every figure comes from the one scheduler of the engine, workers' bytes and times summed
    over the workers before they reach it: tensor-parallel ranks are counted once where a figure
    is per engine (jobs, tokens, chunks, the pools), and summed where each rank does its own
    share (bytes, copy seconds, per-worker samples).
    """

    def __post_init__(self) -> None:
        # Built once a step: the sample lists appear when a job finishes, not here.
        self.data.update({**_ZERO, **self.data})

    def reset(self) -> None:
        """Zeroes every counter, drops the samples and the snapshot."""
        fresh: dict[str, Any] = dict(_ZERO)
        self.data = fresh

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Adds ``other``'s counters, appends its samples; its snapshot, if any, replaces
        this one (snapshots are cumulative: the later one says everything)."""
        d = self.data
        for k, v in other.data.items():
            if k == SNAPSHOT:
                if v:
                    d[SNAPSHOT] = v
            elif isinstance(v, list):
                d.setdefault(k, []).extend(v)
            elif isinstance(v, (int, float)):
                d[k] = d.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, each sample list's count and sum, and the mean scheduler-side time
        per step in µs (vLLM's log line; the snapshot goes to Prometheus only)."""
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if isinstance(v, list):
                out[f"{k}_count"] = len(v)
                out[f"{k}_sum"] = sum(v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = v
        steps = out.get("sched_steps", 0)
        out["sched_us_per_step"] = 1e6 * out.get("sched_seconds", 0.0) / steps if steps else 0.0
        return out

    def is_empty(self) -> bool:
        """Whether nothing was counted, observed or snapshotted."""
        d = self.data
        return (
            not any(map(d.get, _ZERO)) and not d.get(SNAPSHOT) and not any(map(d.get, SAMPLE_KEYS))
        )
