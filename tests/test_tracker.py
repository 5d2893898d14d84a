"""``kvoffload.JobTracker`` end to end: the job table and the fence from Python.

Covers the README example, multi-worker completion (each worker rank reports a job once), the
eager / deferred lifecycle classes (release, reacquire, forget), reset and late reports, the
counters, bad input (each bad call or report raises a specific ``kvoffload.errors`` exception
naming the bad value and changes nothing), and a hypothesis state machine that drives the
tracker next to a small Python model and checks the invariants of DESIGN.md §4 after every step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import kvoffload
from kvoffload import JobTracker, KvOffloadError
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
    t = JobTracker(num_blocks=1024, num_workers=1)
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
    t = JobTracker(num_blocks=8, num_workers=3)
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
    t = JobTracker(num_blocks=8, num_workers=2)
    job = t.create_store(0, eager=[1])
    assert t.complete(job) == "pending"
    with pytest.raises(DuplicateReportError, match=rf"job {job}: worker 0 already reported"):
        t.complete(job, 0)
    assert t.remaining(job) == 1
    assert t.complete(job, 1) == "done"


def test_one_failed_report_fails_the_job() -> None:
    t = JobTracker(num_blocks=8, num_workers=2)
    job = t.create_load(5, [2, 3])
    assert t.complete(job, 1, ok=False) == "pending"
    assert t.complete(job, 0, ok=True) == "failed"
    s = t.stats()
    assert (s["completed"], s["failed"], s["loads_created"]) == (1, 1, 1)
    assert t.armed_pairs == 0


def test_release_arms_pending_and_future_jobs_reacquire_stops_arming_new_ones() -> None:
    t = JobTracker(num_blocks=32)
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
    t = JobTracker(num_blocks=8)
    job = t.create_store(2, deferred=[5])
    t.release(2)
    t.forget(2)
    assert not t.is_released(2)
    assert t.check([5]) == [job]
    assert t.complete(job) == "done"
    assert t.check([5]) == []


def test_check_is_sorted_unique_and_only_on_written_blocks() -> None:
    t = JobTracker(num_blocks=16)
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
    t = JobTracker(num_blocks=16)
    t.release(9)
    j1 = t.create_store(np.int64(9), eager=(1, 2), deferred=range(3, 5))
    j2 = t.create_store(9, deferred=np.array([5, 6], dtype=np.uint32))
    j3 = t.create_store(9, eager=iter([7]))
    assert t.check(range(16)) == [j1, j2, j3]
    assert t.armed_pairs == 7


def test_reset_flushes_everything_and_later_reports_are_late() -> None:
    t = JobTracker(num_blocks=16, num_workers=2)
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
    t = JobTracker(num_blocks=8, num_workers=1)
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
    assert repr(t) == "JobTracker(num_blocks=8, num_workers=1, pending=2, armed_pairs=2)"


def test_owner_ids_cover_the_whole_64_bit_range() -> None:
    t = JobTracker(num_blocks=4)
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
        JobTracker(*args)


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
    t = JobTracker(num_blocks=8, num_workers=4)
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


# --------------------------------------------------------------------------------------------
# Random schedules against a small model
# --------------------------------------------------------------------------------------------

SM_BLOCKS = 12
SM_OWNERS = 5


@dataclass
class MJob:
    """One pending job of the model."""

    id: int
    kind: str
    owner: int
    eager: list[int]
    deferred: list[int]
    armed: bool
    held_in: int | None  # the owner's holding period at creation, if it held its blocks
    reported: set[int] = field(default_factory=set)  # worker ranks that reported it
    failed: bool = False


@dataclass
class Model:
    """The tracker's rules, spelled out naively: a dict of pending jobs, a scanning check."""

    workers: int
    jobs: dict[int, MJob] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)
    period: dict[int, int] = field(default_factory=dict)
    next: int = 0
    floor: int = 0
    completed: list[int] = field(default_factory=list)

    def armed_blocks(self, j: MJob) -> list[int]:
        return j.eager + (j.deferred if j.armed else [])

    def held(self, block: int) -> bool:
        """Whether a request that still holds its blocks reads ``block``."""
        return any(
            j.owner not in self.released
            and j.held_in == self.period.get(j.owner, 0)
            and block in j.deferred
            for j in self.jobs.values()
        )

    def flush(self, written: list[int]) -> list[int]:
        return [j.id for j in self.jobs.values() if set(self.armed_blocks(j)) & set(written)]

    def remaining(self, j: MJob) -> int:
        return self.workers - len(j.reported)

    def missing(self, j: MJob) -> list[int]:
        """Ranks that have not reported ``j`` yet."""
        return sorted(set(range(self.workers)) - j.reported)

    def verdict(self, job: int, rank: int) -> str | tuple[type[KvOffloadError], str] | None:
        """What ``complete(job, rank)`` does: ``None`` (recorded), ``"late"``, or the exception
        and a pattern of its message, in the tracker's check order."""
        if rank < 0:
            return CompletionError, rf"job {job}: worker rank must be >= 0, got {rank}\b"
        if job < self.floor:
            return "late"
        if job >= self.next:
            return UnknownJobError, rf"unknown job {job}\b"
        if rank >= self.workers:
            return CompletionError, rf"job {job}: worker rank {rank} is out of range"
        if job not in self.jobs:
            return CompletionError, rf"job {job} already completed"
        if rank in self.jobs[job].reported:
            return DuplicateReportError, rf"job {job}: worker {rank} already reported"
        return None


