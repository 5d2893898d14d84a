"""The workers' report message: ``by_rank`` (one rank with nothing failed takes a short path)
answers what the general form answers, whatever ranks and failures the report holds."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvoffload.integrations.vllm.messages import KvOffloadWorkerMetadata

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _general(m: KvOffloadWorkerMetadata) -> dict[int, tuple[list[int], list[int]]]:
    ranks = sorted(m.done.keys() | m.failed.keys())
    return {r: (m.done.get(r, []), m.failed.get(r, [])) for r in ranks}


@pytest.mark.parametrize(
    ("done", "failed"),
    [
        ({}, {}),
        ({0: [3, 1, 2]}, {}),
        ({1: []}, {}),
        ({0: [5]}, {0: [6]}),
        ({}, {0: [6]}),
        ({0: [1]}, {1: [2]}),
        ({1: [4], 0: [1, 2]}, {}),
        ({1: [4], 0: [1, 2]}, {1: [7]}),
    ],
)
def test_by_rank_answers_the_general_form(
    done: dict[int, list[int]], failed: dict[int, list[int]]
) -> None:
    m = KvOffloadWorkerMetadata(done=done, failed=failed)
    got = m.by_rank()
    assert got == _general(m)
    assert list(got) == sorted(got), "ranks in increasing order"
    for r, (d, f) in got.items():
        assert d is done.get(r, d), "the report's own list, not a copy"
        assert f == failed.get(r, [])
