"""Engines of a fleet sharing one shared tier, running at the same time.

:func:`simulate_fleet` runs the same workload on ``engines`` simulated engines, each with its
own scheduler, data plane, CPU pool and remote worker, against one Redis server
(``cfg.remote_url``), each on its own thread. Engine ``i`` starts once engine ``i - 1`` has
finished ``lag`` of its requests: replicas that see the same popular prefixes a little later,
while the earlier ones are still running and writing behind. Later engines promote what the
earlier ones wrote; every loaded byte is checked by each engine's own oracle.

The engines' Python code shares the GIL (the shared tier's I/O runs on Rust threads without
it), so a run shows concurrency on the server and the tier, not parallel Python.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvoffload.errors import ConfigError
from kvoffload.sim.config import SimConfig
from kvoffload.sim.engine import Simulator
from kvoffload.sim.result import SimResult

__all__ = ["simulate_fleet"]

Progress = Callable[[int, int, int], None]


def simulate_fleet(
    cfg: SimConfig,
    engines: int = 2,
    lag: float = 0.25,
    progress: Callable[[int], Progress | None] | None = None,
) -> list[SimResult]:
    """Runs ``engines`` engines of ``cfg`` concurrently on one shared tier.

    Args:
        cfg: Every engine's configuration; ``remote_url`` must be set.
        engines: How many engines (2 or more).
        lag: Share of its requests engine ``i - 1`` finishes before engine ``i`` starts.
        progress: ``progress(i)`` gives engine ``i``'s progress callback (or None).

    Returns:
        Each engine's result, in start order.

    Raises:
        ConfigError: No ``remote_url``, fewer than 2 engines, or ``lag`` outside [0, 1).
        SimError: An engine could not run (the first such error, after every engine ended).
    """
    if cfg.remote_url is None:
        raise ConfigError("simulate_fleet needs remote_url: engines share only a shared tier")
    if not isinstance(engines, int) or isinstance(engines, bool) or engines < 2:
        raise ConfigError(f"engines must be an integer >= 2, got {engines!r}")
    if isinstance(lag, bool) or not isinstance(lag, (int, float)) or not 0 <= lag < 1:
        raise ConfigError(f"lag must be a number in [0, 1), got {lag!r}")
    if cfg.disk_path is not None:
        raise ConfigError(
            f"disk_path={cfg.disk_path!r}: engines of a fleet would share one disk directory; "
            "a disk tier belongs to one engine"
        )
    started = [threading.Event() for _ in range(engines)]
    started[0].set()
    results: list[SimResult | None] = [None] * engines
    errors: list[BaseException] = []

    def run(i: int) -> None:
        user = progress(i) if progress is not None else None

        def tick(done: int, total: int, step: int) -> None:
            if i + 1 < engines and done >= lag * total:
                started[i + 1].set()
            if user is not None:
                user(done, total, step)

        started[i].wait()
        try:
            results[i] = Simulator(cfg, progress=tick).run()
        except BaseException as e:  # reported after every engine ended
            errors.append(e)
        finally:
            if i + 1 < engines:
                started[i + 1].set()  # never leave the next engine waiting

    threads = [
        threading.Thread(target=run, args=(i,), name=f"kvoffload-sim-engine-{i}")
        for i in range(engines)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]
