"""The data plane's surface under hostile use: memory safety of the core copy, no
leak of an engine dropped in a reference cycle, thread safety of poll/wait/fence, the one
worker-step call, one copy path for test hooks, and bad input.

Items that could kill or hang the interpreter run in a subprocess: the test then checks that
the interpreter survived and what it printed.
"""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import _core
from kvoffload.errors import (
    ConfigError,
    InvalidBlockError,
    KvOffloadError,
    TransferError,
    UnknownJobError,
)
from kvoffload.transfer import TransferEngine

NB = 8  # GPU blocks
BPB = 64  # bytes per block


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter (the timeout is a hang detector, not a budget)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def kv(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (NB, BPB), dtype=torch.uint8, generator=g) for _ in range(2)]


@pytest.fixture
def engine() -> Iterator[tuple[TransferEngine, list[torch.Tensor]]]:
    t = kv()
    eng = TransferEngine([t], blocks_per_chunk=1, num_slots=4)
    yield eng, t
    eng.shutdown()


def observable(eng: TransferEngine) -> tuple[dict[str, int], list[bytes]]:
    return eng.stats, [bytes(eng.cpu_region(0, i).numpy()) for i in range(eng.num_tensors(0))]


# --------------------------------------------------------------------------- 1. memory safety


def test_the_raw_address_copy_is_not_exported() -> None:
    assert not hasattr(_core, "copy_rows")
    assert "copy_rows" not in dir(_core)


