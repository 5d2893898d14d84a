"""Shared fixtures: a tracker with some of everything in it, and an "unchanged" check."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvoffload._core import _JobTracker

# Fixtures of the shared (Redis) tier: a real server, a delay proxy.
pytest_plugins = ("tests.support.remote",)

NUM_BLOCKS = 16
NUM_WORKERS = 2
OWNERS = range(8)


def observe(t: _JobTracker, num_blocks: int = NUM_BLOCKS) -> dict[str, Any]:
    """Everything a caller can see of a tracker."""
    pending = t.pending_jobs()
    return {
        "stats": t.stats(),
        "pending": pending,
        "len": len(t),
        "armed_pairs": t.armed_pairs,
        "index": [t.jobs_on(b) for b in range(num_blocks)],
        "remaining": [t.remaining(j) for j in pending],
        "released": [t.is_released(o) for o in OWNERS],
        "repr": repr(t),
    }


@dataclass
class Busy:
    """A tracker holding one job in each interesting state, and those jobs' ids."""

    t: _JobTracker
    running_store: int  # owner 1, deferred blocks 1, 2 (not armed)
    eager_store: int  # owner 1, eager block 3 (armed), one of two reports in
    released_store: int  # owner 2, deferred block 4 (armed by the release)
    load: int  # owner 3, deferred block 5
    finished: int  # owner 4, completed


@pytest.fixture
def busy() -> Busy:
    """A 16-block, 2-worker tracker with a mix of pending, armed and finished jobs."""
    t = _JobTracker(num_blocks=NUM_BLOCKS, num_workers=NUM_WORKERS)
    running_store = t.create_store(1, deferred=[1, 2])
    eager_store = t.create_store(1, eager=[3])
    assert t.complete(eager_store, 0) == "pending"
    released_store = t.create_store(2, deferred=[4])
    t.release(2)
    load = t.create_load(3, [5])
    finished = t.create_store(4, eager=[6])
    assert t.complete(finished, 0) == "pending"
    assert t.complete(finished, 1) == "done"
    t.check([0])
    return Busy(t, running_store, eager_store, released_store, load, finished)


@pytest.fixture
def unchanged() -> Callable[[_JobTracker], contextlib.AbstractContextManager[None]]:
    """``with unchanged(t): ...`` asserts that nothing observable of ``t`` changed."""

    @contextlib.contextmanager
    def check(t: _JobTracker) -> Iterator[None]:
        before = observe(t)
        yield
        assert observe(t) == before, "a rejected call changed the tracker"

    return check
