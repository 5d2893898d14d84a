"""The disk tier from Python: configuration, write-behind and promotion through the real data
plane (a CPU TransferEngine and a DiskWorker on its pool), a restart on the same directory
serving byte-exact KV, corruption never served, and the inspect / verify report."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvoffload._core import DiskWorker, disk_inspect
from kvoffload.cli import main
from kvoffload.errors import (
    ConfigError,
    KvOffloadError,
    TierInUseError,
    TierIOError,
    TierPathError,
)
from kvoffload.scheduler import OffloadScheduler, StepInput
from kvoffload.sim import SimConfig, simulate
from kvoffload.transfer import TransferEngine
from kvoffload.transfer.disk import open_disk_worker, pool_registration
from tests.support.disk import BLOCK, HASHES, PROMPT, cpu_engine, store_and_finish, tier_config
from tests.support.remote import RedisServer
from tests.support.remote_engine import load


def _drain(sched: OffloadScheduler, plan: object, worker: TransferEngine, disk: DiskWorker) -> None:
    """Runs a plan's tier jobs to completion and reports them."""
    jobs = plan.tier_jobs  # type: ignore[attr-defined]
    if not jobs:
        return
    disk.submit(jobs)
    for job_id, ok in disk.wait([j[0] for j in jobs], timeout=30):
        sched.complete(job_id, ok=ok)


def _fill(path: Path, hashes: list[int] = HASHES) -> torch.Tensor:
    """First engine: request "a" computes 3 blocks, they are stored and written to disk."""
    sched = OffloadScheduler(tier_config(path))
    kv, worker = cpu_engine(1)
    disk = open_disk_worker(worker, path, 1 << 20, [BLOCK], model="toy")
    before = sched.stats()["tiers"][0]["writes"]  # type: ignore[index]
    plan = store_and_finish(sched, worker, hashes)
    assert [(j[1], j[2]) for j in plan.tier_jobs] == [("write", "disk")]
    _drain(sched, plan, worker, disk)
    st = sched.stats()["tiers"][0]  # type: ignore[index]
    assert (st["writes"] - before, st["queue_depth"], st["medium"]) == (3, 0, "disk")
    assert any(e[3] == "disk" and e[0] == "stored" for e in sched.take_events())
    assert disk.stats()[0]["chunks_written"] == 3
    worker.shutdown()
    return kv[0]["layer1"][1:4].clone()


def test_restart_serves_the_same_bytes_from_disk(tmp_path: Path) -> None:
    expected = _fill(tmp_path)
    # A new engine (other GPU contents) on the same directory.
    sched = OffloadScheduler(tier_config(tmp_path))
    kv, worker = cpu_engine(2)
    disk = open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], model="toy")
    assert sched.stats()["tiers"][0]["used"] == 3  # type: ignore[index]
    sched.add_request("b", prompt_len=PROMPT, block_hashes=HASHES)
    assert sched.lookup("b", num_computed_tokens=0) is None  # promotion in flight
    plan = sched.schedule(StepInput(written=[]))
    assert [j[1] for j in plan.tier_jobs] == ["promote"]
    _drain(sched, plan, worker, disk)
    n = sched.lookup("b", num_computed_tokens=0)
    assert n == 3 * BLOCK
    load(sched, worker, "b", [7, 8, 9, 10], n)
    assert torch.equal(kv[0]["layer1"][7:10], expected)
    st = sched.stats()["tiers"][0]  # type: ignore[index]
    assert (st["promote_jobs"], st["promoted_chunks"], st["quarantined"]) == (1, 3, 0)
    worker.shutdown()


