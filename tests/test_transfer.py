"""Tests of the torch data plane (:mod:`kvoffload.transfer`).

Round trips over layouts, dtypes, chunk sizes and random block/slot mappings; coalescing; real
concurrency with the CPU background threads (made deterministic with a gating hook); failure
injection; shutdown; bad input. CUDA tests follow the same contract and run only on a GPU.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import (
    ConfigError,
    EngineClosedError,
    InvalidBlockError,
    KvOffloadError,
    RegistrationError,
    TransferError,
    UnknownJobError,
)
from kvoffload.transfer import TransferEngine, TransferResult

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8]
LAYOUTS = ["split", "joined", "kv_first"]
WAIT_S = 30.0  # generous bound so that a broken test fails instead of hanging


def rand_tensor(
    shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator, device: str = "cpu"
) -> torch.Tensor:
    """A tensor of random bytes (so floats may hold NaNs: compare bytes, never values)."""
    numel = int(np.prod(shape))
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(*shape).to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in logical order, on the CPU."""
    return t.detach().cpu().contiguous().view(torch.uint8)


@dataclass
class Cache:
    """A KV group for tests: its layers and, per tensor, whether it is K/V-first."""

    layers: list[tuple[torch.Tensor, ...]]
    kv_first: bool
    num_blocks: int

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer]

    def group(self) -> list[torch.Tensor | tuple[torch.Tensor, ...]]:
        return [layer[0] if len(layer) == 1 else layer for layer in self.layers]

    def region_bytes(self) -> list[torch.Tensor]:
        """Per engine region (pool order), the bytes of each block: ``[num_blocks, bpb]``."""
        out = []
        for t in self.tensors:
            b = as_bytes(t)
            if self.kv_first:
                b = b.reshape(2, self.num_blocks, -1)
                out += [b[0], b[1]]
            else:
                out.append(b.reshape(self.num_blocks, -1))
        return out

    def snapshot(self) -> list[torch.Tensor]:
        return [t.detach().cpu().clone() for t in self.tensors]

    def expected_after_copy(
        self, snap: list[torch.Tensor], src: np.ndarray, dst: np.ndarray
    ) -> list[torch.Tensor]:
        """``snap`` with block ``dst[i]`` replaced by block ``src[i]`` in every tensor."""
        s, d = torch.as_tensor(src), torch.as_tensor(dst)
        out = []
        for t in snap:
            e = t.clone()
            if self.kv_first:
                e[:, d] = t[:, s]
            else:
                e[d] = t[s]
            out.append(e)
        return out

    def assert_bytes(self, expected: list[torch.Tensor]) -> None:
        for i, (t, e) in enumerate(zip(self.tensors, expected, strict=True)):
            assert torch.equal(as_bytes(t), as_bytes(e)), f"tensor {i} differs"


def make_cache(
    layout: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    *,
    num_blocks: int = 40,
    num_layers: int = 2,
    block_shape: tuple[int, ...] = (4, 2, 8),
    device: str = "cpu",
) -> Cache:
    """``split``: (K, V) per layer ``[nb, ...]``; ``joined``: ``[nb, 2, ...]``; ``kv_first``:
    ``[2, nb, ...]``."""
    layers: list[tuple[torch.Tensor, ...]] = []
    for _ in range(num_layers):
        if layout == "split":
            k = rand_tensor((num_blocks, *block_shape), dtype, gen, device)
            v = rand_tensor((num_blocks, *block_shape), dtype, gen, device)
            layers.append((k, v))
        elif layout == "joined":
            layers.append((rand_tensor((num_blocks, 2, *block_shape), dtype, gen, device),))
        else:
            layers.append((rand_tensor((2, num_blocks, *block_shape), dtype, gen, device),))
    return Cache(layers, layout == "kv_first", num_blocks)


def engine_for(cache: Cache, **kwargs: object) -> TransferEngine:
    layout = "kv_first" if cache.kv_first else "blocks_first"
    return TransferEngine([cache.group()], layout=layout, **kwargs)  # type: ignore[arg-type]


