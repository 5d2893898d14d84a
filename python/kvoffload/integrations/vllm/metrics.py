"""The connector's Prometheus metrics on vLLM's ``/metrics``: what they are, how the scheduler
side samples the core for them, and how vLLM's stat logger records them.

vLLM's frontend builds one :class:`KvOffloadPromMetrics` per process
(``KvOffloadConnector.build_prom_metrics``) and hands it every interval's stats, the
``data`` of a :class:`~kvoffload.integrations.vllm.messages.KvOffloadStats`, for each engine
(``observe``). Three kinds of figures arrive there:

* interval counters (``bytes_loaded``, ``lookups``, ...): the scheduler side counts them as
  they happen; they are added to Prometheus counters;
* per-job samples (bytes and seconds of each finished copy job on each worker): observed into
  histograms;
* a *snapshot* of the core (:func:`core_snapshot`): its cumulative counters and its gauges (CPU
  pool occupancy per KV group, each lower tier's bytes held, queue depth, probation, ...). The
  scheduler side takes one, and hands vLLM the interval's stats with it, at most every
  ``metrics_interval_ms`` (default 1000), and once more when the engine falls quiet (no request
  tracked and no job pending), so an idle engine's metrics are final. Cumulative counters
  become Prometheus increments here, against the last snapshot seen from that engine.

No figure costs work per engine step beyond what the adapter already counted: the snapshot's
two core calls and the stats object run once a second, not once a step.

Names follow vLLM's conventions: the ``vllm:`` prefix, base units (``_bytes``, ``_seconds``),
counters exposed with ``_total``, vLLM's labels (``model_name``, ``engine``) first. Figures that
vLLM's own ``OffloadingConnector`` exports keep its names and meaning
(``vllm:kv_offload_load_bytes``, ``..._store_bytes``, ``..._load_time``, ``..._store_time``,
``..._load_size``, ``..._store_size``, ``vllm:kv_offload_allocation_failure``), so dashboards
built for it keep working; the others are ``vllm:kvoffload_*``. :data:`METRICS` lists them all
(``docs/metrics.md`` is its table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvoffload.integrations.vllm.messages import SAMPLE_KEYS, SNAPSHOT

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

__all__ = ["METRICS", "KvOffloadPromMetrics", "Metric", "core_snapshot"]

# vLLM's OffloadingConnector's buckets for its transfer size histograms (bytes).
_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
_SECONDS_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class Metric:
    """One exported metric.

    Attributes:
        name: The Prometheus name (a counter's samples get ``_total`` appended).
        kind: ``counter``, ``gauge`` or ``histogram``.
        doc: Its help text.
        labels: Its labels after vLLM's ``model_name`` and ``engine``.
        source: Where its figures come from: ``interval`` (stats counters), ``samples`` (per-job
            lists) or ``snapshot`` (the core, sampled).
        buckets: A histogram's buckets.
    """

    name: str
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()
    source: Literal["interval", "samples", "snapshot"] = "snapshot"
    buckets: tuple[float, ...] | None = None


def _m(name: str, kind: Kind, doc: str, *labels: str, **kw: Any) -> Metric:
    return Metric(name, kind, doc, labels, **kw)


_I = {"source": "interval"}
METRICS: tuple[Metric, ...] = (
    # vLLM's OffloadingConnector's names and meanings.
    _m(
        "vllm:kv_offload_load_bytes",
        "counter",
        "Total bytes loaded from offload storage to GPU (all workers).",
        **_I,
    ),
    _m(
        "vllm:kv_offload_store_bytes",
        "counter",
        "Total bytes stored from GPU to offload storage (all workers).",
        **_I,
    ),
    _m(
        "vllm:kv_offload_load_time",
        "counter",
        "Total load time from offload storage to GPU, in seconds (summed over workers).",
        **_I,
    ),
    _m(
        "vllm:kv_offload_store_time",
        "counter",
        "Total store time from GPU to offload storage, in seconds (summed over workers).",
        **_I,
    ),
    _m(
        "vllm:kv_offload_load_size",
        "histogram",
        "Histogram of KV offload load operation size, in bytes (one per job and worker).",
        source="samples",
        buckets=_SIZE_BUCKETS,
    ),
    _m(
        "vllm:kv_offload_store_size",
        "histogram",
        "Histogram of KV offload store operation size, in bytes (one per job and worker).",
        source="samples",
        buckets=_SIZE_BUCKETS,
    ),
    _m(
        "vllm:kv_offload_allocation_failure",
        "counter",
        "Number of KV offload store allocation attempts that failed (no evictable room in the CPU "
        "pool; retried next step).",
    ),
    # Lookups and hits.
    _m(
        "vllm:kvoffload_lookups",
        "counter",
        "Lookups of waiting requests (vLLM's get_num_new_matched_tokens calls).",
        **_I,
    ),
    _m(
        "vllm:kvoffload_lookups_deferred",
        "counter",
        "Lookups answered 'ask again later' (a load or promotion of the chunks in flight).",
        **_I,
    ),
    _m(
        "vllm:kvoffload_lookup_chunks",
        "counter",
        "Chunks looked up per tier (summed over KV groups), found ready (result=hit) or not "
        "(result=miss).",
        "tier",
        "result",
    ),
    _m(
        "vllm:kvoffload_hit_tokens",
        "counter",
        "Tokens served by the tier: cpu, tokens lookups found loadable in the CPU pool (chunks "
        "promoted there included: every load comes from the CPU pool); disk and remote, tokens "
        "promoted from that tier into the CPU pool (on the KV group promoting the most).",
        "tier",
    ),
    # Tokens, chunks, jobs.
    _m(
        "vllm:kvoffload_loaded_tokens",
        "counter",
        "Tokens loaded into GPU blocks from the CPU pool (vLLM's external tokens).",
        **_I,
    ),
    _m(
        "vllm:kvoffload_stored_chunks",
        "counter",
        "Chunks planned for stores from GPU to the CPU pool (summed over KV groups).",
    ),
    _m(
        "vllm:kvoffload_jobs",
        "counter",
        "Jobs created, by kind (load, store: tier=cpu; write, promote: a lower tier).",
        "kind",
        "tier",
    ),
    _m(
        "vllm:kvoffload_job_failures",
        "counter",
        "Jobs that failed on some worker, by kind (a failed load or promotion is recomputed; a "
        "failed store or write is a future miss).",
        "kind",
        "tier",
    ),
    _m(
        "vllm:kvoffload_load_seconds",
        "histogram",
        "Time of a load job's copies on one worker (one observation per job and worker).",
        source="samples",
        buckets=_SECONDS_BUCKETS,
    ),
    _m(
        "vllm:kvoffload_store_seconds",
        "histogram",
        "Time of a store job's copies on one worker (one observation per job and worker).",
        source="samples",
        buckets=_SECONDS_BUCKETS,
    ),
    # The fence.
    _m(
        "vllm:kvoffload_flushed_jobs",
        "counter",
        "Jobs the fence made complete before a block was written: reason=necessary (exact fence), "
        "conservative (every allocated block counted written), reset (a cache reset).",
        "reason",
    ),
    _m(
        "vllm:kvoffload_flush_wait_seconds",
        "counter",
        "Seconds the workers' hosts waited for flushed jobs (summed over workers; on CUDA the "
        "compute stream waits instead and this stays 0).",
        **_I,
    ),
    # The scheduler side's own cost.
    _m(
        "vllm:kvoffload_scheduler_seconds",
        "counter",
        "Seconds the connector's scheduler side spent in vLLM's scheduler calls.",
        **_I,
    ),
    _m(
        "vllm:kvoffload_scheduler_steps",
        "counter",
        "Engine steps the connector's scheduler side planned.",
        **_I,
    ),
    # The CPU pool.
    _m(
        "vllm:kvoffload_cpu_pool_capacity_slots",
        "gauge",
        "Chunk slots of the CPU pool, per KV group.",
        "group",
    ),
    _m(
        "vllm:kvoffload_cpu_pool_slots",
        "gauge",
        "CPU pool slots per KV group and state: used (holding a chunk, ready or storing), storing "
        "(reserved by a store in flight), pinned (held by loads or writes in flight), free.",
        "group",
        "state",
    ),
    _m(
        "vllm:kvoffload_cpu_pool_evictions",
        "counter",
        "Chunks evicted from the CPU pool to make room, per KV group.",
        "group",
    ),
    _m(
        "vllm:kvoffload_chunk_bytes",
        "gauge",
        "Bytes of one chunk of the KV group on all workers together.",
        "group",
    ),
    _m("vllm:kvoffload_chunk_tokens", "gauge", "Tokens of one chunk."),
    _m("vllm:kvoffload_pending_jobs", "gauge", "Jobs pending (copies and lower-tier jobs)."),
    _m("vllm:kvoffload_loading_requests", "gauge", "Requests waiting for a load."),
    # Lower tiers (tier=disk, remote), summed over KV groups.
    _m(
        "vllm:kvoffload_tier_held_bytes",
        "gauge",
        "Bytes of chunks the lower tier holds (all workers).",
        "tier",
    ),
    _m(
        "vllm:kvoffload_tier_capacity_bytes",
        "gauge",
        "Bytes the lower tier may hold at most (all workers; 0 when the tier sets no bound).",
        "tier",
    ),
    _m(
        "vllm:kvoffload_tier_writes",
        "counter",
        "Chunks written behind to the lower tier and published.",
        "tier",
    ),
    _m(
        "vllm:kvoffload_tier_skipped_writes",
        "counter",
        "Chunks not written behind: reason=no_room (no evictable room in the tier), probation (the"
        " tier was on probation), bound (write-behind already pinned its share of the CPU slots,"
        " tier_write_share, or disk_write_mbps was reached).",
        "tier",
        "reason",
    ),
    _m(
        "vllm:kvoffload_tier_promoted_chunks",
        "counter",
        "Chunks promoted from the lower tier into the CPU pool.",
        "tier",
    ),
    _m(
        "vllm:kvoffload_tier_evictions",
        "counter",
        "Chunks evicted from the lower tier to make room.",
        "tier",
    ),
    _m(
        "vllm:kvoffload_tier_queue_depth",
        "gauge",
        "Lower-tier jobs (writes, promotions) pending.",
        "tier",
    ),
    _m(
        "vllm:kvoffload_tier_deadline_misses",
        "counter",
        "Lower-tier operations past their deadline: promotions that expired (their requests "
        "recompute) and existence checks unanswered in time.",
        "tier",
    ),
    _m(
        "vllm:kvoffload_tier_on_probation",
        "gauge",
        "1 while the lower tier is on probation (from a probation's start until a trial succeeds),"
        " else 0.",
        "tier",
    ),
    _m(
        "vllm:kvoffload_tier_probations",
        "counter",
        "Times the lower tier was put on probation.",
        "tier",
    ),
    _m(
        "vllm:kvoffload_tier_quarantined_chunks",
        "counter",
        "Chunks of the lower tier that failed verification: dropped, never served.",
        "tier",
    ),
    _m(
        "vllm:kvoffload_tier_written_bytes",
        "counter",
        "Bytes the workers wrote to the lower tier.",
        "tier",
        **_I,
    ),
    _m(
        "vllm:kvoffload_tier_read_bytes",
        "counter",
        "Bytes the workers read from the lower tier.",
        "tier",
        **_I,
    ),
)
"""Every metric the connector exports (``docs/metrics.md`` is this table)."""

# Interval counters: stats key -> (metric, label values).
_INTERVAL: dict[str, tuple[str, tuple[str, ...]]] = {
    "bytes_loaded": ("vllm:kv_offload_load_bytes", ()),
    "bytes_stored": ("vllm:kv_offload_store_bytes", ()),
    "load_seconds": ("vllm:kv_offload_load_time", ()),
    "store_seconds": ("vllm:kv_offload_store_time", ()),
    "lookups": ("vllm:kvoffload_lookups", ()),
    "lookups_deferred": ("vllm:kvoffload_lookups_deferred", ()),
    "loaded_tokens": ("vllm:kvoffload_loaded_tokens", ()),
    "flush_seconds": ("vllm:kvoffload_flush_wait_seconds", ()),
    "sched_seconds": ("vllm:kvoffload_scheduler_seconds", ()),
    "sched_steps": ("vllm:kvoffload_scheduler_steps", ()),
    **{
        f"{m}_bytes_{d}": (f"vllm:kvoffload_tier_{d}_bytes", (m,))
        for m in ("disk", "remote")
        for d in ("written", "read")
    },
}
# Per-job samples: stats key -> histograms.
_SAMPLES: dict[str, tuple[str, ...]] = {
    "load_sizes": ("vllm:kv_offload_load_size",),
    "store_sizes": ("vllm:kv_offload_store_size",),
    "load_times": ("vllm:kvoffload_load_seconds",),
    "store_times": ("vllm:kvoffload_store_seconds",),
}
assert set(_SAMPLES) == set(SAMPLE_KEYS)


def _key(name: str, *labels: object) -> str:
    return "/".join((name, *map(str, labels)))


def core_snapshot(
    stats: dict[str, Any],
    tier_stats: list[dict[str, Any]],
    chunk_bytes: list[int],
    chunk_tokens: int,
) -> dict[str, float]:
    """The snapshot figures of the core's ``stats()`` and ``tier_stats()``: cumulative counters
    and gauges, ``metric/label/...`` → value.

    Args:
        stats: ``Scheduler.stats()``.
        tier_stats: ``Scheduler.tier_stats()`` (one entry per group and lower tier).
        chunk_bytes: Bytes of one chunk of each KV group, all workers together.
        chunk_tokens: Tokens of one chunk.
    """
    out: dict[str, float] = {
        "vllm:kv_offload_allocation_failure": stats["store_no_room"],
        _key("vllm:kvoffload_hit_tokens", "cpu"): stats["lookup_hit_tokens"],
        "vllm:kvoffload_stored_chunks": stats["store_chunks"],
        _key("vllm:kvoffload_jobs", "load", "cpu"): stats["load_jobs"],
        _key("vllm:kvoffload_jobs", "store", "cpu"): stats["store_jobs"],
        _key("vllm:kvoffload_job_failures", "load", "cpu"): stats["failed_loads"],
        _key("vllm:kvoffload_job_failures", "store", "cpu"): stats["failed_stores"],
        _key("vllm:kvoffload_flushed_jobs", "necessary"): stats["flushes_necessary"],
        _key("vllm:kvoffload_flushed_jobs", "conservative"): stats["flushes_conservative"],
        _key("vllm:kvoffload_flushed_jobs", "reset"): stats["flushes_reset"],
        "vllm:kvoffload_chunk_tokens": chunk_tokens,
        "vllm:kvoffload_pending_jobs": stats["pending_jobs"],
        "vllm:kvoffload_loading_requests": stats["loading_requests"],
    }
    hits = misses = 0
    for g, p in enumerate(stats["pools"]):
        hits += p["hits"]
        misses += p["misses"]
        out[_key("vllm:kvoffload_cpu_pool_capacity_slots", g)] = p["capacity"]
        for state in ("used", "storing", "pinned", "free"):
            out[_key("vllm:kvoffload_cpu_pool_slots", g, state)] = p[state]
        out[_key("vllm:kvoffload_cpu_pool_evictions", g)] = p["evictions"]
        out[_key("vllm:kvoffload_chunk_bytes", g)] = chunk_bytes[g]
    out[_key("vllm:kvoffload_lookup_chunks", "cpu", "hit")] = hits
    out[_key("vllm:kvoffload_lookup_chunks", "cpu", "miss")] = misses
    promoted: dict[str, int] = {}
    for t in tier_stats:
        m, g = t["medium"], t["group"]
        promoted[m] = max(promoted.get(m, 0), t["promoted_chunks"])
        sums = {
            _key("vllm:kvoffload_lookup_chunks", m, "hit"): t["hits"],
            _key("vllm:kvoffload_lookup_chunks", m, "miss"): t["misses"],
            _key("vllm:kvoffload_jobs", "write", m): t["write_jobs"],
            _key("vllm:kvoffload_jobs", "promote", m): t["promote_jobs"],
            _key("vllm:kvoffload_job_failures", "write", m): t["failed_write_jobs"],
            _key("vllm:kvoffload_job_failures", "promote", m): t["failed_promotions"],
            _key("vllm:kvoffload_tier_held_bytes", m): t["used"] * chunk_bytes[g],
            _key("vllm:kvoffload_tier_capacity_bytes", m): t["capacity"] * chunk_bytes[g],
            _key("vllm:kvoffload_tier_writes", m): t["writes"],
            _key("vllm:kvoffload_tier_skipped_writes", m, "no_room"): t["no_room"],
            _key("vllm:kvoffload_tier_skipped_writes", m, "probation"): t["dropped_writes"],
            _key("vllm:kvoffload_tier_skipped_writes", m, "bound"): t["skipped_writes"],
            _key("vllm:kvoffload_tier_promoted_chunks", m): t["promoted_chunks"],
            _key("vllm:kvoffload_tier_evictions", m): t["evictions"],
            _key("vllm:kvoffload_tier_queue_depth", m): t["queue_depth"],
            _key("vllm:kvoffload_tier_deadline_misses", m): (
                t["expired_promotions"] + t["expired_checks"]
            ),
            _key("vllm:kvoffload_tier_probations", m): t["probations"],
            _key("vllm:kvoffload_tier_quarantined_chunks", m): t["quarantined"],
        }
        for k, v in sums.items():
            out[k] = out.get(k, 0) + v
        on = _key("vllm:kvoffload_tier_on_probation", m)
        out[on] = max(out.get(on, 0), int(t["probations"] > t["recoveries"]))
    for m, n in promoted.items():
        out[_key("vllm:kvoffload_hit_tokens", m)] = n * chunk_tokens
    return out


_BY_NAME = {m.name: m for m in METRICS}


class KvOffloadPromMetrics(KVConnectorPromMetrics):
    """Registers :data:`METRICS` with vLLM's metric classes and records each engine's stats.

    Series whose labels the configuration fixes (the tiers configured, job kinds, flush
    reasons) exist from the start, at 0; per KV group series appear with the first snapshot.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for m in METRICS:
            kw: dict[str, Any] = {
                "name": m.name,
                "documentation": m.doc,
                "labelnames": [*labelnames, *m.labels],
            }
            if m.kind == "counter":
                cls: Any = self._counter_cls
            elif m.kind == "gauge":
                cls = self._gauge_cls
                kw["multiprocess_mode"] = "mostrecent"
            else:
                cls = self._histogram_cls
                kw["buckets"] = list(m.buckets or ())
            self._families[m.name] = cls(**kw)
        # (engine, snapshot key) -> bound metric; (engine, snapshot key) -> last cumulative value
        self._bound: dict[tuple[int, str], Any] = {}
        self._last: dict[tuple[int, str], float] = {}
        ktc = vllm_config.kv_transfer_config
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        tiers = ["cpu"] + [
            m
            for m, opt in (("disk", "disk_path"), ("remote", "remote_url"))
            if extra.get(opt) is not None
        ]
        fixed = [m.name for m in METRICS if not m.labels]
        fixed += [
            _key("vllm:kvoffload_flushed_jobs", r) for r in ("necessary", "conservative", "reset")
        ]
        for t in tiers:
            fixed.append(_key("vllm:kvoffload_hit_tokens", t))
            fixed += [_key("vllm:kvoffload_lookup_chunks", t, r) for r in ("hit", "miss")]
            kinds = ("load", "store") if t == "cpu" else ("write", "promote")
            for k in kinds:
                fixed += [
                    _key("vllm:kvoffload_jobs", k, t),
                    _key("vllm:kvoffload_job_failures", k, t),
                ]
            if t == "cpu":
                continue
            for m in METRICS:
                if m.labels == ("tier",) and m.name.startswith("vllm:kvoffload_tier_"):
                    fixed.append(_key(m.name, t))
            fixed += [
                _key("vllm:kvoffload_tier_skipped_writes", t, r)
                for r in ("no_room", "probation", "bound")
            ]
        for engine in per_engine_labelvalues:
            for k in fixed:
                self._metric(engine, k)

    def _metric(self, engine: int, key: str) -> Any:
        """The metric of snapshot key ``key`` (``name/label/...``) bound to ``engine``'s
        labels."""
        got = self._bound.get((engine, key))
        if got is None:
            name, *labels = key.split("/")
            fam = self._families[name]
            got = fam.labels(*self.per_engine_labelvalues[engine], *labels)
            self._bound[(engine, key)] = got
        return got

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Records one interval's stats of engine ``engine_idx``."""
        d = transfer_stats_data
        for key, (name, labels) in _INTERVAL.items():
            v = d.get(key)
            if v:
                self._metric(engine_idx, _key(name, *labels)).inc(v)
        for key, names in _SAMPLES.items():
            samples = d.get(key)
            if samples:
                for name in names:
                    h = self._metric(engine_idx, name)
                    for v in samples:
                        h.observe(v)
        snap = d.get(SNAPSHOT)
        if not snap:
            return
        for key, v in snap.items():
            m = _BY_NAME[key.split("/", 1)[0]]
            metric = self._metric(engine_idx, key)
            if m.kind == "gauge":
                metric.set(v)
                continue
            last = self._last.get((engine_idx, key), 0)
            if v > last:
                metric.inc(v - last)
                self._last[(engine_idx, key)] = v
