"""vLLM and torch emit deprecation warnings on import; the suite turns warnings into errors.

Import them once here with warnings ignored, so the test modules find them imported.
"""

import importlib
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _name in (
        "torch",
        "torch._dynamo",
        "torch._inductor.compile_fx",
        "vllm",
        "vllm.config",
        "vllm.v1.core.sched.scheduler",
        "vllm.v1.core.sched.async_scheduler",
        "vllm.v1.structured_output",
        "kvoffload.integrations.vllm",
    ):
        try:
            importlib.import_module(_name)
        except ImportError:  # pragma: no cover - vllm absent: the tests skip
            break


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    config.addinivalue_line(
        "markers",
        "ab_harness: runs of benches/vllm_ab.py (make bench-vllm runs them, make test-vllm not)",
    )
