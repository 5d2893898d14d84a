"""A small engine (scheduler + CPU TransferEngine + RemoteWorker) sharing the Redis tier, for
tests that run engines in separate processes.

    python -m tests.remote_engine URL SALT    # engine A: computes request "a", writes it behind
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from kvoffload._core import RemoteWorker
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput
from kvoffload.transfer import TransferEngine
from kvoffload.transfer.remote import open_remote_worker

BLOCK = 16
HASHES = [0xA1, 0xA2, 0xA3]
PROMPT = 3 * BLOCK + 5
MODEL = "toy"


def config(url: str, salt: str = "", **kw: Any) -> OffloadConfig:
    """The engines' configuration: one group, 8 CPU slots, the shared tier at ``url``."""
    return OffloadConfig(
        groups=(KvGroup(block_size=BLOCK, bytes_per_block=2 * 16 * 4 * 64 * 4),),
        num_gpu_blocks=32,
        cpu_chunks=8,
        remote_url=url,
        remote_model=MODEL,
        cache_salt=salt,
        **kw,
    )


def engine(
    url: str, salt: str, seed: int
) -> tuple[list[dict[str, torch.Tensor]], TransferEngine, RemoteWorker]:
    """KV tensors filled from ``seed``, their transfer engine and its remote worker."""
    g = torch.Generator().manual_seed(seed)
    kv = [{f"layer{i}": torch.randn(32, BLOCK, 4, 64, generator=g) for i in range(2)}]
    worker = TransferEngine(kv, blocks_per_chunk=1, num_slots=8)
    remote = open_remote_worker(worker, url, [BLOCK], model=MODEL, cache_salt=salt)
    return kv, worker, remote


def drain(sched: OffloadScheduler, plan: Any, remote: RemoteWorker) -> list[tuple[str, bool]]:
    """Runs a plan's tier jobs to completion and reports them; returns (kind, ok) each."""
    jobs = plan.tier_jobs
    if not jobs:
        return []
    remote.submit(jobs)
    done = dict(remote.wait([j[0] for j in jobs], timeout=30))
    for j in jobs:
        sched.complete(j[0], ok=done[j[0]])
    return [(j[1], done[j[0]]) for j in jobs]


def ask(sched: OffloadScheduler, remote: RemoteWorker, rid: str) -> int:
    """Asks until the lookup answers, stepping the engine between asks (bounded in time: the
    existence check of a lookup is answered or forgotten within the deadline)."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        n = sched.lookup(rid, num_computed_tokens=0)
        if n is not None:
            return int(n)
        drain(sched, sched.schedule(StepInput(written=[])), remote)
        time.sleep(0.001)
    raise AssertionError(f"lookup of {rid} never answered")


def compute(
    sched: OffloadScheduler, worker: TransferEngine, remote: RemoteWorker, rid: str
) -> list[tuple[str, bool]]:
    """Request ``rid`` computes blocks 1..4 (3 full chunks), they are stored and written behind;
    returns the write-behind jobs' (kind, ok)."""
    sched.allocate(rid, [[1, 2, 3, 4]], num_computed_tokens=0, num_load_tokens=0)
    plan = sched.schedule(StepInput(scheduled=[(rid, PROMPT)], written=[1, 2, 3, 4]))
    for job in plan.stores:
        worker.submit_store(job.job_id, job.transfers)
    worker.wait([j.job_id for j in plan.stores])
    for r in worker.poll():
        sched.complete(r.job_id, ok=r.ok)
    plan = sched.schedule(StepInput(finished=[rid], written=[]))
    return drain(sched, plan, remote)


def fill(url: str, salt: str) -> None:
    """Engine A: request "a" misses, computes and is written behind to the shared tier."""
    sched = OffloadScheduler(config(url, salt))
    _, worker, remote = engine(url, salt, seed=1)
    sched.add_request("a", prompt_len=PROMPT, block_hashes=HASHES)
    assert ask(sched, remote, "a") == 0

    assert compute(sched, worker, remote, "a") == [("write", True)]
    worker.shutdown()


def expected_kv() -> torch.Tensor:
    """Engine A's KV of blocks 1..3 (both layers), as it computed them."""
    g = torch.Generator().manual_seed(1)
    kv = [torch.randn(32, BLOCK, 4, 64, generator=g) for _ in range(2)]
    return torch.stack([t[1:4] for t in kv])


if __name__ == "__main__":
    fill(sys.argv[1], sys.argv[2])
