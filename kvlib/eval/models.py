"""Loading the model a comparison runs on: the embedded default, SmolLM2, Gemma 3 270M, a local folder or a hub id."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvlib.errors import ModelLoadError
from kvlib.eval import gemma3, smollm2

DEFAULT_MODEL = "default"
"""The name that selects kvlib's embedded model (:mod:`kvlib.default_model`)."""
NAMED_MODELS: dict[str, Callable[[], Path]] = {smollm2.NAME: smollm2.smollm2_folder, gemma3.NAME: gemma3.gemma3_folder}
"""Models kvlib fetches or assembles and converts once, by name: each gives its converted folder."""


class TextTokenizer(Protocol):
    """What tasks need from a tokenizer."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    def encode(self, text: str, *, bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def instruct(self, message: str, reply_start: str = "") -> list[int]:
        """Ids of a prompt that puts ``message`` to the model and opens its answer with ``reply_start``."""


@dataclass(frozen=True)
class HFTokenizer:
    """A ``transformers`` tokenizer behind the :class:`TextTokenizer` interface."""

    tokenizer: object

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        return ([self.bos_token_id] if bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def instruct(self, message: str, reply_start: str = "") -> list[int]:
        """``message`` as a user turn of the chat template, the assistant's turn opened, then
        ``reply_start``; without a chat template, BOS + ``message`` + ``reply_start``. The template's
        text is encoded as a whole (its special tokens included), so nothing is added twice."""
        if not getattr(self.tokenizer, "chat_template", None):
            return self.encode(message + reply_start, bos=True)
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True)
        return self.encode(text + reply_start)


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM in eval mode, its tokenizer, the name it was loaded by and its context length."""

    model: torch.nn.Module
    tokenizer: TextTokenizer
    name: str
    context: int


def load_model(name: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """``name``: ``None`` or ``"default"`` (the embedded model), ``"smollm2"`` (SmolLM2-135M-Instruct,
    fetched and converted once by :mod:`kvlib.eval.smollm2`, offline afterwards), ``"gemma3-270m"``
    (Gemma 3 270M, the base model, assembled from the ``models`` extra's packages and converted
    once by :mod:`kvlib.eval.gemma3`), a local folder, or a hub id.

    A folder written by :mod:`kvlib.default_model.train` gets the byte tokenizer; anything else
    loads with ``AutoModelForCausalLM`` and ``AutoTokenizer``.

    Raises :class:`ModelLoadError` with one line naming the model and the cause.
    """
    from kvlib.default_model.files import MODEL_DIR, is_byte_model, load_default_model

    name = name or DEFAULT_MODEL
    folder = Path(name).expanduser()
    if name.startswith(("/", "./", "../", "~")) and not folder.is_dir():
        raise ModelLoadError(f"cannot load model {name!r}: no such folder")
    try:
        source = str(NAMED_MODELS[name]()) if name in NAMED_MODELS else name
        folder = Path(source).expanduser()
        if name == DEFAULT_MODEL or is_byte_model(folder):
            model, tokenizer = load_default_model(dtype, MODEL_DIR if name == DEFAULT_MODEL else folder)
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
            tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(source))
    except Exception as exc:  # noqa: BLE001 - any loading failure becomes one clear line
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load model {name!r}: {cause}") from exc
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 2048
    return LoadedModel(model, tokenizer, name, context)
