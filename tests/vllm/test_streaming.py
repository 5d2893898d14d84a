"""Streaming-input sessions (vLLM's resumable requests): a session that stops and receives its
next input chunk keeps its computed tokens, drops the last sampled token, and vLLM truncates its
block hashes at the computed frontier before hashing the new tokens. The hashes the core held
beyond that point belonged to other tokens: a block stored under such a stale key would serve
the session's new tokens to a request whose prompt really has the old ones.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from tests.vllm.harness import BS, Harness, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _chunk(h: Harness, rid: str, tokens: list[int], max_tokens: int, resumable: bool) -> Request:
    """A session's request (its first input chunk, a next one, or with ``resumable`` False its
    end), as the engine hands it to vLLM's scheduler."""
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=h.hasher,
        resumable=resumable,
    )


def _session(h: Harness, rid: str, tokens: list[int], max_tokens: int) -> Request:
    req = _chunk(h, rid, tokens, max_tokens, resumable=True)
    h.reqs[rid] = req
    h.true_tokens[rid] = list(tokens)
    h.sched.add_request(req)
    return req


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("prompt_len", "max_tokens"), [(2 * BS - 1, 1), (3 * BS - 1, 2), (2 * BS, 3)]
)
def test_session_update_never_stores_new_tokens_under_the_old_hashes(
    async_sched: bool, prompt_len: int, max_tokens: int
) -> None:
    """A session's first chunk ends with a sampled token that completes a block (vLLM hashes
    it) but is never computed; the next chunk replaces it. Requests whose prompts hold the old
    tokens and the new ones are then served from the CPU tier, every loaded block checked."""
    h = Harness(num_blocks=64, async_scheduling=async_sched)
    try:
        first = prompt(1, prompt_len)
        sess = _session(h, "s", first, max_tokens=max_tokens)
        stopped = lambda: sess.status == RequestStatus.WAITING_FOR_STREAMING_REQ  # noqa: E731
        h.step_until(stopped, "the session to stop")
        h.flush_outputs()
        old = list(sess.all_token_ids)  # the uncomputed sampled token included
        h.sched.add_request(_chunk(h, "s", prompt(2, 2 * BS), 1, resumable=True))
        new = list(sess.all_token_ids)
        assert new[: sess.num_computed_tokens] == old[: sess.num_computed_tokens]
        assert new[: len(old)] != old  # the session really replaced a hashed token
        h.true_tokens["s"] = new
        h.step_until(stopped, "the second chunk")
        h.flush_outputs()
        computed = sess.num_computed_tokens
        # The session ends (a non-resumable update), and vLLM's own prefix cache is emptied:
        # what the next requests reuse comes from the CPU tier.
        h.sched.add_request(_chunk(h, "s", [1], 1, resumable=False))
        h.drain()
        assert h.sched.reset_prefix_cache()
        core = h.conn.scheduler_side.sched  # type: ignore[union-attr]
        # Another request per version of the tokens, each padded past a block: whatever the
        # connector loads for them must be their own tokens' KV (the harness checks each
        # loaded block).
        h.add("old", old[: len(old) // BS * BS] + prompt(3, BS), max_tokens=1)
        h.add("new", new[: len(new) // BS * BS] + prompt(4, BS), max_tokens=1)
        h.run_until_done()
        h.drain()
        # Together they load the session's stored blocks once each: "old" the blocks before
        # the replaced token (vLLM's cache has them when "new" looks up), "new" the rest. A
        # block stored under a stale hash would be loaded by "old" too and fail the check.
        assert core.stats()["load_tokens"] == computed // BS * BS
    finally:
        h.shutdown()