def test_reset_names_an_in_flight_promotion_in_tier_flush(tmp_path: Path) -> None:
    """A reset while a promotion is in flight: the facade's next plan names it in ``tier_flush``
    (wait on the tier worker), not in ``flush`` (the data plane does not know tier jobs), and its
    late report changes nothing."""
    _fill(tmp_path)
    sched = OffloadScheduler(tier_config(tmp_path))
    _, worker = cpu_engine(2)
    disk = open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], model="toy")
    sched.add_request("b", prompt_len=PROMPT, block_hashes=HASHES)
    assert sched.lookup("b", num_computed_tokens=0) is None
    plan = sched.schedule(StepInput(written=[]))
    (promote,) = plan.tier_jobs
    disk.submit(plan.tier_jobs)
    reset = sched.reset()
    assert reset.flushed == [promote[0]]
    plan = sched.schedule(StepInput(written=[]))
    assert (plan.flush, plan.tier_flush) == ([], [promote[0]])
    assert sched.schedule(StepInput(written=[])).tier_flush == []
    for job_id, ok in disk.wait([promote[0]], timeout=30):
        assert sched.complete(job_id, ok=ok) is None
    pool = sched.stats()["pools"][0]  # type: ignore[index]
    assert (pool["used"], pool["storing"], pool["pinned"]) == (0, 0, 0)
    assert sched.stats()["tiers"][0]["queue_depth"] == 0  # type: ignore[index]
    worker.shutdown()


def test_a_flipped_bit_is_a_miss_never_served(tmp_path: Path) -> None:
    _fill(tmp_path)
    (ns,) = disk_inspect(tmp_path)
    slab = Path(ns["dir"]) / "slab.kvo"
    slot_bytes = 4096 + -(-ns["chunk_bytes"] // 4096) * 4096
    with open(slab, "r+b") as f:
        for slot in range(3):
            f.seek(slot * slot_bytes + 4096 + 1000 + slot)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
    (v,) = disk_inspect(tmp_path, verify=True)
    assert (v["chunks"], v["verified"], v["corrupt"]) == (3, 0, 3)
    sched = OffloadScheduler(tier_config(tmp_path))
    kv, worker = cpu_engine(2)
    before = kv[0]["layer0"].clone()
    disk = open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], model="toy")
    sched.add_request("b", prompt_len=PROMPT, block_hashes=HASHES)
    assert sched.lookup("b", num_computed_tokens=0) is None
    _drain(sched, sched.schedule(StepInput(written=[])), worker, disk)
    assert sched.lookup("b", num_computed_tokens=0) == 0  # recompute, nothing loaded
    st = sched.stats()["tiers"][0]  # type: ignore[index]
    assert (st["failed_promotions"], st["used"]) == (1, 0)
    assert torch.equal(kv[0]["layer0"], before)
    (after,) = disk_inspect(tmp_path)
    assert after["quarantined"] >= 1
    worker.shutdown()


def test_another_model_sees_nothing(tmp_path: Path) -> None:
    _fill(tmp_path)
    cfg = dataclasses.replace(tier_config(tmp_path), disk_model="other")
    sched = OffloadScheduler(cfg)
    assert sched.stats()["tiers"][0]["used"] == 0  # type: ignore[index]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"disk_path": None, "disk_bytes": 1 << 20}, "disk_bytes=1048576 needs disk_path"),
        ({"disk_bytes": 0}, "disk_bytes must be a positive integer, got 0"),
        ({"disk_bytes": True}, r"disk_bytes must be an integer, got True \(bool\)"),
        ({"disk_bytes": 100}, "disk_bytes=100 holds 0 slots"),
        ({"disk_path": 3}, "disk_path must be a path, got 3"),
        ({"disk_deadline_ms": "soon"}, r"disk_deadline_ms must be a number .*'soon'"),
        ({"disk_deadline_ms": 0}, r"disk_deadline_ms must be a number .*got 0"),
        ({"disk_deadline_ms": float("inf")}, r"disk_deadline_ms must be a number .*inf"),
        ({"disk_deadline_ms": True}, r"disk_deadline_ms must be a number .*True"),
        ({"disk_probation_after": 0}, r"disk_probation_after must be in 1\.\.=4294967295, got 0"),
        ({"disk_probation_after": -1}, r"disk_probation_after must be in 1\.\.=.*got -1"),
        ({"disk_probation_after": 1 << 32}, r"disk_probation_after .*got 4294967296"),
        ({"disk_probation_after": 2.0}, r"disk_probation_after .*got 2\.0 \(float\)"),
        ({"disk_probation_after": True}, r"disk_probation_after .*got True \(bool\)"),
        ({"disk_probation_ms": 0}, r"disk_probation_ms must be a number .*got 0"),
        ({"disk_probation_ms": -5.0}, r"disk_probation_ms must be a number .*got -5"),
        ({"disk_probation_ms": float("nan")}, r"disk_probation_ms must be a number .*NaN"),
        ({"disk_probation_ms": "long"}, r"disk_probation_ms must be a number .*'long'"),
    ],
)
def test_bad_disk_config_names_the_value(tmp_path: Path, kw: dict[str, object], match: str) -> None:
    cfg = dataclasses.replace(tier_config(tmp_path), **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=match):
        OffloadScheduler(cfg)


