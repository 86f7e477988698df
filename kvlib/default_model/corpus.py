"""The default model's text: the Python standard library's own source files.

Every machine with Python has them, so training and evaluation need no download. Files under
``test``/``tests``/``idlelib``/``site-packages`` are skipped; :data:`HOLDOUT` modules are kept out
of training and serve as the evaluation text (needle filler, perplexity). File order is sorted by
relative path, so the corpus is the same on every machine with the same Python version.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

HOLDOUT = ("calendar.py", "difflib.py", "fractions.py", "pprint.py", "statistics.py", "textwrap.py")
"""Top-level stdlib modules never trained on: the evaluation text."""

SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})
FILE_SEPARATOR = b"\n\n"


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def training_files() -> list[Path]:
    """Every stdlib ``.py`` file used for training, sorted by relative path."""
    root = stdlib_dir()
    files = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        relative = path.relative_to(root)
        if SKIPPED_DIRS.intersection(relative.parts[:-1]) or relative.as_posix() in HOLDOUT:
            continue
        files.append(path)
    return files


def training_text() -> bytes:
    """All training files' bytes, joined by blank lines."""
    return FILE_SEPARATOR.join(path.read_bytes() for path in training_files())


def holdout_text() -> str:
    """The :data:`HOLDOUT` modules' source, joined by blank lines (about 200 KB)."""
    root = stdlib_dir()
    return FILE_SEPARATOR.decode().join((root / name).read_text(encoding="utf-8") for name in HOLDOUT)
