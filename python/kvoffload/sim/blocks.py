"""The simulated engine's GPU block pool: reference counts, a prefix cache keyed by chained
hashes, and an LRU free queue."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.sim.config import NULL_BLOCK, SimError

__all__ = ["BlockPool"]


class BlockPool:
    """GPU blocks with reference counts, a prefix cache and an LRU free queue.

    Block 0 is the null block and never allocated. A freed block keeps its cached content and
    hash until it is allocated again: then its hash is evicted and it will be re-written. A
    cache hit on a free block takes it out of the free queue, content intact.
    """

    def __init__(self, num_blocks: int) -> None:
        """``num_blocks`` blocks, block 0 reserved."""
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key: list[tuple[int, int] | None] = [None] * num_blocks
        self.cache: dict[tuple[int, int], int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.evictions = 0

    def num_free(self) -> int:
        """Blocks in the free queue (cached or not)."""
        return len(self.free)

    def cached(self, group: int, h: int) -> int | None:
        """The block caching ``(group, hash)``, or None."""
        return self.cache.get((group, h))

    def touch(self, block: int) -> None:
        """Takes a reference on a cache hit (out of the free queue if it was free)."""
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def take(self, n: int) -> list[int]:
        """Allocates ``n`` blocks from the front of the free queue (evicting their hashes)."""
        if n > len(self.free):
            raise SimError(f"asked for {n} blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            k = self.key[b]
            if k is not None:
                del self.cache[k]
                self.key[b] = None
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drops one reference of each block, in the order given; free blocks join the tail."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
            elif self.ref[b] < 0:  # pragma: no cover - a simulator bug
                raise SimError(f"block {b} released more often than taken")

    def register(self, block: int, group: int, h: int) -> None:
        """Caches a full block under ``(group, hash)`` unless that content is cached already."""
        k = (group, h)
        if self.key[block] is None and k not in self.cache:
            self.cache[k] = block
            self.key[block] = k