class TrackerMachine(RuleBasedStateMachine):
    """Drives a ``JobTracker`` and a ``Model`` with the same calls and compares them."""

    t: JobTracker
    m: Model

    @initialize(workers=st.integers(1, 3))
    def start(self, workers: int) -> None:
        self.t = JobTracker(num_blocks=SM_BLOCKS, num_workers=workers)
        self.m = Model(workers)

    owners = st.integers(0, SM_OWNERS - 1)
    block_lists = st.lists(st.integers(0, SM_BLOCKS - 1), max_size=4)

    def _create(self, kind: str, owner: int, eager: list[int], deferred: list[int]) -> None:
        m = self.m
        mine = [j for j in m.jobs.values() if j.owner == owner]
        before = observe(self.t, SM_BLOCKS)
        expected: type[KvOffloadError] | None = None
        if not eager and not deferred:
            expected = InvalidBlockError
        elif any(j.kind == "load" for j in mine) or (kind == "load" and mine):
            expected = RequestStateError
        if expected is not None:
            with pytest.raises(expected, match=rf"request {owner}\b"):
                self._call_create(kind, owner, eager, deferred)
            assert observe(self.t, SM_BLOCKS) == before
            return
        job = self._call_create(kind, owner, eager, deferred)
        assert job == m.next, "ids are issued in order"
        m.next += 1
        released = owner in m.released
        m.jobs[job] = MJob(
            job,
            kind,
            owner,
            list(eager),
            list(deferred),
            armed=released,
            held_in=None if released else m.period.get(owner, 0),
        )

    def _call_create(self, kind: str, owner: int, eager: list[int], deferred: list[int]) -> int:
        if kind == "load":
            return self.t.create_load(owner, deferred)
        return self.t.create_store(owner, eager=eager, deferred=deferred)

    @rule(owner=owners, eager=block_lists, deferred=block_lists)
    def create_store(self, owner: int, eager: list[int], deferred: list[int]) -> None:
        self._create("store", owner, eager, deferred)

    @rule(owner=owners, blocks=block_lists)
    def create_load(self, owner: int, blocks: list[int]) -> None:
        self._create("load", owner, [], blocks)

    @rule(owner=owners)
    def release(self, owner: int) -> None:
        self.t.release(owner)
        if owner not in self.m.released:
            self.m.released.add(owner)
            self.m.period[owner] = self.m.period.get(owner, 0) + 1
        for j in self.m.jobs.values():
            if j.owner == owner:
                j.armed = True

    @rule(owner=owners)
    def reacquire(self, owner: int) -> None:
        self.t.reacquire(owner)
        if owner in self.m.released:
            self.m.released.discard(owner)
            self.m.period[owner] = self.m.period.get(owner, 0) + 1

    @rule(owner=owners)
    def forget(self, owner: int) -> None:
        self.t.forget(owner)
        self.m.released.discard(owner)

    @rule(written=st.lists(st.integers(0, SM_BLOCKS - 1), max_size=6), drain=st.booleans())
    def check(self, written: list[int], drain: bool) -> None:
        flush = self.t.check(written)
        # Minimal flush: exactly the jobs with an armed pair on a written block.
        assert flush == self.m.flush(written)
        # No torn store: a block the engine may write (not held by a running request) has no
        # pending job reading or writing it outside the flush set.
        for b in written:
            if not self.m.held(b):
                for j in self.m.jobs.values():
                    if b in j.eager or b in j.deferred:
                        assert j.id in flush, f"block {b}: job {j.id} not flushed"
        if drain:
            for job in flush:
                self._drain(job)

    def _drain(self, job: int) -> None:
        """Every rank that has not reported ``job`` yet reports it."""
        for rank in self.m.missing(self.m.jobs[job]):
            self._report(job, rank, True)

    def _report(self, job: int, rank: int, ok: bool) -> None:
        """A report the model says is recorded."""
        m = self.m
        j = m.jobs[job]
        assert m.verdict(job, rank) is None
        j.reported.add(rank)
        j.failed |= not ok
        done = not m.remaining(j)
        expected = "pending" if not done else ("failed" if j.failed else "done")
        assert self.t.complete(job, rank, ok) == expected
        if done:
            del m.jobs[job]
            m.completed.append(job)

    @precondition(lambda self: self.m.jobs)
    @rule(data=st.data(), ok=st.booleans())
    def complete(self, data: st.DataObject, ok: bool) -> None:
        """A valid report: a pending job, a rank that has not reported it."""
        job = data.draw(st.sampled_from(sorted(self.m.jobs)), label="job")
        rank = data.draw(st.sampled_from(self.m.missing(self.m.jobs[job])), label="rank")
        self._report(job, rank, ok)

    @precondition(lambda self: any(j.reported for j in self.m.jobs.values()))
    @rule(data=st.data(), ok=st.booleans())
    def duplicate_report(self, data: st.DataObject, ok: bool) -> None:
        """A rank reports a pending job a second time: rejected, nothing changes (not even the
        job's failed flag, which shows when it completes)."""
        m = self.m
        job = data.draw(st.sampled_from([j.id for j in m.jobs.values() if j.reported]))
        rank = data.draw(st.sampled_from(sorted(m.jobs[job].reported)), label="rank")
        before = observe(self.t, SM_BLOCKS)
        with pytest.raises(DuplicateReportError, match=rf"job {job}: worker {rank} already"):
            self.t.complete(job, rank, ok)
        assert observe(self.t, SM_BLOCKS) == before, "a duplicate report changed the tracker"

    @rule(data=st.data(), ok=st.booleans())
    def report(self, data: st.DataObject, ok: bool) -> None:
        """Any report: pending, completed, late or never-issued ids; ranks that reported,
        that did not, out of range or negative. Whatever is not recorded changes nothing."""
        m = self.m
        ids = [st.integers(m.next, m.next + 2)]  # never issued
        if m.jobs:
            ids.append(st.sampled_from(sorted(m.jobs)))
        partial = [j.id for j in m.jobs.values() if j.reported]
        if partial:
            ids.append(st.sampled_from(partial))  # some ranks in: room for duplicates
        if m.completed:
            ids.append(st.sampled_from(m.completed))
        if m.floor:
            ids.append(st.integers(max(0, m.floor - 3), m.floor - 1))  # late
        job = data.draw(st.one_of(ids), label="job")
        ranks = [
            st.integers(0, m.workers - 1),
            st.integers(m.workers, m.workers + 2) | st.sampled_from([2**32, 2**40]),
            st.sampled_from([-1, -2, -(2**40)]),
        ]
        if job in m.jobs and m.jobs[job].reported:
            ranks.append(st.sampled_from(sorted(m.jobs[job].reported)))  # a duplicate
        rank = data.draw(st.one_of(ranks), label="rank")
        verdict = m.verdict(job, rank)
        if verdict is None:
            self._report(job, rank, ok)
            return
        before = observe(self.t, SM_BLOCKS)
        if verdict == "late":
            assert self.t.complete(job, rank, ok) == "late"
            before["stats"]["late_reports"] += 1
            assert observe(self.t, SM_BLOCKS) == before
            return
        exc, pattern = verdict
        with pytest.raises(exc, match=pattern) as e:
            self.t.complete(job, rank, ok)
        assert type(e.value) is exc
        assert observe(self.t, SM_BLOCKS) == before, "a rejected report changed the tracker"

    @rule()
    def reset(self) -> None:
        assert self.t.reset() == list(self.m.jobs)
        self.m.jobs.clear()
        self.m.completed.clear()
        for owner in self.m.released:
            self.m.period[owner] = self.m.period.get(owner, 0) + 1
        self.m.released.clear()
        self.m.floor = self.m.next

    @invariant()
    def matches_the_model(self) -> None:
        t, m = self.t, self.m
        assert t.pending_jobs() == list(m.jobs)
        assert len(t) == len(m.jobs)
        assert [t.remaining(j) for j in m.jobs] == [m.remaining(j) for j in m.jobs.values()]
        index: list[list[int]] = [[] for _ in range(SM_BLOCKS)]
        for j in m.jobs.values():
            for b in m.armed_blocks(j):
                index[b].append(j.id)
        assert [t.jobs_on(b) for b in range(SM_BLOCKS)] == [sorted(x) for x in index]
        assert t.armed_pairs == sum(map(len, index))
        assert [t.is_released(o) for o in range(SM_OWNERS)] == [
            o in m.released for o in range(SM_OWNERS)
        ]
        s = t.stats()
        assert s["owners"] == len({j.owner for j in m.jobs.values()})
        assert s["released_owners"] == len(m.released)
        # One pending load or any number of stores per request.
        for o in range(SM_OWNERS):
            kinds = [j.kind for j in m.jobs.values() if j.owner == o]
            assert kinds.count("load") == 0 or kinds == ["load"]
        # No leaks: nothing pending, nothing left.
        if not m.jobs:
            assert (s["pending"], s["armed_pairs"], s["owners"]) == (0, 0, 0)

    def teardown(self) -> None:
        if not hasattr(self, "t"):
            return
        for job in list(self.m.jobs):
            self._drain(job)
        s = self.t.stats()
        assert (s["pending"], s["armed_pairs"], s["owners"]) == (0, 0, 0)
        assert self.t.pending_jobs() == []


TrackerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_tracker_state_machine = TrackerMachine.TestCase


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

    t = JobTracker(num_blocks=8)
    j = t.create_store(owner=1, deferred=[1])
    before = (t.stats(), t.pending_jobs())
    with pytest.raises(getattr(errors, exc), match=match):
        t.complete(job, worker)
    assert (t.stats(), t.pending_jobs()) == before
    assert t.complete(j) == "done"
