"""Differential test: the Rust scheduler core against the pure-Python model on random schedules.

A small random engine drives both with identical calls — admissions with lookups and loads,
prefill and decode, finish / abort / preemption / resume, sliding-window blocks freed and
re-allocated, out-of-order completions from several workers with failures, resets — and every
answer must be identical: lookups, load job ids, plans (jobs, blocks, slots, flush sets) and
completions. Ground-truth invariants of DESIGN.md §4 are checked on the engine's own view after
every step, and the final drain must leave nothing behind.
"""

from __future__ import annotations

import random

import pytest

from kvoffload import Scheduler
from kvoffload.errors import DuplicateReportError
from tests.model.scheduler_model import ModelScheduler


def _plan_tuple(jobs):
    return [
        (j.job_id, j.kind, j.request_id, [tuple(t) for t in j.transfers])
        if hasattr(j, "job_id")
        else (j.id, j.kind, j.req, [(g, gpu, cpu) for g, gpu, cpu, _ in j.transfers])
        for j in jobs
    ]


class Engine:
    """A tiny paged engine: block tables, a free list, requests with shared prefixes."""

    def __init__(
        self, rng: random.Random, window: bool, bpc: int, workers: int, conservative: bool
    ):
        self.rng = rng
        self.bs = 4
        self.bpc = bpc
        self.window = 16 if window else None
        self.groups = [(self.bs, None)] + ([(self.bs, self.window)] if window else [])
        self.num_blocks = 160
        self.workers = workers
        self.conservative = conservative
        kwargs = dict(
            blocks_per_chunk=bpc,
            hash_block_size=self.bs,
            num_gpu_blocks=self.num_blocks,
            cpu_chunks=24,
            policy=rng.choice(["lru", "arc"]),
            num_workers=workers,
            max_loading_requests=rng.choice([0, 2]),
            null_block=0,
        )
        self.core = Scheduler([(bs, w, 0) for bs, w in self.groups], **kwargs)
        self.model = ModelScheduler(self.groups, **kwargs)
        self.free = list(range(1, self.num_blocks))
        rng.shuffle(self.free)
        self.owner: dict[int, str] = {}  # block -> request holding it
        self.reqs: dict[str, dict] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.pending: dict[int, dict] = {}  # job -> {"remaining", "blocks", "req", "kind"}
        self.n = 0
        self.loads = 0
        self.flushes = 0

    # -- both implementations, compared ------------------------------------------------------
    def both(self, name, *args, **kwargs):
        a = getattr(self.core, name)(*args, **kwargs)
        b = getattr(self.model, name)(*args, **kwargs)
        return a, b

    def add(self):
        rid = f"r{self.n}"
        self.n += 1
        family = self.rng.randrange(3)
        shared = self.rng.choice([0, 4, 8, 12])
        plen = shared * self.bs + self.rng.randrange(1, 30)
        hashes = [family * 10_000 + i for i in range(shared)]
        hashes += [self.n * 100_000 + i for i in range(plen // self.bs - shared)]
        self.reqs[rid] = {
            "plen": plen,
            "hashes": hashes,
            "tables": None,
            "computed": 0,
            "tokens": plen,
        }
        self.both("add_request", rid, plen, hashes)
        self.waiting.append(rid)

    def take_blocks(self, n, rid):
        out = [self.free.pop() for _ in range(n)]
        for b in out:
            self.owner[b] = rid
        return out

    def release(self, rid):
        for t in self.reqs[rid]["tables"] or []:
            for b in t:
                if b and self.owner.get(b) == rid:
                    del self.owner[b]
                    self.free.insert(self.rng.randrange(len(self.free) + 1), b)
        self.reqs[rid]["tables"] = None

    def step(self):
        rng = self.rng
        written: list[int] = []
        new_blocks = []
        resumed = []
        admitted = []
        # Admission.
        for rid in list(self.waiting):
            r = self.reqs[rid]
            hit = rng.choice([0, 0, self.bs]) if r["plen"] > self.bs else 0
            a, b = self.both("lookup", rid, hit)
            assert a == b, (rid, a, b)
            if a is None:
                continue
            nblk = -(-r["tokens"] // self.bs)
            if len(self.free) < nblk * len(self.groups) + 4:
                continue
            tables = [self.take_blocks(nblk, rid) for _ in self.groups]
            was_preempted = r["tables"] is None and r["computed"] > 0
            a, b = self.both("allocate", rid, tables, hit, a)
            assert a == b
            if a is not None:
                self.pending[a] = {
                    "blocks": {b for t in tables for b in t},
                    "req": rid,
                }
                self.loads += 1
            r["tables"] = tables
            r["computed"] = r["tokens"]
            # Blocks of the engine's own prefix hit are re-used read-only, never written.
            written += [b for t in tables for b in t[hit // self.bs :]]
            self.waiting.remove(rid)
            self.running.append(rid)
            admitted.append(rid)
            del was_preempted
        # Decode and sliding-window frees for running requests.
        scheduled = []
        for rid in self.running:
            r = self.reqs[rid]
            if rid not in admitted:
                r["tokens"] += 1
                r["computed"] = r["tokens"]
                if (r["tokens"] - 1) % self.bs == 0 and self.free:
                    for g in range(len(self.groups)):
                        if not self.free:
                            break
                        (blk,) = self.take_blocks(1, rid)
                        r["tables"][g].append(blk)
                        new_blocks.append((rid, g, [blk]))
                        written.append(blk)
                if r["tokens"] % self.bs == 0:
                    h = rid_hash = hash((rid, r["tokens"])) & (2**62 - 1)
                    r["hashes"].append(h)
                    self.both("extend_hashes", rid, [rid_hash])
                if self.window and rng.random() < 0.3:
                    # Free a block that left the window (the engine may re-use it at once).
                    t = r["tables"][1]
                    out = (r["computed"] - self.window) // self.bs
                    for pos in range(min(max(out, 0), len(t))):
                        if t[pos] and self.owner.get(t[pos]) == rid:
                            del self.owner[t[pos]]
                            self.free.append(t[pos])
                            t[pos] = 0  # the engine's table now holds the null block there
                            break
            scheduled.append((rid, min(r["computed"], len(r["tables"][0]) * self.bs)))
        # Finish / abort / preempt.
        finished, aborted, preempted = [], [], []
        for rid in list(self.running):
            x = rng.random()
            if x < 0.06:
                finished.append(rid)
            elif x < 0.08:
                aborted.append(rid)
            elif x < 0.10 and rid not in admitted:
                preempted.append(rid)
        for rid in finished + aborted + preempted:
            self.running.remove(rid)
            scheduled = [s for s in scheduled if s[0] != rid]
            new_blocks = [nb for nb in new_blocks if nb[0] != rid]
            self.release(rid)
            if rid in preempted:
                self.reqs[rid]["tokens"] = self.reqs[rid]["computed"]
                self.waiting.append(rid)
        # Freed blocks may be re-allocated and written in this same step by a waiting request.
        candidates = [x for x in self.waiting if x not in preempted]
        if candidates and rng.random() < 0.5:
            rid = rng.choice(candidates)
            r = self.reqs[rid]
            a, b = self.both("lookup", rid, 0)
            assert a == b
            nblk = -(-r["tokens"] // self.bs)
            if a is not None and len(self.free) >= nblk * len(self.groups):
                tables = [self.take_blocks(nblk, rid) for _ in self.groups]
                a2, b2 = self.both("allocate", rid, tables, 0, a)
                assert a2 == b2
                if a2 is not None:
                    self.pending[a2] = {
                        "blocks": {b for t in tables for b in t},
                        "req": rid,
                    }
                r["tables"] = tables
                r["computed"] = r["tokens"]
                written += [b for t in tables for b in t]
                self.waiting.remove(rid)
                self.running.append(rid)
        written = [
            b for b in written if b in self.owner
        ]  # blocks of requests that ended are not written
        ids = [s[0] for s in scheduled]
        comp = [s[1] for s in scheduled]
        w = None if self.conservative else written
        plan = self.core.schedule(ids, comp, new_blocks, resumed, finished, aborted, preempted, w)
        loads, stores, flush = self.model.schedule(
            ids, comp, new_blocks, resumed, finished, aborted, preempted, w
        )
        assert _plan_tuple(plan.loads) == _plan_tuple(loads)
        assert _plan_tuple(plan.stores) == _plan_tuple(stores)
        assert list(plan.flush) == flush
        for j in [*plan.loads, *plan.stores]:
            blocks = {b for _, gpu, _ in j.transfers for b in gpu}
            self.pending[j.job_id] = {
                "remaining": self.workers,
                "blocks": blocks,
                "req": j.request_id,
            }
        # Ground truth: a written block that a pending job touches but its request no longer
        # holds (it was re-allocated) must have that job flushed (no torn store).
        wset = set(written)
        for jid, p in self.pending.items():
            if jid in plan.flush:
                continue
            for b in p["blocks"] & wset:
                assert self.owner.get(b) == p["req"], (
                    f"job {jid} reads block {b} rewritten unflushed"
                )
        # Workers: complete the flush set first, then random others out of order.
        self.flushes += len(plan.flush)
        for jid in plan.flush:
            self.finish_job(jid, ok=True)
        for jid in list(self.pending):
            if rng.random() < 0.4:
                self.finish_job(jid, ok=rng.random() > 0.05, count=1)
        assert self.core.armed_pairs == self.model.armed_pairs()
        if rng.random() < 0.01:
            a, b = self.both("reset")
            assert a == b
            self.pending.clear()

    def finish_job(self, jid, ok, count=None):
        p = self.pending.get(jid)
        if p is None:
            return
        left = p.setdefault("ranks", list(range(self.workers)))
        n = len(left) if count is None else count
        for _ in range(n):
            rank = left.pop(self.rng.randrange(len(left)))
            a = self.core.complete(jid, rank, ok)
            b = self.model.complete(jid, rank, ok)
            got = (
                None
                if a is None
                else (a.job_id, a.kind, a.request_id, a.ok, list(a.invalid_blocks))
            )
            assert got == b
            if left and self.rng.random() < 0.2:
                # A duplicated report of the same rank: refused by both, nothing changes.
                with pytest.raises(DuplicateReportError):
                    self.core.complete(jid, rank, True)
                with pytest.raises(DuplicateReportError):
                    self.model.complete(jid, rank, True)
        if not left:
            del self.pending[jid]

    def drain(self):
        finished = list(self.running)
        aborted = list(self.waiting)
        for rid in finished:
            self.release(rid)
        self.running, self.waiting = [], []
        plan = self.core.schedule([], [], None, None, finished, aborted, None, None)
        _, _, flush = self.model.schedule([], [], (), (), finished, aborted, (), None)
        assert list(plan.flush) == flush
        for j in plan.stores:
            self.pending[j.job_id] = {
                "remaining": self.workers,
                "blocks": set(),
                "req": j.request_id,
            }
        for _ in range(50):
            for jid in list(self.pending):
                self.finish_job(jid, ok=True)
            plan = self.core.schedule([], [])
            _, stores, _ = self.model.schedule([], [])
            assert _plan_tuple(plan.stores) == _plan_tuple(stores)
            for j in plan.stores:
                self.pending[j.job_id] = {
                    "blocks": set(),
                    "req": j.request_id,
                }
            if not self.pending and self.core.num_requests == 0:
                break
        # No leaks (invariant 6).
        assert self.core.num_requests == 0
        assert self.core.pending_jobs() == []
        assert self.core.armed_pairs == 0
        assert self.core.loading_requests == 0
        assert all(p["pinned"] == 0 and p["storing"] == 0 for p in self.core.stats()["pools"])


@pytest.mark.parametrize("seed", range(12))
def test_core_matches_model_on_random_schedules(seed):
    rng = random.Random(seed)
    eng = Engine(
        rng,
        window=seed % 2 == 1,
        bpc=1 + seed % 3 % 2,
        workers=1 + seed % 4 // 2,
        conservative=seed % 3 == 0,
    )
    for _ in range(250):
        if rng.random() < 0.5 and len(eng.waiting) < 6:
            eng.add()
        eng.step()
    stats = eng.core.stats()
    # The schedule exercised what it is meant to exercise.
    assert stats["store_jobs"] > 0
    assert stats["jobs_completed"] > 0
    eng.drain()


def test_random_schedules_cover_loads_flushes_and_drops():
    totals = {"load_jobs": 0, "flushes": 0, "store_no_room": 0, "chunks_dropped": 0}
    for seed in range(100, 106):
        rng = random.Random(seed)
        eng = Engine(rng, window=True, bpc=1, workers=2, conservative=False)
        for _ in range(300):
            if rng.random() < 0.5 and len(eng.waiting) < 6:
                eng.add()
            eng.step()
        s = eng.core.stats()
        totals["load_jobs"] += s["load_jobs"]
        totals["store_no_room"] += s["store_no_room"]
        totals["chunks_dropped"] += s["chunks_dropped"]
        totals["flushes"] += eng.flushes
        eng.drain()
    assert all(v > 0 for v in totals.values()), totals
