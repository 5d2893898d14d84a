"""The shared (Redis) tier on a worker: a :class:`kvoffload._core.RemoteWorker` over a
TransferEngine's pool.

The scheduler plans write-behind and promotion jobs with medium ``"remote"``
(``StepPlan.tier_jobs``); on each worker a ``RemoteWorker`` runs them on Rust threads, sending
the engine's CPU pool slots to the server and reading promoted chunks straight into them
(every slot checked against the registered rows, every chunk verified).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload._core import RemoteWorker
from kvoffload.transfer.disk import pool_registration
from kvoffload.transfer.engine import TransferEngine


def open_remote_worker(
    engine: TransferEngine,
    url: str,
    block_sizes: Sequence[int],
    *,
    model: str = "",
    cache_salt: str = "",
    rank: int = 0,
    world_size: int = 1,
    threads: int = 2,
    deadline_ms: float = 1000.0,
) -> RemoteWorker:
    """Opens the shared tier at ``url`` for ``engine``'s CPU pool.

    Args:
        engine: The worker's transfer engine (its pool is what tier jobs read and write).
        url: The scheduler's ``remote_url``.
        block_sizes: Tokens per GPU block of each group (part of the namespace).
        model: The scheduler's ``remote_model``.
        cache_salt: The scheduler's ``cache_salt``.
        rank: This worker's tensor-parallel rank.
        world_size: Tensor-parallel ranks.
        threads: I/O threads.
        deadline_ms: Longest wait for one operation.

    Raises:
        ConfigError: ``block_sizes`` does not match the engine's groups, or a value is refused
            (the message names it).
    """
    view, layout = pool_registration(engine, block_sizes)
    return RemoteWorker(
        url,
        [view],
        layout,
        blocks_per_chunk=engine._bpc,
        model=model,
        cache_salt=cache_salt,
        rank=rank,
        world_size=world_size,
        threads=threads,
        deadline_ms=deadline_ms,
    )
