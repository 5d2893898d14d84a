"""Builds a revision of this repository and installs its whole package as ``DIR/kvbase``
(``kvoffload`` renamed ``kvbase`` in its Python sources): the other build of
``benches/ab/vllm_ab.py``'s whole-package mode (its connector and its core), and through
``DIR/kvbase/_core*.so`` of the core-only harnesses (``schedule_batch_ab.py``,
``request_calls_ab.py``). Run from the checkout, in ``.venv-vllm`` (its maturin); the build
reuses this checkout's ``target/``::

    .venv-vllm/bin/python benches/ab/ab_prepare.py HEAD~1 /tmp/base
    .venv-vllm/bin/python benches/ab/vllm_ab.py /tmp/base --rounds 4
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def install_package(package: Path, into: Path) -> Path:
    """Copies the ``kvoffload`` package directory ``package`` to ``into/kvbase``, renaming
    the package in its Python sources; returns the new directory."""
    dest = into / "kvbase"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(package, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for py in dest.rglob("*.py"):
        py.write_text(re.sub(r"\bkvoffload\b", "kvbase", py.read_text()))
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("rev", help="the revision to build (any git revision)")
    ap.add_argument("dir", type=Path, help="where kvbase/ goes")
    a = ap.parse_args(argv)
    maturin = Path(sys.executable).with_name("maturin")
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", a.rev],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        wt, dist = Path(tmp) / "wt", Path(tmp) / "dist"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(wt), rev],
            check=True,
        )
        try:
            subprocess.run(
                [str(maturin), "build", "--release", "-q", "-o", str(dist)],
                cwd=wt,
                env={**os.environ, "CARGO_TARGET_DIR": str(ROOT / "target")},
                check=True,
            )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=False
            )
        (wheel,) = dist.glob("*.whl")
        zipfile.ZipFile(wheel).extractall(Path(tmp) / "unpacked")
        dest = install_package(Path(tmp) / "unpacked" / "kvoffload", a.dir)
    print(f"{dest}: {rev}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
