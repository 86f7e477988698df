"""The README's and docs/' Python examples run, and the README's test command is what CI runs."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCUMENTS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("**/*.md"))]
BLOCKS = [
    pytest.param(name, block, id=f"{name}-{index}")
    for name in DOCUMENTS
    for index, block in enumerate(re.findall(r"```python\n(.*?)```", (ROOT / name).read_text(), re.S))
]


@pytest.mark.parametrize("name, block", BLOCKS)
def test_python_examples_run(name: str, block: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, scratch_registry) -> None:
    """Every Python block of the README and docs/ runs on its own, from any folder (it loads
    nothing outside the installed package). Examples may register plugins: they do so in a
    scratch registry."""
    module = types.ModuleType("readme_example")  # dataclasses look their module up in sys.modules
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.chdir(tmp_path)  # not the checkout: an example must not read a file beside it
    exec(compile(block, name, "exec"), module.__dict__)


def quick_start_commands() -> list[str]:
    """The commands of the README's quick-start block (comments dropped)."""
    section = README.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def ci_lines() -> list[str]:
    """The lines of ``.ci/run`` that run (comments dropped)."""
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.lstrip().startswith("#")]


def test_the_quick_start_is_two_commands_and_ci_runs_the_second() -> None:
    assert quick_start_commands() == ["python3 quickstart.py compare", "python3 quickstart.py test"]
    assert f"if ! {quick_start_commands()[1]} --strict-skips; then" in ci_lines()


def test_ci_runs_in_a_clone_with_nothing_beside_it() -> None:
    """Before its first step, CI clones the checkout into a fresh temporary folder and moves there."""
    lines = ci_lines()
    first_step = next(i for i, line in enumerate(lines) if "quickstart.py" in line)
    assert (
        lines.index("scratch=$(mktemp -d)")
        < lines.index('git clone -q . "$scratch/kvlib"')
        < lines.index('cd "$scratch/kvlib"')
        < first_step
    )
