"""The arguments of a :class:`~kvoffload.transfer.TransferEngine`, checked before anything is
allocated: sizes, layouts, pinning, copy threads, test hooks, and the pool's size against this
machine's memory. Each bad value raises :class:`~kvoffload.errors.ConfigError` (or
:class:`~kvoffload.errors.RegistrationError` for ``kv_caches`` that are not a sequence of
groups) naming the argument and the value.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvoffload.errors import ConfigError, RegistrationError
from kvoffload.transfer.execute import _Hooks
from kvoffload.transfer.ids import _index
from kvoffload.transfer.layout import Layout


@dataclass(frozen=True, slots=True)
class _Options:
    """A TransferEngine's checked arguments (the pool's size needs the parsed tensors too)."""

    blocks_per_chunk: int
    layouts: list[Layout]
    pin_memory: bool | None
    parts: int
    hooks: _Hooks


def _size(x: object, name: str, *, minimum: int = 1) -> int:
    """A size argument: an integer (not a bool) >= ``minimum``; raises ConfigError naming it."""
    v = _index(x, name, ConfigError)
    if v < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {v}")
    return v


def _options(
    kv_caches: object,
    *,
    blocks_per_chunk: object,
    num_slots: object,
    cpu_bytes: object,
    layout: object,
    pin_memory: object,
    cpu_copy_threads: object,
    copy_delay_s: object,
    before_copy: Callable[[int, int], None] | None,
    fault_injector: Callable[[int], None] | None,
) -> _Options:
    """Check every argument that does not need the tensors parsed (see ``TransferEngine``)."""
    bpc = _size(blocks_per_chunk, "blocks_per_chunk")
    if (num_slots is None) == (cpu_bytes is None):
        raise ConfigError("give exactly one of num_slots and cpu_bytes")
    if isinstance(kv_caches, (torch.Tensor, Mapping)) or not isinstance(kv_caches, Sequence):
        raise RegistrationError(
            "kv_caches must be a sequence of KV groups (e.g. [{'layer0': (k, v)}]), got "
            f"{type(kv_caches).__name__}"
        )
    if len(kv_caches) == 0:
        raise RegistrationError("kv_caches is empty: register at least one KV group")
    parts = _size(
        torch.get_num_threads() if cpu_copy_threads is None else cpu_copy_threads,
        "cpu_copy_threads",
    )
    if isinstance(layout, str):
        given: list[object] = [layout] * len(kv_caches)
    elif isinstance(layout, Sequence):
        given = list(layout)
    else:
        raise ConfigError(f"layout must be a string or a sequence of them, got {layout!r}")
    if len(given) != len(kv_caches):
        raise ConfigError(f"{len(given)} layouts given for {len(kv_caches)} KV groups")
    layouts: list[Layout] = []
    for lay in given:
        if lay == "blocks_first" or lay == "kv_first":
            layouts.append(lay)
        else:
            raise ConfigError(f"layout must be 'blocks_first' or 'kv_first', got {lay!r}")
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise ConfigError(f"pin_memory must be None, True or False, got {pin_memory!r}")
    delay = copy_delay_s
    if isinstance(delay, bool) or not isinstance(delay, (int, float)):
        raise ConfigError(f"_copy_delay_s must be a number of seconds, got {delay!r}")
    if not 0.0 <= delay <= 3600.0:  # also rejects nan and inf
        raise ConfigError(f"_copy_delay_s must be in [0, 3600] seconds, got {delay!r}")
    for name, hook in (("_before_copy", before_copy), ("_fault_injector", fault_injector)):
        if hook is not None and not callable(hook):
            raise ConfigError(f"{name} must be callable or None, got {hook!r}")
    hooks = _Hooks(float(delay), before_copy, fault_injector)
    return _Options(bpc, layouts, pin_memory, parts, hooks)


def _pool_slots(slot_bytes: list[int], num_slots: object, cpu_bytes: object) -> tuple[int, str]:
    """Slots per group from ``num_slots`` or the ``cpu_bytes`` budget (one of them is given),
    and how to name the choice in errors."""
    if num_slots is not None:
        slots = _size(num_slots, "num_slots")
        return slots, f"num_slots={slots}"
    budget = _size(cpu_bytes, "cpu_bytes")
    slots = budget // sum(slot_bytes)
    if slots < 1:
        raise ConfigError(
            f"cpu_bytes={budget} is less than one slot in every group ({sum(slot_bytes)} bytes)"
        )
    return slots, f"cpu_bytes={budget}"


def _memory_bytes() -> int | None:
    """Physical memory of this machine, if the OS tells."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return None


def _check_memory(what: str, total: int) -> None:
    """Refuse a pool of ``total`` bytes larger than this machine's memory."""
    memory = _memory_bytes()
    if memory is not None and total > memory:
        raise ConfigError(
            f"{what}: the CPU pool would take {total} bytes, more than this machine's "
            f"{memory} bytes of memory"
        )
