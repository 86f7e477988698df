"""Packaging: every package folder is installed, under the kvlib namespace only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
MAPPED = {"kvlib": "kvlib", "kvlib.policies": "policies", "kvlib.storage": "storage", "kvlib.adapters": "adapters"}


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == MAPPED
    found = set()
    for package, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *relative)))
    assert found == set(config["packages"])


def test_only_kvlib_is_a_top_level_import_name(tmp_path: Path) -> None:
    code = (
        "import importlib.util, kvlib.storage, kvlib.policies.eviction, kvlib.adapters;"
        "print([n for n in ('storage', 'policies', 'strategies', 'adapters') if importlib.util.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
