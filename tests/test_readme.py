"""The README's example runs as written."""

from __future__ import annotations

import pathlib
import re


def test_readme_example_runs(capsys):
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    exec(compile(code, "README.md", "exec"), {})
    assert "32 tokens loaded" in capsys.readouterr().out
