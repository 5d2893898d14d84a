"""The core's one-call engine paths: ``lookup_request`` (vLLM's ``get_num_new_matched_tokens``
in one call), against the same calls made one by one; bad input changes nothing."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvoffload._core import Scheduler
from kvoffload.errors import InvalidBlockError, InvalidKeyError, KvOffloadError, RequestStateError
from tests.support.scheduler import hashes, snapshot

BS = 4


def core(**kw: Any) -> Scheduler:
    return Scheduler([(BS, None, 64)], num_gpu_blocks=64, cpu_chunks=32, **kw)


def stored(s: Scheduler, rid: str, hs: list[bytes], blocks: list[int]) -> None:
    """Registers ``rid``, runs its prompt and completes the store of its chunks."""
    assert s.lookup_request(rid, len(blocks) * BS, hs, 0) == 0
    s.allocate(rid, [blocks], 0, 0)
    s.schedule_batch([rid], [0], added={rid: len(blocks) * BS}, written=blocks)
    for j in s.pending_jobs():
        s.complete(j)


def test_lookup_request_equals_sync_then_lookup() -> None:
    hs = hashes(1, 4)
    one, many = core(), core()
    stored(one, "a", hs, [1, 2, 3, 4])
    many.sync_request("a", 16, hs)
    assert many.lookup("a", 0) == 0
    many.allocate("a", [[1, 2, 3, 4]], 0, 0)
    many.schedule_batch(["a"], [0], added={"a": 16}, written=[1, 2, 3, 4])
    for j in many.pending_jobs():
        many.complete(j)
    # A second request with the same prefix: its first ask registers it and finds 3 chunks
    # (the last prompt token is recomputed), the hashes given in two asks.
    assert one.lookup_request("b", 17, hs[:2], 4) == 4
    many.sync_request("b", 17, hs[:2])
    assert many.lookup("b", 4) == 4
    assert one.lookup_request("b", 17, hs, 4) == 12
    many.sync_request("b", 17, hs)
    assert many.lookup("b", 4) == 12
    assert snapshot(one) == snapshot(many)
    assert one.status("b") == "waiting"


def test_lookup_request_releases_a_request_asked_again_while_running() -> None:
    s = core()
    hs = hashes(2, 4)
    stored(s, "a", hs, [1, 2, 3, 4])
    assert s.lookup_request("b", 17, hs, 0) == 16
    job = s.allocate("b", [[5, 6, 7, 8, 9]], 0, 16)
    assert job is not None
    s.schedule_batch(["b"], [0], written=[5, 6, 7, 8])
    assert s.status("b") == "running"
    s.complete(job, ok=False)
    # vLLM freed the blocks of the failed load and asks again: the core releases it first
    # (the failed load's chunks were discarded: nothing to load).
    assert s.lookup_request("b", 17, hs, 0) == 0
    assert s.status("b") == "preempted"


@pytest.mark.parametrize("hit", [1, 6, 15])
def test_lookup_request_refuses_a_hit_off_the_block_grid(hit: int) -> None:
    s = core()
    hs = hashes(3, 4)
    stored(s, "a", hs, [1, 2, 3, 4])
    before = snapshot(s)
    with pytest.raises(RequestStateError, match=rf'"b".* {hit} tokens.* block size {BS}'):
        s.lookup_request("b", 17, hs, hit)
    assert snapshot(s) == before
    with pytest.raises(RequestStateError, match=rf'"a".* {hit} tokens'):
        s.lookup_request("a", 17, hs, hit)
    assert snapshot(s) == before


def test_lookup_request_bad_input_changes_nothing() -> None:
    s = core()
    hs = hashes(4, 4)
    stored(s, "a", hs, [1, 2, 3, 4])
    before = snapshot(s)
    with pytest.raises(InvalidKeyError, match=r"block_hashes\[1\]"):
        s.lookup_request("b", 17, [hs[0], "x"], 0)
    assert snapshot(s) == before


def test_complete_counts_applies_what_complete_many_applies() -> None:
    hs = hashes(6, 4)
    counts, objects = core(num_workers=2), core(num_workers=2)
    for s in (counts, objects):
        assert s.lookup_request("a", 16, hs, 0) == 0
        s.allocate("a", [[1, 2, 3, 4]], 0, 0)
        s.schedule_batch(["a"], [0], added={"a": 16}, written=[1, 2, 3, 4])
    (job,) = counts.pending_jobs()
    assert counts.complete_counts([job], worker=0) == (0, 0)  # one worker of two
    assert objects.complete_many([job], worker=0) == []
    assert counts.complete_counts([], [job], worker=1) == (0, 1)
    assert [(j.job_id, j.ok) for j in objects.complete_many([], [job], worker=1)] == [(job, False)]
    assert snapshot(counts) == snapshot(objects)
    # All or nothing: a second report from a worker raises and changes nothing.
    before = snapshot(counts)
    with pytest.raises(KvOffloadError):
        counts.complete_counts([job], worker=1)
    assert snapshot(counts) == before


def test_num_pending_counts_the_pending_jobs() -> None:
    s = core()
    assert s.num_pending == 0
    hs = hashes(7, 8)
    for rid, blocks in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        assert s.lookup_request(rid, 16, hs if rid == "a" else hashes(8, 4), 0) == 0
        s.allocate(rid, [blocks], 0, 0)
    s.schedule_batch(["a", "b"], [0, 0], added={"a": 16, "b": 16}, written=list(range(1, 9)))
    assert s.num_pending == len(s.pending_jobs()) == 2
    s.complete(s.pending_jobs()[0])
    assert s.num_pending == len(s.pending_jobs()) == 1


class _CallsBackIn:
    """A hash whose conversion (``__index__``) runs ``call`` once first: a caller's object (or
    another thread) changing the request while the core converts the hash list unlocked."""

    def __init__(self, value: int, call: Any) -> None:
        self.value, self.call = value, call

    def __index__(self) -> int:
        call, self.call = self.call, None
        if call is not None:
            call()
        return self.value


@pytest.mark.parametrize("method", ["lookup_request", "sync_request"])
def test_hashes_appended_while_converting_land_once(method: str) -> None:
    """The hash list is converted from the count the core held; when that count changes during
    the conversion, the tail is taken again from the new count, never appended twice."""
    hs = [random.Random(f"h/{i}").getrandbits(63) for i in range(4)]
    s = core()
    # The CPU tier holds the first 3 chunks: a 4th hash appended twice would make the 4th block
    # look up the 3rd chunk's key (a hit of 16 tokens, serving the wrong chunk).
    stored(s, "a", [h.to_bytes(32, "big") for h in hs[:3]], [1, 2, 3])
    s.sync_request("r", 17, hs[:2])
    tail = [*hs[:3], _CallsBackIn(hs[3], lambda: s.extend_hashes("r", [hs[2]]))]
    if method == "lookup_request":
        assert s.lookup_request("r", 17, tail, 0) == 12
    else:
        s.sync_request("r", 17, tail)
        assert s.lookup("r", 0) == 12


def test_schedule_batch_converts_again_when_the_request_changed_meanwhile() -> None:
    """``schedule_batch`` reads the engine's hash list from the count the core held; a hash whose
    conversion extends the request meanwhile makes it convert again, so the stores go under the
    right keys and another request finds every chunk."""
    hs = [random.Random(f"b/{i}").getrandbits(63) for i in range(4)]
    s = core()
    s.sync_request("r", 16, hs[:2])
    assert s.lookup("r", 0) == 0
    s.allocate("r", [[1, 2, 3, 4]], 0, 0)
    lists = [*hs[:3], _CallsBackIn(hs[3], lambda: s.extend_hashes("r", [hs[2]]))]
    s.schedule_batch(["r"], [0], added={"r": 16}, hashes={"r": lists}, written=[1, 2, 3, 4])
    for j in s.pending_jobs():
        s.complete(j)
    assert s.lookup_request("c", 17, hs, 0) == 16


class _Bytes(bytes):
    """A ``bytes`` subclass: not the exact type the in-place fast path reads."""


def test_engine_hashes_of_every_form_key_the_same_chunks() -> None:
    """Exact ``bytes`` (read in place), a ``bytes`` subclass, short ``bytes`` and the 64-bit
    ints vLLM publishes name the same chunks, in a list or a tuple."""
    hs = hashes(9, 4)
    s = core()
    stored(s, "a", [int.from_bytes(h[-8:], "big") for h in hs], [1, 2, 3, 4])
    forms: dict[str, Any] = {
        "bytes": hs,
        "tuple": tuple(hs),
        "subclass": [_Bytes(h) for h in hs],
        "mixed": [hs[0], int.from_bytes(hs[1][-8:], "big"), _Bytes(hs[2]), hs[3]],
        "short": [h[-8:] for h in hs],
    }
    for name, form in forms.items():
        assert s.lookup_request(name, 17, form, 0) == 16, name
    # A hash shorter than 8 bytes is the int of its bytes: b"\x01\x02" is 0x0102.
    s2 = core()
    stored(s2, "a", [0x0102, 7], [1, 2])
    assert s2.lookup_request("b", 9, [b"\x01\x02", b"\x07"], 0) == 8


def test_a_hash_list_shrunk_while_converting_is_read_to_its_new_end() -> None:
    """The in-place read of the hash list re-reads its length after every item that ran Python:
    a list cleared by an item's conversion is read up to that item, nothing past its end."""
    hs = hashes(10, 4)
    s = core()
    stored(s, "a", hs, [1, 2, 3, 4])
    lst: list[Any] = [hs[0]]
    lst += [_CallsBackIn(int.from_bytes(hs[1][-8:], "big"), lst.clear), hs[2], hs[3]]
    s.sync_request("r", 17, lst)
    assert lst == []
    assert s.lookup("r", 0) == 8  # two hashes registered: h0 and h1


