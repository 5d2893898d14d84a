"""``lookup_request`` and ``sync_request`` take the engine's whole hash list: a list resent
whole is not appended twice, a list grown by some hashes appends those, and a list that
contradicts the held hashes (shorter, or different at the last held position: hashes are
chained) raises ``RequestStateError`` naming the request, nothing changed."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvoffload._core import Scheduler
from kvoffload.errors import RequestStateError

BS = 4


def core() -> Scheduler:
    return Scheduler([(BS, None, 64)], num_gpu_blocks=64, cpu_chunks=32)


def hashes(seed: int, n: int) -> list[bytes]:
    return [random.Random(f"{seed}/{i}").randbytes(32) for i in range(n)]


def snapshot(s: Scheduler, rid: str) -> tuple[Any, ...]:
    return (s.stats(), s.pending_jobs(), s.num_requests, s.armed_pairs, s.status(rid))


def stored(s: Scheduler, rid: str, hs: list[bytes], blocks: list[int]) -> None:
    """Registers ``rid``, runs its prompt, completes the store of its chunks and finishes it."""
    assert s.lookup_request(rid, len(blocks) * BS + 1, hs, 0) == 0
    s.allocate(rid, [blocks], 0, 0)
    s.schedule_batch([rid], [0], added={rid: len(blocks) * BS}, written=blocks)
    for j in s.pending_jobs():
        s.complete(j)
    s.schedule_batch([], [], finished=[rid])


def test_a_list_resent_whole_is_not_appended_again() -> None:
    """Had the resent list been appended, the request would hold 2n hashes and the store of its
    blocks past n would go under the wrong keys; here a twin that never resent matches it."""
    hs = hashes(1, 6)
    s, twin = core(), core()
    for _ in range(3):
        assert s.lookup_request("a", 25, hs[:4], 0) == 0
    s.sync_request("a", 25, hs[:4])
    s.sync_request("a", 25, hs)
    assert twin.lookup_request("a", 25, hs, 0) == 0
    for c in (s, twin):
        c.allocate("a", [list(range(1, 7))], 0, 0)
        c.schedule_batch(["a"], [0], added={"a": 24}, written=list(range(1, 7)))
        for j in c.pending_jobs():
            c.complete(j)
        c.schedule_batch([], [], finished=["a"])
        # Another request with the same six hashes finds all six chunks.
        assert c.lookup_request("b", 25, hs, 0) == 24
    # Same stores and loads (the extra asks only count as lookups, and as pool hits/misses).
    counts = ("store_jobs", "store_chunks", "load_jobs", "load_tokens", "lookup_hit_tokens")
    assert [s.stats()[k] for k in counts] == [twin.stats()[k] for k in counts]
    assert s.stats()["store_chunks"] == 6


@pytest.mark.parametrize("method", ["lookup_request", "sync_request"])
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda hs: hs[:3], "a hash list of 3"),
        (lambda hs: [], "a hash list of 0"),
        (lambda hs: [*hs[:3], b"x" * 32, *hs[4:]], "position 3"),
        (lambda hs: hashes(7, 6), "position 3"),
        (lambda hs: [*hs[:3], b"x" * 32, *hashes(8, 4)], "position 3"),
    ],
    ids=["shorter", "empty", "last-held-differs", "all-differ", "differs-and-grown"],
)
def test_a_contradicting_list_is_refused_and_changes_nothing(
    method: str, bad: Any, match: str
) -> None:
    hs = hashes(2, 6)
    s = core()
    stored(s, "p", hs, [1, 2, 3, 4])
    assert s.lookup_request("a", 25, hs[:4], 0) == 16
    before = snapshot(s, "a")
    call = getattr(s, method)
    args = (0,) if method == "lookup_request" else ()
    with pytest.raises(RequestStateError, match=rf'request "a" .*{match}'):
        call("a", 25, bad(hs), *args)
    assert snapshot(s, "a") == before
    # The right list afterwards: as if the bad one never came.
    assert s.lookup_request("a", 25, hs, 0) == 16


def test_a_running_request_sent_a_contradicting_list_keeps_running() -> None:
    hs = hashes(3, 3)
    s = core()
    assert s.lookup_request("a", 13, hs, 0) == 0
    s.allocate("a", [[1, 2, 3]], 0, 0)
    s.schedule_batch(["a"], [0], added={"a": 12})
    before = snapshot(s, "a")
    assert before[-1] == "running"
    with pytest.raises(RequestStateError, match='request "a" '):
        s.lookup_request("a", 13, hashes(4, 3), 0)
    assert snapshot(s, "a") == before
