"""kvlib's page kernels as torch custom operators: ``torch.ops.kvlib.*``.

A decode step of a planned cache (:mod:`kvlib.storage.store.step_plan`) costs each layer two operators, one
per job, whatever the device:

- ``kvlib::write_planned``: the layer's new keys, values and positions written into its arenas
  at the slots the step plan gave them (vLLM's ``reshape_and_cache`` for kvlib's per-head pages);
- ``kvlib::paged_decode`` (float arenas) or ``kvlib::paged_decode_coded`` (a coded pool: open
  pages raw, sealed pages as its codec's fields, decoded inside the kernel): the layer's
  attention straight over its pages, through the plan's block tables and lengths, returned in
  the layout `transformers` attention functions return.

Each takes the plan's tensors for every layer and the layer's index, so that no per-layer slice
of them is made before the call. Only tensors, ints, floats and strs cross an operator's
boundary: a coded pool hands its codec's fields as tensor lists and names the readers that decode
them (:class:`~kvlib.kernel_readers.KernelReader`: ``key_reader`` / ``value_reader`` and their
int parameters), which each kernel resolves itself (:mod:`kvlib.kernels.page_readers`). So a
decode step traces under ``torch.compile`` with every operator a single node (fake
implementations give shapes only), and caches of the same codec share a compiled graph. In
eager mode each is one trip through torch's dispatcher.

The CPU implementations run the numba kernels of :mod:`kvlib.kernels.paged_attention` over numpy
views of the arguments (:func:`~kvlib.kernels.host_arrays.host_array`), so they dispatch no torch
operator inside but the output's allocation (and, for a 16-bit query, its conversion back);
the CUDA ones run the Triton kernels of :mod:`kvlib.kernels.paged_attention_triton` where triton is
installed, else (float arenas only) the torch path of :mod:`kvlib.kernels.paged_attention_torch`
(:func:`kvlib.devices.paged_kernel` chooses).

Semantics of the decode operators are :func:`kvlib.kernels.paged_attention.paged_attention`'s:
query ``[batch, query_heads, queries, head_dim]``; ``mask`` the model's mask over logical
positions (``[batch, 1, queries, logical]``, bool or additive float; None: causal by
``query_positions [queries]``); output ``[batch, queries, query_heads, value_dim]`` in the
query's dtype, float32 accumulation.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvlib.devices import PAGED_KERNELS, PagedKernel, paged_kernel
from kvlib.kernel_readers import KernelReader
from kvlib.kernels.arena_sources import ARENA_SOURCES
from kvlib.kernels.host_arrays import host_array
from kvlib.kernels.paged_attention import PageSource, arena_source, coded_source, kernel_positions, kernel_query, run_kernel

_LIBRARY = torch.library.Library("kvlib", "DEF")  # noqa: TOR901 - the low-level API: a few microseconds a call, not tens

_LIBRARY.define(
    "write_planned(Tensor(a!) key_arena, Tensor(b!) value_arena, Tensor(c!) position_arena, Tensor slots, Tensor position_slots,"
    " int layer, Tensor keys, Tensor values, Tensor positions) -> ()"
)
_LIBRARY.define(
    "paged_decode(Tensor query, Tensor key_arena, Tensor value_arena, Tensor position_arena, Tensor pages, Tensor lengths,"
    " int layer, Tensor? mask, Tensor? query_positions, float scale, float softcap, Tensor(d!)? received=None) -> Tensor"
)
_LIBRARY.define(
    "paged_decode_coded(Tensor query, Tensor key_arena, Tensor value_arena, Tensor position_arena, Tensor pages, Tensor lengths,"
    " int layer, Tensor? mask, Tensor? query_positions, float scale, float softcap, Tensor sealed, Tensor raw_row,"
    " Tensor[] key_fields, str key_reader, int[] key_params, Tensor[] value_fields, str value_reader, int[] value_params,"
    " Tensor(d!)? received=None) -> Tensor"
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
) -> torch.Tensor:
    """Attention of ``query`` over layer ``layer``'s float pages (see the module docstring):
    ``pages`` int64 ``[layers, batch, kv_heads, max_pages]`` and ``lengths`` int64 ``[layers,
    batch, kv_heads]`` are the plan's, for every layer. ``received`` (float32 ``[batch, kv_heads,
    slots]``, at least each head's length of slots; optional) has the attention each stored slot
    (block-table order) received added to it: the softmax weights summed over the queries and
    averaged over the query heads of its KV head (H2O's accumulated attention, this call's part)."""
    return torch.ops.kvlib.paged_decode(
        query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap or 0.0, received
    )


def paged_decode_coded(
    query: torch.Tensor,
    raw_keys: torch.Tensor,
    raw_values: torch.Tensor,
    position_arena: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    layer: int,
    mask: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sealed: torch.Tensor,
    raw_row: torch.Tensor,
    keys: KernelReader,
    values: KernelReader,
    received: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_decode` over a coded pool's pages: open pages raw in ``raw_keys`` /
    ``raw_values`` at their row ``raw_row[page]`` (int64 ``[capacity]``), sealed pages (bool
    ``sealed [capacity]``, on the arenas' device) as the codec's fields, read in the kernel by the
    readers ``keys`` and ``values`` name. The raw arenas a planned write changes are the
    operator's inputs, so that it is ordered after that write wherever a compiler moves operators."""
    return torch.ops.kvlib.paged_decode_coded(
        query,
        raw_keys,
        raw_values,
        position_arena,
        pages,
        lengths,
        layer,
        mask,
        query_positions,
        scale,
        softcap or 0.0,
        sealed,
        raw_row,
        list(keys.fields),
        keys.kernel,
        list(keys.params),
        list(values.fields),
        values.kernel,
        list(values.params),
        received,
    )


