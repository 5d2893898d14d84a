"""``Scheduler.schedule_batch`` and ``sync_request``: the engine-shaped step (whole hash lists,
whole or appended block tables, a dict of scheduled tokens) and the compact plan (job ids and
one buffer of copy runs).

Two cores driven through the same random schedules, one with ``schedule`` and one with
``schedule_batch``, must plan the same jobs, the same flush sets and the same copies; bad input
raises a kvoffload error naming the value and leaves the core as it was.
"""

from __future__ import annotations

import random
import struct
import threading
from typing import Any

import pytest

from kvoffload._core import Scheduler
from kvoffload.errors import InvalidBlockError, InvalidKeyError, KvOffloadError, StepInputError

BS = 4
MASK64 = (1 << 64) - 1


def core(groups: int = 1, window: int | None = None, **kw: Any) -> Scheduler:
    specs = [(BS, None, 64)] + [(BS, window, 64)] * (groups - 1)
    return Scheduler(specs, num_gpu_blocks=256, cpu_chunks=kw.pop("cpu_chunks", 64), **kw)


def hashes(seed: int, n: int) -> list[bytes]:
    return [random.Random(f"{seed}/{i}").randbytes(32) for i in range(n)]


def engine_int(h: bytes) -> int:
    return int.from_bytes(h, "big") & MASK64


def decode(runs: bytes, jobs: list[int]) -> dict[int, list[tuple[int, list[int], list[int]]]]:
    """The runs buffer, expanded: job id -> (group, gpu blocks, cpu blocks) per group."""
    out: dict[int, list[tuple[int, list[int], list[int]]]] = {}
    for k, g, gpu, cpu, n in struct.iter_unpack("<5I", runs):
        groups = out.setdefault(jobs[k], [])
        if not groups or groups[-1][0] != g:
            groups.append((g, [], []))
        groups[-1][1].extend(range(gpu, gpu + n))
        groups[-1][2].extend(range(cpu, cpu + n))
    return out


def snapshot(s: Scheduler) -> tuple[Any, ...]:
    st = s.stats()
    return (st, s.pending_jobs(), s.num_requests, s.armed_pairs)


