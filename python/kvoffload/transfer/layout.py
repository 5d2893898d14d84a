"""Registration of the engine's KV tensors and the layout of the CPU pool.

The engine hands over its KV cache tensors per KV group and per layer. A layer is one tensor or
a tuple of tensors (K and V separate). Each tensor has one of two layouts:

* ``"blocks_first"``: ``[num_blocks, ...]``. K and V may be separate tensors or joined in one
  (``[num_blocks, 2, ...]``): either way the bytes of one block are one dense range.
* ``"kv_first"``: ``[2, num_blocks, ...]``, the layout of vLLM's FlashAttention backend. K and V
  are split into two block-first views.

Inner dimensions may be permuted (vLLM's ``kv_cache_stride_order``) as long as the bytes of one
block form one dense range; the data plane copies raw bytes (``uint8``), so every dtype works,
fp8 included. Shapes, dtypes and devices are validated up front (:class:`RegistrationError`).

**The CPU pool is tensor-major** (a deliberate departure from DESIGN.md §6; the reason is in
``docs/design-notes.md``): per KV group it is ``[num_tensors, num_slots * blocks_per_chunk,
bytes_per_block]``, one region per registered (block-first) tensor, and slot ``s`` is the block
positions ``[s * bpc, (s + 1) * bpc)`` in every region. Consecutive slots are consecutive in
memory per tensor, so a job whose GPU blocks and CPU positions both form a run is ONE copy per
tensor per run, even across slot boundaries. CPU positions are addressed as
``slot * bpc + offset_in_chunk``, so a store may start in the middle of a chunk. Each group has
its own regions and its own position space; all groups get the same number of slots, in one
allocation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch

from kvoffload.errors import (
    RegistrationError,
)

Layout: TypeAlias = Literal["blocks_first", "kv_first"]
"""Layout of a registered tensor: ``[num_blocks, ...]`` or ``[2, num_blocks, ...]``."""
LayerCache: TypeAlias = torch.Tensor | Sequence[torch.Tensor]
"""One layer's KV cache: one tensor (joined K/V or a single latent) or several (K, V)."""
GroupCaches: TypeAlias = Mapping[str, LayerCache] | Sequence[LayerCache]
"""One KV group's layers, by name (a mapping, as vLLM registers them) or by position."""


_GROUP_ALIGN = 4096
"""Each group's regions start on this byte boundary in the pool allocation."""


@dataclass(frozen=True, slots=True)
class _Region:
    """One registered block-first tensor and its CPU region, both as ``[n, bytes_per_block]``."""

    name: str
    gpu: torch.Tensor
    cpu: torch.Tensor
    bytes_per_block: int


@dataclass(frozen=True, slots=True)
class _Group:
    """A KV group: its regions, GPU block count and CPU position count."""

    regions: tuple[_Region, ...]
    num_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int
    dtype: torch.dtype


def _block_rows(x: torch.Tensor, where: str) -> torch.Tensor:
    """View a block-first tensor ``[num_blocks, ...]`` as bytes ``[num_blocks, bytes_per_block]``.

    Args:
        x: The tensor, blocks on dimension 0.
        where: Names the tensor in error messages.

    Returns:
        A ``uint8`` view sharing ``x``'s memory, row ``b`` holding the bytes of block ``b``.

    Raises:
        RegistrationError: One block's bytes are not one dense range, or blocks overlap.
    """
    if x.dim() == 1:
        x = x.unsqueeze(1)
    num_blocks = x.size(0)
    inner = [(x.stride(d), x.size(d)) for d in range(1, x.dim()) if x.size(d) != 1]
    inner.sort(reverse=True)  # memory order, so permuted (stride-ordered) layouts are accepted
    expected = 1
    for stride, size in reversed(inner):
        if stride != expected:
            raise RegistrationError(
                f"{where}: the bytes of one block are not one dense range (shape "
                f"{tuple(x.shape)}, strides {x.stride()}); register K/V-first tensors "
                f"[2, num_blocks, ...] with layout='kv_first'"
            )
        expected *= size
    itemsize = x.element_size()
    bytes_per_block = expected * itemsize
    block_stride = x.stride(0) * itemsize
    if bytes_per_block == 0:
        raise RegistrationError(f"{where}: blocks are empty (shape {tuple(x.shape)})")
    if num_blocks > 1 and block_stride < bytes_per_block:
        raise RegistrationError(
            f"{where}: blocks overlap: block stride {block_stride} bytes < "
            f"{bytes_per_block} bytes per block (shape {tuple(x.shape)}, strides {x.stride()})"
        )
    storage = torch.empty(0, dtype=torch.uint8, device=x.device).set_(x.untyped_storage())
    return storage.as_strided(
        (num_blocks, bytes_per_block), (block_stride, 1), x.storage_offset() * itemsize
    )


def _layer_items(group: GroupCaches) -> list[tuple[str, LayerCache]]:
    """``(name, layer)`` pairs of a group given as a mapping or a sequence."""
    if isinstance(group, Mapping):
        return [(str(k), v) for k, v in group.items()]
    if isinstance(group, torch.Tensor) or not isinstance(group, Sequence):
        raise RegistrationError(
            "kv_caches must be a sequence of KV groups, each a mapping name -> layer or a "
            f"sequence of layers; got a group of type {type(group).__name__}"
        )
    return [(f"layer {i}", layer) for i, layer in enumerate(group)]


