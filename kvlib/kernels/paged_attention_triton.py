"""Attention of a few queries per row over a layer's pages with Triton kernels: a paged decode
path for CUDA that reads float pages and a coded pool's sealed pages in place.

:func:`attend_pages_triton` computes what :func:`kvlib.kernels.paged_attention.paged_attention` computes
(the same arguments, shapes and mask rules: query head ``i`` uses KV head ``i // (query_heads //
kv_heads)``; a stored token at position ``p`` is visible to query ``q`` of row ``b`` iff
``visible[b, q, p]``, or with no mask iff ``0 <= p <= query_positions[q]``; scores ``scale *
q.k``, optionally ``softcap * tanh(s / softcap)``; float32 accumulation whatever the pages'
dtype; zeros for a query that sees no token; output ``[batch, query_heads, queries, value_dim]``
in the query's dtype), with no dense copy of the layer:

- one program per (row, KV head, split) holds the whole GQA group's ``group * queries`` query
  rows as one tile, so each key and value is read once for the group, and walks its split's
  tokens :data:`TILE_TOKENS` at a time with an online softmax; a second kernel merges the
  splits by their log-sum-exps (:mod:`kvlib.kernels.triton_decode_kernels`);
- splits: the tokens of the longest (row, KV head) cut into at most :data:`MAX_SPLITS` runs of
  at least :data:`SPLIT_TOKENS` tokens, and no more than fill :data:`TARGET_PROGRAMS` programs
  (:func:`split_plan`): one split for a short context or a large batch, several for a long
  context over few heads. Each split is a whole number of tiles;
- pages are read through tile loaders (:mod:`kvlib.kernels.triton_tiles` has the contract): a
  float arena's tokens, or a coded pool's, where open pages are read raw and sealed pages
  decoded in registers from the codec's fields by the loader registered under the name the
  codec's :class:`~kvlib.kernel_readers.KernelReader` gives (:mod:`kvlib.kernels.page_readers`;
  kivi, kv_bits, int8, fp8 and rotated have one). A codec without one is read densely
  (:func:`has_triton_loaders`).

Index and bookkeeping tensors (``pages``, ``lengths``, ``visible``, ``query_positions``, a coded
pool's ``sealed`` and ``raw_row``) may be on the CPU: they move to the arenas' device through
:func:`kvlib.devices.to_arena_device`. The number of splits is read from ``lengths`` (a device
synchronisation unless it is on the CPU, as the torch path's block count).
Products run on tensor cores in the query's half dtype with split operands, or in IEEE float32
for float32 queries (:mod:`kvlib.kernels.triton_products`). Without a GPU the kernels run in Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1`` set before the kernels' modules are
imported): that is how the tests check them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvlib.devices import to_arena_device
from kvlib.kernel_readers import KernelReader
from kvlib.kernels.page_readers import TRITON_LOADERS, triton_loader
from kvlib.kernels.query_groups import grouped_rows
from kvlib.kernels.triton_decode_kernels import attend_splits, merge_splits, score_tiles
from kvlib.kernels.triton_products import dot_dtype
from kvlib.kernels.triton_tiles import load_float_tile

TILE_TOKENS = 32
"""Tokens a program reads per step (``BLOCK_N``): a tile may span several pages."""

SPLIT_TOKENS = 256
"""The fewest tokens a split covers when a context is cut into several (:func:`split_plan`)."""

MAX_SPLITS = 32
"""The most splits of one (row, KV head)."""

TARGET_PROGRAMS = 512
"""Programs of the first kernel beyond which more splits do not pay: a few per SM of a current
GPU (an H100 has 132), enough to fill it while each split still reads hundreds of tokens."""

WIDE_CHANNELS = 128
"""Head or value dims from which the attention kernel runs 8 warps instead of 4: at 128 channels
its tiles (keys and values of :data:`TILE_TOKENS` tokens, the accumulator) took all 255 registers
of 4 warps' threads and spilled (ptxas for sm_90, float arenas); 8 warps held them without
spilling (128 registers for float32 pages, under 200 for half ones)."""

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes of float arenas (and of a coded pool's open pages) the kernels read."""


class TileSource(NamedTuple):
    """How the kernels read one tensor (keys or values) of a layer's pages: a tile loader, the
    tuple of tensors and the tuple of constexpr params it takes (:mod:`kvlib.kernels.triton_tiles`),
    and the tensor's channels."""

    load: object
    tensors: tuple[torch.Tensor, ...]
    params: tuple[int, ...]
    dim: int


