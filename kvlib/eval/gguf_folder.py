"""A GGUF file dequantized once into a plain model folder in kvlib's cache (what :mod:`.smollm2`
and :mod:`.gemma3` share).

``transformers`` reads a GGUF file (with the ``gguf`` and ``accelerate`` packages, kvlib's
``models`` extra) into a float32 model whose config still names the GGUF quantization, and
``save_pretrained`` refuses such a model (``ValueError: The model is quantized with gguf and is
not serializable``). :func:`write_plain_model` therefore builds a plain model of the same config
without its ``quantization_config``, loads the dequantized state dict into it (strictly: every
tensor, no more) and saves that: float32 safetensors (the dequantized weights exactly), the
config, the generation config and the tokenizer.

The folder is written beside its final place and renamed into it once complete, its
:data:`MARKER` (``kvlib-model.json``, saying where it came from) written last, so an interrupted
conversion leaves nothing half-written and two processes converting at once both end with a
complete folder. Later runs find the marker and load the folder offline.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from kvlib.errors import ModelLoadError
from kvlib.eval.output_files import private_folder

MARKER = "kvlib-model.json"
"""Written last into a converted folder: the folder is complete when it exists."""


def cache_root() -> Path:
    """Where kvlib keeps downloaded and converted files: ``$KVLIB_CACHE`` or ``~/.cache/kvlib``."""
    return Path(os.environ.get("KVLIB_CACHE") or Path.home() / ".cache" / "kvlib").expanduser()


def write_plain_model(gguf: Path, folder: Path, name: str, note: dict, *, chat_template: bool = True, progress: bool = True) -> None:
    """Dequantize ``gguf`` and write it to ``folder`` as a plain model (see the module docstring),
    ``note`` as its :data:`MARKER`. ``chat_template`` False drops any chat template the file's
    tokenizer carries (a base model: prompts are plain text). A failure is one
    :class:`ModelLoadError` line naming ``gguf`` and leaves no folder behind."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = private_folder(folder)  # built where no one else can plant a file, then renamed into place
    with tqdm(total=3, desc=f"kvlib: converting {name}", unit="step", disable=not progress) as bar:
        try:
            bar.set_postfix_str("dequantizing")
            quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            bar.update()
            bar.set_postfix_str("building a plain model")
            settings = quantized.config.to_dict()
            settings.pop("quantization_config", None)  # a plain float model, saved like any other
            model = AutoModelForCausalLM.from_config(type(quantized.config).from_dict(settings))
            model.load_state_dict(quantized.state_dict(), strict=True)
            model.generation_config = quantized.generation_config
            del quantized
            if not chat_template:
                tokenizer.chat_template = None
            bar.update()
            bar.set_postfix_str("writing safetensors")
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
            (partial / MARKER).write_text(json.dumps(note, indent=1) + "\n")
            bar.update()
        except Exception as exc:  # noqa: BLE001 - any conversion failure becomes one clear line
            shutil.rmtree(partial, ignore_errors=True)
            raise ModelLoadError(f"cannot convert {gguf}: {first_line(exc)}") from exc
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        partial.rename(folder)
    except OSError:  # another process finished first: its folder is as good as ours
        shutil.rmtree(partial, ignore_errors=True)
        if not (folder / MARKER).is_file():
            raise


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def say(message: str, progress: bool) -> None:
    """``message`` on stderr when ``progress`` is on."""
    if progress:
        print(message, file=sys.stderr, flush=True)
