"""Inputs and observations of the core :class:`~kvoffload._core.Scheduler` the tests share."""

from __future__ import annotations

import random
from typing import Any

from kvoffload._core import Scheduler


def hashes(seed: int, n: int) -> list[bytes]:
    """``n`` 32-byte block hashes, the same for the same ``seed``."""
    return [random.Random(f"{seed}/{i}").randbytes(32) for i in range(n)]


def snapshot(s: Scheduler) -> tuple[Any, ...]:
    """What a refused call must leave as it was: counters, pending jobs, requests, armed pairs."""
    return (s.stats(), s.pending_jobs(), s.num_requests, s.armed_pairs)
