"""Every option of the scheduler is spelled once, as an :class:`OffloadConfig` field (name,
default, documentation): the core takes exactly these keywords (its runtime signature and the
hand-written stub ``_core.pyi`` list them, with the same defaults, and it reads each one), and
the simulator's and the CLI's defaults for them are the fields'. Adding an option in one place
and forgetting another fails here."""

from __future__ import annotations

import ast
import inspect
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

import kvoffload
from kvoffload._core import Scheduler
from kvoffload.cli import build_parser
from kvoffload.errors import ConfigError
from kvoffload.scheduler import OPTION_DEFAULTS, KvGroup, OffloadConfig
from kvoffload.sim import SimConfig

FIELDS = [(f.name, f.default) for f in fields(OffloadConfig)]
"""OffloadConfig's fields in order, the required ones with ``MISSING``."""
STUB = Path(kvoffload.__file__).parent / "_core.pyi"
UNSIZED = {"cpu_chunks", "disk_bytes"}
"""Sizes the scheduler has no default for (None: not given); a simulated run needs one."""
BASE = OffloadConfig(groups=(KvGroup(16, None, 1024),), num_gpu_blocks=64, cpu_chunks=8)


def _stub_signature(method: str) -> list[tuple[str, Any]]:
    """``Scheduler.<method>``'s parameters in the stub: ``(name, default or MISSING)``."""
    tree = ast.parse(STUB.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    a = fn.args
    positional = [p.arg for p in a.args if p.arg != "cls"]
    out: list[tuple[str, Any]] = [(name, MISSING) for name in positional]
    for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append((p.arg, MISSING if d is None else ast.literal_eval(d)))
    return out


def _runtime_signature(obj: object) -> list[tuple[str, Any]]:
    """The core's signature as Python sees it (``__text_signature__``)."""
    params = inspect.signature(obj).parameters.values()  # type: ignore[arg-type]
    return [(p.name, MISSING if p.default is p.empty else p.default) for p in params]


@pytest.mark.parametrize("method", ["__new__", "check_config"])
def test_the_stub_lists_the_fields_with_their_defaults(method: str) -> None:
    assert _stub_signature(method) == FIELDS


@pytest.mark.parametrize("obj", [Scheduler, Scheduler.check_config])
def test_the_core_signature_lists_the_fields_with_their_defaults(obj: object) -> None:
    assert _runtime_signature(obj) == FIELDS


def test_the_cores_own_defaults_are_the_fields() -> None:
    """What a direct caller of the core gets for an omitted keyword."""
    assert Scheduler.defaults() == OPTION_DEFAULTS


def test_the_core_reads_every_field() -> None:
    """Each keyword reaches the core's checks (a value of no possible type names it) and the
    fields as given are a configuration it accepts; an unknown keyword is refused."""
    kwargs = BASE._core_kwargs()
    assert list(kwargs) == [name for name, _ in FIELDS]
    Scheduler.check_config(**kwargs)
    for name, _ in FIELDS:
        with pytest.raises(ConfigError, match=name):
            Scheduler.check_config(**{**kwargs, name: object()})
    with pytest.raises(TypeError, match="disk_sise"):
        Scheduler.check_config(**kwargs, disk_sise=1)


def test_every_field_is_documented() -> None:
    doc = inspect.getdoc(OffloadConfig) or ""
    attributes = doc.split("Attributes:")[1]
    documented = [line.strip().split(":")[0] for line in attributes.splitlines()]
    assert [name for name, _ in FIELDS if name not in documented] == []


def test_option_defaults_are_the_fields() -> None:
    assert dict(OPTION_DEFAULTS) == {n: d for n, d in FIELDS if d is not MISSING}


def test_the_simulators_defaults_are_the_fields() -> None:
    sim = {f.name: f.default for f in fields(SimConfig) if f.name in OPTION_DEFAULTS}
    assert {"policy", "disk_deadline_ms", "tier_write_share", "io_cpus"} <= set(sim)
    assert {n: d for n, d in sim.items() if n not in UNSIZED} == {
        n: OPTION_DEFAULTS[n] for n in sim if n not in UNSIZED
    }
    assert SimConfig().offload_config().disk_bytes is None  # no disk tier, no size


def test_the_clis_defaults_are_the_fields() -> None:
    given = vars(build_parser().parse_args(["simulate"]))
    cli = {n: v for n, v in given.items() if n in OPTION_DEFAULTS and n not in UNSIZED}
    assert {"policy", "disk_probation_after", "tier_write_share", "remote_url"} <= set(cli)
    assert cli == {n: OPTION_DEFAULTS[n] for n in cli}


def test_check_config_checks_the_tiers_options_without_opening_them(tmp_path: Path) -> None:
    """What the simulator and the vLLM adapter check up front: the tiers' values, the form of
    the shared tier's URL too, with nothing created or connected."""
    kwargs = BASE._core_kwargs()
    never = tmp_path / "never"
    Scheduler.check_config(**{**kwargs, "disk_path": never, "disk_bytes": 1 << 20})
    Scheduler.check_config(**{**kwargs, "remote_url": "redis://127.0.0.1:1"})
    assert not never.exists()
    with pytest.raises(ConfigError, match="remote_url"):
        Scheduler.check_config(**{**kwargs, "remote_url": "http://127.0.0.1:1"})
    with pytest.raises(ConfigError, match="disk_write_mbps"):
        Scheduler.check_config(**{**kwargs, "disk_write_mbps": -1.0})
