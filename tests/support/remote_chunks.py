"""A process that writes or reads known chunks through the shared tier (for multi-process and
multi-host tests).

    python -m tests.support.remote_chunks write URL SALT FIRST COUNT
    python -m tests.support.remote_chunks read URL SALT FIRST COUNT

Chunk ``k`` holds :func:`chunk` ``(k)``. ``read`` prints one JSON object: per key its outcome,
and how many "hit" chunks differ from the known bytes (``wrong``, which must be 0).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kvoffload._core import RemoteClient, namespace_digest

CHUNK = 64 << 10
SHAPES = [[2, 16, 8, 64]]


def namespace(salt: str) -> int:
    """The namespace of the test engine's chunks for tenant ``salt``."""
    return namespace_digest(
        model="test-model",
        dtype="bfloat16",
        tensor_shapes=SHAPES,
        block_size=16,
        blocks_per_chunk=1,
        cache_salt=salt,
    )


def chunk(key: int, size: int = CHUNK) -> np.ndarray:
    """The known bytes of chunk ``key``."""
    return np.random.default_rng(key).integers(0, 256, size=size, dtype=np.uint8)


def main(argv: list[str]) -> int:
    op, url, salt, first, count = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    keys = list(range(first, first + count))
    client = RemoteClient(url, deadline_ms=5000)
    ns = namespace(salt)
    if op == "write":
        data = np.concatenate([chunk(k) for k in keys])
        ok = client.write(ns, keys, data)
        print(json.dumps({"written": sum(ok)}))
        return 0 if all(ok) else 1
    out = np.zeros(count * CHUNK, dtype=np.uint8)
    outcomes = client.read(ns, keys, out)
    wrong = sum(
        1
        for i, (k, o) in enumerate(zip(keys, outcomes, strict=True))
        if o == "hit" and not np.array_equal(out[i * CHUNK : (i + 1) * CHUNK], chunk(k))
    )
    exists = client.exists(ns, keys)
    print(json.dumps({"outcomes": outcomes, "wrong": wrong, "exists": exists}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