def _corrupt_last_chunk(path: Path) -> None:
    """Flips a data bit of the slot whose header names the prompt's last chunk."""
    (ns,) = disk_inspect(path)
    slot_bytes = 4096 + -(-ns["chunk_bytes"] // 4096) * 4096
    last = HASHES[-1].to_bytes(16, "little")
    with open(Path(ns["dir"]) / "slab.kvo", "r+b") as f:
        for slot in range(ns["slots"]):
            f.seek(slot * slot_bytes + 32)
            if f.read(16) == last:
                f.seek(slot * slot_bytes + 4096 + 77)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 1]))
                return
    raise AssertionError("no slot holds the last chunk")


@pytest.mark.parametrize(
    ("after", "probation_ms", "probations", "tried_again"),
    [(3, 50.0, 0, True), (1, 50.0, 1, True), (1, 60_000.0, 1, False)],
)
def test_disk_probation_thresholds_are_the_configured_ones(
    tmp_path: Path, after: int, probation_ms: float, probations: int, tried_again: bool
) -> None:
    """One failed promotion puts the tier on probation only when ``disk_probation_after`` is
    1; the probation lasts ``disk_probation_ms``: lookups skip the tier meanwhile, and the
    first lookup after it promotes again (a trial)."""
    import time

    other = [0xB1, 0xB2, 0xB3]
    _fill(tmp_path)
    _fill(tmp_path, other)
    _corrupt_last_chunk(tmp_path)
    cfg = tier_config(tmp_path, disk_probation_after=after, disk_probation_ms=probation_ms)
    sched = OffloadScheduler(cfg)
    _, worker = cpu_engine(2)
    disk = open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], model="toy")
    sched.add_request("b", prompt_len=PROMPT, block_hashes=HASHES)
    assert sched.lookup("b", num_computed_tokens=0) is None
    _drain(sched, sched.schedule(StepInput(written=[])), worker, disk)
    st = sched.stats()["tiers"][0]  # type: ignore[index]
    assert (st["failed_promotions"], st["used"], st["probations"]) == (1, 3, probations)
    # Another prompt's chunks are still on disk: a request promotes them unless the tier is
    # on probation.
    sched.add_request("c", prompt_len=PROMPT, block_hashes=other)
    first = sched.lookup("c", num_computed_tokens=0)
    assert first == (0 if probations else None)
    time.sleep(0.2)
    sched.add_request("d", prompt_len=PROMPT, block_hashes=other)
    again = sched.lookup("d", num_computed_tokens=0)
    assert again == (None if tried_again or not probations else 0)
    st = sched.stats()["tiers"][0]  # type: ignore[index]
    assert (st["skipped_lookups"] > 0) == bool(probations)
    worker.shutdown()


