"""The CPU pool's Python binding (``kvoffload._core._CpuPool``, private: only tests and tools
drive it directly) gets what only the binding can get wrong right.

Keys convert from ints, ``bytes`` (big-endian, folded past 16 bytes) and numpy integers, and come
back as ints; states, plans, events and the policy come back as strings, lists and tuples; every
bad input raises a specific ``kvoffload.errors`` exception with a message naming the bad value,
the pool left exactly as it was. ``discard``, which ``tests/pool.rs`` does not cover, drops only
ready, unpinned keys.

The pool's rules (the reference scenario of DESIGN.md §5, LRU and ARC eviction, pins, the
admission filter, reset) are ``tests/pool.rs``'s, with its property test against a naive model
of each policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvoffload
from kvoffload._core import _CpuPool, _StorePlan
from kvoffload.errors import (
    ConfigError,
    InvalidKeyError,
    KeyStateError,
    KvOffloadError,
    UnknownKeyError,
)

UNIVERSE = range(12)


def snapshot(pool: _CpuPool) -> tuple[Any, ...]:
    """Everything observable about a pool, read without side effects."""
    return (
        pool.stats(),
        [pool.state(k) for k in UNIVERSE],
        [pool.pins(k) for k in UNIVERSE],
        [pool.slot(k) for k in UNIVERSE],
        pool.order(),
    )


def fill(pool: _CpuPool, keys: Iterable[int | bytes]) -> _StorePlan:
    """Stores and completes `keys` (which must fit)."""
    plan = pool.prepare_store(keys)
    assert plan is not None
    pool.complete_store(plan.keys)
    return plan


def test_the_pool_and_tracker_are_private_and_their_errors_public() -> None:
    for name in ("CpuPool", "StorePlan", "JobTracker"):
        assert not hasattr(kvoffload, name), name
        assert name not in kvoffload.__all__
        assert getattr(kvoffload._core, f"_{name}").__name__ == f"_{name}"
    for name in ("UnknownKeyError", "KeyStateError", "InvalidKeyError"):
        assert name in kvoffload.errors.__all__
        assert issubclass(getattr(kvoffload.errors, name), KvOffloadError)


def test_lookup_reports_states_and_counts_hits() -> None:
    pool = _CpuPool(8)
    fill(pool, [1, 2, 4])
    pool.prepare_store([3])
    assert pool.lookup([1, 2, 3, 4, 5]) == (2, ["ready", "ready", "storing", "ready", "absent"])
    assert pool.lookup(iter([5])) == (0, ["absent"])
    stats = pool.stats()
    assert (stats["hits"], stats["misses"]) == (2, 4)


def test_keys_as_bytes_and_numpy() -> None:
    pool = _CpuPool(8)
    big = 2**128 - 1
    plan = pool.prepare_store([b"\x01\x00", np.uint64(7), big, b"\xff" * 16])
    assert plan is not None
    # 16 bytes of 0xff and 2**128 - 1 are the same key.
    assert plan.keys == [256, 7, big]
    assert all(type(k) is int for k in plan.keys)
    long_hash = bytes(range(32))  # longer than 16 bytes: folded to 128 bits
    pool.complete_store(np.array([256, 7], dtype=np.uint64))
    assert pool.lookup([256, 7, big]) == (2, ["ready", "ready", "storing"])
    assert pool.state(long_hash) == "absent"
    fill(pool, [long_hash])
    assert pool.state(long_hash) == "ready"


@given(st.integers(min_value=0, max_value=2**128 - 1))
def test_int_and_big_endian_bytes_are_one_key(k: int) -> None:
    pool = _CpuPool(1)
    fill(pool, [k])
    assert pool.state(k.to_bytes(16, "big")) == "ready"
    assert pool.take_events() == [("stored", [k], "cpu")]


# ---------------------------------------------------------------------------------------------
# Bad input: specific exception, message naming the value, state unchanged.


def busy_pool() -> _CpuPool:
    """A pool with ready (1, 2), pinned (2) and storing (3) keys."""
    pool = _CpuPool(4, "arc", store_threshold=0)
    fill(pool, [1, 2])
    pool.prepare_store([3])
    pool.prepare_load([2])
    pool.take_events()
    return pool


@pytest.mark.parametrize(
    ("call", "exc", "needle"),
    [
        (lambda p: p.prepare_load([1, 9]), UnknownKeyError, hex(9)),
        (lambda p: p.prepare_load([1, 3]), KeyStateError, hex(3)),
        (lambda p: p.complete_load([2, 1]), KeyStateError, hex(1)),
        (lambda p: p.complete_load([2, 2]), KeyStateError, hex(2)),
        (lambda p: p.complete_load([11]), UnknownKeyError, hex(11)),
        (lambda p: p.complete_store([3, 10]), UnknownKeyError, hex(10)),
        (lambda p: p.complete_store([10], ok=False), UnknownKeyError, hex(10)),
        (lambda p: p.prepare_store([4, 1.5]), InvalidKeyError, "1.5"),
        (lambda p: p.prepare_store(["7"]), InvalidKeyError, "'7'"),
        (lambda p: p.prepare_store([-1]), InvalidKeyError, "-1"),
        (lambda p: p.prepare_store([2**128]), InvalidKeyError, str(2**128)),
        (lambda p: p.prepare_store([True]), InvalidKeyError, "True"),
        (lambda p: p.prepare_store(None), InvalidKeyError, "None"),
        (lambda p: p.prepare_store("12"), InvalidKeyError, "'12'"),
        (lambda p: p.prepare_load(5), InvalidKeyError, "5"),
        (lambda p: p.lookup([0, 1.0]), InvalidKeyError, "1.0"),
        (lambda p: p.touch([1, object()]), InvalidKeyError, "object"),
        (lambda p: p.state(-5), InvalidKeyError, "-5"),
        (lambda p: p.slot(2.5), InvalidKeyError, "2.5"),
        (lambda p: p.complete_store([3.0]), InvalidKeyError, "3.0"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call: Any, exc: type[Exception], needle: str) -> None:
    pool = busy_pool()
    before = snapshot(pool)
    with pytest.raises(exc) as info:
        call(pool)
    assert needle in str(info.value)
    assert snapshot(pool) == before
    assert pool.take_events() == []


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"capacity": 0}, "got 0"),
        ({"capacity": -3}, "got -3"),
        ({"capacity": 2.0}, "got 2.0"),
        ({"capacity": "8"}, "got '8'"),
        ({"capacity": 2**40}, f"got {2**40}"),
        ({"capacity": 8, "policy": "fifo"}, '"fifo"'),
        ({"capacity": 8, "policy": 1}, "got 1"),
        ({"capacity": 8, "store_threshold": -1}, "got -1"),
    ],
)
def test_bad_config_raises_config_error(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        _CpuPool(**kwargs)
    assert needle in str(info.value)
    assert isinstance(info.value, KvOffloadError)


def test_repr_and_store_plan() -> None:
    pool = _CpuPool(2)
    plan = pool.prepare_store([5])
    assert plan is not None
    assert repr(plan) == "_StorePlan(keys=[5], slots=[0], evicted=[], filtered=[])"
    assert repr(pool) == "_CpuPool(capacity=2, policy='lru', used=1, storing=1, pinned=0)"
    assert _CpuPool(2, policy="ARC").policy == "arc"


def test_discard_drops_only_ready_unpinned_keys():
    pool = _CpuPool(4)
    plan = pool.prepare_store([1, 2, 3])
    assert plan is not None
    pool.complete_store([1, 2])  # 3 stays storing
    pool.prepare_load([2])  # 2 is pinned
    pool.take_events()
    assert pool.discard([1, 2, 3, 99]) == [1]
    assert pool.state(1) == "absent"
    assert [pool.state(k) for k in (2, 3)] == ["ready", "storing"]
    assert pool.take_events() == [("removed", [1], "cpu")]
    assert pool.stats()["discarded"] == 1
    # The freed slot is reusable, and nothing is left in a ghost list.
    assert pool.prepare_store([5]) is not None
