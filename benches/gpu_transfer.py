"""CUDA bandwidth of the data plane against a plain pinned ``copy_`` (run when a GPU is lent).

Run::

    .venv/bin/python benches/gpu_transfer.py            # all cases, ~1 minute on an H100/H200
    .venv/bin/python benches/gpu_transfer.py --quick    # fewer rounds and bytes

Without a CUDA device it prints why and exits with status 2.

Each case moves one job of ``--job-mib`` between KV tensors on the GPU (one KV group of
``--tensors`` block-first tensors) and the engine's pinned CPU pool, timed on the host from
``submit_store``/``submit_load`` to the end of ``wait`` (so submission cost is included). The
baseline is one ``copy_(non_blocking=True)`` of the same number of bytes between a contiguous
GPU tensor and a pinned CPU tensor, timed the same way in the same run; the ratio is the
engine's share of it. Cases (DESIGN.md §7 budgets):

* ``chunks``: every chunk of every tensor is one contiguous copy of ``chunk`` bytes (scattered
  slots, chunk-aligned GPU blocks), chunk ∈ {256 KiB, 1 MiB, 4 MiB}: budget ≥ 90%.
* ``contiguous``: the whole job coalesces into one copy per tensor: budget ≥ 90%.
* ``blocks``: scattered single blocks of 16 and 32 KiB (``blocks_per_chunk=1``, random GPU
  blocks and CPU positions), one copy per block per tensor: budget ≥ 60%.

``--experiments`` adds rows for a gather-based alternative (``index_select`` into a staging
buffer on the GPU, then one copy into a contiguous pinned range), as an upper bound for a future
batched path; the engine does not use it.

Every case checks its bytes after the round trip (store, then load into other blocks).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload.transfer import TransferEngine

KIB = 1 << 10
MIB = 1 << 20


@dataclass
class Row:
    """One line of the table."""

    case: str
    direction: str
    size: int
    copies: int
    engine_s: float
    plain_s: float
    submit_s: float
    budget: float | None

    def line(self, job_bytes: int) -> str:
        ratio = self.plain_s / self.engine_s
        verdict = "" if self.budget is None else ("ok" if ratio >= self.budget else "BELOW")
        budget = "" if self.budget is None else f"{self.budget:.0%}"
        return (
            f"{self.case:12} {self.direction:5} {self.size // KIB:>6}KiB {self.copies:>7} "
            f"{job_bytes / self.engine_s / 1e9:>9.2f} {job_bytes / self.plain_s / 1e9:>9.2f} "
            f"{ratio:>6.2f} {self.submit_s * 1e3:>9.2f} {budget:>6} {verdict}"
        )


def best_of(fn: Callable[[], object], rounds: int, warmup: int = 2) -> float:
    """Minimum host time of ``fn`` (which must synchronise) over ``rounds``."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def plain_copy_seconds(job_bytes: int, device: torch.device, rounds: int) -> dict[str, float]:
    """Best host time of one pinned ``copy_`` of ``job_bytes`` per direction."""
    gpu = torch.ones(job_bytes, dtype=torch.uint8, device=device)
    cpu = torch.empty(job_bytes, dtype=torch.uint8, pin_memory=True)

    def d2h() -> None:
        cpu.copy_(gpu, non_blocking=True)
        torch.cuda.synchronize(device)

    def h2d() -> None:
        gpu.copy_(cpu, non_blocking=True)
        torch.cuda.synchronize(device)

    return {"store": best_of(d2h, rounds), "load": best_of(h2d, rounds)}


def time_jobs(
    eng: TransferEngine,
    direction: str,
    gpu_ids: np.ndarray,
    cpu_ids: np.ndarray,
    ids: Iterator[int],
    args: argparse.Namespace,
) -> tuple[float, float, int]:
    """Best host time of a job (submit to end of wait), best submit time, copies per job."""
    submit = eng.submit_store if direction == "store" else eng.submit_load
    submit_times: list[float] = []
    copies: list[int] = []

    def job() -> None:
        jid = next(ids)
        t0 = time.perf_counter()
        submit(jid, [(0, gpu_ids, cpu_ids)])
        submit_times.append(time.perf_counter() - t0)
        eng.wait([jid])
        [res] = eng.poll()
        if not res.ok:
            raise RuntimeError(f"job {jid} failed: {res.error}")
        copies.append(res.copies)

    return best_of(job, args.rounds), min(submit_times), copies[-1]


