"""Every combination of a step's request lists, for every state a request can be in.

The rule for each combination is written once in ``docs/step-rules.md`` and once here, as
:func:`expected_errors`, from that table and not from the core's checks. For every request state
(unknown, waiting, running, preempted, finished or aborted with a store still pending) and every
subset of the lists that name the request (``scheduled``, ``new_blocks``, ``resumed``,
``finished``, ``aborted``, ``preempted``), with ``written`` absent, valid or out of range, the
step is either applied as the table says or rejected with the table's ``kvoffload.errors``
exception, and a rejected step changes nothing: a twin that never saw it goes on to produce
the same plans, counters and statuses.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvoffload.errors import (
    InvalidBlockError,
    KvOffloadError,
    RequestStateError,
    UnknownRequestError,
)
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput

BS = 16
LISTS = ("scheduled", "new_blocks", "resumed", "finished", "aborted", "preempted")
RELEASES = {"finished", "aborted", "preempted"}
STATES = ("unknown", "waiting", "running", "preempted", "finished", "aborted")
WRITTEN = ("absent", "valid", "out_of_range")
NUM_BLOCKS = 64


def make() -> OffloadScheduler:
    cfg = OffloadConfig(groups=(KvGroup(BS),), num_gpu_blocks=NUM_BLOCKS, cpu_chunks=16)
    return OffloadScheduler(cfg)


def in_state(state: str) -> OffloadScheduler:
    """A scheduler holding request "r" in ``state`` (and a bystander "o", running)."""
    s = make()
    s.add_request("o", 2 * BS, [900, 901])
    assert s.lookup("o", 0) == 0
    s.allocate("o", [[20, 21]], 0, 0)
    if state == "unknown":
        s.schedule(StepInput(scheduled=[("o", BS)]))
        return s
    s.add_request("r", 2 * BS, [100, 101])
    assert s.lookup("r", 0) == 0
    if state == "waiting":
        s.schedule(StepInput(scheduled=[("o", BS)]))
        return s
    s.allocate("r", [[1, 2]], 0, 0)
    # Both chunks of "r" are stored by this step; the stores stay pending.
    plan = s.schedule(StepInput(scheduled=[("o", BS), ("r", 2 * BS)]))
    assert len(plan.stores) == 2
    if state in ("finished", "aborted", "preempted"):
        s.schedule(StepInput(**{state: ["r"]}))
        assert s.status("r") == state
    else:
        assert s.status("r") == "running"
    return s


def step_for(lists: tuple[str, ...], written: str) -> StepInput:
    kw: dict[str, Any] = {name: ["r"] for name in lists}
    if "scheduled" in lists:
        kw["scheduled"] = [("r", 3 * BS)]
    if "new_blocks" in lists:
        kw["new_blocks"] = [("r", 0, [7])]
    if written == "valid":
        kw["written"] = [7]
    elif written == "out_of_range":
        kw["written"] = [NUM_BLOCKS + 5]
    return StepInput(**kw)


def expected_errors(state: str, lists: tuple[str, ...], written: str) -> set[type]:
    """The exceptions the step may raise (empty: it is applied), from docs/step-rules.md."""
    named = set(lists)
    releases = named & RELEASES
    live = state == "running" or (state == "preempted" and "resumed" in named)
    errors: set[type] = set()
    if written == "out_of_range":
        errors.add(InvalidBlockError)
    if state == "unknown":
        if named:
            errors.add(UnknownRequestError)
        return errors
    bad = [
        len(releases) > 1,  # released twice in one step
        "resumed" in named and state not in ("preempted", "running"),
        "resumed" in named and bool(releases),
        bool({"finished", "aborted"} & named) and state in ("finished", "aborted"),
        "preempted" in named and state not in ("running", "preempted"),
        "scheduled" in named and not live,
        "new_blocks" in named and not live,
        "scheduled" in named and bool(releases),
        "new_blocks" in named and bool(releases),
    ]
    if any(bad):
        errors.add(RequestStateError)
    return errors


def status(s: OffloadScheduler, rid: str) -> str:
    try:
        return s.status(rid)
    except UnknownRequestError:
        return "dropped"


def expected_status(state: str, lists: tuple[str, ...]) -> set[str]:
    """The status of "r" right after the step was applied."""
    named = set(lists)
    if "finished" in named or "aborted" in named:
        word = "finished" if "finished" in named else "aborted"
        # Kept while its stores are pending; dropped at once otherwise.
        return {word} if state in ("running", "preempted") else {word, "dropped"}
    if "preempted" in named:
        return {"preempted"}
    if "resumed" in named or "scheduled" in named or "new_blocks" in named:
        return {"running"}
    return {"dropped" if state == "unknown" else state}


def fingerprint(s: OffloadScheduler) -> tuple:
    st = s.stats()
    st.pop("tiers", None)
    return (status(s, "r"), status(s, "o"), repr(sorted(st.items())))


def plan_fingerprint(plan: Any) -> tuple:
    jobs = [(j.job_id, j.kind, j.request_id, j.transfers) for j in (*plan.loads, *plan.stores)]
    return (jobs, list(plan.flush))


def drain(s: OffloadScheduler) -> list[tuple]:
    """Follow-up steps every scheduler can take: the bystander runs on, then finishes; every
    job is reported. Returns what each step planned and the state after it."""
    out = []
    for step in (
        StepInput(scheduled=[("o", 2 * BS)]),
        StepInput(finished=["o"]),
        StepInput(),
    ):
        plan = s.schedule(step)
        out.append((plan_fingerprint(plan), fingerprint(s)))
        for j in (*plan.loads, *plan.stores):
            s.complete(j.job_id)
    pending = s._core.pending_jobs()
    for j in pending:
        s.complete(j)
    out.append(fingerprint(s))
    return out


CASES = [
    (state, lists, written)
    for state in STATES
    for n in range(len(LISTS) + 1)
    for lists in itertools.combinations(LISTS, n)
    for written in WRITTEN
]


@pytest.mark.parametrize("state", STATES)
def test_every_combination_of_step_lists(state: str) -> None:
    for _, lists, written in (c for c in CASES if c[0] == state):
        s, twin = in_state(state), in_state(state)
        before = fingerprint(s)
        errors = expected_errors(state, lists, written)
        where = f"state={state} lists={lists} written={written}"
        if errors:
            with pytest.raises(KvOffloadError) as info:
                s.schedule(step_for(lists, written))
            assert type(info.value) in errors, f"{where}: {info.value!r}, expected {errors}"
            assert fingerprint(s) == before, where
            assert drain(s) == drain(twin), f"{where}: the refused step changed the state"
        else:
            s.schedule(step_for(lists, written))
            assert status(s, "r") in expected_status(state, lists), (
                f"{where}: status {status(s, 'r')}"
            )
            # Whatever was applied, the scheduler goes on and ends with nothing left.
            drain(s)
            if status(s, "r") in ("running", "preempted", "waiting"):
                s.schedule(StepInput(finished=["r"]))
                for j in s._core.pending_jobs():
                    s.complete(j)
                s.schedule(StepInput())
            assert s.num_requests == 0, where
            assert s._core.pending_jobs() == [], where


def test_the_table_covers_every_outcome() -> None:
    """The cases hold accepted and refused steps for every state but unknown (the rule table
    is not vacuous), and every list on its own is accepted for a running request."""
    for state in STATES[1:]:
        outcomes = {bool(expected_errors(state, lists, w)) for _, lists, w in CASES if _ == state}
        assert outcomes == {True, False}, state
    for name in LISTS:
        assert not expected_errors("running", (name,), "absent"), name
