"""Eleven rules of the scheduler's fence and bookkeeping, each on its minimal public-API setup
(4-token blocks, block 0 is the null block): a reset never plans a load it cancelled; a chunk
whose blocks are reused in the step its request finishes is still stored; a load is never in its
own step's flush set; a partly filled block reported written loses nothing; lookups refresh the
chunks the GPU cache serves; a sliding window needs only its rightmost window; an aborted
request is forgotten when its load completes; no pool lookup below a chunk; a duplicated report
never completes a job; a failed load's chunks are stored again; and a step, an allocation or a
batch of reports that breaks a rule is refused whole, nothing changed. A comment at each
assertion says what a wrong scheduler would do there.
"""

from __future__ import annotations

import pytest

from kvoffload.errors import (
    CompletionError,
    DuplicateReportError,
    RequestStateError,
    UnknownJobError,
)
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput

BS = 4


def make(window: int | None = None, *, fa: bool = True, **kw) -> OffloadScheduler:
    groups: tuple[KvGroup, ...] = (KvGroup(BS),) if fa else ()
    if window:
        groups += (KvGroup(BS, sliding_window=window),)
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("cpu_chunks", 16)
    return OffloadScheduler(OffloadConfig(groups=groups, **kw))


def blocks_of(jobs) -> list[list[int]]:
    return [[b for _, gpu, _ in j.transfers for b in gpu] for j in jobs]


def finish_all(s: OffloadScheduler, jobs) -> None:
    for j in jobs:
        for w in range(s.config.num_workers):
            s.complete(j.job_id, worker=w)


def store_prefix(s: OffloadScheduler, rid: str, tables, hashes, tokens: int) -> None:
    """Request ``rid`` computes ``tokens`` tokens, stores them, finishes; its jobs complete."""
    s.add_request(rid, tokens + 1, hashes)
    assert s.lookup(rid, 0) == 0
    s.allocate(rid, tables, 0, 0)
    plan = s.schedule(StepInput(scheduled=[(rid, tokens)]))
    finish_all(s, plan.stores)
    plan = s.schedule(StepInput(finished=[rid], written=[]))
    finish_all(s, plan.stores)


def loading_b(s: OffloadScheduler) -> int:
    """Request "b" loads the 8-token prefix "a" stored into blocks 5, 6 (block 7 computes);
    the load's step is planned. Returns the load job."""
    store_prefix(s, "a", [[1, 2]], [11, 12], 8)
    s.add_request("b", 9, [11, 12])
    n = s.lookup("b", 0)
    assert n == 8
    load = s.allocate("b", [[5, 6, 7]], 0, n)
    assert load is not None
    s.schedule(StepInput(written=[5, 6, 7]))
    return load


def test_reset_never_plans_a_load_it_cancelled():
    s = make()
    store_prefix(s, "a", [[1, 2]], [11, 12], 8)
    s.add_request("b", 9, [11, 12])
    n = s.lookup("b", 0)
    assert n == 8
    load = s.allocate("b", [[5, 6, 7]], 0, n)
    res = s.reset()
    assert ("b", load) in res.cancelled_loads
    # Never handed to a worker: not in the flush set either (a worker would not know it).
    assert load not in res.flushed
    s.add_request("c", 9, [31, 32])
    assert s.lookup("c", 0) == 0
    s.allocate("c", [[8, 9, 10]], 0, 0)
    plan = s.schedule(StepInput(scheduled=[("b", 8), ("c", 8)], written=[8, 9, 10]))
    # Planning it would read slots this plan gives to new stores.
    assert [j.job_id for j in plan.loads] == []
    assert load not in plan.flush


@pytest.mark.parametrize("window", [None, 8])
def test_finish_and_block_reuse_in_one_step_stores_the_last_chunk(window):
    s = make(window)
    groups = 2 if window else 1
    a_blocks = [[1], [2]][:groups]
    s.add_request("a", 3, [])
    assert s.lookup("a", 0) == 0
    s.allocate("a", a_blocks, 0, 0)
    s.schedule(StepInput(scheduled=[("a", 3)], written=[1, 2][:groups]))
    p = s.schedule(StepInput(scheduled=[("a", 4)], written=[1, 2][:groups]))
    assert p.stores == []  # the 4th token's hash is not known yet
    s.extend_hashes("a", [77])
    # a finishes; its blocks go to b, which writes them in this very step.
    s.add_request("b", 5, [88])
    assert s.lookup("b", 0) == 0
    s.allocate("b", [[1], [2]][:groups], 0, 0)
    p = s.schedule(StepInput(finished=["a"], scheduled=[("b", 4)], written=[1, 2][:groups]))
    # Not dropped (chunks_dropped=1, no store): stored from the finished request's blocks.
    (store,) = [j for j in p.stores if j.request_id == "a"]
    assert blocks_of([store]) == [[1, 2][:groups]]
    assert store.job_id in p.flush  # it copies before b's forward pass
    assert s.stats()["chunks_dropped"] == 0