def test_simulate_passes_the_disk_probation_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvoffload simulate --disk-probation-after/--disk-probation-ms`` reach the scheduler's
    configuration, and the core refuses a bad value given to the simulator, naming it."""
    import kvoffload.sim

    seen: list[SimConfig] = []

    def fake(cfg: SimConfig, progress: object = None) -> object:
        seen.append(cfg)
        raise KeyboardInterrupt

    monkeypatch.setattr(kvoffload.sim, "simulate", fake)
    flags = ["--disk-probation-after", "7", "--disk-probation-ms", "250"]
    with pytest.raises(KeyboardInterrupt):
        main(["simulate", "--quiet", "--disk", str(tmp_path), *flags])
    off = seen[0].offload_config()
    assert (off.disk_probation_after, off.disk_probation_ms) == (7, 250.0)
    monkeypatch.undo()
    cfg = SimConfig(
        num_requests=12, disk_path=str(tmp_path), disk_bytes=1 << 24, disk_probation_after=0
    )
    with pytest.raises(ConfigError, match=r"disk_probation_after must be in 1\.\.=\d+, got 0"):
        simulate(cfg)


def test_disk_worker_rejects_bad_jobs_and_arguments(tmp_path: Path) -> None:
    _, worker = cpu_engine(1)
    with pytest.raises(ConfigError, match="block_sizes has 2 entries"):
        open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK, BLOCK])
    with pytest.raises(ConfigError, match="rank=2, world_size=2"):
        open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], rank=2, world_size=2)
    disk = open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK])
    with pytest.raises(KvOffloadError, match='kind "copy"'):
        disk.submit([(1, "copy", "disk", 0, [1], [0], [0], [1])])
    with pytest.raises(KvOffloadError, match="1 keys, 2 slots"):
        disk.submit([(1, "write", "disk", 0, [1], [0, 1], [0], [1])])
    # A slot outside the pool, or a promotion of a chunk that is not there, fails the job.
    disk.submit([(5, "write", "disk", 0, [1], [99], [0], [1])])
    disk.submit([(6, "promote", "disk", 0, [1], [0], [0], [1])])
    assert sorted(disk.wait([5, 6], timeout=30)) == [(5, False), (6, False)]
    with pytest.raises(ConfigError, match="timeout=-1 must be"):
        disk.wait([1], timeout=-1.0)
    worker.shutdown()


def test_simulate_restart_hits_disk_and_stays_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["simulate", "--workload", "sysprompt", "--requests", "40", "--scale", "0.5"]
    args += ["--cpu-chunks", "64", "--disk", str(tmp_path), "--disk-bytes", str(16 << 20)]
    # Completions taken every step: the run does not depend on timing. (With --completion
    # poll, how much a restart saves depends on when promotions land: the order requests told
    # "ask later" are admitted in changes the GPU prefix cache's reuse; see the report.)
    args += ["--completion", "step"]
    json_path = tmp_path / "run.json"
    assert main([*args, "--restart", "--quiet", "--json", str(json_path)]) == 0
    out = capsys.readouterr().out
    assert "before the restart" in out
    assert "promoted from disk first" in out

    f = json.loads(json_path.read_text())["figures"]
    # The second run starts with an empty CPU pool: its hits come from disk, byte-exact.
    assert f["disk_promoted_chunks"] > 0
    assert f["disk_promoted_tokens"] > 0
    assert f["cpu_hit_tokens"] > 0
    assert f["integrity_mismatches"] == 0
    assert f["leaked_jobs"] == 0
    assert f["prefill_tokens"] < f["prefill_tokens_without_offload"]
    assert main(["disk", "verify", str(tmp_path)]) == 0


def test_disk_cli_inspect_verify_and_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fill(tmp_path)
    assert main(["disk", "inspect", str(tmp_path), "--json"]) == 0

    (rep,) = json.loads(capsys.readouterr().out)
    assert (rep["chunks"], rep["quarantined"]) == (3, 0)
    slab = Path(rep["dir"]) / "slab.kvo"
    with open(slab, "r+b") as f:
        f.seek(4096 + 7)
        b = f.read(1)
        f.seek(4096 + 7)
        f.write(bytes([b[0] ^ 1]))
    assert main(["disk", "verify", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "1 corrupt chunks" in captured.err
    assert main(["disk", "inspect", str(tmp_path / "missing")]) == 2
    assert main(["simulate", "--restart", "--quiet"]) == 2
    assert "--restart needs --disk DIR" in capsys.readouterr().err


def test_both_tiers_restart_promotes_from_disk_and_refills_the_shared_tier(
    tmp_path: Path, redis: RedisServer
) -> None:
    """Disk and shared tier at once (DESIGN §9): stored chunks go down to both; after a
    restart on the same directory with the server flushed, promotions come from the disk (the
    nearest tier) and the promoted chunks refill the shared tier; an engine with an empty disk
    then promotes from the shared tier. Every loaded byte checked."""
    cfg = SimConfig(
        workload="sysprompt",
        num_requests=40,
        scale=0.5,
        cpu_chunks=64,
        disk_path=str(tmp_path / "a"),
        disk_bytes=16 << 20,
        remote_url=redis.url,
        # No failed tier job is allowed below: no healthy operation may miss the deadline
        # (the default, 1 s, a loaded machine could).
        remote_deadline_ms=30_000.0,
        tier_write_share=1.0,  # a small pool: write-behind may pin all of it
    )
    runs = [simulate(cfg)]
    written = runs[0].tier_written_chunks
    # Stored chunks go down to both tiers, as far as the write-behind bound lets them (the
    # two tiers share a group's room; a chunk past it is skipped, counted).
    assert written["disk"] > 0
    assert written["remote"] > 0
    redis.flushall()
    runs.append(simulate(cfg))  # the restart: the disk holds everything, the server nothing
    assert runs[1].tier_promoted_chunks["disk"] > 0
    assert runs[1].tier_promoted_chunks.get("remote", 0) == 0
    assert runs[1].tier_written_chunks["remote"] > 0, "promoted chunks refill the server"
    assert redis.dbsize() > 0
    runs.append(simulate(dataclasses.replace(cfg, disk_path=str(tmp_path / "b"))))
    assert runs[2].tier_promoted_chunks["remote"] > 0
    for r in runs:
        assert (r.mismatches, r.hit_mismatches, r.torn_stores, r.leaked_jobs) == (0, 0, 0, 0)
        assert sum(r.tier_failed_jobs.values()) == 0
    assert runs[1].cpu_hit_tokens > 0
    assert runs[2].cpu_hit_tokens > 0


# ------------------------------------------------------------------ one owner, truthful verify

ROOT = Path(__file__).resolve().parents[1]


def _ns_dir(path: Path) -> Path:
    (rep,) = disk_inspect(path)
    return Path(rep["dir"])


def test_a_second_disk_worker_on_one_directory_is_refused(tmp_path: Path) -> None:
    """Another tier object in this process gets TierInUseError naming the directory and the
    holder; the owner keeps working; once it closes, the directory opens again."""
    _fill(tmp_path)
    _, worker = cpu_engine(2)
    first = open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], model="toy")
    with pytest.raises(TierInUseError, match=f"{_ns_dir(tmp_path)}.*this process") as e:
        open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], model="toy")
    assert f"pid {os.getpid()}" in str(e.value)
    first.submit([(1, "write", "disk", 0, [0xC1], [0], [20], [1000])])  # a free place
    assert first.wait([1], timeout=30) == [(1, True)]
    first.close()
    open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], model="toy").close()
    worker.shutdown()


def test_a_second_process_is_refused_and_verify_says_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess
    import sys

    _fill(tmp_path)
    code = "import sys; from tests.support.disk import hold; hold(sys.argv[1])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        _, worker = cpu_engine(2)
        with pytest.raises(TierInUseError, match=f"in use by process {proc.pid}"):
            open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], model="toy")
        worker.shutdown()
        # verify reads nothing of a live directory and fails; inspect reports it in use.
        assert main(["disk", "verify", str(tmp_path)]) == 1
        assert f"in use by process {proc.pid}; not verified" in capsys.readouterr().err
        assert main(["disk", "inspect", str(tmp_path)]) == 0
        assert f"in use by process {proc.pid}" in capsys.readouterr().out
    finally:
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.close()
        proc.stdout.close()
        assert proc.wait(timeout=60) == 0
    assert main(["disk", "verify", str(tmp_path)]) == 0


def test_verify_fails_on_a_flipped_header_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fill(tmp_path)
    (rep,) = disk_inspect(tmp_path)
    slot_bytes = 4096 + -(-rep["chunk_bytes"] // 4096) * 4096
    with open(_ns_dir(tmp_path) / "slab.kvo", "r+b") as f:
        for slot in range(rep["slots"]):
            f.seek(slot * slot_bytes)
            if f.read(8) == b"KVOFFLD\x01":
                f.seek(slot * slot_bytes + 40)  # a bit of the key
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 4]))
                break
    assert main(["disk", "verify", str(tmp_path)]) == 1
    assert "1 slot headers do not decode" in capsys.readouterr().err
    assert main(["disk", "inspect", str(tmp_path), "--json"]) == 0
    (rep,) = json.loads(capsys.readouterr().out)
    assert (rep["chunks"], rep["bad_headers"], len(rep["problems"])) == (2, 1, 1)


@pytest.mark.parametrize("note", [None, b"", b"chunk_bytes=32768 slo"])
def test_verify_fails_on_a_slab_it_cannot_attribute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], note: bytes | None
) -> None:
    """A slab whose layout note is gone or torn: verify fails with a line naming it (not
    "0 namespaces", exit 0; nor an error about the whole directory); inspect says the same and
    succeeds; the next owner rewrites the note and the directory verifies again."""
    _fill(tmp_path)
    note_path = _ns_dir(tmp_path) / "layout.txt"
    if note is None:
        note_path.unlink()
    else:
        note_path.write_bytes(note)
    assert main(["disk", "verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "slab.kvo: 3 chunk headers but" in err
    assert "cannot attribute them" in err
    assert main(["disk", "inspect", str(tmp_path)]) == 0
    assert "cannot attribute them" in capsys.readouterr().err
    _, worker = cpu_engine(2)
    open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], model="toy").close()
    worker.shutdown()
    assert main(["disk", "verify", str(tmp_path)]) == 0


def _other_layout(layout: str) -> dict[str, torch.Tensor]:
    """KV tensors whose chunks have the bytes of ``cpu_engine``'s (2 layers of float32
    ``[32, BLOCK, 4, 64]``) in another layout."""
    g = torch.Generator().manual_seed(3)
    if layout == "one tensor per layer":
        return {"layer0": torch.randn(32, BLOCK, 8, 64, generator=g)}
    return {f"layer{i}": torch.randn(32, BLOCK, 8, 64, generator=g).half() for i in range(2)}


@pytest.mark.parametrize("layout", ["one tensor per layer", "float16"])
def test_another_tensor_layout_reads_nothing(tmp_path: Path, layout: str) -> None:
    """An engine whose chunks have the same size but another split into KV tensors, or another
    element type (same model string, block size, blocks per chunk, rank) never loads the
    writer's bytes."""
    _fill(tmp_path)
    sched = OffloadScheduler(tier_config(tmp_path))
    kv = [_other_layout(layout)]
    worker = TransferEngine(kv, blocks_per_chunk=1, num_slots=8)
    disk = open_disk_worker(worker, tmp_path, 1 << 20, [BLOCK], model="toy")
    before = [t.clone() for t in kv[0].values()]
    sched.add_request("b", prompt_len=PROMPT, block_hashes=HASHES)
    if sched.lookup("b", num_computed_tokens=0) is None:  # promotion planned: it must fail
        _drain(sched, sched.schedule(StepInput(written=[])), worker, disk)
    assert sched.lookup("b", num_computed_tokens=0) == 0
    st = sched.stats()["tiers"][0]  # type: ignore[index]
    assert st["promoted_chunks"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, kv[0].values(), strict=True))
    view, groups = pool_registration(worker, [BLOCK])
    with pytest.raises(ConfigError, match="dtypes has 2 entries, the pool has 1 groups"):
        DiskWorker(tmp_path / "x", 1 << 20, [view], groups, dtypes=["a", "b"])
    worker.shutdown()


