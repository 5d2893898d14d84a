"""Test infrastructure for the shared (Redis) tier: a real server, a delay proxy, test hosts.

- :class:`RedisServer` runs Debian's ``redis-server`` on 127.0.0.1 (and optionally on test-host
  addresses) with a free port, a temporary directory, no persistence and ``maxmemory`` with
  ``allkeys-lru``; it can be killed, restarted on the same port, flushed and inspected.
- :class:`DelayProxy` is a loopback TCP proxy that holds every reply from the server for a
  settable delay, so a client's deadline passes (the "slow server" fault);
  :class:`ProxyProcess` runs one in a process of its own, for measurements of the process
  that uses it (its threads then take neither the GIL nor that process's CPU time).
- :class:`RedisCluster` runs a Redis Cluster of three masters and three replicas on
  127.0.0.1 (free ports, temporary directories), created with ``redis-cli --cluster create``.
- :class:`NetnsHosts` creates simulated hosts: one network namespace each, joined to this
  namespace by a veth pair with addresses it chose itself, and removes them all afterwards.

Everything here talks only to 127.0.0.1 and to the addresses of hosts it created.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

REDIS_SERVER = "redis-server"


def _reap(proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout: float) -> None:
    """Waits ``timeout`` seconds for ``proc`` to exit, then kills it."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resp(*args: bytes | str) -> bytes:
    """One command in the Redis protocol."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode() if isinstance(a, str) else a
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RedisServer:
    """A ``redis-server`` process for one test: started, stopped, restarted, flushed.

    Args:
        maxmemory: the server's memory limit in bytes (``allkeys-lru`` beyond it).
        bind: extra addresses to listen on besides 127.0.0.1 (test hosts' gateways).
        options: more ``--name value`` arguments for the server (benchmarks: ``io-threads``).
    """

    def __init__(
        self, maxmemory: int = 512 << 20, bind: Sequence[str] = (), options: Sequence[str] = ()
    ) -> None:
        if shutil.which(REDIS_SERVER) is None:
            raise RuntimeError(
                "redis-server is not installed: `make test` installs Debian's redis-server "
                "package (apt-get, as root)"
            )
        self.maxmemory = maxmemory
        self.bind = ["127.0.0.1", *bind]
        self.options = list(options)
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT``."""
        return f"redis://127.0.0.1:{self.port}"

    def url_at(self, host: str) -> str:
        """The server's URL as seen from a test host whose gateway is ``host``."""
        return f"redis://{host}:{self.port}"

    def start(self) -> None:
        """Start the server (on the same port after a kill) and wait until it answers."""
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                *self.bind,
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory",
                str(self.maxmemory),
                "--maxmemory-policy",
                "allkeys-lru",
                "--protected-mode",
                "no",
                "--daemonize",
                "no",
                "--logfile",
                str(self.dir / "redis.log"),
                *self.options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10.0
        while True:
            try:
                if self.command("PING") == b"+PONG\r\n":
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")
            time.sleep(0.02)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL): every connection breaks, every key is gone."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        """Stop the server if it runs."""
        if self.proc is not None:
            self.proc.terminate()
            _reap(self.proc, 5)
            self.proc = None

    def restart(self) -> None:
        """Kill and start again on the same port, empty."""
        self.kill()
        self.start()

    def command(self, *args: bytes | str) -> bytes:
        """Send one command on a fresh connection and return the raw reply's first read."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(resp(*args))
            return s.recv(1 << 16)

    def flushall(self) -> None:
        """Delete every key."""
        assert self.command("FLUSHALL") == b"+OK\r\n"

    def dbsize(self) -> int:
        """Number of keys the server holds."""
        reply = self.command("DBSIZE")
        assert reply.startswith(b":"), reply
        return int(reply[1:].strip())

    def keys(self) -> list[bytes]:
        """Every key the server holds (small test servers only)."""
        import redis  # redis-py, a dev dependency; only the tests use it

        c = redis.Redis(host="127.0.0.1", port=self.port)
        try:
            return sorted(c.keys("*"))
        finally:
            c.close()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class DelayProxy:
    """A loopback TCP proxy in front of a server; replies can be held back by ``delay`` seconds.

    Requests go through at once; each chunk of reply bytes is forwarded ``delay`` seconds after
    it arrived (order kept), so a client with a shorter deadline sees a late reply. ``delay`` can
    change while connections are open. :meth:`close` ends every connection.
    """

    def __init__(self, target_port: int, delay: float = 0.0) -> None:
        self.target_port = target_port
        self.delay = delay
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.05)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        t = threading.Thread(target=self._accept, name="delay-proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` of the proxy."""
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, server]
            for src, dst, delayed in ((client, server, False), (server, client, True)):
                t = threading.Thread(
                    target=self._pump, args=(src, dst, delayed), name="delay-proxy", daemon=True
                )
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([src], [], [], 0.05)
                if not ready:
                    continue
                data = src.recv(1 << 20)
                if not data:
                    break
                if delayed and self.delay > 0:
                    # One wake-up per reply (not a polling loop): a measured engine shares the
                    # machine's cores with this proxy.
                    self._stop.wait(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop forwarding, close every socket and join the threads."""
        self._stop.set()
        self._listener.close()
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            for s in self._socks:
                s.close()


class ProxyProcess:
    """A :class:`DelayProxy` in a child process (``python -m tests.support.remote proxy PORT``):
    the same ``port``, ``url``, settable ``delay`` (applied when the setter returns) and
    :meth:`close`."""

    def __init__(self, target_port: int, delay: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.remote", "proxy", str(target_port)],
            cwd=Path(__file__).resolve().parents[2],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self.port = int(self._stdout.readline())
        self._delay = 0.0
        self.delay = delay

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` of the proxy."""
        return f"redis://127.0.0.1:{self.port}"

    @property
    def delay(self) -> float:
        """Seconds each reply is held."""
        return self._delay

    @delay.setter
    def delay(self, seconds: float) -> None:
        self._stdin.write(f"{seconds}\n")
        self._stdin.flush()
        if self._stdout.readline().strip() != "ok":
            raise RuntimeError(f"proxy process refused delay {seconds}")
        self._delay = seconds

    def close(self) -> None:
        """Stops the proxy (every connection ends) and waits for its process."""
        with contextlib.suppress(OSError):
            self._stdin.close()
        _reap(self.proc, 10)
        self._stdout.close()


def _serve_proxy(target_port: int) -> None:
    """The child of :class:`ProxyProcess`: prints its port, then takes one delay per line."""
    proxy = DelayProxy(target_port)
    try:
        print(proxy.port, flush=True)
        for line in sys.stdin:
            proxy.delay = float(line)
            print("ok", flush=True)
    finally:
        proxy.close()


class NetnsHosts:
    """``count`` simulated hosts: network namespaces joined to this one by veth pairs.

    Host ``i`` is namespace ``kvo<pid>h<i>`` with address ``10.<n>.<i>.2/24`` on its veth end;
    this namespace's end has ``10.<n>.<i>.1`` (:meth:`gateway`), where a server can listen.
    ``n`` is picked among the ``10.n.*`` networks no interface uses yet, so test runs on one
    machine at the same time do not route each other's replies (with one fixed network, a
    concurrent run's links took this run's replies and its writes failed). Every name and
    address is created here and removed by :meth:`close`.
    """

    def __init__(self, count: int) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("network-namespace test hosts need root (ip netns)")
        self.prefix = f"kvo{os.getpid() % 100000}h"
        self.net = self._free_net()
        self.names: list[str] = []
        self._links: list[str] = []
        try:
            for i in range(count):
                self._add(i)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_net() -> int:
        """A second octet ``n`` such that no interface has a ``10.n.*`` address."""
        shown = subprocess.run(
            ["ip", "-o", "-4", "addr", "show"],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        taken = {int(n) for n in re.findall(r"inet 10\.(\d+)\.", shown)}
        free = [n for n in range(64, 250) if n not in taken]
        if not free:
            raise RuntimeError("no free 10.n.0.0/16 network for test hosts")
        return random.choice(free)

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def _add(self, i: int) -> None:
        ns, outer, inner = f"{self.prefix}{i}", f"{self.prefix}{i}o", f"{self.prefix}{i}i"
        self._ip("netns", "add", ns)
        self.names.append(ns)
        self._ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._links.append(outer)
        self._ip("link", "set", inner, "netns", ns)
        self._ip("addr", "add", f"{self.gateway(i)}/24", "dev", outer)
        self._ip("link", "set", outer, "up")
        self._ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inner)
        self._ip("-n", ns, "link", "set", inner, "up")
        self._ip("-n", ns, "link", "set", "lo", "up")

    def gateway(self, i: int) -> str:
        """This namespace's address on host ``i``'s link."""
        return f"10.{self.net}.{i}.1"

    def address(self, i: int) -> str:
        """Host ``i``'s own address."""
        return f"10.{self.net}.{i}.2"

    def exec_prefix(self, i: int) -> list[str]:
        """Argument prefix that runs a command inside host ``i``."""
        return ["ip", "netns", "exec", self.names[i]]

    def close(self) -> None:
        """Remove every link and namespace created (idempotent)."""
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._links.clear()
        self.names.clear()


def _cluster_port() -> int:
    """A free port whose cluster bus port (``+10000``) is free too."""
    while True:
        port = free_port()
        if port < 55_000:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port + 10_000))
                except OSError:
                    continue
            return port


