"""The extra config's ``io_cpus`` in vLLM's real scheduler (fake workers): the workers' disk
and shared-tier I/O threads run on those CPUs only, read back from the threads; a bad set is a
``ConfigError`` naming the id when the connector is built, before any tier opens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvoffload.errors import ConfigError
from tests.vllm.harness import Harness, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ALLOWED = sorted(os.sched_getaffinity(0))
LAST = ALLOWED[-1]


def _io_threads() -> dict[int, set[int]]:
    """This process's tier I/O threads (``kvoffload-tier-*``): tid -> CPUs. (Threads of
    earlier tests may still be listed for a moment after they were joined: tests compare tids,
    not counts.)"""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("kvoffload-tier"):
                    out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # a thread that ended meanwhile
            continue
    return out


def test_every_rank_pins_its_disk_and_shared_tier_threads(tmp_path: Path) -> None:
    before = _io_threads()
    extra = {"disk_path": str(tmp_path), "disk_bytes": 1 << 20, "io_cpus": [LAST]}
    # A shared tier nobody listens on: its threads start all the same (it connects lazily).
    h = Harness(64, tp=2, remote_url="redis://127.0.0.1:1", remote_deadline_ms=50, **extra)
    mine = [c for t, c in _io_threads().items() if t not in before]
    assert len(mine) == 2 * 2 * 2, mine  # 2 ranks x (disk, shared) x 2 threads
    assert all(c == {LAST} for c in mine)
    assert [w.worker_side.tiers[0].stats()[0]["io_cpus"] for w in h.workers] == [[LAST]] * 2
    h.add("a", prompt(3, 40))
    h.run_until_done()
    h.drain()
    h.assert_clean()
    h.shutdown()
    assert sorted(os.sched_getaffinity(0)) == ALLOWED


@pytest.mark.parametrize(
    ("io_cpus", "match"),
    [
        ([], "empty set"),
        ([LAST, -2], "CPU id -2 is negative"),
        ([LAST, LAST], f"CPU {LAST} is named twice"),
        ([4096], "CPU 4096 is not one this process may run on"),
        ("0", "must be a collection of CPU ids"),
    ],
)
def test_a_bad_set_is_refused_when_the_connector_is_built(
    tmp_path: Path, io_cpus: object, match: str
) -> None:
    before = set(_io_threads())
    with pytest.raises(ConfigError, match=match):
        Harness(64, disk_path=str(tmp_path / "d"), disk_bytes=1 << 20, io_cpus=io_cpus)
    assert set(_io_threads()) <= before, "no thread was started"
    assert not (tmp_path / "d").exists()
