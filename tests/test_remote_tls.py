"""The shared tier over TLS from Python: ``kvoffload simulate --remote rediss://...
--remote-tls-ca FILE`` (the scheduler's lookups and the workers' reads and writes on TLS)
against a real ``redis-server`` with certificates made here by ``openssl``; a CA that did not
sign the server's certificate is a :class:`~kvoffload.errors.ConfigError` at startup."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload._core import RemoteClient
from kvoffload.cli import main
from kvoffload.errors import ConfigError
from tests.support.remote import free_port


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A TLS-only ``redis-server`` on 127.0.0.1 and the directory of its certificates."""
    for ca in ("ca", "other-ca"):
        _openssl(
            tmp_path, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN=kvoffload test {ca}", "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
        )  # fmt: skip
    _openssl(
        tmp_path, "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr",
    )  # fmt: skip
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        tmp_path, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.crt",
    )  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            *("--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"),
            *("--tls-cert-file", "server.crt", "--tls-key-file", "server.key"),
            *("--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"),
            *("--save", "", "--appendonly", "no", "--dir", str(tmp_path)),
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 10
        while True:
            try:
                RemoteClient(f"rediss://127.0.0.1:{port}", tls_ca=str(tmp_path / "ca.crt"))
                out = subprocess.run(
                    ["redis-cli", "--tls", "--cacert", "ca.crt", "-p", str(port), "ping"],
                    cwd=tmp_path,
                    capture_output=True,
                    text=True,
                )
                if out.stdout.startswith("PONG"):
                    break
            except ConfigError:
                pass
            assert time.monotonic() < end, "redis-server (TLS) did not start"
            time.sleep(0.05)
        yield port, tmp_path
    finally:
        proc.kill()
        proc.wait()


def test_simulate_shares_chunks_over_tls(
    tls_server: tuple[int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    port, d = tls_server
    argv = ["simulate", "--requests", "30", "--quiet", "--no-baseline"]
    url = f"rediss://127.0.0.1:{port}"
    assert main([*argv, "--remote", url, "--remote-tls-ca", str(d / "ca.crt")]) == 0
    out = capsys.readouterr().out
    promoted = [line for line in out.splitlines() if line.startswith("promoted from remote")]
    assert promoted, out
    assert not promoted[0].split(":")[1].strip().startswith("0 "), promoted


def test_a_certificate_from_another_ca_is_refused_at_startup(
    tls_server: tuple[int, Path],
) -> None:
    port, d = tls_server
    with pytest.raises(ConfigError, match="remote_url"):
        RemoteClient(f"rediss://127.0.0.1:{port}", tls_ca=str(d / "other-ca.crt"))
    with pytest.raises(ConfigError, match="remote_tls_ca"):
        RemoteClient(f"rediss://127.0.0.1:{port}")
