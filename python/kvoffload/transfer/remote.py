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
from kvoffload.transfer.disk import tier_worker
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
    io_cpus: Sequence[int] | None = None,
    tls_ca: str | None = None,
) -> RemoteWorker:
    """Opens the shared tier at ``url`` for ``engine``'s CPU pool.

    ``engine``, ``block_sizes``, ``model``, ``rank``, ``world_size``, ``threads`` and
    ``io_cpus`` are those
    of :func:`~kvoffload.transfer.disk.open_disk_worker` (``model`` is the scheduler's
    ``remote_model``).

    Args:
        url: The scheduler's ``remote_url``.
        cache_salt: The scheduler's ``cache_salt``.
        deadline_ms: Longest wait for one operation (the scheduler's ``remote_deadline_ms``).
        tls_ca: For ``rediss://``: the CA file (the scheduler's ``remote_tls_ca``).

    Raises:
        ConfigError: ``block_sizes`` does not match the engine's groups, or a value is refused
            (the message names it).
    """
    return tier_worker(
        RemoteWorker,
        engine,
        block_sizes,
        url,
        model=model,
        cache_salt=cache_salt,
        rank=rank,
        world_size=world_size,
        threads=threads,
        deadline_ms=deadline_ms,
        io_cpus=io_cpus,
        tls_ca=tls_ca,
    )
