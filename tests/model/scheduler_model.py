"""A pure-Python model of the scheduler core: short, naive, slow, obviously correct.

It mirrors ``rust/scheduler.rs`` operation for operation with the simplest data structures:
jobs in a dict, the fence check as a scan of every pending job, the re-allocation check as a
scan of every request's block table. CPU pools are :class:`kvoffload.CpuPool` instances (the
pool has its own model in ``tests/test_pool.py``); the model makes the same pool calls in the
same order, so plans — slots included — must be identical to the core's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload import CpuPool
from kvoffload.errors import RequestStateError, UnknownRequestError

NULL = None


@dataclass
class MGroup:
    blocks: list[int | None] = field(default_factory=list)
    cursor: int = 0


@dataclass
class MRequest:
    id: str
    prompt_len: int
    hashes: list[int]
    groups: list[MGroup]
    computed: int = 0
    status: str = "waiting"
    load: int | None = None
    first_ask: int | None = None
    wait_on: list[int] = field(default_factory=list)
    lookup: tuple[int, int, int] | None = None  # (step, hit, end)
    fresh: set[tuple[int, int]] = field(default_factory=set)  # (group, pos) not yet indexed


@dataclass
class MJob:
    id: int
    kind: str
    req: str
    transfers: list[tuple[int, list[int], list[int], list[int]]]  # group, gpu, cpu, keys
    eager: list[int]
    deferred: list[int]
    armed: bool
    remaining: int
    failed: bool = False


class ModelScheduler:
    """Same public operations as ``kvoffload._core.Scheduler``, in plain Python."""

    def __init__(
        self,
        groups: list[tuple[int, int | None]],
        *,
        blocks_per_chunk: int,
        hash_block_size: int,
        num_gpu_blocks: int,
        cpu_chunks: int,
        policy: str = "lru",
        num_workers: int = 1,
        max_loading_requests: int = 0,
        offload_prompt_only: bool = False,
        max_offload_tokens: int | None = None,
        null_block: int | None = 0,
    ) -> None:
        self.groups = groups
        self.bpc = blocks_per_chunk
        self.hbs = hash_block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_workers = num_workers
        self.max_loading = max_loading_requests
        self.prompt_only = offload_prompt_only
        self.max_tokens = max_offload_tokens
        self.null_block = null_block
        self.cpu_chunks = cpu_chunks
        self.pools = [CpuPool(cpu_chunks, policy) for _ in groups]
        self.align = 1
        for g in range(len(groups)):
            ct = self.ct(g)
            a, b = self.align, ct
            while b:
                a, b = b, a % b
            self.align = self.align // a * ct
        self.has_window = any(w is not None for _, w in groups)
        self.reqs: dict[str, MRequest] = {}
        self.jobs: dict[int, MJob] = {}
        self.next_job = 0
        self.floor = 0
        self.released: set[str] = set()
        self.loading: dict[tuple[int, int], int] = {}
        self.step = 0
        self.new_loads: list[MJob] = []
        self.allocated: list[int] = []
        self.retry: list[str] = []
        self.reset_flush: list[int] = []
        self.max_wait = 0

    # -- helpers --------------------------------------------------------------------------
    def ct(self, g: int) -> int:
        return self.groups[g][0] * self.bpc

    def key(self, r: MRequest, g: int, c: int) -> int | None:
        h = (c + 1) * self.ct(g) // self.hbs
        return r.hashes[h - 1] if 0 < h <= len(r.hashes) else None

    def req(self, rid: str) -> MRequest:
        if rid not in self.reqs:
            raise UnknownRequestError(rid)
        return self.reqs[rid]

    def owner_jobs(self, rid: str) -> list[MJob]:
        return [j for j in self.jobs.values() if j.req == rid]

    def engine_block(self, b: int) -> int | None:
        return None if b == self.null_block else b

    def first_needed_chunk(self, g: int, hit: int, end: int) -> int:
        w = self.groups[g][1]
        start = hit if w is None else max(hit, end - w)
        return start // self.ct(g)

    # -- operations -----------------------------------------------------------------------
    def add_request(self, rid: str, prompt_len: int, hashes: list[int]) -> None:
        if rid in self.reqs:
            raise RequestStateError(rid)
        self.reqs[rid] = MRequest(rid, prompt_len, list(hashes), [MGroup() for _ in self.groups])

    def extend_hashes(self, rid: str, hashes: list[int]) -> None:
        self.req(rid).hashes.extend(hashes)

    def hit_end(self, r: MRequest, hit: int) -> tuple[int, bool]:
        cap = r.prompt_len - int(self.has_window)
        if r.status == "preempted":
            cap = max(cap, r.computed)
        cap = min(cap, len(r.hashes) * self.hbs)
        cap -= cap % self.align
        if cap <= hit:
            return 0, False
        storing = False
        ready: list[dict[int, bool]] = []
        for g in range(len(self.groups)):
            ct = self.ct(g)
            s, n = hit // ct, cap // ct
            keys = [self.key(r, g, c) for c in range(s, n)]
            self.pools[g].lookup(keys)
            states = {c: self.pools[g].state(keys[c - s]) for c in range(s, n)}
            ready.append({c: st == "ready" for c, st in states.items()})
            if self.groups[g][1] is None:
                for c in range(s, n):
                    if states[c] != "ready":
                        storing |= states[c] == "storing"
                        break
            else:
                storing |= "storing" in states.values()
        p = cap
        while p > hit and p - hit >= self.align:
            if all(
                all(ready[g][c] for c in range(self.first_needed_chunk(g, hit, p), p // self.ct(g)))
                for g in range(len(self.groups))
            ):
                return p, storing
            p -= self.align
        return 0, storing

    def lookup(self, rid: str, hit: int) -> int | None:
        r = self.req(rid)
        if r.status not in ("waiting", "preempted"):
            raise RequestStateError(rid)
        r.lookup = None
        if self.owner_jobs(rid):
            return None
        first = r.first_ask is None
        if first:
            r.first_ask = self.step
        end, storing = self.hit_end(r, hit)
        if end == 0:
            return None if storing else 0
        if first:
            r.wait_on = sorted(
                {
                    self.loading[(g, self.key(r, g, c))]
                    for g in range(len(self.groups))
                    for c in range(self.first_needed_chunk(g, hit, end), end // self.ct(g))
                    if (g, self.key(r, g, c)) in self.loading
                }
            )
        r.wait_on = [j for j in r.wait_on if j in self.jobs]
        loading_reqs = sum(1 for x in self.reqs.values() if x.load is not None)
        if storing or (self.max_loading and loading_reqs >= self.max_loading) or r.wait_on:
            return None
        self.max_wait = max(self.max_wait, self.step - r.first_ask)
        r.lookup = (self.step, hit, end)
        for g in range(len(self.groups)):
            keys = [
                self.key(r, g, c)
                for c in range(self.first_needed_chunk(g, hit, end), end // self.ct(g))
            ]
            self.pools[g].touch(keys)
        return end - hit

    def create_job(self, kind: str, rid: str, transfers, eager, deferred) -> MJob:
        armed = rid in self.released
        job = MJob(self.next_job, kind, rid, transfers, eager, deferred, armed, self.num_workers)
        self.next_job += 1
        self.jobs[job.id] = job
        return job

    def allocate(self, rid: str, tables: list[list[int]], hit: int, load: int) -> int | None:
        r = self.req(rid)
        if r.status not in ("waiting", "preempted") or len(tables) != len(self.groups):
            raise RequestStateError(rid)
        tables2 = [[self.engine_block(b) for b in t] for t in tables]
        if self.owner_jobs(rid):
            raise RequestStateError(rid)
        end = hit + load
        if load > 0 and r.lookup != (self.step, hit, end):
            raise RequestStateError(rid)
        transfers = []
        if load > 0:
            for g, t in enumerate(tables2):
                if len(t) < -(-end // self.groups[g][0]):
                    raise RequestStateError(rid)
            for g, t in enumerate(tables2):
                bs = self.groups[g][0]
                first = max(self.first_needed_chunk(g, hit, end) * self.bpc, hit // bs)
                gpu, cpu, keys, kidx = [], [], [], []
                for pos in range(first, end // bs):
                    if t[pos] is None:
                        continue
                    k = self.key(r, g, pos // self.bpc)
                    if not keys or keys[-1][0] != pos // self.bpc:
                        keys.append((pos // self.bpc, k))
                    kidx.append(len(keys) - 1)
                    gpu.append(t[pos])
                    cpu.append(pos % self.bpc)
                if keys:
                    slots = self.pools[g].prepare_load([k for _, k in keys])
                    cpu = [c + slots[i] * self.bpc for c, i in zip(cpu, kidx, strict=True)]
                    transfers.append((g, gpu, cpu, [k for _, k in keys]))
        if r.status == "preempted":
            self.released.discard(rid)
        for g, t in enumerate(tables2):
            self.allocated += [b for b in t if b is not None]
            cursor = max(r.groups[g].cursor, end // self.ct(g))
            r.groups[g] = MGroup(list(t), cursor)
            r.fresh |= {(g, p) for p in range(len(t))}
        r.status, r.computed, r.first_ask, r.wait_on, r.lookup = "running", hit, None, [], None
        if not transfers:
            return None
        eager = [b for tr in transfers if self.groups[tr[0]][1] is not None for b in tr[1]]
        deferred = [b for tr in transfers if self.groups[tr[0]][1] is None for b in tr[1]]
        job = self.create_job("load", rid, transfers, eager, deferred)
        for g, _, _, keys in transfers:
            for k in keys:
                self.loading[(g, k)] = job.id
        r.load = job.id
        self.new_loads.append(job)
        return job.id

    def invalidate(self, written: list[int]) -> None:
        ws = set(written)
        for r in self.reqs.values():
            for g, rg in enumerate(r.groups):
                for pos in range(rg.cursor * self.bpc, len(rg.blocks)):
                    if rg.blocks[pos] in ws and (g, pos) not in r.fresh:
                        rg.blocks[pos] = None

    def watermark(self, r: MRequest) -> int:
        wm = r.computed
        if self.prompt_only:
            wm = min(wm, r.prompt_len)
        if self.max_tokens is not None:
            wm = min(wm, self.max_tokens)
        return wm

    def plan_stores(self, rid: str, out: list[MJob]) -> None:
        r = self.reqs[rid]
        if r.status == "waiting":
            return
        if r.load is not None:
            self.retry.append(rid)
            return
        wm, bpc = self.watermark(r), self.bpc
        transfers, eager, deferred, cursors, retry = [], [], [], [], False
        for g, rg in enumerate(r.groups):
            limit, c, keys = wm // self.ct(g), rg.cursor, []
            while c < limit and len(keys) < self.cpu_chunks:
                k = self.key(r, g, c)
                blocks = rg.blocks[c * bpc : (c + 1) * bpc]
                if k is None or len(blocks) < bpc:
                    break
                if None not in blocks:
                    keys.append((c, k))
                c += 1
            if c == rg.cursor:
                continue
            plan = None
            if keys:
                plan = self.pools[g].prepare_store([k for _, k in keys])
                if plan is None:
                    retry = True
                    continue
            cursors.append((g, c))
            if plan is None:
                continue
            slot_of = dict(zip(plan.keys, plan.slots, strict=True))
            gpu, cpu = [], []
            for chunk, k in keys:
                if k in slot_of:
                    gpu += rg.blocks[chunk * bpc : (chunk + 1) * bpc]
                    cpu += [slot_of[k] * bpc + o for o in range(bpc)]
            if not gpu:
                continue
            (eager if self.groups[g][1] is not None else deferred).extend(gpu)
            transfers.append((g, gpu, cpu, list(plan.keys)))
        for g, c in cursors:
            r.groups[g].cursor = c
        if retry:
            self.retry.append(rid)
        if transfers:
            out.append(self.create_job("store", rid, transfers, eager, deferred))

    def maybe_drop(self, rid: str) -> None:
        r = self.reqs.get(rid)
        if (
            r is None
            or r.status not in ("finished", "aborted")
            or self.owner_jobs(rid)
            or rid in self.retry
        ):
            return
        self.released.discard(rid)
        del self.reqs[rid]

    def schedule(
        self,
        scheduled: list[str],
        computed: list[int],
        new_blocks=(),
        resumed=(),
        finished=(),
        aborted=(),
        preempted=(),
        written=None,
    ) -> tuple[list[MJob], list[MJob], list[int]]:
        for rid in [*resumed, *finished, *aborted, *preempted, *scheduled]:
            self.req(rid)
        self.step += 1
        work = []
        for lst, status in ((finished, "finished"), (aborted, "aborted"), (preempted, "preempted")):
            for rid in lst:
                self.reqs[rid].status = status
                self.released.add(rid)
                for j in self.owner_jobs(rid):
                    j.armed = True
                work.append(rid)
        if written is None:
            w = self.allocated + [b for _, _, bs in new_blocks for b in bs if b != self.null_block]
        else:
            w = [b for b in written if b != self.null_block]
        self.allocated = []
        self.invalidate(w)
        for rid in resumed:
            r = self.reqs[rid]
            self.released.discard(rid)
            r.status = "running"
            for rg in r.groups:
                rg.blocks = []
        for rid, g, bs in new_blocks:
            self.reqs[rid].groups[g].blocks += [self.engine_block(b) for b in bs]
        for rid, c in zip(scheduled, computed, strict=True):
            self.reqs[rid].computed = c
            work.append(rid)
        for r in self.reqs.values():
            r.fresh.clear()
        work += self.retry
        self.retry = []
        stores: list[MJob] = []
        seen = set()
        for rid in work:
            if rid in seen or rid not in self.reqs:
                continue
            seen.add(rid)
            self.plan_stores(rid, stores)
            self.maybe_drop(rid)
        ws = set(w)
        flush = sorted(
            j.id
            for j in self.jobs.values()
            if ws & set(j.eager) or (j.armed and ws & set(j.deferred))
        )
        fresh = {
            j.id for j in stores if j.req in self.reqs and self.reqs[j.req].status == "running"
        }
        flush = sorted((set(flush) - fresh) | set(self.reset_flush))
        self.reset_flush = []
        loads, self.new_loads = self.new_loads, []
        return loads, stores, flush

    def complete(self, job_id: int, count: int = 1, ok: bool = True):
        if job_id < self.floor:
            return None
        j = self.jobs[job_id]
        j.remaining -= count
        j.failed |= not ok
        if j.remaining > 0:
            return None
        del self.jobs[job_id]
        ok = not j.failed
        invalid = []
        if j.kind == "store":
            for g, _, _, keys in j.transfers:
                self.pools[g].complete_store(keys, ok)
        else:
            for g, gpu, _, keys in j.transfers:
                self.pools[g].complete_load(keys)
                if not ok:
                    self.pools[g].discard(keys)
                for k in keys:
                    if self.loading.get((g, k)) == job_id:
                        del self.loading[(g, k)]
                if not ok:
                    invalid += gpu
            self.reqs[j.req].load = None
        self.maybe_drop(j.req)
        return (job_id, j.kind, j.req, ok, invalid)

    def reset(self) -> tuple[list[int], list[tuple[str, int]]]:
        flushed = sorted(self.jobs)
        self.reset_flush += flushed
        self.jobs.clear()
        self.floor = self.next_job
        self.released.clear()
        for p in self.pools:
            p.reset()
        self.loading.clear()
        self.retry = []
        cancelled = []
        for rid in list(self.reqs):
            r = self.reqs[rid]
            if r.load is not None:
                cancelled.append((rid, r.load))
                r.load = None
            r.first_ask, r.wait_on, r.lookup = None, [], None
            if r.status in ("finished", "aborted"):
                del self.reqs[rid]
            elif r.status in ("preempted", "waiting"):
                r.groups = [MGroup() for _ in self.groups]
            else:
                for g, rg in enumerate(r.groups):
                    w = self.groups[g][1]
                    rg.cursor = 0 if w is None else -(-max(r.computed - w, 0) // self.ct(g))
        return flushed, sorted(cancelled, key=lambda c: c[1])

    def armed_pairs(self) -> int:
        return sum(len(j.eager) + (len(j.deferred) if j.armed else 0) for j in self.jobs.values())
