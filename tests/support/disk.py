"""A small engine with a disk tier, for the tests that drive one in this process or in a child.

:func:`tier_config` is a one-group :class:`~kvoffload.scheduler.OffloadConfig` (8 CPU slots, 32 GPU
blocks, a 1 MiB tier when ``path`` is given); :func:`cpu_engine` a CPU
:class:`~kvoffload.transfer.TransferEngine` over seeded KV tensors of that shape;
:func:`store_and_finish` runs request "a" through its stores and finishes it, returning the
finishing step's plan (its tier jobs are the write-behind); :func:`hold` keeps a disk worker on a
directory in a process of its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput, StepPlan
from kvoffload.transfer import TransferEngine
from kvoffload.transfer.disk import open_disk_worker
from tests.support.remote_engine import BLOCK, HASHES, PROMPT

__all__ = ["BLOCK", "HASHES", "PROMPT", "cpu_engine", "hold", "store_and_finish", "tier_config"]


def tier_config(path: Path | None, **kw: object) -> OffloadConfig:
    """One group of ``BLOCK``-token blocks, a disk tier on ``path`` (none when ``None``)."""
    return OffloadConfig(
        groups=(KvGroup(block_size=BLOCK, bytes_per_block=2 * 16 * 4 * 64 * 4),),
        num_gpu_blocks=32,
        cpu_chunks=8,
        disk_path=path,
        disk_bytes=None if path is None else 1 << 20,
        disk_model="toy",
        # 8 CPU slots: write-behind may pin them all here (tests/test_tier_speed.py: the bound).
        **{"tier_write_share": 1.0, **kw},  # type: ignore[arg-type]
    )


def cpu_engine(seed: int) -> tuple[list[dict[str, torch.Tensor]], TransferEngine]:
    """Two layers of float32 ``[32, BLOCK, 4, 64]`` filled from ``seed``, and their engine."""
    g = torch.Generator().manual_seed(seed)
    kv = [{f"layer{i}": torch.randn(32, BLOCK, 4, 64, generator=g) for i in range(2)}]
    return kv, TransferEngine(kv, blocks_per_chunk=1, num_slots=8)


def store_and_finish(
    sched: OffloadScheduler,
    worker: TransferEngine,
    hashes: list[int] = HASHES,
    prompt: int = PROMPT,
) -> StepPlan:
    """Request "a" (``prompt`` tokens, ``hashes``) computes its blocks in blocks 1-4, its stores
    complete, and it finishes: returns the finishing step's plan."""
    sched.add_request("a", prompt_len=prompt, block_hashes=hashes)
    assert sched.lookup("a", num_computed_tokens=0) == 0
    sched.allocate("a", [[1, 2, 3, 4]], num_computed_tokens=0, num_load_tokens=0)
    plan = sched.schedule(StepInput(scheduled=[("a", prompt)], written=[1, 2, 3, 4]))
    for job in plan.stores:
        worker.submit_store(job.job_id, job.transfers)
    worker.wait([j.job_id for j in plan.stores])
    for r in worker.poll():
        sched.complete(r.job_id, ok=r.ok)
    return sched.schedule(StepInput(finished=["a"], written=[]))


def hold(path: str) -> None:
    """A disk worker on ``path`` in a process of its own: says READY, holds the directory until
    its stdin closes."""
    _, worker = cpu_engine(1)
    disk = open_disk_worker(worker, path, 1 << 20, [BLOCK], model="toy")
    print("READY", flush=True)
    sys.stdin.readline()
    disk.close()
