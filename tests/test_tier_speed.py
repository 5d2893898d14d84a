"""A lower tier only ever adds (DESIGN.md §9): with a disk tier at any speed (as fast as the I/O,
10 MB/s, stuck) the hit rate stays within 2 points of looked-up tokens of the same seeded runs
without it.

The tier's speed is simulated in engine steps (``tier_delay_ms_per_chunk``, ``tier_stall``), not
wall time, and every run completes its copies by steps (``completion="step"``): the figures are
the same on an idle and on a loaded machine. A slow or stuck tier's write-behind pins CPU slots
until it reports; unbounded, those pins filled the CPU pool and stores found no room (the hit
rate fell from 48.6% to 24% with a stuck tier).

One seeded run moves by a few points for any change of what the CPU pool holds (pinning a
single slot for the whole run moved it by 1.3 points: which requests hit decides which ones
wait, which decides the GPU prefix-cache hits of the next ones), so the rule is checked on the
mean over a few seeds, each with and without the tier.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import ConfigError
from kvoffload.scheduler import KvGroup, OffloadConfig
from kvoffload.sim import SimConfig, simulate

SEEDS = (0, 1, 2)
BASE = SimConfig(
    workload="mixed",
    num_requests=150,
    cpu_chunks=1024,
    num_gpu_blocks=512,
    token_bytes=64,
    sliding_window=128,
    completion="step",
    disk_bytes=1 << 30,
    # Promotions never expire in wall time here: the run must not depend on the machine.
    disk_deadline_ms=3.6e6,
)
SPEEDS: dict[str, dict[str, Any]] = {
    "normal": {},
    # 10 MB/s with 2 MiB chunks: 200 ms per chunk, 20 engine steps of 10 ms.
    "10MBps": {"tier_delay_ms_per_chunk": 200.0},
    "stuck": {"tier_stall": True},
}


def hit_rate(cfg: SimConfig) -> float:
    r = simulate(cfg)
    assert (r.mismatches, r.hit_mismatches, r.torn_stores) == (0, 0, 0)
    assert (r.leaked_requests, r.leaked_jobs) == (0, 0)
    return r.hit_rate


@pytest.fixture(scope="module")
def without_tier() -> float:
    return statistics.mean(hit_rate(replace(BASE, seed=s)) for s in SEEDS)


@pytest.mark.parametrize("speed", list(SPEEDS))
def test_a_disk_tier_at_any_speed_costs_at_most_two_points(
    speed: str, tmp_path: Path, without_tier: float
) -> None:
    with_tier = statistics.mean(
        hit_rate(replace(BASE, seed=s, disk_path=str(tmp_path / f"d{s}"), **SPEEDS[speed]))
        for s in SEEDS
    )
    assert with_tier >= without_tier - 0.02, (speed, with_tier, without_tier)


def test_a_simulated_tier_speed_is_reproducible(tmp_path: Path) -> None:
    cfg = replace(BASE, num_requests=40, tier_delay_ms_per_chunk=50.0)
    a = simulate(replace(cfg, disk_path=str(tmp_path / "a")))
    b = simulate(replace(cfg, disk_path=str(tmp_path / "b")))
    figures = [(r.hit_rate, r.steps, r.tier_written_chunks) for r in (a, b)]
    assert figures[0] == figures[1]
    assert a.tiers["disk"]["skipped_writes"] > 0  # the tier did not keep up


@pytest.mark.parametrize(
    ("field", "value"),
    [("tier_delay_ms_per_chunk", -1.0), ("tier_stall", 1), ("tier_write_share", 0.0)],
)
def test_bad_tier_speed_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        replace(BASE, **{field: value}).validate()


@pytest.mark.parametrize(
    "value", [0, 0.0, -0.5, 1.5, float("nan"), float("inf"), True, "0.1", None]
)
def test_a_bad_tier_write_share_is_a_config_error_naming_it(value: object) -> None:
    cfg = OffloadConfig(groups=(KvGroup(block_size=16),), num_gpu_blocks=32, cpu_chunks=64)
    with pytest.raises(ConfigError, match="tier_write_share"):
        replace(cfg, tier_write_share=value).to_core()  # type: ignore[arg-type]
    # A valid share takes at least one slot: 1/1000 of 64 slots is one.
    replace(cfg, tier_write_share=0.001).to_core()
    replace(cfg, tier_write_share=1).to_core()


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), 2e6, True, "10"])
def test_a_bad_disk_write_mbps_is_a_config_error_naming_it(value: object, tmp_path: Path) -> None:
    cfg = OffloadConfig(
        groups=(KvGroup(block_size=16, bytes_per_block=1024),),
        num_gpu_blocks=32,
        cpu_chunks=64,
        disk_path=tmp_path / "d",
        disk_bytes=1 << 20,
    )
    with pytest.raises(ConfigError, match="disk_write_mbps"):
        replace(cfg, disk_write_mbps=value).to_core()  # type: ignore[arg-type]
    replace(cfg, disk_write_mbps=250.0).to_core()
