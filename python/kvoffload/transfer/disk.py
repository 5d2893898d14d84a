"""The disk tier on a worker: a :class:`kvoffload._core.DiskWorker` over a TransferEngine's pool.

The scheduler plans write-behind and promotion jobs (``StepPlan.tier_jobs``); on each worker a
``DiskWorker`` runs them on Rust threads, reading and writing the engine's CPU pool memory
directly (every slot checked against the registered rows). :func:`open_disk_worker` registers
exactly the pool the engine allocated: the same buffer, each group's CPU rows, in pool order,
so a chunk's bytes on disk are the concatenation of its rows in every registered tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvoffload._core import DiskWorker, TierWorker
from kvoffload.errors import ConfigError
from kvoffload.transfer.cpu import _storage_bytes
from kvoffload.transfer.engine import TransferEngine


def pool_registration(
    engine: TransferEngine, block_sizes: Sequence[int]
) -> tuple[Any, list[tuple[int, int, list[tuple[int, int, int, int]]]]]:
    """The CPU pool of ``engine`` as tier workers register it: one byte view of the pool and,
    per group, ``(cpu_rows, block_size, regions)`` with regions ``(0, offset, stride,
    row_bytes)``, in pool order (a chunk's bytes below the CPU pool are the concatenation of
    its rows in every registered tensor).

    Raises:
        ConfigError: ``block_sizes`` does not match the engine's groups.
    """
    groups = engine._groups  # this engine's own pool registration
    if len(block_sizes) != len(groups):
        raise ConfigError(
            f"block_sizes has {len(block_sizes)} entries, the engine has {len(groups)} groups"
        )
    pool = engine._pool
    base = int(pool.storage_offset())
    layout = [
        (
            g.num_cpu_blocks,
            int(bs),
            [
                (0, int(r.cpu.storage_offset()) - base, r.cpu.stride(0), r.bytes_per_block)
                for r in g.regions
            ],
        )
        for g, bs in zip(groups, block_sizes, strict=True)
    ]
    return _storage_bytes(pool)[base : base + pool.numel()], layout


W = TypeVar("W", bound=TierWorker)


def tier_worker(
    cls: Callable[..., W],
    engine: TransferEngine,
    block_sizes: Sequence[int],
    *args: Any,
    **kwargs: Any,
) -> W:
    """``cls(*args, buffers, groups, blocks_per_chunk=..., dtypes=..., **kwargs)`` over
    ``engine``'s pool (:func:`pool_registration`): what every tier worker's opener shares. The
    element type of each group's tensors is part of the namespace its chunks are written in
    (with the model, the split of a chunk into tensors, block size, rank and group)."""
    view, layout = pool_registration(engine, block_sizes)
    dtypes = [str(g.dtype).removeprefix("torch.") for g in engine._groups]
    return cls(*args, [view], layout, blocks_per_chunk=engine._bpc, dtypes=dtypes, **kwargs)


def open_disk_worker(
    engine: TransferEngine,
    path: str | os.PathLike[str],
    disk_bytes: int,
    block_sizes: Sequence[int],
    *,
    model: str = "",
    rank: int = 0,
    world_size: int = 1,
    threads: int = 2,
    direct: bool = True,
    sync: bool = True,
    io_cpus: Sequence[int] | None = None,
) -> DiskWorker:
    """Opens the disk tier of ``engine``'s CPU pool.

    Args:
        engine: The worker's transfer engine (its pool is what tier jobs read and write).
        path: The disk tier's directory (the scheduler's ``disk_path``).
        disk_bytes: Bytes per group on this worker (the scheduler's ``disk_bytes``).
        block_sizes: Tokens per GPU block of each group (part of the namespace).
        model: The scheduler's ``disk_model``.
        rank: This worker's tensor-parallel rank.
        world_size: Tensor-parallel ranks.
        threads: I/O threads.
        direct: Use ``O_DIRECT`` where the file system allows it.
        sync: Make every batch durable before its headers are written.
        io_cpus: CPU ids to pin the I/O threads to (the scheduler's ``io_cpus``; None: not
            pinned).

    Raises:
        ConfigError: ``block_sizes`` does not match the engine's groups, or the tier cannot be
            opened (the message names the value and the path).
    """
    return tier_worker(
        DiskWorker,
        engine,
        block_sizes,
        os.fspath(path),
        disk_bytes,
        model=model,
        rank=rank,
        world_size=world_size,
        threads=threads,
        direct=direct,
        sync=sync,
        io_cpus=io_cpus,
    )
