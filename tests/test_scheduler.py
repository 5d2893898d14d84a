"""Scenario tests of the scheduler, each driven step by step through the public API."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from kvoffload._core import Scheduler
from kvoffload.errors import (
    CompletionError,
    ConfigError,
    InvalidBlockError,
    RequestStateError,
    UnknownJobError,
    UnknownRequestError,
)
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput

BS = 4


def make(window: int | None = None, **kw) -> OffloadScheduler:
    groups = (KvGroup(BS),) + ((KvGroup(BS, sliding_window=window),) if window else ())
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("cpu_chunks", 16)
    return OffloadScheduler(OffloadConfig(groups=groups, **kw))


def hashes(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


def admit(s, rid, blocks, prompt, base=1000, hit=0, expect_load=None):
    s.add_request(rid, prompt, hashes(prompt // BS, base))
    n = s.lookup(rid, hit)
    if expect_load is not None:
        assert n == expect_load
    return s.allocate(rid, blocks, hit, n or 0)


def complete_all(s, jobs):
    return [s.complete(j.job_id) for j in jobs]


def test_store_after_a_chunk_fills_and_not_before():
    s = make()
    admit(s, "a", [[1, 2, 3]], prompt=10)
    plan = s.schedule(StepInput(scheduled=[("a", 3)]))
    assert plan.stores == []
    plan = s.schedule(StepInput(scheduled=[("a", 4)]))
    assert [j.transfers for j in plan.stores] == [[(0, [1], [0])]]
    plan = s.schedule(StepInput(scheduled=[("a", 7)]))
    assert plan.stores == []  # chunk 1 is not full yet
    plan = s.schedule(StepInput(scheduled=[("a", 8)]))
    assert [t[1] for t in plan.stores[0].transfers] == [[2]]


def test_a_jobs_transfers_and_keys_are_built_once():
    s = make(window=8)
    admit(s, "a", [[1, 2, 3], [5, 6, 7]], prompt=12)
    (job,) = s.schedule(StepInput(scheduled=[("a", 8)])).stores
    transfers, keys = job.transfers, job.keys
    assert transfers == [(0, [1, 2], [0, 1]), (1, [5, 6], [0, 1])]
    assert keys == [(0, [1000, 1001]), (1, [1000, 1001])]
    # Later reads hand out the same lists: nothing is converted again.
    assert job.transfers is transfers
    assert job.keys is keys


def test_finish_time_store_of_last_full_chunk_then_dropped():
    s = make(cpu_chunks=1)
    admit(s, "a", [[1, 2, 3]], prompt=12)
    p1 = s.schedule(StepInput(scheduled=[("a", 12)]))
    # One slot: the first chunk is stored, the rest waits for room.
    assert [t[1] for t in p1.stores[0].transfers] == [[1]]
    complete_all(s, p1.stores)
    p2 = s.schedule(StepInput(finished=["a"], written=[]))
    assert [t[1] for t in p2.stores[0].transfers] == [[2]]
    assert s.status("a") == "finished"
    complete_all(s, p2.stores)
    p3 = s.schedule(StepInput(written=[]))
    complete_all(s, p3.stores)
    s.schedule(StepInput(written=[]))
    assert s.num_requests == 0
    assert s.armed_pairs == 0


def test_finished_store_flushed_when_block_rewritten_not_when_prefix_reused():
    s = make()
    admit(s, "a", [[1, 2]], prompt=8)
    plan = s.schedule(StepInput(scheduled=[("a", 8)]))
    store = plan.stores[0].job_id
    # a finishes; its block 1 is handed to b as a prefix-cache hit (read-only): no flush.
    p = s.schedule(StepInput(finished=["a"], written=[]))
    assert p.flush == []
    # Block 2 is re-allocated and written by a new request: the store must finish first.
    p = s.schedule(StepInput(written=[2]))
    assert p.flush == [store]
    assert s.stats()["flushes_necessary"] == 1


def test_running_full_attention_store_never_touches_the_fence():
    s = make()
    admit(s, "a", [[1, 2]], prompt=8)
    plan = s.schedule(StepInput(scheduled=[("a", 8)]))
    assert plan.stores
    assert s.armed_pairs == 0
    # Even if the engine (wrongly, conservatively) reports the blocks written, no flush.
    assert s.schedule(StepInput(scheduled=[("a", 9)], written=[1, 2])).flush == []


def test_several_jobs_on_reused_blocks_all_flushed():
    s = make()
    admit(s, "a", [[1, 2, 3]], prompt=12)
    j1 = s.schedule(StepInput(scheduled=[("a", 4)])).stores[0].job_id
    j2 = s.schedule(StepInput(scheduled=[("a", 8)])).stores[0].job_id
    j3 = s.schedule(StepInput(scheduled=[("a", 12)])).stores[0].job_id
    s.schedule(StepInput(aborted=["a"], written=[]))
    assert s.schedule(StepInput(written=[3, 1, 9])).flush == [j1, j3]
    assert s.armed_pairs == 3
    del j2


def test_mixed_full_attention_and_sliding_window_arming():
    s = make(window=8)
    admit(s, "a", [[1, 2, 3], [11, 12, 13]], prompt=12)
    plan = s.schedule(StepInput(scheduled=[("a", 12)]))
    (job,) = plan.stores
    # Window blocks are armed at creation, full-attention blocks are not.
    assert s.armed_pairs == 3
    assert s.schedule(StepInput(scheduled=[("a", 13)], written=[11])).flush == [job.job_id]
    assert s.schedule(StepInput(scheduled=[("a", 14)], written=[1])).flush == []
    s.schedule(StepInput(finished=["a"], written=[]))
    assert s.armed_pairs == 6
    assert s.schedule(StepInput(written=[2])).flush == [job.job_id]


def test_window_slides_while_pool_full_stale_positions_dropped():
    s = make(window=8, cpu_chunks=2)
    # Fill both pools with a request whose slots stay pinned by a load.
    admit(s, "x", [[1, 2], [11, 12]], prompt=9)
    px = s.schedule(StepInput(scheduled=[("x", 8)]))
    complete_all(s, px.stores)
    s.schedule(StepInput(finished=["x"], written=[]))
    admit(s, "y", [[3, 4, 5], [0, 13, 14]], prompt=9, base=1000, expect_load=8)
    # The pool is full (both slots pinned by y's load): a's stores wait.
    admit(s, "a", [[21, 22, 23], [31, 32, 33]], prompt=12, base=5000)
    p = s.schedule(StepInput(scheduled=[("a", 12)], written=[21, 22, 23, 31, 32, 33]))
    assert p.stores == []
    assert s.stats()["store_no_room"] >= 1
    # The window slides: block 31 (position 0) is freed and re-allocated to a new request.
    s.add_request("z", 5, [9001])
    assert s.lookup("z", 0) == 0
    s.allocate("z", [[41], [31]], 0, 0)
    p = s.schedule(StepInput(scheduled=[("a", 13), ("z", 4)], written=[31, 41]))
    for j in p.loads:
        s.complete(j.job_id)
    s.complete(s.pending_jobs()[0])
    p = s.schedule(StepInput(scheduled=[("a", 14)], written=[]))
    stored = {g: gpu for j in p.stores if j.request_id == "a" for g, gpu, _ in j.transfers}
    assert 31 not in stored.get(1, [])  # the stale window position is never stored
    assert stored.get(1, []) == [32, 33][: len(stored.get(1, []))]
    for _ in range(3):  # once there is room, the window's remaining chunks go; 31 never does
        for j in s.pending_jobs():
            s.complete(j)
        p = s.schedule(StepInput(scheduled=[("a", 14)], written=[]))
        got = [
            b
            for j in p.stores
            if j.request_id == "a"
            for g, gpu, _ in j.transfers
            for b in gpu
            if g == 1
        ]
        assert 31 not in got
    assert s.stats()["chunks_dropped"] >= 1


def test_preemption_arms_without_flushing_and_rewrite_flushes():
    s = make()
    admit(s, "a", [[1, 2]], prompt=8)
    job = s.schedule(StepInput(scheduled=[("a", 8)])).stores[0].job_id
    p = s.schedule(StepInput(preempted=["a"], written=[]))
    assert p.flush == []  # preemption alone does not flush
    assert s.schedule(StepInput(written=[2])).flush == [job]


def test_preempted_request_readmitted_before_stores_complete_waits():
    s = make()
    admit(s, "a", [[1, 2]], prompt=8)
    job = s.schedule(StepInput(scheduled=[("a", 8)])).stores[0].job_id
    s.schedule(StepInput(preempted=["a"], written=[]))
    assert s.lookup("a", 0) is None  # its own store is still pending
    s.complete(job)
    assert s.lookup("a", 0) == 8  # now served from the CPU tier
    assert s.status("a") == "preempted"


def test_concurrent_lookups_of_same_prefix_load_once_without_convoy():
    s = make(num_gpu_blocks=4096, cpu_chunks=64)
    admit(s, "seed", [[1, 2, 3, 4]], prompt=17)
    complete_all(s, s.schedule(StepInput(scheduled=[("seed", 17)])).stores)
    s.schedule(StepInput(finished=["seed"], written=[]))
    # First reader loads; hundreds of later readers wait only for that load.
    n = 300
    first = admit(s, "r0", [[10, 11, 12, 13, 14]], prompt=17, expect_load=16)
    assert first is not None
    for i in range(1, n):
        s.add_request(f"r{i}", 17, hashes(4))
        assert s.lookup(f"r{i}", 0) is None
    p = s.schedule(StepInput(written=[10, 11, 12, 13]))
    assert [j.job_id for j in p.loads] == [first]
    s.complete(first)
    # The first load finished: every waiter is answered at once (no convoy behind later loads).
    loads = 0
    for i in range(1, n):
        got = s.lookup(f"r{i}", 0)
        assert got == 16
        base = 20 + 5 * i
        loads += s.allocate(f"r{i}", [list(range(base, base + 5))], 0, got) is not None
    assert loads == n - 1
    assert s.stats()["max_lookup_wait_steps"] == 1


def test_abort_while_loading_arms_the_load():
    s = make()
    admit(s, "a", [[1, 2, 3]], prompt=9)
    complete_all(s, s.schedule(StepInput(scheduled=[("a", 8)])).stores)
    s.schedule(StepInput(finished=["a"], written=[]))
    load = admit(s, "b", [[5, 6, 7]], prompt=9, expect_load=8)
    s.schedule(StepInput(written=[]))
    s.schedule(StepInput(aborted=["b"], written=[]))
    assert s.schedule(StepInput(written=[6])).flush == [load]
    done = s.complete(load)
    assert done is not None
    assert done.ok
    s.schedule(StepInput(written=[]))
    assert s.num_requests == 0


def test_failed_load_reports_invalid_blocks_and_failed_store_is_never_readable():
    s = make()
    admit(s, "a", [[1, 2, 3]], prompt=9)
    (st,) = s.schedule(StepInput(scheduled=[("a", 8)])).stores
    assert s.complete(st.job_id, ok=False).ok is False
    s.add_request("b", 9, hashes(2))
    assert s.lookup("b", 0) == 0  # the failed store never became readable
    (st,) = s.schedule(StepInput(scheduled=[("a", 9)], written=[])).stores or [None]
    del st


def test_reset_with_jobs_in_flight():
    s = make()
    admit(s, "a", [[1, 2, 3]], prompt=12)
    p = s.schedule(StepInput(scheduled=[("a", 8)]))
    job = p.stores[0].job_id
    r = s.reset()
    assert r.flushed == [job]
    assert s.complete(job) is None  # late: ignored, counted
    assert s.stats()["late_reports"] == 1
    p = s.schedule(StepInput(scheduled=[("a", 12)]))
    assert job in p.flush
    # The store cursor restarted: all three chunks are stored again.
    assert [gpu for j in p.stores for _, gpu, _ in j.transfers] == [[1, 2, 3]]


def test_two_workers_completing_out_of_order():
    s = make(num_workers=2)
    admit(s, "a", [[1, 2]], prompt=8)
    j1 = s.schedule(StepInput(scheduled=[("a", 4)])).stores[0].job_id
    j2 = s.schedule(StepInput(scheduled=[("a", 8)])).stores[0].job_id
    assert s.complete(j2, worker=1) is None
    assert s.complete(j1, worker=0) is None
    assert s.complete(j1, worker=1).job_id == j1
    assert s.complete(j2, worker=0).job_id == j2
    with pytest.raises(CompletionError, match="already completed"):
        s.complete(j2)


def test_bad_input_raises_specific_errors_and_changes_nothing():
    s = make()
    admit(s, "a", [[1, 2]], prompt=8)
    before = s.stats()
    with pytest.raises(UnknownRequestError, match=r"nope"):
        s.schedule(StepInput(scheduled=[("a", 8), ("nope", 1)]))
    with pytest.raises(InvalidBlockError, match="64"):
        s.schedule(StepInput(scheduled=[("a", 8)], new_blocks=[("a", 0, [64])]))
    with pytest.raises(InvalidBlockError, match="-1"):
        s.schedule(StepInput(scheduled=[("a", 8)], written=[-1]))
    with pytest.raises(RequestStateError, match="group 3"):
        s.schedule(StepInput(new_blocks=[("a", 3, [5])]))
    with pytest.raises(RequestStateError, match="already registered"):
        s.add_request("a", 8, [])
    with pytest.raises(RequestStateError, match="running"):
        s.lookup("a", 0)
    with pytest.raises(UnknownJobError, match="77"):
        s.complete(77)
    assert s.stats() == before
    plan = s.schedule(StepInput(scheduled=[("a", 8)]))
    assert len(plan.stores) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"blocks_per_chunk": 3, "hash_block_size": 8}, "multiple of hash_block_size"),
        ({"cpu_chunks": 0}, "cpu_chunks"),
        ({"policy": "fifo"}, "policy"),
        ({"num_workers": 0}, "num_workers"),
    ],
)
def test_invalid_config_says_what_to_change(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make(**kwargs)


def test_window_smaller_than_chunk_rejected():
    with pytest.raises(ConfigError, match="lower blocks_per_chunk"):
        make(window=4, blocks_per_chunk=2)


def test_failed_load_reports_its_destination_blocks():
    s = make(num_workers=2)
    admit(s, "a", [[1, 2, 3]], prompt=9)
    for j in s.schedule(StepInput(scheduled=[("a", 8)])).stores:
        s.complete_many([j.job_id], worker=0)
        s.complete_many([j.job_id], worker=1)
    s.schedule(StepInput(finished=["a"], written=[]))
    load = admit(s, "b", [[5, 6, 7]], prompt=9, expect_load=8)
    assert [j.job_id for j in s.schedule(StepInput(written=[])).loads] == [load]
    assert s.complete(load, worker=0, ok=True) is None  # one worker succeeded
    done = s.complete(load, worker=1, ok=False)  # the other failed: the load failed
    assert done.kind == "load"
    assert not done.ok
    assert done.invalid_blocks == [5, 6]
    assert s.stats()["failed_loads"] == 1
    # The chunks are no longer trusted: unpinned, dropped, reported removed.
    assert s.stats()["pools"][0]["pinned"] == 0
    assert ("removed", 0, [1000, 1001], "cpu") in s.take_events()
    s.add_request("c", 9, hashes(2))
    assert s.lookup("c", 0) == 0


def test_events_carry_group_and_keys():
    s = make(window=8, cpu_chunks=2)
    admit(s, "a", [[1, 2, 3], [11, 12, 13]], prompt=12)
    complete_all(s, s.schedule(StepInput(scheduled=[("a", 8)])).stores)
    events = s.take_events()
    assert sorted((kind, group, keys) for kind, group, keys, _ in events) == [
        ("stored", 0, [1000, 1001]),
        ("stored", 1, [1000, 1001]),
    ]
    assert {medium for *_, medium in events} == {"cpu"}
    # A third chunk evicts the least recent one in each group's pool.
    complete_all(s, s.schedule(StepInput(scheduled=[("a", 12)])).stores)
    removed = [(g, keys) for kind, g, keys, _ in s.take_events() if kind == "removed"]
    assert sorted(removed) == [(0, [1000]), (1, [1000])]
    assert s.take_events() == []


def test_resumed_request_loads_its_generated_tokens_too():
    s = make()
    admit(s, "a", [[1, 2, 3, 4]], prompt=8)
    jobs = s.schedule(StepInput(scheduled=[("a", 8)])).stores
    s.extend_hashes("a", [1002])  # decode fills the third block
    jobs += s.schedule(StepInput(scheduled=[("a", 12)])).stores
    complete_all(s, jobs)
    s.schedule(StepInput(preempted=["a"], written=[]))
    # Prompt (8) and generated tokens (4) had KV: all 12 come back.
    assert s.lookup("a", 0) == 12
    load = s.allocate("a", [[9, 10, 11, 12]], 0, 12)
    assert load is not None
    plan = s.schedule(StepInput(scheduled=[("a", 13)], written=[9, 10, 11, 12]))
    assert [t[1] for j in plan.loads for t in j.transfers] == [[9, 10, 11]]


def test_preempt_outside_a_step_after_a_failed_load():
    s = make()
    admit(s, "a", [[1, 2, 3]], prompt=9)
    complete_all(s, s.schedule(StepInput(scheduled=[("a", 8)])).stores)
    s.schedule(StepInput(finished=["a"], written=[]))
    load = admit(s, "b", [[5, 6, 7]], prompt=9, expect_load=8)
    s.schedule(StepInput(written=[5, 6, 7]))
    assert s.complete(load, ok=False).invalid_blocks == [5, 6]
    # The engine drops b's blocks and will admit it again: it must be lookable.
    with pytest.raises(RequestStateError, match="running"):
        s.lookup("b", 0)
    s.preempt("b")
    s.preempt("b")  # idempotent
    assert s.status("b") == "preempted"
    assert s.lookup("b", 0) == 0  # the failed load's chunks were dropped: recompute
    # Reporting the preemption in the next step as well is harmless.
    s.schedule(StepInput(preempted=["b"], written=[]))
    s.schedule(StepInput(aborted=["b"], written=[]))
    with pytest.raises(UnknownRequestError, match="b"):
        s.preempt("b")  # aborted with nothing pending: dropped


BAD_CONFIG = [
    ("num_gpu_blocks", -1, "-1"),
    ("num_gpu_blocks", True, "True"),
    ("blocks_per_chunk", 0, "0"),
    ("blocks_per_chunk", 2.5, "2.5"),
    ("hash_block_size", 0, "0"),
    ("cpu_chunks", -3, "-3"),
    ("policy", "fifo", "fifo"),
    ("num_workers", 0, "0"),
    ("max_loading_requests", -1, "-1"),
    ("offload_prompt_only", 1, "1"),
    ("max_offload_tokens", -5, "-5"),
    ("store_threshold", -1, "-1"),
    ("null_block", 64, "64"),
    ("debug_skip_deferred_arming", "yes", "yes"),
    ("groups", (KvGroup(0),), "block_size"),
    ("groups", (KvGroup(BS, sliding_window=0),), "sliding_window"),
    ("groups", [(BS,)], "(4,)"),
]


@pytest.mark.parametrize(("field", "value", "shown"), BAD_CONFIG)
def test_config_is_validated_by_the_core_alone(field, value, shown):
    """One validator: OffloadConfig holds values as given, and the facade's error is exactly the
    core's (Scheduler.check_config), naming the field and the value."""
    cfg = OffloadConfig(
        **{"groups": (KvGroup(BS),), "num_gpu_blocks": 64, "cpu_chunks": 16, field: value}
    )
    with pytest.raises(ConfigError) as core:
        Scheduler.check_config(**cfg._core_kwargs())
    for build in (
        OffloadScheduler,
        lambda c: c.resolved_cpu_chunks(),
        lambda c: c.bytes_per_chunk(0),
    ):
        with pytest.raises(ConfigError) as facade:
            build(cfg)
        assert str(facade.value) == str(core.value)
    assert field in str(core.value)
    assert shown in str(core.value)