def test_a_load_is_never_in_the_flush_set_of_its_own_step():
    s = make(window=8)
    store_prefix(s, "a", [[1, 2, 3, 4], [5, 6, 7, 8]], [11, 12, 13, 14], 12)
    s.add_request("b", 13, [11, 12, 13])
    n = s.lookup("b", 0)
    assert n == 12
    load = s.allocate("b", [[21, 22, 23, 24], [0, 26, 27, 28]], 0, n)
    p = s.schedule(StepInput(scheduled=[("b", 12)], written=[21, 22, 23, 26, 27]))
    dest = blocks_of(p.loads)[0]
    assert p.loads[0].job_id == load
    assert set(dest) <= {21, 22, 23, 26, 27}
    # Not [load]: its eager window pairs are armed when it is planned, not at creation.
    assert p.flush == []


def test_reporting_a_partly_filled_block_as_written_loses_nothing():
    s = make()
    s.add_request("a", 10, [11, 12])
    assert s.lookup("a", 0) == 0
    s.allocate("a", [[1, 2, 3]], 0, 0)
    p1 = s.schedule(StepInput(scheduled=[("a", 6)], written=[1, 2]))
    p2 = s.schedule(StepInput(scheduled=[("a", 8)], written=[2]))
    # Chunk 1 is stored once its last block is written, not dropped.
    assert blocks_of(p1.stores) + blocks_of(p2.stores) == [[1], [2]]
    assert s.stats()["chunks_dropped"] == 0


@pytest.mark.parametrize("window", [None, 8])
def test_any_superset_of_written_costs_flushes_never_chunks(window):
    """Every allocated and every unrelated block reported written: the same chunks are stored."""

    def run(superset: bool) -> tuple[list[list[int]], int]:
        s = make(window)
        g = 2 if window else 1
        tables = [[1, 2, 3, 4], [5, 6, 7, 8]][:g]
        everything = list(range(1, 64)) if superset else None
        s.add_request("a", 16, [11, 12, 13, 14])
        s.lookup("a", 0)
        s.allocate("a", tables, 0, 0)
        stored = []
        for t in (3, 6, 9, 12, 15):
            p = s.schedule(StepInput(scheduled=[("a", t)], written=everything or []))
            stored += blocks_of(p.stores)
            finish_all(s, p.stores)
        return stored, s.stats()["chunks_dropped"]

    superset = run(True)
    assert superset == run(False)
    assert superset[1] == 0


def test_a_lookup_refreshes_chunks_the_gpu_cache_serves():
    s = make(cpu_chunks=2)
    store_prefix(s, "a", [[1]], [501], 4)
    store_prefix(s, "b", [[2]], [502], 4)
    # c's prefix 501 is a GPU prefix hit: the lookup must still make 501 the most recent.
    s.add_request("c", 5, [501])
    assert s.lookup("c", 4) == 0
    store_prefix(s, "d", [[3]], [503], 4)  # one slot must go: the least recent
    s.add_request("e", 5, [501])
    # 502 is the least recent and goes; 501, refreshed by the lookup, stays.
    assert s.lookup("e", 0) == 4
    s.add_request("f", 5, [502])
    assert s.lookup("f", 0) == 0