class TritonPageSource(NamedTuple):
    """A layer's pages as the Triton kernels read them, on their own device: keys and values as
    :class:`TileSource` s, and each page's token positions (int64 ``[capacity, page_size]``, same
    device). The counterpart of :class:`kvlib.kernels.paged_attention_torch.TorchPageSource` (float
    arenas only) that also reads coded pools; a :class:`~kvlib.kernels.pages.PageReader`."""

    keys: TileSource
    values: TileSource
    positions: torch.Tensor

    @property
    def value_dim(self) -> int:
        """Value channels per token."""
        return self.values.dim

    def attend(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`attend_pages_triton` of ``query`` over these pages; ``options``: its keyword arguments."""
        return attend_pages_triton(query, self, pages, lengths, **options)

    def attend_parts(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`attend_parts_triton` of ``query`` over these pages: float32 output and log-sum-exps."""
        return attend_parts_triton(query, self, pages, lengths, **options)

    def weights(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`attention_weights_triton` of ``query`` over these pages; ``options``: its keyword arguments."""
        return attention_weights_triton(query, self, pages, lengths, **options)


def triton_arena_source(key_arena: torch.Tensor, value_arena: torch.Tensor, positions: torch.Tensor) -> TritonPageSource:
    """The :class:`TritonPageSource` of float arenas ``[capacity, page_size, head_dim | value_dim]``
    (one of :data:`FLOAT_DTYPES`, keys and values alike, contiguous) and their positions."""
    if key_arena.dtype not in FLOAT_DTYPES or value_arena.dtype != key_arena.dtype:
        raise ValueError(f"pages must be one of {FLOAT_DTYPES} (keys and values alike), got {key_arena.dtype} / {value_arena.dtype}")
    if not (key_arena.is_contiguous() and value_arena.is_contiguous() and positions.is_contiguous()):
        raise ValueError("the Triton kernels read contiguous arenas and positions")
    return TritonPageSource(
        TileSource(load_float_tile, (key_arena,), (), key_arena.shape[2]),
        TileSource(load_float_tile, (value_arena,), (), value_arena.shape[2]),
        positions,
    )


def has_triton_loaders(keys: KernelReader, values: KernelReader) -> bool:
    """Whether the Triton kernels have a tile loader for both readers (else the layer is read densely)."""
    return keys.kernel in TRITON_LOADERS and values.kernel in TRITON_LOADERS


def triton_coded_source(
    raw_keys: torch.Tensor,
    raw_values: torch.Tensor,
    sealed: torch.Tensor,
    raw_row: torch.Tensor,
    positions: torch.Tensor,
    keys: KernelReader,
    values: KernelReader,
) -> TritonPageSource:
    """The :class:`TritonPageSource` of a coded pool's pages (:class:`~kvlib.storage.pools.formats.coded_format.CodedPages`'s
    layout): open pages in the raw arenas ``[raw_rows, page_size, head_dim | value_dim]`` (a
    float compute dtype) at ``raw_row`` (int64 ``[capacity]``), sealed ones (``sealed [capacity]``,
    bool or uint8) read by the tile loaders ``keys`` and ``values`` name, from their fields (on the
    raw arenas' device); ``positions`` int64 ``[capacity, page_size]``. ValueError for a reader
    with no Triton loader (:func:`has_triton_loaders`)."""
    if raw_keys.dtype not in FLOAT_DTYPES or raw_values.dtype != raw_keys.dtype:
        raise ValueError(f"open pages must be one of {FLOAT_DTYPES}, got {raw_keys.dtype} / {raw_values.dtype}")
    device = raw_keys.device
    flags = to_arena_device(sealed, device)
    flags = flags if flags.dtype == torch.uint8 else flags.view(torch.uint8)
    rows = to_arena_device(raw_row, device)
    return TritonPageSource(_coded_tiles(keys, raw_keys, rows, flags), _coded_tiles(values, raw_values, rows, flags), positions)


def _coded_tiles(reader: KernelReader, raw: torch.Tensor, raw_row: torch.Tensor, sealed: torch.Tensor) -> TileSource:
    """The :class:`TileSource` of a coded reader with the pool's open part before its fields."""
    return TileSource(triton_loader(reader.kernel), (raw, raw_row, sealed, *reader.fields), reader.params, raw.shape[2])


def split_plan(longest: int, pairs: int, splits: int | None = None) -> tuple[int, int]:
    """``(splits, tokens per split)`` for ``pairs`` (row, KV head) pairs whose longest holds
    ``longest`` tokens: ``splits`` when given (at most; fewer where the tiles run out), else
    ``ceil(longest / SPLIT_TOKENS)`` capped by :data:`MAX_SPLITS` and by ``TARGET_PROGRAMS /
    pairs``, at least 1. Each split covers a whole number of :data:`TILE_TOKENS` tiles."""
    if splits is None:
        splits = min(math.ceil(longest / SPLIT_TOKENS), MAX_SPLITS, math.ceil(TARGET_PROGRAMS / max(pairs, 1)))
    elif splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    tiles = max(1, math.ceil(longest / TILE_TOKENS))
    per_split = math.ceil(tiles / max(splits, 1))
    return math.ceil(tiles / per_split), per_split * TILE_TOKENS


class _Launch(NamedTuple):
    """What every kernel launch of a call shares: the grouped queries, index tensors on the
    arenas' device, and the constexprs of the shapes and the visibility rule."""

    grouped: torch.Tensor
    pages: torch.Tensor
    lengths: torch.Tensor
    visible: torch.Tensor | None
    query_positions: torch.Tensor | None
    longest: int
    """Tokens of the longest (row, KV head); 0 also under a mask over no positions (nothing is
    seen): the kernels are then not launched."""
    shape: dict[str, object]

    @staticmethod
    def of(query, source: TritonPageSource, pages, lengths, visible, query_positions) -> _Launch:
        batch, _, queries, dim = query.shape
        kv_heads = pages.shape[1]
        rows = grouped_rows(query, pages, visible, query_positions)
        device = source.positions.device
        grouped = query.detach().to(device).reshape(batch * kv_heads, rows, dim).contiguous()
        nothing_visible = lengths.numel() == 0 or (visible is not None and visible.shape[-1] == 0)
        longest = 0 if nothing_visible else int(lengths.max())
        shape = dict(
            KV_HEADS=kv_heads,
            QUERIES=queries,
            ROWS=rows,
            HEAD_DIM=dim,
            PAGE_SIZE=source.positions.shape[1],
            BLOCK_M=triton_block(rows),
            BLOCK_D=triton_block(dim),
            CAUSAL=visible is None,
            DOT=dot_dtype(query.dtype, device),
        )
        return _Launch(
            grouped,
            to_arena_device(pages, device).reshape(batch * kv_heads, pages.shape[2]).contiguous(),
            to_arena_device(lengths, device).reshape(-1).contiguous(),
            None if visible is None else to_arena_device(visible, device).contiguous().view(torch.uint8),
            None if query_positions is None else to_arena_device(query_positions, device).contiguous(),
            longest,
            shape,
        )

    @property
    def mask_arguments(self) -> tuple:
        """``(visible, query_positions, logical)`` as the kernels take them (``logical``: the mask's columns, 0 when causal)."""
        logical = 0 if self.visible is None else self.visible.shape[2]
        return self.visible, self.query_positions, logical


def triton_block(size: int) -> int:
    """``size`` rounded up to a power of two, at least 16 (the smallest ``tl.dot`` operand side)."""
    return max(16, 1 << max(size - 1, 0).bit_length())


def attend_pages_triton(
    query: torch.Tensor,
    source: TritonPageSource,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    *,
    visible: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """:func:`kvlib.kernels.paged_attention.paged_attention` over pages however ``source`` holds them
    (float arenas, or a coded pool's open and sealed pages), by the Triton kernels; ``splits``:
    at most this many splits per (row, KV head) (None: :func:`split_plan`'s choice). The other
    arguments and the result are :func:`~kvlib.kernels.paged_attention.paged_attention`'s; the result is
    on the arenas' device."""
    out, _ = _attend(query, source, pages, lengths, visible, query_positions, scale, softcap, splits, with_lse=False)
    return out


def attend_parts_triton(
    query: torch.Tensor,
    source: TritonPageSource,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    *,
    visible: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_pages_triton` as a partial attention (:func:`kvlib.kernels.paged_attention.attend_parts`):
    the output in float32 ``[batch, query_heads, queries, value_dim]`` and each query's
    log-sum-exp, float32 ``[batch, query_heads, queries]`` (``-inf`` where it sees nothing), on
    the arenas' device."""
    return _attend(query, source, pages, lengths, visible, query_positions, scale, softcap, splits, with_lse=True)


def _attend(
    query, source, pages, lengths, visible, query_positions, scale, softcap, splits, *, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton kernels' output ``[batch, query_heads, queries, value_dim]`` (float32 with
    ``with_lse``, else the query's dtype) and, with ``with_lse``, the log-sum-exps ``[batch,
    query_heads, queries]`` (else None)."""
    launch = _Launch.of(query, source, pages, lengths, visible, query_positions)
    pairs, rows = launch.grouped.shape[:2]
    value_dim = source.value_dim
    device = source.positions.device
    dtype = torch.float32 if with_lse else query.dtype
    out = (torch.empty if launch.longest else torch.zeros)(pairs, rows, value_dim, dtype=dtype, device=device)
    lse = torch.full((pairs, rows), float("-inf"), dtype=torch.float32, device=device) if with_lse else out
    count, split_tokens = split_plan(launch.longest, pairs, splits)
    several = count > 1
    partial = torch.empty(pairs, count, rows, value_dim, dtype=torch.float32, device=device) if several else out
    partial_lse = torch.empty(pairs, count, rows, dtype=torch.float32, device=device) if several else out
    block_v = triton_block(value_dim)
    if launch.longest:
        attend_splits[(pairs, count)](
            launch.grouped,
            launch.pages,
            launch.pages.shape[1],
            launch.lengths,
            source.positions,
            *launch.mask_arguments,
            out,
            partial,
            partial_lse,
            lse,
            split_tokens,
            float(scale),
            float(softcap or 1.0),
            source.keys.tensors,
            source.values.tensors,
            LOAD_KEYS=source.keys.load,
            KEY_PARAMS=source.keys.params,
            LOAD_VALUES=source.values.load,
            VALUE_PARAMS=source.values.params,
            VALUE_DIM=value_dim,
            BLOCK_N=TILE_TOKENS,
            BLOCK_V=block_v,
            SOFTCAP=bool(softcap),
            SPLIT=several,
            WITH_LSE=with_lse,
            num_warps=8 if max(launch.shape["HEAD_DIM"], value_dim) >= WIDE_CHANNELS else 4,
            **launch.shape,
        )
        if several:
            merge_splits[(pairs,)](
                partial,
                partial_lse,
                out,
                lse,
                count,
                ROWS=rows,
                VALUE_DIM=value_dim,
                BLOCK_M=launch.shape["BLOCK_M"],
                BLOCK_V=block_v,
                WITH_LSE=with_lse,
            )
    batch, query_heads, queries, _ = query.shape
    return out.view(batch, query_heads, queries, value_dim), lse.view(batch, query_heads, queries) if with_lse else None


def attention_weights_triton(
    query: torch.Tensor,
    source: TritonPageSource,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    *,
    visible: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`kvlib.kernels.paged_scores.attention_weights` over pages however ``source`` holds them (keys
    only): the scores by a Triton kernel, slot by slot, then a softmax in torch. float32
    ``[batch, query_heads, queries, pages.shape[2] * page_size]`` on the arenas' device."""
    launch = _Launch.of(query, source, pages, lengths, visible, query_positions)
    pairs, rows = launch.grouped.shape[:2]
    slots = launch.pages.shape[1] * source.positions.shape[1]
    scores = torch.full((pairs, rows, slots), float("-inf"), dtype=torch.float32, device=source.positions.device)
    tiles = math.ceil(launch.longest / TILE_TOKENS)
    if tiles:
        score_tiles[(pairs, tiles)](
            launch.grouped,
            launch.pages,
            launch.pages.shape[1],
            launch.lengths,
            source.positions,
            *launch.mask_arguments,
            scores,
            slots,
            float(scale),
            float(softcap or 1.0),
            source.keys.tensors,
            LOAD_KEYS=source.keys.load,
            KEY_PARAMS=source.keys.params,
            BLOCK_N=TILE_TOKENS,
            SOFTCAP=bool(softcap),
            **launch.shape,
        )
    batch, query_heads, queries, _ = query.shape
    weights = torch.softmax(scores.view(batch, query_heads, queries, slots), dim=-1)
    return weights.nan_to_num_(0.0)  # a query that sees nothing: all -inf, softmax NaN
