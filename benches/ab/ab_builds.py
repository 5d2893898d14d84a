"""What the same-process A/B harnesses (``schedule_batch_ab.py``, ``request_calls_ab.py``)
share: one core scheduler of each build, and caches made cold before a timed call."""

from __future__ import annotations

import importlib
import sys
from typing import Any

BLOCK = 16


def schedulers(other: str, gpu_blocks: int) -> dict[str, Any]:
    """A scheduler of the other build (``other/kvbase/_core*.so``) and one of this build
    (``kvoffload._core``), keyed ``"other"`` and ``"this"``: one full-attention group of
    ``BLOCK``-token blocks, ``gpu_blocks`` GPU blocks, 400,000 CPU chunks."""
    sys.path.insert(0, other)
    mods = {
        "other": importlib.import_module("kvbase._core"),
        "this": importlib.import_module("kvoffload._core"),
    }
    return {
        k: m.Scheduler([(BLOCK, None, 64)], num_gpu_blocks=gpu_blocks, cpu_chunks=400_000)
        for k, m in mods.items()
    }


class Cold:
    """Calling it rewrites a 64 MiB buffer, so the next call starts with cold caches, as after
    vLLM's own work between our calls."""

    def __init__(self) -> None:
        self.junk, self.zeros = bytearray(64 << 20), bytes(64 << 20)

    def __call__(self) -> None:
        self.junk[:] = self.zeros
