"""The runtime state of one request in the simulated engine."""

from __future__ import annotations

from kvoffload.sim.oracle import Stream
from kvoffload.sim.workloads import RequestSpec

__all__ = ["SimRequest"]


class SimRequest:
    """Runtime state of one request."""

    __slots__ = (
        "arrived",
        "cached",
        "computed",
        "done",
        "hashes_sent",
        "id",
        "inflight",
        "left",
        "load_end",
        "load_hit",
        "load_job",
        "max_computed",
        "num_output",
        "output_len",
        "prompt_len",
        "released",
        "spec",
        "state",
        "stream",
        "tables",
    )

    def __init__(self, spec: RequestSpec, num_groups: int) -> None:
        self.spec = spec
        self.id = spec.req_id
        self.stream: Stream = spec.stream
        self.prompt_len = spec.prompt_len
        self.output_len = spec.output_len
        self.state = "pending"  # pending, waiting, loading, ready, running, done
        self.arrived = False
        self.done = False
        self.computed = 0
        self.max_computed = 0
        self.num_output = 0
        self.inflight = 0
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.released: list[list[int]] = [[] for _ in range(num_groups)]
        self.left: list[dict[int, int]] = [{} for _ in range(num_groups)]
        """Per group: blocks that left the sliding window -> their position (freed, and still
        holding that position's bytes until re-allocated)."""
        self.cached = [0] * num_groups
        self.hashes_sent = 0
        self.load_job: int | None = None
        self.load_hit = 0
        self.load_end = 0

    @property
    def known(self) -> int:
        """Tokens whose ids the engine knows: prompt plus processed outputs."""
        return self.prompt_len + self.num_output