class Twin:
    """The same engine driven into two cores: ``a`` through ``schedule``, ``b`` through
    ``schedule_batch``."""

    def __init__(self, seed: int, groups: int = 1) -> None:
        self.rng = random.Random(seed)
        self.groups = groups
        self.a = core(groups, window=8)
        self.b = core(groups, window=8)
        self.free = list(range(1, 256))
        self.rng.shuffle(self.free)
        self.reqs: dict[str, dict[str, Any]] = {}
        self.lists: dict[str, list[bytes]] = {}
        self.synced: dict[str, int] = {}  # hashes core a holds
        self.stored = 0
        self.loaded = 0
        self.n = 0

    def add(self) -> None:
        rid = f"r{self.n}"
        self.n += 1
        prompt = self.rng.randrange(4, 40)
        hs = hashes(self.rng.randrange(3), prompt // BS)  # shared prefixes across requests
        self.a.add_request(rid, prompt, [engine_int(h) for h in hs])
        self.b.sync_request(rid, prompt, hs)
        self.lists[rid] = list(hs)
        self.synced[rid] = len(hs)
        self.reqs[rid] = {"prompt": prompt, "computed": 0, "tables": None, "tokens": prompt}

    def admit(self, rid: str) -> None:
        r = self.reqs[rid]
        got_a = self.a.lookup(rid, 0)
        got_b = self.b.lookup(rid, 0)
        assert got_a == got_b
        load = got_a or 0
        need = -(-max(r["prompt"], load + 1) // BS)
        if len(self.free) < need * self.groups:
            return
        tables = [[self.free.pop() for _ in range(need)] for _ in range(self.groups)]
        ja = self.a.allocate(rid, tables, 0, load)
        jb = self.b.allocate(rid, tables, 0, load)
        assert ja == jb
        r["tables"] = tables
        r["computed"] = load
        r["written"] = [b for t in tables for b in t]

    def disorder(
        self, ids: list[str], before: list[int], added: dict[str, int], finished: list[str]
    ) -> tuple[list[int], dict[str, int]]:
        """``added`` as an engine other than vLLM may give it: in another order than ``ids``,
        keyed by equal strings that are other objects, with ids of requests not scheduled, or
        lacking some ids (their tokens counted in ``before`` instead). The step must not
        change."""
        rng = self.rng
        before = list(before)
        items = list(added.items())
        if rng.random() < 0.3:
            rng.shuffle(items)
        out: dict[str, int] = {}
        for k, (rid, n) in enumerate(items):
            if rng.random() < 0.1:
                before[ids.index(rid)] += n  # absent from the dict
                continue
            if rng.random() < 0.2:
                rid = fresh(rid)  # an equal id, another object
            out[rid] = n
            if rng.random() < 0.1:
                out[f"unscheduled-{k}"] = rng.randrange(1, 9)
            if finished and rng.random() < 0.1:
                out[rng.choice(finished)] = rng.randrange(1, 9)
        return before, out

    def step(self) -> None:
        running = [rid for rid, r in self.reqs.items() if r["tables"] is not None]
        finished = [
            rid
            for rid in running
            if self.reqs[rid]["computed"] >= self.reqs[rid]["prompt"] and self.rng.random() < 0.2
        ]
        ids, before, added, appended, new_blocks, written = [], [], {}, [], [], []
        written_b = []  # blocks allocated beyond the hit count as written without being listed
        for rid in running:
            r = self.reqs[rid]
            got = r.pop("written", [])
            written += got
            if self.rng.random() < 0.3:
                written_b += got  # listing them anyway changes nothing

            if rid in finished:
                continue
            n = min(r["tokens"] - r["computed"], self.rng.randrange(1, 12))
            if n <= 0:  # decode one token
                r["tokens"] += 1
                n = 1
            end = r["computed"] + n
            need = -(-end // BS) - len(r["tables"][0])
            app = None
            if need > 0:
                if len(self.free) < need * self.groups:
                    continue
                app = [[self.free.pop() for _ in range(need)] for _ in range(self.groups)]
                for g, blocks in enumerate(app):
                    r["tables"][g] += blocks
                    new_blocks.append((rid, g, blocks))
            ids.append(rid)
            before.append(r["computed"])
            added[rid] = n
            appended.append(app)
            r["computed"] = end
            while len(self.lists[rid]) < end // BS:
                self.lists[rid].append(random.Random(f"{rid}/{end}").randbytes(32))
        for rid in ids + finished:  # the facade path sends the new hashes itself
            hs = self.lists[rid]
            self.a.extend_hashes(rid, [engine_int(h) for h in hs[self.synced[rid] :]])
            self.synced[rid] = len(hs)
        fresh = [b for _, _, blocks in new_blocks for b in blocks]
        plan = self.a.schedule(
            ids,
            [c + added[r] for r, c in zip(ids, before, strict=True)],
            new_blocks,
            None,
            finished,
            None,
            None,
            written + fresh,
        )
        before_b, added_b = self.disorder(ids, before, added, finished)
        loads, load_reqs, stores, flush, runs, _tiers, _tier_flush = self.b.schedule_batch(
            ids,
            before_b,
            added=added_b,
            appended=appended,
            hashes=self.lists,
            finished=finished,
            written=written_b,
        )
        assert loads == [j.job_id for j in plan.loads]
        assert load_reqs == [j.request_id for j in plan.loads]
        assert stores == [j.job_id for j in plan.stores]
        assert flush == list(plan.flush)
        want = {
            j.job_id: [(g, list(gb), list(cb)) for g, gb, cb in j.transfers]
            for j in [*plan.loads, *plan.stores]
        }
        assert decode(runs, loads + stores) == {j: t for j, t in want.items() if t}
        self.stored += len(stores)
        self.loaded += len(loads)
        for rid in finished:
            r = self.reqs.pop(rid)
            self.free += [b for t in r["tables"] for b in t]
            del self.lists[rid]
        for job in loads + stores:
            assert (self.a.complete(job) is None) == (self.b.complete(job) is None)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("groups", [1, 2])
def test_schedule_batch_plans_what_schedule_plans(seed: int, groups: int) -> None:
    t = Twin(seed, groups)
    for _ in range(60):
        if t.rng.random() < 0.5:
            t.add()
        for rid, r in list(t.reqs.items()):
            if r["tables"] is None and t.rng.random() < 0.5:
                t.admit(rid)
        t.step()
    # Both kinds in the runs: the loads' rows come first, the stores' are written as planned.
    assert t.stored > 0
    assert t.loaded > 0
    assert snapshot(t.a) == snapshot(t.b)


def test_sync_request_keys_are_the_engine_ints_and_only_the_tail_is_read() -> None:
    s = core(cpu_chunks=8)
    hs = hashes(1, 3)
    s.sync_request("a", 12, hs)
    s.set_event_limit(1000)
    s.allocate("a", [[1, 2, 3]], 0, 0)
    s.schedule_batch(["a"], [0], added={"a": 12}, written=[1, 2, 3])
    (job,) = s.pending_jobs()
    s.complete(job)
    (kind, group, keys, medium) = s.take_events()[0]
    assert (kind, group, medium) == ("stored", 0, "cpu")
    assert keys == [engine_int(h) for h in hs]
    # The core holds three hashes: earlier items but the last held one (checked) are not read.
    s.sync_request("a", 12, [None, None, hs[2], hashes(2, 1)[0]])
    before = snapshot(s)
    with pytest.raises(InvalidKeyError, match=r"block_hashes\[5\]"):
        s.sync_request("a", 12, [*hs, hashes(2, 1)[0], b"x" * 32, "not a hash"])
    assert snapshot(s) == before


def test_tables_append_only_what_the_core_lacks() -> None:
    s = core()
    hs = hashes(1, 4)
    lists = {"a": hs[:3]}
    s.sync_request("a", 12, lists["a"])
    s.allocate("a", [[5, 6]], 0, 0)
    # vLLM's scheduler output repeats the whole table, grown by one block: the store reads it.
    plan = s.schedule_batch(
        ["a"], [0], added={"a": 12}, tables=[("a", [[5, 6, 7]])], hashes=lists, written=[5, 6]
    )
    loads, _, stores, _, runs, _, _ = plan
    assert decode(runs, loads + stores) == {stores[0]: [(0, [5, 6, 7], [0, 1, 2])]}
    # The same whole table again: nothing is appended (a fourth position would be stored).
    lists["a"] = hs
    plan = s.schedule_batch(["a"], [12], added={"a": 4}, tables=[("a", [[5, 6, 7]])], hashes=lists)
    assert plan[2] == []
    assert plan[4] == b""


def test_new_requests_step_as_scheduled_ones_with_whole_tables() -> None:
    """``new=[(id, computed, tables)]`` plans what the same requests listed first in
    ``scheduled`` with their tables in ``tables`` plan: two cores, the same three steps."""
    cores = [core(2, window=8, cpu_chunks=64) for _ in range(2)]
    lists = {"a": hashes(1, 4), "b": hashes(2, 6)}
    for s in cores:
        s.sync_request("a", 16, lists["a"])
        s.allocate("a", [[1, 2, 3, 4], [11, 12, 13, 14]], 0, 0)
        s.sync_request("b", 24, lists["b"])
        # Allocated short (as before an asynchronous load's second allocation): the new
        # request's whole tables bring the rest.
        s.allocate("b", [[5, 6], [15, 16]], 0, 0)
    b_tables = [[5, 6, 7, 8, 9, 10], [15, 16, 17, 18, 19, 20]]
    plans = []
    for k, s in enumerate(cores):
        if k == 0:
            first = s.schedule_batch(
                ["a"],
                [0],
                new=[("b", 0, b_tables)],
                added={"a": 16, "b": 24},
                appended=[None],
                hashes=lists,
                written=[],
            )
        else:
            first = s.schedule_batch(
                ["b", "a"],
                [0, 0],
                added={"a": 16, "b": 24},
                appended=[None, None],
                tables=[("b", b_tables)],
                hashes=lists,
                written=[],
            )
        second = s.schedule_batch(
            ["a", "b"],
            [16, 24],
            added={"a": 1, "b": 1},
            appended=[None, [[21], [22]]],
            hashes=lists,
            written=[],
        )
        plans.append((first, second, s.stats(), s.pending_jobs()))
    assert plans[0] == plans[1]
    (loads, _, stores, _, runs, _, _), *_ = plans[0]
    gpu = sorted(b for ts in decode(runs, loads + stores).values() for _, bs, _ in ts for b in bs)
    # Every full chunk of both requests, the ones of b's tables beyond its allocation included.
    assert gpu == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"added": [1]}, StepInputError, "added must be a dict"),
        ({"hashes": "a"}, StepInputError, "hashes must be a dict"),
        ({"appended": [None, None]}, StepInputError, "1 scheduled request ids but 2 appended"),
        ({"appended": [[[3, -1]]]}, InvalidBlockError, r"appended\[0\]\[0\]\[1\]"),
        ({"appended": [[["x"]]]}, InvalidBlockError, "must be an integer"),
        ({"added": {"a": -4}}, StepInputError, "added"),
        ({"added": {"a": 2**32 - 1}}, StepInputError, "overflows"),
        ({"tables": [("a",)]}, StepInputError, r"tables\[0\]"),
        ({"tables": [(7, [[1]])]}, KvOffloadError, r"tables\[0\]\[0\]"),
        ({"written": [1, "b"]}, InvalidBlockError, r"written\[1\]"),
        ({"new": 5}, StepInputError, "new must be a sequence"),
        ({"new": [("b", 0)]}, StepInputError, r"new\[0\] must be a \(request_id"),
        ({"new": [(7, 0, [[1]])]}, KvOffloadError, r"new\[0\]\[0\]"),
        ({"new": [("b", -1, [[3]])]}, StepInputError, r"new\[0\]\[1\]"),
        ({"new": [("b", 2**32 - 4, [[3]])]}, StepInputError, r"new\[0\]\[1\] \+ added"),
        ({"new": [("b", 0, 3)]}, StepInputError, r"new\[0\]\[2\] must be a sequence"),
        ({"new": [("b", 0, [[3, "x"]])]}, InvalidBlockError, r"new\[0\]\[2\]\[0\]\[1\]"),
        ({"new": [("b", 0, [[3]])]}, KvOffloadError, "b"),  # not registered
        ({"new": [("a", 0, [[1, 2]])]}, KvOffloadError, "a"),  # also in `scheduled`
        ({"hashes": {"a": [None] * 5}}, InvalidKeyError, r"hashes\[a\]\[2\]"),
    ],
)
def test_bad_batch_input_raises_and_changes_nothing(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    s = core()
    s.sync_request("a", 8, hashes(1, 2))
    s.allocate("a", [[1, 2]], 0, 0)
    before = snapshot(s)
    with pytest.raises(error, match=match):
        s.schedule_batch(["a"], [4], **{"added": {"a": 8, "b": 4}, **kwargs})
    assert snapshot(s) == before
    with pytest.raises(StepInputError, match="2 computed-token counts"):
        s.schedule_batch(["a"], [4, 4])
    assert snapshot(s) == before


def feed(s: Scheduler, call: str, arg: Any) -> None:
    """Request "a" (8 tokens, 2 hashes, 2 blocks) stepped by 8 tokens with `arg` added to the
    step's arguments, or allocated `arg` again."""
    if call == "batch":
        s.schedule_batch(["a"], [4], **{"added": {"a": 8}, **arg})
    else:
        s.allocate("a", arg, 0, 0)


@pytest.mark.parametrize(
    ("call", "arg", "error", "message"),
    [
        (
            "batch",
            {"appended": [5]},
            StepInputError,
            "appended[0] must be a sequence of block id lists, one per group, got 5 (int)",
        ),
        (
            "batch",
            {"appended": [[[1], [2, None]]]},
            InvalidBlockError,
            "appended[0][1][1] must be an integer, got None (NoneType)",
        ),
        (
            # vLLM's shape: a tuple of per-group lists (read in place).
            "batch",
            {"appended": [([1], [2, None])]},
            InvalidBlockError,
            "appended[0][1][1] must be an integer, got None (NoneType)",
        ),
        (
            "batch",
            {"tables": [("a", 3)]},
            StepInputError,
            "tables[0][1] must be a sequence of block id lists, one per group, got 3 (int)",
        ),
        (
            "batch",
            {"tables": [("a", [[1, 2, "x"]])]},
            InvalidBlockError,
            # Position 2 of the caller's list ("a" holds two blocks: only the third is read).
            "tables[0][1][0][2] must be an integer, got 'x' (str)",
        ),
        (
            "batch",
            {"tables": [("a", [(1, 2, 3, "x")])]},
            InvalidBlockError,
            "tables[0][1][0][3] must be an integer, got 'x' (str)",
        ),
        (
            "batch",
            {"hashes": {"a": [*hashes(1, 2), 1.5]}},
            InvalidKeyError,
            "hashes[a][2] must be an int or bytes, got 1.5 (float)",
        ),
        # Not sequences where a block list or a hash list belongs (these raised a bare
        # TypeError from len()).
        (
            "batch",
            {"appended": [[7]]},
            InvalidBlockError,
            "appended[0][0] must be a sequence of integers, got 7 (int)",
        ),
        (
            "batch",
            {"tables": [("a", [[1, 2], 4])]},
            InvalidBlockError,
            "tables[0][1][1] must be a sequence of integers, got 4 (int)",
        ),
        (
            "batch",
            {"hashes": {"a": 7}},
            InvalidKeyError,
            "hashes[a] must be a list or tuple of hashes (bytes or int), got 7 (int)",
        ),
        (
            "allocate",
            3,
            InvalidBlockError,
            "block_ids must be a sequence of block id lists, one per group, got 3 (int)",
        ),
        (
            "allocate",
            [[1, "x"]],
            InvalidBlockError,
            "block_ids[0][1] must be an integer, got 'x' (str)",
        ),
        (
            "allocate",
            [[1], 5],
            InvalidBlockError,
            "block_ids[1] must be a sequence of integers, got 5 (int)",
        ),
    ],
)
def test_a_bad_nested_value_is_named_by_its_whole_path(
    call: str, arg: Any, error: type[Exception], message: str
) -> None:
    # The names are rendered only for an error (none is formatted on the hot path): the whole
    # message, path and value, as it was when they were formatted eagerly.
    s = core()
    s.sync_request("a", 8, hashes(1, 2))
    s.allocate("a", [[1, 2]], 0, 0)
    before = snapshot(s)
    with pytest.raises(error) as raised:
        feed(s, call, arg)
    assert str(raised.value) == message
    assert snapshot(s) == before


class Block:
    """An engine's block object, as vLLM's ``KVCacheBlock`` carries its id."""

    def __init__(self, block_id: object) -> None:
        self.block_id = block_id


def test_allocate_reads_the_engine_block_objects() -> None:
    a, b = core(cpu_chunks=8), core(cpu_chunks=8)
    for s in (a, b):
        s.sync_request("a", 12, hashes(1, 3))
    a.allocate("a", [[1, 2, 3]], 0, 0)
    b.allocate("a", [[Block(1), Block(2), 3]], 0, 0)  # objects and ints may mix
    pa = a.schedule_batch(["a"], [0], added={"a": 12}, written=[])
    pb = b.schedule_batch(["a"], [0], added={"a": 12}, written=[])
    assert pa == pb
    assert decode(pa[4], pa[0] + pa[2]) == {pa[2][0]: [(0, [1, 2, 3], [0, 1, 2])]}
    c = core()
    c.sync_request("a", 12, hashes(1, 3))
    before = snapshot(c)
    with pytest.raises(InvalidBlockError, match=r"block_ids\[0\]\[1\]\.block_id must be in"):
        c.allocate("a", [[Block(1), Block(-1)]], 0, 0)
    with pytest.raises(InvalidBlockError, match=r"block_ids\[0\]\[0\] must be an integer"):
        c.allocate("a", [[object()]], 0, 0)
    assert snapshot(c) == before


def test_blocks_allocated_beyond_the_hit_are_written_without_being_listed() -> None:
    s = core(cpu_chunks=8)
    s.sync_request("a", 8, hashes(1, 2))
    s.allocate("a", [[1, 2]], 0, 0)
    (_, _, (store,), *_) = s.schedule_batch(["a"], [0], added={"a": 8}, written=[])
    # "a" finishes with its store pending; "b" gets block 2 beyond its (empty) prefix hit: the
    # store must be flushed before "b" writes it, though the adapter lists nothing as written.
    s.sync_request("b", 8, hashes(2, 2))
    s.schedule_batch([], [], finished=["a"], written=[])
    s.allocate("b", [[2, 3]], 0, 0)
    flush = s.schedule_batch(["b"], [0], added={"b": 8}, written=[])[3]
    assert flush == [store]


def test_a_bad_hash_tail_appends_no_other_request_s_tail() -> None:
    s = core(cpu_chunks=16)
    ha, hb = hashes(1, 3), hashes(2, 3)
    s.sync_request("a", 12, ha[:2])
    s.sync_request("b", 12, hb[:2])
    s.allocate("a", [[1, 2, 3]], 0, 0)
    s.allocate("b", [[4, 5, 6]], 0, 0)
    before = snapshot(s)
    # a's tail converts fine, b's last hash does not: neither tail is appended.
    with pytest.raises(InvalidKeyError, match=r"hashes\[b\]\[2\]"):
        s.schedule_batch(
            ["a", "b"], [0, 0], added={"a": 12, "b": 12}, hashes={"a": ha, "b": [*hb[:2], "x"]}
        )
    assert snapshot(s) == before
    # The same step without hashes: each request stores the two chunks it has hashes for.
    loads, _, stores, _, runs, _, _ = s.schedule_batch(
        ["a", "b"], [0, 0], added={"a": 12, "b": 12}, written=[]
    )
    assert decode(runs, loads + stores) == {
        stores[0]: [(0, [1, 2], [0, 1])],
        stores[1]: [(0, [4, 5], [2, 3])],
    }


def test_a_request_both_scheduled_and_finished_fails_the_step_and_gets_its_tail_once() -> None:
    s = core(cpu_chunks=16)
    ha = hashes(1, 3)
    s.sync_request("a", 20, ha[:1])
    s.allocate("a", [[1, 2, 3, 4, 5]], 0, 0)
    with pytest.raises(KvOffloadError, match="scheduled and released"):
        s.schedule_batch(["a"], [0], added={"a": 20}, hashes={"a": ha}, finished=["a"])
    # The tail (a fact of the engine) was appended once: the core holds three hashes, so the
    # engine's list grown to five appends the last two and all five chunks are stored. Appended
    # twice, the core would hold five (the last two repeating the second and third) and take
    # nothing from the grown list: only three distinct chunks.
    _, _, stores, _, runs, _, _ = s.schedule_batch(
        ["a"], [0], added={"a": 20}, hashes={"a": hashes(1, 5)}, written=[]
    )
    assert decode(runs, stores) == {stores[0]: [(0, [1, 2, 3, 4, 5], [0, 1, 2, 3, 4])]}


# The binding resolves the scheduled ids by object identity (rust/py/scheduler/ids.rs): the
# previous step's id objects, held, with their handles. These steps try to make it wrong.


def fresh(text: str) -> str:
    """A new ``str`` object equal to ``text`` (never an interned one)."""
    return "".join([text[:1], text[1:]])


def two_requests(s: Scheduler) -> tuple[str, str]:
    """Registers ``req-a`` (blocks 1, 2) and ``req-b`` (blocks 3, 4), 8-token prompts."""
    a, b = fresh("req-a"), fresh("req-b")
    for k, rid in enumerate((a, b)):
        s.sync_request(rid, 8, hashes(k, 2))
        s.allocate(rid, [[1 + 2 * k, 2 + 2 * k]], 0, 0)
    return a, b


def stored(s: Scheduler, ids: list[str], added: dict[str, int]) -> list[list[int]]:
    """One step of ``ids`` (``added``: their tokens after it): the GPU blocks each store reads."""
    _, _, stores, _, runs, _, _ = s.schedule_batch(ids, [0] * len(ids), added=added, written=[])
    return sorted(gpu for ts in decode(runs, stores).values() for _, gpu, _ in ts)


def test_an_equal_id_as_another_object_or_a_str_subclass_names_the_same_request() -> None:
    class Rid(str):
        __slots__ = ()

    s = core(cpu_chunks=16)
    a, b = two_requests(s)
    assert stored(s, [a, b], {a: 4, b: 4}) == [[1], [3]]  # both now kept by the cache
    a2, b2 = Rid(fresh(a)), fresh(b)
    assert a2 is not a
    assert b2 is not b
    # New objects in swapped order: each id still names its own request (its second chunk).
    assert stored(s, [b2, a2], {b2: 8, a2: 8}) == [[2], [4]]
    before = snapshot(s)
    with pytest.raises(KvOffloadError, match=r"req-a.*scheduled twice"):
        s.schedule_batch([a2, Rid(a)], [8, 8], written=[])
    assert snapshot(s) == before


def test_an_id_released_and_registered_again_between_steps_is_the_new_request() -> None:
    s = core(cpu_chunks=16)
    a, b = two_requests(s)
    assert stored(s, [a], {a: 8}) == [[1, 2]]  # the cache keeps a's object with its handle
    # Released through the plain step, its store completed, dropped, and registered again
    # under the same object: a new request (new owner) that may reuse the old slab index.
    s.schedule([], [], None, None, [a], None, None, [])
    for job in s.pending_jobs():
        s.complete(job)
    with pytest.raises(KvOffloadError, match="req-a"):
        s.status(a)
    s.sync_request(a, 12, hashes(7, 3))
    s.allocate(a, [[9, 10, 11]], 0, 0)
    assert stored(s, [a, b], {a: 12, b: 4}) == [[3], [9, 10, 11]]
    # And unknown again: the kept handle is stale, the id lookup fails naming it.
    s.schedule([], [], None, None, [a], None, None, [])
    for job in s.pending_jobs():
        s.complete(job)
    before = snapshot(s)
    with pytest.raises(KvOffloadError, match="req-a"):
        s.schedule_batch([b, a], [4, 12], written=[])
    assert snapshot(s) == before


def test_a_kept_id_object_is_held_so_no_other_id_takes_its_address() -> None:
    s = core(cpu_chunks=16)
    a, _ = two_requests(s)
    addr = id(a)
    assert stored(s, [a], {a: 4}) == [[1]]
    del a  # the cache holds the only reference left
    same_size = [fresh("req-b") for _ in range(2000)]
    assert addr not in {id(x) for x in same_size}
    b = same_size[-1]
    assert stored(s, [b], {b: 4}) == [[3]]
    # Once a step no longer schedules it, the object is freed: an object at its address now
    # is whatever id it holds.
    s.schedule_batch([], [], written=[])
    del same_size, b
    reused = [fresh("req-b") for _ in range(2000)]
    b = next((x for x in reused if id(x) == addr), reused[-1])
    assert stored(s, [b], {b: 8}) == [[4]]


def kept_pair() -> tuple[Scheduler, str, str]:
    """A core with ``two_requests`` after one step of both: their ids kept by the binding, their
    first chunks stored."""
    s = core(cpu_chunks=16)
    a, b = two_requests(s)
    assert stored(s, [a, b], {a: 4, b: 4}) == [[1], [3]]
    return s, a, b


def test_a_kept_id_named_twice_in_one_step_fails_and_the_next_step_still_resolves() -> None:
    s, a, b = kept_pair()
    before = snapshot(s)
    # The first `a` takes the kept entry; the second must be resolved by its id and refused.
    with pytest.raises(KvOffloadError, match=r"req-a.*scheduled twice"):
        s.schedule_batch([a, b, a], [4, 4, 4], written=[])
    assert snapshot(s) == before
    assert stored(s, [a, b], {a: 8, b: 8}) == [[2], [4]]


def test_a_step_refused_after_its_ids_were_matched_changes_nothing() -> None:
    s, a, b = kept_pair()
    before = snapshot(s)
    with pytest.raises(StepInputError, match=r"computed\[1\]"):
        s.schedule_batch([a, b], [4, "x"], written=[])
    with pytest.raises(StepInputError, match=r'added\["req-b"\]'):
        s.schedule_batch([a, b], [4, 4], added={b: -1}, written=[])
    with pytest.raises(KvOffloadError, match=r"scheduled\[1\]"):
        s.schedule_batch([a, 7], [4, 4], written=[])
    assert snapshot(s) == before
    assert stored(s, [b, a], {a: 8, b: 8}) == [[2], [4]]


def test_ids_given_as_a_generator_plan_as_a_list_does() -> None:
    s, a, b = kept_pair()
    _, _, stores, _, runs, _, _ = s.schedule_batch(
        (x for x in [a, b]), [0, 0], added={a: 8, b: 8}, written=[]
    )
    assert sorted(gpu for ts in decode(runs, stores).values() for _, gpu, _ in ts) == [[2], [4]]


def test_a_kept_id_whose_finalizer_calls_back_in_is_dropped_with_no_lock_held() -> None:
    s = core(cpu_chunks=16)
    calls: list[int] = []

    class Rid(str):
        def __del__(self) -> None:
            calls.append(s.num_requests)
            s.schedule_batch([], [], written=[])  # a whole step from inside the drop

    a = Rid("req-a")
    s.sync_request(a, 8, hashes(0, 2))
    s.allocate(a, [[1, 2]], 0, 0)
    b = fresh("req-b")
    s.sync_request(b, 8, hashes(1, 2))
    s.allocate(b, [[3, 4]], 0, 0)
    assert stored(s, [a, b], {a: 4, b: 4}) == [[1], [3]]
    del a  # the binding's kept ids hold the last reference

    def step() -> None:
        # `a` is no longer scheduled: its kept id is dropped by this step.
        stored(s, [b], {b: 8})

    t = threading.Thread(target=step, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the step deadlocked in the finalizer's call"
    assert calls == [2]
    assert s.pending_jobs()  # both steps' stores are there