def random_mapping(
    rng: np.random.Generator, num_blocks: int, num_cpu: int, bpc: int
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct GPU blocks and distinct CPU positions, of one of three shapes."""
    m = int(rng.integers(1, 13))
    style = int(rng.integers(3))
    if style == 0:  # one run, starting in the middle of a chunk where possible
        slot = int(rng.integers(0, (num_cpu - m) // bpc + 1))
        c0 = min(slot * bpc + (1 if bpc > 1 else 0), num_cpu - m)
        g0 = int(rng.integers(0, num_blocks - m + 1))
        return np.arange(g0, g0 + m), np.arange(c0, c0 + m)
    g = rng.choice(num_blocks, m, replace=False)
    c = rng.choice(num_cpu, m, replace=False)
    if style == 1:  # sorted subsets: partial runs
        g, c = np.sort(g), np.sort(c)
    return g, c


def count_runs(g: Sequence[int] | np.ndarray, c: Sequence[int] | np.ndarray) -> int:
    """Reference count of runs where both sides step by one (plain Python)."""
    if len(g) == 0:
        return 0
    return 1 + sum(
        1 for i in range(len(g) - 1) if not (g[i + 1] == g[i] + 1 and c[i + 1] == c[i] + 1)
    )


def run_one(engine: TransferEngine, job_id: int) -> TransferResult:
    """Wait for one job and return its result from poll."""
    engine.wait([job_id], timeout=WAIT_S)
    results = engine.poll()
    assert [r.job_id for r in results] == [job_id]
    return results[0]


def round_trip(
    engine: TransferEngine,
    cache: Cache,
    rng: np.random.Generator,
    *,
    check_region: bool = True,
) -> None:
    """Store a random mapping, check the pool, load into other blocks, check everything."""
    nb, n_cpu = cache.num_blocks, engine.num_slots * engine.blocks_per_chunk
    src, cpos = random_mapping(rng, nb, n_cpu, engine.blocks_per_chunk)
    snap = cache.snapshot()

    # Split the mapping into two transfers (numpy array and list) to cover both inputs.
    cut = int(rng.integers(0, len(src) + 1))
    engine.submit_store(1, [(0, src[:cut], cpos[:cut]), (0, src[cut:].tolist(), cpos[cut:])])
    res = run_one(engine, 1)
    assert res.ok, res.error
    assert res.kind == "store"
    assert res.bytes == len(src) * engine.bytes_per_slot(0) // engine.blocks_per_chunk
    assert res.copies == (
        count_runs(src[:cut], cpos[:cut]) + count_runs(src[cut:], cpos[cut:])
    ) * engine.num_tensors(0)
    cache.assert_bytes(snap)  # the source is unchanged
    if check_region:
        for i, rb in enumerate(cache.region_bytes()):
            region = engine.cpu_region(0, i)
            assert torch.equal(region[torch.as_tensor(cpos)], rb[torch.as_tensor(src)])

    others = np.setdiff1d(np.arange(nb), src)
    dst = rng.choice(others, len(src), replace=False)
    order = rng.permutation(len(src))  # load the pairs in another order
    engine.submit_load(2, [(0, dst[order], cpos[order])])
    res = run_one(engine, 2)
    assert res.ok, res.error
    assert res.kind == "load"
    cache.assert_bytes(cache.expected_after_copy(snap, src, dst))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bpc", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip(layout: str, dtype: torch.dtype, bpc: int, device: str) -> None:
    seed = zlib.crc32(f"{layout}-{dtype}-{bpc}".encode())
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    cache = make_cache(layout, dtype, gen, device=device)
    with engine_for(cache, blocks_per_chunk=bpc, num_slots=24 // bpc + 1) as eng:
        for _ in range(3):
            round_trip(eng, cache, rng)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    layout=st.sampled_from(LAYOUTS),
    bpc=st.sampled_from([1, 3, 4]),
)
def test_round_trip_random_mappings(seed: int, layout: str, bpc: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    cache = make_cache(layout, torch.bfloat16, gen, num_blocks=30, num_layers=1)
    with engine_for(cache, blocks_per_chunk=bpc, num_slots=16 // bpc + 1) as eng:
        round_trip(eng, cache, rng)


def test_store_starting_mid_chunk_lands_at_the_offset() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = make_cache("split", torch.float16, gen, num_blocks=16, num_layers=1)
    with engine_for(cache, blocks_per_chunk=4, num_slots=3) as eng:
        before = [eng.cpu_region(0, i).clone() for i in range(2)]
        # gpu blocks 5..7 -> slot 1, offsets 1..3, then block 9 -> slot 2 offset 0 (one run)
        eng.submit_store(1, [(0, [5, 6, 7, 9], [5, 6, 7, 8])])
        res = run_one(eng, 1)
        assert res.ok
        assert res.copies == 2 * 2  # runs [5,6,7]->[5,6,7] and [9]->[8], two tensors
        for i, rb in enumerate(cache.region_bytes()):
            region = eng.cpu_region(0, i)
            assert torch.equal(region[5:8], rb[5:8])
            assert torch.equal(region[8], rb[9])
            assert torch.equal(region[:5], before[i][:5])  # slot 1 offset 0 untouched
            assert torch.equal(region[9:], before[i][9:])


@pytest.mark.parametrize("device", DEVICES)
def test_several_groups_are_independent(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    rng = np.random.default_rng(2)
    full = make_cache("kv_first", torch.bfloat16, gen, num_blocks=20, device=device)
    window = make_cache("split", torch.float32, gen, num_blocks=12, num_layers=3, device=device)
    eng = TransferEngine(
        [full.group(), {f"swa.{i}": layer for i, layer in enumerate(window.group())}],
        layout=["kv_first", "blocks_first"],
        blocks_per_chunk=2,
        num_slots=5,
    )
    with eng:
        assert eng.num_groups == 2
        assert (eng.num_blocks(0), eng.num_blocks(1)) == (20, 12)
        assert (eng.num_tensors(0), eng.num_tensors(1)) == (4, 6)
        assert "swa.2" in eng.tensor_names(1)[-1]
        snap_f, snap_w = full.snapshot(), window.snapshot()
        eng.submit_store(1, [(0, [3, 4], [0, 1]), (1, [3, 4], [0, 1])])
        assert run_one(eng, 1).ok
        eng.submit_load(2, [(1, [7, 8], [0, 1])])  # only group 1
        assert run_one(eng, 2).ok
        full.assert_bytes(snap_f)
        window.assert_bytes(window.expected_after_copy(snap_w, np.array([3, 4]), np.array([7, 8])))
        del rng


@pytest.mark.parametrize("device", DEVICES)
def test_permuted_and_padded_layouts_round_trip(device: str) -> None:
    """Inner dims in stride order (vLLM's stride order) and blocks with padding between them."""
    gen = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(3)
    # physical [nb, heads, block_size, head_dim], registered as [nb, block_size, heads, head_dim]
    k = rand_tensor((24, 2, 4, 8), torch.bfloat16, gen, device).permute(0, 2, 1, 3)
    # every block followed by as many bytes of padding: shape [nb, 64], strides (128, 1)
    v = rand_tensor((24, 2, 64), torch.float16, gen, device)[:, 0]
    cache = Cache([(k,)], kv_first=False, num_blocks=24)
    cache_v = Cache([(v,)], kv_first=False, num_blocks=24)
    for c in (cache, cache_v):
        with engine_for(c, blocks_per_chunk=2, num_slots=8) as eng:
            for _ in range(3):
                round_trip(eng, c, rng, check_region=False)


def test_capacity_from_bytes() -> None:
    gen = torch.Generator().manual_seed(4)
    cache = make_cache("split", torch.float16, gen, num_blocks=8, num_layers=3)
    bpb = 4 * 2 * 8 * 2  # bytes per block of one tensor
    per_slot = 3 * 2 * bpb * 4  # 3 layers, K and V, bpc = 4
    with engine_for(cache, blocks_per_chunk=4, cpu_bytes=10 * per_slot + per_slot - 1) as eng:
        assert eng.num_slots == 10
        assert eng.bytes_per_slot(0) == per_slot
        assert eng.pool_bytes == 10 * per_slot
        assert eng.cpu_region(0, 5).shape == (40, bpb)
        assert not eng.pinned


# --------------------------------------------------------------------------- coalescing


@pytest.mark.parametrize("device", DEVICES)
def test_copies_are_coalesced_into_runs(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    cache = make_cache("split", torch.float16, gen, num_blocks=32, device=device)  # 4 tensors
    with engine_for(cache, blocks_per_chunk=1, num_slots=16) as eng:
        # runs: [3,4,5]->[0,1,2] | [9,10]->[3,4] (gpu jumps) | [11]->[6] (cpu jumps) | [20]->[7]
        eng.submit_store(1, [(0, [3, 4, 5, 9, 10, 11, 20], [0, 1, 2, 3, 4, 6, 7])])
        assert run_one(eng, 1).copies == 4 * 4
        # bpc = 1 and 16 consecutive slots: one run across every slot boundary
        eng.submit_store(2, [(0, np.arange(16, 32), np.arange(16))])
        assert run_one(eng, 2).copies == 1 * 4
        # fully scattered: one copy per block per tensor
        eng.submit_load(3, [(0, [0, 2, 4], [5, 3, 1])])
        assert run_one(eng, 3).copies == 3 * 4
        assert eng.stats()["copies"] == (4 + 1 + 3) * 4


@settings(max_examples=50, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63)), max_size=40))
def test_copy_count_matches_reference_run_count(pairs: list[tuple[int, int]]) -> None:
    # a store needs distinct destinations (cpu positions); gpu sources may repeat
    g: list[int] = []
    c: list[int] = []
    for gi, ci in pairs:
        if ci not in c:
            g.append(gi)
            c.append(ci)
    k = torch.zeros(64, 16, dtype=torch.uint8)
    with TransferEngine([[k]], blocks_per_chunk=8, num_slots=8) as eng:
        eng.submit_store(7, [(0, g, c)])
        res = run_one(eng, 7)
        assert res.copies == count_runs(g, c)
        assert res.bytes == 16 * len(g)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("pattern", ["contiguous", "scattered"])
