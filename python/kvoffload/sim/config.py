"""Configuration of a simulation run: :class:`SimConfig`, its one check, and :class:`SimError`.

The values the scheduler takes are mapped to its :class:`~kvoffload.scheduler.OffloadConfig`
in one place (:meth:`SimConfig.offload_config`) and checked by the core through it; the
simulator checks only its own values (sizes of the simulated tensors, workload shape, fault
rates, choices). Every bad value raises :class:`~kvoffload.errors.ConfigError`. The values
named as an ``OffloadConfig`` field default to that field's default
(:data:`~kvoffload.scheduler.OPTION_DEFAULTS`) and mean what its documentation says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from kvoffload.errors import ConfigError
from kvoffload.scheduler import OPTION_DEFAULTS as _OPTION
from kvoffload.scheduler import KvGroup, OffloadConfig
from kvoffload.sim.workloads import WORKLOADS

__all__ = ["NULL_BLOCK", "SIM_STEP_MS", "Completion", "FenceMode", "SimConfig", "SimError"]

FenceMode = Literal["exact", "conservative", "off"]
Completion = Literal["step", "poll"]
NULL_BLOCK = 0
"""The engine's null block: never allocated, stands for sliding-window positions left behind."""
SIM_STEP_MS = 10.0
"""Simulated milliseconds per engine step, for ``tier_delay_ms_per_chunk`` (a decode step of a
mid-sized model on one GPU)."""


