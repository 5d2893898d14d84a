"""The simulator runs the tests share."""

from __future__ import annotations

from kvoffload.sim import SimConfig

PRESSURE = SimConfig(
    num_requests=40,
    scale=0.5,
    num_gpu_blocks=96,
    cpu_chunks=2048,
    arrival_gap=0.5,
    completion="poll",
    copy_delay_s=0.002,
    sliding_window=None,
)
"""A pressured run: few GPU blocks, copies slowed down and results polled as they finish, so
blocks are freed and re-written while stores of them are pending and the fence has work to do."""
