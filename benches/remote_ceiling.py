"""What the server can take: the write ceiling of the shared-tier benchmark (bench_remote.py).

Both clients wait on one ``redis-server`` receiving their bytes, so a client's write speed is
bounded by what the server can take. This module measures that bound in the same run:

- :class:`RawWriter`: the fastest writer of the same ``SET``s we know of, the upper bound: the
  commands framed before the clock starts, every value ``header + chunk`` sent with one
  ``sendmsg`` from the source memory (no copy, no checksum), on ``connections`` sockets in
  parallel. Each connection sends the next command's framing after the current value and only
  then waits for the reply, so the server reads that framing alone and keeps the large value
  it reads next without copying it (as our client does, see ``rust/tier/remote/send.rs``).
  Python runs only a few statements per 2 MiB value; the time is the kernel's and the server's.
- :func:`measure`: one write phase with its costs: wall time, this process's CPU time (every
  thread: the Rust client's I/O threads included) and the server's CPU time, per thread,
  from ``/proc/<pid>/task/*/schedstat``. The server's busiest thread's CPU / wall is its
  utilisation: near 1.0, it is saturated and no client can write faster.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process ``pid``, by thread id, from
    ``schedstat`` (nanoseconds; ``stat``'s utime + stime count 10 ms ticks, too coarse for a
    70 ms write phase)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:  # the thread ended
            continue
        out[int(task.name)] = ns / 1e9
    return out


@dataclass
class Cost:
    """One write phase: wall seconds, client CPU seconds, server CPU seconds (all threads and
    the busiest one)."""

    wall: float
    client_cpu: float
    server_cpu: float
    server_top: float


def measure(server_pid: int, work: Callable[[], object]) -> Cost:
    """Runs ``work`` and returns its :class:`Cost`."""
    s0 = thread_cpu(server_pid)
    c0, t0 = time.process_time(), time.perf_counter()
    work()
    t1, c1 = time.perf_counter(), time.process_time()
    s1 = thread_cpu(server_pid)
    per = [v - s0.get(tid, 0.0) for tid, v in s1.items()]
    return Cost(t1 - t0, c1 - c0, sum(per), max(per))


def _send(sock: socket.socket, pieces: Sequence[bytes | memoryview]) -> None:
    """Sends the concatenation of ``pieces`` (``sendmsg`` until every byte is out)."""
    views = [memoryview(p).cast("B") for p in pieces]
    while views:
        n = sock.sendmsg(views)
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]


def _expect(sock: socket.socket, reply: bytes) -> None:
    got = b""
    while len(got) < len(reply):
        part = sock.recv(len(reply) - len(got))
        if not part:
            raise ConnectionError("server closed the connection")
        got += part
    if got != reply:
        raise ConnectionError(f"unexpected reply {got!r}")


class RawWriter:
    """``SET name header+chunk`` for each chunk, the fastest way we know (see the module)."""

    def __init__(self, port: int, connections: int, sndbuf: int = 0) -> None:
        self.socks = []
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if sndbuf:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            self.socks.append(s)

    def frame(self, names: Sequence[str], value_len: int) -> list[bytes]:
        """Each command's bytes before its value (framed before the clock starts)."""
        return [
            b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(n), n.encode(), value_len)
            for n in names
        ]

    def write(self, leads: Sequence[bytes], header: bytes, src: np.ndarray, chunk: int) -> None:
        """Sends ``SET``s: command ``i``'s framing ``leads[i]``, value ``header`` + chunk ``i``
        of ``src``; chunks are shared out to the connections in contiguous runs."""
        data = memoryview(src).cast("B")
        per = -(-len(leads) // len(self.socks))

        def one(sock: socket.socket, first: int) -> None:
            mine = range(first, min(len(leads), first + per))
            if not mine:
                return
            _send(sock, [leads[mine[0]]])
            for i in mine:
                _send(sock, [header, data[i * chunk : (i + 1) * chunk], b"\r\n"])
                if i + 1 in mine:
                    _send(sock, [leads[i + 1]])
                _expect(sock, b"+OK\r\n")

        threads = [
            threading.Thread(target=one, args=(s, k * per)) for k, s in enumerate(self.socks)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def close(self) -> None:
        for s in self.socks:
            s.close()