FACE = ["OffloadScheduler", "OffloadConfig", "KvGroup", "StepInput", "TransferEngine"]


def test_package_face_imports_from_the_top_level():
    import kvoffload
    import kvoffload.scheduler
    import kvoffload.transfer

    homes = [kvoffload.scheduler, kvoffload.transfer, kvoffload._core, kvoffload.errors]
    for name in kvoffload.__all__:  # accurate: each name is the object of its home module
        value = getattr(kvoffload, name)
        assert any(getattr(m, name, None) is value for m in homes), name
    for name in FACE:
        assert name in kvoffload.__all__
    assert kvoffload.OffloadScheduler is kvoffload.scheduler.OffloadScheduler
    assert set(kvoffload.__all__) <= set(dir(kvoffload))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = kvoffload.no_such_name


def test_import_kvoffload_needs_no_torch_until_the_data_plane_is_used():
    code = (
        "import sys, kvoffload\n"
        "from kvoffload import OffloadScheduler, OffloadConfig, KvGroup, StepInput\n"
        "assert 'torch' not in sys.modules, 'torch imported too early'\n"
        "from kvoffload import TransferEngine\n"
        "assert 'torch' in sys.modules and TransferEngine.__name__ == 'TransferEngine'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_stats_is_a_method_on_every_class():
    """``stats`` is the same kind of thing everywhere: a method returning a snapshot dict."""
    import kvoffload

    classes = [kvoffload.OffloadScheduler, kvoffload.TransferEngine]
    classes += [kvoffload.Scheduler, kvoffload._core._JobTracker, kvoffload._core._CpuPool]
    for cls in classes:
        attr = inspect.getattr_static(cls, "stats")
        assert callable(attr), cls
        assert not isinstance(attr, property), cls
    s = make()
    snap = s.stats()
    admit(s, "a", [[1, 2, 3]], prompt=9)
    s.schedule(StepInput(scheduled=[("a", 9)]))
    assert snap != s.stats()  # a snapshot, not a live view
