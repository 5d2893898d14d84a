"""The shared tier's test infrastructure works as the fault tests assume."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.support.remote import (
    DelayProxy,
    NetnsHosts,
    ProxyProcess,
    RedisServer,
    redis_server,
    resp,
)


def ask(port: int, *args: str, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(resp(*args))
        return s.recv(1 << 16)


def test_server_is_volatile_bounded_and_restartable(redis: RedisServer) -> None:
    assert ask(redis.port, "CONFIG", "GET", "maxmemory-policy").endswith(b"allkeys-lru\r\n")
    assert b"\r\n\r\n" in ask(redis.port, "CONFIG", "GET", "save")  # empty: no snapshots
    assert ask(redis.port, "CONFIG", "GET", "appendonly").endswith(b"no\r\n")
    assert ask(redis.port, "SET", "k", "v") == b"+OK\r\n"
    assert redis.dbsize() == 1
    redis.flushall()
    assert redis.dbsize() == 0
    ask(redis.port, "SET", "k", "v")
    port = redis.port
    redis.kill()
    with pytest.raises(ConnectionRefusedError):
        ask(port, "PING", timeout=1)
    redis.start()
    assert redis.port == port
    assert redis.dbsize() == 0, "a restarted server is empty (no persistence)"


def test_maxmemory_evicts_instead_of_refusing() -> None:
    with redis_server(maxmemory=4 << 20) as server:
        import redis as redis_py

        c = redis_py.Redis(port=server.port)
        for i in range(64):
            assert c.set(f"k{i}", b"x" * (256 << 10))
        assert 0 < server.dbsize() < 64
        c.close()


@pytest.mark.parametrize("kind", [DelayProxy, ProxyProcess])
def test_delay_proxy_holds_replies(
    redis: RedisServer, kind: type[DelayProxy | ProxyProcess]
) -> None:
    proxy = kind(redis.port)
    try:
        assert ask(proxy.port, "PING") == b"+PONG\r\n"
        proxy.delay = 0.5
        with pytest.raises(TimeoutError):
            ask(proxy.port, "PING", timeout=0.2)
        proxy.delay = 0.0
        assert ask(proxy.port, "PING") == b"+PONG\r\n"
    finally:
        proxy.close()
    with pytest.raises(ConnectionRefusedError):
        ask(proxy.port, "PING", timeout=1)
    if isinstance(proxy, ProxyProcess):
        assert proxy.proc.returncode == 0


def test_netns_hosts_reach_a_server_on_their_gateway_and_are_removed() -> None:
    hosts = NetnsHosts(2)
    names = list(hosts.names)
    try:
        with redis_server(bind=[hosts.gateway(0), hosts.gateway(1)]) as server:
            for i in range(2):
                out = subprocess.run(
                    [
                        *hosts.exec_prefix(i),
                        "redis-cli",
                        "-h",
                        hosts.gateway(i),
                        "-p",
                        str(server.port),
                        "SET",
                        f"from{i}",
                        "x",
                    ],
                    capture_output=True,
                    timeout=10,
                    check=True,
                )
                assert out.stdout.strip() == b"OK"
            assert server.dbsize() == 2
            # 127.0.0.1 inside a host is its own loopback, not ours.
            out = subprocess.run(
                [*hosts.exec_prefix(0), "redis-cli", "-p", str(server.port), "PING"],
                capture_output=True,
                timeout=10,
            )
            assert b"PONG" not in out.stdout
    finally:
        hosts.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, check=True).stdout
    for n in names:
        assert n.encode() not in listed
