"""The quantization codecs' Triton tile loaders (the contract: :mod:`kvlib.kernels.triton_tiles`), one
module per codec family, each registered under its reader's name
(:func:`kvlib.kernels.page_readers.register_triton_loader`) when imported. Nothing here is imported
with the package: the modules import triton, which is optional; :func:`register_triton_loaders`
imports them where a codec's pages lie on CUDA."""

from __future__ import annotations

import importlib.util

import torch

LOADER_MODULES = ("group", "rotated", "scaled_bytes")
"""The modules of this package that register a tile loader."""


def register_triton_loaders(device: torch.device) -> None:
    """Register every tile loader of this package when ``device`` is a CUDA device and triton is
    installed (importing a module registers its loader; later calls find them imported)."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return
    for name in LOADER_MODULES:
        importlib.import_module(f"{__name__}.{name}")
