"""kvoffload: offload LLM KV-cache blocks to CPU memory and load them back, safely.

The Rust core (:mod:`kvoffload._core`) owns the scheduler-side bookkeeping: the job table, the
fence, the CPU pool and request tracking. The Python layer adds engine-facing facades and the
torch data plane.
"""

from kvoffload._core import CpuPool, JobTracker, Scheduler, StorePlan, __version__
from kvoffload.errors import KvOffloadError

__all__ = ["CpuPool", "JobTracker", "KvOffloadError", "Scheduler", "StorePlan", "__version__"]
