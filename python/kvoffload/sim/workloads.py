"""Seeded, reproducible workloads for the simulated engine.

Each workload is a list of :class:`RequestSpec`: a token stream (shared by every request that
extends it), how much of it is the prompt, how many tokens are generated, and when the request
arrives. Three shapes of prefix reuse, the ones that make a CPU tier pay off:

* ``chat``: multi-turn conversations; turn ``k + 1``'s prompt is turn ``k``'s prompt, its answer
  and a new user message. A turn arrives a few steps after the previous one finished.
* ``sysprompt``: many requests sharing one of a few long system prompts, each with its own
  question.
* ``docs``: long documents, each re-read several times with different questions.
* ``mixed``: the three interleaved.

The same ``(workload, num_requests, seed)`` always gives the same requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvoffload.sim.oracle import Stream

__all__ = ["WORKLOADS", "RequestSpec", "make_workload"]

_VOCAB = 32_000
_PAD = 4
"""Extra tokens at the end of every stream (an asynchronous engine may compute one more)."""


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
        req_id: Unique id.
        stream: The token stream; the request's tokens are ``stream.tokens[:prompt_len +
            output_len]``.
        prompt_len: Prompt tokens.
        output_len: Tokens to generate (at least 1).
        arrival: Step at which it arrives; for a follow-up turn, steps after its predecessor
            finished.
        after: Id of the request that must finish first (previous turn), or None.
    """

    req_id: str
    stream: Stream
    prompt_len: int
    output_len: int
    arrival: int
    after: str | None = None


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1, _VOCAB, size=int(n), dtype=np.int64)


def _len(rng: np.random.Generator, lo: int, hi: int, scale: float) -> int:
    return max(1, int(rng.integers(lo, hi + 1) * scale))


def chat(
    n: int, rng: np.random.Generator, block_size: int, scale: float, gap: float, prefix: str = ""
) -> list[RequestSpec]:
    """Multi-turn conversations: ``n`` turns over about ``n / 4`` conversations."""
    convs = max(1, n // 4)
    turns = [1] * convs
    for _ in range(n - convs):
        turns[int(rng.integers(convs))] += 1
    out: list[RequestSpec] = []
    span = max(1, int(n * gap))
    for c in range(convs):
        parts = [_tokens(rng, _len(rng, 128, 640, scale))]
        bounds: list[tuple[int, int]] = []
        length = len(parts[0])
        for _ in range(turns[c]):
            user = _tokens(rng, _len(rng, 32, 256, scale))
            answer = _tokens(rng, _len(rng, 16, 96, scale))
            length += len(user)
            bounds.append((length, len(answer)))
            length += len(answer)
            parts += [user, answer]
        parts.append(_tokens(rng, _PAD))
        stream = Stream(np.concatenate(parts), block_size)
        start = int(rng.integers(span))
        prev: str | None = None
        for t, (plen, olen) in enumerate(bounds):
            rid = f"{prefix}chat-c{c}-t{t}"
            think = start if prev is None else int(rng.integers(2, 40))
            out.append(RequestSpec(rid, stream, plen, olen, think, prev))
            prev = rid
    return out


def sysprompt(
    n: int, rng: np.random.Generator, block_size: int, scale: float, gap: float, prefix: str = ""
) -> list[RequestSpec]:
    """``n`` requests over 3 long system prompts (skewed popularity), each its own question."""
    prompts = [_tokens(rng, _len(rng, 768, 1536, scale)) for _ in range(3)]
    weights = np.array([0.6, 0.3, 0.1])
    span = max(1, int(n * gap))
    arrivals = np.sort(rng.integers(0, span, size=n))
    out: list[RequestSpec] = []
    for i in range(n):
        sp = prompts[int(rng.choice(3, p=weights))]
        q = _tokens(rng, _len(rng, 16, 128, scale))
        olen = _len(rng, 8, 64, scale)
        toks = np.concatenate([sp, q, _tokens(rng, olen + _PAD)])
        stream = Stream(toks, block_size)
        out.append(
            RequestSpec(f"{prefix}sys-{i}", stream, len(sp) + len(q), olen, int(arrivals[i]))
        )
    return out


def docs(
    n: int, rng: np.random.Generator, block_size: int, scale: float, gap: float, prefix: str = ""
) -> list[RequestSpec]:
    """``n`` questions over about ``n / 5`` long documents, asked at random times."""
    documents = [_tokens(rng, _len(rng, 1024, 3072, scale)) for _ in range(max(1, n // 5))]
    span = max(1, int(n * gap))
    arrivals = np.sort(rng.integers(0, span, size=n))
    out: list[RequestSpec] = []
    for i in range(n):
        d = documents[int(rng.integers(len(documents)))]
        q = _tokens(rng, _len(rng, 16, 64, scale))
        olen = _len(rng, 8, 48, scale)
        toks = np.concatenate([d, q, _tokens(rng, olen + _PAD)])
        stream = Stream(toks, block_size)
        out.append(RequestSpec(f"{prefix}doc-{i}", stream, len(d) + len(q), olen, int(arrivals[i])))
    return out


def mixed(
    n: int, rng: np.random.Generator, block_size: int, scale: float, gap: float, prefix: str = ""
) -> list[RequestSpec]:
    """The three workloads together, about a third of the requests each."""
    a = n // 3
    b = (n - a) // 2
    return (
        chat(a, rng, block_size, scale, gap * 3, prefix)
        + sysprompt(b, rng, block_size, scale, gap * 3, prefix)
        + docs(n - a - b, rng, block_size, scale, gap * 3, prefix)
    )


WORKLOADS: dict[
    str, Callable[[int, np.random.Generator, int, float, float, str], list[RequestSpec]]
] = {"chat": chat, "sysprompt": sysprompt, "docs": docs, "mixed": mixed}
"""Workload generators by name."""


def make_workload(
    name: str,
    num_requests: int,
    seed: int,
    block_size: int,
    *,
    scale: float = 1.0,
    gap: float = 2.0,
) -> list[RequestSpec]:
    """Builds a workload.

    Args:
        name: One of :data:`WORKLOADS`.
        num_requests: Requests to generate (at least 1).
        seed: Random seed; the same arguments give the same requests.
        block_size: Tokens per hashed block.
        scale: Multiplies every length (prompts, documents, answers); < 1 for quick tests.
        gap: Mean steps between arrivals.

    Raises:
        ValueError: Unknown workload name or a non-positive size.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    rng = np.random.default_rng(seed)
    return WORKLOADS[name](num_requests, rng, block_size, scale, gap, "")