def run_case(
    args: argparse.Namespace,
    device: torch.device,
    case: str,
    size: int,
    plain: dict[str, float],
    budget: float,
) -> list[Row]:
    """Measure store and load for one case; check the bytes; return two rows."""
    job_bytes = args.job_mib * MIB
    tensors = args.tensors
    rng = np.random.default_rng(0)
    if case == "blocks":
        bpc, block = 1, size
    else:
        bpc, block = 4, size // 4
    blocks_per_tensor = job_bytes // tensors // block
    chunks = blocks_per_tensor // bpc
    num_blocks = 2 * blocks_per_tensor  # room to load into other blocks
    gen = torch.Generator(device=device).manual_seed(0)
    kv = [
        torch.randint(0, 256, (num_blocks, block), dtype=torch.uint8, device=device, generator=gen)
        for _ in range(tensors)
    ]
    if case == "contiguous":
        gpu_ids = np.arange(blocks_per_tensor)
        cpu_ids = np.arange(blocks_per_tensor)
    else:
        offs = np.arange(bpc)
        gpu_chunks = rng.permutation(num_blocks // bpc)[:chunks]
        slots = rng.permutation(chunks)
        gpu_ids = (gpu_chunks[:, None] * bpc + offs).ravel()
        cpu_ids = (slots[:, None] * bpc + offs).ravel()
    rows = []
    with TransferEngine([kv], blocks_per_chunk=bpc, num_slots=chunks) as eng:
        assert eng.pinned
        ids = itertools.count()
        for direction in ("store", "load"):
            engine_s, submit_s, copies = time_jobs(eng, direction, gpu_ids, cpu_ids, ids, args)
            rows.append(
                Row(case, direction, size, copies, engine_s, plain[direction], submit_s, budget)
            )
        # integrity: store the source blocks, load them into the other half, compare
        others = np.setdiff1d(np.arange(num_blocks), gpu_ids)[: len(gpu_ids)]
        jid = next(ids)
        eng.submit_store(jid, [(0, gpu_ids, cpu_ids)])
        eng.wait([jid])
        jid2 = next(ids)
        eng.submit_load(jid2, [(0, others, cpu_ids)])
        eng.wait([jid2])
        assert all(r.ok for r in eng.poll())
        g, o = torch.as_tensor(gpu_ids, device=device), torch.as_tensor(others, device=device)
        for t in kv:
            if not torch.equal(t[g], t[o]):
                raise RuntimeError(f"{case} {size // KIB} KiB: loaded bytes differ")
    return rows


def run_gather_experiment(
    args: argparse.Namespace, device: torch.device, size: int, plain: dict[str, float]
) -> list[Row]:
    """Gather scattered blocks with index_select into a GPU staging buffer + one pinned copy."""
    job_bytes = args.job_mib * MIB
    n = job_bytes // size
    kv = torch.ones(2 * n, size, dtype=torch.uint8, device=device)
    idx = torch.as_tensor(np.random.default_rng(0).permutation(2 * n)[:n], device=device)
    stage = torch.empty(n, size, dtype=torch.uint8, device=device)
    pinned = torch.empty(n, size, dtype=torch.uint8, pin_memory=True)

    def store() -> None:
        torch.index_select(kv, 0, idx, out=stage)
        pinned.copy_(stage, non_blocking=True)
        torch.cuda.synchronize(device)

    def load() -> None:
        stage.copy_(pinned, non_blocking=True)
        kv.index_copy_(0, idx, stage)
        torch.cuda.synchronize(device)

    return [
        Row("gather-exp", "store", size, 2, best_of(store, args.rounds), plain["store"], 0, None),
        Row("gather-exp", "load", size, 2, best_of(load, args.rounds), plain["load"], 0, None),
    ]


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the cases, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0", help="CUDA device (default cuda:0)")
    parser.add_argument("--job-mib", type=int, default=256, help="bytes per job, MiB")
    parser.add_argument("--tensors", type=int, default=8, help="registered tensors (layers x K/V)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per case (best of)")
    parser.add_argument("--quick", action="store_true", help="64 MiB jobs, 3 rounds")
    parser.add_argument("--experiments", action="store_true", help="add gather-based rows")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_transfer.py: no CUDA device available (torch.cuda.is_available() is False); "
            "it measures the CUDA copy paths and needs a GPU. For the CPU path run: "
            "python -m pytest benches/bench_transfer.py --benchmark-enable",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        args.job_mib, args.rounds = 64, 3
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    job_bytes = args.job_mib * MIB
    plain = plain_copy_seconds(job_bytes, device, args.rounds)
    rows: list[Row] = []
    for chunk in (256 * KIB, 1 * MIB, 4 * MIB):
        rows += run_case(args, device, "chunks", chunk, plain, 0.90)
    rows += run_case(args, device, "contiguous", 1 * MIB, plain, 0.90)
    for block in (16 * KIB, 32 * KIB):
        rows += run_case(args, device, "blocks", block, plain, 0.60)
    if args.experiments:
        for block in (16 * KIB, 32 * KIB):
            rows += run_gather_experiment(args, device, block, plain)
    print(
        f"\n{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
        f"{args.job_mib} MiB per job, {args.tensors} tensors, best of {args.rounds}"
    )
    print(
        f"{'case':12} {'dir':5} {'size':>9} {'copies':>7} {'eng GB/s':>9} {'copy GB/s':>9} "
        f"{'ratio':>6} {'submit ms':>9} {'budget':>6}"
    )
    for row in rows:
        print(row.line(job_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