def test_hostile_copier_calls_raise_and_the_interpreter_survives() -> None:
    """Address 0, rows past a buffer, negative and huge rows, read-only and overlapping
    buffers: each gets a specific exception and copies nothing (the raw ``copy_rows`` it
    replaces segfaulted on address 0 and wrote past a buffer on an oversized row)."""
    out = run_python(
        """
        import numpy as np
        from kvoffload._core import Copier
        from kvoffload.errors import ConfigError, InvalidBlockError, KvOffloadError

        gpu = np.arange(4 * 64, dtype=np.uint8)
        cpu = np.zeros(2 * 64 + 16, dtype=np.uint8)  # 16 guard bytes past the 2 rows
        region = (0, 0, 64, 1, 0, 64, 64)
        c = Copier([gpu, cpu], [(4, 2, [region])])

        def expect(exc, call, needle):
            try:
                call()
            except exc as e:
                assert needle in str(e), (needle, str(e))
                print("ok:", type(e).__name__, e)
            else:
                raise AssertionError(f"no {exc.__name__} for {needle}")

        def store(*runs):
            return lambda: c.copy(True, list(runs))

        def load(*runs):
            return lambda: c.copy(False, list(runs))

        def new(buffers, *regions, gpu_rows=4, cpu_rows=2):
            return lambda: Copier(buffers, [(gpu_rows, cpu_rows, list(regions))])

        IB, KE, CE = InvalidBlockError, KvOffloadError, ConfigError
        expect(IB, store((0, None, [0], [2], [1])), "CPU rows 2..2+1")
        expect(IB, store((0, None, [0], [1], [2])), "CPU rows 1..1+2")
        expect(IB, load((0, None, [3], [0], [2])), "GPU rows 3..3+2")
        expect(IB, store((0, None, [-1], [0], [1])), "rows -1..")
        expect(IB, store((0, None, [0], [0], [-5])), "+-5")
        big = 2**63 - 1
        expect(IB, store((0, None, [big], [0], [big])), str(big))
        expect(KE, store((1, None, [0], [0], [1])), "group 1")
        expect(KE, store((0, 1, [0], [0], [1])), "region 1")
        expect(KE, store((0, None, [0, 1], [0], [1])), "2 GPU starts")
        # A good run before a bad one: all or nothing.
        expect(IB, store((0, None, [0], [0], [1]), (0, None, [0], [5], [1])), "run 1")
        assert not cpu.any(), "a rejected call copied bytes"

        # Registrations that would let a copy leave its buffer or overlap its source.
        expect(CE, new([gpu, cpu], region, gpu_rows=5), "do not fit buffer 0")
        expect(CE, new([gpu, cpu], region, cpu_rows=3), "do not fit buffer 1")
        expect(CE, new([gpu, cpu], (0, 0, 64, 2, 0, 64, 64)), "buffer 2 is not registered")
        expect(CE, new([gpu, cpu], (0, 0, 64, 0, 64, 64, 64)), "overlap")
        expect(CE, new([gpu, cpu], (0, 0, 32, 1, 0, 64, 64)), "rows overlap")
        expect(CE, new([gpu, b"x" * 512], region), "writable")
        expect(CE, new([gpu, gpu.reshape(4, 64)], region), "one-dimensional")
        expect(CE, new([gpu, np.zeros(256, dtype=np.int32)], region), "uint8")

        # A good copy lands where it should and nowhere else.
        assert c.copy(True, [(0, None, [3], [1], [1])]) == 64
        assert (cpu[64:128] == gpu[192:256]).all()
        assert not cpu[:64].any()
        assert not cpu[128:].any()
        print("SURVIVED")
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("SURVIVED")
    assert out.stdout.count("ok:") == 18


def test_the_copier_keeps_its_buffers_alive() -> None:
    """Dropping every Python reference to the registered arrays does not free them under the
    copier (a copier holding raw addresses would then copy freed memory)."""
    gpu = np.full(4 * 64, 7, dtype=np.uint8)
    cpu = np.zeros(4 * 64, dtype=np.uint8)
    c = _core.Copier([gpu, cpu], [(4, 4, [(0, 0, 64, 1, 0, 64, 64)])])
    view = cpu[:]  # to read the result; the copier holds its own reference
    del gpu, cpu
    gc.collect()
    junk = [np.full(4 * 64, 1, dtype=np.uint8) for _ in range(100)]  # reuse freed memory, if any
    assert c.copy(True, [(0, None, [0], [0], [4])]) == 256
    assert (view == 7).all()
    del junk


def test_a_private_engine_copy_cannot_leave_the_registration(
    engine: tuple[TransferEngine, list[torch.Tensor]],
) -> None:
    eng, _ = engine
    copier = eng._runtime.copier
    assert copier is not None
    assert copier.layout() == [(NB, 4, 2)]
    before = observable(eng)
    with pytest.raises(InvalidBlockError, match=f"GPU rows {NB}"):
        copier.copy(True, [(0, None, [NB], [0], [1])])
    with pytest.raises(InvalidBlockError, match=r"CPU rows 3\.\.3\+2"):
        copier.copy(True, [(0, None, [0], [3], [2])])
    assert observable(eng) == before


# --------------------------------------------------------------------------- 3. leaks

LEAK_SCRIPT = """
import gc, os, threading, sys
import torch
from kvoffload.transfer import TransferEngine

torch.set_num_threads(1)
MB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

class Owner:
    '''Holds an engine whose hook refers back to the owner: owner -> engine -> hook -> owner.'''

    def __init__(self, collect_on_copy_thread):
        self.collect = collect_on_copy_thread
        nb = 8 * MB // 4096
        self.kv = [torch.ones(nb, 4096, dtype=torch.uint8) for _ in range(2)]
        self.engine = TransferEngine([self.kv], blocks_per_chunk=1, num_slots=nb,
                                     _fault_injector=self.hook)
        self.engine.cycle = self.engine  # and a cycle of its own
        # Touch the whole pool, so a leaked pool shows in RSS.
        self.engine.submit_store(1, [(0, list(range(nb)), list(range(nb)))])
        self.engine.wait([1])
        self.engine.poll()

    def hook(self, job_id):
        if self.collect and job_id == 2:
            # On the copy thread: collect whatever became garbage, the engine included.
            self.gate.wait()
            gc.collect()

def cycle(i):
    o = Owner(collect_on_copy_thread=i % 2 == 1)
    o.gate = threading.Event()
    o.engine.submit_store(2, [(0, [0], [0])])  # the hook of job 2 runs on the copy thread
    o.gate.set()
    del o  # no shutdown(): only the cycle collector can free it

base_threads = threading.active_count()
for i in range(4):  # warm-up
    cycle(i)
    gc.collect()
for t in threading.enumerate():
    if t.name.startswith("kvoffload-"):
        t.join(60)
start = rss()
for i in range(24):
    cycle(i)
    gc.collect()
for t in threading.enumerate():
    if t.name.startswith("kvoffload-"):
        t.join(60)
gc.collect()
alive = [t.name for t in threading.enumerate() if t.name.startswith("kvoffload-")]
print("GROWTH_MB", (rss() - start) / MB)
print("THREADS", len(alive), threading.active_count() - base_threads)
"""


def test_engines_dropped_in_cycles_free_their_threads_and_memory() -> None:
    """24 engines of 24 MiB each (KV tensors and pool) are dropped inside reference cycles
    without shutdown(), half of them collected on their own copy thread. Before, each one kept
    its load thread, tensors and pool for good ("cannot join current thread"); a leak would
    grow RSS by ~576 MiB here."""
    out = run_python(LEAK_SCRIPT)
    assert out.returncode == 0, out.stderr
    assert "cannot join" not in out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["THREADS"] == "0 0", out.stdout
    assert float(lines["GROWTH_MB"]) < 150, out.stdout


def test_copy_threads_do_not_keep_the_engine_alive() -> None:
    import weakref

    class Owner:
        def __init__(self) -> None:
            self.engine = TransferEngine(
                [kv()], blocks_per_chunk=1, num_slots=2, _before_copy=self.hook
            )

        def hook(self, job_id: int, copy_index: int) -> None:
            pass

    o = Owner()
    o.engine.submit_store(1, [(0, [0], [0])])
    o.engine.wait([1])
    ref = weakref.ref(o.engine)
    threads = [t for t in threading.enumerate() if t.name.startswith("kvoffload-")]
    del o
    gc.collect()
    assert ref() is None, "a copy thread kept the engine alive through its hook"
    for t in threads:
        t.join(60)
        assert not t.is_alive()


# --------------------------------------------------------------------------- 6. threads


def test_poll_wait_and_fence_from_many_threads_lose_no_result() -> None:
    """Before, a second thread's poll() raised "dictionary changed size during iteration"."""
    eng = TransferEngine([kv()], blocks_per_chunk=1, num_slots=NB)
    n_jobs = 600
    got: list[list[int]] = [[] for _ in range(4)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def poller(i: int) -> None:
        try:
            while not stop.is_set():
                got[i].extend(r.job_id for r in eng.poll())
                if i % 2:
                    gc.collect(0)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=poller, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        for j in range(n_jobs):
            b = j % NB
            if j % 3 == 0:
                eng.queue_store(j, [(0, [b], [b])])
                eng.fence([j])
            elif j % 3 == 1:
                eng.submit_load(j, [(0, [b], [b])])
            else:
                eng.submit_store(j, [(0, [b], [b])])
            if j % 7 == 0:
                eng.wait([j])
            got[3].extend(r.job_id for r in eng.poll())
    finally:
        stop.set()
        for t in threads:
            t.join()
    got[3].extend(r.job_id for r in eng.shutdown())
    assert errors == []
    ids = [j for g in got for j in g]
    assert sorted(ids) == list(range(n_jobs)), "a result was lost or returned twice"


def test_a_finalizer_that_calls_back_in_does_not_deadlock() -> None:
    """Garbage collections on the copy thread and on a second thread run finalizers that poll
    the engine while it is busy; the subprocess must finish (a deadlock would hang it)."""
    out = run_python(
        """
        import gc, threading, weakref
        import torch
        from kvoffload.transfer import TransferEngine

        kv = [torch.zeros(8, 64, dtype=torch.uint8)]
        seen = []

        def collect(job_id, copy_index):
            gc.collect()  # on the copy thread

        eng = TransferEngine([kv], blocks_per_chunk=1, num_slots=8, _before_copy=collect)

        class Trash:
            def __init__(self):
                self.me = self
                weakref.finalize(self, lambda: seen.extend(r.job_id for r in eng.poll()))

        def other():
            for _ in range(100):
                Trash()
                gc.collect()
                seen.extend(r.job_id for r in eng.poll())

        t = threading.Thread(target=other)
        t.start()
        for j in range(100):
            Trash()
            eng.submit_store(j, [(0, [j % 8], [j % 8])])
            if j % 5 == 0:
                eng.wait([j])
        t.join()
        seen.extend(r.job_id for r in eng.shutdown())
        assert sorted(seen) == list(range(100)), len(seen)
        print("DONE")
        """,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "DONE"


# --------------------------------------------------------------------------- 7. the step


def test_step_runs_a_plan_in_the_one_correct_order() -> None:
    t = kv(1)
    calls: list[int] = []
    with TransferEngine([t], blocks_per_chunk=1, num_slots=NB, _fault_injector=calls.append) as eng:
        old = [x[2].clone() for x in t]
        # Step 1: store 1 (queued), store 2 flushed in its own plan (a released request's
        # store), a load into block 2 submitted only after the flush completed.
        eng.step(stores=[(1, [(0, [1], [1])]), (2, [(0, [2], [2])])], flush=[2])
        assert calls == [2]  # the flushed store ran; store 1 waits for the next step
        assert eng.stats()["queued"] == 1
        for i in range(len(t)):
            assert torch.equal(eng.cpu_region(0, i)[2], old[i])
        eng.step(loads=[(3, [(0, [2], [5])])])  # the next step submits store 1 first
        assert eng.stats()["queued"] == 0
        eng.wait([1, 2, 3])
        assert sorted(calls) == [1, 2, 3]
        results = {r.job_id: r for r in eng.poll()}
        assert set(results) == {1, 2, 3}
        assert all(r.ok for r in results.values())


def test_step_waits_for_the_flush_before_loads_overwrite_the_blocks() -> None:
    """Store 1 reads block 0 slowly; a load of the same step writes block 0. The load must
    start only after the flushed store finished, so the store keeps the old bytes."""
    t = kv(2)
    old = [x[0].clone() for x in t]
    with TransferEngine([t], blocks_per_chunk=1, num_slots=NB, _copy_delay_s=0.01) as eng:
        eng.cpu_region(0, 0)[5].fill_(0xAB)
        eng.cpu_region(0, 1)[5].fill_(0xCD)
        eng.step(stores=[(1, [(0, [0], [0])])])
        eng.step(flush=[1], loads=[(2, [(0, [0], [5])])])
        assert 1 in {r.job_id for r in eng.poll()}, "step returned before the flush completed"
        eng.wait([2])
        for i in range(2):
            assert torch.equal(eng.cpu_region(0, i)[0], old[i])
        assert bool((t[0][0] == 0xAB).all())
        assert bool((t[1][0] == 0xCD).all())


def test_step_completes_a_flushed_load_of_its_own_plan_before_returning() -> None:
    """A load whose request was released in the step that created it is in that step's flush
    set (its blocks may be written by a new owner): the step submits it and waits for it."""
    t = kv(2)
    with TransferEngine([t], blocks_per_chunk=1, num_slots=NB, _copy_delay_s=0.01) as eng:
        eng.cpu_region(0, 0)[5].fill_(0xAB)
        eng.cpu_region(0, 1)[5].fill_(0xCD)
        eng.step(flush=[7], loads=[(7, [(0, [3], [5])])])
        assert 7 in {r.job_id for r in eng.poll()}, "step returned before the flushed load"
        assert bool((t[0][3] == 0xAB).all())
        assert bool((t[1][3] == 0xCD).all())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"flush": [99]}, UnknownJobError, "step flush: job 99 was never queued"),
        ({"flush": [None]}, UnknownJobError, "job id must be an integer, got None"),
        ({"flush": [True]}, UnknownJobError, "job id must be an integer, got True"),
        ({"flush": 7}, UnknownJobError, "iterable of integers, got 7"),
        (
            {"stores": [(5, [(0, [1], [1])])], "loads": [(5, [(0, [2], [2])])]},
            TransferError,
            "job 5 is given twice",
        ),
        ({"stores": [(1, [(0, [1], [1])])]}, TransferError, "job 1 is already queued"),
        ({"stores": [(6, [(0, [NB], [1])])]}, InvalidBlockError, f"= {NB} is out of range"),
        ({"stores": [6]}, TransferError, r"stores\[0\] is not a \(job_id, transfers\) pair"),
        ({"loads": "ab"}, TransferError, "iterable of \\(job_id, transfers\\) pairs"),
        ({"stores": [(2**70, [(0, [1], [1])])], "flush": [2**71]}, UnknownJobError, str(2**71)),
    ],
)
def test_step_rejects_bad_plans_and_changes_nothing(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    t = kv(3)
    calls: list[int] = []
    with TransferEngine([t], blocks_per_chunk=1, num_slots=NB, _fault_injector=calls.append) as eng:
        eng.queue_store(1, [(0, [0], [0])])
        before = observable(eng)
        snap = [x.clone() for x in t]
        with pytest.raises(error, match=match):
            eng.step(**kwargs)
        assert observable(eng) == before
        assert calls == []  # nothing was submitted, not even the queued store
        assert all(torch.equal(a, b) for a, b in zip(t, snap, strict=True))
        eng.step()  # the engine still works
        eng.wait([1])
        assert [r.job_id for r in eng.poll()] == [1]


def test_wait_and_fence_reject_unknown_ids_but_accept_finished_ones(
    engine: tuple[TransferEngine, list[torch.Tensor]],
) -> None:
    eng, _ = engine
    eng.submit_store(10, [(0, [0], [0])])
    eng.wait([10])
    assert [r.job_id for r in eng.poll()] == [10]
    eng.wait([10])  # finished and polled: still known
    eng.fence([10])
    for bad in ([11], [9], [None], ["10"], [10.0], [2**80]):
        with pytest.raises(UnknownJobError) as e:
            eng.wait(bad)
        assert repr(bad[0]) in str(e.value) or str(bad[0]) in str(e.value)
        with pytest.raises(UnknownJobError):
            eng.fence(bad)


def test_known_ids_are_remembered_in_bounded_memory() -> None:
    from kvoffload.transfer.ids import _IdRanges

    r = _IdRanges(limit=8)
    for x in range(0, 1000, 2):  # 500 gaps
        r.add(x)
    assert len(r) <= 8
    assert 998 in r  # recent ids stay exact
    assert 996 in r
    assert 997 not in r
    assert 1000 not in r
    assert -1 not in r
    seq = _IdRanges()
    for x in [5, 3, 4, 7, 6, 1, 2, 0]:
        seq.add(x)
    assert len(seq) == 1
    assert all(x in seq for x in range(8))
    assert 8 not in seq


# --------------------------------------------------------------------------- 8. one copy path


class CountingCopier:
    """Wraps the engine's core copier and counts calls into it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def copy_packed(self, *args: Any) -> int:
        self.calls += 1
        return int(self.inner.copy_packed(*args))


@pytest.mark.parametrize(
    "hooks",
    [{}, {"_copy_delay_s": 1e-4}, {"_before_copy": lambda j, i: None}],
    ids=["no hook", "delay", "before_copy"],
)
def test_copies_go_through_the_core_copier_with_or_without_hooks(hooks: dict[str, Any]) -> None:
    """With a per-copy hook the CPU copies once went through numpy instead of the core."""
    t = kv(4)
    with TransferEngine([t], blocks_per_chunk=1, num_slots=NB, **hooks) as eng:
        counting = CountingCopier(eng._runtime.copier)
        eng._runtime.copier = counting  # type: ignore[assignment]
        eng.submit_store(1, [(0, [0, 1, 5], [3, 4, 0])])  # runs [0,1]->[3,4] and [5]->[0]
        eng.wait([1])
        [res] = eng.poll()
        assert res.ok
        assert res.copies == 4  # 2 runs x 2 tensors
        assert counting.calls == (1 if not hooks else 4)
        for i, x in enumerate(t):
            region = eng.cpu_region(0, i)
            assert torch.equal(region[3:5], x[0:2])
            assert torch.equal(region[0], x[5])


# --------------------------------------------------------------------------- 9. bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_slots": 2**50}, "num_slots=1125899906842624"),
        ({"num_slots": 2**62}, "num_slots=4611686018427387904"),
        ({"num_slots": True}, "num_slots must be an integer, got True"),
        ({"num_slots": 0}, "num_slots must be >= 1, got 0"),
        ({"num_slots": 2.0}, "num_slots must be an integer, got 2.0"),
        ({"num_slots": "4"}, "num_slots must be an integer, got '4'"),
        ({"num_slots": None, "cpu_bytes": 2**60}, "cpu_bytes=1152921504606846976"),
        ({"num_slots": None, "cpu_bytes": -1}, "cpu_bytes must be >= 1, got -1"),
        ({"blocks_per_chunk": True}, "blocks_per_chunk must be an integer, got True"),
        ({"blocks_per_chunk": None}, "blocks_per_chunk must be an integer, got None"),
        ({"cpu_copy_threads": 0}, "cpu_copy_threads must be >= 1, got 0"),
        ({"cpu_copy_threads": 1.5}, "cpu_copy_threads must be an integer"),
        ({"layout": 5}, "layout must be a string or a sequence"),
        ({"layout": ["blocks_first", "x"]}, "2 layouts given for 1 KV groups"),
        ({"pin_memory": "no"}, "pin_memory must be None, True or False, got 'no'"),
        ({"_copy_delay_s": math.inf}, "_copy_delay_s must be in \\[0, 3600\\] seconds, got inf"),
        ({"_copy_delay_s": math.nan}, "_copy_delay_s must be in .* got nan"),
        ({"_copy_delay_s": -1.0}, "_copy_delay_s must be in"),
        ({"_copy_delay_s": "1"}, "_copy_delay_s must be a number of seconds, got '1'"),
        ({"_before_copy": 5}, "_before_copy must be callable or None, got 5"),
    ],
)
def test_bad_engine_arguments_raise_config_errors_naming_field_and_value(
    kwargs: dict[str, Any], match: str
) -> None:
    args: dict[str, Any] = {"blocks_per_chunk": 1, "num_slots": 4, **kwargs}
    with pytest.raises(ConfigError, match=match):
        TransferEngine([kv()], **args)


def test_bad_wait_timeouts_raise_transfer_errors(
    engine: tuple[TransferEngine, list[torch.Tensor]],
) -> None:
    eng, _ = engine
    eng.submit_store(1, [(0, [0], [0])])
    for bad in (-1, math.nan, "1", True):
        with pytest.raises(TransferError, match="timeout must be"):
            eng.wait([1], timeout=bad)  # type: ignore[arg-type]
    eng.wait([1], timeout=math.inf)  # as long as it takes
    eng.wait([1], timeout=1e300)
    assert [r.job_id for r in eng.poll()] == [1]


ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(min_value=-3, max_value=12), max_size=4),
    st.tuples(
        st.integers(-1, 2),
        st.lists(st.integers(-1, 9), max_size=3),
        st.lists(st.integers(-1, 9), max_size=3),
    ),
)
CALLS = st.sampled_from(
    [
        "submit_store",
        "submit_load",
        "queue_store",
        "wait",
        "fence",
        "step_stores",
        "step_flush",
        "step_loads",
        "cpu_region",
        "num_blocks",
        "bytes_per_slot",
    ]
)


@settings(max_examples=300, deadline=None)
@given(call=CALLS, a=ANY, b=st.one_of(ANY, st.lists(ANY, max_size=3)))
def test_arbitrary_arguments_raise_only_kvoffload_errors_and_change_nothing(
    call: str, a: object, b: object
) -> None:
    t = kv()
    with TransferEngine([t], blocks_per_chunk=1, num_slots=4) as eng:
        eng.queue_store(1, [(0, [0], [0])])  # a known id, queued
        before = observable(eng)
        snap = [x.clone() for x in t]
        try:
            if call == "step_stores":
                eng.step(stores=[(a, b)])  # type: ignore[list-item]
            elif call == "step_flush":
                eng.step(flush=b)  # type: ignore[arg-type]
            elif call == "step_loads":
                eng.step(loads=[(a, b)])  # type: ignore[list-item]
            elif call in ("wait", "fence"):
                getattr(eng, call)(b)
            elif call == "cpu_region":
                eng.cpu_region(a, b)  # type: ignore[arg-type]
            elif call in ("num_blocks", "bytes_per_slot"):
                getattr(eng, call)(a)
            else:
                getattr(eng, call)(a, b)
        except KvOffloadError:
            assert observable(eng) == before, "a rejected call changed the engine"
            assert all(torch.equal(x, y) for x, y in zip(t, snap, strict=True))
            return
        eng.step()  # accepted: every job must run to completion cleanly
        results = eng.shutdown()
        assert all(r.ok for r in results), [r.error for r in results]
        assert 1 in {r.job_id for r in results}
