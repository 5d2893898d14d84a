"""The simulated engine's KV cache: real tensors written with the oracle's bytes, and the checks
of what was loaded, stored and hit against the oracle.

Each forward step writes the bytes of :mod:`kvoffload.sim.oracle` for every computed token into
the tensors (one per layer, ``(num_gpu_blocks, block_size, token_bytes)`` uint8, shared by every
KV group as in a hybrid allocator), so the correct content of every block is always known. A
loaded block, a stored CPU slot and a prefix-cache hit are compared byte for byte with it;
differences are counted in the run's :class:`~kvoffload.sim.result.SimResult` with a
:class:`~kvoffload.sim.result.Mismatch` record each (the first 100).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.sim.config import NULL_BLOCK, SimConfig, SimError
from kvoffload.sim.oracle import token_bytes
from kvoffload.sim.request import SimRequest
from kvoffload.sim.result import Mismatch, SimResult

__all__ = ["KvCache", "Transfers"]

Transfers = list[tuple[int, list[int], list[int]]]
"""A job's copies as ``(group, GPU blocks, CPU slots)`` per group."""


class KvCache:
    """The KV tensors of the simulated engine and the integrity oracle's checks of them."""

    def __init__(self, cfg: SimConfig, result: SimResult) -> None:
        """Allocates one zeroed tensor per layer on ``cfg.device``; counts into ``result``."""
        self.cfg = cfg
        self.result = result
        self.bs = cfg.block_size
        self.width = cfg.token_bytes
        self.ng = len(cfg.windows)
        self.device = torch.device(cfg.device)
        self.kv = [
            torch.zeros(
                (cfg.num_gpu_blocks, self.bs, self.width), dtype=torch.uint8, device=self.device
            )
            for _ in range(cfg.num_layers)
        ]
        self.kv_np = [t.numpy() for t in self.kv] if self.device.type == "cpu" else None

    def forward(self, scheduled: list[tuple[SimRequest, int, int]], step: int) -> None:
        """Writes the oracle's bytes for every token computed this step (``(request, first
        position, tokens)`` each)."""
        if not scheduled:
            return
        bs = self.bs
        pos_l, par_l, tok_l = [], [], []
        blk_l: list[list[npt.NDArray[np.int64]]] = [[] for _ in range(self.ng)]
        for r, start, n in scheduled:
            pos = np.arange(start, start + n, dtype=np.int64)
            pos_l.append(pos)
            par_l.append(r.stream.parents[pos // bs])
            tok_l.append(r.stream.tokens[pos])
            for g in range(self.ng):
                blk_l[g].append(np.asarray(r.tables[g], dtype=np.int64)[pos // bs])
        pos = np.concatenate(pos_l)
        par = np.concatenate(par_l)
        tok = np.concatenate(tok_l)
        off = pos % bs

        for g in range(self.ng):
            blk = np.concatenate(blk_l[g])
            if (blk == NULL_BLOCK).any():  # pragma: no cover - a simulator bug
                raise SimError(f"step {step}: a computed token maps to the null block")
            for layer in range(self.cfg.num_layers):
                vals = token_bytes(par, pos, tok, g, layer, self.width)
                if self.kv_np is not None:
                    self.kv_np[layer][blk, off] = vals
                else:
                    t = self.kv[layer]
                    t[torch.from_numpy(blk).to(t.device), torch.from_numpy(off).to(t.device)] = (
                        torch.from_numpy(vals).to(t.device)
                    )

    def _expected(self, r: SimRequest, g: int, positions: Sequence[int], layer: int) -> np.ndarray:
        bs = self.bs
        pos = (np.asarray(positions, dtype=np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
        return r.stream.content(pos, g, layer, self.width).reshape(len(positions), bs, self.width)

    def _actual(self, blocks: Sequence[int], layer: int) -> np.ndarray:
        idx = np.asarray(blocks, dtype=np.int64)
        if self.kv_np is not None:
            return self.kv_np[layer][idx]
        return self.kv[layer][torch.from_numpy(idx).to(self.device)].cpu().numpy()

    def _compare(
        self, r: SimRequest, g: int, blocks: list[int], positions: list[int]
    ) -> npt.NDArray[np.bool_]:
        bad = np.zeros(len(blocks), dtype=bool)
        for layer in range(self.cfg.num_layers):
            exp = self._expected(r, g, positions, layer)
            bad |= (self._actual(blocks, layer) != exp).reshape(len(blocks), -1).any(axis=1)
        return bad

    def verify_load(self, r: SimRequest, job: int, transfers: Transfers, step: int) -> None:
        """Compares the blocks a completed load wrote with the oracle (a mismatch per chunk)."""
        bpc = self.cfg.blocks_per_chunk
        for g, gpu, _cpu in transfers:
            where = {b: j for j, b in enumerate(r.tables[g]) if b != NULL_BLOCK}
            positions = []
            for b in gpu:
                if b not in where:
                    raise SimError(f"load {job} of {r.id} writes block {b}, not in its table")
                positions.append(where[b])
            bad = self._compare(r, g, gpu, positions)
            self.result.blocks_verified += len(gpu)
            seen: set[int] = set()
            for k in np.flatnonzero(bad):
                chunk = positions[k] // bpc
                if chunk not in seen:
                    seen.add(chunk)
                    self.result.mismatches += 1
                    self._detail("load", r, g, positions[k], gpu[k], job, step)

    def verify_store(
        self,
        r: SimRequest,
        job: int,
        copies: Transfers,
        cpu_region: Callable[[int, int], torch.Tensor],
        step: int,
    ) -> None:
        """Diagnostic: compares what a store wrote to the CPU pool with the oracle.

        Args:
            r: The request stored.
            job: The store job.
            copies: ``(group, positions, CPU slots)`` per group; position -1: a block the
                request no longer held when the store was planned (counted as torn).
            cpu_region: ``(group, layer)`` -> that CPU pool region (slot-indexed).
            step: The current step, for the record.
        """
        for g, positions, cpu in copies:
            for layer in range(self.cfg.num_layers):
                region = cpu_region(g, layer).numpy()
                got = region[np.asarray(cpu)].reshape(len(cpu), self.bs, self.width)
                for k, pos in enumerate(positions):
                    if pos < 0:
                        self.result.torn_stores += 1
                        continue
                    exp = self._expected(r, g, [pos], layer)[0]
                    if not np.array_equal(got[k], exp):
                        self.result.torn_stores += 1
                        if len(self.result.mismatch_details) < 100:
                            self._detail("store", r, g, pos, -1, job, step)

    def verify_hits(self, r: SimRequest, hit_tables: list[list[int]], step: int) -> None:
        """Compares prefix-cache hit blocks with the oracle (a check of the simulator itself)."""
        for g, row in enumerate(hit_tables):
            pairs = [(b, j) for j, b in enumerate(row) if b != NULL_BLOCK]
            if not pairs:
                continue
            blocks = [b for b, _ in pairs]
            positions = [j for _, j in pairs]
            bad = self._compare(r, g, blocks, positions)
            self.result.hit_blocks_verified += len(blocks)
            for k in np.flatnonzero(bad):
                self.result.hit_mismatches += 1
                self._detail("hit", r, g, positions[k], blocks[k], None, step)

    def _detail(
        self, kind: str, r: SimRequest, g: int, pos: int, block: int, job: int | None, step: int
    ) -> None:
        if len(self.result.mismatch_details) < 100:
            self.result.mismatch_details.append(
                Mismatch(
                    kind=kind,
                    request=r.id,
                    group=g,
                    chunk=pos // self.cfg.blocks_per_chunk,
                    position=pos,
                    block=int(block),
                    step=step,
                    job=job,
                )
            )
