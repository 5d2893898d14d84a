"""The connector's worker side: one :class:`~kvoffload.transfer.TransferEngine` per worker.

In vLLM's call order: ``handle_preemptions`` (before the forward pass) runs the data plane's
step for the plan (:meth:`TransferEngine.step_packed`, with the plan's packed runs as the core
made them: submits the previous step's stores and every
flushed job, completes the flush set -- a host wait on CPU, a compute-stream wait on CUDA --
submits the loads and queues this step's stores, which start at the next step);
``start_load_kv`` and ``wait_for_save`` run that step if the plan had none yet (no forward
pass); ``get_finished`` / ``get_transfer_results`` poll results.

**How job ids travel back.** Each worker reports the ids of the jobs it finished (or failed),
with its rank, in a :class:`~kvoffload.integrations.vllm.messages.KvOffloadWorkerMetadata`
(``build_connector_worker_meta``); vLLM merges the workers' reports and hands them to the
scheduler side, which completes a job once every rank reported it. Loads are also reported by
request id through ``finished_recving``, which vLLM counts over workers to keep a request in
``WAITING_FOR_REMOTE_KVS`` until its load is done everywhere. Failed loads are reported as
``failed_recving`` and, with one KV group, as ``get_block_ids_with_load_errors`` (vLLM refuses
block ids with several groups).

**Lower tiers.** With ``disk_path`` and/or ``remote_url`` set, each worker opens a tier worker
per tier (:class:`~kvoffload._core.DiskWorker`, :class:`~kvoffload._core.RemoteWorker`) over
its engine's CPU pool, with its rank and the world size in the namespace (each rank holds its
own shard of every chunk). The plan's tier jobs go to them as the packed buffer the core made
(each takes its own medium's jobs); they run them on Rust threads, and their results travel
back like copies (job ids by rank in the worker metadata; a failed promotion makes the request
recompute). After a cache reset the plan names the tier jobs in flight (``tier_flush``): their
CPU slots are free again, so the worker waits for them, and for the flushed copies, before
anything of the new plan starts. ``shutdown`` closes the tier workers (their queued jobs
finish first).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvoffload._core import DiskWorker, RemoteWorker
from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm.messages import KvOffloadMetadata, KvOffloadWorkerMetadata
from kvoffload.scheduler import OffloadConfig
from kvoffload.transfer import TransferEngine
from kvoffload.transfer.disk import tier_worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def _layout(t: torch.Tensor, num_blocks: int, name: str) -> str:
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks and num_blocks != 2:
        return "kv_first"
    if t.shape[0] == num_blocks:
        return "blocks_first"
    raise ConfigError(
        f"KvOffloadConnector: cannot tell the block dimension of layer {name}'s KV cache "
        f"(shape {tuple(t.shape)}, {num_blocks} blocks)"
    )


def worker_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank among the engine's ``num_workers`` (TP x PP): reports carry it, so the
    scheduler completes a job only once every rank reported it. 0 before vLLM's parallel state
    exists (a single worker)."""
    from vllm.distributed import parallel_state as ps

    try:
        tp = ps.get_tensor_model_parallel_rank()
        pp = ps.get_pp_group().rank_in_group
    except (AssertionError, AttributeError):
        return 0
    return pp * int(vllm_config.parallel_config.tensor_parallel_size) + tp


