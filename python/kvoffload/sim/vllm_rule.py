"""The counterfactual fence: the store jobs vLLM's own offloading rule would flush on a run.

kvoffload's fence flushes a pending job only when a block it still reads is re-allocated and
written this step (DESIGN.md §4). vLLM 0.32's offloading connector decides with a coarser
rule; counting what it would flush on the *same* run, beside our count, is a standing measure
of fence quality. The rule, as the simulator applies it to our pending store jobs:

* pairs of sliding-window blocks are armed when the store is created; pairs of full-attention
  blocks when the request finishes or is aborted;
* the check runs over every block allocated this step (prefix-cache re-use counts as a write),
  before this step's stores are built;
* a preemption flushes every pending store of the preempted request;
* inline, a store created for a finished request is flushed at once if one of its
  full-attention blocks was allocated this step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["VllmRuleFence"]


@dataclass
class _Job:
    request: str
    window: set[int]
    full: set[int]
    armed_full: bool = False


@dataclass
class VllmRuleFence:
    """Shadow of the pending store jobs under vLLM's rule; ``flushed`` counts its flushes.

    Attributes:
        windows: Per KV group, its sliding window in tokens or None (full attention).
        flushed: Jobs the rule flushed so far (a job flushed in two steps counts twice).
    """

    windows: Sequence[int | None]
    flushed: int = 0
    _jobs: dict[int, _Job] = field(default_factory=dict)
    _allocated: set[int] = field(default_factory=set)
    _released: set[str] = field(default_factory=set)
    _step_allocated: set[int] = field(default_factory=set)

    def allocated(self, blocks: Iterable[int]) -> None:
        """Blocks allocated this step, prefix-cache hits included."""
        self._allocated.update(blocks)

    def step(self, finished: Iterable[str], preempted: Iterable[str]) -> int:
        """The check of one step, before its stores exist; returns the jobs it flushes."""
        done = set(finished)
        self._released |= done
        gone = set(preempted)
        hit = set()
        for jid, j in self._jobs.items():
            if j.request in done:
                j.armed_full = True
            if (
                j.request in gone
                or j.window & self._allocated
                or (j.armed_full and j.full & self._allocated)
            ):
                hit.add(jid)
        self._step_allocated, self._allocated = self._allocated, set()
        self.flushed += len(hit)
        return len(hit)

    def stores(
        self, jobs: Iterable[tuple[int, str, Sequence[tuple[int, Sequence[int], object]]]]
    ) -> None:
        """Store jobs of a plan: ``(job_id, request_id, [(group, gpu_blocks, _), ...])``."""
        for jid, rid, transfers in jobs:
            j = _Job(rid, set(), set(), armed_full=rid in self._released)
            for g, gpu, _ in transfers:
                (j.full if self.windows[g] is None else j.window).update(gpu)
            self._jobs[jid] = j
            if j.armed_full and j.full & self._step_allocated:
                self.flushed += 1

    def completed(self, job_id: int) -> None:
        """The job completed (or was cancelled by a reset)."""
        self._jobs.pop(job_id, None)

    def reset(self) -> None:
        """Every pending job is gone."""
        self._jobs.clear()
