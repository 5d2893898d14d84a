"""The random-call scheduler fuzzer (tests/fuzz/scheduler_fuzz.py) on bounded seeds.

Each run drives :class:`~kvoffload.scheduler.OffloadScheduler` with a simulated paged engine and
1-3 simulated workers that hold real (modelled) bytes, interleaving resets, late, duplicated and
failed reports and invalid calls, and checks the content of every copy against the truth. The
bounded seeds here cover every combination of full attention / sliding window, 1 or 2 blocks per
chunk, 1-3 workers and exact / superset / conservative ``written``; ``make fuzz`` runs thousands.
"""

from __future__ import annotations

import pytest

from kvoffload.errors import KvOffloadError
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput
from tests.fuzz.scheduler_fuzz import FuzzViolationError, options_for_seed, run, run_compare

STEPS = 300
CHUNKS = 10
PER_CHUNK = 12  # options_for_seed cycles through every combination in 36 seeds

COVERED = (
    "loads",
    "stores",
    "flushes",
    "resets",
    "invalid_calls",
    "late_reports",
    "duplicate_reports",
    "failed_reports",
    "preemptions",
    "complete_many",
)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_calls_keep_every_byte_true(chunk):
    totals: dict[str, int] = {}
    for seed in range(chunk * PER_CHUNK, (chunk + 1) * PER_CHUNK):
        res = run(seed, STEPS, **options_for_seed(seed))
        assert res["violations"] == 0
        for k in (*COVERED, "cancelled_loads", "readmissions", "sw_frees", "chunks_dropped"):
            totals[k] = totals.get(k, 0) + res.get(k, 0)
    # The schedules exercised what they are meant to exercise.
    assert all(totals[k] > 0 for k in COVERED), totals


@pytest.mark.parametrize("seed", range(12))
def test_superset_or_conservative_written_plans_the_same_stores(seed):
    """Exact, superset and ``None`` written: identical store plans and dropped chunks; superset
    flush sets contain the exact ones (run_compare raises otherwise)."""
    res = run_compare(seed, STEPS, **options_for_seed(seed))
    assert res["exact"]["stores"] > 0
    assert res["superset"]["flushes"] >= res["exact"]["flushes"]


def test_the_broken_fence_is_caught():
    """debug_skip_deferred_arming (full-attention pairs never armed) must trip the truth checks:
    a torn store (check 3) or wrong bytes in a completed store (check 2)."""
    kinds: dict[str, int] = {}
    for seed in range(4):
        res = run(
            seed,
            150,
            debug_skip_deferred_arming=True,
            raise_on_violation=False,
            **options_for_seed(seed),
        )
        assert res["violations"] > 0, seed
        for k, v in res["violation_kinds"].items():
            kinds[k] = kinds.get(k, 0) + v
    assert kinds.get("torn", 0) > 0, kinds
    assert kinds.get("store-content", 0) > 0, kinds
    with pytest.raises(FuzzViolationError, match=r"torn|store-content"):
        run(0, 150, debug_skip_deferred_arming=True, **options_for_seed(0))


def test_a_data_plane_that_skips_flushes_is_caught():
    """Self-test of the checks: workers that ignore half of the flush set tear stores."""
    res = run(1, 150, skip_flush_rate=0.5, raise_on_violation=False, **options_for_seed(1))
    assert res["violation_kinds"].get("torn", 0) > 0, res["violation_kinds"]


# Known bugs found by the fuzzer ---------------------------------------------------------------


def _reset_after_load_setup() -> tuple[OffloadScheduler, list[int]]:
    """Full attention + a sliding window of 8 tokens, 4-token blocks. Request ``b`` has a GPU
    prefix hit of 12 tokens (its window blocks 12, 13 at positions 1, 2) and loads tokens 12..32.
    Once the load is done its window starts at token 25: the engine frees blocks 12 and 13 and
    gives them to ``c``, which writes them. Then a reset; then ``b``'s next step."""
    s = OffloadScheduler(
        OffloadConfig(
            groups=(KvGroup(4), KvGroup(4, sliding_window=8)), num_gpu_blocks=64, cpu_chunks=16
        )
    )

    def done(plan):
        for j in [*plan.loads, *plan.stores]:
            s.complete(j.job_id)

    hashes = [101 + i for i in range(8)]
    s.add_request("a", 33, hashes)
    s.lookup("a", 0)
    s.allocate("a", [list(range(1, 10)), list(range(11, 20))], 0, 0)
    done(s.schedule(StepInput(scheduled=[("a", 32)], written=[*range(1, 10), *range(11, 20)])))
    done(s.schedule(StepInput(finished=["a"], written=[])))
    s.add_request("b", 33, hashes)
    n = s.lookup("b", 12)
    assert n == 20
    s.allocate("b", [[1, 2, 3, 21, 22, 23, 24, 25], [0, 12, 13, 0, 0, 0, 26, 27]], 12, n)
    done(s.schedule(StepInput(written=[21, 22, 23, 24, 25, 26, 27])))
    s.add_request("c", 9, [201, 202])
    s.lookup("c", 0)
    s.allocate("c", [[30, 31, 32], [12, 13, 33]], 0, 0)
    done(s.schedule(StepInput(scheduled=[("c", 8)], written=[30, 31, 32, 12, 13, 33])))
    s.reset()
    plan = s.schedule(
        StepInput(scheduled=[("b", 33)], new_blocks=[("b", 0, [34]), ("b", 1, [35])], written=[])
    )
    return s, [
        blk
        for j in plan.stores
        if j.request_id == "b"
        for g, gpu, _ in j.transfers
        if g == 1
        for blk in gpu
    ]


def test_reset_after_a_load_never_stores_window_blocks_the_engine_gave_away():
    _, window_blocks = _reset_after_load_setup()
    # Blocks 12 and 13 now hold c's KV: b's store must not copy [12, 13, 26, 27].
    assert not {12, 13} & set(window_blocks), window_blocks


@pytest.mark.parametrize("seed", [157, 851])
def test_fuzz_seeds_with_a_reset_after_a_load(seed):
    run(seed, STEPS, **options_for_seed(seed))


def test_complete_with_a_non_bool_ok_raises_a_kvoffload_error():
    s = OffloadScheduler(OffloadConfig(groups=(KvGroup(4),), num_gpu_blocks=16, cpu_chunks=4))
    s.add_request("a", 5, [11])
    s.lookup("a", 0)
    s.allocate("a", [[1, 2]], 0, 0)
    (store,) = s.schedule(StepInput(scheduled=[("a", 4)], written=[1])).stores
    with pytest.raises(KvOffloadError):
        s.complete(store.job_id, worker=0, ok="yes")
    assert s.pending_jobs() == [store.job_id]
