"""``io_cpus``: the lower tiers' I/O threads pinned to a CPU set, read back from the threads'
real affinity (``os.sched_getaffinity(tid)``); every bad set refused at open time, naming the
offending id, with nothing started (no thread, no file); the configuration paths (OffloadConfig,
the simulator and its CLI) reaching the threads."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvoffload.sim.offload
from kvoffload._core import DiskWorker, RemoteWorker, Scheduler, check_io_cpus
from kvoffload.cli import main
from kvoffload.errors import ConfigError
from kvoffload.scheduler import KvGroup, OffloadConfig
from kvoffload.sim import SimConfig

ALLOWED = sorted(os.sched_getaffinity(0))
LAST = ALLOWED[-1]
NOT_ALLOWED = next(c for c in range(1 << 16) if c not in ALLOWED)
CHUNK = 4096
SLOTS = 4


def _io_threads() -> dict[int, set[int]]:
    """This process's kvoffload threads (``kvoffload-tier-*`` and helpers): tid -> CPUs."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith("kvoffload-tier"):
                out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # a thread that ended meanwhile
            continue
    return out


def _io_threads_after_join() -> dict[int, set[int]]:
    """``_io_threads()`` once the joined threads are gone: the kernel lists a thread in
    ``/proc/self/task`` a little after ``pthread_join`` returned (its task is reaped after the
    join's wake-up), so a thread still listed is waited for, up to 10 s."""
    deadline = time.monotonic() + 10
    while (threads := _io_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads


@pytest.fixture
def pool() -> np.ndarray:
    """Page-aligned memory of ``SLOTS`` chunks (freed with the last worker holding it)."""
    return np.frombuffer(mmap.mmap(-1, SLOTS * CHUNK), dtype=np.uint8)


def _disk(path: Path, view: np.ndarray, **kw: Any) -> DiskWorker:
    return DiskWorker(
        str(path),
        SLOTS * 2 * CHUNK,
        [view],
        [(SLOTS, 16, [(0, 0, CHUNK, CHUNK)])],
        direct=False,
        sync=False,
        **kw,
    )


def test_disk_threads_run_on_the_set_only_and_the_engine_keeps_its_cpus(
    tmp_path: Path, pool: np.ndarray
) -> None:
    assert _io_threads_after_join() == {}
    w = _disk(tmp_path / "t", pool, threads=3, io_cpus=[LAST])
    threads = _io_threads()
    assert len(threads) == 3
    assert all(cpus == {LAST} for cpus in threads.values()), threads
    assert w.stats()[0]["io_cpus"] == [LAST]
    assert sorted(os.sched_getaffinity(0)) == ALLOWED, "the calling thread is not pinned"
    # The pinned threads work: a write, then a promotion into other slots, byte-exact.
    pool[:CHUNK] = 7
    w.submit([(1, "write", "disk", 0, [11], [0], [0], [1])])
    assert w.wait([1], timeout=30) == [(1, True)]
    w.submit([(2, "promote", "disk", 0, [11], [3], [0], [1])])
    assert w.wait([2], timeout=30) == [(2, True)]
    assert (pool[3 * CHUNK :] == 7).all()
    w.close()
    assert _io_threads_after_join() == {}
    # Reopened without a set: nothing pinned (the default), the stats say so.
    w = _disk(tmp_path / "t", pool, threads=2)
    assert [sorted(c) for c in _io_threads().values()] == [ALLOWED, ALLOWED]
    assert w.stats()[0]["io_cpus"] is None
    w.close()
    assert w.stats() == []


def test_a_set_of_several_cpus_in_any_order_and_from_a_set(
    tmp_path: Path, pool: np.ndarray
) -> None:
    ids = ALLOWED[::-1]
    assert _io_threads_after_join() == {}
    w = _disk(tmp_path / "t", pool, io_cpus=set(ids))
    assert all(sorted(c) == ALLOWED for c in _io_threads().values())
    assert sorted(w.stats()[0]["io_cpus"]) == ALLOWED
    w.close()
    assert check_io_cpus(ids) == ids
    assert check_io_cpus(None) is None


BAD: list[tuple[object, str]] = [
    ([], "at least one CPU, got an empty set"),
    ([-1], "CPU id -1 is negative"),
    ([LAST, -5], "CPU id -5 is negative"),
    ([NOT_ALLOWED], f"CPU {NOT_ALLOWED} is not one this process may run on"),
    ([1 << 40], f"CPU {1 << 40} is not one this process may run on"),
    ([LAST, LAST], f"CPU {LAST} is named twice"),
    ([1 << 70], "is not a CPU id"),
    ([True], "must be a collection of CPU ids"),
    ([1.0], "1.0 is not a CPU id"),
    (["1"], "'1' is not a CPU id"),
    ("1", "must be a collection of CPU ids"),
    (3, r"must be a collection of CPU ids \(integers\), got 3"),
]


@pytest.mark.parametrize(("io_cpus", "match"), BAD)
def test_a_bad_set_is_refused_at_open_naming_the_id_nothing_started(
    tmp_path: Path, pool: np.ndarray, io_cpus: object, match: str
) -> None:
    path = tmp_path / "never"
    assert _io_threads_after_join() == {}
    with pytest.raises(ConfigError, match=match):
        _disk(path, pool, io_cpus=io_cpus)
    assert not path.exists(), "no slab file was opened"
    with pytest.raises(ConfigError, match=match):
        RemoteWorker(
            "redis://127.0.0.1:1", [pool], [(SLOTS, 16, [(0, 0, CHUNK, CHUNK)])], io_cpus=io_cpus
        )
    assert _io_threads() == {}, "no thread was started"
    with pytest.raises(ConfigError, match=match):
        check_io_cpus(io_cpus)
    cfg = _offload(tmp_path, io_cpus)
    with pytest.raises(ConfigError, match=match):
        cfg.to_core()
    with pytest.raises(ConfigError, match=match):
        cfg.checked_io_cpus()


def test_shared_tier_threads_are_pinned_too(pool: np.ndarray) -> None:
    """The shared tier's workers are the same pool of I/O threads (no server is needed: the
    client connects when the first job runs)."""
    assert _io_threads_after_join() == {}
    w = RemoteWorker(
        "redis://127.0.0.1:1", [pool], [(SLOTS, 16, [(0, 0, CHUNK, CHUNK)])], io_cpus=[LAST]
    )
    threads = _io_threads()
    assert len(threads) == 2
    assert all(c == {LAST} for c in threads.values())
    w.close()
    assert _io_threads_after_join() == {}


def _offload(tmp_path: Path, io_cpus: object) -> OffloadConfig:
    return OffloadConfig(
        groups=(KvGroup(block_size=16, bytes_per_block=1024),),
        num_gpu_blocks=32,
        cpu_chunks=8,
        disk_path=tmp_path / "d",
        disk_bytes=1 << 20,
        io_cpus=io_cpus,  # type: ignore[arg-type]
    )


def test_offload_config_checks_and_keeps_the_set(tmp_path: Path) -> None:
    cfg = _offload(tmp_path, (LAST,))
    assert cfg.checked_io_cpus() == [LAST]
    cfg.to_core()
    assert _offload(tmp_path, None).checked_io_cpus() is None


def test_simulate_cli_pins_the_disk_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvoffload simulate --io-cpus N`` reaches the disk tier's threads (read when the worker
    opened); a bad id is a clear error before anything runs."""
    seen: list[list[set[int]]] = []
    real = kvoffload.sim.offload.open_disk_worker

    def spy(*args: Any, **kw: Any) -> DiskWorker:
        w = real(*args, **kw)
        seen.append(list(_io_threads().values()))
        return w

    monkeypatch.setattr(kvoffload.sim.offload, "open_disk_worker", spy)
    args = ["simulate", "--quiet", "--no-baseline", "--workload", "sysprompt", "--requests", "8"]
    args += ["--scale", "0.25", "--cpu-chunks", "64", "--disk", str(tmp_path)]
    args += ["--disk-bytes", str(4 << 20)]
    assert _io_threads_after_join() == {}
    assert main([*args, "--io-cpus", str(LAST)]) == 0
    assert seen
    assert seen[0]
    assert all(c == {LAST} for c in seen[0])
    assert main([*args, f"--io-cpus={LAST},{NOT_ALLOWED}"]) == 2
    assert main([*args, f"--io-cpus={LAST},{LAST}"]) == 2
    with pytest.raises(SystemExit):
        main([*args, "--io-cpus", "one"])
    assert len(seen) == 1, "no worker opened for a bad set"
    assert SimConfig(io_cpus=(LAST,)).offload_config().io_cpus == (LAST,)


def _lookup_threads() -> dict[int, set[int]]:
    """The shared tier's scheduler-side lookup threads (``kvoffload-remote-lookup``, whose
    name the kernel keeps as its first 15 bytes): tid -> CPUs."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "kvoffload-remot":
                    out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:
            continue
    return out


