"""The counterfactual fence of the simulator: vLLM's rule, counted on the same run as ours."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvoffload.sim import simulate
from kvoffload.sim.vllm_rule import VllmRuleFence
from tests.support.sim import PRESSURE

FA, SW = 0, 1


def fence() -> VllmRuleFence:
    return VllmRuleFence([None, 16])


def test_window_pairs_are_armed_at_creation():
    f = fence()
    f.step([], [])
    f.stores([(1, "a", [(SW, [5], None), (FA, [6], None)])])
    f.allocated([5])
    assert f.step([], []) == 1


def test_full_attention_pairs_wait_for_the_finish():
    f = fence()
    f.step([], [])
    f.stores([(1, "a", [(FA, [6], None)])])
    f.allocated([6])
    assert f.step([], []) == 0  # a running request holds its full-attention blocks
    f.allocated([6])
    assert f.step(["a"], []) == 1


def test_a_preemption_flushes_every_pending_store_of_the_request():
    f = fence()
    f.step([], [])
    f.stores(
        [(1, "a", [(FA, [6], None)]), (2, "a", [(FA, [7], None)]), (3, "b", [(FA, [8], None)])]
    )
    assert f.step([], ["a"]) == 2


def test_a_store_of_a_finished_request_is_checked_inline():
    f = fence()
    f.allocated([9])
    f.step(["a"], [])
    f.stores([(1, "a", [(FA, [9], None)])])  # its block was re-allocated in this step
    assert f.flushed == 1


def test_completed_jobs_and_resets_leave_nothing_to_flush():
    f = fence()
    f.step([], [])
    f.stores([(1, "a", [(SW, [5], None)]), (2, "a", [(SW, [6], None)])])
    f.completed(1)
    f.allocated([5, 6])
    assert f.step([], []) == 1
    f.reset()
    f.allocated([6])
    assert f.step([], []) == 0


# test_sim's pressure run (small GPU pool, copies that take a while: blocks of pending stores
# get re-allocated), with the CLI's default 128-token sliding-window group (its blocks need a
# larger GPU pool).
RUN = replace(PRESSURE, sliding_window=128, num_gpu_blocks=144)


@pytest.mark.parametrize(
    "cfg",
    [
        RUN,
        PRESSURE,
        replace(RUN, async_scheduling=True),
        replace(RUN, num_gpu_blocks=128),  # more preemptions
    ],
    ids=["window", "full", "async", "pressure"],
)
def test_our_fence_flushes_no_more_than_vllms_rule_and_serves_no_wrong_byte(cfg):
    r = simulate(cfg)
    assert r.mismatches == 0
    assert r.hit_mismatches == 0
    assert r.torn_stores == 0
    assert r.load_jobs > 0
    assert r.store_jobs > 0
    assert r.flushes_vllm_rule > 0, "the run never re-allocated a block a pending store read"
    assert r.flushes_necessary <= r.flushes_vllm_rule
