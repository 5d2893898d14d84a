"""Per-request cost of ``KvOffloadConnector.on_new_request`` inside vLLM 0.32's objects
(issue 12: at most 15 µs for a 6k-token prompt).

Run with the vLLM virtualenv (``make test-vllm`` builds it)::

    .venv-vllm/bin/python benches/vllm_new_request.py [--tokens 6000] [--requests 2000]
        [--rounds 5]

vLLM's real ``Scheduler`` with our connector is built as ``benches/vllm_workload.py`` builds
it (full attention, 16-token blocks); ``--requests`` vLLM ``Request`` objects of ``--tokens``
random prompt tokens are made with vLLM's block hasher (``--tokens // 16`` SHA-256 block
hashes each, computed untimed, as the frontend does). Each round then registers every request
through the connector as vLLM's ``Scheduler.add_request`` does (``on_new_request``), then
finishes them all in one core step (untimed) for the next round. The numbers are the engine
thread's CPU time per call (one clock read per round), median, best and worst round, with the
same loop over a no-op function for the overhead the bench's loop itself adds, and over the
core's ``sync_request`` alone (the one call ``on_new_request`` makes: hash conversion included).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_workload import Workload, _import_vllm, build_scheduler


def _per_call(fn: Any, items: list[Any]) -> float:
    """CPU seconds per call of ``fn`` over ``items`` (one clock read per round)."""
    clock = time.thread_time
    t = clock()
    for x in items:
        fn(x)
    return (clock() - t) / len(items)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tokens", type=int, default=6000, help="prompt tokens per request")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    v = _import_vllm()
    s, hasher = build_scheduler(Workload(b=64, attention="full", steps=0, warmup=0), "ours")
    side = s.get_kv_connector().scheduler_side
    rng = random.Random(0)
    sp = v.SamplingParams(max_tokens=16, ignore_eos=True)
    reqs = [
        v.Request(
            request_id=f"r{k}",
            prompt_token_ids=[rng.randrange(32000) for _ in range(args.tokens)],
            sampling_params=sp,
            pooling_params=None,
            block_hasher=hasher,
        )
        for k in range(args.requests)
    ]
    n_hashes = len(reqs[0].block_hashes)
    conn = s.get_kv_connector()
    calls: list[float] = []
    core: list[float] = []
    noop: list[float] = []
    ids = [r.request_id for r in reqs]

    def sync(r: Any) -> None:
        side.sched.sync_request(r.request_id, r.num_prompt_tokens, r.block_hashes)

    for _ in range(args.rounds):
        noop.append(_per_call(lambda _r: None, reqs))
        calls.append(_per_call(conn.on_new_request, reqs))
        side.sched.schedule_batch([], [], finished=ids)  # forgotten: registered again next
        side.hashes.clear()
        core.append(_per_call(sync, reqs))  # the core's call alone, as on_new_request makes it
        side.sched.schedule_batch([], [], finished=ids)

    med = 1e6 * statistics.median(calls)
    print(
        f"on_new_request, {args.tokens} tokens ({n_hashes} hashes), {args.rounds} rounds of "
        f"{len(reqs)} calls: median {med:.2f} us/call, best {1e6 * min(calls):.2f}, worst "
        f"{1e6 * max(calls):.2f} ({1e3 * med / n_hashes:.1f} ns per hash); the bench's loop "
        f"alone {1e6 * statistics.median(noop):.2f} us/call; the core's sync_request alone "
        f"{1e6 * statistics.median(core):.2f} us/call"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
