"""How the Triton paged-attention kernel reads keys and values: the *tile loader* contract, and
how a codec describes its sealed pages to it (:class:`TritonReader`). Nothing here imports triton,
so codecs can name this contract on machines without it.

The kernel (:mod:`kvlib.kernels.paged_attention_triton`) reads a tile of ``BLOCK_N`` tokens of one
(row, KV head) at a time, each token on its own page, through a loader: a ``@triton.jit``
function handed to the kernel as a constexpr (one compilation per loader and parameters)::

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
alone, :func:`kvlib.kernels.triton_tiles.load_float_tile`), and a coded pool's, whose first three
tensors are the pool's open part (the raw arena of open pages ``[raw_rows, page_size, DIM]`` in
the compute dtype, each page's row there int64 ``[capacity]``, each page's sealed flag as uint8
``[capacity]``; :func:`kvlib.kernels.triton_tiles.open_tile` reads it) and the rest the codec's fields,
decoded where a page is sealed. A codec gives the latter through :meth:`kvlib.codec.TensorCodec.triton_reader`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TritonReader(NamedTuple):
    """How the Triton kernel decodes one tensor (keys or values) of a codec's sealed pages in
    registers: ``load``, a coded tile loader (a ``@triton.jit`` function, see the module
    docstring), ``fields``, its tensors after the pool's three open-part ones (on the arenas'
    device, contiguous), and ``params``, its constexpr ints."""

    load: object
    fields: tuple[torch.Tensor, ...]
    params: tuple[int, ...]