def test_sliding_window_lookup_needs_only_the_rightmost_window():
    s = make(window=8, fa=False, cpu_chunks=8)
    # Chunks 2 and 3 of z's prompt are ready ...
    s.add_request("x", 17, [800, 801, 902, 903])
    s.lookup("x", 0)
    s.allocate("x", [[1, 2, 3, 4, 5]], 0, 0)
    finish_all(s, s.schedule(StepInput(scheduled=[("x", 16)], written=[])).stores)
    # ... chunk 0 is being stored, chunk 1 is absent.
    s.add_request("y", 5, [900])
    s.lookup("y", 0)
    s.allocate("y", [[6, 7]], 0, 0)
    (pending,) = s.schedule(StepInput(scheduled=[("y", 4)], written=[])).stores
    assert pending.keys == [(0, [900])]
    s.add_request("z", 17, [900, 901, 902, 903])
    # The window of 8 tokens before token 16 is chunks 2-3: a hit, not None ("ask later").
    assert s.lookup("z", 0) == 16


def test_an_aborted_loading_request_is_dropped_when_its_load_completes():
    s = make()
    load = loading_b(s)
    s.schedule(StepInput(aborted=["b"], written=[]))
    assert s.status("b") == "aborted"
    done = s.complete(load)
    assert done is not None
    assert done.request_id == "b"
    # Forgotten at once, not tracked as "aborted" until the next schedule().
    assert s.num_requests == 0


def test_no_pool_lookup_when_less_than_a_chunk_lies_beyond_the_hit():
    s = make(blocks_per_chunk=2)
    s.add_request("a", 13, [11, 12, 13])
    # The engine's hit is 4 tokens; a chunk is 8: tokens 4..12 hold no complete chunk beyond.
    before = s.stats()["pools"][0]
    assert s.lookup("a", 4) == 0
    after = s.stats()["pools"][0]
    # Not asked: no miss counted, nothing fed to the reuse filter.
    assert after["misses"] == before["misses"]
    assert after["hits"] == before["hits"]


def test_a_duplicated_worker_report_never_completes_a_store():
    s = make(num_workers=2)
    s.add_request("a", 5, [11])
    s.lookup("a", 0)
    s.allocate("a", [[1, 2]], 0, 0)
    (store,) = s.schedule(StepInput(scheduled=[("a", 4)], written=[1])).stores
    assert s.complete(store.job_id, worker=0) is None
    # A second report from worker 0 must not complete the store while worker 1 still copies.
    with pytest.raises(DuplicateReportError, match=f"job {store.job_id}: worker 0"):
        s.complete(store.job_id, worker=0)
    assert s.pending_jobs() == [store.job_id]
    s.add_request("b", 5, [11])
    assert s.lookup("b", 0) is None  # still being stored: not readable
    with pytest.raises(CompletionError, match="worker rank 2 is out of range"):
        s.complete(store.job_id, worker=2)
    assert s.complete(store.job_id, worker=1).job_id == store.job_id
    assert s.lookup("b", 0) == 4


def test_a_failed_loads_chunks_are_stored_again_once_recomputed():
    s = make()
    load = loading_b(s)
    done = s.complete(load, ok=False)
    assert done.invalid_blocks == [5, 6]
    # The failed load's chunks were dropped from the CPU tier; b recomputes them.
    p = s.schedule(StepInput(scheduled=[("b", 8)], written=[5, 6]))
    # The store cursor goes back to them: they are stored again.
    assert blocks_of(p.stores) == [[5, 6]]
    finish_all(s, p.stores)
    s.add_request("c", 9, [11, 12])
    assert s.lookup("c", 0) == 8


def test_a_block_table_with_a_repeated_block_is_rejected_unchanged():
    s = make()
    s.add_request("a", 10, [11, 12])
    assert s.lookup("a", 0) == 0
    with pytest.raises(RequestStateError, match="block 3 twice"):
        s.allocate("a", [[3, 4, 3]], 0, 0)
    assert s.status("a") == "waiting"
    s.allocate("a", [[3, 4, 5]], 0, 0)
    with pytest.raises(RequestStateError, match="block 9"):
        s.schedule(StepInput(scheduled=[("a", 9)], new_blocks=[("a", 0, [9, 9])]))
    assert s.stats()["steps"] == 0


