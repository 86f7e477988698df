"""Rows of a :class:`~kvlib.adapters.cache.transformers_cache.KVCache` forked by reference: a whole
cache (:meth:`KVCache.fork <kvlib.adapters.cache.transformers_cache.KVCache.fork>`) and rows
selected, repeated or reordered in place (beam search's ``reorder_cache``,
``batch_repeat_interleave``, ``batch_select_indices``).

A fork of a row is a new store sequence sharing the row's pages in every layer (store sequences
span layers), copy-on-write: tokens either side adds later go to pages of its own, so neither sees
what the other appends.

Invariants: no page is copied; every page a selection leaves behind is released (the old rows'
references), so a selection neither leaks nor frees pages a kept row reads; rows are replaced in
place (a prefix session shares the cache's row list); the rows' padding and the compressor's
per-row state follow the rows; a forked cache evicts nothing and keeps every layer's length and
slot order. Caches a fork cannot copy are refused before anything is shared
(:func:`check_forkable`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlib.adapters.cache.state_layers import select_state_rows

if TYPE_CHECKING:
    from kvlib.adapters.cache.transformers_cache import KVCache


def check_forkable(cache: KVCache) -> None:
    """``ValueError`` for a cache that still evicts, one primed from a PrefixStore, one with a
    tiering policy, and one that holds nothing yet (see :meth:`KVCache.fork
    <kvlib.adapters.cache.transformers_cache.KVCache.fork>`)."""
    if cache.compressor is not None:
        raise ValueError(f"fork needs a cache that no longer evicts; this one runs {cache.compressor.policy.spec()}")
    if cache.session is not None:
        raise ValueError("fork is for caches outside a PrefixStore; this one was primed from one (make_cache(reuse=...))")
    if cache.tiering is not None:
        raise ValueError(f"fork is for caches without tiering; this one spills pages with {cache.tiering.spec()}")
    if cache.state_layers:
        raise ValueError(
            "fork shares pages by reference; this model's layers keep state outside the pages (recurrent states, indexer keys),"
            " which a fork cannot share"
        )
    if not cache.rows:
        raise ValueError("the cache holds no tokens yet: run the model with it first")


def share_rows(cache: KVCache, copy: KVCache) -> None:
    """Make the empty ``copy`` (built with ``cache``'s shape, page size, read mirror, codec and
    spec) hold what ``cache`` holds, by reference: its store, a fork of each row, the fitted
    codecs of the shared pages, each layer's length and slot order, the rows' padding."""
    copy.home = cache.home
    copy.builder.codecs = cache.builder.codecs  # fitted codecs of the shared pages
    copy.store = cache.store
    copy.reuse_slots = cache.reuse_slots
    copy.rows.extend(cache.store.fork(row) for row in cache.rows)
    copy.padding = cache.padding.clone()
    for mine, theirs in zip(copy.kv_layers, cache.kv_layers):
        mine.seen, mine.identity = theirs.seen, theirs.identity


def select_rows(cache: KVCache, index: torch.Tensor) -> None:
    """Row ``i`` of ``cache`` becomes a fork of old row ``index[i]`` in every layer; the padding, the
    compressor's per-row state and the state layers keep outside the pages (a hybrid model's
    recurrent states, a sparse-attention indexer's keys) follow.
    ``ValueError`` for an index out of range."""
    rows = cache.rows
    if not rows:
        return
    index = torch.as_tensor(index).to("cpu", torch.int64).flatten()
    if bool(((index < 0) | (index >= len(rows))).any()):
        raise ValueError(f"row indices must be in [0, {len(rows)}), got {index.tolist()}")
    if index.tolist() == list(range(len(rows))):
        return
    old = list(rows)
    rows[:] = [cache.store.fork(old[i]) for i in index.tolist()]  # in place: a prefix session shares the list
    cache.store.release(old)
    cache.padding = cache.padding[index.to(cache.padding.device)]
    if cache.compressor is not None:
        cache.compressor.select_rows(index)
    for layer in cache.state_layers:
        select_state_rows(layer, index)
