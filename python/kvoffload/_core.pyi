"""Type stubs for the Rust extension ``kvoffload._core`` (checked by ``mypy.stubtest``)."""

import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Protocol, SupportsIndex, TypeAlias, final

from typing_extensions import disjoint_base

_Key: TypeAlias = SupportsIndex | bytes
_KeyState: TypeAlias = Literal["absent", "storing", "ready"]
_PoolEvent: TypeAlias = tuple[Literal["stored", "removed"], list[int], Literal["cpu"]]

class _EngineBlock(Protocol):
    """An engine's block object (vLLM's ``KVCacheBlock``): its id is read from ``block_id``."""

    @property
    def block_id(self) -> int: ...

__all__ = [
    "RUN_WORDS",
    "TIER_ROW_WORDS",
    "CompletedJob",
    "CompletionError",
    "ConfigError",
    "Copier",
    "DiskWorker",
    "DuplicateReportError",
    "InternalError",
    "InvalidBlockError",
    "InvalidKeyError",
    "InvalidRequestError",
    "KeyStateError",
    "KvOffloadError",
    "RemoteClient",
    "RemoteWorker",
    "RequestStateError",
    "Scheduler",
    "StepInputError",
    "StepPlan",
    "TierIOError",
    "TierInUseError",
    "TierPathError",
    "TierWorker",
    "TransferJob",
    "UnknownJobError",
    "UnknownKeyError",
    "UnknownRequestError",
    "_CpuPool",
    "_JobTracker",
    "_StorePlan",
    "__version__",
    "check_io_cpus",
    "check_runs",
    "disk_inspect",
    "namespace_digest",
]

__version__: str
RUN_WORDS: int
"""Words (``uint32``) per row of a packed runs buffer: job index, group, GPU start, CPU start,
length."""
TIER_ROW_WORDS: int
"""Words (``uint64``) per row of packed tier jobs: job id, kind | medium << 8, group, key low,
key high, CPU slot, place, generation."""

@final
class Copier:
    """Bounded copies between registered KV-tensor storages and CPU-pool regions."""

    def __new__(
        cls,
        buffers: list[Any],
        groups: list[tuple[int, int, list[tuple[int, int, int, int, int, int, int]]]],
    ) -> Copier: ...
    def copy(
        self,
        store: bool,
        runs: list[tuple[int, int | None, list[int], list[int], list[int]]],
        threads: int = 1,
    ) -> int: ...
    def copy_packed(
        self,
        store: bool,
        runs: bytes,
        start: int,
        end: int,
        threads: int = 1,
        region: int | None = None,
    ) -> int: ...
    def layout(self) -> list[tuple[int, int, int]]: ...

def check_runs(
    runs: bytes, jobs: int, loads: int, groups: list[tuple[int, int, int, int]]
) -> list[tuple[int, int, int, int]]: ...
def namespace_digest(
    *,
    model: str,
    dtype: str,
    tensor_shapes: Sequence[Sequence[int]],
    block_size: int,
    blocks_per_chunk: int,
    rank: int = 0,
    world_size: int = 1,
    group: int = 0,
    cache_salt: str = ...,
) -> int: ...