class RedisCluster:
    """Three masters and three replicas of ``redis-server`` on 127.0.0.1, in a temporary
    directory; a master that is down costs only its slots (``cluster-require-full-coverage
    no``). Started at construction (a few seconds); :meth:`close` stops and removes it."""

    def __init__(self, nodes: int = 6) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-cluster-"))
        self.ports = [_cluster_port() for _ in range(nodes)]
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for port in self.ports:
                d = self.dir / str(port)
                d.mkdir()
                self.procs.append(
                    subprocess.Popen(
                        [
                            REDIS_SERVER,
                            *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(d)),
                            *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                            *("--cluster-node-timeout", "2000"),
                            *("--cluster-require-full-coverage", "no"),
                            *("--repl-diskless-sync-delay", "0"),
                            *("--save", "", "--appendonly", "no", "--protected-mode", "no"),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
            for port in self.ports:
                self._wait(lambda p=port: self.cli(p, "ping").startswith("PONG"))
            addrs = [f"127.0.0.1:{p}" for p in self.ports]
            self.cli(self.ports[0], "--cluster", "create", *addrs, "--cluster-replicas", "1")
            self._wait(self._ready)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def cli(port: int, *args: str) -> str:
        """``redis-cli -p port args...`` (``--cluster-yes`` for cluster commands)."""
        extra = ["--cluster-yes"] if args and args[0] == "--cluster" else []
        out = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args, *extra],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout

    @staticmethod
    def _wait(ok: object, timeout: float = 30.0) -> None:
        """Polls ``ok`` until it holds; a node not listening yet (``redis-cli`` failing) is
        not ready, not an error."""
        end = time.monotonic() + timeout
        while True:
            try:
                if ok():  # type: ignore[operator]
                    return
            except subprocess.CalledProcessError:
                pass
            if time.monotonic() > end:
                raise RuntimeError("the Redis cluster did not become ready")
            time.sleep(0.05)

    def _ready(self) -> bool:
        for port in self.ports:
            info = self.cli(port, "cluster", "info")
            if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                return False
            if len(self.masters_of(port)) != 3:
                return False
            repl = self.cli(port, "info", "replication")
            if "role:master" not in repl and "master_link_status:up" not in repl:
                return False
        return True

    def masters_of(self, port: int) -> list[int]:
        """Ports of the live masters as the node on ``port`` sees them."""
        out = []
        for line in self.cli(port, "cluster", "nodes").splitlines():
            f = line.split()
            if len(f) > 2 and "master" in f[2] and "fail" not in f[2]:
                out.append(int(f[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(out)

    @property
    def masters(self) -> list[int]:
        """Ports of the live masters."""
        return self.masters_of(self.ports[0])

    @property
    def url(self) -> str:
        """``redis+cluster://`` with one seed node."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def dbsize(self, port: int) -> int:
        """Keys on the node on ``port``."""
        return int(self.cli(port, "dbsize"))

    def close(self) -> None:
        """Stops every node and removes the directory (idempotent)."""
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisCluster]:
    """One Redis Cluster for a test module (tests must not change its topology)."""
    cluster = RedisCluster()
    try:
        yield cluster
    finally:
        cluster.close()


@contextlib.contextmanager
def redis_server(**kwargs: object) -> Iterator[RedisServer]:
    """A :class:`RedisServer` for the duration of a ``with`` block."""
    server = RedisServer(**kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A fresh ``redis-server`` on 127.0.0.1 for one test (64 MiB, ``allkeys-lru``)."""
    with redis_server(maxmemory=64 << 20) as server:
        yield server


@pytest.fixture
def delay_proxy(redis: RedisServer) -> Iterator[DelayProxy]:
    """A :class:`DelayProxy` in front of the test's server, no delay to start with."""
    proxy = DelayProxy(redis.port)
    try:
        yield proxy
    finally:
        proxy.close()


if __name__ == "__main__" and sys.argv[1:2] == ["proxy"]:
    _serve_proxy(int(sys.argv[2]))
