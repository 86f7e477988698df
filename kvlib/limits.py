"""Bounds on the sizes users give kvlib, checked before anything is allocated or run.

Each bound is far above what a working configuration uses and low enough that a typo (an extra
zero, a byte count passed as a token count) fails at once with a ``ValueError`` naming the
argument, its value, the bound and why, instead of allocating for minutes and being killed:

- :data:`MAX_PAGE_SIZE`: tokens per page;
- :data:`MAX_BUDGET_TOKENS`: an eviction budget given as a token count;
- :data:`MAX_SPEC_CHARS` and :data:`MAX_SPEC_TERMS`: the size of a spec string;
- memory: what a store preallocates (its first page arenas, or a fixed page budget) must fit in
  the memory its device has available (:func:`kvlib.devices.check_fits`).
"""

from __future__ import annotations

from kvlib.errors import quoted

MAX_PAGE_SIZE = 4096
"""Most tokens per page. Pages amortise per-page costs (a block-table entry, a kernel's page
loop, a codec's scales) and are the unit of eviction, sharing and sealing: 16 to 256 tokens
already amortise the costs, while every head's open page, a store's first arenas (64 pages per
layer) and the read mirror's rounding all grow with the page. At 4096 a prefix is shared, and
a quantized page sealed, only in 4096-token steps."""

MAX_BUDGET_TOKENS = 2**32
"""Most tokens an int eviction budget may keep per (layer, KV head): beyond any model's context
(a larger budget evicts nothing), and small enough that budgets summed over heads and layers,
and positions, stay exact in int64."""

MAX_SPEC_CHARS = 4096
"""Longest spec string parsed (``ast`` builds a tree as deep as the spec has terms)."""

MAX_SPEC_TERMS = 64
"""Most strategies in one spec: a spec holds one per kind, and reuse strategies beside them."""


def check_page_size(page_size: object) -> int:
    """``page_size`` if it is an int in ``[1, MAX_PAGE_SIZE]``; else ``ValueError`` saying why."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1 (tokens per page), got {quoted(page_size)}")
    if page_size > MAX_PAGE_SIZE:
        raise ValueError(
            f"page_size={page_size} is over the limit of {MAX_PAGE_SIZE} tokens per page: every head's open page and"
            " the first page arenas grow with it, and pages past a few hundred tokens save nothing (typical: 16-256)"
        )
    return page_size
