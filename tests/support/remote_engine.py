"""A small engine (scheduler + CPU TransferEngine + RemoteWorker) sharing the Redis tier, for
tests that run engines in separate processes, and a simulated engine under faults.

    python -m tests.support.remote_engine URL SALT
        engine A: computes request "a", writes it behind
    python -m tests.support.remote_engine --host URL
        one simulated engine (a test host): JSON figures, once a line arrives on stdin
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvoffload._core import RemoteWorker
from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput
from kvoffload.transfer import TransferEngine
from kvoffload.transfer.remote import open_remote_worker
from tests.support.remote import DelayProxy, ProxyProcess, RedisServer

BLOCK = 16
HASHES = [0xA1, 0xA2, 0xA3]
PROMPT = 3 * BLOCK + 5
MODEL = "toy"


DEADLINE_MS = 30_000.0
"""The shared tier's deadline in these engines: no healthy check, write or read of a loaded
machine misses it (the default, 1 s, could, and a missed one fails the test); a dead server
refuses connections at once, so no test waits for it."""


def config(url: str, salt: str = "", **kw: Any) -> OffloadConfig:
    """The engines' configuration: one group, 8 CPU slots, the shared tier at ``url``."""
    return OffloadConfig(
        groups=(KvGroup(block_size=BLOCK, bytes_per_block=2 * 16 * 4 * 64 * 4),),
        num_gpu_blocks=32,
        cpu_chunks=8,
        remote_url=url,
        remote_model=MODEL,
        cache_salt=salt,
        # 8 CPU slots: write-behind may pin them all here (tests/test_tier_speed.py: the bound).
        **{"remote_deadline_ms": DEADLINE_MS, "tier_write_share": 1.0, **kw},
    )


def engine(
    url: str, salt: str, seed: int
) -> tuple[list[dict[str, torch.Tensor]], TransferEngine, RemoteWorker]:
    """KV tensors filled from ``seed``, their transfer engine and its remote worker."""
    g = torch.Generator().manual_seed(seed)
    kv = [{f"layer{i}": torch.randn(32, BLOCK, 4, 64, generator=g) for i in range(2)}]
    worker = TransferEngine(kv, blocks_per_chunk=1, num_slots=8)
    remote = open_remote_worker(
        worker, url, [BLOCK], model=MODEL, cache_salt=salt, deadline_ms=DEADLINE_MS
    )
    return kv, worker, remote


def drain(sched: OffloadScheduler, plan: Any, remote: RemoteWorker) -> list[tuple[str, bool]]:
    """Runs a plan's tier jobs to completion and reports them; returns (kind, ok) each."""
    jobs = plan.tier_jobs
    if not jobs:
        return []
    remote.submit(jobs)
    done = dict(remote.wait([j[0] for j in jobs], timeout=2 * DEADLINE_MS / 1000))
    for j in jobs:
        sched.complete(j[0], ok=done[j[0]])
    return [(j[1], done[j[0]]) for j in jobs]


def ask(sched: OffloadScheduler, remote: RemoteWorker, rid: str) -> int:
    """Asks until the lookup answers, stepping the engine between asks (bounded in time: the
    existence check of a lookup is answered or forgotten within the deadline)."""
    end = time.monotonic() + 2 * DEADLINE_MS / 1000
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


def load(
    sched: OffloadScheduler, worker: TransferEngine, rid: str, blocks: list[int], n: int
) -> None:
    """Request ``rid`` (a ``PROMPT``-token prompt) loads ``n`` tokens into ``blocks``: the
    load is allocated, planned, copied, and every copy succeeded."""
    job = sched.allocate(rid, [blocks], num_computed_tokens=0, num_load_tokens=n)
    plan = sched.schedule(StepInput(scheduled=[(rid, PROMPT)], written=blocks))
    for j in plan.loads:
        worker.submit_load(j.job_id, j.transfers)
    worker.wait([job])
    assert all(r.ok for r in worker.poll())


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


# --------------------------------------------------------------------------- faults, engine level

FAULTS = ("healthy", "killed", "restarted", "flushed", "slow", "healed")
"""The phases of :class:`FaultRun`, in order: what happens to the server at each one's start."""


