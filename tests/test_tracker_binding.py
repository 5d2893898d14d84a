"""The job table and the fence's Python binding (``kvoffload._core._JobTracker``, private: only
tests and tools drive it directly) gets what only the binding can get wrong right.

Arguments convert from any iterable of integers (numpy arrays, ranges, generators), owners over
the whole 64-bit range, a rank that defaults to 0; outcomes and counters come back as strings
and dicts; every bad call or report raises the specific ``kvoffload.errors`` exception naming the
bad value (negative ranks, ranks beyond 32 bits, ids, owners and blocks of the wrong type) and
leaves the tracker exactly as it was.

The rules themselves (eager and deferred arming, release, reacquire, forget, the check,
multi-worker completion, resets and late reports) are ``tests/tracker.rs``'s, with its proptest
that drives the core with random schedules next to a naive model.
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
# Conversions in and out
# --------------------------------------------------------------------------------------------


def test_the_worker_rank_defaults_to_0() -> None:
    t = _JobTracker(num_blocks=8, num_workers=2)
    job = t.create_store(0, eager=[1])
    assert t.complete(job) == "pending"
    with pytest.raises(DuplicateReportError, match=rf"job {job}: worker 0 already reported"):
        t.complete(job, 0)
    assert t.remaining(job) == 1
    assert t.complete(job, 1) == "done"


def test_block_lists_may_be_any_iterable_of_integers() -> None:
    t = _JobTracker(num_blocks=16)
    t.release(9)
    j1 = t.create_store(np.int64(9), eager=(1, 2), deferred=range(3, 5))
    j2 = t.create_store(9, deferred=np.array([5, 6], dtype=np.uint32))
    j3 = t.create_store(9, eager=iter([7]))
    assert t.check(range(16)) == [j1, j2, j3]
    assert t.check(np.array([5], dtype=np.int64)) == [j2]
    assert t.check(x for x in (7,)) == [j3]
    assert t.armed_pairs == 7


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
    assert t.complete(s1, ok=False) == "failed"
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


def test_a_load_beside_pending_jobs_is_refused_naming_the_request(
    busy: Busy, unchanged: Any
) -> None:
    t = busy.t
    # Owner 1 has stores pending, owner 3 a load.
    with unchanged(t), pytest.raises(RequestStateError, match=r"request 1\b.*pending stores"):
        t.create_load(1, [9])
    with unchanged(t), pytest.raises(RequestStateError, match=r"request 3\b.*pending load"):
        t.create_load(3, [9])
    with unchanged(t), pytest.raises(RequestStateError, match=r"request 3\b.*pending load"):
        t.create_store(3, eager=[9])


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
