"""The Triton tile loaders every page source shares: a float arena's tokens, and a coded pool's
open pages; and the tile loader contract.

The attention kernel (:mod:`kvlib.kernels.paged_attention_triton`) reads a tile of ``BLOCK_N``
tokens of one (row, KV head) at a time, each token on its own page, through a loader: a
``@triton.jit`` function handed to the kernel as a constexpr (one compilation per loader and
parameters)::

    load(page, slot, stored, tensors, params, DIM, PAGE_SIZE, BLOCK_D, DOT) -> float32 [BLOCK_N, BLOCK_D]

- ``page`` int64 ``[BLOCK_N]``: each token's page id (0 where not ``stored``); ``slot`` its slot
  in that page; ``stored`` bool ``[BLOCK_N]``: whether the token is one of the head's (tokens
  past its length are not, and nothing of theirs may be read);
- ``tensors``: a tuple of the loader's tensors on the arenas' device, as many as it reads;
  ``params``: a tuple of its constexpr ints (one compilation per value);
- ``DIM``: the tensor's channels, ``PAGE_SIZE``: tokens per page, ``BLOCK_D``: ``DIM`` rounded up
  to a power of two, at least 16 (a ``tl.dot`` operand on the GPU), ``DOT``: the dtype of the
  kernel's matrix products, for a loader that multiplies matrices (:mod:`kvlib.kernels.triton_products`),
  all constexpr.

It returns the tokens' channels as float32 (decoded in registers, never rounded to the compute
dtype: what the codec's float32 decode gives), 0 where not ``stored`` and in channels ``>= DIM``.
Every arena is contiguous, so a loader finds a page's row of any field from the page id and
the constexpr shapes alone.

Two kinds of loaders exist: a float arena's (``tensors`` the arena ``[capacity, page_size, DIM]``
alone, :func:`load_float_tile`), and a coded pool's, whose first three tensors are the pool's
open part (the raw arena of open pages ``[raw_rows, page_size, DIM]`` in the compute dtype, each
page's row there int64 ``[capacity]``, each page's sealed flag as uint8 ``[capacity]``;
:func:`open_tile` reads it) and the rest the fields of the codec's
:class:`~kvlib.kernel_readers.KernelReader`, with its ``params``, decoded where a page is sealed.
A codec's loader is registered under its reader's name (:func:`kvlib.kernels.page_readers.register_triton_loader`).

Offsets are computed in int64 (page ids are int64), so arenas past 2**31 elements are read
right. Loads are masked to the tokens and channels that exist: an arena's unwritten rows
(``torch.empty``: any bits) are never read.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def token_channels(page, slot, stored, arena, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """float32 ``[BLOCK_N, BLOCK_D]``: slot ``slot`` of row ``page`` of ``arena [rows, PAGE_SIZE,
    DIM]`` per token, 0 where not ``stored`` and past ``DIM``."""
    channel = tl.arange(0, BLOCK_D)
    offsets = (page * PAGE_SIZE + slot)[:, None] * DIM + channel[None, :]
    return tl.load(arena + offsets, mask=stored[:, None] & (channel < DIM)[None, :], other=0.0).to(tl.float32)


@triton.jit
def load_float_tile(
    page, slot, stored, tensors, params, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr
):
    """The loader of pages held in a float compute dtype: ``tensors`` is ``(arena,)``, ``arena
    [capacity, PAGE_SIZE, DIM]`` (float32, float16 or bfloat16) indexed by page id; ``params``
    (``()``) and ``DOT`` unused."""
    return token_channels(page, slot, stored, tensors[0], DIM, PAGE_SIZE, BLOCK_D)


@triton.jit
def open_tile(page, slot, stored, tensors, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """A coded pool's open part of a tile: ``(tokens, coded)``, the tokens of open pages read
    from the raw arena at their page's raw row as float32 ``[BLOCK_N, BLOCK_D]`` (0 for the rest),
    and bool ``[BLOCK_N]``, which stored tokens lie on sealed pages, for the codec's loader to
    decode. ``tensors`` is a coded loader's: ``(raw, raw_row, sealed uint8 per page, *fields)``."""
    raw = tensors[0]
    raw_row = tensors[1]
    sealed = tensors[2]
    is_sealed = tl.load(sealed + page, mask=stored, other=0) != 0
    opened = stored & ~is_sealed
    row = tl.load(raw_row + page, mask=opened, other=0)
    return token_channels(row, slot, opened, raw, DIM, PAGE_SIZE, BLOCK_D), stored & is_sealed
