"""kvlib's page kernels as torch custom operators: ``torch.ops.kvlib.*``.

A decode step of a planned cache (:mod:`kvlib.storage.step_plan`) costs each layer two operators, one
per job, whatever the device:

- ``kvlib::write_planned``: the layer's new keys, values and positions written into its arenas
  at the slots the step plan gave them (vLLM's ``reshape_and_cache`` for kvlib's per-head pages);
- ``kvlib::paged_decode``: the layer's attention straight over its pages, through the plan's
  block tables and lengths, returned in the layout `transformers` attention functions return.

Both take the plan's tensors for every layer and the layer's index, so that no per-layer slice
of them is made before the call. As operators they are single nodes for ``torch.compile``
(their fake implementations give shapes only: a decode step traces without a graph break) and
one trip through torch's dispatcher each in eager mode. Each has a CPU implementation (the numba
kernel of :mod:`kvlib.kernels.paged_attention`) and a CUDA one (:func:`kvlib.devices.paged_kernel`'s: the
Triton kernels of :mod:`kvlib.kernels.paged_attention_triton` where triton is installed, else the torch
path of :mod:`kvlib.kernels.paged_attention_torch`).

Semantics of ``paged_decode`` are :func:`kvlib.kernels.paged_attention.paged_attention`'s: query
``[batch, query_heads, queries, head_dim]``; ``mask`` the model's mask over logical positions
(``[batch, 1, queries, logical]``, bool or additive float; None: causal by
``query_positions [queries]``); output ``[batch, queries, query_heads, value_dim]`` in the
query's dtype, float32 accumulation.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import numpy as np
import torch

from kvlib.devices import PagedKernel, paged_kernel
from kvlib.kernels.arena_sources import ARENA_SOURCES
from kvlib.kernels.page_kernel_parts import LOADERS
from kvlib.kernels.paged_attention import PageReader, PageSource, paged_attention_kernel

_LIBRARY = torch.library.Library("kvlib", "DEF")  # noqa: TOR901 - the low-level API: a few microseconds a call, not tens

_LIBRARY.define(
    "write_planned(Tensor(a!) key_arena, Tensor(b!) value_arena, Tensor(c!) position_arena, Tensor slots, Tensor position_slots,"
    " int layer, Tensor keys, Tensor values, Tensor positions) -> ()"
)
_LIBRARY.define(
    "paged_decode_source(int source, Tensor query, Tensor key_arena, Tensor value_arena, Tensor position_arena, Tensor pages,"
    " Tensor lengths, int layer, Tensor? mask, Tensor? query_positions, float scale, float softcap, Tensor(d!)? received=None)"
    " -> Tensor"
)
_LIBRARY.define(
    "paged_decode(Tensor query, Tensor key_arena, Tensor value_arena, Tensor position_arena, Tensor pages, Tensor lengths,"
    " int layer, Tensor? mask, Tensor? query_positions, float scale, float softcap, Tensor(d!)? received=None) -> Tensor"
)


def write_planned(
    key_arena: torch.Tensor,
    value_arena: torch.Tensor,
    position_arena: torch.Tensor,
    slots: torch.Tensor,
    position_slots: torch.Tensor,
    layer: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Write a step's tokens of layer ``layer`` into its arenas.

    Args:
        key_arena, value_arena: ``[rows, page_size, head_dim | value_dim]`` (written in place).
        position_arena: int64 ``[pages, page_size]`` (written in place).
        slots: int64 ``[layers, batch, kv_heads, tokens]``: each new token's flat slot
            (``row * page_size + offset``) in the key and value arenas.
        position_slots: int64 ``[layers, batch, kv_heads, tokens]``: its flat slot in
            ``position_arena`` (the same as ``slots`` for a pool whose arenas are indexed by page).
        keys, values: ``[batch, kv_heads, tokens, head_dim | value_dim]``.
        positions: int64 ``[batch, tokens]``: each new token's original position (every head).
    """
    torch.ops.kvlib.write_planned(key_arena, value_arena, position_arena, slots, position_slots, layer, keys, values, positions)


class SourceOwner(Protocol):
    """What reads its pages through a source of its own (a coded pool: its codec's fields decoded
    in the kernel): :meth:`page_source` gives the current one, or None."""

    def page_source(self) -> PageReader | None: ...


