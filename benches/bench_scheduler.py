"""Per-step cost of ``schedule`` + completions: the Rust core vs the pure-Python model.

Run: ``.venv/bin/python -m pytest benches/bench_scheduler.py --benchmark-enable -q -s``.
Steady decode at 64, 256 and 512 running requests (16-token blocks, one chunk per block, so
every 16th step of a request fills a chunk and creates a store), with the previous step's stores
completed each step. The printed ratio is model time / core time, measured in the same run.
"""

from __future__ import annotations

import time

import pytest
from tests.model.scheduler_model import ModelScheduler

from kvoffload import Scheduler

BS = 16
CFG = dict(
    blocks_per_chunk=1,
    hash_block_size=BS,
    num_gpu_blocks=200_000,
    cpu_chunks=400_000,
    num_workers=1,
)


def setup(impl, n: int):
    ids = [f"req-{i}" for i in range(n)]
    computed = []
    next_block = 1
    for i, rid in enumerate(ids):
        plen = 2048 + 16 * (i % 7) + i % 16
        impl.add_request(rid, plen, [i * 10_000 + k for k in range(plen // BS + 64)])
        impl.lookup(rid, 0)
        nb = plen // BS + 40
        impl.allocate(rid, [list(range(next_block, next_block + nb))], 0, 0)
        next_block += nb
        computed.append(plen)
    return ids, computed


def run_steps(impl, ids, computed, steps: int, core: bool) -> float:
    pending: list[int] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        for j in pending:
            impl.complete(j)
        computed = [c + 1 for c in computed]
        if core:
            plan = impl.schedule(ids, computed, None, None, None, None, None, [])
            pending = [j.job_id for j in plan.stores]
        else:
            _, stores, _ = impl.schedule(ids, computed, (), (), (), (), (), [])
            pending = [j.id for j in stores]
    return (time.perf_counter() - t0) / steps


def prefilled(n: int):
    """The core and the model with the same `n` requests, after the first step (its prefill
    stores): what the benches measure comes after it."""
    core = Scheduler([(BS, None, 0)], **CFG)
    model = ModelScheduler([(BS, None)], **CFG)
    ids, computed = setup(core, n)
    setup(model, n)
    run_steps(core, ids, computed, 1, True)
    run_steps(model, ids, computed, 1, False)
    return core, model, ids, computed


@pytest.mark.parametrize("n", [64, 256, 512])
def test_steady_decode_step(benchmark, n):
    core, model, ids, computed = prefilled(n)
    state = {"computed": [c + 1 for c in computed]}

    def one_step():
        state["computed"] = [c + 1 for c in state["computed"]]
        plan = core.schedule(ids, state["computed"], None, None, None, None, None, [])
        for j in plan.stores:
            core.complete(j.job_id)

    benchmark(one_step)
    t_core = benchmark.stats.stats.mean
    t_model = run_steps(model, ids, state["computed"], 20, False)
    print(
        f"\n{n} requests: core {t_core * 1e6:.1f} us/step, model {t_model * 1e6:.1f} us/step, "
        f"ratio {t_model / t_core:.0f}x"
    )
    assert t_model > 0


@pytest.mark.parametrize("n", [64, 256, 512])
def test_prefill_heavy_step(benchmark, n):
    """One in eight requests prefills a 256-token piece per step (16 chunks to store)."""
    steps = 40
    core, model, ids, computed = prefilled(n)
    start = [c + 1 for c in computed]
    # The same sequence of step inputs for both implementations.
    inputs = []
    cur = start
    for step in range(1, steps + 1):
        cur = [c + (256 if i % 8 == step % 8 else 1) for i, c in enumerate(cur)]
        inputs.append(cur)
    it = iter(inputs)

    def one_step():
        plan = core.schedule(ids, next(it), None, None, None, None, None, [])
        for j in plan.stores:
            core.complete(j.job_id)

    benchmark.pedantic(one_step, rounds=steps, iterations=1)
    t_core = benchmark.stats.stats.mean
    t0 = time.perf_counter()
    for comp in inputs:
        _, stores, _ = model.schedule(ids, comp, (), (), (), (), (), [])
        for j in stores:
            model.complete(j.id)
    t_model = (time.perf_counter() - t0) / steps
    print(
        f"\nprefill-heavy {n} requests: core {t_core * 1e6:.1f} us/step, "
        f"model {t_model * 1e6:.1f} us/step, ratio {t_model / t_core:.0f}x"
    )
    assert t_model > 0


def test_steady_decode_512_through_the_facade(benchmark):
    """The same steady decode at 512 requests, through ``OffloadScheduler.schedule``."""
    from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput

    s = OffloadScheduler(
        OffloadConfig(groups=(KvGroup(BS),), num_gpu_blocks=200_000, cpu_chunks=400_000)
    )
    ids, computed = setup(s, 512)
    state = {"computed": computed}

    def one_step():
        state["computed"] = [c + 1 for c in state["computed"]]
        step = StepInput(request_ids=ids, computed_tokens=state["computed"], written=[])
        for j in s.schedule(step).stores:
            s.complete(j.job_id)

    one_step()
    benchmark(one_step)
    print(f"\nfacade, 512 requests: {benchmark.stats.stats.mean * 1e6:.1f} us/step")
