"""What crosses vLLM's process boundaries: the plan the scheduler sends the workers each step
(:class:`KvOffloadMetadata`), the job reports the workers send back
(:class:`KvOffloadWorkerMetadata`, vLLM's worker-to-scheduler side channel), and the counters
vLLM aggregates and logs (:class:`KvOffloadStats`). All are picklable and small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["KvOffloadMetadata", "KvOffloadStats", "KvOffloadWorkerMetadata"]

_Transfers = list[tuple[int, list[int], list[int]]]


@dataclass
class KvOffloadMetadata(KVConnectorMetadata):
    """Scheduler → workers, one per step: the step plan.

    Attributes:
        loads: ``(job_id, request_id, transfers)`` per load job.
        stores: ``(job_id, transfers)`` per store job.
        flush: Jobs that must complete before this step writes its blocks.
        cancelled: Load jobs a cache reset cancelled: workers report them as failed.
    """

    loads: list[tuple[int, str, _Transfers]] = field(default_factory=list)
    stores: list[tuple[int, _Transfers]] = field(default_factory=list)
    flush: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)

    def load_requests(self) -> list[tuple[int, str]]:
        """``(job_id, request_id)`` per load job."""
        return [(j, rid) for j, rid, _ in self.loads]

    def store_ids(self) -> list[int]:
        """Store job ids."""
        return [j for j, _ in self.stores]

    def transfers(self, job: int) -> list[tuple[int, list[int], list[int]]]:
        """``(group, gpu_blocks, cpu_blocks)`` per group of job ``job``."""
        for j, _, t in self.loads:
            if j == job:
                return t
        for j, t in self.stores:
            if j == job:
                return t
        raise KeyError(job)


@dataclass
class KvOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler, one per step: job reports by worker rank, and bytes.

    Attributes:
        done: Rank → ids of the jobs that worker finished.
        failed: Rank → ids of the jobs that worker failed.
    """

    done: dict[int, list[int]] = field(default_factory=dict)
    failed: dict[int, list[int]] = field(default_factory=dict)
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0

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
        )

    def by_rank(self) -> dict[int, tuple[list[int], list[int]]]:
        """Rank → (jobs finished, jobs failed)."""
        return {
            r: (self.done.get(r, []), self.failed.get(r, []))
            for r in sorted(self.done.keys() | self.failed.keys())
        }


def _merge(a: dict[int, list[int]], b: dict[int, list[int]]) -> dict[int, list[int]]:
    out = {r: list(jobs) for r, jobs in a.items()}
    for r, jobs in b.items():
        out.setdefault(r, []).extend(jobs)
    return out


_STAT_KEYS = (
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
    "sched_seconds",
    "sched_steps",
)


@dataclass
class KvOffloadStats(KVConnectorStats):
    """Counters of one interval, summed over steps and workers (vLLM logs them)."""

    def __post_init__(self) -> None:
        for k in _STAT_KEYS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        """Zeroes every counter."""
        self.data = dict.fromkeys(_STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Adds ``other``'s counters."""
        for k, v in other.data.items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, plus the mean scheduler-side time per step in µs."""
        out = {k: v for k, v in self.data.items() if isinstance(v, (int, float))}
        steps = out.get("sched_steps", 0)
        out["sched_us_per_step"] = 1e6 * out.get("sched_seconds", 0.0) / steps if steps else 0.0
        return out

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(self.data.get(k) for k in _STAT_KEYS)