def test_large_jobs_split_over_copy_threads(threads: int, pattern: str) -> None:
    """Jobs of >= 2 MiB are split over cpu_copy_threads (threads inside the core's copy call);
    bytes and copy counts are unchanged."""
    gen = torch.Generator().manual_seed(17)
    rng = np.random.default_rng(17)
    cache = make_cache("split", torch.float16, gen, num_blocks=112, block_shape=(16, 8, 64))
    with engine_for(cache, blocks_per_chunk=4, num_slots=16, cpu_copy_threads=threads) as eng:
        if pattern == "contiguous":
            src, cpos = np.arange(8, 56), np.arange(48)
        else:
            src, cpos = rng.choice(112, 48, replace=False), rng.permutation(64)[:48]
        snap = cache.snapshot()
        eng.submit_store(1, [(0, src, cpos)])
        res = run_one(eng, 1)
        assert res.ok
        assert res.bytes == 48 * 4 * 16 * 1024  # 3 MiB: over the split threshold
        assert res.copies == count_runs(src, cpos) * 4
        for i, rb in enumerate(cache.region_bytes()):
            assert torch.equal(eng.cpu_region(0, i)[torch.as_tensor(cpos)], rb[src])
        dst = rng.choice(np.setdiff1d(np.arange(112), src), 48, replace=False)
        eng.submit_load(2, [(0, dst, cpos)])
        assert run_one(eng, 2).ok
        cache.assert_bytes(cache.expected_after_copy(snap, src, dst))