class WorkerSide:
    """Drives one :class:`TransferEngine` in vLLM's worker call order."""

    def __init__(self, cfg: OffloadConfig, kv_cache_config: KVCacheConfig, rank: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank  # reported with every job
        self.kv_cache_config = kv_cache_config
        self.xfer: TransferEngine | None = None
        # Load job -> (request, its plan): a failed load reports its GPU blocks.
        self.load_req: dict[int, tuple[str, KvOffloadMetadata]] = {}
        self.before_done: KvOffloadMetadata | None = None
        self.meta = KvOffloadWorkerMetadata()
        self.invalid: set[int] = set()
        self.cancelled: set[int] = set()
        # vLLM refuses block-level load errors with several KV groups (block ids are per
        # group); failed_recving alone then reports the failed request.
        self.report_blocks = len(kv_cache_config.kv_cache_groups) == 1
        self.engine_kwargs: dict[str, Any] = {}  # tests: TransferEngine hooks (copy delays)
        self.tiers: list[DiskWorker | RemoteWorker] = []  # disk first, then the shared tier
        # Tier jobs submitted and not finished yet, with the worker running each.
        self.tier_inflight: dict[int, DiskWorker | RemoteWorker] = {}
        self.tier_bytes: dict[str, tuple[int, int]] = {}  # per medium, at the last report
        self.flush_wait_us = 0  # the data plane's host wait for flushes, at the last report

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        nb = int(self.kv_cache_config.num_blocks)
        groups: list[dict[str, torch.Tensor]] = []
        layouts: list[str] = []
        for g, spec_group in enumerate(self.kv_cache_config.kv_cache_groups):
            layers = {n: kv_caches[n] for n in spec_group.layer_names}
            found = {_layout(t, nb, n) for n, t in layers.items()}
            if len(found) != 1:
                raise ConfigError(f"KvOffloadConnector: group {g} mixes KV layouts {found}")
            groups.append(layers)
            layouts.append(found.pop())
        self.xfer = TransferEngine(
            groups,
            blocks_per_chunk=self.cfg.blocks_per_chunk,
            num_slots=self.cfg.resolved_cpu_chunks(),
            layout=layouts,  # type: ignore[arg-type]
            **self.engine_kwargs,
        )
        logger.info(
            "kvoffload: %d KV group(s) registered on %s, CPU pool %.1f MiB (%d slots)",
            len(groups),
            self.xfer.device,
            self.xfer.pool_bytes / 2**20,
            self.xfer.num_slots,
        )
        self.tiers = self._open_tiers(self.xfer)

    def _open_tiers(self, x: TransferEngine) -> list[DiskWorker | RemoteWorker]:
        """This rank's tier workers over ``x``'s pool: the disk tier's, then the shared
        tier's, for those configured.

        Raises:
            ConfigError: A tier value the worker refuses, or a chunk size that differs from
                the scheduler's (the namespaces would differ: nothing would ever be found).
        """
        c = self.cfg
        if c.disk_path is None and c.remote_url is None:
            return []
        for g in range(len(c.groups)):
            rows = x._groups[g].regions
            mine = sum(r.bytes_per_block for r in rows) * c.blocks_per_chunk
            if mine != c.bytes_per_chunk(g):
                raise ConfigError(
                    f"KvOffloadConnector: a chunk of group {g} has {mine} bytes on worker "
                    f"{self.rank}, the scheduler's has {c.bytes_per_chunk(g)}: the lower tier "
                    "needs equal sizes"
                )
        sizes = [grp.block_size for grp in c.groups]
        where = {"rank": self.rank, "world_size": c.num_workers}
        out: list[DiskWorker | RemoteWorker] = []
        try:
            if c.disk_path is not None:
                out.append(
                    tier_worker(
                        DiskWorker,
                        x,
                        sizes,
                        os.fspath(c.disk_path),
                        c.disk_bytes,
                        model=c.disk_model,
                        io_cpus=c.io_cpus,
                        **where,
                    )
                )
            if c.remote_url is not None:
                out.append(
                    tier_worker(
                        RemoteWorker,
                        x,
                        sizes,
                        c.remote_url,
                        model=c.remote_model,
                        cache_salt=c.cache_salt,
                        deadline_ms=c.remote_deadline_ms,
                        io_cpus=c.io_cpus,
                        **where,
                    )
                )
        except BaseException as e:
            for w in out:
                w.close()
            if isinstance(e, (TypeError, OverflowError)):  # a value of the wrong type or range
                raise ConfigError(f"KvOffloadConnector lower tier: {e}") from e
            raise
        return out

    def before_forward(self, meta: KvOffloadMetadata) -> None:
        """The data plane's step for this plan, once per plan: one
        :meth:`TransferEngine.step_packed` submits the previous step's stores, completes the
        flush set (submitting a flushed store of this same plan first), submits the loads and
        queues this step's stores."""
        if self.before_done is meta:
            return
        self.before_done = meta
        x = self.xfer
        assert x is not None
        self.cancelled.update(j for j in meta.cancelled if j in self.load_req)
        for job, rid in zip(meta.load_jobs, meta.load_reqs, strict=True):
            self.load_req[job] = (rid, meta)
        if meta.tier_flush:
            # A reset freed the CPU slots of these tier jobs: nothing new may touch them first.
            for w in self.tiers:
                wait = [j for j in meta.tier_flush if self.tier_inflight.get(j) is w]
                if wait:
                    self._tier_done(w.wait(wait))
        x.step_packed(meta.load_jobs, meta.store_jobs, meta.flush, meta.runs)
        if self.tiers and meta.tier_jobs:
            if meta.flush and x.device.type == "cuda":
                # The flushed copies may still run on the copy stream (the step made the
                # compute stream wait, not the host): a tier job must not race them.
                x.wait(meta.flush)
            for w in self.tiers:
                self.tier_inflight.update(dict.fromkeys(w.submit_packed(meta.tier_jobs), w))

    def start_load(self, meta: KvOffloadMetadata) -> None:
        self.before_forward(meta)

    def wait_for_save(self, meta: KvOffloadMetadata) -> None:
        # The step queued this plan's stores (they start at the next step); a plan whose step
        # has not run yet (no forward pass this step) runs it now.
        self.before_forward(meta)

    def transfer_results(self) -> KVConnectorTransferResults:
        x = self.xfer
        out = KVConnectorTransferResults()
        if x is None:
            return out
        m = self.meta
        for r in x.poll():
            ok = r.ok and r.job_id not in self.cancelled
            self.cancelled.discard(r.job_id)
            (m.done if ok else m.failed).setdefault(self.rank, []).append(r.job_id)
            if r.kind == "load":
                m.bytes_loaded += r.bytes
                m.load_seconds += r.seconds
                m.load_sizes.append(r.bytes)
                m.load_times.append(r.seconds)
                rid, plan = self.load_req.pop(r.job_id, ("", None))
                if rid:
                    out.finished_recving.add(rid)
                    if not ok:
                        out.failed_recving.add(rid)
                        if self.report_blocks and plan is not None:
                            self.invalid.update(plan.gpu_blocks(r.job_id))
            else:
                m.bytes_stored += r.bytes
                m.store_seconds += r.seconds
                m.store_sizes.append(r.bytes)
                m.store_times.append(r.seconds)
            if not r.ok:
                logger.warning("kvoffload: %s job %d failed: %s", r.kind, r.job_id, r.error)
        return out

    def _tier_done(self, done: list[tuple[int, bool]]) -> None:
        """Reports finished tier jobs like copies (by rank, finished or failed)."""
        m = self.meta
        for job, ok in done:
            self.tier_inflight.pop(job, None)
            (m.done if ok else m.failed).setdefault(self.rank, []).append(job)
            if not ok:
                logger.warning("kvoffload: tier job %d failed (the request recomputes)", job)

    def _tier_poll(self) -> None:
        """Collects finished tier jobs and each tier's bytes since the last poll."""
        busy = set(self.tier_inflight.values())
        for w in self.tiers:
            if w in busy:
                self._tier_done(w.poll())
            st = w.stats()
            rows = st if isinstance(st, list) else [st]
            now = (
                sum(r.get("bytes_written", 0) for r in rows),
                sum(r.get("bytes_read", 0) for r in rows),
            )
            m = w.medium
            last = self.tier_bytes.get(m, (0, 0))
            if now != last:
                seen = self.meta.tier_bytes.get(m, (0, 0))
                self.meta.tier_bytes[m] = (
                    seen[0] + now[0] - last[0],
                    seen[1] + now[1] - last[1],
                )
                self.tier_bytes[m] = now

    def take_invalid(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out

    def take_meta(self) -> KvOffloadWorkerMetadata | None:
        self._tier_poll()
        m = self.meta
        if m.done or m.failed:
            # The host's wait for flushes since the last report (a flushed job finished).
            x = self.xfer
            waited = x.flush_wait_us if x is not None else self.flush_wait_us
            if waited != self.flush_wait_us:
                m.flush_seconds += (waited - self.flush_wait_us) / 1e6
                self.flush_wait_us = waited
        elif not m.tier_bytes:
            return None
        self.meta = KvOffloadWorkerMetadata()
        return m

    def shutdown(self) -> None:
        for w in self.tiers:
            w.close()  # its queued jobs finish first: they read the pool
        self.tiers = []
        if self.xfer is not None:
            self.xfer.shutdown(wait=False)
            self.xfer = None


# ----------------------------------------------------------------------------- the connector
