"""A simulated paged inference engine with a byte-exact integrity oracle.

:func:`simulate` runs a seeded workload through a vLLM-like engine (block pool, prefix cache,
chunked prefill, decode, sliding window, preemption) that drives
:class:`~kvoffload.scheduler.OffloadScheduler` and :class:`~kvoffload.transfer.TransferEngine`
as a real engine would, with copies running concurrently, and checks every loaded block byte
for byte. ``kvoffload simulate`` is its command line.

Modules, one concept each: :mod:`~kvoffload.sim.config` (the run's configuration and its check),
:mod:`~kvoffload.sim.workloads` and :mod:`~kvoffload.sim.oracle` (requests and their bytes),
:mod:`~kvoffload.sim.engine` (the engine's step), :mod:`~kvoffload.sim.blocks` (GPU block pool
and prefix cache), :mod:`~kvoffload.sim.request` (a request's runtime state),
:mod:`~kvoffload.sim.kv` (the KV tensors and the oracle's checks),
:mod:`~kvoffload.sim.offload` (kvoffload's scheduler and data plane, driven as an engine drives
them), :mod:`~kvoffload.sim.fleet` (engines sharing the shared tier, concurrently),
:mod:`~kvoffload.sim.vllm_rule` (vLLM's fence rule, counted on the same run),
:mod:`~kvoffload.sim.result` (the figures), :mod:`~kvoffload.sim.report` and
:mod:`~kvoffload.sim.plot` (table, JSON and chart).
"""

from kvoffload.sim.blocks import BlockPool
from kvoffload.sim.config import SimConfig, SimError
from kvoffload.sim.engine import Simulator, simulate
from kvoffload.sim.fleet import simulate_fleet
from kvoffload.sim.result import Mismatch, SimResult, TimelinePoint
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
    "TimelinePoint",
    "make_workload",
    "simulate",
    "simulate_fleet",
]
