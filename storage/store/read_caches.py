"""The paged store's read caches: per layer, at most one dense copy of the last batch read,
kept in step with the store's changes or dropped (see :mod:`kvlib.storage.layers.read_cache`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlib.storage.layers.read_cache import DenseReadCache, LayerRead

Gather = Callable[[torch.Tensor, int], LayerRead]
"""Gathers rows (int64 ``[batch]``) of a layer into fresh dense tensors of that many slots a head."""


class ReadCaches:
    """At most one :class:`~kvlib.storage.layers.read_cache.DenseReadCache` per layer (``caches[layer]``, None
    when the layer has none).

    Invariant: a layer's read cache holds, for each of its rows, exactly what reading that sequence
    from the pages gives; every change to a cached sequence either updates the read cache the same
    way (appends, hole fills, truncations of the cached batch) or drops it.

    Args:
        num_layers: layers of the store.
        page_size: tokens per page (read caches are sized in whole pages).
        enabled: build read caches on reads (False: every read is a transient workspace).
    """

    def __init__(self, num_layers: int, page_size: int, enabled: bool) -> None:
        self.page_size = page_size
        self.enabled = enabled
        self._caches: list[DenseReadCache | None] = [None] * num_layers

    def __getitem__(self, layer: int) -> DenseReadCache | None:
        return self._caches[layer]

    def rows(self, layer: int) -> tuple[int, ...]:
        """The sequences ``layer``'s read cache holds, in its row order (empty without one)."""
        cache = self._caches[layer]
        return () if cache is None else cache.rows

    def nbytes(self) -> int:
        """Bytes of every read cache's buffers."""
        return sum(cache.nbytes() for cache in self._caches if cache is not None)

    def clear(self) -> None:
        """Drop every read cache."""
        self._caches = [None] * len(self._caches)

    def read(self, layer: int, rows: torch.Tensor, lengths: torch.Tensor, gather: Gather, *, keep: bool) -> LayerRead | None:
        """``rows``' tokens of ``layer`` from its read cache (a view; ``lengths`` int64 ``[batch,
        kv_heads]`` their stored lengths): the read cache as it is when it holds exactly ``rows``;
        extended by the rows that joined it (``gather`` reads only those) when it holds their
        leading part and ``keep``; built anew when read caches are enabled and ``keep``. None when
        the caller is to read a workspace instead (the layer's read cache then stays as it is)."""
        key = tuple(rows.tolist())
        cache = self._caches[layer]
        if cache is not None and cache.rows == key:
            return cache.view()
        if keep and cache is not None and cache.rows and key[: len(cache.rows)] == cache.rows:
            joined = rows[len(cache.rows) :]  # sequences joined the cached batch: gather only them
            size = -(-int(lengths[len(cache.rows) :].max()) // self.page_size) * self.page_size
            cache.add_rows(tuple(joined.tolist()), gather(joined, max(size, self.page_size)), lengths[len(cache.rows) :].clone())
            return cache.view()
        if not self.enabled or not keep:
            return None
        longest = int(lengths.max()) if lengths.numel() else 0
        headroom = max(self.page_size, longest // 4)
        capacity = -(-(longest + headroom) // self.page_size) * self.page_size
        cache = DenseReadCache(key, gather(rows, capacity), lengths, self.page_size)
        self._caches[layer] = cache
        return cache.view()

    def drop(self, layer: int, rows: torch.Tensor) -> None:
        """Drop ``layer``'s read cache if it holds any of ``rows`` (they changed in a way it does not follow)."""
        cache = self._caches[layer]
        if cache is not None and not set(cache.rows).isdisjoint(rows.tolist()):
            self._caches[layer] = None

    def forget(self, rows: torch.Tensor) -> None:
        """Released sequences ``rows`` leave every read cache; the other rows stay cached."""
        gone = set(rows.tolist())
        for cache in self._caches:
            if cache is not None and not gone.isdisjoint(cache.rows):
                cache.drop_rows(gone)

    def follow_append(
        self, layer: int, rows: torch.Tensor, key: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Keep ``layer``'s read cache in step with an append to ``rows`` (``key``, as a tuple):
        extended when it caches these rows or a leading part of them (the others join it at the
        next read), dropped when it caches any of them otherwise."""
        cache = self._caches[layer]
        if cache is None:
            return
        cached = len(cache.rows)
        if cache.rows == key[:cached]:
            cache.append(keys[:cached], values[:cached], positions[:cached])
        else:
            self.drop(layer, rows)

    def follow_compaction(
        self, layer: int, rows: torch.Tensor, reorder: torch.Tensor, moves: tuple[torch.Tensor, ...] | None, new_lengths: torch.Tensor
    ) -> None:
        """Keep ``layer``'s read cache in step with a compaction of ``rows``: patched (the tokens
        ``moves`` moved and vacated only) when no changed head of its rows was rewritten in order
        (``reorder``, bool ``[batch, kv_heads]``), else dropped."""
        cache = self._caches[layer]
        if cache is None:
            return
        where = {seq: i for i, seq in enumerate(cache.rows)}
        cache_row = torch.tensor([where.get(seq, -1) for seq in rows.tolist()], dtype=torch.int64)
        cached = cache_row >= 0
        if not bool(cached.any()):
            return
        if bool(reorder[cached].any()):
            self._caches[layer] = None
            return
        lengths = cache.lengths.clone()
        lengths[cache_row[cached]] = new_lengths[cached]
        b, h, hole, src = moves if moves is not None else (torch.zeros(0, dtype=torch.int64),) * 4
        inside = cached[b]
        cache.fill_holes(cache_row[b[inside]], h[inside], hole[inside], src[inside], lengths)

    def follow_truncation(self, layer: int, rows: torch.Tensor, new_lengths: torch.Tensor) -> None:
        """Cut ``layer``'s read cache to ``new_lengths`` when it holds exactly ``rows``, else drop it
        if it holds any of them."""
        cache = self._caches[layer]
        if cache is not None and cache.rows == tuple(rows.tolist()):
            cache.truncate(new_lengths)
        else:
            self.drop(layer, rows)