_SOURCES: weakref.WeakValueDictionary[int, SourceOwner] = weakref.WeakValueDictionary()
"""The owners ``kvlib::paged_decode_source`` reads through, by handle (their ``id``; held weakly)."""


def paged_decode(
    query: torch.Tensor,
    key_arena: torch.Tensor,
    value_arena: torch.Tensor,
    position_arena: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    layer: int,
    mask: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    received: torch.Tensor | None = None,
    owner: SourceOwner | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over layer ``layer``'s pages (see the module docstring): ``pages``
    int64 ``[layers, batch, kv_heads, max_pages]`` and ``lengths`` int64 ``[layers, batch,
    kv_heads]`` are the plan's, for every layer. ``received`` (float32 ``[batch, kv_heads,
    slots]``, zeros, at least each head's length of slots; optional) gets the attention each
    stored slot (block-table order) received: the softmax weights summed over the queries and
    averaged over the query heads of its KV head (H2O's accumulated attention of this call).

    One operator: ``kvlib::paged_decode`` over the float arenas (``owner`` None), else
    ``kvlib::paged_decode_source`` over pages that ``owner`` reads through its own source (a
    coded pool: open pages raw in ``key_arena`` / ``value_arena``, sealed pages as its codec's
    fields, decoded inside the kernel; values of ``value_arena.shape[-1]`` channels). There the
    arenas a planned write changes are still the operator's inputs, so that it is ordered after
    that write wherever a compiler moves operators; the rest is read through ``owner.page_source()``."""
    if owner is None:
        return torch.ops.kvlib.paged_decode(
            query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap or 0.0, received
        )
    _SOURCES[id(owner)] = owner
    return torch.ops.kvlib.paged_decode_source(
        id(owner),
        query,
        key_arena,
        value_arena,
        position_arena,
        pages,
        lengths,
        layer,
        mask,
        query_positions,
        scale,
        softcap or 0.0,
        received,
    )


def _write_planned(key_arena, value_arena, position_arena, slots, position_slots, layer, keys, values, positions) -> None:
    index = slots[layer].reshape(-1)
    key_arena.view(-1, key_arena.shape[-1]).index_copy_(0, index, keys.reshape(-1, key_arena.shape[-1]))
    value_arena.view(-1, value_arena.shape[-1]).index_copy_(0, index, values.reshape(-1, value_arena.shape[-1]))
    heads = slots.shape[2]
    position_arena.view(-1).index_copy_(0, position_slots[layer].reshape(-1), positions.unsqueeze(1).expand(-1, heads, -1).reshape(-1))


def mask_visibility(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The model's mask as bool ``[batch, queries, logical]`` (its first head row), or None."""
    if mask is None:
        return None
    visible = mask[:, 0]
    return visible if visible.dtype == torch.bool else visible > torch.finfo(visible.dtype).min


_CAUSAL = np.zeros(0, dtype=np.int64)


def decode_over(source: PageSource, query, pages, lengths, layer, mask, query_positions, scale, softcap, received=None) -> torch.Tensor:
    """``paged_decode``'s CPU work over any :class:`~kvlib.kernels.paged_attention.PageSource` (float
    arenas, or a codec's fields decoded in the kernel): the numba kernel of
    :func:`~kvlib.kernels.paged_attention.attend_pages` for a decode step's few queries, over the
    plan's CPU tensors read as numpy (each C-contiguous), and its result laid out as `transformers`
    attention functions return it: ``[batch, queries, query_heads, value_dim]`` in ``query``'s
    dtype. No torch operator but the query's conversion to float32, the mask's to bool and the
    result's back."""
    batch, query_heads, queries, dim = query.shape
    kv_heads = pages.shape[2]
    if query_heads % kv_heads:
        raise ValueError(f"query heads ({query_heads}) must be a multiple of KV heads ({kv_heads})")
    visible = mask_visibility(mask)
    floats = query.detach() if query.dtype == torch.float32 else query.detach().float()
    grouped = np.ascontiguousarray(floats.numpy().reshape(batch, kv_heads, query_heads // kv_heads * queries, dim))
    out = np.empty((*grouped.shape[:3], source.value_dim), dtype=np.float32)
    paged_attention_kernel(
        grouped,
        source.keys,
        source.values,
        source.positions,
        pages.numpy()[layer],
        lengths.numpy()[layer],
        np.zeros((batch, queries, 0), dtype=np.bool_) if visible is None else visible.numpy(),
        _CAUSAL if query_positions is None else query_positions.numpy(),
        source.load_keys,
        source.load_values,
        np.float32(scale),
        np.float32(softcap or 0.0),
        out,
        np.zeros((batch, kv_heads, 0), dtype=np.float32) if received is None else received.numpy(),
    )
    if queries > 1:  # [batch, kv_heads, group, queries, dim] -> [batch, queries, kv_heads, group, dim]
        out = np.ascontiguousarray(out.reshape(batch, kv_heads, -1, queries, out.shape[-1]).transpose(0, 3, 1, 2, 4))
    output = torch.from_numpy(out.reshape(batch, queries, query_heads, -1))
    return output if query.dtype == torch.float32 else output.to(query.dtype)


def _paged_decode_cpu(
    query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap, received=None
):
    if paged_kernel(key_arena.device) is not PagedKernel.NUMBA:  # another kernel chosen for the CPU (tests compare them)
        return _paged_decode_by_source(
            query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap, received
        )
    load = LOADERS[key_arena.dtype]
    source = PageSource(_float_bits(key_arena), _float_bits(value_arena), load, load, position_arena.numpy(), value_arena.shape[2])
    return decode_over(source, query, pages, lengths, layer, mask, query_positions, scale, softcap, received)


def _float_bits(arena: torch.Tensor) -> np.ndarray:
    """A float arena as the kernel reads it: float32 as it is, 16-bit floats as their bits."""
    return arena.numpy() if arena.dtype == torch.float32 else arena.view(torch.int16).numpy().view(np.uint16)


def _paged_decode_by_source(
    query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap, received=None
):
    reader = ARENA_SOURCES[paged_kernel(key_arena.device)](key_arena, value_arena, position_arena)
    options = {"visible": mask_visibility(mask), "query_positions": query_positions, "scale": scale, "softcap": softcap or None}
    if received is not None:
        _add_received(received, reader.weights(query, pages[layer], lengths[layer], **options), pages.shape[2])
    return reader.attend(query, pages[layer], lengths[layer], **options).transpose(1, 2).contiguous()


def _add_received(received: torch.Tensor, weights: torch.Tensor, kv_heads: int) -> None:
    """Add attention ``weights`` (``[batch, query_heads, queries, slots]``) to ``received``
    (``[batch, kv_heads, slots']``) as the CPU kernel adds them: summed over the queries, averaged
    over each KV head's query heads."""
    summed = weights.sum(2).view(weights.shape[0], kv_heads, -1, weights.shape[-1]).mean(2)
    width = min(received.shape[-1], summed.shape[-1])
    received[..., :width] += summed[..., :width]


def _paged_decode_source_cpu(
    source, query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap, received=None
):
    reader = _SOURCES[source].page_source()
    return decode_over(reader, query, pages, lengths, layer, mask, query_positions, scale, softcap, received)


def _paged_decode_source_cuda(
    source, query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap, received=None
):
    reader = _SOURCES[source].page_source()
    options = {"visible": mask_visibility(mask), "query_positions": query_positions, "scale": scale, "softcap": softcap or None}
    if received is not None:
        _add_received(received, reader.weights(query, pages[layer], lengths[layer], **options), pages.shape[2])
    return reader.attend(query, pages[layer], lengths[layer], **options).transpose(1, 2).contiguous()


def _paged_decode_fake(
    query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap, received=None
):
    batch, heads, queries, _ = query.shape
    return query.new_empty(batch, queries, heads, value_arena.shape[-1])


def _paged_decode_source_fake(source, *arguments, **keywords):
    return _paged_decode_fake(*arguments, **keywords)


for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("write_planned", _write_planned, _key)
_LIBRARY.impl("paged_decode", _paged_decode_cpu, "CPU")
_LIBRARY.impl("paged_decode", _paged_decode_by_source, "CUDA")
_LIBRARY.impl("paged_decode_source", _paged_decode_source_cpu, "CPU")
_LIBRARY.impl("paged_decode_source", _paged_decode_source_cuda, "CUDA")
torch.library.register_fake("kvlib::write_planned", lambda *args: None, lib=_LIBRARY)
torch.library.register_fake("kvlib::paged_decode", _paged_decode_fake, lib=_LIBRARY)
torch.library.register_fake("kvlib::paged_decode_source", _paged_decode_source_fake, lib=_LIBRARY)