@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_larger_than_a_copy_piece(threads: int) -> None:
    """Blocks of 320 KiB are copied in 256 KiB pieces plus a tail; the bytes must not care."""
    gen = torch.Generator().manual_seed(18)
    k = rand_tensor((16, 320 * 1024), torch.uint8, gen)
    cache = Cache([(k,)], kv_first=False, num_blocks=16)
    with TransferEngine([[k]], blocks_per_chunk=2, num_slots=4, cpu_copy_threads=threads) as eng:
        snap = cache.snapshot()
        src = np.array([1, 2, 3, 7, 8, 9, 12, 13])  # 2.5 MiB: split over the threads
        cpos = np.array([4, 5, 0, 1, 2, 3, 6, 7])  # runs [1,2] [3] [7,8,9] [12,13]
        eng.submit_store(1, [(0, src, cpos)])
        assert run_one(eng, 1).copies == 4
        assert torch.equal(eng.cpu_region(0, 0)[torch.as_tensor(cpos)], snap[0][src])
        dst = np.array([0, 4, 5, 6, 10, 11, 14, 15])
        eng.submit_load(2, [(0, dst, cpos)])
        assert run_one(eng, 2).ok
        cache.assert_bytes(cache.expected_after_copy(snap, src, dst))


# --------------------------------------------------------------------------- concurrency (CPU)


class Gate:
    """A ``_before_copy`` hook that holds copy ``index`` of ``job`` until released."""

    def __init__(self, job: int, index: int = 0) -> None:
        self.job, self.index = job, index
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: set[str] = set()

    def __call__(self, job_id: int, copy_index: int) -> None:
        self.threads.add(threading.current_thread().name)
        if job_id == self.job and copy_index == self.index:
            self.entered.set()
            if not self.release.wait(WAIT_S):
                raise TimeoutError("gate never released")


def test_store_is_isolated_from_writes_to_other_blocks_and_after_wait() -> None:
    gen = torch.Generator().manual_seed(6)
    cache = make_cache("split", torch.float16, gen, num_blocks=16, num_layers=2)
    gate = Gate(job=1)
    with engine_for(cache, blocks_per_chunk=2, num_slots=4, _before_copy=gate) as eng:
        src = np.array([1, 2, 5])
        want = [rb[torch.as_tensor(src)].clone() for rb in cache.region_bytes()]
        eng.submit_store(1, [(0, src, [0, 1, 2])])
        assert gate.entered.wait(WAIT_S)  # the copy is running on the background thread
        for t in cache.tensors:  # the caller keeps writing other blocks meanwhile
            t[[0, 3, 4, 6, 7]] = 1
        gate.release.set()
        eng.wait([1], timeout=WAIT_S)
        for t in cache.tensors:  # after wait, the job's own blocks may be overwritten
            t[torch.as_tensor(src)] = 2
        for i, w in enumerate(want):
            assert torch.equal(eng.cpu_region(0, i)[:3], w)
        assert run_one(eng, 1).ok
        assert threading.current_thread().name not in gate.threads
        assert gate.threads == {"kvoffload-store"}


def test_slowed_store_with_concurrent_writes_keeps_pre_overwrite_bytes() -> None:
    gen = torch.Generator().manual_seed(7)
    cache = make_cache("kv_first", torch.bfloat16, gen, num_blocks=16, num_layers=2)
    with engine_for(cache, blocks_per_chunk=1, num_slots=8, _copy_delay_s=0.005) as eng:
        src = np.array([1, 3, 5, 7])  # 4 runs x 4 regions = 16 slowed copies
        want = [rb[torch.as_tensor(src)].clone() for rb in cache.region_bytes()]
        eng.submit_store(1, [(0, src, [0, 1, 2, 3])])
        for t in cache.tensors:
            t[:, [0, 2, 4, 6, 8]] = 3  # other blocks, while the store runs
        eng.wait([1], timeout=WAIT_S)
        for t in cache.tensors:
            t[:, torch.as_tensor(src)] = 4
        for i, w in enumerate(want):
            assert torch.equal(eng.cpu_region(0, i)[:4], w)
        assert run_one(eng, 1).ok


