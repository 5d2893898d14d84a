"""``kvoffload._core._JobTracker`` end to end: the job table and the fence from Python.

Covers the README example, multi-worker completion (each worker rank reports a job once), the
eager / deferred lifecycle classes (release, reacquire, forget), reset and late reports, the
counters, and bad input (each bad call or report raises a specific ``kvoffload.errors``
exception naming the bad value and changes nothing), including what only the binding sees:
negative ranks, ranks beyond 32 bits, ids and blocks of the wrong type.

The random-schedule model of the tracker is the proptest in ``tests/tracker.rs``: it drives the
core with schedules of up to 300 operations (stores, loads, releases, reacquires, fence checks
with drains, reports by rank in any order, duplicate, out-of-range, completed, unknown and late
reports, resets) and compares the whole observable state after every one.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import kvoffload
from kvoffload import KvOffloadError
from kvoffload._core import _JobTracker
from kvoffload.errors import (
    CompletionError,
    ConfigError,
    DuplicateReportError,
    InvalidBlockError,
    InvalidRequestError,
    RequestStateError,
    UnknownJobError,
)
from tests.conftest import NUM_BLOCKS, Busy, observe

# --------------------------------------------------------------------------------------------
# The documented behaviour
# --------------------------------------------------------------------------------------------


def test_readme_example() -> None:
    t = _JobTracker(num_blocks=1024, num_workers=1)
    job = t.create_store(owner=7, deferred=[10, 11])
    assert t.check(written=[10]) == []
    t.release(7)
    assert t.check(written=[10]) == [job]
    assert t.complete(job) == "done"
    # And afterwards nothing is left behind.
    assert len(t) == 0
    assert t.armed_pairs == 0
    assert t.check(written=[10, 11]) == []


def test_a_job_completes_after_every_worker_rank_reported() -> None:
    t = _JobTracker(num_blocks=8, num_workers=3)
    job = t.create_store(0, eager=[1])
    assert t.remaining(job) == 3
    assert t.complete(job, 0) == "pending"
    assert t.remaining(job) == 2
    assert t.check([1]) == [job], "still armed until the last worker reported"
    assert t.complete(job, worker=2) == "pending"
    assert t.remaining(job) == 1
    assert t.check([1]) == [job]
    assert t.complete(job, 1) == "done"
    assert t.pending_jobs() == []
    assert t.check([1]) == []
    # Reports may arrive from the workers in any order, for jobs in any order.
    a, b, c = (t.create_store(o, eager=[o]) for o in (1, 2, 3))
    assert t.complete(c, 2) == "pending"
    assert t.complete(a, 1) == "pending"
    assert t.complete(c, 0) == "pending"
    assert t.complete(a, 2) == "pending"
    assert t.complete(b, 1) == "pending"
    assert t.complete(a, 0) == "done"
    assert t.complete(c, 1) == "done"
    assert t.pending_jobs() == [b]
    assert t.remaining(b) == 2
    assert t.stats()["completed"] == 3


def test_the_worker_rank_defaults_to_0() -> None:
    t = _JobTracker(num_blocks=8, num_workers=2)
    job = t.create_store(0, eager=[1])
    assert t.complete(job) == "pending"
    with pytest.raises(DuplicateReportError, match=rf"job {job}: worker 0 already reported"):
        t.complete(job, 0)
    assert t.remaining(job) == 1
    assert t.complete(job, 1) == "done"


def test_one_failed_report_fails_the_job() -> None:
    t = _JobTracker(num_blocks=8, num_workers=2)
    job = t.create_load(5, [2, 3])
    assert t.complete(job, 1, ok=False) == "pending"
    assert t.complete(job, 0, ok=True) == "failed"
    s = t.stats()
    assert (s["completed"], s["failed"], s["loads_created"]) == (1, 1, 1)
    assert t.armed_pairs == 0


def test_release_arms_pending_and_future_jobs_reacquire_stops_arming_new_ones() -> None:
    t = _JobTracker(num_blocks=32)
    old = t.create_store(1, eager=[20], deferred=[1, 2])
    assert t.armed_pairs == 1, "only the eager pair"
    assert t.jobs_on(1) == []
    assert t.check([1, 2]) == []
    t.release(1)  # preempted
    assert t.is_released(1)
    assert t.armed_pairs == 3
    assert t.jobs_on(2) == [old]
    while_released = t.create_store(1, deferred=[3])
    assert t.jobs_on(3) == [while_released], "armed at creation"
    t.release(1)  # a second release arms nothing twice
    assert t.armed_pairs == 4
    t.reacquire(1)  # resumed
    assert not t.is_released(1)
    resumed = t.create_store(1, deferred=[4])
    assert t.jobs_on(4) == []
    assert t.check([1, 3, 4]) == [old, while_released], "old pairs stay armed"
    t.release(1)
    assert t.check([4]) == [resumed]
    for job in (old, while_released, resumed):
        assert t.complete(job) == "done"
    assert t.armed_pairs == 0
    t.forget(1)
    assert not t.is_released(1)
    assert t.stats()["released_owners"] == 0


def test_forget_keeps_armed_pairs_until_completion() -> None:
    t = _JobTracker(num_blocks=8)
    job = t.create_store(2, deferred=[5])
    t.release(2)
    t.forget(2)
    assert not t.is_released(2)
    assert t.check([5]) == [job]
    assert t.complete(job) == "done"
    assert t.check([5]) == []


def test_check_is_sorted_unique_and_only_on_written_blocks() -> None:
    t = _JobTracker(num_blocks=16)
    a = t.create_store(1, eager=[5, 6, 7])
    b = t.create_store(2, eager=[6])
    t.create_store(3, eager=[9])
    assert t.check([7, 6, 6, 5, 0]) == [a, b]
    assert t.check(np.array([6], dtype=np.int64)) == [a, b]
    assert t.check(x for x in (9,)) == [2]
    assert t.check([]) == []
    s = t.stats()
    assert (s["checks"], s["flushed"]) == (4, 5)


def test_block_lists_may_be_any_iterable_of_integers() -> None:
    t = _JobTracker(num_blocks=16)
    t.release(9)
    j1 = t.create_store(np.int64(9), eager=(1, 2), deferred=range(3, 5))
    j2 = t.create_store(9, deferred=np.array([5, 6], dtype=np.uint32))
    j3 = t.create_store(9, eager=iter([7]))
    assert t.check(range(16)) == [j1, j2, j3]
    assert t.armed_pairs == 7


def test_reset_flushes_everything_and_later_reports_are_late() -> None:
    t = _JobTracker(num_blocks=16, num_workers=2)
    a = t.create_store(1, eager=[1])
    b = t.create_load(2, [2])
    c = t.create_store(3, deferred=[3])
    t.release(3)
    t.release(4)
    assert t.complete(b, 0) == "pending"
    assert t.complete(b, 1) == "done"
    assert t.complete(a, 0) == "pending"
    assert t.reset() == [a, c], "every pending job, in creation order"
    assert len(t) == 0
    assert t.pending_jobs() == []
    assert t.armed_pairs == 0
    assert not t.is_released(3)
    assert not t.is_released(4)
    assert t.check(range(16)) == []
    # Reports for jobs from before the reset are ignored, even ones that would be errors now:
    # a duplicate rank, a completed job, a rank out of range.
    assert t.complete(a, 0) == "late"
    assert t.complete(b, 1) == "late"
    assert t.complete(c, worker=5, ok=False) == "late"
    assert t.remaining(a) == 0
    # New ids keep growing and the new jobs complete normally.
    d = t.create_load(2, [2])
    assert d > c
    assert t.complete(d, 1) == "pending"
    assert t.complete(d, 0) == "done"
    s = t.stats()
    assert (s["resets"], s["reset_flushed"], s["late_reports"]) == (1, 2, 3)
    assert (s["completed"], s["failed"]) == (2, 0)
    assert t.reset() == []


def test_stats_count_everything() -> None:
    t = _JobTracker(num_blocks=8, num_workers=1)
    assert t.stats() == {
        "stores_created": 0,
        "loads_created": 0,
        "completed": 0,
        "failed": 0,
        "late_reports": 0,
        "resets": 0,
        "checks": 0,
        "flushed": 0,
        "reset_flushed": 0,
        "pending": 0,
        "armed_pairs": 0,
        "owners": 0,
        "released_owners": 0,
    }
    s1 = t.create_store(1, eager=[1], deferred=[2])
    t.create_store(1, deferred=[3])
    t.create_load(2, [4, 5])
    t.release(2)
    t.release(6)
    t.check([1, 4])
    t.complete(s1, ok=False)
    stats = t.stats()
    assert stats == {
        "stores_created": 2,
        "loads_created": 1,
        "completed": 1,
        "failed": 1,
        "late_reports": 0,
        "resets": 0,
        "checks": 1,
        "flushed": 2,
        "reset_flushed": 0,
        "pending": 2,
        "armed_pairs": 2,
        "owners": 2,
        "released_owners": 2,
    }
    assert repr(t) == "_JobTracker(num_blocks=8, num_workers=1, pending=2, armed_pairs=2)"


def test_owner_ids_cover_the_whole_64_bit_range() -> None:
    t = _JobTracker(num_blocks=4)
    big = 2**64 - 1
    job = t.create_store(big, deferred=[1])
    t.release(big)
    assert t.is_released(big)
    assert t.check([1]) == [job]


def test_errors_share_a_base_class_and_are_exported() -> None:
    for exc in (
        CompletionError,
        ConfigError,
        InvalidBlockError,
        InvalidRequestError,
        RequestStateError,
        UnknownJobError,
    ):
        assert issubclass(exc, KvOffloadError)
        assert exc.__module__ == "kvoffload.errors"
        assert getattr(kvoffload._core, exc.__name__) is exc
    assert issubclass(KvOffloadError, Exception)
    assert kvoffload.KvOffloadError is KvOffloadError


# --------------------------------------------------------------------------------------------
# Bad input: a specific exception naming the bad value, and nothing changes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0,), "num_blocks must be in 1..=16777216, got 0"),
        ((2**32 - 1,), "num_blocks must be in 1..=16777216, got 4294967295"),
        ((8, 0), "num_workers must be in 1..=128, got 0"),
        ((8, True), "num_workers must be an integer, got True (bool)"),
        ((None,), "num_blocks must be an integer, got None (NoneType)"),
        ((-1,), "got -1"),
        ((8, -3), "got -3"),
        ((2**32,), "got 4294967296"),
        ((8, 2**40), "got 1099511627776"),
        ((1.5,), "got 1.5"),
        ((8, "2"), "got '2'"),
    ],
)
def test_bad_config(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _JobTracker(*args)


def test_unknown_job(busy: Busy, unchanged: Any) -> None:
    t = busy.t
    for job in (99, 2**63, -1, -(2**70), 2**70):
        with unchanged(t), pytest.raises(UnknownJobError, match=re.escape(str(job))):
            t.complete(job)
        with unchanged(t), pytest.raises(UnknownJobError, match=re.escape(str(job))):
            t.remaining(job)


def test_double_completion(busy: Busy, unchanged: Any) -> None:
    t, job = busy.t, busy.finished
    msg = f"job {job} already completed"
    with unchanged(t), pytest.raises(CompletionError, match=msg):
        t.complete(job)
    with unchanged(t), pytest.raises(CompletionError, match=msg):
        t.complete(job, ok=False)
    with unchanged(t), pytest.raises(CompletionError, match=msg):
        t.remaining(job)


def test_duplicate_rank(busy: Busy, unchanged: Any) -> None:
    t, job = busy.t, busy.eager_store  # rank 0 reported, rank 1 remains
    for ok in (True, False):
        with (
            unchanged(t),
            pytest.raises(DuplicateReportError, match=rf"job {job}: worker 0 already reported"),
        ):
            t.complete(job, 0, ok=ok)
        assert t.remaining(job) == 1
    # The rejected reports neither stood in for rank 1 nor marked the job failed.
    pending, armed, stats = t.pending_jobs(), t.armed_pairs, t.stats()
    assert job in pending
    assert t.complete(job, 1) == "done"
    assert t.pending_jobs() == [j for j in pending if j != job]
    assert t.armed_pairs == armed - 1
    after = t.stats()
    assert (after["completed"], after["failed"]) == (stats["completed"] + 1, stats["failed"])


def test_duplicate_rank_among_many_workers() -> None:
    t = _JobTracker(num_blocks=8, num_workers=4)
    job = t.create_store(1, eager=[1, 2])
    for rank in (3, 1):
        assert t.complete(job, rank) == "pending"
    for rank in (1, 3, 3):
        before = (t.remaining(job), t.pending_jobs(), t.armed_pairs, t.stats())
        with pytest.raises(DuplicateReportError, match=rf"job {job}: worker {rank} already"):
            t.complete(job, rank, ok=False)
        assert (t.remaining(job), t.pending_jobs(), t.armed_pairs, t.stats()) == before
    assert t.remaining(job) == 2
    assert t.complete(job, 0) == "pending"
    assert t.complete(job, 2) == "done", "no failed report was recorded"


@pytest.mark.parametrize("rank", [2, 3, 2**31, 2**32, 2**40, 2**100])
def test_rank_out_of_range(busy: Busy, unchanged: Any, rank: int) -> None:
    t = busy.t
    for job in (busy.running_store, busy.eager_store, busy.load):
        with unchanged(t), pytest.raises(CompletionError) as e:
            t.complete(job, rank, ok=False)
        assert type(e.value) is CompletionError
        assert re.search(
            rf"job {job}: worker rank {rank} is out of range.*\b2 workers", str(e.value)
        )
    assert [t.remaining(j) for j in (busy.running_store, busy.eager_store, busy.load)] == [2, 1, 2]


@pytest.mark.parametrize("rank", [-1, -2, -(2**40)])
def test_negative_rank(busy: Busy, unchanged: Any, rank: int) -> None:
    t = busy.t
    for job in (busy.running_store, busy.eager_store, busy.load):
        with unchanged(t), pytest.raises(CompletionError) as e:
            t.complete(job, rank)
        assert type(e.value) is CompletionError
        assert re.search(rf"job {job}: worker rank must be >= 0, got {rank}\b", str(e.value))


def test_a_bad_rank_for_an_unknown_or_finished_job_names_the_job(
    busy: Busy, unchanged: Any
) -> None:
    t = busy.t
    # An unknown id is reported before the rank's range; the range before "already completed".
    for rank in (0, 1, 2, 2**40):
        with unchanged(t), pytest.raises(UnknownJobError, match="unknown job 99"):
            t.complete(99, rank)
    for rank in (2, 2**40):
        with (
            unchanged(t),
            pytest.raises(CompletionError, match=rf"job {busy.finished}: worker rank"),
        ):
            t.complete(busy.finished, rank)
    for rank in (0, 1):
        with unchanged(t), pytest.raises(CompletionError, match=f"job {busy.finished} already"):
            t.complete(busy.finished, rank)
    # A negative rank is rejected with the arguments, before the id is looked up.
    for job in (99, busy.finished):
        with unchanged(t), pytest.raises(CompletionError, match=rf"job {job}: .*got -1\b"):
            t.complete(job, -1)


def test_reports_for_pre_reset_jobs_are_late_whatever_their_rank(busy: Busy) -> None:
    t = busy.t
    old = t.reset()
    # Rank 0 of eager_store had reported (a duplicate now); 2 and more are out of range.
    for rank in (0, 1, 2, 3, 2**40):
        assert t.complete(busy.eager_store, rank) == "late"
    assert t.complete(old[0], 1, ok=False) == "late"
    assert t.complete(busy.finished, 7) == "late"
    assert t.stats()["late_reports"] == 7
    # A negative rank is not a rank at all: an error, even for a late job, and not counted.
    with pytest.raises(CompletionError, match=r"got -1\b"):
        t.complete(old[0], -1)
    assert t.stats()["late_reports"] == 7


BAD_BLOCKS = [
    (-1, "got -1"),
    (-(2**40), "got -1099511627776"),
    (1.5, "1.5 (float)"),
    (2.0, "2.0 (float)"),
    ("3", "'3' (str)"),
    (None, "None (NoneType)"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_BLOCKS)
def test_non_integer_or_negative_block(busy: Busy, unchanged: Any, bad: Any, message: str) -> None:
    t = busy.t
    calls = {
        "eager[1]": lambda: t.create_store(7, eager=[1, bad]),
        "deferred[0]": lambda: t.create_store(7, eager=[1], deferred=[bad]),
        "blocks[2]": lambda: t.create_load(7, [1, 2, bad]),
        "written[0]": lambda: t.check([bad, 1]),
        "block": lambda: t.jobs_on(bad),
    }
    for where, call in calls.items():
        with unchanged(t), pytest.raises(InvalidBlockError, match=re.escape(message)) as e:
            call()
        assert where in str(e.value)


def test_out_of_range_block(busy: Busy, unchanged: Any) -> None:
    t = busy.t
    calls = [
        lambda: t.create_store(7, eager=[0, NUM_BLOCKS]),
        lambda: t.create_store(7, deferred=[NUM_BLOCKS]),
        lambda: t.create_store(2, deferred=[NUM_BLOCKS]),  # a released owner
        lambda: t.create_load(7, [NUM_BLOCKS]),
        lambda: t.check([1, NUM_BLOCKS]),
        lambda: t.jobs_on(NUM_BLOCKS),
    ]
    for call in calls:
        with unchanged(t), pytest.raises(InvalidBlockError, match=rf"\b{NUM_BLOCKS}\b"):
            call()
    with unchanged(t), pytest.raises(InvalidBlockError, match="4294967294"):
        t.check([2**32 - 2])


def test_blocks_that_are_not_a_sequence(busy: Busy, unchanged: Any) -> None:
    t = busy.t
    with unchanged(t), pytest.raises(InvalidBlockError, match=r"eager .*5 \(int\)"):
        t.create_store(7, eager=5)  # type: ignore[arg-type]
    with unchanged(t), pytest.raises(InvalidBlockError, match="written"):
        t.check(3.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("owner", "message"),
    [
        (-1, "got -1"),
        (2**64, "got 18446744073709551616"),
        ("7", "'7' (str)"),
        (7.0, "7.0 (float)"),
        (None, "None (NoneType)"),
    ],
)
def test_bad_owner(busy: Busy, unchanged: Any, owner: Any, message: str) -> None:
    t = busy.t
    calls = [
        lambda: t.create_store(owner, eager=[1]),
        lambda: t.create_load(owner, [1]),
        lambda: t.release(owner),
        lambda: t.reacquire(owner),
        lambda: t.forget(owner),
        lambda: t.is_released(owner),
    ]
    for call in calls:
        with unchanged(t), pytest.raises(InvalidRequestError, match=re.escape(message)):
            call()


def test_empty_job(busy: Busy, unchanged: Any) -> None:
    t = busy.t
    for call in (
        lambda: t.create_store(7),
        lambda: t.create_store(7, eager=[], deferred=()),
        lambda: t.create_store(2),  # released owner
        lambda: t.create_load(7, []),
    ):
        with unchanged(t), pytest.raises(InvalidBlockError, match=r"request 7\b|request 2\b"):
            call()


def test_a_request_has_one_load_or_any_number_of_stores(busy: Busy, unchanged: Any) -> None:
    t = busy.t
    # Owner 1 has stores pending, owner 3 a load.
    with unchanged(t), pytest.raises(RequestStateError, match=r"request 1\b.*pending stores"):
        t.create_load(1, [9])
    with unchanged(t), pytest.raises(RequestStateError, match=r"request 3\b.*pending load"):
        t.create_load(3, [9])
    with unchanged(t), pytest.raises(RequestStateError, match=r"request 3\b.*pending load"):
        t.create_store(3, eager=[9])
    # Stores pile up; once the load is done, the request may store.
    assert t.create_store(1, deferred=[9]) > busy.finished
    assert t.complete(busy.load, 0) == "pending"
    with unchanged(t), pytest.raises(RequestStateError, match=r"request 3\b.*pending load"):
        t.create_store(3, eager=[9])  # one of two ranks in: the load is still pending
    assert t.complete(busy.load, 1) == "done"
    t.create_store(3, eager=[9])
    assert t.stats()["owners"] == 3


def test_a_rejected_call_among_valid_ones_leaves_the_tracker_as_before(busy: Busy) -> None:
    t = busy.t
    before = observe(t)
    bad_calls = [
        lambda: t.create_store(7, eager=[1], deferred=[-1]),
        lambda: t.create_load(1, [1]),
        lambda: t.complete(busy.eager_store, 0),  # duplicate rank
        lambda: t.complete(busy.eager_store, 2),  # rank out of range
        lambda: t.complete(busy.running_store, -1),
        lambda: t.complete(busy.finished),
        lambda: t.check([NUM_BLOCKS]),
    ]
    for call in bad_calls:
        with pytest.raises(KvOffloadError):
            call()
    assert observe(t) == before


@pytest.mark.parametrize(
    ("job", "worker", "exc", "match"),
    [
        ("0", 1, "UnknownJobError", "'0' \\(str\\)"),
        (0.0, 1, "UnknownJobError", "0.0 \\(float\\)"),
        (None, 1, "UnknownJobError", "None"),
        (0, "1", "CompletionError", "'1' \\(str\\)"),
        (0, 1.0, "CompletionError", "1.0 \\(float\\)"),
    ],
)
def test_complete_with_wrong_types_names_the_value(job, worker, exc, match):
    import kvoffload.errors as errors

    t = _JobTracker(num_blocks=8)
    j = t.create_store(owner=1, deferred=[1])
    before = (t.stats(), t.pending_jobs())
    with pytest.raises(getattr(errors, exc), match=match):
        t.complete(job, worker)
    assert (t.stats(), t.pending_jobs()) == before
    assert t.complete(j) == "done"
