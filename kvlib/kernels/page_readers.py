"""How the paged kernels read a codec's sealed pages where they lie: the readers, registered by name.

A codec describes one tensor (keys or values) of its sealed pages as a
:class:`~kvlib.kernel_readers.KernelReader`: the name of a reader, the tensors it reads (field
arenas, codec state) and its int parameters. Nothing else crosses the boundary of the decode
operator (:mod:`kvlib.kernels.paged_ops`), so it traces. Each kernel looks the name up here:

- the numba kernel (CPU, :mod:`kvlib.kernels.paged_attention`): a :class:`NumbaReader`, whose
  functions score a sealed page against the query rows and add its values into the accumulator,
  with the codec's scales folded in where the layout allows (a codec of per-channel scales
  scales the query once per page instead of every key; a per-token scale multiplies the token's
  weight instead of its values); registered with :func:`register_numba_reader`;
- the Triton kernels (CUDA, :mod:`kvlib.kernels.paged_attention_triton`): a tile loader that
  decodes a tile of tokens in registers (:mod:`kvlib.kernels.triton_tiles` has the contract);
  registered with :func:`register_triton_loader` by the module that defines it (which imports
  triton, so it is imported only where triton is).

A codec that only knows how to decode one page into float32 gets a numba reader from
:func:`loader_reader` (decode the page into scratch, then the float loops of
:mod:`kvlib.kernels.page_kernel_parts`). Pages stored as they are in the compute dtype (the side
a codec leaves alone, :class:`~kvlib.codec.IdentityCodec`) are read by ``"plain"`` (:data:`PLAIN`).

The numba reader's functions (all numba-compiled; ``fields`` is what :attr:`NumbaReader.fields`
made of the descriptor's tensors and parameters; ``page`` a sealed page's id; query rows, scores
and weights as :mod:`kvlib.kernels.page_kernel_parts` lays them out):

- ``prepare_keys(fields, query, head) -> work``: once per (row, KV head) and split, what the
  scores need of the query rows ``query [rows, head_dim]`` of KV head ``head`` (a float32 2D
  array the reader lays out as it likes: a rotated query, per-page scratch);
- ``key_scores(fields, page, head, query, work, filled, scores, scratch)``: ``scores[r, t] =
  query[r] . key[t]`` for the first ``filled`` tokens of sealed page ``page`` read for KV head
  ``head`` (no scale, no mask), ``scratch`` float32 ``[page_size, head_dim]``;
- ``prepare_values(fields, rows, value_dim) -> state``: float32 ``[rows, n]``, the reader's own
  accumulators beside the kernel's (the kernel rescales them with its own, row by row);
- ``accumulate_values(fields, page, head, weights, filled, acc, state, scratch)``: adds ``sum_t
  weights[r, t] * value[t]`` over the first ``filled`` tokens to ``acc [rows, value_dim]``
  (or to ``state``, in the reader's own terms), ``scratch`` float32 ``[page_size, value_dim]``;
- ``finish_values(fields, acc, state, head)``: adds what ``state`` holds into ``acc``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numba
import numpy as np
import torch

from kvlib.kernels.host_arrays import FLOAT_KINDS, host_array
from kvlib.kernels.page_kernel_parts import float_accumulate, float_of, float_scores


class NumbaReader(NamedTuple):
    """The numba kernel's reader of one codec's sealed pages (see the module docstring):
    ``fields(tensors, params)`` turns a descriptor's tensors and ints into the tuple the
    functions take (numpy views, :func:`~kvlib.kernels.host_arrays.host_array`: no torch
    operator), then the five compiled functions."""

    fields: Callable[[Sequence[torch.Tensor], Sequence[int]], tuple]
    prepare_keys: Callable[..., np.ndarray]
    key_scores: Callable[..., None]
    prepare_values: Callable[..., np.ndarray]
    accumulate_values: Callable[..., None]
    finish_values: Callable[..., None]


NUMBA_READERS: dict[str, NumbaReader] = {}
"""The numba readers, by the name a :class:`~kvlib.kernel_readers.KernelReader` gives."""

TRITON_LOADERS: dict[str, object] = {}
"""The Triton tile loaders, by the name a :class:`~kvlib.kernel_readers.KernelReader` gives."""


def register_numba_reader(name: str, reader: NumbaReader) -> NumbaReader:
    """Make ``reader`` the numba kernel's reader of pages described as ``name`` (a name is
    registered once: ValueError for another reader under a taken name)."""
    held = NUMBA_READERS.setdefault(name, reader)
    if held is not reader:
        raise ValueError(f"a numba page reader named {name!r} is registered already")
    return reader


def register_triton_loader(name: str, load: object) -> object:
    """Make ``load`` (a ``@triton.jit`` tile loader) the Triton kernels' reader of pages described
    as ``name`` (once per name, as :func:`register_numba_reader`)."""
    held = TRITON_LOADERS.setdefault(name, load)
    if held is not load:
        raise ValueError(f"a Triton tile loader named {name!r} is registered already")
    return load


def numba_reader(name: str) -> NumbaReader:
    """The numba reader registered as ``name``; ValueError naming the registered ones."""
    reader = NUMBA_READERS.get(name)
    if reader is None:
        raise ValueError(f"no numba page reader is registered as {name!r}; registered: {sorted(NUMBA_READERS)}")
    return reader


def triton_loader(name: str) -> object:
    """The Triton tile loader registered as ``name``; ValueError naming the registered ones."""
    load = TRITON_LOADERS.get(name)
    if load is None:
        raise ValueError(f"no Triton tile loader is registered as {name!r}; registered: {sorted(TRITON_LOADERS)}")
    return load


@numba.njit
def no_work(fields, query, head):  # pragma: no cover - compiled
    """No key work: an empty array."""
    return np.empty((query.shape[0], 0), dtype=np.float32)


@numba.njit
def no_state(fields, rows, value_dim):  # pragma: no cover - compiled
    """No value state: an empty array."""
    return np.empty((rows, 0), dtype=np.float32)


@numba.njit
def nothing_to_finish(fields, acc, state, head) -> None:  # pragma: no cover - compiled
    """Nothing held apart from the accumulator."""


@numba.njit
def no_scores(fields, page, head, query, work, filled, scores, scratch) -> None:  # pragma: no cover - compiled
    """Never called: no page of float arenas is sealed."""


@numba.njit
def no_values(fields, page, head, weights, filled, acc, state, scratch) -> None:  # pragma: no cover - compiled
    """Never called: no page of float arenas is sealed."""


FLOAT_ARENAS = NumbaReader(lambda tensors, params: (), no_work, no_scores, no_state, no_values, nothing_to_finish)
"""The reader of float arenas, whose pages are never sealed (the kernel reads them raw)."""


@functools.cache
def loader_reader(load: Callable[..., None], fields: Callable[[Sequence[torch.Tensor], Sequence[int]], tuple]) -> NumbaReader:
    """The numba reader of a codec that decodes one sealed page at a time: ``load(fields, page,
    out, out_bits, rows)`` writes the page's first ``rows`` tokens as float32 into ``out
    [page_size, dim]`` (``out_bits``: the same scratch viewed as uint32), and the float loops
    take it from there. ``fields``: as :attr:`NumbaReader.fields`."""

    @numba.njit
    def key_scores(fields, page, head, query, work, filled, scores, scratch):  # pragma: no cover - compiled
        load(fields, page, scratch, scratch.view(np.uint32), filled)
        float_scores(query, scratch, filled, scores)

    @numba.njit
    def accumulate_values(fields, page, head, weights, filled, acc, state, scratch):  # pragma: no cover - compiled
        load(fields, page, scratch, scratch.view(np.uint32), filled)
        float_accumulate(weights, scratch, filled, acc)

    return NumbaReader(fields, no_work, key_scores, no_state, accumulate_values, nothing_to_finish)


def plain_fields(tensors: Sequence[torch.Tensor], params: Sequence[int]) -> tuple:
    """``(data [capacity, page_size * dim] as bits, kind)`` of the ``"plain"`` reader: the field
    ``data`` (``[capacity, page_size, dim]`` in the compute dtype), no params."""
    (data,) = tensors
    array = host_array(data)
    return array.reshape(array.shape[0], math.prod(array.shape[1:])), FLOAT_KINDS[data.dtype]


@numba.njit
def load_plain(fields, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:  # pragma: no cover - compiled
    """A page stored as it is: its first ``rows`` tokens widened to float32 (exactly)."""
    data, kind = fields
    dim = out.shape[1]
    for t in range(rows):
        for c in range(dim):
            out[t, c] = float_of(data[page, t * dim + c], kind)


PLAIN = register_numba_reader("plain", loader_reader(load_plain, plain_fields))
"""The numba reader of pages stored in the compute dtype (:class:`~kvlib.codec.IdentityCodec`)."""
