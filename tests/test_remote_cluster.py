"""The shared tier on a real Redis Cluster from Python (three masters, three replicas of
Debian's ``redis-server`` on loopback, one per module): engines share chunks through it with
byte-exact reads, ``simulate --engines N`` reports the share of keys and bytes per master, and
bad cluster URLs are refused with :class:`~kvoffload.errors.ConfigError` naming them."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload._core import RemoteClient
from kvoffload.cli import main
from kvoffload.errors import ConfigError
from tests.support.remote import RedisCluster, redis_cluster
from tests.support.remote_chunks import CHUNK, chunk, namespace

__all__ = ["redis_cluster"]  # the module's fixture


def test_engine_b_reads_engine_a_chunks_byte_exact_from_every_master(
    redis_cluster: RedisCluster,
) -> None:
    ns = namespace("py-cluster")
    a = RemoteClient(redis_cluster.url, deadline_ms=5000)
    b = RemoteClient(redis_cluster.url, deadline_ms=5000)
    keys = list(range(1, 61))
    data = np.concatenate([chunk(k) for k in keys])
    assert a.write(ns, keys, data) == [True] * len(keys)
    assert b.exists(ns, [*keys, 10**9]) == [True] * len(keys) + [False]
    out = np.zeros(len(keys) * CHUNK, dtype=np.uint8)
    assert b.read(ns, keys, out) == ["hit"] * len(keys)
    assert np.array_equal(out, data)
    nodes = a.node_stats()
    assert len(nodes) == 3, nodes
    assert all(s["writes"] > 5 for s in nodes.values()), nodes
    assert sum(redis_cluster.dbsize(p) for p in redis_cluster.masters) >= len(keys)


def test_simulate_engines_share_the_cluster(
    redis_cluster: RedisCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--requests", "40", "--quiet", "--no-baseline"]
    assert main([*argv, "--remote", redis_cluster.url, "--engines", "3"]) == 0
    out = capsys.readouterr().out
    assert "engine A:" in out
    assert "engine B:" in out
    assert "engine C (concurrently):" in out
    rows = [line for line in out.splitlines() if line.startswith("127.0.0.1:")]
    assert sorted(int(r.split()[0].rsplit(":", 1)[1]) for r in rows) == redis_cluster.masters
    shares = [float(r.split()[2].rstrip("%")) for r in rows]
    assert abs(sum(shares) - 100) < 0.5, rows
    assert min(shares) > 15, rows


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("redis+cluster://127.0.0.1", "has no port"),
        ("redis+cluster://u:s3cret@127.0.0.1:1/0", "no database"),
    ],
)
def test_bad_cluster_urls_are_config_errors_naming_them(url: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named) as e:
        RemoteClient(url)
    assert "s3cret" not in str(e.value)


def test_a_wrong_password_is_refused_at_startup_redacted(
    redis_cluster: RedisCluster,
) -> None:
    wrong = redis_cluster.url.replace("://", "://kvo:s3cret@")
    with pytest.raises(ConfigError, match=r"kvo:\*\*\*") as e:
        RemoteClient(wrong)
    assert "s3cret" not in str(e.value)