def test_a_long_table_s_repeated_block_is_found_and_no_call_sees_another_s_blocks() -> None:
    """Tables of hundreds of blocks: a repeat at the end, in the middle or at the start is
    refused, and the blocks a refused or an earlier call named are not repeats in the next call
    (the check's generation stamps move on per call)."""
    s = make(num_gpu_blocks=4096)
    s.add_request("a", 1200, list(range(100, 400)))
    assert s.lookup("a", 0) == 0
    table = list(range(1, 301))
    for dup_at in (299, 150, 1):
        with pytest.raises(RequestStateError, match=f"block {table[dup_at - 1]} twice"):
            s.allocate("a", [[*table[:dup_at], table[dup_at - 1], *table[dup_at:]]], 0, 0)
        assert s.status("a") == "waiting"
    s.allocate("a", [table], 0, 0)
    fresh = list(range(301, 801))
    with pytest.raises(RequestStateError, match="block 800"):
        s.schedule(StepInput(scheduled=[("a", 9)], new_blocks=[("a", 0, [*fresh, 800])]))
    assert s.stats()["steps"] == 0
    s.schedule(StepInput(scheduled=[("a", 9)], new_blocks=[("a", 0, fresh)]))
    assert s.stats()["steps"] == 1


def test_the_null_block_where_a_load_must_write_is_rejected_unchanged():
    s = make()
    store_prefix(s, "a", [[1, 2, 3, 4, 5, 6, 7, 8]], list(range(11, 19)), 32)
    s.add_request("b", 33, list(range(11, 19)))
    n = s.lookup("b", 0)
    assert n == 32
    before = s.stats()
    # Accepted, 32 tokens would be promised and one block copied.
    with pytest.raises(RequestStateError, match="null block at position 1"):
        s.allocate("b", [[20, 0, 0, 0, 0, 0, 0, 0, 21]], 0, n)
    assert s.status("b") == "waiting"
    assert s.stats()["pools"] == before["pools"]
    assert s.pending_jobs() == []


@pytest.mark.parametrize(
    "lists",
    [
        {"finished": ["a"], "preempted": ["a"]},
        {"finished": ["a"], "aborted": ["a"]},
        {"aborted": ["a"], "preempted": ["a"]},
        {"finished": ["a", "a"]},
    ],
)
def test_one_request_released_twice_in_a_step_is_rejected_unchanged(lists):
    s = make()
    s.add_request("a", 10, [11, 12])
    s.lookup("a", 0)
    s.allocate("a", [[1, 2, 3]], 0, 0)
    with pytest.raises(RequestStateError, match='"a"'):
        s.schedule(StepInput(written=[], **lists))
    # Refused whole: the request is not left "preempted" forever.
    assert s.status("a") == "running"
    assert s.stats()["steps"] == 0


def test_a_request_scheduled_and_released_in_one_step_is_rejected_unchanged():
    s = make()
    s.add_request("a", 10, [11, 12])
    s.lookup("a", 0)
    s.allocate("a", [[1, 2, 3]], 0, 0)
    with pytest.raises(RequestStateError, match="scheduled and released"):
        s.schedule(StepInput(scheduled=[("a", 8)], finished=["a"], written=[]))
    assert s.status("a") == "running"


def test_complete_many_is_all_or_nothing():
    s = make()
    s.add_request("a", 13, [11, 12, 13])
    s.lookup("a", 0)
    s.allocate("a", [[1, 2, 3, 4]], 0, 0)
    j1 = s.schedule(StepInput(scheduled=[("a", 4)], written=[1])).stores[0].job_id
    j2 = s.schedule(StepInput(scheduled=[("a", 8)], written=[2])).stores[0].job_id
    # Refused whole: j1 is not applied before 999 raises.
    with pytest.raises(UnknownJobError, match="999"):
        s.complete_many([j1, 999, j2])
    assert s.pending_jobs() == [j1, j2]
    with pytest.raises(DuplicateReportError, match=f"job {j1}"):
        s.complete_many([j1, j2], failed=[j1])
    assert s.pending_jobs() == [j1, j2]
    done = s.complete_many([j1, j2])
    assert [d.job_id for d in done] == [j1, j2]
    assert s.pending_jobs() == []


def test_step_checks_hold_with_more_requests_than_gpu_blocks():
    """The per-step duplicate checks index requests and blocks apart: a request index beyond
    the block count is no out-of-range index into the blocks' table."""
    s = make(num_gpu_blocks=4)
    for i in range(10):
        s.add_request(f"r{i}", 5, [i])
    s.schedule(StepInput(aborted=["r9", "r8"], finished=["r7"], written=[]))
    assert s.num_requests == 7
    with pytest.raises(RequestStateError, match='"r6"'):
        s.schedule(StepInput(aborted=["r6"], preempted=["r6"], written=[]))
