"""Where the default model's weights live inside the package, and how to load them."""

from __future__ import annotations

from pathlib import Path

import torch

from kvlib.default_model.tokenizer import ByteTokenizer

MODEL_DIR = Path(__file__).resolve().parent
"""Folder holding ``config.json`` and ``model.safetensors``; ``from_pretrained(MODEL_DIR)`` works."""


TRAINING_LOG = "training.json"
"""Written by :mod:`kvlib.default_model.train` beside the weights: marks a byte-level kvlib model."""


def is_byte_model(folder: Path) -> bool:
    """Whether ``folder`` holds a model written by :mod:`kvlib.default_model.train`."""
    return (folder / TRAINING_LOG).is_file() and (folder / "config.json").is_file()


def load_default_model(dtype: torch.dtype = torch.float32, folder: Path = MODEL_DIR):
    """The embedded model (or another trained by the same script, in ``folder``), in eval mode,
    and its :class:`ByteTokenizer`.

    Raises ``FileNotFoundError`` naming the training command when the weights are missing
    (a checkout where ``python -m kvlib.default_model.train`` has not been run).
    """
    from transformers import AutoModelForCausalLM

    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the default model's weights are missing from {folder}; train them with: python -m kvlib.default_model.train"
        )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval(), ByteTokenizer()
