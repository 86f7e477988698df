"""The README's Python examples run, and its test command is what CI runs."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("block", re.findall(r"```python\n(.*?)```", README, re.S))
def test_python_examples_run(block: str, monkeypatch: pytest.MonkeyPatch, scratch_registry) -> None:
    """Examples may register plugins: they do so in a scratch registry."""
    module = types.ModuleType("readme_example")  # dataclasses look their module up in sys.modules
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(block, "README.md", "exec"), module.__dict__)


def test_ci_runs_the_readme_test_command() -> None:
    assert "python -m pytest         # the test suite" in README
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == "python -m pytest"