def test_another_tensor_layout_reads_nothing_from_the_shared_tier(redis: RedisServer) -> None:
    """The same through Redis: engine A (two KV tensors per layer) writes behind; engine B (one
    tensor per layer, same chunk size, model and salt) is never served A's bytes."""
    from tests.support.remote_engine import ask, compute, config, engine

    sched = OffloadScheduler(config(redis.url))
    _, worker_a, remote_a = engine(redis.url, "", seed=1)
    sched.add_request("a", prompt_len=PROMPT, block_hashes=HASHES)
    assert ask(sched, remote_a, "a") == 0
    assert compute(sched, worker_a, remote_a, "a") == [("write", True)]
    worker_a.shutdown()

    from kvoffload.transfer.remote import open_remote_worker

    sched = OffloadScheduler(config(redis.url))
    kv = [_other_layout("one tensor per layer")]
    worker = TransferEngine(kv, blocks_per_chunk=1, num_slots=8)
    remote = open_remote_worker(worker, redis.url, [BLOCK], model="toy", deadline_ms=30_000.0)
    sched.add_request("b", prompt_len=PROMPT, block_hashes=HASHES)
    # The keys exist (the place is the scheduler's), the bytes do not verify.
    assert ask(sched, remote, "b") == 0
    st = sched.stats()["tiers"][0]  # type: ignore[index]
    assert st["promoted_chunks"] == 0
    assert remote.stats()["checksum_mismatches"] == 3
    worker.shutdown()


