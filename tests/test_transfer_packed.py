"""The packed hand-off: :meth:`TransferEngine.step_packed` with a plan's runs buffer.

Byte-exact copies on the CPU path for runs across groups, jobs without runs, the same result as
the lists path on a real scheduler's plans, and bad rows: each raises a ``kvoffload.errors``
exception naming the row, with nothing queued, submitted or copied.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvoffload._core import RUN_WORDS, StepPlan
from kvoffload.errors import InvalidBlockError, TransferError, UnknownJobError
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput
from kvoffload.transfer import TransferEngine

NB = 16  # GPU blocks per group
BPC = 2
SLOTS = 4  # CPU positions per group: SLOTS * BPC = 8
WAIT_S = 30.0


def pack(*rows: tuple[int, int, int, int, int]) -> bytes:
    """A runs buffer: ``(job index, group, gpu start, cpu start, length)`` per row."""
    return np.array(rows, dtype="<u4").reshape(-1, RUN_WORDS).tobytes()


def kv(seed: int) -> list[list[torch.Tensor]]:
    """Two KV groups of two tensors each, random bytes, different block sizes per group."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, 256, (NB, 8 * (g + 1)), dtype=torch.uint8, generator=gen) for _ in "kv"]
        for g in range(2)
    ]


@pytest.fixture
def eng() -> Iterator[tuple[TransferEngine, list[list[torch.Tensor]]]]:
    caches = kv(0)
    with TransferEngine(caches, blocks_per_chunk=BPC, num_slots=SLOTS) as e:
        yield e, caches


def finish(e: TransferEngine, ids: list[int]) -> dict[int, tuple[bool, int, int]]:
    e.submit_queued()
    e.wait(ids, timeout=WAIT_S)
    return {r.job_id: (r.ok, r.bytes, r.copies) for r in e.poll()}


def test_runs_across_groups_copy_exactly_their_bytes(
    eng: tuple[TransferEngine, list[list[torch.Tensor]]],
) -> None:
    e, caches = eng
    before = [[t.clone() for t in g] for g in caches]
    pool = [[e.cpu_region(g, t).clone() for t in range(2)] for g in range(2)]
    # Store 7: group 0 blocks 3,4 -> positions 5,6 and 9 -> 0; group 1 blocks 10..12 -> 1..3.
    stores = pack((0, 0, 3, 5, 2), (0, 0, 9, 0, 1), (0, 1, 10, 1, 3))
    e.step_packed([], [7], [], stores)
    assert finish(e, [7]) == {7: (True, 3 * 16 + 3 * 32, 6)}  # bytes/block: 2 x 8, 2 x 16
    for ti in range(2):
        r0, r1 = e.cpu_region(0, ti), e.cpu_region(1, ti)
        assert torch.equal(r0[5:7], caches[0][ti][3:5])
        assert torch.equal(r0[0], caches[0][ti][9])
        assert torch.equal(r1[1:4], caches[1][ti][10:13])
        p0, p1 = pool[0][ti], pool[1][ti]
        assert torch.equal(r0[1:5], p0[1:5])
        assert torch.equal(r0[7:], p0[7:])
        assert torch.equal(r1[0], p1[0])
        assert torch.equal(r1[4:], p1[4:])
    # Load 8 (index 0) puts them back elsewhere; store 9 (index 1) has no runs at all.
    loads = pack((0, 0, 0, 5, 2), (0, 1, 14, 1, 2))
    e.step_packed([8], [9], [], loads)
    assert finish(e, [8, 9]) == {8: (True, 2 * 16 + 2 * 32, 4), 9: (True, 0, 0)}
    for ti in range(2):
        assert torch.equal(caches[0][ti][0:2], before[0][ti][3:5])
        assert torch.equal(caches[1][ti][14:16], before[1][ti][10:12])
        assert torch.equal(caches[0][ti][2:], before[0][ti][2:])  # nothing else written
        assert torch.equal(caches[1][ti][:14], before[1][ti][:14])
    assert e.stats()["queued"] == 0


def test_an_empty_plan_and_a_job_without_runs(
    eng: tuple[TransferEngine, list[list[torch.Tensor]]],
) -> None:
    e, _ = eng
    e.step_packed([], [], [], b"")
    e.step_packed([3], [], [], b"")
    assert finish(e, [3]) == {3: (True, 0, 0)}


def _observable(e: TransferEngine) -> tuple[object, ...]:
    return (e.stats(), [e.cpu_region(g, t).clone() for g in range(2) for t in range(2)])


