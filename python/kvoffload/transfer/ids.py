"""Job ids: integer arguments checked one way, and the ids an engine has seen.

An id that is not an integer (or is a bool) raises the caller's exception naming the value.
:class:`_IdRanges` remembers which job ids an engine has accepted, in bounded memory
(``docs/design-notes.md``, "Bounded memory of job ids"), so a flush or wait of an id the engine
never saw raises instead of being skipped.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable

from kvoffload.errors import TransferError, UnknownJobError

_MAX_ID_RANGES = 4096
"""Ranges of job ids an engine remembers exactly (see :class:`_IdRanges`)."""


class _IdRanges:
    """The job ids an engine has accepted, as sorted disjoint ranges ``[lo, hi)``.

    The scheduler's ids grow by one, so this is one range in practice. Past ``limit`` ranges the
    two lowest merge: an id in a gap that old then counts as known (finished), never the
    reverse, so a live job is never reported unknown and memory stays bounded.
    """

    def __init__(self, limit: int = _MAX_ID_RANGES) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        self._limit = limit

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self._lo, x) - 1
        return i >= 0 and x < self._hi[i]

    def __len__(self) -> int:
        return len(self._lo)

    def add(self, x: int) -> None:
        lo, hi = self._lo, self._hi
        i = bisect.bisect_right(lo, x) - 1  # the range starting at or before x
        if i >= 0 and x < hi[i]:
            return
        if i >= 0 and hi[i] == x:
            hi[i] = x + 1
            if i + 1 < len(lo) and lo[i + 1] == x + 1:  # joins the next range
                hi[i] = hi[i + 1]
                del lo[i + 1], hi[i + 1]
        elif i + 1 < len(lo) and lo[i + 1] == x + 1:
            lo[i + 1] = x
        else:
            lo.insert(i + 1, x)
            hi.insert(i + 1, x + 1)
            if len(lo) > self._limit:
                hi[0] = hi[1]
                del lo[1], hi[1]


def _job_id(x: object, where: str) -> int:
    """A job id: an integer (not a bool); raises UnknownJobError naming ``x``."""
    return _index(x, f"{where}: job id", UnknownJobError)


def _id_list(xs: object, where: str) -> list[int]:
    """Job ids from an iterable; raises UnknownJobError naming the bad value."""
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable):
        raise UnknownJobError(
            f"{where}: job ids must be an iterable of integers, got {xs!r} ({type(xs).__name__})"
        )
    return [_job_id(x, where) for x in xs]


def _index(x: object, name: str, exc: type[Exception]) -> int:
    """An integer argument (not a bool); raises ``exc`` naming ``name`` and the value."""
    if isinstance(x, bool):
        raise exc(f"{name} must be an integer, got {x!r}")
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise exc(f"{name} must be an integer, got {x!r} ({type(x).__name__})") from None


def _ids(xs: object, what: str) -> list[int]:
    """Job ids of a plan; raises TransferError naming the bad value."""
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable):
        raise TransferError(f"{what} must be an iterable of job ids, got {xs!r}")
    return [_index(x, f"{what}: job id", TransferError) for x in xs]
