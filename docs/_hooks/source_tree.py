"""MkDocs hook: give mkdocstrings one source tree of the ``kvlib`` namespace.

kvlib installs folders from the repository root inside its namespace (``package-dir`` in
pyproject.toml: ``adapters/`` is ``kvlib.adapters``, and so on). Griffe, which reads the sources
for the API reference, finds a package's sub-packages only below the package's own folder, so
``kvlib.make_cache`` (re-exported from ``kvlib.adapters``) would not resolve. Before each build
this hook lays out ``build/api-source/kvlib/`` as symbolic links: every entry of ``kvlib/`` plus
every sub-package mapped to a folder of its own (``kvlib.X``; deeper packages live inside those
folders); ``mkdocs.yml`` points the handler's ``paths`` there. Only the links are rebuilt; the
sources are never copied or changed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "api-source"
MAPPED = re.compile(r'"kvlib\.(\w+)"\s*=\s*"([^"]+)"')


def package_dirs() -> dict[str, Path]:
    """Sub-packages ``kvlib.X`` that live outside ``kvlib/``: ``X`` -> folder (from pyproject.toml)."""
    line = next(line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.startswith("package-dir"))
    return {name: ROOT / folder for name, folder in MAPPED.findall(line)}


def on_startup(command: str, dirty: bool) -> None:
    """Rebuild the link tree: kvlib's own entries, then each mapped sub-package."""
    if TREE.exists():
        shutil.rmtree(TREE)
    package = TREE / "kvlib"
    package.mkdir(parents=True)
    for entry in (ROOT / "kvlib").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in package_dirs().items():
        (package / name).unlink(missing_ok=True)  # the mapping wins over a same-named entry of kvlib/
        (package / name).symlink_to(folder, target_is_directory=True)