@pytest.mark.parametrize(
    ("loads", "stores", "runs", "error", "match"),
    [
        ([], [1], pack((0, 0, 15, 0, 2)), InvalidBlockError, r"runs row 0 \(group 0\): gpu_bl"),
        ([], [1], pack((0, 0, 0, 0, 1), (0, 1, 0, 7, 2)), InvalidBlockError, "runs row 1"),
        ([], [1], pack((0, 0, 0, 0, 1), (0, 1, 2**32 - 1, 0, 2)), InvalidBlockError, "row 1"),
        ([], [1], pack((0, 2, 0, 0, 1)), TransferError, "runs row 0: group 2 is not registered"),
        ([], [1], pack((0, 0, 0, 0, 1), (1, 0, 0, 0, 1)), TransferError, "row 1: job index 1"),
        ([1], [2], pack((1, 0, 0, 0, 1), (0, 0, 1, 1, 1)), TransferError, "row 1: job index 0"),
        ([], [1], pack((0, 0, 0, 3, 2), (0, 0, 5, 4, 1)), TransferError, "writes cpu_blocks 4"),
        ([1], [], pack((0, 0, 3, 0, 2), (0, 1, 3, 0, 1), (0, 0, 4, 6, 1)), TransferError, "gpu"),
        ([], [1], pack((0, 0, 0, 0, 1))[:-1], TransferError, "19 bytes is not a whole number"),
        ([], [1], "runs", TransferError, "runs must be bytes"),
        ([], [True], b"", TransferError, "store_jobs: job id must be an integer, got True"),
        ([1], [1], b"", TransferError, "job 1 is given twice"),
        ([], 5, b"", TransferError, "store_jobs must be an iterable"),
    ],
)
def test_bad_rows_are_named_and_change_nothing(
    eng: tuple[TransferEngine, list[list[torch.Tensor]]],
    loads: list[int],
    stores: object,
    runs: object,
    error: type[Exception],
    match: str,
) -> None:
    e, _ = eng
    e.step_packed([], [50], [], pack((0, 0, 0, 0, 1)))  # queued: a bad step must not submit it
    before = _observable(e)
    with pytest.raises(error, match=match):
        e.step_packed(loads, stores, [], runs)  # type: ignore[arg-type]
    after = _observable(e)
    assert after[0] == before[0]
    assert all(torch.equal(a, b) for a, b in zip(after[1], before[1], strict=True))  # type: ignore[call-overload]


def test_a_flushed_unknown_job_is_refused(
    eng: tuple[TransferEngine, list[list[torch.Tensor]]],
) -> None:
    e, _ = eng
    with pytest.raises(UnknownJobError, match="job 99"):
        e.step_packed([], [1], [99], pack((0, 0, 0, 0, 1)))
    assert e.stats()["queued"] == 0


def test_a_real_plans_runs_copy_what_its_transfers_name() -> None:
    """The core's ``StepPlan.runs`` through ``step_packed`` and the plan's transfers through
    ``step`` leave byte-identical pools and KV tensors, over plans with loads and stores in two
    groups (a request stored, finished, then loaded back by another)."""
    groups = (KvGroup(4), KvGroup(4))
    s = OffloadScheduler(OffloadConfig(groups=groups, num_gpu_blocks=NB, cpu_chunks=SLOTS * 2))
    caches = kv(1)
    mirror = [[t.clone() for t in g] for g in caches]
    a = TransferEngine(caches, blocks_per_chunk=1, num_slots=SLOTS * 2)
    b = TransferEngine(mirror, blocks_per_chunk=1, num_slots=SLOTS * 2)
    hashes = [1000, 1001, 1002]
    with a, b:
        for e in (a, b):
            for g in range(2):
                for t in range(2):
                    e.cpu_region(g, t).zero_()  # the pool is not zeroed

        def run(p: StepPlan) -> None:
            loads, stores = [j.job_id for j in p.loads], [j.job_id for j in p.stores]
            a.step_packed(loads, stores, p.flush, p.runs)
            b.step(
                [(j.job_id, j.transfers) for j in p.stores],
                p.flush,
                [(j.job_id, j.transfers) for j in p.loads],
            )
            ids = loads + stores
            assert finish(a, ids) == finish(b, ids)
            for j in ids:
                s.complete(j)

        s.add_request("x", 13, hashes)
        assert s.lookup("x", 0) == 0
        s.allocate("x", [[1, 2, 3, 9], [4, 6, 5, 10]], 0, 0)
        p = s.schedule(StepInput(scheduled=[("x", 12)]))
        assert len(p.stores) == 1
        assert len(p.runs) == 4 * RUN_WORDS * 4
        run(p)
        run(s.schedule(StepInput(finished=["x"], written=[])))
        s.add_request("y", 13, hashes)
        assert s.lookup("y", 0) == 12
        s.allocate("y", [[7, 8, 11, 12], [13, 14, 9, 15]], 0, 12)
        p = s.schedule(StepInput(scheduled=[("y", 13)]))
        assert len(p.loads) == 1
        run(p)
        for g in range(2):
            for t in range(2):
                assert a.cpu_region(g, t).any()
                assert torch.equal(a.cpu_region(g, t), b.cpu_region(g, t))
                assert torch.equal(caches[g][t], mirror[g][t])
        assert torch.equal(caches[0][0][7:9], caches[0][0][1:3])  # loaded what was stored
        assert torch.equal(caches[1][1][[13, 14, 9]], caches[1][1][[4, 6, 5]])
