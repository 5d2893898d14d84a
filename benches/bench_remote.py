"""Shared tier (Redis, loopback): our Rust client against redis-py on the same work, one run.

Run::

    .venv/bin/python benches/bench_remote.py [--only throughput|pace|faults]  # tables + JSON
    .venv/bin/python benches/bench_remote.py --cluster  # a Redis Cluster against one server
    .venv/bin/python benches/bench_remote.py --only throughput --io-threads 1 --io-threads 2 \
        --connections 2 --connections 4    # one throughput run per server/client setting
    .venv/bin/python -m pytest benches/bench_remote.py -q -s   # same, as a test with the goals

A fresh ``redis-server`` (Debian's package) is started on 127.0.0.1 with a free port. Each
round writes ``CHUNKS`` chunks of ``CHUNK`` bytes from one numpy buffer and reads them back
into another, with each client, interleaved round by round (best round of each counts).
Rounds overwrite the same keys, as a full cache does in its steady state (the server reuses
the memory it frees instead of faulting in new pages):

- ``kvoffload``: :class:`kvoffload._core.RemoteClient`: header + CRC-32C per chunk, pipelined
  sub-batches on pooled connections, GIL released, read verified and copied into the buffer.
- ``raw`` (writes only): :class:`benches.remote_ceiling.RawWriter`, the upper bound: the same
  ``SET``s pre-framed, sent from the same memory, no checksum, on as many connections.
- ``redis-py``: the same keys and values (a 72-byte header + the chunk), a CRC-32 (zlib, in C)
  per chunk on both sides; writes in pipelines of ``PY_PIPELINE`` SETs of ``header + memoryview``
  (one copy: its fastest way here; one pipeline of ``header + tobytes()`` for all 64 chunks, the
  earlier baseline, ran at 0.66x of it), reads in one pipeline, the reply copied into the
  buffer.

Every write phase also records this process's CPU time and the server's, per thread
(:func:`benches.remote_ceiling.measure`), printed as CPU seconds per GB written, and from them
the GB/s this machine's cores allow each writer (``bound``): client and server share the
cores, the server's main thread and redis-py's one thread use at most one each. Those costs
vary far less with the machine's load than the GB/s do. What they showed on the 2-core
development machine (loaded by other builds): the server takes 0.26-0.47 CPU
s/GB from any of our writers (half of it the kernel's copy out of the socket), the raw writer
needs 0.29-0.37 of client CPU, our client 0.38-0.44 (the difference is CRC-32C), redis-py
0.80-1.0 on one thread. So redis-py is bound near 1.1-1.2 GB/s by its own thread and any
writer near 2.1-2.6 GB/s by the server's main thread (and the two cores): raw / redis-py, the
best write ratio any client can reach here, was 1.6-2.6 measured and 1.8-2.4 at the CPU
bounds. 3x needs the server's socket copy off its main thread (io-threads) and cores to run
it on. Tried, not
kept: the server's ``io-threads 2`` (with reads) spins its I/O thread and took more server CPU
per GB on 2 cores (0.39 and 1.48 against 0.26-0.28 s/GB, throughput not better); ``SO_SNDBUF``
of 4 or 8 MiB on the raw writer's sockets (medians 0.82, 0.81 against 0.80 GB/s: noise); 4
connections instead of 2 (server 0.26 against 0.28 s/GB, GB/s within noise).

Then a 512-chunk prefix lookup with our client: the round trips it took (budget: one).
Goals (DESIGN.md §7): ≥ 1 GB/s each direction and ≥ 3x redis-py in the same run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.remote_ceiling import Cost, RawWriter, measure, thread_cpu
from tests.support.remote import RedisCluster, redis_server

from kvoffload._core import RemoteClient

MIB = 1 << 20
CHUNK = 2 * MIB
CHUNKS = 64  # 128 MiB per round and direction
ROUNDS = 5
CONNECTIONS = None  # the client's default: one per core, at most 4
HEADER = 72
PY_PIPELINE = 4  # redis-py's fastest write here: 1 0.36, 4 0.38, 8 0.30, 64 0.25 GB/s (medians)
NAMESPACE = 0x5EED
GOAL_GBPS = 1.0
GOAL_RATIO = 3.0
RAW_HEADER = bytes(range(HEADER))  # the raw writer's header: any 72 bytes, no checksum


def ours_read(client: RemoteClient, dst: np.ndarray, keys: list[int]) -> float:
    t0 = time.perf_counter()
    assert client.read(NAMESPACE, keys, dst) == ["hit"] * len(keys)
    return time.perf_counter() - t0


def _names(keys: list[int]) -> list[str]:
    return [f"kvo:{NAMESPACE + 1:032x}:{k:032x}" for k in keys]


def redis_py_write(conn: object, src: np.ndarray, keys: list[int]) -> None:
    names = _names(keys)
    for start in range(0, len(names), PY_PIPELINE):
        pipe = conn.pipeline(transaction=False)  # type: ignore[attr-defined]
        for i in range(start, min(len(names), start + PY_PIPELINE)):
            chunk = src.data[i * CHUNK : (i + 1) * CHUNK]
            header = zlib.crc32(chunk).to_bytes(4, "little") * (HEADER // 4)
            pipe.set(names[i], header + chunk)  # one copy: the value must start with the header
        assert all(pipe.execute())


def redis_py_read(conn: object, dst: np.ndarray, keys: list[int]) -> float:
    t0 = time.perf_counter()
    pipe = conn.pipeline(transaction=False)  # type: ignore[attr-defined]
    for name in _names(keys):
        pipe.get(name)
    for i, value in enumerate(pipe.execute()):
        body = memoryview(value)[HEADER:]
        assert zlib.crc32(body) == int.from_bytes(value[:4], "little")
        dst[i * CHUNK : (i + 1) * CHUNK] = np.frombuffer(body, dtype=np.uint8)
    return time.perf_counter() - t0


WRITERS = ("ours", "raw", "redispy")


def run(
    chunks: int = CHUNKS,
    rounds: int = ROUNDS,
    options: tuple[str, ...] = (),
    connections: int | None = CONNECTIONS,
) -> dict[str, float]:
    """Runs the benchmark and returns its numbers (GB/s, ratios, CPU per GB, the server's
    utilisation while writing, lookup round trips); ``options`` go to the server."""
    import redis as redis_py_module

    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, size=chunks * CHUNK, dtype=np.uint8)
    dst = np.zeros_like(src)
    keys = list(range(1, chunks + 1))
    best = {"ours_r": 1e9, "py_r": 1e9}
    cores = len(os.sched_getaffinity(0))
    costs: dict[str, list[Cost]] = {w: [] for w in WRITERS}
    with redis_server(maxmemory=5 * chunks * CHUNK + (256 << 20), options=options) as server:
        assert server.proc is not None
        pid = server.proc.pid
        # The client's default: one connection per core, at most 4; the raw writer's too.
        conns = connections or min(4, cores)
        client = RemoteClient(server.url, deadline_ms=10_000, connections=conns)
        conn = redis_py_module.Redis(host="127.0.0.1", port=server.port)
        raw = RawWriter(server.port, conns)
        leads = raw.frame([f"kvo:{NAMESPACE + 2:032x}:{k:032x}" for k in keys], HEADER + CHUNK)
        for _ in range(rounds):
            dst[:] = 0
            cost = measure(pid, lambda: client.write(NAMESPACE, keys, src))
            costs["ours"].append(cost)
            rd = ours_read(client, dst, keys)
            assert np.array_equal(src, dst), "our client read other bytes"
            best["ours_r"] = min(best["ours_r"], rd)
            costs["raw"].append(measure(pid, lambda: raw.write(leads, RAW_HEADER, src, CHUNK)))
            dst[:] = 0
            costs["redispy"].append(measure(pid, lambda: redis_py_write(conn, src, keys)))
            rd = redis_py_read(conn, dst, keys)
            assert np.array_equal(src, dst), "redis-py read other bytes"
            best["py_r"] = min(best["py_r"], rd)
        assert conn.get(leads[-1].split(b"\r\n")[4]) == RAW_HEADER + src[-CHUNK:].tobytes()
        lookup_keys = list(range(1, 513))
        client.write(NAMESPACE, lookup_keys, np.zeros(512 * 64, dtype=np.uint8))
        before = client.stats()["round_trips"]
        found = client.exists(NAMESPACE, lookup_keys)
        trips = client.stats()["round_trips"] - before
        assert found == [True] * 512
        conn.close()
        raw.close()
    gb = chunks * CHUNK / 1e9
    out: dict[str, float] = {
        "chunk_bytes": CHUNK,
        "chunks": chunks,
        "connections": conns,
        "cores": cores,
        "ours_read_gbps": gb / best["ours_r"],
        "redispy_read_gbps": gb / best["py_r"],
        "lookup_512_round_trips": trips,
    }
    for w, cs in costs.items():
        out[f"{w}_write_gbps"] = gb / min(c.wall for c in cs)
        wall = sum(c.wall for c in cs)
        out[f"{w}_client_cpu_s_per_gb"] = sum(c.client_cpu for c in cs) / (gb * len(cs))
        out[f"{w}_server_cpu_s_per_gb"] = sum(c.server_cpu for c in cs) / (gb * len(cs))
        out[f"{w}_server_top_cpu_s_per_gb"] = sum(c.server_top for c in cs) / (gb * len(cs))
        out[f"{w}_server_busy"] = sum(c.server_top for c in cs) / wall
        # What this machine's CPUs allow: client and server share the cores; the server's
        # busiest thread (the main thread) and redis-py's one thread each use at most one.
        both = out[f"{w}_client_cpu_s_per_gb"] + out[f"{w}_server_cpu_s_per_gb"]
        bound = min(cores / both, 1 / out[f"{w}_server_top_cpu_s_per_gb"])
        if w == "redispy":
            bound = min(bound, 1 / out[f"{w}_client_cpu_s_per_gb"])
        out[f"{w}_cpu_bound_gbps"] = bound
    out["write_ratio"] = out["ours_write_gbps"] / out["redispy_write_gbps"]
    out["read_ratio"] = out["ours_read_gbps"] / out["redispy_read_gbps"]
    out["best_write_ratio"] = out["raw_write_gbps"] / out["redispy_write_gbps"]
    out["cpu_bound_write_ratio"] = out["raw_cpu_bound_gbps"] / out["redispy_cpu_bound_gbps"]
    return out


def pace(blocks: int = 20, block_steps: int = 250, delay_s: float = 0.5) -> dict[str, float]:
    """Scheduler time per engine step (lookups of the step's waiting requests, then a schedule
    that aborts the oldest) on the shared tier behind a proxy in a process of its own, in
    alternating blocks of ``block_steps`` steps: *healthy* (replies pass at once) and *slow*
    (replies held ``delay_s``, past the 100 ms deadline), ``blocks`` of each in one run, so
    both phases see the same machine. Per phase, p50 / p99 in µs of the wall time (what the
    engine waits for) and of this thread's CPU time (the work done; without the time other
    processes held the CPU), and the ratios slow / healthy. Lookups never wait for the server
    (the check runs on a Rust thread; the request is told "ask later"), so the ratios should be
    about 1."""
    from tests.support.remote import ProxyProcess

    from kvoffload.scheduler import KvGroup, OffloadConfig, OffloadScheduler, StepInput

    live = 9  # requests waiting at once: each asks again every step until it is aborted
    times: dict[str, list[tuple[int, int]]] = {"healthy": [], "slow": []}
    with redis_server() as server:
        proxy = ProxyProcess(server.port)
        try:
            cfg = OffloadConfig(
                groups=(KvGroup(block_size=16, bytes_per_block=4096),),
                num_gpu_blocks=4096,
                cpu_chunks=256,
                remote_url=proxy.url,
                remote_deadline_ms=100,
            )
            sched = OffloadScheduler(cfg)
            i = 0
            for _ in range(blocks):
                for phase, delay in (("healthy", 0.0), ("slow", delay_s)):
                    proxy.delay = delay
                    for _ in range(block_steps):
                        sched.add_request(
                            f"r{i}",
                            prompt_len=16 * 32 + 1,
                            block_hashes=[i * 1000 + h for h in range(32)],
                        )
                        old = [f"r{i - live}"] if i >= live else []
                        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                        for j in range(max(0, i - live + 1), i + 1):
                            sched.lookup(f"r{j}", num_computed_tokens=0)
                        sched.schedule(StepInput(written=[], aborted=old))
                        times[phase].append(
                            (time.perf_counter_ns() - t0, time.thread_time_ns() - c0)
                        )
                        i += 1
        finally:
            proxy.close()
    out: dict[str, float] = {"steps_per_phase": float(blocks * block_steps)}
    for phase, rows in times.items():
        a = np.array(rows, dtype=np.float64) / 1e3
        for col, name in ((0, "wall"), (1, "cpu")):
            for q in (50, 99):
                out[f"{phase}_{name}_p{q}_us"] = float(np.percentile(a[:, col], q))
    for name in ("wall", "cpu"):
        for q in (50, 99):
            out[f"{name}_p{q}_ratio"] = out[f"slow_{name}_p{q}_us"] / out[f"healthy_{name}_p{q}_us"]
    return out


def faults(requests: int = 200, phase_steps: int = 200) -> dict[str, dict[str, float]]:
    """The scheduler's time per engine step (µs, p50 / p99) in each phase of
    :class:`tests.support.remote_engine.FaultRun` (a simulated engine whose server is killed,
    restarted, flushed, slowed past the deadline, healed), and in the same phases of the same
    run without faults; runs alternate, best of ``ROUNDS // 2 + 1`` per phase. Goal: p99
    within +5% of the run without faults."""
    from tests.support.remote import ProxyProcess, RedisServer
    from tests.support.remote_engine import FAULTS, FaultRun

    def phases(inject: bool) -> dict[str, list[float]]:
        server = RedisServer()
        proxy = ProxyProcess(server.port)
        try:
            fr = FaultRun(server, proxy, phase_steps=phase_steps, inject=inject)
            r = fr.run(num_requests=requests)
            assert (r.mismatches, r.hit_mismatches, r.leaked_jobs) == (0, 0, 0)
            assert fr.sim is not None
            times = np.array(fr.sim.step_times) * 1e6
            names = np.array(fr.phase_of_step)
            return {p: sorted(times[names == p]) for p in FAULTS}
        finally:
            proxy.close()
            server.close()

    def q(t: list[float], p: float) -> float:
        return float(t[min(len(t) - 1, int(p * len(t)))])

    best: dict[str, dict[str, float]] = {}
    for _ in range(ROUNDS // 2 + 1):
        for inject in (False, True):
            for p, t in phases(inject).items():
                row = best.setdefault(p, {})
                tag = "faults" if inject else "clean"
                for name, v in ((f"{tag}_p50_us", q(t, 0.5)), (f"{tag}_p99_us", q(t, 0.99))):
                    row[name] = min(row.get(name, 1e18), v)
    for row in best.values():
        row["p99_ratio"] = row["faults_p99_us"] / row["clean_p99_us"]
    return best


def report(out: dict[str, float], options: tuple[str, ...] = ()) -> None:
    """Prints the tables and the JSON line."""
    print(
        f"\nshared tier, loopback, {out['chunks']} x {out['chunk_bytes'] >> 20} MiB chunks, "
        f"{out['connections']} connections, server options: {' '.join(options) or 'none'}"
    )
    print(f"{'':8} {'kvoffload GB/s':>15} {'redis-py GB/s':>14} {'ratio':>6}")
    for d in ("write", "read"):
        print(
            f"{d:8} {out[f'ours_{d}_gbps']:15.2f} {out[f'redispy_{d}_gbps']:14.2f} "
            f"{out[f'{d}_ratio']:6.1f}"
        )
    print(
        "writes: CPU seconds per GB written (all rounds): the client, the server (all its "
        "threads, its busiest one);\nbusy = the busiest server thread's CPU / wall; bound = "
        f"GB/s the {out['cores']} cores allow at these costs (see run())"
    )
    print(
        f"{'writer':14} {'GB/s':>6} {'client':>7} {'server':>7} {'busiest':>8} {'busy':>5} "
        f"{'bound':>6}"
    )
    for w, name in (("ours", "kvoffload"), ("raw", "raw (ceiling)"), ("redispy", "redis-py")):
        print(
            f"{name:14} {out[f'{w}_write_gbps']:6.2f} {out[f'{w}_client_cpu_s_per_gb']:7.3f} "
            f"{out[f'{w}_server_cpu_s_per_gb']:7.3f} {out[f'{w}_server_top_cpu_s_per_gb']:8.3f} "
            f"{out[f'{w}_server_busy']:5.2f} {out[f'{w}_cpu_bound_gbps']:6.2f}"
        )
    print(
        f"best write ratio possible: raw / redis-py {out['best_write_ratio']:.1f} measured, "
        f"{out['cpu_bound_write_ratio']:.1f} at the CPU bounds; "
        f"kvoffload = {out['ours_write_gbps'] / out['raw_write_gbps']:.2f} x raw"
    )
    print(f"512-chunk prefix lookup: {out['lookup_512_round_trips']} round trip(s)")
    print(json.dumps(out))


def _cpu(pids: list[int]) -> list[dict[int, float]]:
    return [thread_cpu(p) for p in pids]


def _spent(
    before: list[dict[int, float]], after: list[dict[int, float]]
) -> list[tuple[float, float]]:
    """Per process: (CPU seconds of all threads, of its busiest thread) between two reads."""
    out = []
    for b, a in zip(before, after, strict=True):
        per = [v - b.get(tid, 0.0) for tid, v in a.items()] or [0.0]
        out.append((sum(per), max(per)))
    return out


def cluster_run(
    chunks: int = CHUNKS, rounds: int = ROUNDS, nodes_at: tuple[int, ...] = (1, 3, 6, 12, 24)
) -> dict[str, object]:
    """Our client on a Redis Cluster (three masters, three replicas) against one server of the
    same build and options, alone (the same binary, not in cluster mode), on the same work:
    per target, best write and read GB/s, client CPU s/GB, server CPU s/GB per master (all
    threads, main thread), the replicas' CPU s/GB, and the *parallelism* of the per-master
    batches (the masters' main-thread CPU over the wall time: how many masters were busy at
    once). From the costs, the write GB/s the servers allow at N masters (each master's main
    thread takes 1/N of the bytes) and per client core."""
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, size=chunks * CHUNK, dtype=np.uint8)
    dst = np.zeros_like(src)
    keys = list(range(1, chunks + 1))
    gb = chunks * CHUNK / 1e9
    out: dict[str, object] = {"chunk_bytes": CHUNK, "chunks": chunks, "rounds": rounds}
    cluster = RedisCluster()
    try:
        with redis_server(maxmemory=5 * chunks * CHUNK + (256 << 20)) as single:
            assert single.proc is not None
            targets = {
                "single": (single.url, [single.proc.pid], []),
                "cluster": (
                    cluster.url,
                    [cluster.procs[cluster.ports.index(p)].pid for p in cluster.masters],
                    [
                        pr.pid
                        for port, pr in zip(cluster.ports, cluster.procs, strict=True)
                        if port not in cluster.masters
                    ],
                ),
            }
            for name, (url, masters, replicas) in targets.items():
                client = RemoteClient(url, deadline_ms=10_000)
                w_best, r_best = 1e9, 1e9
                client_cpu = 0.0
                m_all = [0.0] * len(masters)
                m_top = [0.0] * len(masters)
                rep = 0.0
                busy = 0.0
                for _ in range(rounds):
                    b = _cpu(masters + replicas)
                    c0, t0 = time.process_time(), time.perf_counter()
                    assert client.write(NAMESPACE, keys, src) == [True] * chunks
                    wall = time.perf_counter() - t0
                    client_cpu += time.process_time() - c0
                    spent = _spent(b, _cpu(masters + replicas))
                    for i in range(len(masters)):
                        m_all[i] += spent[i][0]
                        m_top[i] += spent[i][1]
                    rep += sum(x for x, _ in spent[len(masters) :])
                    busy += sum(t for _, t in spent[: len(masters)]) / wall
                    w_best = min(w_best, wall)
                    dst[:] = 0
                    r_best = min(r_best, ours_read(client, dst, keys))
                    assert np.array_equal(src, dst), f"{name}: read other bytes"
                tot = gb * rounds
                top = sum(m_top) / tot  # main-thread CPU s per GB of the tier, all masters
                row: dict[str, object] = {
                    "write_gbps": gb / w_best,
                    "read_gbps": gb / r_best,
                    "client_cpu_s_per_gb": client_cpu / tot,
                    "server_cpu_s_per_gb_per_master": [x / tot for x in m_all],
                    "server_main_cpu_s_per_gb_per_master": [x / tot for x in m_top],
                    "replicas_cpu_s_per_gb": rep / tot,
                    "parallelism": busy / rounds,
                    "bytes_share_per_master": [
                        s["bytes_written"] / max(1, client.stats()["bytes_written"])
                        for s in client.node_stats().values()
                    ],
                    "projected_server_gbps_at_n_masters": {n: n / top for n in nodes_at},
                    "projected_gbps_per_client_core": 1 / (client_cpu / tot),
                }
                out[name] = row
    finally:
        cluster.close()
    return out


def cluster_report(out: dict[str, object]) -> None:
    """Prints the cluster table and the JSON line."""
    print(
        f"\nshared tier on a cluster (3 masters + 3 replicas) vs one server, loopback, "
        f"{out['chunks']} x {int(out['chunk_bytes']) >> 20} MiB chunks, best of {out['rounds']}"  # type: ignore[call-overload]
    )
    print(
        f"{'target':8} {'write GB/s':>10} {'read GB/s':>9} {'client s/GB':>11} "
        f"{'master s/GB (main)':>30} {'replicas s/GB':>13} {'parallel':>8}"
    )
    for name in ("single", "cluster"):
        r = out[name]
        assert isinstance(r, dict)
        per = " ".join(
            f"{a:.2f}({m:.2f})"
            for a, m in zip(
                r["server_cpu_s_per_gb_per_master"],
                r["server_main_cpu_s_per_gb_per_master"],
                strict=True,
            )
        )
        print(
            f"{name:8} {r['write_gbps']:10.2f} {r['read_gbps']:9.2f} "
            f"{r['client_cpu_s_per_gb']:11.3f} {per:>30} {r['replicas_cpu_s_per_gb']:13.3f} "
            f"{r['parallelism']:8.2f}"
        )
    c = out["cluster"]
    assert isinstance(c, dict)
    proj = ", ".join(f"{n}: {g:.1f}" for n, g in c["projected_server_gbps_at_n_masters"].items())
    print(
        f"projected write GB/s the masters allow (cluster costs, one core per master): {proj}; "
        f"the client: {c['projected_gbps_per_client_core']:.1f} GB/s per core"
    )
    print(json.dumps(out))


def test_bench_remote() -> None:
    out = run()
    report(out)
    assert out["lookup_512_round_trips"] == 1
    for d in ("write", "read"):
        assert out[f"ours_{d}_gbps"] >= GOAL_GBPS, out
    assert out["read_ratio"] >= GOAL_RATIO, out
    # Writes: 3x where the machine allows any writer that much (the raw writer's ratio);
    # otherwise our client must keep up with the raw writer, the ceiling of the same SETs.
    if out["best_write_ratio"] >= GOAL_RATIO:
        assert out["write_ratio"] >= GOAL_RATIO, out
    else:
        assert out["ours_write_gbps"] >= 0.8 * out["raw_write_gbps"], out


def main(argv: list[str] | None = None) -> None:
    """Runs the measurements ``--only`` names (default: all three)."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--only",
        choices=("throughput", "pace", "faults"),
        action="append",
        help="run only this measurement (repeatable; default: all)",
    )
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="our client on a Redis Cluster (3 masters + 3 replicas) against one server",
    )
    ap.add_argument(
        "--io-threads",
        type=int,
        action="append",
        help="throughput: the server's io-threads (reads too); repeatable: one run each",
    )
    ap.add_argument(
        "--connections",
        type=int,
        action="append",
        help="throughput: connections of our client and the raw writer; repeatable: one run each",
    )
    args = ap.parse_args(argv)
    if args.cluster:
        cluster_report(cluster_run())
        return
    only = set(args.only or ("throughput", "pace", "faults"))
    if "throughput" in only:
        for n in args.io_threads or [1]:
            options = ("--io-threads", str(n), "--io-threads-do-reads", "yes") if n > 1 else ()
            for c in args.connections or [None]:
                report(run(options=options, connections=c), options)
    if "pace" in only:
        p = pace()
        print(
            f"\nscheduler µs per step on the shared tier, healthy and slow blocks alternated, "
            f"{p['steps_per_phase']:.0f} steps each"
        )
        print(f"{'':8} {'wall p50':>9} {'p99':>7} {'cpu p50':>8} {'p99':>7}")
        for phase in ("healthy", "slow"):
            print(
                f"{phase:8} {p[f'{phase}_wall_p50_us']:9.0f} {p[f'{phase}_wall_p99_us']:7.0f} "
                f"{p[f'{phase}_cpu_p50_us']:8.0f} {p[f'{phase}_cpu_p99_us']:7.0f}"
            )
        print(
            f"{'ratio':8} {p['wall_p50_ratio']:9.2f} {p['wall_p99_ratio']:7.2f} "
            f"{p['cpu_p50_ratio']:8.2f} {p['cpu_p99_ratio']:7.2f}"
        )
        print(json.dumps(p))
    if "faults" in only:
        f = faults()
        print(
            "\nscheduler µs per engine step, one engine through server faults vs the same run "
            "without"
        )
        print(
            f"{'phase':10} {'clean p50':>9} {'p99':>7} {'faults p50':>10} {'p99':>7} "
            f"{'p99 ratio':>9}"
        )
        for name, row in f.items():
            print(
                f"{name:10} {row['clean_p50_us']:9.0f} {row['clean_p99_us']:7.0f} "
                f"{row['faults_p50_us']:10.0f} {row['faults_p99_us']:7.0f} "
                f"{row['p99_ratio']:9.2f}"
            )
        print(json.dumps(f))


if __name__ == "__main__":
    main()
