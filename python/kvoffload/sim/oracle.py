"""The byte oracle: what every KV position of the simulated engine must hold.

A token stream is a numpy array of token ids. Its *chained block hashes* are computed the way an
engine computes its prefix-cache keys: the hash of block ``j`` covers the hash of block ``j - 1``
and the ``block_size`` token ids of block ``j``. The KV bytes of the token at position ``p`` in
group ``g``, layer ``l`` are a pure function of ``(parent hash of p's block, p, token id, g, l)``
(splitmix64 mixing, vectorised in numpy), so:

* two positions with equal chained hashes hold equal bytes (prefix sharing is sound);
* any wrong block — another request's, another position's, another group's or layer's, stale
  or half-written — differs from the expected bytes with overwhelming probability.

The simulated forward pass writes these bytes, and every load and every prefix-cache hit is
compared against them byte for byte.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

__all__ = ["ROOT_HASH", "Stream", "chained_hashes", "token_bytes"]

ROOT_HASH = 0x243F6A8885A308D3
"""Parent hash of the first block of every stream."""

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_POS = _U64(0xD6E8FEB86659FD93)
_TOK = _U64(0xA0761D6478BD642F)
_GRP = _U64(0xE7037ED1A0B428DB)
_LAY = _U64(0x8EBC6AF09C88C6E3)
_WORD = _U64(0x589965CC75374CC3)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser, element-wise (wrapping uint64 arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> _U64(30))) * _M1
    z = (z ^ (z >> _U64(27))) * _M2
    out: npt.NDArray[np.uint64] = z ^ (z >> _U64(31))
    return out


def chained_hashes(
    tokens: npt.NDArray[np.int64], block_size: int, parent: int = ROOT_HASH
) -> list[int]:
    """Chained hashes of the complete blocks of ``tokens`` (63-bit non-negative ints).

    Args:
        tokens: Token ids.
        block_size: Tokens per hashed block.
        parent: Hash of the block before ``tokens[0]`` (the root for a whole stream).

    Returns:
        One hash per complete block.
    """
    out: list[int] = []
    n = len(tokens) // block_size
    raw = np.ascontiguousarray(tokens[: n * block_size], dtype=np.int64).tobytes()
    step = block_size * 8
    h = parent
    for j in range(n):
        d = hashlib.blake2b(
            h.to_bytes(8, "little") + raw[j * step : (j + 1) * step], digest_size=8
        ).digest()
        h = int.from_bytes(d, "little") & 0x7FFF_FFFF_FFFF_FFFF
        out.append(h)
    return out


def token_bytes(
    parents: npt.NDArray[np.uint64],
    positions: npt.NDArray[np.int64],
    tokens: npt.NDArray[np.int64],
    group: int,
    layer: int,
    width: int,
) -> npt.NDArray[np.uint8]:
    """The KV bytes of tokens, shape ``[n, width]``.

    Args:
        parents: Per token, the chained hash of the block before the token's block.
        positions: Per token, its position in the stream.
        tokens: Per token, its id.
        group: KV group.
        layer: Layer within the group.
        width: Bytes per token per layer.
    """
    n = positions.shape[0]
    base = (
        parents.astype(np.uint64, copy=False)
        ^ (positions.astype(np.uint64) * _POS)
        ^ (tokens.astype(np.uint64) * _TOK)
        ^ (np.full(n, group, dtype=np.uint64) * _GRP)
        ^ (np.full(n, layer, dtype=np.uint64) * _LAY)
    )
    words = -(-width // 8)
    idx = np.arange(words, dtype=np.uint64) * _WORD
    out = _mix(_mix(base)[:, None] ^ idx[None, :])
    return out.view(np.uint8).reshape(n, words * 8)[:, :width]


class Stream:
    """A token stream and its chained block hashes, shared by the requests that extend it.

    Attributes:
        tokens: Token ids (int64).
        block_size: Tokens per hashed block.
        hashes: Chained hash of each complete block (uint64 array).
        parents: Parent hash per block index (``parents[j]`` = hash of block ``j - 1``).
    """

    def __init__(self, tokens: npt.NDArray[np.int64], block_size: int) -> None:
        """Hashes every complete block of ``tokens``."""
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        self.block_size = block_size
        hs = chained_hashes(self.tokens, block_size)
        self.hash_list = hs
        self.hashes = np.array(hs, dtype=np.uint64)
        nblocks = -(-len(self.tokens) // block_size)
        parents = np.empty(nblocks, dtype=np.uint64)
        parents[0] = ROOT_HASH
        parents[1:] = self.hashes[: nblocks - 1]
        self.parents = parents

    def __len__(self) -> int:
        return len(self.tokens)

    def content(
        self, positions: npt.NDArray[np.int64], group: int, layer: int, width: int
    ) -> npt.NDArray[np.uint8]:
        """Expected KV bytes of ``positions`` of this stream, shape ``[n, width]``."""
        return token_bytes(
            self.parents[positions // self.block_size],
            positions,
            self.tokens[positions],
            group,
            layer,
            width,
        )
