"""Engine adapters. Each submodule imports its engine lazily; importing this package is free.

* :mod:`kvoffload.integrations.vllm`: a vLLM v1 KV connector (``KvOffloadConnector``).
"""

__all__: list[str] = []