@numba.njit(cache=True)
def _scatter_planned(key_arena, value_arena, position_arena, slots, position_slots, keys, values, positions) -> None:  # pragma: no cover
    """``kvlib::write_planned`` on host arrays (``slots`` / ``position_slots`` the layer's ``[batch,
    kv_heads, tokens]``; arenas and tokens as the same element type: floats or their bits)."""
    batch, heads, tokens = slots.shape
    page_size = key_arena.shape[1]
    for b in range(batch):
        for h in range(heads):
            for t in range(tokens):
                slot = slots[b, h, t]
                row, offset = slot // page_size, slot % page_size
                for c in range(key_arena.shape[2]):
                    key_arena[row, offset, c] = keys[b, h, t, c]
                for c in range(value_arena.shape[2]):
                    value_arena[row, offset, c] = values[b, h, t, c]
                place = position_slots[b, h, t]
                position_arena[place // page_size, place % page_size] = positions[b, t]


def _write_planned_cpu(key_arena, value_arena, position_arena, slots, position_slots, layer, keys, values, positions) -> None:
    _scatter_planned(
        host_array(key_arena),
        host_array(value_arena),
        host_array(position_arena),
        np.ascontiguousarray(host_array(slots)[layer]),
        np.ascontiguousarray(host_array(position_slots)[layer]),
        np.ascontiguousarray(host_array(keys)),
        np.ascontiguousarray(host_array(values)),
        np.ascontiguousarray(host_array(positions)),
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


_HALF_VIEWS = {torch.float16: np.float16}


def host_visibility(mask: torch.Tensor | None, batch: int, queries: int) -> np.ndarray:
    """:func:`mask_visibility` as the CPU kernel reads it, made on host arrays (no torch
    operator): bool ``[batch, queries, logical]``, C-contiguous; no columns when ``mask`` is None."""
    if mask is None:
        return np.zeros((batch, queries, 0), dtype=np.bool_)
    rows = host_array(mask)[:, 0]
    if mask.dtype == torch.bool:
        return np.ascontiguousarray(rows)
    if mask.dtype == torch.bfloat16:
        rows = (rows.astype(np.uint32) << np.uint32(16)).view(np.float32)
    elif mask.dtype == torch.float16:
        rows = rows.view(np.float16)
    return np.ascontiguousarray(rows > torch.finfo(mask.dtype).min)


def decode_over(source: PageSource, query, pages, lengths, layer, mask, query_positions, scale, softcap, received=None) -> torch.Tensor:
    """A decode operator's CPU work over any :class:`~kvlib.kernels.paged_attention.PageSource`
    (float arenas, or a coded pool's pages): the numba kernel over host arrays of the plan's
    layer ``layer``, its output laid out as `transformers` attention functions return it
    (``[batch, queries, query_heads, value_dim]``, in ``query``'s dtype). No torch operator but
    the output's allocation (and its conversion to a 16-bit query's dtype)."""
    batch, query_heads, queries, _ = query.shape
    kv_heads = pages.shape[2]
    if query_heads % kv_heads:
        raise ValueError(f"query heads ({query_heads}) must be a multiple of KV heads ({kv_heads})")
    out = torch.empty(batch, queries, query_heads, source.value_dim, dtype=torch.float32)
    run_kernel(
        source,
        *kernel_query(query.detach() if query.requires_grad else query),
        np.ascontiguousarray(host_array(pages)[layer]),
        np.ascontiguousarray(host_array(lengths)[layer]),
        host_visibility(mask, batch, queries),
        kernel_positions(query_positions),
        scale,
        softcap or None,
        host_array(out),
        np.zeros((batch, kv_heads, 0), dtype=np.float32) if received is None else host_array(received),
    )
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _paged_decode_cpu(
    query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap, received=None
):
    if PAGED_KERNELS["cpu"][0] is not PagedKernel.NUMBA:  # the CPU's first kernel (numba is always installed): tests choose another
        return _paged_decode_by_source(
            query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap, received
        )
    source = arena_source(key_arena, value_arena, position_arena)
    return decode_over(source, query, pages, lengths, layer, mask, query_positions, scale, softcap, received)


def _paged_decode_by_source(
    query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap, received=None
):
    reader = ARENA_SOURCES[paged_kernel(key_arena.device)](key_arena, value_arena, position_arena)
    return _attend_through(reader, query, pages, lengths, layer, mask, query_positions, scale, softcap, received)


def _attend_through(reader, query, pages, lengths, layer, mask, query_positions, scale, softcap, received) -> torch.Tensor:
    """A decode operator's work through a :class:`~kvlib.kernels.pages.PageReader` of torch
    tensors (the Triton kernels, the torch path)."""
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


def _coded_readers(key_fields, key_reader, key_params, value_fields, value_reader, value_params) -> tuple[KernelReader, KernelReader]:
    return KernelReader(key_reader, tuple(key_fields), tuple(key_params)), KernelReader(
        value_reader, tuple(value_fields), tuple(value_params)
    )


def _paged_decode_coded_cpu(
    query,
    raw_keys,
    raw_values,
    position_arena,
    pages,
    lengths,
    layer,
    mask,
    query_positions,
    scale,
    softcap,
    sealed,
    raw_row,
    key_fields,
    key_reader,
    key_params,
    value_fields,
    value_reader,
    value_params,
    received=None,
):
    keys, values = _coded_readers(key_fields, key_reader, key_params, value_fields, value_reader, value_params)
    source = coded_source(raw_keys, raw_values, sealed, raw_row, position_arena, keys, values)
    return decode_over(source, query, pages, lengths, layer, mask, query_positions, scale, softcap, received)


def _paged_decode_coded_cuda(
    query,
    raw_keys,
    raw_values,
    position_arena,
    pages,
    lengths,
    layer,
    mask,
    query_positions,
    scale,
    softcap,
    sealed,
    raw_row,
    key_fields,
    key_reader,
    key_params,
    value_fields,
    value_reader,
    value_params,
    received=None,
):
    from kvlib.kernels.paged_attention_triton import triton_coded_source  # triton is optional: CUDA builds of torch bring it

    keys, values = _coded_readers(key_fields, key_reader, key_params, value_fields, value_reader, value_params)
    reader = triton_coded_source(raw_keys, raw_values, sealed, raw_row, position_arena, keys, values)
    return _attend_through(reader, query, pages, lengths, layer, mask, query_positions, scale, softcap, received)


def _paged_decode_fake(
    query, key_arena, value_arena, position_arena, pages, lengths, layer, mask, query_positions, scale, softcap, received=None
):
    batch, heads, queries, _ = query.shape
    return query.new_empty(batch, queries, heads, value_arena.shape[-1])


def _paged_decode_coded_fake(query, raw_keys, raw_values, *arguments, received=None):
    batch, heads, queries, _ = query.shape
    return query.new_empty(batch, queries, heads, raw_values.shape[-1])


_LIBRARY.impl("write_planned", _write_planned_cpu, "CPU")
_LIBRARY.impl("write_planned", _write_planned, "CUDA")
_LIBRARY.impl("paged_decode", _paged_decode_cpu, "CPU")
_LIBRARY.impl("paged_decode", _paged_decode_by_source, "CUDA")
_LIBRARY.impl("paged_decode_coded", _paged_decode_coded_cpu, "CPU")
_LIBRARY.impl("paged_decode_coded", _paged_decode_coded_cuda, "CUDA")
torch.library.register_fake("kvlib::write_planned", lambda *args: None, lib=_LIBRARY)
torch.library.register_fake("kvlib::paged_decode", _paged_decode_fake, lib=_LIBRARY)
torch.library.register_fake("kvlib::paged_decode_coded", _paged_decode_coded_fake, lib=_LIBRARY)
