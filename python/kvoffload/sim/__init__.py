"""A simulated paged inference engine with a byte-exact integrity oracle.

:func:`simulate` runs a seeded workload through a vLLM-like engine (block pool, prefix cache,
chunked prefill, decode, sliding window, preemption) that drives
:class:`~kvoffload.scheduler.OffloadScheduler` and :class:`~kvoffload.transfer.TransferEngine`
as a real engine would, with copies running concurrently, and checks every loaded block byte
for byte. ``kvoffload simulate`` is its command line.
"""

from kvoffload.sim.engine import (
    BlockPool,
    Mismatch,
    SimConfig,
    SimError,
    SimResult,
    Simulator,
    simulate,
)
from kvoffload.sim.workloads import WORKLOADS, RequestSpec, make_workload

__all__ = [
    "WORKLOADS",
    "BlockPool",
    "Mismatch",
    "RequestSpec",
    "SimConfig",
    "SimError",
    "SimResult",
    "Simulator",
    "make_workload",
    "simulate",
]
