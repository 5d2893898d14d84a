"""What a simulation run reports: :class:`SimResult`, its :class:`TimelinePoint` per step and
the :class:`Mismatch` records of the integrity oracle."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

__all__ = ["Mismatch", "SimResult", "TimelinePoint"]


@dataclass(frozen=True)
class Mismatch:
    """A block whose bytes differ from the oracle's.

    Attributes:
        kind: ``load`` (a block loaded from the CPU tier) or ``hit`` (a GPU prefix-cache hit).
        request: The request that received it.
        group: KV group.
        chunk: Chunk index within the request (position // blocks_per_chunk).
        position: Block position within the request.
        block: GPU block id.
        step: Engine step at which it was detected.
        job: Load job id (None for a hit).
    """

    kind: str
    request: str
    group: int
    chunk: int
    position: int
    block: int
    step: int
    job: int | None


class TimelinePoint(NamedTuple):
    """Cumulative figures of a run at the end of one step (one entry of
    :attr:`SimResult.timeline`): the step, then :class:`SimResult` figures of the same names."""

    step: int
    lookup_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    prefill_tokens: int
    bytes_stored: int
    bytes_loaded: int
    flushed_jobs: int
    flushes_vllm_rule: int


@dataclass
class SimResult:
    """Figures of one run. :meth:`to_dict` gives them as plain JSON-able values."""

    config: dict[str, Any]
    requests: int = 0
    steps: int = 0
    wall_seconds: float = 0.0
    lookup_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    readmissions: int = 0
    store_jobs: int = 0
    load_jobs: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    failed_jobs: int = 0
    tier_written_chunks: dict[str, int] = field(default_factory=dict)
    """Per lower tier's medium (``disk``, ``remote``): chunks written behind to it."""
    tier_promoted_chunks: dict[str, int] = field(default_factory=dict)
    """Per medium: chunks promoted from it into the CPU pool."""
    tier_promoted_tokens: dict[str, int] = field(default_factory=dict)
    """Per medium: tokens of the first group's chunks promoted from it."""
    tier_failed_jobs: dict[str, int] = field(default_factory=dict)
    """Per medium: tier jobs that failed (the request recomputed)."""
    tiers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per medium: the scheduler's tier counters, summed over the groups."""
    remote_nodes: dict[str, dict[str, int]] = field(default_factory=dict)
    """The shared tier's client counters per server (``host:port``; every cluster master)."""
    flushes_necessary: int = 0
    flushes_conservative: int = 0
    flushes_vllm_rule: int = 0
    """Store jobs vLLM's own offloading rule would have flushed on the same run
    (:mod:`kvoffload.sim.vllm_rule`)."""
    flushed_jobs: int = 0
    """Jobs in the plans' flush sets (our fence), whatever the fence mode."""
    flush_steps: int = 0
    flush_wait_seconds: float = 0.0
    sched_seconds: float = 0.0
    sched_step_us_mean: float = 0.0
    sched_step_us_p99: float = 0.0
    blocks_verified: int = 0
    hit_blocks_verified: int = 0
    mismatches: int = 0
    hit_mismatches: int = 0
    torn_stores: int = 0
    mismatch_details: list[Mismatch] = field(default_factory=list)
    leaked_requests: int = 0
    leaked_jobs: int = 0
    scheduler_stats: dict[str, Any] = field(default_factory=dict)
    timeline: list[TimelinePoint] = field(default_factory=list)
    """Per step, the cumulative figures at its end."""

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens served by the GPU cache or the CPU tier."""
        return (self.gpu_hit_tokens + self.cpu_hit_tokens) / max(1, self.lookup_tokens)

    def to_dict(self) -> dict[str, Any]:
        """All figures, JSON-able."""
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["mismatch_details"] = [asdict(m) for m in self.mismatch_details]
        return d
