"""Check kvlib's import contracts (``[tool.importlinter]`` in pyproject.toml) with lint-imports.

import-linter finds a package's modules on the file system, from where ``import kvlib`` resolves.
kvlib's sub-packages ``kvlib.policies``, ``kvlib.storage`` and ``kvlib.adapters`` live in
top-level folders that ``[tool.setuptools] package-dir`` maps into ``kvlib`` (an editable install
resolves them through an import hook, which import-linter does not follow). So this script lays
the package out as it is installed, as links in a temporary folder (``kvlib/*`` plus one link per
``package-dir`` entry), and runs lint-imports there; then it looks for import circles among
kvlib's modules in the same layout, every import counted (those under ``TYPE_CHECKING`` and
inside functions too: a circle of type hints is still two modules that cannot be read apart).
Exit status: 0 when every contract is kept and no circle exists.

Usage: ``.venv/bin/python .ci/import_layers.py`` from anywhere.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import grimp
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


def import_circles(package: str) -> list[list[str]]:
    """The strongly connected parts of ``package``'s import graph with more than one module (each
    one or more circles), every import counted (grimp reads TYPE_CHECKING and function-level
    imports too), each sorted; Tarjan's algorithm, iteratively."""
    graph = grimp.build_graph(package, include_external_packages=False)
    edges = {module: sorted(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            module, position = work.pop()
            if position == 0:
                index[module] = low[module] = len(index)
                stack.append(module)
                on_stack.add(module)
            if position < len(edges[module]):
                work.append((module, position + 1))
                target = edges[module][position]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            if low[module] == index[module]:
                part = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.append(member)
                    if member == module:
                        break
                if len(part) > 1:
                    circles.append(sorted(part))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
    return circles


def main() -> int:
    config = ROOT / "pyproject.toml"
    package_dir = tomllib.loads(config.read_text())["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory(prefix="kvlib-layers-") as folder:
        lay_out(Path(folder), package_dir)
        os.chdir(folder)  # lint-imports puts the working directory first on sys.path
        sys.path.insert(0, folder)
        status = lint_imports(config_filename=str(config), no_cache=True)
        circles = import_circles(ROOT_PACKAGE)
    for part in circles:
        print("import circle among: " + ", ".join(part))
    print(f"Import circles: {len(circles)}.")
    return status or int(bool(circles))


if __name__ == "__main__":
    sys.exit(main())