_Parsed = list[tuple[list[tuple[str, torch.Tensor]], int, torch.dtype]]
"""Per group: its ``(name, byte rows)`` regions, num_blocks and dtype."""


def _parse_kv_caches(
    kv_caches: Sequence[GroupCaches], layouts: Sequence[Layout]
) -> tuple[torch.device, _Parsed]:
    """Validate the registered tensors and view each as byte rows ``[num_blocks, bpb]``.

    Raises:
        RegistrationError: The first problem found, naming group, layer, tensor and value.
    """
    device: torch.device | None = None
    device_where = ""
    parsed: _Parsed = []
    for gi, (group, lay) in enumerate(zip(kv_caches, layouts, strict=True)):
        rows: list[tuple[str, torch.Tensor]] = []
        num_blocks: int | None = None
        dtype: torch.dtype | None = None
        first_where = ""
        items = _layer_items(group)
        if not items:
            raise RegistrationError(f"group {gi} has no layers")
        for lname, layer in items:
            if isinstance(layer, torch.Tensor):
                tensors = [(f"group {gi} {lname}", layer)]
            elif (
                isinstance(layer, Sequence)
                and layer
                and all(isinstance(t, torch.Tensor) for t in layer)
            ):
                names = ("k", "v") if len(layer) == 2 else tuple(map(str, range(len(layer))))
                tensors = [
                    (f"group {gi} {lname} [{n}]", t) for n, t in zip(names, layer, strict=True)
                ]
            else:
                raise RegistrationError(
                    f"group {gi} {lname}: a layer must be a tensor or a non-empty tuple of "
                    f"tensors, got {type(layer).__name__}"
                )
            for where, t in tensors:
                if t.layout != torch.strided:
                    raise RegistrationError(f"{where}: unsupported tensor layout {t.layout}")
                if t.device.type not in ("cpu", "cuda"):
                    raise RegistrationError(
                        f"{where}: unsupported device {t.device} (expected cpu or cuda)"
                    )
                if device is None:
                    device, device_where = t.device, where
                elif t.device != device:
                    raise RegistrationError(
                        f"{where} is on {t.device}, but {device_where} is on {device}: "
                        "one engine serves one device"
                    )
                if dtype is None:
                    dtype = t.dtype
                    first_where = where
                elif t.dtype != dtype:
                    raise RegistrationError(
                        f"{where} has dtype {t.dtype}, but {first_where} has {dtype}: "
                        "all tensors of a KV group share one dtype"
                    )
                t = t.detach()
                if lay == "kv_first":
                    if t.dim() < 2 or t.size(0) != 2:
                        raise RegistrationError(
                            f"{where}: layout 'kv_first' needs shape [2, num_blocks, ...], "
                            f"got {tuple(t.shape)}"
                        )
                    views = [(f"{where} k", t[0]), (f"{where} v", t[1])]
                else:
                    if t.dim() < 1:
                        raise RegistrationError(f"{where}: a 0-d tensor has no blocks")
                    views = [(where, t)]
                for vwhere, v in views:
                    nb = v.size(0)
                    if nb < 1:
                        raise RegistrationError(f"{vwhere}: num_blocks is 0")
                    if num_blocks is None:
                        num_blocks = nb
                    elif nb != num_blocks:
                        raise RegistrationError(
                            f"{vwhere} has num_blocks={nb}, but the first tensor of group "
                            f"{gi} ({first_where}) has {num_blocks}: all tensors of a KV "
                            "group share one block table"
                        )
                    rows.append((vwhere, _block_rows(v, vwhere)))
        assert num_blocks is not None
        assert dtype is not None
        parsed.append((rows, num_blocks, dtype))
    assert device is not None
    return device, parsed


def _pool_offsets(slot_bytes: Sequence[int], slots: int) -> tuple[list[int], int]:
    """Where each group's regions start in the one pool allocation, and its total size.

    Per group its regions lie back to back (``slots`` slots of ``slot_bytes[g]`` bytes in
    all); each group starts on a ``_GROUP_ALIGN`` boundary.
    """
    offsets: list[int] = []
    total = 0
    for sb in slot_bytes:
        total = -(-total // _GROUP_ALIGN) * _GROUP_ALIGN
        offsets.append(total)
        total += slots * sb
    return offsets, total


def _carve_pool(
    parsed: _Parsed, pool: torch.Tensor, offsets: Sequence[int], n_cpu: int
) -> list[_Group]:
    """The groups: each registered tensor's byte rows paired with its CPU region in ``pool``.

    Group ``g``'s regions are ``[n_cpu, bytes_per_block]`` views of ``pool`` from
    ``offsets[g]`` on, one per tensor, back to back (the tensor-major layout).
    """
    groups: list[_Group] = []
    for (rows, nb, dtype), start in zip(parsed, offsets, strict=True):
        regions: list[_Region] = []
        pos = start
        for where, gpu in rows:
            bpb = gpu.size(1)
            cpu = pool[pos : pos + n_cpu * bpb].view(n_cpu, bpb)
            pos += n_cpu * bpb
            regions.append(_Region(name=where, gpu=gpu, cpu=cpu, bytes_per_block=bpb))
        groups.append(
            _Group(
                regions=tuple(regions),
                num_blocks=nb,
                num_cpu_blocks=n_cpu,
                bytes_per_block=sum(r.bytes_per_block for r in regions),
                dtype=dtype,
            )
        )
    return groups
