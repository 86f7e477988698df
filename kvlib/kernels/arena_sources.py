"""How a pool's float arenas are handed to the paged kernel of their device.

:func:`arena_source_for` looks the arenas' device up in :func:`kvlib.devices.paged_kernel` and
builds that kernel's page source: numpy views and numba loaders for the CPU kernel
(:func:`kvlib.kernels.paged_attention.arena_source`), the arenas as they are for the torch path
(:func:`kvlib.kernels.paged_attention_torch.torch_arena_source`). Either source answers
``attend(query, pages, lengths, **options)``, so :meth:`kvlib.kernels.pages.PagedLayer.attend`
runs the right implementation without asking which it holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlib.devices import PagedKernel, paged_kernel
from kvlib.kernels.paged_attention import arena_source
from kvlib.kernels.paged_attention_torch import torch_arena_source
from kvlib.kernels.pages import PageReader

ARENA_SOURCES: dict[PagedKernel, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], PageReader]] = {
    PagedKernel.NUMBA: arena_source,
    PagedKernel.TORCH: torch_arena_source,
}
try:  # triton is optional (torch's CUDA builds bring it): without it CUDA reads through the torch path
    from kvlib.kernels.paged_attention_triton import triton_arena_source

    ARENA_SOURCES[PagedKernel.TRITON] = triton_arena_source
except ImportError:
    pass
"""Each paged kernel's page source over float arenas ``(keys, values, positions)``."""


def arena_source_for(key_arena: torch.Tensor, value_arena: torch.Tensor, positions: torch.Tensor) -> PageReader | None:
    """The page source of float arenas ``[capacity, page_size, head_dim | value_dim]`` with their
    positions (int64 ``[capacity, page_size]``, same device) for their device's paged kernel, or
    None where that device reads layers densely (:func:`kvlib.devices.reads_pages_in_place`)."""
    kernel = paged_kernel(key_arena.device)
    return None if kernel is None else ARENA_SOURCES[kernel](key_arena, value_arena, positions)
