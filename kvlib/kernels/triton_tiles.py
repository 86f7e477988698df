"""The Triton tile loaders every page source shares: a float arena's tokens, and a coded pool's
open pages (see :mod:`kvlib.triton_readers` for the loader contract).

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