def _remote(io_cpus: object, groups: int = 2) -> OffloadConfig:
    return OffloadConfig(
        groups=tuple(KvGroup(block_size=16, bytes_per_block=1024) for _ in range(groups)),
        num_gpu_blocks=32,
        cpu_chunks=8,
        remote_url="redis://127.0.0.1:1",  # the lookup threads connect on the first question
        io_cpus=io_cpus,  # type: ignore[arg-type]
    )


def test_the_shared_tier_lookup_threads_are_pinned_too() -> None:
    """The scheduler's own shared-tier threads (one lookup thread per group) run on the set
    when the config names one; the calling thread keeps its CPUs."""
    before = set(_lookup_threads())
    core = _remote([LAST]).to_core()
    mine = {t: c for t, c in _lookup_threads().items() if t not in before}
    assert len(mine) == 2
    assert all(c == {LAST} for c in mine.values())
    assert sorted(os.sched_getaffinity(0)) == ALLOWED
    del core
    unpinned = _remote(None, groups=1).to_core()
    new = {t: c for t, c in _lookup_threads().items() if t not in before and t not in mine}
    assert list(new.values()) == [set(ALLOWED)]
    del unpinned


@pytest.mark.parametrize("bad", [[NOT_ALLOWED], [-1], [], [LAST, LAST]])
def test_a_bad_set_starts_no_lookup_thread(bad: list[int]) -> None:
    before = set(_lookup_threads())
    with pytest.raises(ConfigError, match="io_cpus"):
        Scheduler(**_remote(bad)._core_kwargs())
    assert set(_lookup_threads()) <= before