def test_simulate_on_a_directory_in_use_exits_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvoffload simulate --disk DIR`` while DIR's namespace directories are held: exit 2
    and one line saying so, no traceback; nothing of the holder's is touched."""
    import fcntl

    args = ["simulate", "--quiet", "--no-baseline", "--requests", "4", "--disk", str(tmp_path)]
    args += ["--disk-bytes", str(1 << 22)]
    assert main(args) == 0
    capsys.readouterr()
    before = {r["dir"]: r["chunks"] for r in disk_inspect(tmp_path)}
    held = [open(Path(d) / "lock", "rb") for d in before]  # noqa: SIM115
    try:
        for f in held:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "kvoffload simulate: error: disk tier" in err
        assert "in use by" in err
        assert "Traceback" not in err
    finally:
        for f in held:
            f.close()
    assert {r["dir"]: r["chunks"] for r in disk_inspect(tmp_path)} == before


@pytest.mark.parametrize("name", ["slab.kvo", "layout.txt", "lock"])
def test_a_symbolic_link_in_the_directory_is_refused(tmp_path: Path, name: str) -> None:
    """A link planted in place of one of the tier's files: TierPathError (a ConfigError) naming
    it; the link's target is untouched."""
    _fill(tmp_path / "t")
    target = tmp_path / "precious"
    target.write_bytes(b"precious")
    path = _ns_dir(tmp_path / "t") / name
    path.unlink()
    path.symlink_to(target)
    _, worker = cpu_engine(2)
    with pytest.raises(TierPathError, match=f"{path}: is a symbolic link"):
        open_disk_worker(worker, tmp_path / "t", 1 << 20, [BLOCK], model="toy")
    assert issubclass(TierPathError, ConfigError)
    assert target.read_bytes() == b"precious"
    worker.shutdown()


_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
from tests.support.disk import BLOCK, cpu_engine
from kvoffload.transfer.disk import open_disk_worker
from kvoffload.errors import TierIOError
kv, worker = cpu_engine(1)
try:
    open_disk_worker(worker, Path(sys.argv[1]), 1 << 20, [BLOCK], model="toy")
except TierIOError as e:
    print(f"TierIOError: {e}")
"""


def test_a_full_disk_is_an_io_error_not_a_config_error(tmp_path: Path) -> None:
    """A file-size limit below the slab (as a full disk would) fails the slab's sizing: the error
    is TierIOError naming the file and the OS error, not ConfigError."""
    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path / "tier")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
        check=True,
    ).stdout
    assert "TierIOError: I/O error: disk tier" in out
    assert "slab.kvo: cannot size: File too large" in out
    assert not issubclass(TierIOError, ConfigError)
