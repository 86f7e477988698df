"""Check kvlib's import contracts (``[tool.importlinter]`` in pyproject.toml) with lint-imports.

import-linter finds a package's modules on the file system, from where ``import kvlib`` resolves.
kvlib's sub-packages ``kvlib.policies``, ``kvlib.storage`` and ``kvlib.adapters`` live in
top-level folders that ``[tool.setuptools] package-dir`` maps into ``kvlib`` (an editable install
resolves them through an import hook, which import-linter does not follow). So this script lays
the package out as it is installed, as links in a temporary folder (``kvlib/*`` plus one link per
``package-dir`` entry), and runs lint-imports there. Exit status: lint-imports' (0: every
contract kept).

Usage: ``.venv/bin/python .ci/import_layers.py`` from anywhere.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import tomllib
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent
ROOT_PACKAGE = "kvlib"


def lay_out(target: Path, package_dir: dict[str, str]) -> None:
    """Links under ``target`` that give the installed layout of ``kvlib``: every entry of the
    root package's folder, and each mapped sub-package's folder at its dotted place."""
    root = target / ROOT_PACKAGE
    root.mkdir()
    for entry in (ROOT / package_dir.get(ROOT_PACKAGE, ROOT_PACKAGE)).iterdir():
        if entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry)
    for name, folder in package_dir.items():
        parts = name.split(".")
        if name == ROOT_PACKAGE or parts[0] != ROOT_PACKAGE:
            continue
        link = target.joinpath(*parts)
        if link.is_symlink():  # a folder of that name in kvlib/ itself: the mapping wins, as installed
            link.unlink()
        link.symlink_to(ROOT / folder, target_is_directory=True)


def main() -> int:
    config = ROOT / "pyproject.toml"
    package_dir = tomllib.loads(config.read_text())["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory(prefix="kvlib-layers-") as folder:
        lay_out(Path(folder), package_dir)
        os.chdir(folder)  # lint-imports puts the working directory first on sys.path
        sys.path.insert(0, folder)
        return lint_imports(config_filename=str(config), no_cache=True)


if __name__ == "__main__":
    sys.exit(main())
