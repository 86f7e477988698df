"""The Engine's page budget: the pages per layer that ``page_budget_bytes`` holds and the prefix
cache's byte budget, worked out and checked before anything is allocated.

Units: pages are counted per layer (one page holds ``page_size`` tokens of one KV head). With a
codec, a sealed page counts at its encoded bytes and an open page (a head's partly filled last
page, held raw) as ``open_page_cost`` sealed pages (its raw bytes over a sealed page's, rounded
up), so the keys and values an Engine holds between steps stay within ``page_budget_bytes``;
without a codec both count one page. Positions (int64 per page slot) are bookkeeping on top of
the budget, but count when the budget is checked against the device's memory.

Invariants: a budget holds at least one open page per KV head of every layer (one token fits);
the pools and their positions fit in the memory the device has available; the prefix cache's
bytes are at most the page budget (its pages live there), or without one, within the device's
memory. Each failure is a ``ValueError`` naming the option, raised before anything is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlib.codec import Codec, layer_shapes
from kvlib.devices import check_fits
from kvlib.model_shape import KVShape

DEFAULT_PREFIX_CACHE_BYTES = 2**30
"""Bytes of unused cached pages kept without a page budget or ``prefix_cache_bytes``."""


@dataclass(frozen=True)
class PageBudget:
    """The store's sizes, checked before anything is allocated: ``pages`` per layer (None: the
    pools grow), each layer's page ``codecs`` (None: raw pages), ``prefix_bytes``, the bytes
    of unused cached pages the prefix index keeps, and ``open_page_cost``, the budget pages an
    open page counts for (its raw keys and values over a sealed page's encoded bytes, rounded
    up; 1 without a codec)."""

    pages: int | None
    codecs: list | None
    prefix_bytes: int
    open_page_cost: int = 1


def page_budget(
    shape: KVShape,
    *,
    codec: Codec | None,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    page_budget_bytes: int | None,
    prefix_cache_bytes: int | None,
) -> PageBudget:
    """The pages ``page_budget_bytes`` holds per layer (with a codec, sealed pages count at their
    encoded size, open pages at their raw size: ``open_page_cost`` encoded pages) and the prefix
    cache's byte budget; ``ValueError`` when the budget holds less than one open page per KV head
    or more than ``device`` has available (see :func:`_check_memory_budgets`). Positions (int64
    per page slot) are bookkeeping on top of the budget."""
    codecs = None
    if codec is not None:
        codecs = codec.layer_codecs(
            layer_shapes(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.value_dim, page_size, dtype, device)
        )
    raw_page_bytes = kv_page_bytes = page_size * (shape.head_dim + shape.value_dim) * dtype.itemsize
    if codecs is not None:  # the budget counts sealed pages at their encoded size
        kv_page_bytes = codecs[0].page_bytes()
    open_page_cost = math.ceil(raw_page_bytes / kv_page_bytes)
    pages = None if page_budget_bytes is None else page_budget_bytes // (shape.num_layers * kv_page_bytes)
    if pages is not None and pages < shape.num_kv_heads * open_page_cost:
        raise ValueError(
            f"page_budget_bytes={page_budget_bytes} holds {pages} pages per layer; one token needs"
            f" {shape.num_kv_heads * open_page_cost} (one open page of {raw_page_bytes} bytes, {open_page_cost} of {kv_page_bytes}"
            f" bytes, per KV head per layer, {shape.num_layers} layers)"
        )
    positions_bytes = 0 if pages is None else pages * shape.num_layers * page_size * 8  # int64 per page slot
    prefix_bytes = _check_memory_budgets(page_budget_bytes, prefix_cache_bytes, positions_bytes, device)
    return PageBudget(pages, codecs, prefix_bytes, open_page_cost)


def _check_memory_budgets(page_budget_bytes: int | None, prefix_cache_bytes: int | None, positions_bytes: int, device: torch.device) -> int:
    """The prefix cache's byte budget; ``ValueError`` (before anything is allocated) when the
    page budget, which the pools take up front with ``positions_bytes`` of their pages'
    positions, is more than ``device`` has available, or when ``prefix_cache_bytes`` is more than
    the page budget its pages live in (without one, more than the device has available)."""
    if page_budget_bytes is not None:
        check_fits(f"page_budget_bytes={page_budget_bytes}", page_budget_bytes + positions_bytes, device)
    if prefix_cache_bytes is None:
        return page_budget_bytes or DEFAULT_PREFIX_CACHE_BYTES
    if page_budget_bytes is not None and prefix_cache_bytes > page_budget_bytes:
        raise ValueError(
            f"prefix_cache_bytes={prefix_cache_bytes} is more than page_budget_bytes={page_budget_bytes}: the cached"
            " pages live in the page budget"
        )
    if page_budget_bytes is None:
        check_fits(f"prefix_cache_bytes={prefix_cache_bytes} (cached pages, no page budget)", prefix_cache_bytes, device)
    return prefix_cache_bytes
