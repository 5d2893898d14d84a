"""Nothing escapes the boundary: no panic reaches Python, no report fails open, no report of a
job before the plan that carries it is applied, and the interpreter exits cleanly with copies in
flight.

Each test names the defect it rules out: a ``PanicException`` with the step half applied, a load
planned after its failure was reported, an ``ok=None`` report publishing a store, a SIGABRT at
exit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvoffload._core import Scheduler, _CpuPool, _JobTracker
from kvoffload.errors import (
    CompletionError,
    InternalError,
    KvOffloadError,
    RequestStateError,
)
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput

BS = 16


def make(**kw: object) -> OffloadScheduler:
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("cpu_chunks", 16)
    return OffloadScheduler(OffloadConfig(groups=(KvGroup(BS),), **kw))  # type: ignore[arg-type]


def running(s: OffloadScheduler, rid: str, blocks: list[int], base: int = 100) -> None:
    s.add_request(rid, len(blocks) * BS, [base + i for i in range(len(blocks))])
    assert s.lookup(rid, 0) == 0
    s.allocate(rid, [blocks], 0, 0)


def snapshot(s: OffloadScheduler) -> tuple:
    return (repr(sorted(s.stats().items())), s._core.pending_jobs(), s.num_requests)


@pytest.mark.parametrize("release", ["finished", "aborted", "preempted"])
def test_new_blocks_for_a_request_released_in_the_same_step_are_refused(release: str) -> None:
    """Was: ``PanicException: indexed request exists``, the request dropped and the step
    counted."""
    s = make()
    running(s, "a", [1])
    before = snapshot(s)
    step = StepInput(new_blocks=[("a", 0, [2])], **{release: ["a"]})
    with pytest.raises(RequestStateError, match='"a" gets new blocks and is released'):
        s.schedule(step)
    assert snapshot(s) == before
    assert s.status("a") == "running"
    # The same release on its own is applied: nothing is pending, so a finished or aborted
    # request is dropped at once.
    s.schedule(StepInput(**{release: ["a"]}))
    assert s.num_requests == (1 if release == "preempted" else 0)


def test_a_request_is_not_resumed_and_preempted_in_one_step() -> None:
    s = make()
    running(s, "a", [1])
    s.schedule(StepInput(preempted=["a"]))
    before = snapshot(s)
    with pytest.raises(RequestStateError, match='"a" is resumed and released'):
        s.schedule(StepInput(resumed=["a"], preempted=["a"], new_blocks=[("a", 0, [3])]))
    assert snapshot(s) == before
    assert s.status("a") == "preempted"


def prior_store_and_load() -> tuple[OffloadScheduler, int]:
    """A scheduler whose request "b" has a load job created and not yet handed out."""
    s = make()
    running(s, "a", [1, 2])
    for j in s.schedule(StepInput(scheduled=[("a", 2 * BS)])).stores:
        s.complete(j.job_id)
    s.schedule(StepInput(finished=["a"]))
    s.add_request("b", 2 * BS + 1, [100, 101])
    assert s.lookup("b", 0) == 2 * BS
    load = s.allocate("b", [[5, 6, 7]], 0, 2 * BS)
    assert load is not None
    return s, load


@pytest.mark.parametrize("ok", [False, True])
def test_a_report_before_the_plan_that_carries_the_job_is_refused(ok: bool) -> None:
    """Was: the failed load was still planned, reading slots outside the fence, and the worker's
    real report was then rejected as "already completed"."""
    s, load = prior_store_and_load()
    before = snapshot(s)
    with pytest.raises(CompletionError, match=f"job {load} was not handed out in a plan"):
        s.complete(load, 0, ok)
    with pytest.raises(CompletionError, match=f"job {load} was not handed out in a plan"):
        s.complete_many([] if not ok else [load], [load] if not ok else [])
    assert snapshot(s) == before
    plan = s.schedule(StepInput(scheduled=[("b", 2 * BS + 1)], written=[7]))
    assert [j.job_id for j in plan.loads] == [load]
    done = s.complete(load, 0, ok)
    assert done is not None
    assert done.ok == ok


@pytest.mark.parametrize("bad", [None, 1, 0, "yes", 1.0, [True]])
def test_ok_must_be_a_bool(bad: object) -> None:
    """Was: ``complete(job, ok=None)`` published the store, and a later lookup hit it."""
    s = make()
    running(s, "a", [1, 2])
    stores = s.schedule(StepInput(scheduled=[("a", 2 * BS)])).stores
    before = snapshot(s)
    for j in stores:
        with pytest.raises(CompletionError, match="ok must be a bool"):
            s.complete(j.job_id, ok=bad)  # type: ignore[arg-type]
        with pytest.raises(CompletionError, match="ok must be a bool"):
            s._core.complete(j.job_id, 0, bad)  # type: ignore[arg-type]
    assert snapshot(s) == before
    s.add_request("b", 2 * BS + 1, [100, 101])
    assert s.lookup("b", 0) is None  # still being stored: nothing was published
    tracker = _JobTracker(8)
    job = tracker.create_store(0, [1])
    with pytest.raises(CompletionError, match="ok must be a bool"):
        tracker.complete(job, 0, bad)  # type: ignore[arg-type]
    assert tracker.pending_jobs() == [job]
    pool = _CpuPool(4)
    pool.prepare_store([1])
    with pytest.raises(CompletionError, match="ok must be a bool"):
        pool.complete_store([1], bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [None, 1.0, "0", True])
def test_worker_must_be_an_int(bad: object) -> None:
    s = make()
    running(s, "a", [1])
    (store,) = s.schedule(StepInput(scheduled=[("a", BS)])).stores
    before = snapshot(s)
    with pytest.raises(CompletionError, match="worker rank"):
        s._core.complete(store.job_id, bad, True)  # type: ignore[arg-type]
    with pytest.raises(CompletionError, match="worker rank"):
        s._core.complete_many([store.job_id], None, bad)  # type: ignore[arg-type]
    with pytest.raises(CompletionError, match="worker rank"):
        s._core.complete_counts([store.job_id], None, bad)  # type: ignore[arg-type]
    assert snapshot(s) == before
    assert s.complete(store.job_id) is not None


def test_a_panic_becomes_internal_error_and_poisons_the_object() -> None:
    core = Scheduler([(BS, None, 1024)], num_gpu_blocks=64, cpu_chunks=8)
    core.add_request("a", BS, [1])
    with pytest.raises(InternalError, match="_debug_panic"):
        core._debug_panic()
    calls = [
        lambda: core.add_request("b", BS, [2]),
        lambda: core.lookup("a", 0),
        lambda: core.schedule([]),
        lambda: core.complete(0),
        lambda: core.reset(),
        lambda: core.stats(),
        lambda: core.take_events(),
        lambda: core.pending_jobs(),
    ]
    for call in calls:
        with pytest.raises(InternalError, match="refuses every call"):
            call()
    assert issubclass(InternalError, KvOffloadError)
    # Another object is not affected.
    other = Scheduler([(BS, None, 1024)], num_gpu_blocks=64, cpu_chunks=8)
    other.add_request("a", BS, [1])


EXIT_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import torch
    from kvoffload.transfer import TransferEngine

    k = torch.zeros(64, 1 << 18, dtype=torch.uint8)
    eng = TransferEngine([[k]], blocks_per_chunk=1, num_slots=64, cpu_copy_threads=2)
    for j in range(20):
        eng.submit_store(2 * j, [(0, np.arange(64), np.arange(64))])
        eng.submit_load(2 * j + 1, [(0, np.arange(64), np.arange(64))])
    # Exits here, copies in flight, without waiting or shutting down.
    """
)


