#!/usr/bin/env python3
"""Set up kvlib in this checkout and run its main job or its tests: the README's two commands.

    python3 quickstart.py compare [kvlib compare options]   # the main job
    python3 quickstart.py test [pytest options]             # the test suite (what CI runs)

``test`` runs pytest on every usable core (pytest-xdist's ``-n N``, from the ``dev`` extra); a
``-n``/``--numprocesses`` or ``-p no:xdist`` of the caller's own wins.

The first run creates a virtual environment in ``.venv`` (or ``$KVLIB_VENV``), installs torch
(the CPU build, ``torch==2.13.0``, where no NVIDIA GPU is present; the default build where
``nvidia-smi`` finds one; ``$KVLIB_TORCH`` overrides the requirement), then kvlib with its
``dev`` extra. Later runs reuse that environment: set-up is skipped while the stamp file in it
matches ``pyproject.toml`` and the requested torch and transformers. ``$KVLIB_TRANSFORMERS``
pins transformers (CI uses it to test the oldest version ``pyproject.toml`` allows).

Only the standard library is used here, so any Python 3.10+ runs it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
COMMANDS = ("compare", "test")


def _venv_python(venv: Path) -> Path:
    """The interpreter inside ``venv`` (POSIX or Windows layout)."""
    posix = venv / "bin" / "python"
    return posix if posix.exists() else venv / "Scripts" / "python.exe"


def _torch_requirement() -> str:
    """The torch requirement for this machine: ``$KVLIB_TORCH``, else CPU or default build."""
    chosen = os.environ.get("KVLIB_TORCH")
    if chosen:
        return chosen
    return "torch" if shutil.which("nvidia-smi") else "torch==2.13.0"


def _stamp(torch_requirement: str, transformers_pin: str) -> str:
    """What the installed environment was built from; a change triggers a new install."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(f"\0{torch_requirement}\0{transformers_pin}".encode())
    return digest.hexdigest()


def _run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def ensure_environment() -> Path:
    """Create or reuse the virtual environment; returns its Python interpreter."""
    venv = (ROOT / os.environ.get("KVLIB_VENV", ".venv")).resolve()
    torch_requirement = _torch_requirement()
    transformers_pin = os.environ.get("KVLIB_TRANSFORMERS", "")
    stamp_file = venv / "kvlib-setup.stamp"
    wanted = _stamp(torch_requirement, transformers_pin)
    if stamp_file.exists() and stamp_file.read_text() == wanted:
        return _venv_python(venv)
    if not _venv_python(venv).exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    python = str(_venv_python(venv))
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # torch first: kvlib's plain torch requirement would otherwise pull a CUDA build.
    _run(pip + [torch_requirement])
    extra = [f"transformers=={transformers_pin}"] if transformers_pin else []
    _run(pip + ["--upgrade-strategy", "only-if-needed", "-e", ".[dev]"] + extra)
    stamp_file.write_text(wanted)
    return Path(python)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity where the platform reports it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def pytest_arguments(given: list[str], cores: int) -> list[str]:
    """pytest's arguments for ``quickstart.py test``: ``given``, after ``-n cores`` (one
    pytest-xdist worker per core) when there is more than one core and ``given`` neither chooses
    its workers (``-n``, ``--numprocesses``) nor turns xdist off (``-p no:xdist``)."""
    chooses_workers = any(arg.startswith(("-n", "--numprocesses")) for arg in given)
    plugins = [value for flag, value in zip(given, given[1:]) if flag == "-p"] + [arg[2:] for arg in given if arg.startswith("-p")]
    if chooses_workers or "no:xdist" in plugins or cores < 2:
        return list(given)
    return ["-n", str(cores), *given]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python3 quickstart.py {{{'|'.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    try:
        python = str(ensure_environment())
    except subprocess.CalledProcessError as error:
        print(f"quickstart: set-up failed ({error})", file=sys.stderr)
        return 1
    if command == "compare":
        invocation = [python, "-m", "kvlib.cli", "compare", *rest]
    else:
        invocation = [python, "-m", "pytest", *pytest_arguments(rest, usable_cores())]
    print("+", " ".join(invocation), flush=True)
    return subprocess.run(invocation, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