class SimError(Exception):
    """The simulation cannot run or cannot make progress (a configuration that cannot work)."""


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulation run depends on. Same config, same figures (except timings).

    Attributes:
        workload: ``chat``, ``sysprompt``, ``docs`` or ``mixed`` (see
            :mod:`kvoffload.sim.workloads`).
        num_requests: Requests in the workload.
        seed: Seed of the workload.
        scale: Multiplies every length of the workload (< 1 for quick runs).
        arrival_gap: Mean steps between arrivals.
        block_size: Tokens per GPU block (and per hash block).
        num_gpu_blocks: GPU blocks, the null block included.
        cpu_chunks: CPU slots per KV group.
        blocks_per_chunk: GPU blocks per chunk (the unit of offloading).
        policy: CPU eviction policy, ``lru`` or ``arc``.
        sliding_window: Window in tokens of a second, sliding-window KV group; None: one
            full-attention group only.
        num_layers: Layers per KV group (every group shares the same tensors, as in a hybrid
            allocator: a block id is one piece of memory whichever group holds it).
        token_bytes: KV bytes per token per layer.
        max_num_seqs: Requests holding blocks at once (running or loading).
        token_budget: Tokens computed per step (chunked prefill).
        device: ``cpu`` or ``cuda``.
        offload: Drive the offloading scheduler; False: the same engine without offloading.
        fence: ``exact`` (pass the blocks written this step), ``conservative`` (pass None: every
            allocated block) or ``off`` (ignore the flush set: a broken fence, for tests).
        skip_deferred_arming: Build the scheduler with deferred pairs never armed (a broken
            fence, for tests).
        async_scheduling: One-step lag between scheduling and outputs.
        completion: ``step``: wait at the start of every step for the copies submitted before it
            (copies still overlap the forward pass; runs are reproducible); ``poll``: only take
            what has finished (timing dependent).
        copy_delay_s: Sleep this long before the first copy of every store job (makes the race
            of a broken fence certain).
        max_loading_requests: Scheduler backpressure on concurrent loads (0: none).
        load_fault_rate: Share of load jobs the data plane fails on purpose (seeded by
            ``seed``): the run must stay exact, the requests recompute.
        store_fault_rate: Share of store jobs failed on purpose (never published).
        max_steps: Give up after this many steps.
        disk_path: The scheduler's (no disk tier by default). A run on a directory an earlier
            run filled starts with its chunks on disk.
        disk_bytes: The scheduler's (with ``disk_path``).
        disk_deadline_ms: The scheduler's.
        disk_probation_after: The scheduler's.
        disk_probation_ms: The scheduler's.
        remote_deadline_ms: The scheduler's; the worker's reads and writes too.
        remote_url: The scheduler's; with ``disk_path`` too, both tiers. A run against a
            server an earlier run (another engine) filled finds its chunks there.
        remote_tls_ca: The scheduler's.
        io_cpus: The scheduler's; the worker's I/O threads too.
        tier_delay_ms_per_chunk: Simulated speed of every lower tier: each tier runs its jobs
            one after another, a job of ``n`` chunks taking ``n`` times this many milliseconds
            of simulated time (:data:`SIM_STEP_MS` per engine step); a job's completion is
            taken only once its simulated end has come (0: as fast as the real I/O). Counted
            in steps, never in wall time, so runs are reproducible with ``completion="step"``.
        tier_stall: Every lower tier is stuck: no tier job completes until the run drains.
        tier_write_share: The scheduler's ``tier_write_share``.
    """

    workload: str = "mixed"
    num_requests: int = 150
    seed: int = 0
    scale: float = 1.0
    arrival_gap: float = 2.0
    block_size: int = 16
    num_gpu_blocks: int = 1024
    cpu_chunks: int = 8192
    blocks_per_chunk: int = _OPTION["blocks_per_chunk"]
    policy: str = _OPTION["policy"]
    sliding_window: int | None = None
    num_layers: int = 2
    token_bytes: int = 16
    max_num_seqs: int = 32
    token_budget: int = 512
    device: str = "cpu"
    offload: bool = True
    fence: FenceMode = "exact"
    skip_deferred_arming: bool = False
    async_scheduling: bool = False
    completion: Completion = "step"
    copy_delay_s: float = 0.0
    max_loading_requests: int = _OPTION["max_loading_requests"]
    load_fault_rate: float = 0.0
    store_fault_rate: float = 0.0
    max_steps: int = 1_000_000
    disk_path: str | None = _OPTION["disk_path"]
    disk_bytes: int | None = _OPTION["disk_bytes"]
    disk_deadline_ms: float = _OPTION["disk_deadline_ms"]
    disk_probation_after: int = _OPTION["disk_probation_after"]
    disk_probation_ms: float = _OPTION["disk_probation_ms"]
    remote_url: str | None = _OPTION["remote_url"]
    remote_deadline_ms: float = _OPTION["remote_deadline_ms"]
    remote_tls_ca: str | None = _OPTION["remote_tls_ca"]
    io_cpus: tuple[int, ...] | None = _OPTION["io_cpus"]
    tier_delay_ms_per_chunk: float = 0.0
    tier_stall: bool = False
    tier_write_share: float = _OPTION["tier_write_share"]

    @property
    def windows(self) -> list[int | None]:
        """Per KV group, its sliding window (None: full attention): one full-attention group,
        then the sliding-window group if there is one."""
        return [None] if self.sliding_window is None else [None, self.sliding_window]

    def offload_config(self) -> OffloadConfig:
        """The scheduler's configuration for this run (the one mapping from the simulator's
        values to the scheduler's)."""
        bytes_per_block = self.num_layers * self.block_size * self.token_bytes
        return OffloadConfig(
            groups=tuple(
                KvGroup(
                    block_size=self.block_size, sliding_window=w, bytes_per_block=bytes_per_block
                )
                for w in self.windows
            ),
            num_gpu_blocks=self.num_gpu_blocks,
            blocks_per_chunk=self.blocks_per_chunk,
            hash_block_size=self.block_size,
            cpu_chunks=self.cpu_chunks,
            policy=self.policy,  # type: ignore[arg-type]
            num_workers=1,
            max_loading_requests=self.max_loading_requests,
            null_block=NULL_BLOCK,
            debug_skip_deferred_arming=self.skip_deferred_arming,
            disk_path=self.disk_path,
            disk_bytes=self.disk_bytes if self.disk_path is not None else None,
            disk_model="kvoffload-sim",
            disk_deadline_ms=self.disk_deadline_ms,
            disk_probation_after=self.disk_probation_after,
            disk_probation_ms=self.disk_probation_ms,
            remote_url=self.remote_url,
            remote_model="kvoffload-sim",
            remote_deadline_ms=self.remote_deadline_ms,
            remote_tls_ca=self.remote_tls_ca,
            io_cpus=self.io_cpus,
            tier_write_share=self.tier_write_share,
        )

    def validate(self) -> None:
        """Raises :class:`~kvoffload.errors.ConfigError` naming the first bad value.

        What the scheduler takes (block size, GPU blocks, CPU chunks, blocks per chunk, policy,
        sliding window, load backpressure) is checked by the core, in one place, with its
        messages, also for a run without offloading; the simulator checks only its own values.
        """
        for name in _POSITIVE:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name, lo, hi, closed in _BOUNDED:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            # also rejects nan and inf
            if not ok or not (lo <= v <= hi if closed else lo < v <= hi):
                interval = f"[{lo:g}, {hi:g}]" if closed else f"({lo:g}, {hi:g}]"
                raise ConfigError(f"{name} must be a number in {interval}, got {v!r}")
        for name, choices in _CHOICES:
            v = getattr(self, name)
            if v not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {v!r}")
        if not isinstance(self.tier_stall, bool):
            raise ConfigError(f"tier_stall must be a bool, got {self.tier_stall!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for, but CUDA is not available here")
        self.offload_config().resolved_cpu_chunks()  # the core checks the scheduler's values


_POSITIVE = (
    "num_requests",
    "num_layers",
    "token_bytes",
    "max_num_seqs",
    "token_budget",
    "max_steps",
)
"""The simulator's own integer values (the scheduler's are checked by the core)."""
_BOUNDED = (
    ("scale", 0.0, 1e6, False),
    ("arrival_gap", 0.0, 1e9, True),
    ("copy_delay_s", 0.0, 60.0, True),
    ("load_fault_rate", 0.0, 1.0, True),
    ("store_fault_rate", 0.0, 1.0, True),
    ("tier_delay_ms_per_chunk", 0.0, 3.6e6, True),
)
"""The simulator's own numbers: (name, low, high, low included)."""
_CHOICES = (
    ("workload", tuple(WORKLOADS)),
    ("fence", get_args(FenceMode)),
    ("completion", get_args(Completion)),
    ("device", ("cpu", "cuda")),
)
