"""The connector's Prometheus metrics, on a real ``vllm serve``'s ``/metrics`` page.

The acceptance test starts vLLM's OpenAI server (CPU backend, the 2-layer toy Llama, the
connector with a CPU tier and a disk tier) as a subprocess on 127.0.0.1, twice on the same disk
directory, and talks to it over HTTP only:

* server 1: request A (a 320-token prefix and its own tail), a prefix-cache reset
  (``/reset_prefix_cache``, vLLM's dev mode), request B (the same prefix, another tail): B's
  prefix comes from the CPU tier;
* server 2, a new process on the same disk directory: request A again: its prefix comes from the
  disk tier (promoted into the CPU pool, then loaded); a reset and B: from the CPU tier again.

After each request the page is scraped until the engine's figures are final (nothing pending),
and the figures are checked against each other (stored bytes = chunks x chunk bytes, disk bytes
held = chunks written x chunk bytes, loaded tokens = vLLM's own external prefix-cache hits) and
against what the requests must have caused (hits > 0 exactly in the tier that served them);
every counter is monotone from one scrape to the next, and every metric the Grafana dashboard
(``docs/grafana/kvoffload.json``) queries is on the page.

Without a server: tensor-parallel ranks counted once (vLLM's real scheduler, two workers),
the stats' aggregation, bad metrics options refused at startup, and the docs' metric table.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm import KvOffloadConnector, KvOffloadStats
from kvoffload.integrations.vllm.messages import SNAPSHOT
from kvoffload.integrations.vllm.metrics import METRICS, KvOffloadPromMetrics
from tests.vllm.harness import Harness, make_config, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "kvoffload.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
MODEL = "tiny"
BLOCK = 32
PREFIX = 320  # 10 full blocks, shared by A and B
TAIL = 20

Sample = tuple[str, tuple[tuple[str, str], ...]]


# ----------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``vllm serve`` (vLLM's OpenAI server module) with the connector, in a subprocess."""

    def __init__(self, disk: Path, log: Path) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        extra = {
            "cpu_bytes": 16 << 20,
            "blocks_per_chunk": 1,
            "disk_path": str(disk),
            "disk_bytes": 16 << 20,
        }
        ktc = {
            "kv_connector": "KvOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(HERE / "tiny-llama"),
            "--served-model-name",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--load-format",
            "dummy",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "4",
            "--num-gpu-blocks-override",
            "64",
            "--enable-prefix-caching",
            "--kv-transfer-config",
            json.dumps(ktc),
        ]
        # Dev mode serves /reset_prefix_cache.
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT, cwd=ROOT
        )
        try:
            self._wait_ready(timeout_s=300.0)
        except BaseException:
            self.stop()
            raise

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.proc.returncode}:\n{self._tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        pytest.fail(f"vllm serve not ready after {timeout_s} s:\n{self._tail()}")

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        req = urllib.request.Request(
            self.base + path,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            out: dict[str, Any] = json.loads(r.read() or b"{}")
            return out

    def complete(self, tokens: list[int]) -> dict[str, Any]:
        """A greedy completion of a token-id prompt (the toy model has no tokenizer)."""
        return self.post(
            "/v1/completions",
            {"model": MODEL, "prompt": tokens, "max_tokens": 4, "temperature": 0.0},
        )

    def reset_prefix_cache(self) -> None:
        """Empties vLLM's prefix cache (not the connector's tiers); vLLM refuses while blocks
        are held (offloads in flight): retried."""
        deadline = time.monotonic() + 30.0
        while not self.post("/reset_prefix_cache").get("success"):
            assert time.monotonic() < deadline, "vLLM kept refusing to reset its prefix cache"
            time.sleep(0.2)

    def page(self) -> str:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as r:
            return str(r.read().decode())

    def scrape(self) -> dict[Sample, float]:
        """Every sample on ``/metrics``: (name, labels) -> value."""
        out: dict[Sample, float] = {}
        for fam in text_string_to_metric_families(self.page()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
        return out

    def settled(self, cond: Any, what: str, timeout_s: float = 60.0) -> dict[Sample, float]:
        """A scrape where nothing is pending any more and ``cond(scrape)`` holds (the stats
        of the engine's last steps reach the server's page asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.scrape()
            if _v(m, "vllm:kvoffload_pending_jobs") == 0 and cond(m):
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"/metrics never showed {what}:\n{_ours(m)}")
            time.sleep(0.3)

    def stop(self) -> None:
        """A clean shutdown (SIGINT: the disk tier closes durably), killed if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._out.close()


def _v(m: dict[Sample, float], name: str, **labels: str) -> float:
    """The value of ``name`` with ``labels`` (and vLLM's model and engine labels)."""
    want = tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items()))
    return m[(name, want)]


def _ours(m: dict[Sample, float]) -> str:
    return "\n".join(
        f"{n}{dict(ls)} {v}"
        for (n, ls), v in sorted(m.items())
        if "offload" in n and not n.endswith(("_bucket", "_created"))
    )


def _assert_monotone(before: dict[Sample, float], after: dict[Sample, float]) -> int:
    """Every counter and histogram series of ``before`` is on ``after`` and not lower."""
    n = 0
    for key, v in before.items():
        name = key[0]
        if name.endswith(("_total", "_count", "_sum", "_bucket")) and "offload" in name:
            assert key in after, f"{key} vanished"
            assert after[key] >= v, f"{key} went from {v} to {after[key]}"
            n += 1
    return n


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1900 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both servers' requests, the scrape after each, and the dashboard check's page."""
    tmp = tmp_path_factory.mktemp("metrics")
    disk = tmp / "disk"
    prefix = _tokens(1, PREFIX)
    a, b = prefix + _tokens(2, TAIL), prefix + _tokens(3, TAIL)
    out: dict[str, Any] = {}

    def stored_behind(m: dict[Sample, float]) -> bool:
        # Every stored chunk written behind to the disk tier.
        return (
            _v(m, "vllm:kvoffload_tier_writes_total", tier="disk")
            >= _v(m, "vllm:kvoffload_stored_chunks_total")
            and _v(m, "vllm:kvoffload_stored_chunks_total") > 0
        )

    def loaded(n: int) -> Any:
        return lambda m: _v(m, "vllm:kvoffload_jobs_total", kind="load", tier="cpu") >= n

    s1 = Server(disk, tmp / "server1.log")
    try:
        out["1_empty"] = s1.scrape()
        s1.complete(a)
        out["1_a"] = s1.settled(stored_behind, "A's chunks stored and written to disk")
        s1.reset_prefix_cache()
        s1.complete(b)
        out["1_b"] = s1.settled(lambda m: loaded(1)(m) and stored_behind(m), "B's load and stores")
        out["1_page"] = s1.page()
    finally:
        s1.stop()
    s2 = Server(disk, tmp / "server2.log")
    try:
        s2.complete(a)
        out["2_a"] = s2.settled(loaded(1), "A's load after its promotion from disk")
        s2.reset_prefix_cache()
        s2.complete(b)
        out["2_b"] = s2.settled(loaded(2), "B's load from the CPU tier")
    finally:
        s2.stop()
    return out


def _check_stored_bytes(m: dict[Sample, float]) -> None:
    chunk = _v(m, "vllm:kvoffload_chunk_bytes", group="0")
    assert chunk == 2 * 2 * BLOCK * 2 * 32 * 4  # layers x (K, V) x tokens x kv heads x dim x f32
    chunks = _v(m, "vllm:kvoffload_stored_chunks_total")
    assert _v(m, "vllm:kv_offload_store_bytes_total") == chunks * chunk
    assert _v(m, "vllm:kv_offload_store_size_sum") == chunks * chunk
    assert _v(m, "vllm:kv_offload_store_size_count") == _v(
        m, "vllm:kvoffload_jobs_total", kind="store", tier="cpu"
    )
    assert _v(m, "vllm:kvoffload_store_seconds_count") == _v(m, "vllm:kv_offload_store_size_count")
    # Every chunk the CPU pool holds was stored (nothing evicted: the pool is large).
    assert _v(m, "vllm:kvoffload_cpu_pool_evictions_total", group="0") == 0
    used = _v(m, "vllm:kvoffload_cpu_pool_slots", group="0", state="used")
    free = _v(m, "vllm:kvoffload_cpu_pool_slots", group="0", state="free")
    assert used + free == _v(m, "vllm:kvoffload_cpu_pool_capacity_slots", group="0")
    # Nothing failed, nothing was skipped, nothing waited.
    for kind, tier in (("load", "cpu"), ("store", "cpu"), ("write", "disk"), ("promote", "disk")):
        assert _v(m, "vllm:kvoffload_job_failures_total", kind=kind, tier=tier) == 0
    for reason in ("no_room", "probation"):
        assert _v(m, "vllm:kvoffload_tier_skipped_writes_total", tier="disk", reason=reason) == 0
    assert _v(m, "vllm:kv_offload_allocation_failure_total") == 0
    assert _v(m, "vllm:kvoffload_tier_quarantined_chunks_total", tier="disk") == 0
    assert _v(m, "vllm:kvoffload_tier_deadline_misses_total", tier="disk") == 0
    assert _v(m, "vllm:kvoffload_tier_on_probation", tier="disk") == 0
    assert _v(m, "vllm:kvoffload_tier_queue_depth", tier="disk") == 0


def _check_loads(m: dict[Sample, float]) -> None:
    chunk = _v(m, "vllm:kvoffload_chunk_bytes", group="0")
    tokens = _v(m, "vllm:kvoffload_loaded_tokens_total")
    assert tokens == _v(m, "vllm:external_prefix_cache_hits_total")  # vLLM's own count
    assert _v(m, "vllm:kv_offload_load_bytes_total") == tokens / BLOCK * chunk
    assert _v(m, "vllm:kv_offload_load_size_count") == _v(
        m, "vllm:kvoffload_jobs_total", kind="load", tier="cpu"
    )


def test_cpu_tier_hit_after_a_prefix_cache_reset(scrapes: dict[str, Any]) -> None:
    before, after_a, after_b = scrapes["1_empty"], scrapes["1_a"], scrapes["1_b"]
    # Before any request: the series are there, at 0.
    assert _v(before, "vllm:kvoffload_hit_tokens_total", tier="cpu") == 0
    assert _v(before, "vllm:kv_offload_store_bytes_total") == 0
    # A: nothing to hit anywhere; its 10 prefix chunks (and more) stored and written behind.
    assert _v(after_a, "vllm:kvoffload_hit_tokens_total", tier="cpu") == 0
    assert _v(after_a, "vllm:kvoffload_hit_tokens_total", tier="disk") == 0
    assert _v(after_a, "vllm:kvoffload_jobs_total", kind="load", tier="cpu") == 0
    assert _v(after_a, "vllm:kvoffload_lookup_chunks_total", tier="cpu", result="hit") == 0
    assert _v(after_a, "vllm:kvoffload_stored_chunks_total") >= PREFIX // BLOCK
    _check_stored_bytes(after_a)
    # B: its whole prefix from the CPU tier, nothing from disk.
    hit = _v(after_b, "vllm:kvoffload_hit_tokens_total", tier="cpu")
    assert hit >= PREFIX
    assert _v(after_b, "vllm:kvoffload_loaded_tokens_total") == PREFIX
    assert _v(after_b, "vllm:kvoffload_hit_tokens_total", tier="disk") == 0
    assert _v(after_b, "vllm:kvoffload_tier_promoted_chunks_total", tier="disk") == 0
    assert _v(after_b, "vllm:kvoffload_tier_read_bytes_total", tier="disk") == 0
    assert _v(after_b, "vllm:kvoffload_lookup_chunks_total", tier="cpu", result="hit") >= 10
    assert _v(after_b, "vllm:kvoffload_jobs_total", kind="load", tier="cpu") == 1
    _check_stored_bytes(after_b)
    _check_loads(after_b)
    # The disk tier holds what was written behind, and the workers wrote exactly that.
    chunk = _v(after_b, "vllm:kvoffload_chunk_bytes", group="0")
    writes = _v(after_b, "vllm:kvoffload_tier_writes_total", tier="disk")
    assert writes == _v(after_b, "vllm:kvoffload_stored_chunks_total")
    assert _v(after_b, "vllm:kvoffload_tier_held_bytes", tier="disk") == writes * chunk
    assert _v(after_b, "vllm:kvoffload_tier_written_bytes_total", tier="disk") == writes * chunk
    assert _v(after_b, "vllm:kvoffload_tier_capacity_bytes", tier="disk") >= writes * chunk
    assert _v(after_b, "vllm:kvoffload_lookups_total") >= 2
    assert _v(after_b, "vllm:kvoffload_scheduler_steps_total") > 0
    assert _assert_monotone(before, after_a) > 30
    assert _assert_monotone(after_a, after_b) > 30


def test_disk_tier_hit_after_a_restart(scrapes: dict[str, Any]) -> None:
    first, after_a, after_b = scrapes["1_b"], scrapes["2_a"], scrapes["2_b"]
    chunk = _v(after_a, "vllm:kvoffload_chunk_bytes", group="0")
    # The new process found every chunk the first one wrote behind.
    held = _v(first, "vllm:kvoffload_tier_held_bytes", tier="disk")
    assert _v(after_a, "vllm:kvoffload_tier_held_bytes", tier="disk") >= held
    # A: the CPU pool was empty; the prefix was promoted from disk (the lookup asked again
    # later), then loaded from the CPU pool.
    promoted = _v(after_a, "vllm:kvoffload_tier_promoted_chunks_total", tier="disk")
    assert promoted >= PREFIX // BLOCK
    assert _v(after_a, "vllm:kvoffload_hit_tokens_total", tier="disk") == promoted * BLOCK
    assert _v(after_a, "vllm:kvoffload_lookup_chunks_total", tier="disk", result="hit") > 0
    assert _v(after_a, "vllm:kvoffload_lookups_deferred_total") >= 1
    assert _v(after_a, "vllm:kvoffload_tier_read_bytes_total", tier="disk") == promoted * chunk
    assert _v(after_a, "vllm:kvoffload_jobs_total", kind="promote", tier="disk") >= 1
    assert _v(after_a, "vllm:kvoffload_loaded_tokens_total") == PREFIX
    assert _v(after_a, "vllm:kvoffload_hit_tokens_total", tier="cpu") >= PREFIX
    _check_loads(after_a)
    # B: from the CPU pool, which holds the promoted prefix: no new promotion.
    assert _v(after_b, "vllm:kvoffload_tier_promoted_chunks_total", tier="disk") == promoted
    assert _v(after_b, "vllm:kvoffload_loaded_tokens_total") == 2 * PREFIX
    assert _v(after_b, "vllm:kvoffload_jobs_total", kind="load", tier="cpu") == 2
    _check_stored_bytes(after_b)
    _check_loads(after_b)
    assert _assert_monotone(after_a, after_b) > 30


def _dashboard_metrics() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [
        t["expr"]
        for p in board["panels"]
        for t in p.get("targets", ())
        if isinstance(t.get("expr"), str)
    ]
    assert len(exprs) >= 10
    return {n for e in exprs for n in re.findall(r"vllm:[a-z_:]+", e)}


def test_every_metric_the_dashboard_queries_is_on_the_page(scrapes: dict[str, Any]) -> None:
    names = {
        s.name for fam in text_string_to_metric_families(scrapes["1_page"]) for s in fam.samples
    }
    queried = _dashboard_metrics()
    assert len(queried) >= 20
    missing = sorted(queried - names)
    assert not missing, f"the dashboard queries metrics /metrics lacks: {missing}"
    # And it shows every metric the connector exports.
    exported = {m.name + ("_total" if m.kind == "counter" else "") for m in METRICS}
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for n in queried}
    assert not sorted(exported - shown), f"not on the dashboard: {sorted(exported - shown)}"


# ----------------------------------------------------------------------- without a server


def _prom() -> tuple[KvOffloadPromMetrics, CollectorRegistry]:
    """A KvOffloadPromMetrics on a private registry, one engine, like vLLM builds it."""
    reg = CollectorRegistry()
    types: Any = {
        Gauge: functools.partial(Gauge, registry=reg),
        Counter: functools.partial(Counter, registry=reg),
        Histogram: functools.partial(Histogram, registry=reg),
    }
    vc, _ = make_config(64, {"cpu_chunks": 256})
    return KvOffloadPromMetrics(vc, types, ["model_name", "engine"], {0: ["m", "0"]}), reg


def _get(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})
    assert v is not None, (name, labels)
    return v


def test_tensor_parallel_ranks_counted_once() -> None:
    """Two workers (vLLM's real scheduler and its output aggregator): jobs, tokens and
    chunks once per engine; bytes summed over the workers' shards."""
    h = Harness(64, tp=2, metrics_interval_ms=0)
    prom, reg = _prom()
    update = h.sched.update_from_output

    def record(*args: Any) -> Any:
        outs = update(*args)
        for eco in outs.values():
            st = eco.scheduler_stats
            if st is not None and st.kv_connector_stats:
                prom.observe(st.kv_connector_stats, 0)
        return outs

    h.sched.update_from_output = record  # type: ignore[method-assign]
    try:
        p = prompt(5, 100)  # 6 full blocks of 16
        h.add("a", p)
        h.run_until_done()
        h.drain()
        assert h.sched.reset_prefix_cache()
        h.add("b", p)
        h.run_until_done()
        h.drain()
    finally:
        h.shutdown()
    s = h.conn.scheduler_side
    assert s is not None
    per_worker = s.cfg.bytes_per_chunk(0)
    assert _get(reg, "vllm:kvoffload_chunk_bytes", group="0") == 2 * per_worker
    chunks = _get(reg, "vllm:kvoffload_stored_chunks_total")
    assert chunks == 6
    assert _get(reg, "vllm:kv_offload_store_bytes_total") == chunks * 2 * per_worker
    assert _get(reg, "vllm:kvoffload_jobs_total", kind="load", tier="cpu") == 1
    assert _get(reg, "vllm:kvoffload_loaded_tokens_total") == 96
    assert _get(reg, "vllm:kvoffload_hit_tokens_total", tier="cpu") == 96
    assert _get(reg, "vllm:kv_offload_load_bytes_total") == 6 * 2 * per_worker
    # One observation per job and worker.
    assert _get(reg, "vllm:kv_offload_load_size_count") == 2
    stores = _get(reg, "vllm:kvoffload_jobs_total", kind="store", tier="cpu")
    assert _get(reg, "vllm:kvoffload_store_seconds_count") == 2 * stores
    assert _get(reg, "vllm:kvoffload_pending_jobs") == 0


def test_stats_aggregate_counters_samples_and_the_latest_snapshot() -> None:
    a = KvOffloadStats()
    a.data.update(lookups=2, bytes_loaded=10, load_sizes=[10], load_times=[0.5])
    a.data[SNAPSHOT] = {"vllm:kvoffload_pending_jobs": 3, "vllm:kvoffload_stored_chunks": 4}
    b = KvOffloadStats()
    b.data.update(lookups=1, bytes_loaded=5, load_sizes=[5], load_times=[0.25])
    b.data[SNAPSHOT] = {"vllm:kvoffload_pending_jobs": 0, "vllm:kvoffload_stored_chunks": 6}
    c = KvOffloadStats()  # an interval without a snapshot keeps the latest one
    assert c.is_empty()
    got = a.aggregate(b).aggregate(c)
    assert isinstance(got, KvOffloadStats)
    assert not got.is_empty()
    assert got.data["lookups"] == 3
    assert got.data["load_sizes"] == [10, 5]
    assert got.data[SNAPSHOT]["vllm:kvoffload_stored_chunks"] == 6
    r = got.reduce()
    assert r["bytes_loaded"] == 15
    assert r["load_times_count"] == 2
    assert r["load_times_sum"] == 0.75
    assert SNAPSHOT not in r
    # Cumulative snapshot counters become increments; gauges are set.
    prom, reg = _prom()
    prom.observe(a.data | {SNAPSHOT: {"vllm:kvoffload_stored_chunks": 4}})
    prom.observe({SNAPSHOT: {"vllm:kvoffload_stored_chunks": 6, "vllm:kvoffload_pending_jobs": 2}})
    prom.observe({SNAPSHOT: {"vllm:kvoffload_stored_chunks": 6}})
    assert _get(reg, "vllm:kvoffload_stored_chunks_total") == 6
    assert _get(reg, "vllm:kvoffload_pending_jobs") == 2
    assert _get(reg, "vllm:kvoffload_lookups_total") == 3
    assert _get(reg, "vllm:kv_offload_load_size_count") == 2


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"metrics_interval": 1000}, r"key\(s\) \['metrics_interval'\]"),
        ({"metrics_interval_ms": "1s"}, "metrics_interval_ms must be"),
        ({"metrics_interval_ms": -1}, "metrics_interval_ms must be"),
        ({"metrics_interval_ms": True}, "metrics_interval_ms must be"),
    ],
)
def test_bad_metrics_option_fails_at_startup(extra: dict[str, Any], named: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc, kcc = make_config(64, {"cpu_chunks": 256, **extra})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=named):
            KvOffloadConnector(vc, role, kcc)


def test_docs_table_lists_every_metric() -> None:
    doc = METRICS_DOC.read_text()
    for m in METRICS:
        shown = m.name + ("_total" if m.kind == "counter" else "")
        assert f"`{shown}`" in doc, shown
    assert "docs/metrics.md" in (ROOT / "README.md").read_text()