def test_without_wait_a_slow_copy_sees_a_later_overwrite() -> None:
    """The race the fence exists for is real here: overwriting a source before its store has
    read it changes what the CPU tier holds."""
    gen = torch.Generator().manual_seed(8)
    cache = make_cache("split", torch.float16, gen, num_blocks=8, num_layers=1)
    gate = Gate(job=1)
    with engine_for(cache, blocks_per_chunk=1, num_slots=4, _before_copy=gate) as eng:
        original = [rb[3].clone() for rb in cache.region_bytes()]
        eng.submit_store(1, [(0, [3], [0])])
        assert gate.entered.wait(WAIT_S)
        for t in cache.tensors:
            t[3] = 7.0  # no wait: the store has not read block 3 yet
        overwritten = [rb[3].clone() for rb in cache.region_bytes()]
        gate.release.set()
        assert run_one(eng, 1).ok
        for i in range(2):
            assert torch.equal(eng.cpu_region(0, i)[0], overwritten[i])
            assert not torch.equal(eng.cpu_region(0, i)[0], original[i])


def test_loads_do_not_queue_behind_stores() -> None:
    gen = torch.Generator().manual_seed(9)
    cache = make_cache("split", torch.int8, gen, num_blocks=8, num_layers=1)
    gate = Gate(job=1)
    with engine_for(cache, blocks_per_chunk=1, num_slots=4, _before_copy=gate) as eng:
        eng.submit_store(1, [(0, [0], [0])])
        assert gate.entered.wait(WAIT_S)
        eng.submit_load(2, [(0, [5], [3])])
        eng.wait([2], timeout=WAIT_S)  # returns although the store is held
        assert [r.job_id for r in eng.poll()] == [2]
        gate.release.set()
        assert run_one(eng, 1).ok


def test_wait_blocks_until_the_bytes_are_there() -> None:
    gen = torch.Generator().manual_seed(10)
    cache = make_cache("joined", torch.float32, gen, num_blocks=12, num_layers=3)
    with engine_for(cache, blocks_per_chunk=1, num_slots=8, _copy_delay_s=0.002) as eng:
        src = np.array([0, 2, 4, 6, 8, 10])
        eng.submit_store(1, [(0, src, np.arange(6))])
        eng.wait([1])
        for i, rb in enumerate(cache.region_bytes()):  # checked before poll
            assert torch.equal(eng.cpu_region(0, i)[:6], rb[torch.as_tensor(src)])
        [res] = eng.poll()
        assert (res.job_id, res.ok, res.copies) == (1, True, 6 * 3)
        assert res.seconds > 0
        assert eng.poll() == []  # each result exactly once


