"""The types the paged kernels and the store share: a layer's pages as arrays
(:class:`PageArrays`), as something a paged kernel reads (:class:`PageReader`), and a batch's
pages of a layer (:class:`PagedLayer`). No kernel here: :mod:`kvlib.kernels.paged_attention`,
:mod:`kvlib.kernels.paged_scores` and :mod:`kvlib.kernels.paged_attention_torch` read them."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch

from kvlib.kernels.page_readers import NumbaReader


class PageArrays(NamedTuple):
    """A layer's pages as the numba kernel reads them, in place (CPU).

    ``keys`` / ``values``: the arenas of pages held raw (every page of float arenas; a coded
    pool's open pages), float32, or float16 / bfloat16 as uint16 bits (``kind``:
    :data:`~kvlib.kernels.host_arrays.FLOAT_KINDS`), ``[rows, page_size, dim]``; ``sealed`` bool
    ``[capacity]`` and ``raw_row`` int64 ``[capacity]`` (each open page's row in ``keys`` /
    ``values``; both empty for float arenas, whose page ids are their rows); each page's token
    positions (int64 ``[capacity, page_size]``); for sealed keys and values a
    :class:`~kvlib.kernels.page_readers.NumbaReader` and the fields it reads; the value channels;
    and the tensors the arrays view (:func:`~kvlib.kernels.host_arrays.host_array`: views do not
    keep their tensor alive), held for as long as the source is."""

    keys: np.ndarray
    values: np.ndarray
    kind: int
    sealed: np.ndarray
    raw_row: np.ndarray
    positions: np.ndarray
    key_reader: NumbaReader
    key_fields: tuple
    value_reader: NumbaReader
    value_fields: tuple
    value_dim: int
    held: tuple


class PageReader(Protocol):
    """A layer's pages as some paged kernel reads them in place: :class:`~kvlib.kernels.paged_attention.PageSource` (the CPU
    kernel) or :class:`~kvlib.kernels.paged_attention_torch.TorchPageSource` (torch ops, any device),
    chosen per device by :func:`kvlib.devices.paged_kernel`."""

    value_dim: int

    def attend(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`~kvlib.kernels.paged_attention.paged_attention` of ``query`` over these pages through the block table
        ``pages`` holding ``lengths`` tokens per (row, KV head)."""

    def attend_parts(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend` as a partial attention (:func:`~kvlib.kernels.paged_attention.attend_parts`): the
        output in float32 and each query's log-sum-exp (float32 ``[batch, query_heads, queries]``,
        ``-inf`` where it sees nothing), for merging with attention over other tokens."""

    def weights(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`~kvlib.kernels.paged_scores.attention_weights` of ``query`` over these pages (slots in block-table order)."""


class PagedLayer(NamedTuple):
    """A layer's tokens for a batch of sequences, as they lie in the pages (nothing copied).

    source: how a paged kernel reads the layer's pages (a :class:`PageReader`); pages: int64
    ``[batch, kv_heads, max_pages]``, each (row, KV head)'s page ids in order (``-1`` past its
    last page); lengths: int64 ``[batch, kv_heads]``, tokens stored per (row, KV head).
    """

    source: PageReader
    pages: torch.Tensor
    lengths: torch.Tensor

    def attend(self, query: torch.Tensor, **options) -> torch.Tensor:
        """:func:`~kvlib.kernels.paged_attention.paged_attention` of ``query`` over these pages by their source's kernel;
        ``options``: its keyword arguments (``visible``, ``query_positions``, ``scale``, ``softcap``)."""
        return self.source.attend(query, self.pages, self.lengths, **options)

    def weights(self, query: torch.Tensor, **options) -> torch.Tensor:
        """:func:`~kvlib.kernels.paged_scores.attention_weights` of ``query`` over these pages by their source's kernel (slots
        in block-table order, as a dense read of the layer lays them out); ``options`` as for
        :meth:`attend`."""
        return self.source.weights(query, self.pages, self.lengths, **options)
