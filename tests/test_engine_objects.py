"""The engine's own objects read in place (``rust/py/engine.rs``): block tables of vLLM's
``KVCacheBlock`` shape (a ``dataclass(slots=True)``: ``block_id`` read from its slot, the objects
and their ints prefetched ahead) and hash lists of ``bytes`` (prefetched ahead). Whatever the
objects, the core must see what ``getattr(block, "block_id")`` and the hashes say: tables long
enough for the prefetching to run, subclasses and types that change the attribute, unset slots,
ids out of range, and Python code that changes the table while it is read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvoffload._core import Scheduler
from kvoffload.errors import InvalidBlockError
from tests.support.scheduler import hashes, snapshot

BS = 4
N = 80  # blocks per table: beyond twice the readers' prefetch distance (16)


@dataclass(slots=True)
class Block:
    """vLLM 0.32's ``KVCacheBlock`` shape."""

    block_id: Any
    ref_cnt: int = 0
    prev_free_block: Any = None
    next_free_block: Any = None
    is_null: bool = False


class Renamed(Block):
    """A subclass whose ``block_id`` is a property over the slot: the property wins."""

    @property
    def block_id(self) -> int:
        return 200

    @block_id.setter
    def block_id(self, v: Any) -> None:
        pass


class Intercepted:
    """Slots, but an instance ``__getattribute__`` that answers ``block_id`` itself."""

    __slots__ = ("block_id",)

    def __init__(self, b: int) -> None:
        self.block_id = b

    def __getattribute__(self, name: str) -> Any:
        if name == "block_id":
            return 201
        return object.__getattribute__(self, name)


class MyInt(int):
    """An int subclass: taken by its value, as any integer is."""


def core() -> Scheduler:
    return Scheduler([(BS, None, 64)], num_gpu_blocks=256, cpu_chunks=256)


def planned(table: Any, n: int = N) -> tuple[Any, ...]:
    """The step plan of one request of ``n`` blocks allocated with ``table``."""
    s = core()
    s.sync_request("a", n * BS, hashes(1, n))
    s.allocate("a", [table], 0, 0)
    return s.schedule_batch(["a"], [0], added={"a": n * BS}, written=[])


def test_slotted_blocks_plan_what_their_ids_plan() -> None:
    ids = list(range(3, 3 + N))
    want = planned(ids)
    assert want[2]  # a store of the N chunks
    assert planned([Block(b) for b in ids]) == want
    assert planned(tuple(Block(b) for b in ids)[:N]) == want
    mixed: list[Any] = [Block(b) if b % 3 else b for b in ids]
    mixed[5] = MyInt(ids[5])
    assert planned(mixed) == want


def test_a_subclass_or_a_custom_getattribute_is_read_through_getattr() -> None:
    ids = list(range(3, 3 + N))
    for odd, value in ((Renamed(7), 200), (Intercepted(7), 201)):
        for at in (0, 1, 40, N - 1):
            table: list[Any] = [Block(b) for b in ids]
            table[at] = odd
            expect = list(ids)
            expect[at] = value
            assert planned(table) == planned(expect), (type(odd).__name__, at)


@pytest.mark.parametrize("at", [0, 17, 40, N - 1])
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (-1, r"block_ids\[0\]\[{at}\]\.block_id must be in"),
        (2**32 - 1, r"block_ids\[0\]\[{at}\]\.block_id must be in"),
        (2**70, r"block_ids\[0\]\[{at}\]\.block_id must be in"),
        (True, r"block_ids\[0\]\[{at}\]\.block_id must be an integer"),
        (3.0, r"block_ids\[0\]\[{at}\]\.block_id must be an integer"),
        (None, r"block_ids\[0\]\[{at}\] must be an integer"),  # an unset slot
    ],
)
def test_a_bad_block_raises_naming_it_and_changes_nothing(bad: Any, at: int, match: str) -> None:
    s = core()
    s.sync_request("a", N * BS, hashes(1, N))
    table = [Block(b) for b in range(3, 3 + N)]
    if bad is None:
        table[at] = object.__new__(Block)  # its block_id slot never set
    else:
        table[at].block_id = bad
    before = snapshot(s)
    with pytest.raises(InvalidBlockError, match=match.format(at=at)):
        s.allocate("a", [table], 0, 0)
    assert snapshot(s) == before


def test_a_table_cleared_while_read_is_read_to_its_new_end() -> None:
    """A block whose ``block_id`` runs Python code that empties the table: the reader reads the
    length again after it, so nothing past the table's new end is read."""
    table: list[Any] = []

    class Clears:
        @property
        def block_id(self) -> int:
            table.clear()
            return 99

    table += [Block(b) for b in range(3, 30)] + [Clears()] + [Block(b) for b in range(30, 90)]
    plan = planned(table, 28)
    assert table == []
    assert plan == planned([*range(3, 30), 99], 28)


def test_long_hash_lists_read_in_place_equal_their_ints() -> None:
    """Hundreds of bytes hashes (the prefetching reader) register the keys their ints do."""
    hs = hashes(2, 300)
    ints = [int.from_bytes(h[-8:], "big") for h in hs]
    a, b = core(), core()
    for s, hl in ((a, hs), (b, ints)):
        assert s.lookup_request("a", 200 * BS, hl[:200], 0) == 0
        s.allocate("a", [list(range(1, 201))], 0, 0)
        s.schedule_batch(["a"], [0], added={"a": 200 * BS}, written=[])
        for j in s.pending_jobs():
            s.complete(j)
    for s, hl in ((a, hs), (b, ints)):
        assert s.lookup_request("b", 300 * BS, hl, 0) == 200 * BS
        assert s.lookup_request("c", 300 * BS, tuple(hl[:250]), 0) == 200 * BS
    assert a.stats() == b.stats()
