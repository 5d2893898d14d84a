"""A pure-Python model of the scheduler core: short, naive, slow, obviously correct.

It mirrors ``rust/scheduler.rs`` operation for operation with the simplest data structures:
jobs in a dict, the fence check as a scan of every pending job, the re-allocation check as a
scan of every request's block table. CPU pools are :class:`kvoffload._core._CpuPool` instances
(the pool has its own model in ``tests/pool.rs``); the model makes the same pool calls in the
same order, so plans — slots included — must be identical to the core's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload._core import _CpuPool
from kvoffload.errors import (
    CompletionError,
    DuplicateReportError,
    RequestStateError,
    UnknownJobError,
    UnknownRequestError,
)

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
    fresh: set[tuple[int, int]] = field(default_factory=set)  # (group, pos) allocated this step


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
    reported: set[int] = field(default_factory=set)
    first_chunks: list[int] = field(default_factory=list)  # a load's first chunk per transfer
    load_end: int = 0  # a load's end token


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
        self.pools = [_CpuPool(cpu_chunks, policy) for _ in groups]
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
        self.reallocated: list[int] = []  # blocks given new content by allocate() this step
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
        """Best end point with ready chunks; and whether chunks being stored could beat it."""
        cap = r.prompt_len - int(self.has_window)
        if r.status == "preempted":
            cap = max(cap, r.computed)
        cap = min(cap, len(r.hashes) * self.hbs)
        cap -= cap % self.align
        if cap - hit < self.align:
            return 0, False
        states: list[dict[int, str]] = []
        for g in range(len(self.groups)):
            ct = self.ct(g)
            s, n = hit // ct, cap // ct
            keys = [self.key(r, g, c) for c in range(s, n)]
            self.pools[g].lookup(keys)
            states.append({c: self.pools[g].state(keys[c - s]) for c in range(s, n)})

        def best(ok: set[str]) -> int:
            p = cap
            while p > hit and p - hit >= self.align:
                if all(
                    all(
                        states[g][c] in ok
                        for c in range(self.first_needed_chunk(g, hit, p), p // self.ct(g))
                    )
                    for g in range(len(self.groups))
                ):
                    return p
                p -= self.align
            return 0

        end = best({"ready"})
        return end, best({"ready", "storing"}) > end

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
            if storing:
                return None
            self.touch_prefix(r, hit, hit)
            return 0
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
        self.touch_prefix(r, hit, end)
        return end - hit

    def touch_prefix(self, r: MRequest, hit: int, end: int) -> None:
        """Every chunk the request re-uses (GPU hit and loaded) is touched, earliest most recent."""
        for g, (_, w) in enumerate(self.groups):
            first = 0 if w is None else max(hit - w, 0) // self.ct(g)
            keys = [self.key(r, g, c) for c in range(first, max(end, hit) // self.ct(g))]
            keys = [k for k in keys if k is not None]
            if keys:
                self.pools[g].touch(keys)

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
        flat = [b for t in tables2 for b in t if b is not None]
        if len(flat) != len(set(flat)):
            raise RequestStateError(rid)
        if self.owner_jobs(rid):
            raise RequestStateError(rid)
        end = hit + load
        if load > 0 and r.lookup != (self.step, hit, end):
            raise RequestStateError(rid)
        transfers = []
        first_chunks = []
        if load > 0:
            for g, t in enumerate(tables2):
                bs, w = self.groups[g]
                if len(t) < -(-end // bs):
                    raise RequestStateError(rid)
                if w is None and None in t[hit // bs : end // bs]:
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
                    first_chunks.append(self.first_needed_chunk(g, hit, end))
        if r.status == "preempted":
            self.released.discard(rid)
        for g, t in enumerate(tables2):
            self.allocated += [b for b in t if b is not None]
            self.reallocated += [b for b in t[hit // self.groups[g][0] :] if b is not None]
            cursor = max(r.groups[g].cursor, end // self.ct(g))
            r.groups[g] = MGroup(list(t), cursor)
            r.fresh |= {(g, p) for p in range(len(t))}
        r.status, r.computed, r.first_ask, r.wait_on, r.lookup = "running", hit, None, [], None
        if not transfers:
            return None
        eager = [b for tr in transfers if self.groups[tr[0]][1] is not None for b in tr[1]]
        deferred = [b for tr in transfers if self.groups[tr[0]][1] is None for b in tr[1]]
        job = self.create_job("load", rid, transfers, eager, deferred)
        job.first_chunks = first_chunks
        job.load_end = end
        for g, _, _, keys in transfers:
            for k in keys:
                self.loading[(g, k)] = job.id
        r.load = job.id
        self.new_loads.append(job)
        return job.id

    def invalidate(self, reallocated: list[int]) -> None:
        """Positions not stored yet whose block got new content lose it."""
        ws = set(reallocated)
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
        # Done for good: its chunks still in the pools are refreshed (recency only), the
        # earliest most recent, so a next turn finds the prefix rather than its suffix.
        for g, rg in enumerate(r.groups):
            keys = [self.key(r, g, c) for c in range(rg.cursor)]
            self.pools[g].refresh([k for k in keys if k is not None])
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
        released = [*finished, *aborted, *preempted]
        if len(set(released)) != len(released) or set(released) & set(scheduled):
            raise RequestStateError(released)
        if len(set(scheduled)) != len(scheduled):
            raise RequestStateError(scheduled)
        fresh_blocks = [b for _, _, bs in new_blocks for b in bs if b != self.null_block]
        if len(set(fresh_blocks)) != len(fresh_blocks):
            raise RequestStateError(new_blocks)
        self.step += 1
        for lst, status in ((finished, "finished"), (aborted, "aborted"), (preempted, "preempted")):
            for rid in lst:
                self.reqs[rid].status = status
                self.released.add(rid)
                for j in self.owner_jobs(rid):
                    j.armed = True
        if written is None:
            w = self.allocated + fresh_blocks
        else:
            w = [b for b in written if b != self.null_block]
        self.allocated = []
        retry, self.retry = self.retry, []
        stores: list[MJob] = []
        seen: set[str] = set()

        def plan(rids: list[str]) -> None:
            for rid in rids:
                if rid in seen or rid not in self.reqs:
                    continue
                seen.add(rid)
                self.plan_stores(rid, stores)
                self.maybe_drop(rid)

        # Released requests store what their blocks hold before this step re-allocates them.
        plan(released + [x for x in retry if x in self.reqs and self.reqs[x].status != "running"])
        self.invalidate(self.reallocated + fresh_blocks)
        self.reallocated = []
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
        for r in self.reqs.values():
            r.fresh.clear()
        n_released = len(stores)
        plan(
            list(scheduled)
            + [x for x in retry if x in self.reqs and self.reqs[x].status == "running"]
        )
        ws = set(w)
        flush = {
            j.id
            for j in self.jobs.values()
            if ws & set(j.eager) or (j.armed and ws & set(j.deferred))
        }
        # Stores of running requests run after this step's forward pass; new loads write their
        # own blocks: neither is flushed by the step that creates it.
        flush -= {j.id for j in stores[n_released:]}
        flush -= {j.id for j in self.new_loads if self.reqs[j.req].status == "running"}
        flush = sorted(flush | set(self.reset_flush))
        self.reset_flush = []
        loads, self.new_loads = self.new_loads, []
        return loads, stores, flush

    def validate_report(self, job_id: int, worker: int) -> bool:
        """False for a late report; raises for a bad one."""
        if job_id < self.floor:
            return False
        if job_id >= self.next_job:
            raise UnknownJobError(job_id)
        if not 0 <= worker < self.num_workers:
            raise CompletionError(worker)
        if job_id not in self.jobs:
            raise CompletionError(job_id)
        if worker in self.jobs[job_id].reported:
            raise DuplicateReportError(job_id)
        return True

    def complete(self, job_id: int, worker: int = 0, ok: bool = True):
        if not self.validate_report(job_id, worker):
            return None
        j = self.jobs[job_id]
        j.reported.add(worker)
        j.failed |= not ok
        if len(j.reported) < self.num_workers:
            return None
        del self.jobs[job_id]
        ok = not j.failed
        invalid = []
        r = self.reqs[j.req]
        if j.kind == "store":
            for g, _, _, keys in j.transfers:
                self.pools[g].complete_store(keys, ok)
        else:
            for (g, gpu, _, keys), first in zip(j.transfers, j.first_chunks, strict=True):
                self.pools[g].complete_load(keys)
                if not ok:
                    self.pools[g].discard(keys)
                    r.groups[g].cursor = min(r.groups[g].cursor, first)
                for k in keys:
                    if self.loading.get((g, k)) == job_id:
                        del self.loading[(g, k)]
                if not ok:
                    invalid += gpu
            r.load = None
            if ok:  # the loaded tokens are computed now
                r.computed = max(r.computed, j.load_end)
            if r.status in ("finished", "aborted") and not any(
                rg.cursor < self.watermark(r) // self.ct(g) for g, rg in enumerate(r.groups)
            ):
                self.retry = [x for x in self.retry if x != j.req]
        self.maybe_drop(j.req)
        return (job_id, j.kind, j.req, ok, invalid)

    def complete_many(self, finished, failed=(), worker: int = 0):
        reports = [(j, True) for j in finished] + [(j, False) for j in failed]
        for k, (j, _) in enumerate(reports):
            if self.validate_report(j, worker) and any(x == j for x, _ in reports[:k]):
                raise DuplicateReportError(j)
        out = [self.complete(j, worker, ok) for j, ok in reports]
        return [d for d in out if d is not None]

    def reset(self) -> tuple[list[int], list[tuple[str, int]]]:
        unplanned = {j.id for j in self.new_loads}
        self.new_loads = []
        flushed = sorted(j for j in self.jobs if j not in unplanned)
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