def test_exit_with_copies_in_flight_is_clean_50_times() -> None:
    """Was: SIGABRT ("FATAL: exception not rethrown") in most runs: a daemon copy thread inside
    the core's copy, GIL released, torn down by the interpreter's shutdown."""

    def run(_: int) -> tuple[int, str]:
        p = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=300
        )
        return p.returncode, p.stderr[-2000:]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(50)))
    failures = [(rc, err) for rc, err in results if rc != 0]
    assert failures == [], f"{len(failures)} of 50 runs failed; first: {failures[:1]}"


TIER_EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, tempfile
    from pathlib import Path
    from tests.support.disk import BLOCK, cpu_engine, store_and_finish, tier_config
    from kvoffload.scheduler import OffloadScheduler
    from kvoffload.transfer.disk import open_disk_worker

    path = Path(tempfile.mkdtemp())
    sched = OffloadScheduler(tier_config(path, tier_write_share=1.0))
    kv, worker = cpu_engine(1)
    disk = open_disk_worker(worker, path, 1 << 20, [BLOCK], model="toy")
    plan = store_and_finish(sched, worker, [1, 2, 3], 3 * BLOCK)
    assert plan.tier_jobs
    disk.submit(plan.tier_jobs)
    # Exits here, the disk tier's writes in flight on its Rust I/O threads.
    """
)


def test_exit_with_tier_writes_in_flight_is_clean() -> None:
    root = str(Path(__file__).resolve().parents[1])

    def run(_: int) -> tuple[int, str]:
        p = subprocess.run(
            [sys.executable, "-c", TIER_EXIT_SCRIPT],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
        )
        return p.returncode, p.stderr[-2000:]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(6)))
    failures = [(rc, err) for rc, err in results if rc != 0]
    assert failures == [], f"{len(failures)} of 6 runs failed; first: {failures[:1]}"