@final
class RemoteClient:
    """A client of the shared (Redis) tier: pipelined batches, deadlines, probation."""

    def __new__(
        cls,
        url: str,
        *,
        deadline_ms: float = 1000.0,
        connections: int | None = None,
        part_bytes: int = ...,
        probation_after: int = 3,
        probation_ms: float = 2000.0,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> RemoteClient: ...
    @property
    def url(self) -> str: ...
    @property
    def on_probation(self) -> bool: ...
    def write(
        self, namespace: int, keys: Iterable[_Key], data: Any, group: int = 0
    ) -> list[bool]: ...
    def read(
        self, namespace: int, keys: Iterable[_Key], out: Any, group: int = 0
    ) -> list[Literal["hit", "miss", "corrupt", "failed"]]: ...
    def exists(self, namespace: int, keys: Iterable[_Key]) -> list[bool] | None: ...
    def stats(self) -> dict[str, int]: ...
    def node_stats(self) -> dict[str, dict[str, int]]: ...

class KvOffloadError(Exception): ...
class ConfigError(KvOffloadError): ...
class UnknownJobError(KvOffloadError): ...
class CompletionError(KvOffloadError): ...
class DuplicateReportError(CompletionError): ...
class InvalidBlockError(KvOffloadError): ...
class InvalidRequestError(KvOffloadError): ...
class RequestStateError(KvOffloadError): ...
class UnknownKeyError(KvOffloadError): ...
class KeyStateError(KvOffloadError): ...
class InvalidKeyError(KvOffloadError): ...
class UnknownRequestError(KvOffloadError): ...
class StepInputError(KvOffloadError): ...
class InternalError(KvOffloadError): ...
class TierIOError(KvOffloadError): ...
class TierInUseError(KvOffloadError): ...
class TierPathError(ConfigError): ...

@final
class _JobTracker:
    """Job table + fence index with eager and deferred lifecycle classes."""

    def __new__(cls, num_blocks: int, num_workers: int = 1) -> _JobTracker: ...
    def create_store(
        self,
        owner: SupportsIndex,
        eager: Iterable[SupportsIndex] | None = None,
        deferred: Iterable[SupportsIndex] | None = None,
    ) -> int: ...
    def create_load(self, owner: SupportsIndex, blocks: Iterable[SupportsIndex]) -> int: ...
    def release(self, owner: SupportsIndex) -> None: ...
    def reacquire(self, owner: SupportsIndex) -> None: ...
    def forget(self, owner: SupportsIndex) -> None: ...
    def check(self, written: Iterable[SupportsIndex]) -> list[int]: ...
    def complete(
        self, job: int, worker: int = 0, ok: bool = True
    ) -> Literal["pending", "done", "failed", "late"]: ...
    def reset(self) -> list[int]: ...
    def pending_jobs(self) -> list[int]: ...
    def jobs_on(self, block: SupportsIndex) -> list[int]: ...
    def remaining(self, job: int) -> int: ...
    def is_released(self, owner: SupportsIndex) -> bool: ...
    def __len__(self) -> int: ...
    @property
    def armed_pairs(self) -> int: ...
    def stats(self) -> dict[str, int]: ...

@final
class TransferJob:
    """One store or load job of a step plan."""

    @property
    def job_id(self) -> int: ...
    @property
    def kind(self) -> Literal["store", "load"]: ...
    @property
    def request_id(self) -> str: ...
    @property
    def transfers(self) -> list[tuple[int, list[int], list[int]]]: ...
    @property
    def keys(self) -> list[tuple[int, list[int]]]: ...
    @property
    def num_blocks(self) -> int: ...

@final
class StepPlan:
    """What the workers must do this step."""

    @property
    def loads(self) -> list[TransferJob]: ...
    @property
    def stores(self) -> list[TransferJob]: ...
    @property
    def flush(self) -> list[int]: ...
    @property
    def tier_jobs(
        self,
    ) -> list[tuple[int, str, str, int, list[int], list[int], list[int], list[int]]]: ...
    @property
    def tier_flush(self) -> list[int]: ...
    @property
    def runs(self) -> bytes: ...

@final
class CompletedJob:
    """A job whose last worker reported."""

    @property
    def job_id(self) -> int: ...
    @property
    def kind(self) -> Literal["store", "load"]: ...
    @property
    def request_id(self) -> str: ...
    @property
    def ok(self) -> bool: ...
    @property
    def invalid_blocks(self) -> list[int]: ...

@final
class Scheduler:
    """The scheduler core: request tracking, lookups, loads, store planning and the fence."""

    def __new__(
        cls,
        groups: Sequence[tuple[int, int | None, int]],
        *,
        num_gpu_blocks: int,
        blocks_per_chunk: int = 1,
        hash_block_size: int | None = None,
        cpu_chunks: int | None = None,
        cpu_bytes: int | None = None,
        policy: str = "lru",
        num_workers: int = 1,
        max_loading_requests: int = 0,
        offload_prompt_only: bool = False,
        max_offload_tokens: int | None = None,
        store_threshold: int = 0,
        null_block: int | None = 0,
        debug_skip_deferred_arming: bool = False,
        disk_path: str | os.PathLike[str] | None = None,
        disk_bytes: int | None = None,
        disk_model: str = "",
        disk_deadline_ms: float = 5000.0,
        disk_probation_after: int = 3,
        disk_probation_ms: float = 5000.0,
        disk_write_mbps: float = 0.0,
        remote_url: str | None = None,
        remote_model: str = "",
        cache_salt: str = "",
        remote_deadline_ms: float = 1000.0,
        remote_tls_ca: str | os.PathLike[str] | None = None,
        disk_min_hits: int = 0,
        remote_min_hits: int = 0,
        tier_write_share: float = 0.125,
        io_cpus: Iterable[int] | None = None,
    ) -> Scheduler: ...
    @staticmethod
    def check_config(
        groups: Sequence[tuple[int, int | None, int]],
        *,
        num_gpu_blocks: int,
        blocks_per_chunk: int = 1,
        hash_block_size: int | None = None,
        cpu_chunks: int | None = None,
        cpu_bytes: int | None = None,
        policy: str = "lru",
        num_workers: int = 1,
        max_loading_requests: int = 0,
        offload_prompt_only: bool = False,
        max_offload_tokens: int | None = None,
        store_threshold: int = 0,
        null_block: int | None = 0,
        debug_skip_deferred_arming: bool = False,
        disk_path: str | os.PathLike[str] | None = None,
        disk_bytes: int | None = None,
        disk_model: str = "",
        disk_deadline_ms: float = 5000.0,
        disk_probation_after: int = 3,
        disk_probation_ms: float = 5000.0,
        disk_write_mbps: float = 0.0,
        remote_url: str | None = None,
        remote_model: str = "",
        cache_salt: str = "",
        remote_deadline_ms: float = 1000.0,
        remote_tls_ca: str | os.PathLike[str] | None = None,
        disk_min_hits: int = 0,
        remote_min_hits: int = 0,
        tier_write_share: float = 0.125,
        io_cpus: Iterable[int] | None = None,
    ) -> tuple[int, list[int]]: ...
    @staticmethod
    def defaults() -> dict[str, Any]: ...
    def add_request(
        self, request_id: str, prompt_len: int, block_hashes: Iterable[int | bytes]
    ) -> None: ...
    def extend_hashes(self, request_id: str, block_hashes: Iterable[int | bytes]) -> None: ...
    def lookup(self, request_id: str, num_computed_tokens: int) -> int | None: ...
    def allocate(
        self,
        request_id: str,
        block_ids: Iterable[Iterable[SupportsIndex | _EngineBlock]],
        num_computed_tokens: int,
        num_load_tokens: int,
    ) -> int | None: ...
    def schedule(
        self,
        scheduled: Sequence[str] | Sequence[tuple[str, int]],
        computed: Sequence[int] | None = None,
        new_blocks: Sequence[tuple[str, int, Iterable[SupportsIndex]]] | None = None,
        resumed: Sequence[str] | None = None,
        finished: Sequence[str] | None = None,
        aborted: Sequence[str] | None = None,
        preempted: Sequence[str] | None = None,
        written: Iterable[SupportsIndex] | None = None,
    ) -> StepPlan: ...
    def schedule_batch(
        self,
        scheduled: Sequence[str],
        computed: Sequence[int],
        *,
        new: Sequence[tuple[str, int, Sequence[Sequence[SupportsIndex]]]] | None = None,
        added: dict[str, int] | None = None,
        appended: Sequence[Sequence[Sequence[SupportsIndex]] | None] | None = None,
        tables: Sequence[tuple[str, Sequence[Sequence[SupportsIndex]]]] | None = None,
        hashes: dict[str, Sequence[bytes | int]] | None = None,
        finished: Sequence[str] | None = None,
        aborted: Sequence[str] | None = None,
        preempted: Sequence[str] | None = None,
        written: Iterable[SupportsIndex | _EngineBlock] | None = None,
    ) -> tuple[list[int], list[str], list[int], list[int], bytes, bytes, list[int]]: ...
    def sync_request(
        self, request_id: str, prompt_len: int, block_hashes: Sequence[bytes | int]
    ) -> None: ...
    def lookup_request(
        self,
        request_id: str,
        prompt_len: int,
        block_hashes: Sequence[bytes | int],
        num_computed_tokens: int,
    ) -> int | None: ...
    def set_event_limit(self, limit: int) -> None: ...
    def preempt(self, request_id: str) -> None: ...
    def _debug_panic(self) -> None: ...
    def complete(self, job: int, worker: int = 0, ok: bool = True) -> CompletedJob | None: ...
    def complete_many(
        self,
        finished: Iterable[int],
        failed: Iterable[int] | None = None,
        worker: int = 0,
    ) -> list[CompletedJob]: ...
    def complete_counts(
        self,
        finished: Iterable[int],
        failed: Iterable[int] | None = None,
        worker: int = 0,
    ) -> tuple[int, int]: ...
    def reset(self) -> tuple[list[int], list[tuple[str, int]]]: ...
    def take_events(self) -> list[tuple[str, int, list[int], str]]: ...
    def status(self, request_id: str) -> str: ...
    def pending_jobs(self) -> list[int]: ...
    @property
    def num_pending(self) -> int: ...
    @property
    def num_requests(self) -> int: ...
    @property
    def armed_pairs(self) -> int: ...
    @property
    def loading_requests(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def tier_stats(self) -> list[dict[str, Any]]: ...

@final
class _StorePlan:
    """The slots reserved by :meth:`_CpuPool.prepare_store`."""

    @property
    def keys(self) -> list[int]: ...
    @property
    def slots(self) -> list[int]: ...
    @property
    def evicted(self) -> list[int]: ...
    @property
    def filtered(self) -> list[int]: ...

@final
class _CpuPool:
    """The CPU tier's slots: key states, pins, LRU or ARC eviction, stored / removed events."""

    def __new__(
        cls,
        capacity: int,
        policy: str = "lru",
        store_threshold: int = 0,
        max_event_keys: int | None = None,
    ) -> _CpuPool: ...
    @property
    def capacity(self) -> int: ...
    @property
    def max_event_keys(self) -> int: ...
    @property
    def policy(self) -> Literal["lru", "arc"]: ...
    @property
    def store_threshold(self) -> int: ...
    def lookup(self, keys: Iterable[_Key]) -> tuple[int, list[_KeyState]]: ...
    def state(self, key: _Key) -> _KeyState: ...
    def pins(self, key: _Key) -> int: ...
    def slot(self, key: _Key) -> int | None: ...
    def prepare_store(self, keys: Iterable[_Key]) -> _StorePlan | None: ...
    def complete_store(self, keys: Iterable[_Key], ok: bool = True) -> None: ...
    def prepare_load(self, keys: Iterable[_Key]) -> list[int]: ...
    def complete_load(self, keys: Iterable[_Key]) -> None: ...
    def touch(self, keys: Iterable[_Key]) -> None: ...
    def refresh(self, keys: Iterable[_Key]) -> None: ...
    def discard(self, keys: Iterable[_Key]) -> list[int]: ...
    def take_events(
        self,
    ) -> list[tuple[Literal["stored", "removed"], list[int], Literal["cpu"]]]: ...
    def reset(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def order(self) -> dict[str, list[int]]: ...
    def __len__(self) -> int: ...

@disjoint_base
class TierWorker:
    """What ``DiskWorker`` and ``RemoteWorker`` share: tier jobs on Rust threads, straight from
    and into the registered CPU pool."""

    @property
    def medium(self) -> Literal["disk", "remote"]: ...
    @property
    def closed(self) -> bool: ...
    def submit(
        self, jobs: Sequence[tuple[int, str, str, int, list[int], list[int], list[int], list[int]]]
    ) -> None: ...
    def submit_packed(self, jobs: bytes) -> list[int]: ...
    def poll(self) -> list[tuple[int, bool]]: ...
    def wait(self, job_ids: Sequence[int], timeout: float = 60.0) -> list[tuple[int, bool]]: ...
    def close(self) -> None: ...

@final
class DiskWorker(TierWorker):
    """Runs disk tier jobs on Rust threads, straight from and into the registered CPU pool."""

    def __new__(
        cls,
        path: str | os.PathLike[str],
        disk_bytes: int,
        buffers: Sequence[Any],
        groups: Sequence[tuple[int, int, Sequence[tuple[int, int, int, int]]]],
        blocks_per_chunk: int = 1,
        model: str = "",
        rank: int = 0,
        world_size: int = 1,
        threads: int = 2,
        direct: bool = True,
        sync: bool = True,
        io_cpus: Iterable[int] | None = None,
        dtypes: Sequence[str] | None = None,
    ) -> DiskWorker: ...
    def stats(self) -> list[dict[str, Any]]: ...

@final
class RemoteWorker(TierWorker):
    """Runs shared-tier jobs on Rust threads, straight from and into the registered CPU pool."""

    def __new__(
        cls,
        url: str,
        buffers: Sequence[Any],
        groups: Sequence[tuple[int, int, Sequence[tuple[int, int, int, int]]]],
        blocks_per_chunk: int = 1,
        model: str = "",
        cache_salt: str = "",
        rank: int = 0,
        world_size: int = 1,
        threads: int = 2,
        deadline_ms: float = 1000.0,
        io_cpus: Iterable[int] | None = None,
        dtypes: Sequence[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> RemoteWorker: ...
    def stats(self) -> dict[str, int]: ...
    def node_stats(self) -> dict[str, dict[str, int]]: ...

def check_io_cpus(io_cpus: Iterable[int] | None) -> list[int] | None: ...
def disk_inspect(path: str | os.PathLike[str], verify: bool = False) -> list[dict[str, Any]]: ...