# --------------------------------------------------------------------------- queue, wait, fence


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flush", ["wait", "fence", "submit_queued"])
def test_queued_store_starts_only_when_submitted_or_flushed(device: str, flush: str) -> None:
    gen = torch.Generator().manual_seed(11)
    cache = make_cache("split", torch.float16, gen, num_blocks=8, num_layers=1, device=device)
    calls: list[int] = []
    with engine_for(cache, blocks_per_chunk=2, num_slots=2, _fault_injector=calls.append) as eng:
        eng.queue_store(5, [(0, [2, 3], [0, 1])])
        eng.queue_store(6, [(0, [4], [2])])
        assert eng.stats()["queued"] == 2
        assert eng.poll() == []
        assert calls == []  # accepted, not started
        if flush == "wait":
            with pytest.raises(UnknownJobError, match="job 99 was never"):
                eng.wait([5, 99])  # 99: unknown, so nothing is submitted or waited for
            assert eng.stats()["queued"] == 2
            eng.wait([5])
        elif flush == "fence":
            eng.fence([5])
        else:
            assert eng.submit_queued() == [5, 6]
        if device == "cuda":
            torch.cuda.synchronize()
        eng.wait([5], timeout=WAIT_S)
        assert 5 in calls
        results = {r.job_id: r for r in eng.poll()}
        assert results[5].ok
        for i, rb in enumerate(cache.region_bytes()):
            assert torch.equal(eng.cpu_region(0, i)[:2], rb[2:4])
        assert eng.stats()["queued"] == (0 if flush == "submit_queued" else 1)
        eng.wait([5, 6], timeout=WAIT_S)  # finished (polled) ids are fine too
        assert eng.stats()["queued"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_empty_job_completes(device: str) -> None:
    k = torch.zeros(4, 8, device=device)
    with TransferEngine([[k]], blocks_per_chunk=1, num_slots=1) as eng:
        eng.submit_load(1, [])
        eng.submit_store(2, [(0, [], np.array([], dtype=np.int32))])
        eng.wait([1, 2], timeout=WAIT_S)
        results = sorted(eng.poll(), key=lambda r: r.job_id)
        assert [(r.job_id, r.ok, r.bytes, r.copies) for r in results] == [
            (1, True, 0, 0),
            (2, True, 0, 0),
        ]


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("device", DEVICES)
def test_injected_failure_fails_only_its_job(device: str) -> None:
    gen = torch.Generator().manual_seed(12)
    cache = make_cache("split", torch.float16, gen, num_blocks=8, num_layers=1, device=device)

    def fault(job_id: int) -> None:
        if job_id == 2:
            raise OSError("simulated copy failure")

    with engine_for(cache, blocks_per_chunk=1, num_slots=8, _fault_injector=fault) as eng:
        eng.submit_store(1, [(0, [0], [0])])
        eng.submit_store(2, [(0, [1], [1])])
        eng.submit_load(3, [(0, [5], [0])])
        eng.wait([1, 2, 3], timeout=WAIT_S)
        results = {r.job_id: r for r in eng.poll()}
        assert sorted(results) == [1, 2, 3]
        assert results[1].ok
        assert results[3].ok
        failed = results[2]
        assert not failed.ok
        assert failed.error == "OSError: simulated copy failure"
        assert (failed.copies, failed.bytes) == (0, 0)
        # the engine keeps working, and a new job may reuse the failed job's positions
        eng.submit_store(4, [(0, [6], [1])])
        assert run_one(eng, 4).ok
        assert torch.equal(eng.cpu_region(0, 0)[1], cache.region_bytes()[0][6])
        assert eng.stats()["jobs_failed"] == 1
        assert eng.stats()["jobs_ok"] == 3


@pytest.mark.parametrize("device", DEVICES)
def test_failure_in_the_middle_of_a_job(device: str) -> None:
    gen = torch.Generator().manual_seed(13)
    cache = make_cache("split", torch.float16, gen, num_blocks=8, num_layers=2, device=device)

    def before_copy(job_id: int, index: int) -> None:
        if job_id == 1 and index == 1:
            raise RuntimeError("link reset")

    with engine_for(cache, blocks_per_chunk=1, num_slots=8, _before_copy=before_copy) as eng:
        eng.submit_load(1, [(0, [0, 1], [0, 1])])
        res = run_one(eng, 1)
        assert not res.ok
        assert res.error == "RuntimeError: link reset"
        assert res.copies == 1
        assert res.bytes == 2 * 128  # one run of 2 blocks of 4*2*8 fp16 from the first tensor
        eng.submit_load(2, [(0, [0, 1], [0, 1])])  # same job content, new id: fine
        assert run_one(eng, 2).ok


@pytest.mark.parametrize("device", DEVICES)
def test_shutdown_drains_in_flight_and_queued_jobs(device: str) -> None:
    gen = torch.Generator().manual_seed(14)
    cache = make_cache("split", torch.float16, gen, num_blocks=8, num_layers=1, device=device)
    eng = engine_for(cache, blocks_per_chunk=1, num_slots=8, _copy_delay_s=0.002)
    eng.submit_store(1, [(0, [0, 2, 4], [0, 1, 2])])
    eng.submit_load(2, [(0, [7], [5])])
    eng.queue_store(3, [(0, [6], [6])])
    results = {r.job_id: r for r in eng.shutdown(wait=True)}
    assert sorted(results) == [1, 2, 3]
    assert all(r.ok for r in results.values())
    rb = cache.region_bytes()
    assert torch.equal(eng.cpu_region(0, 0)[:3], rb[0][[0, 2, 4]])
    assert torch.equal(eng.cpu_region(0, 1)[6], rb[1][6])
    assert eng.closed
    assert eng.shutdown() == []


def test_shutdown_without_wait_cancels_unfinished_jobs() -> None:
    gen = torch.Generator().manual_seed(15)
    cache = make_cache("split", torch.float16, gen, num_blocks=8, num_layers=1)
    gate = Gate(job=1)
    eng = engine_for(cache, blocks_per_chunk=1, num_slots=8, _before_copy=gate)
    eng.submit_store(1, [(0, [0, 2], [0, 1])])  # held at its first copy
    eng.submit_store(2, [(0, [3], [3])])  # waits behind job 1 on the store thread
    eng.queue_store(3, [(0, [4], [4])])  # never submitted
    assert gate.entered.wait(WAIT_S)
    cancel = eng._resources.lanes["store"].cancel

    def release_once_cancelled() -> None:  # job 1 leaves the hook only after shutdown began
        cancel.wait(WAIT_S)
        gate.release.set()

    releaser = threading.Thread(target=release_once_cancelled)
    releaser.start()
    results = {r.job_id: r for r in eng.shutdown(wait=False)}
    releaser.join()
    assert sorted(results) == [1, 2, 3]
    for r in results.values():
        assert not r.ok
        assert r.error is not None
        assert r.error.startswith("cancelled by shutdown")
    assert results[1].copies == 1  # stopped between copies
    assert results[2].copies == 0
    assert results[3].copies == 0
    assert results[3].seconds == 0.0
    lanes = eng._resources.lanes.values()
    assert not any(lane._thread.is_alive() for lane in lanes)


def test_use_after_shutdown_raises() -> None:
    k = torch.zeros(4, 8)
    with TransferEngine([[k]], blocks_per_chunk=1, num_slots=2) as eng:
        pass
    assert eng.closed
    calls: list[Callable[[], object]] = [
        lambda: eng.submit_store(1, [(0, [0], [0])]),
        lambda: eng.submit_load(1, [(0, [0], [0])]),
        lambda: eng.queue_store(1, [(0, [0], [0])]),
        eng.submit_queued,
        eng.poll,
        lambda: eng.wait([1]),
        lambda: eng.fence([1]),
    ]
    for call in calls:
        with pytest.raises(EngineClosedError, match="shut down"):
            call()
    assert eng.shutdown() == []


def test_context_manager_exit_on_error_cancels() -> None:
    k = torch.zeros(4, 8)
    gate = Gate(job=1)
    eng = TransferEngine([[k]], blocks_per_chunk=1, num_slots=2, _before_copy=gate)

    def step_that_raises() -> None:
        with eng:
            eng.queue_store(1, [(0, [0], [0])])
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        step_that_raises()
    assert eng.closed
    assert not gate.entered.is_set()  # the queued job was cancelled, not run


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def small() -> Iterator[tuple[TransferEngine, Cache]]:
    gen = torch.Generator().manual_seed(16)
    cache = make_cache("split", torch.float16, gen, num_blocks=8, num_layers=1)
    eng = engine_for(cache, blocks_per_chunk=2, num_slots=3)
    yield eng, cache
    eng.shutdown()


@pytest.mark.parametrize(
    ("transfers", "error", "match"),
    [
        ([(1, [0], [0])], TransferError, "names group 1, but 1 groups are registered"),
        ([(-1, [0], [0])], TransferError, "names group -1"),
        ([(0, [0, 8], [0, 1])], InvalidBlockError, r"gpu_blocks\[1\] = 8 is out of range"),
        ([(0, [-1], [0])], InvalidBlockError, r"gpu_blocks\[0\] = -1 is out of range"),
        ([(0, [0], [6])], InvalidBlockError, r"cpu_blocks\[0\] = 6 is out of range \[0, 6\)"),
        ([(0, [0, 1], [0])], TransferError, "2 gpu_blocks but 1 cpu_blocks"),
        ([(0, [0.0], [0])], TransferError, "must be integers"),
        ([(0, [[0]], [[0]])], TransferError, "one-dimensional"),
        ([(0, [0])], TransferError, "not a .group, gpu_blocks, cpu_blocks. triple"),
        ([(0, [0], [1]), (0, [1], [1])], TransferError, "writes cpu_blocks 1 twice"),
        (5, TransferError, "iterable"),
    ],
)
@pytest.mark.parametrize("method", ["submit_store", "submit_load", "queue_store"])
def test_bad_jobs_raise_and_change_nothing(
    small: tuple[TransferEngine, Cache],
    transfers: object,
    error: type[Exception],
    match: str,
    method: str,
) -> None:
    eng, cache = small
    if method == "submit_load" and "cpu_blocks 1 twice" in match:
        transfers, match = [(0, [2], [0]), (0, [2], [1])], "writes gpu_blocks 2 twice"
    snap = cache.snapshot()
    pool = [eng.cpu_region(0, i).clone() for i in range(2)]
    stats = eng.stats
    with pytest.raises(error, match=match):
        getattr(eng, method)(3, transfers)
    assert issubclass(error, KvOffloadError)
    assert eng.stats == stats
    with pytest.raises(UnknownJobError, match="job 3 was never queued or submitted"):
        eng.wait([3], timeout=WAIT_S)  # the rejected job left no trace
    assert eng.poll() == []
    cache.assert_bytes(snap)
    for i in range(2):
        assert torch.equal(eng.cpu_region(0, i), pool[i])
    eng.submit_store(3, [(0, [1], [1])])  # the id was not taken
    assert run_one(eng, 3).ok


def test_duplicate_job_id_is_rejected_until_polled(small: tuple[TransferEngine, Cache]) -> None:
    eng, _ = small
    eng.queue_store(1, [(0, [0], [0])])
    with pytest.raises(TransferError, match="job 1 is already queued"):
        eng.submit_load(1, [(0, [0], [0])])
    eng.submit_queued()
    eng.wait([1], timeout=WAIT_S)
    with pytest.raises(TransferError, match="job 1 is already queued or not yet polled"):
        eng.submit_store(1, [(0, [0], [0])])
    assert [r.job_id for r in eng.poll()] == [1]
    eng.submit_store(1, [(0, [0], [0])])
    assert run_one(eng, 1).ok


def test_accepts_numpy_integer_inputs(small: tuple[TransferEngine, Cache]) -> None:
    eng, cache = small
    eng.submit_store(
        np.int64(4), [(np.int32(0), np.array([1, 2], np.uint16), np.array([2, 3], np.int32))]
    )
    res = run_one(eng, 4)
    assert res.ok
    assert res.copies == 2
    assert torch.equal(eng.cpu_region(0, 1)[2:4], cache.region_bytes()[1][1:3])


def test_registration_errors_name_the_tensor() -> None:
    ok = torch.zeros(8, 4, 16, dtype=torch.float16)
    cases: list[tuple[object, dict[str, object], str]] = [
        (
            [{"l0": (ok, ok), "l1": (ok, torch.zeros(9, 4, 16, dtype=torch.float16))}],
            {},
            r"group 0 l1 \[v\] has num_blocks=9, but .* has 8",
        ),
        (
            [[ok, torch.zeros(8, 4, 16, dtype=torch.bfloat16)]],
            {},
            r"group 0 layer 1 has dtype torch.bfloat16, but group 0 layer 0 has torch.float16",
        ),
        ([[ok], [torch.zeros(8, 4, device="meta")]], {}, "group 1 layer 0: unsupported device"),
        (
            [[ok]],
            {"layout": "kv_first"},
            r"needs shape \[2, num_blocks, \.\.\.\], got \(8, 4, 16\)",
        ),
        ([[torch.zeros(16, 8, 4).transpose(0, 1)]], {}, "not one dense range"),
        ([[torch.zeros(0, 4)]], {}, "num_blocks is 0"),
        ([[torch.zeros(8, 0)]], {}, "blocks are empty"),
        ([[]], {}, "group 0 has no layers"),
        ([[[ok, "v"]]], {}, "a layer must be a tensor or a non-empty tuple of tensors"),
        (ok, {}, "must be a sequence of KV groups"),
        ([], {}, "kv_caches is empty"),
    ]
    for kv, kwargs, match in cases:
        with pytest.raises(RegistrationError, match=match):
            TransferEngine(kv, blocks_per_chunk=1, num_slots=1, **kwargs)  # type: ignore[arg-type]


def test_config_errors() -> None:
    k = torch.zeros(8, 16, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="blocks_per_chunk must be >= 1"):
        TransferEngine([[k]], blocks_per_chunk=0, num_slots=1)
    with pytest.raises(ConfigError, match="exactly one of num_slots and cpu_bytes"):
        TransferEngine([[k]], blocks_per_chunk=1)
    with pytest.raises(ConfigError, match="exactly one of num_slots and cpu_bytes"):
        TransferEngine([[k]], blocks_per_chunk=1, num_slots=1, cpu_bytes=1 << 20)
    with pytest.raises(ConfigError, match=r"cpu_bytes=31 is less than one slot .*32 bytes"):
        TransferEngine([[k]], blocks_per_chunk=2, cpu_bytes=31)
    with pytest.raises(ConfigError, match="num_slots must be >= 1"):
        TransferEngine([[k]], blocks_per_chunk=1, num_slots=0)
    with pytest.raises(ConfigError, match="2 layouts given for 1 KV groups"):
        TransferEngine([[k]], blocks_per_chunk=1, num_slots=1, layout=["kv_first"] * 2)
    with pytest.raises(ConfigError, match="cpu_copy_threads must be >= 1"):
        TransferEngine([[k]], blocks_per_chunk=1, num_slots=1, cpu_copy_threads=0)
    with pytest.raises(ConfigError, match="layout must be"):
        TransferEngine([[k]], blocks_per_chunk=1, num_slots=1, layout="heads_first")  # type: ignore[arg-type]
    if not HAS_CUDA:
        with pytest.raises(ConfigError, match="pin_memory=True needs CUDA"):
            TransferEngine([[k]], blocks_per_chunk=1, num_slots=1, pin_memory=True)


# --------------------------------------------------------------------------- CUDA only


@needs_cuda
def test_cuda_pool_is_pinned_without_power_of_two_growth() -> None:
    k = torch.zeros(16, 3, 1000, dtype=torch.uint8, device="cuda")
    with TransferEngine([[k]], blocks_per_chunk=1, num_slots=7) as eng:
        assert eng.pinned
        assert eng.pool_bytes == 7 * 3000
        assert eng.cpu_region(0, 0).is_pinned()


@needs_cuda
def test_cuda_mixed_devices_rejected() -> None:
    with pytest.raises(RegistrationError, match=r"layer 1 is on cpu, but group 0 layer 0 is on"):
        TransferEngine(
            [[torch.zeros(4, 8, device="cuda"), torch.zeros(4, 8)]],
            blocks_per_chunk=1,
            num_slots=1,
        )


@needs_cuda
def test_cuda_store_is_ordered_after_the_compute_that_wrote_its_blocks() -> None:
    k = torch.zeros(8, 1 << 16, dtype=torch.uint8, device="cuda")
    with TransferEngine([[k]], blocks_per_chunk=1, num_slots=4) as eng:
        torch.cuda._sleep(50_000_000)  # keep the compute stream busy
        k[2].fill_(9)  # "the forward pass writes block 2"
        eng.submit_store(1, [(0, [2], [0])])  # must read the 9s, not the zeros
        eng.wait([1])
        assert run_one(eng, 1).ok
        assert bool((eng.cpu_region(0, 0)[0] == 9).all())


@needs_cuda
def test_cuda_fence_orders_compute_after_the_job() -> None:
    k = torch.full((8, 1 << 16), 5, dtype=torch.uint8, device="cuda")
    with TransferEngine([[k]], blocks_per_chunk=1, num_slots=4, _copy_delay_s=0.0) as eng:
        eng.submit_store(1, [(0, [3], [0])])
        eng.fence([1])  # host does not block
        k[3].fill_(1)  # ordered after the store on the compute stream
        eng.submit_load(2, [(0, [6], [0])])
        eng.fence([2])
        out = k[6].clone()  # ordered after the load
        torch.cuda.synchronize()
        assert bool((eng.cpu_region(0, 0)[0] == 5).all())
        assert bool((out == 5).all())
        assert bool((k[3] == 1).all())
        eng.wait([1, 2])
        assert sorted(r.job_id for r in eng.poll()) == [1, 2]