@dataclass
class FaultRun:
    """One simulated engine (scheduler, workers, oracle) on the shared tier behind a
    :class:`~tests.support.remote.DelayProxy`, with the server's faults scheduled by step:
    every ``phase_steps`` steps the next phase of :data:`FAULTS` starts (kill the server,
    restart it empty, flush it, hold its replies past the deadline, heal). Each step sleeps
    ``pace_s`` (the forward pass). The counters of the scheduler's tier and of the worker's
    client are taken at every phase change; :attr:`phase_of_step` tells which phase each
    step's scheduler time (``Simulator.step_times``) belongs to.
    """

    server: RedisServer
    proxy: DelayProxy | ProxyProcess
    phase_steps: int = 100
    pace_s: float = 0.002
    deadline_ms: float = 200.0
    slow_delay_s: float = 1.0
    probation_s: float = 2.1
    inject: bool = True
    """False: the same run and phases without faults (the baseline of a benchmark)."""
    phase: int = -1
    phase_of_step: list[str] = field(default_factory=list)
    tier: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per phase: the scheduler's remote tier counters at its end."""
    worker: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per phase: the worker's client counters at its end."""
    result: Any = None
    """The run's ``SimResult`` (set by the caller)."""

    def config(self, **kw: Any) -> Any:
        """The engine's configuration: a chat workload whose CPU pool and GPU cache are small
        enough that chunks come back from the shared tier; completions polled, as an engine
        does (a step never waits for tier I/O)."""
        from kvoffload.sim import SimConfig

        base: dict[str, Any] = {
            "workload": "chat",
            "num_requests": 100,
            "scale": 0.5,
            "cpu_chunks": 32,
            "num_gpu_blocks": 160,
            "max_num_seqs": 8,
            "completion": "poll",
            "remote_url": self.proxy.url,
            "remote_deadline_ms": self.deadline_ms,
            "tier_write_share": 1.0,  # a tiny CPU pool: write-behind may pin all of it
        }
        return SimConfig(**{**base, **kw})

    def run(self, **kw: Any) -> Any:
        """Runs the workload through every phase; returns the run's :class:`SimResult`."""
        from kvoffload.sim import Simulator

        self.sim = Simulator(self.config(**kw))
        assert self.sim.offload is not None
        self.remote = self.sim.offload.tiers["remote"]  # kept: its counters outlive the run
        self.sim.before_step = self._before_step
        result = self.sim.run()
        self._snapshot(result.tiers["remote"])
        return result

    def _snapshot(self, tier: dict[str, int] | None = None) -> None:
        name = FAULTS[self.phase]
        if tier is None:
            assert self.sim.offload is not None
            stats: Any = self.sim.offload.sched.stats()["tiers"]
            tier = stats[0]
        self.tier[name] = dict(tier)
        self.worker[name] = dict(self.remote.stats())

    def _before_step(self, step: int) -> None:
        phase = min((step - 1) // self.phase_steps, len(FAULTS) - 1)
        while self.phase < phase:
            if self.phase >= 0:
                if self.inject:
                    self._leave(FAULTS[self.phase])
                self._snapshot()
            self.phase += 1
            if self.inject:
                self._enter(FAULTS[self.phase])
        self.phase_of_step.append(FAULTS[self.phase])
        time.sleep(self.pace_s)

    def _enter(self, name: str) -> None:
        if name == "killed":
            self.server.kill()
        elif name == "restarted":
            self.server.start()
            time.sleep(self.probation_s)  # the clients' probations end: next operation is a trial
        elif name == "flushed":
            self.server.flushall()
        elif name == "slow":
            self.proxy.delay = self.slow_delay_s
        elif name == "healed":
            self.proxy.delay = 0.0
            time.sleep(self.probation_s)

    def _leave(self, name: str) -> None:
        if name == "slow":
            # Until the worker's client went on probation under the slow server (bounded).
            since = self.worker["flushed"]["probations"]
            end = time.monotonic() + 10
            while self.remote.stats()["probations"] == since and time.monotonic() < end:
                time.sleep(0.01)

    def delta(self, name: str, key: str, of: str = "tier") -> int:
        """How much counter ``key`` (of the scheduler's ``tier`` or the ``worker``'s client)
        grew during phase ``name``."""
        d = self.tier if of == "tier" else self.worker
        i = FAULTS.index(name)
        before = d[FAULTS[i - 1]][key] if i else 0
        return d[name][key] - before


def host(url: str) -> dict[str, Any]:
    """One simulated engine (a test host) runs :data:`HOST_WORKLOAD` on the shared tier at
    ``url``; returns its figures."""
    from kvoffload.sim import SimConfig, simulate
    from kvoffload.sim.report import figures

    return figures(simulate(SimConfig(remote_url=url, **HOST_WORKLOAD)), None)


HOST_WORKLOAD: dict[str, Any] = {
    "workload": "sysprompt",
    "num_requests": 40,
    "scale": 0.5,
    "cpu_chunks": 64,
    "remote_deadline_ms": DEADLINE_MS,  # the test asserts no failed tier job
    "tier_write_share": 1.0,  # a small CPU pool: write-behind may pin all of it
}
"""What every test host runs: long shared system prompts (their chunks are what hosts share)."""


if __name__ == "__main__":
    if sys.argv[1] == "--host":
        import kvoffload.sim  # noqa: F401  (imported before the go: hosts start up together)

        sys.stdin.readline()
        print(json.dumps(host(sys.argv[2])))
    else:
        fill(sys.argv[1], sys.argv[2])
