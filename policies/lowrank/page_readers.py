"""The low-rank codecs' numba page readers: sealed pages read inside the paged-attention kernel in
their own, narrower space (the reader contract: :mod:`kvlib.kernels.page_readers`).

- ``"basis"`` (:class:`~.basis.BasisCodec`: svd, cskv, xkv): a token is stored as its
  coefficients ``c = x V`` in its KV head's orthonormal basis ``V [dim, rank]``. Keys:
  ``q . (V c) = (V^T q) . c``, the query projected once per (row, KV head)
  (:func:`basis_work`), then ``rank`` products a token instead of ``dim``; values: the weighted
  coefficients summed in the basis (``state [rows, rank]``), taken back to the model's channels
  once per (row, KV head) (:func:`basis_finish`: ``acc += state V^T``).
- ``"channel_mask"`` (:class:`~.leank.StaticChannelMask`: leank): a head keeps ``width`` of its
  key channels, the rest read as zero: ``q . k = q[kept] . k_kept``, the query's kept channels
  gathered once per (row, KV head) (:func:`mask_work`), then ``width`` products a token.

Each equals what the codec's float32 decode gives (:meth:`~kvlib.codec.TensorCodec.decode_into`
into float32: coefficients times the basis in float32; kept channels scattered), up to float32
rounding of the reordered sums. A sealed page is read for the KV head whose basis or mask
encoded it: the store allocates every page to one KV head of one sequence's block table and reads
it for that head (as ``rotated``'s reader, which checks it per page, relies on too).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvlib.kernels.host_arrays import FLOAT_KINDS, host_array
from kvlib.kernels.page_kernel_parts import FASTMATH, float_accumulate, float_of, float_scores
from kvlib.kernels.page_readers import NumbaReader, no_state, nothing_to_finish, register_numba_reader


def _rows(arena: torch.Tensor) -> np.ndarray:
    """A field arena as a numpy ``[capacity, elements per page]`` view (no torch operator)."""
    array = host_array(arena)
    return array.reshape(array.shape[0], math.prod(array.shape[1:]))


@numba.njit(fastmath=FASTMATH)
def widen_page(data, kind: int, page: int, rows: int, width: int, scratch: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """The first ``rows`` tokens of ``page`` (``width`` entries each, row ``page`` of ``data``)
    as float32 ``[page_size, width]`` in ``scratch``'s memory (a contiguous view of it)."""
    page_size = scratch.shape[0]
    out = scratch.reshape(-1)[: page_size * width].reshape((page_size, width))
    for t in range(rows):
        for j in range(width):
            out[t, j] = float_of(data[page, t * width + j], kind)
    return out


@numba.njit(fastmath=FASTMATH)
def narrow_key_scores(fields, page, head, query, work, filled, scores, scratch) -> None:  # pragma: no cover - compiled
    """Scores of a page of narrow keys (``fields``: ``(data, head table, kind, width)``, both
    readers' layout): the query as the reader's work narrowed it (``work [rows, width]``: projected
    into the basis, or its kept channels) against the page's ``width`` entries a token."""
    data, _, kind, width = fields
    float_scores(work, widen_page(data, kind, page, filled, width, scratch), filled, scores)


# -- basis coefficients ----------------------------------------------------------------------


def basis_fields(tensors: tuple[torch.Tensor, ...], params: tuple[int, ...]) -> tuple:
    """``(coefficients [capacity, page_size * rank] as bits, basis [kv_heads, dim, rank] as bits,
    kind, rank)`` of a :class:`~.basis.BasisCodec`'s reader: fields ``(coefficients, basis)``
    (both in the compute dtype), params ``(rank,)``."""
    coefficients, basis = tensors
    (rank,) = params
    return _rows(coefficients), host_array(basis), FLOAT_KINDS[coefficients.dtype], rank


@numba.njit(fastmath=FASTMATH)
def basis_work(fields, query, head):  # pragma: no cover - compiled
    """``V_h^T q`` of each query row: float32 ``[rows, rank]``."""
    _, basis, kind, rank = fields
    rows, dim = query.shape
    work = np.zeros((rows, rank), dtype=np.float32)
    for c in range(dim):
        for k in range(rank):
            v = float_of(basis[head, c, k], kind)
            for r in range(rows):
                work[r, k] += query[r, c] * v
    return work


@numba.njit
def basis_state(fields, rows, value_dim):  # pragma: no cover - compiled
    """The weighted sum of the value coefficients, ``[rows, rank]``."""
    return np.zeros((rows, fields[3]), dtype=np.float32)


@numba.njit(fastmath=FASTMATH)
def basis_accumulate(fields, page, head, weights, filled, acc, state, scratch) -> None:  # pragma: no cover - compiled
    """A page of value coefficients added, weighted, into ``state`` (in the basis)."""
    coefficients, _, kind, rank = fields
    float_accumulate(weights, widen_page(coefficients, kind, page, filled, rank, scratch), filled, state)


@numba.njit(fastmath=FASTMATH)
def basis_finish(fields, acc, state, head) -> None:  # pragma: no cover - compiled
    """``acc += state V_h^T`` row by row: the basis left once per (row, KV head)."""
    _, basis, kind, rank = fields
    dim = acc.shape[1]
    for c in range(dim):
        for k in range(rank):
            v = float_of(basis[head, c, k], kind)
            for r in range(state.shape[0]):
                acc[r, c] += state[r, k] * v


BASIS = register_numba_reader(
    "basis", NumbaReader(basis_fields, basis_work, narrow_key_scores, basis_state, basis_accumulate, basis_finish)
)
"""The numba reader of :class:`~.basis.BasisCodec` pages (keys and values)."""


# -- kept key channels -----------------------------------------------------------------------


def mask_fields(tensors: tuple[torch.Tensor, ...], params: tuple[int, ...]) -> tuple:
    """``(channels [capacity, page_size * width] as bits, kept [kv_heads, width] int64, kind,
    width)`` of a :class:`~.leank.StaticChannelMask`'s reader: fields ``(channels, kept)``
    (``kept``: each head's kept channel indices, ``-1`` past its count), params ``(width,)``."""
    channels, kept = tensors
    (width,) = params
    return _rows(channels), host_array(kept), FLOAT_KINDS[channels.dtype], width


@numba.njit(fastmath=FASTMATH)
def mask_work(fields, query, head):  # pragma: no cover - compiled
    """Each query row's kept channels of KV head ``head``: float32 ``[rows, width]`` (0 where the
    head keeps fewer than ``width``)."""
    _, kept, _, width = fields
    rows = query.shape[0]
    work = np.zeros((rows, width), dtype=np.float32)
    for j in range(width):
        channel = kept[head, j]
        if channel >= 0:
            for r in range(rows):
                work[r, j] = query[r, channel]
    return work


@numba.njit
def mask_no_values(fields, page, head, weights, filled, acc, state, scratch) -> None:  # pragma: no cover - compiled
    """Never called: the mask codes keys only."""


CHANNEL_MASK = register_numba_reader(
    "channel_mask", NumbaReader(mask_fields, mask_work, narrow_key_scores, no_state, mask_no_values, nothing_to_finish)
)
"""The numba reader of :class:`~.leank.StaticChannelMask` key pages."""
