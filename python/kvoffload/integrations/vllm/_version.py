"""The vLLM versions the connector supports, checked when the package is imported (before any
other vLLM import of the connector's modules)."""

from __future__ import annotations

SUPPORTED_VLLM = ">=0.32.0,<0.33"
"""vLLM versions this connector is tested with."""


def installed_vllm_version() -> str:
    """The installed vLLM's version string (ImportError without vLLM)."""
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - the connector is loaded by vLLM
        raise ImportError(f"kvoffload.integrations.vllm needs vLLM {SUPPORTED_VLLM}: {e}") from e
    return str(getattr(vllm, "__version__", "0"))


def check_vllm_version(raw: str) -> str:
    """Returns ``raw`` if that vLLM version is supported, else raises ImportError naming the
    supported range."""
    base = raw.split("+")[0]
    parts = []
    for p in base.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    if not ((0, 32, 0) <= tuple(parts) < (0, 33, 0)):
        raise ImportError(
            f"kvoffload.integrations.vllm supports vLLM {SUPPORTED_VLLM}, but vLLM {raw} is "
            "installed: install a supported vLLM or a kvoffload release that supports yours"
        )
    return raw


VLLM_VERSION = check_vllm_version(installed_vllm_version())
