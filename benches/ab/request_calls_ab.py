"""A new request's three core calls (``sync_request``, ``lookup_request``, ``allocate``: what
vLLM's ``on_new_request``, ``get_num_new_matched_tokens`` and ``update_state_after_alloc`` make)
of two builds of the extension, in one process, on the same multi-turn chat (the shape of
``benches/vllm_workload.py``, without vLLM): 1,024 conversations on 4 shared system prompts of
512-1,536 tokens, first prompts of 2,048-5,632 tokens, each turn adding 96-768 tokens (an answer
and a user message) up to 8,192; a turn's prompt hashes are vLLM's (32-byte ``bytes``), its
block table vLLM's ``KVCacheBlock`` shape (a ``dataclass(slots=True)``, one object per GPU
block, built once, as vLLM's block pool); the engine's own prefix hit is the system prompt. The
CPU pool holds what earlier turns stored, so later turns load their history from it.

Before every timed call a 64 MiB buffer is rewritten, so each call starts with cold caches, as
inside vLLM. Calls alternate which build goes first; both builds get the same calls, and their
answers are compared.

Run (the other build's ``_core*.so`` copied into ``DIR/kvbase/`` with an empty
``__init__.py``)::

    .venv/bin/python benches/ab/request_calls_ab.py DIR [--rounds 120] [--per-round 4]

It prints, per call, the median µs of each build over the timed requests and their ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ab_builds import BLOCK, Cold, schedulers

GPU_BLOCKS = 200_000
CALLS = ("sync_request", "lookup_request", "allocate")


@dataclass(slots=True)
class Block:
    """The shape of vLLM 0.32's ``KVCacheBlock``."""

    block_id: int
    ref_cnt: int = 0
    pool: Any = None
    _block_hash: Any = None
    _block_hash_num_tokens: int | None = None
    prev_free_block: Any = None
    next_free_block: Any = None
    is_null: bool = False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("other", help="directory holding kvbase/_core*.so (the other build)")
    ap.add_argument("--conversations", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=120, help="timed rounds (after warmup)")
    ap.add_argument("--warmup", type=int, default=600, help="untimed rounds first")
    ap.add_argument("--per-round", type=int, default=4, help="new requests per round")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cores = schedulers(a.other, GPU_BLOCKS)
    for s in cores.values():
        s.set_event_limit(0)
    rng = random.Random(a.seed)
    blocks = [Block(i) for i in range(GPU_BLOCKS)]
    free = list(range(1, GPU_BLOCKS))
    rng.shuffle(free)
    systems = [[rng.randbytes(32) for _ in range(n // BLOCK)] for n in (512, 864, 1200, 1536)]
    convs: list[list[bytes]] = []  # each conversation's hashes so far
    for _ in range(a.conversations):
        sys_hashes = systems[rng.randrange(4)]
        convs.append(list(sys_hashes))
    turn = [0] * a.conversations
    sys_len = [len(h) * BLOCK for h in convs]
    times: dict[str, dict[str, list[float]]] = {k: {c: [] for c in CALLS} for k in cores}
    cold = Cold()
    n_req = 0

    timing = False

    def timed(k: str, call: str, fn: Any, *args: Any) -> Any:
        if not timing:
            return fn(*args)
        cold()
        t = time.perf_counter()
        out = fn(*args)
        times[k][call].append(time.perf_counter() - t)
        return out

    for rnd in range(a.warmup + a.rounds):
        timing = rnd >= a.warmup
        # The first rounds compute their system prompts (the engine's cache has none yet):
        # they reach the CPU pool, as in vLLM; later the engine's prefix hit covers them.
        engine_hit = rnd >= 8
        picked = rng.sample(range(a.conversations), a.per_round)
        batch = []
        for c in picked:
            if turn[c] == 0 or len(convs[c]) * BLOCK > 8192 - 768:
                convs[c] = convs[c][: sys_len[c] // BLOCK]
                turn[c] = 0
                grow = rng.randrange(2048, 5633) - sys_len[c]
            else:
                grow = rng.randrange(96, 769)
            turn[c] += 1
            n = len(convs[c]) * BLOCK + grow
            convs[c].extend(rng.randbytes(32) for _ in range(n // BLOCK - len(convs[c])))
            rid = f"cmpl-{rng.getrandbits(96):024x}-{n_req}"
            n_req += 1
            table = [blocks[free.pop()] for _ in range(n // BLOCK + 1)]
            batch.append((rid, n, list(convs[c]), sys_len[c] if engine_hit else 0, table))
        order = list(cores) if rnd % 2 else list(reversed(cores))
        answers: dict[str, list[Any]] = {k: [] for k in cores}
        for rid, n, hashes, hit, table in batch:
            for k in order:
                s = cores[k]
                timed(k, "sync_request", s.sync_request, rid, n, hashes)
                got = timed(k, "lookup_request", s.lookup_request, rid, n, hashes, hit)
                got = got or 0
                job = timed(k, "allocate", s.allocate, rid, [table], hit, got)
                answers[k].append((got, job is not None))
        assert answers["this"] == answers["other"], rnd
        # Untimed: the loads complete, the prompts are prefilled and stored, the requests end.
        ids = [b[0] for b in batch]
        for k, s in cores.items():
            loads, *_ = s.schedule_batch([], [])
            for j in loads:
                s.complete(j)
            computed = [
                hit + got for (_, _, _, hit, _), (got, _) in zip(batch, answers[k], strict=True)
            ]
            added = {rid: n - c for (rid, n, *_), c in zip(batch, computed, strict=True)}
            tables = [(rid, [[b.block_id for b in t]]) for rid, _, _, _, t in batch]
            _, _, stores, *_ = s.schedule_batch(
                ids, computed, added=added, tables=tables, written=[]
            )
            for j in stores:
                s.complete(j)
            s.schedule_batch([], [], finished=ids)
        for *_, table in batch:
            free.extend(b.block_id for b in table)
    print(
        f"{a.rounds * a.per_round} new requests (after {a.warmup * a.per_round} untimed), "
        f"median us per call (cold caches):"
    )
    for call in CALLS:
        o = statistics.median(times["other"][call]) * 1e6
        t = statistics.median(times["this"][call]) * 1e6
        print(f"  {call:<15} other {o:8.1f}  this {t:8.1f}  other/this {o / t:5.2f}x")
    o = sum(statistics.median(times["other"][c]) for c in CALLS) * 1e6
    t = sum(statistics.median(times["this"][c]) for c in CALLS) * 1e6
    print(f"  {'sum':<15} other {o:8.1f}  this {t:8.1f}  other/this {o / t:5.2f}x")


if __name__ == "__main__":
    main()