class _Block:
    """An engine's block object (vLLM's ``KVCacheBlock``): the core reads its ``block_id``."""

    def __init__(self, block_id: Any) -> None:
        self.block_id = block_id


def test_schedule_batch_reads_written_engine_blocks_as_their_ids() -> None:
    """``written`` of engine block objects fences what the same block ids fence (a pending
    store of a block re-used read-only by a prefix hit is flushed only when the block is
    written); a block object with a bad id raises naming it, nothing changed."""
    flushes = []
    for written in ([], [2], [_Block(2)]):
        s = core()
        ha = hashes(11, 4)
        assert s.lookup_request("a", 17, ha, 0) == 0
        s.allocate("a", [[1, 2, 3, 4, 5]], 0, 0)
        s.schedule_batch(["a"], [0], added={"a": 17}, written=[1, 2, 3, 4, 5])
        (store,) = s.pending_jobs()
        assert s.lookup_request("b", 9, ha[:2], 8) == 0
        s.allocate("b", [[1, 2, 6]], 8, 0)
        before = snapshot(s)
        with pytest.raises(InvalidBlockError, match=r"written\[1\]\.block_id"):
            s.schedule_batch(["b"], [8], added={"b": 1}, written=[_Block(2), _Block(-1)])
        assert snapshot(s) == before
        plan = s.schedule_batch(["b"], [8], added={"b": 1}, finished=["a"], written=written)
        flushes.append(plan[3])
    assert flushes == [[], [store], [store]]
