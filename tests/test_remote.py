"""The shared (Redis) tier's client from Python, against a real ``redis-server``: processes and
hosts sharing chunks byte-exact, tenants isolated, and faults (killed, restarted, flushed and
slowed server) costing misses, never wrong bytes, with probation and recovery counted."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvoffload._core import RemoteClient
from kvoffload.errors import ConfigError, InvalidKeyError, KvOffloadError
from tests.support.remote import DelayProxy, NetnsHosts, RedisServer, redis_server
from tests.support.remote_chunks import CHUNK, chunk, namespace

ROOT = Path(__file__).resolve().parents[1]


def run_chunks(*args: str, prefix: list[str] | None = None) -> dict[str, object]:
    """Runs :mod:`tests.support.remote_chunks` in its own process (optionally inside a test
    host)."""
    out = subprocess.run(
        [*(prefix or []), sys.executable, "-m", "tests.support.remote_chunks", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_a_second_process_reads_the_first_ones_chunks_byte_exact(redis: RedisServer) -> None:
    assert run_chunks("write", redis.url, "", "100", "40") == {"written": 40}
    got = run_chunks("read", redis.url, "", "90", "60")
    assert got["wrong"] == 0
    assert got["outcomes"] == ["miss"] * 10 + ["hit"] * 40 + ["miss"] * 10
    assert got["exists"] == [False] * 10 + [True] * 40 + [False] * 10


def test_different_cache_salts_share_nothing(redis: RedisServer) -> None:
    run_chunks("write", redis.url, "tenant-a", "0", "20")
    other = run_chunks("read", redis.url, "tenant-b", "0", "20")
    assert other["outcomes"] == ["miss"] * 20
    assert other["exists"] == [False] * 20
    same = run_chunks("read", redis.url, "tenant-a", "0", "20")
    assert same["outcomes"] == ["hit"] * 20
    assert same["wrong"] == 0


def test_hosts_in_network_namespaces_share_one_server() -> None:
    hosts = NetnsHosts(3)
    try:
        with redis_server(bind=[hosts.gateway(i) for i in range(3)]) as server:
            # Host 0 and host 1 each compute half of a prefix; every host reads all of it.
            run_chunks(
                "write", server.url_at(hosts.gateway(0)), "", "0", "32", prefix=hosts.exec_prefix(0)
            )
            run_chunks(
                "write",
                server.url_at(hosts.gateway(1)),
                "",
                "32",
                "32",
                prefix=hosts.exec_prefix(1),
            )
            for i in range(3):
                got = run_chunks(
                    "read",
                    server.url_at(hosts.gateway(i)),
                    "",
                    "0",
                    "64",
                    prefix=hosts.exec_prefix(i),
                )
                assert got["outcomes"] == ["hit"] * 64, f"host {i}"
                assert got["wrong"] == 0
            assert server.dbsize() == 64
    finally:
        hosts.close()


def keys_and_data(first: int, count: int) -> tuple[list[int], np.ndarray]:
    keys = list(range(first, first + count))
    return keys, np.concatenate([chunk(k) for k in keys])


def read_checked(client: RemoteClient, ns: int, keys: list[int]) -> list[str]:
    """Reads ``keys``; asserts that every hit is byte-exact."""
    out = np.zeros(len(keys) * CHUNK, dtype=np.uint8)
    outcomes = client.read(ns, keys, out)
    for i, (k, o) in enumerate(zip(keys, outcomes, strict=True)):
        if o == "hit":
            assert np.array_equal(out[i * CHUNK : (i + 1) * CHUNK], chunk(k)), f"key {k}"
    return outcomes


def test_stats_name_every_counter_in_their_documented_order() -> None:
    # Connects lazily: no server is needed to read the counters of a fresh client.
    client = RemoteClient("redis://127.0.0.1:1")
    names = [
        "writes",
        "failed_writes",
        "dropped_writes",
        "read_hits",
        "read_misses",
        "failed_reads",
        "checksum_mismatches",
        "lookups",
        "lookup_hits",
        "skipped_lookups",
        "round_trips",
        "errors",
        "deadline_misses",
        "probations",
        "recoveries",
        "bytes_written",
        "bytes_read",
        "redirects",
    ]
    # A list of pairs: a dict comparison would ignore the order.
    assert list(client.stats().items()) == [(name, 0) for name in names]


def test_killed_and_restarted_server_means_misses_probation_then_recovery(
    redis: RedisServer,
) -> None:
    # A deadline no healthy operation of a loaded machine misses (2 s could); the killed server
    # refuses connections at once, so nothing here waits for it.
    client = RemoteClient(redis.url, deadline_ms=30_000, probation_after=2, probation_ms=200)
    ns = namespace("")
    keys, data = keys_and_data(0, 8)
    assert all(client.write(ns, keys, data))
    redis.kill()
    assert read_checked(client, ns, keys) == ["failed"] * 8
    assert client.exists(ns, keys) is None
    assert client.on_probation
    assert client.write(ns, keys, data) == [False] * 8  # dropped, nothing sent
    s = client.stats()
    assert (s["probations"], s["dropped_writes"], s["errors"]) == (1, 8, 2)
    redis.start()
    time.sleep(0.25)
    # The restarted server is empty: misses, not errors; the trial recovers the tier.
    assert read_checked(client, ns, keys) == ["miss"] * 8
    assert not client.on_probation
    assert client.stats()["recoveries"] == 1
    assert all(client.write(ns, keys, data))
    assert read_checked(client, ns, keys) == ["hit"] * 8


def test_flushed_server_means_misses(redis: RedisServer) -> None:
    client = RemoteClient(redis.url)
    ns = namespace("")
    keys, data = keys_and_data(0, 8)
    client.write(ns, keys, data)
    redis.flushall()
    assert read_checked(client, ns, keys) == ["miss"] * 8
    assert client.exists(ns, keys) == [False] * 8
    assert client.stats()["errors"] == 0


def test_slow_server_misses_deadlines_then_recovers(
    redis: RedisServer, delay_proxy: DelayProxy
) -> None:
    # Load-independent timing: healthy operations get a deadline no loaded machine misses, the
    # slow server holds replies far past it (not a delay a stalled client could mistake for
    # healthy), and the probation's end is waited for, not slept for.
    client = RemoteClient(delay_proxy.url, deadline_ms=1000, probation_after=2, probation_ms=1000)
    ns = namespace("")
    keys, data = keys_and_data(0, 4)
    assert all(client.write(ns, keys, data))
    delay_proxy.delay = 60.0
    t0 = time.monotonic()
    assert read_checked(client, ns, keys) == ["failed"] * 4
    assert client.exists(ns, keys) is None
    bounded = time.monotonic() - t0
    assert client.on_probation
    s = client.stats()
    assert (s["deadline_misses"], s["probations"]) == (2, 1)
    # On probation nothing waits for the slow server.
    t0 = time.monotonic()
    assert client.exists(ns, keys) is None
    assert time.monotonic() - t0 < bounded
    assert client.stats()["deadline_misses"] == 2
    delay_proxy.delay = 0.0
    give_up = time.monotonic() + 30
    while client.on_probation and time.monotonic() < give_up:
        time.sleep(0.01)
    assert read_checked(client, ns, keys) == ["hit"] * 4
    s = client.stats()
    assert (s["recoveries"], s["deadline_misses"], s["probations"]) == (1, 2, 1)


def test_bad_arguments_raise_kvoffload_errors_by_name(redis: RedisServer) -> None:
    with pytest.raises(ConfigError, match="remote_url"):
        RemoteClient("http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="remote_deadline_ms"):
        RemoteClient(redis.url, deadline_ms=0)
    with pytest.raises(ConfigError, match="remote_connections"):
        RemoteClient(redis.url, connections=0)
    client = RemoteClient(redis.url)
    with pytest.raises(InvalidKeyError, match=r"keys\[1\]"):
        client.write(1, [1, -2], np.zeros(2 * 16, dtype=np.uint8))
    with pytest.raises(KvOffloadError, match="whole number of chunks"):
        client.write(1, [1, 2, 3], np.zeros(16, dtype=np.uint8))
    with pytest.raises(KvOffloadError, match="writable"):
        client.read(1, [1], np.zeros(16, dtype=np.uint8)[::2])
    assert redis.dbsize() == 0, "nothing was written by a refused call"
