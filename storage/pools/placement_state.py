"""What a tiered pool knows of its pages for placement, and the order its rule makes of them.

Per page id (CPU tensors, grown with the pool): ``last_use`` int64, the pool's clock at the
page's last allocation or write (reads never count: a decode step reads every page); ``score``
float32, its placement score from the last ranking, higher stays on the device (``+inf`` for a
page never ranked since it was allocated). The rule (:class:`~kvlib.placement.Placement`'s
``leaving_order``) sees them as :class:`~kvlib.placement.PageStats` and decides the order; the
pool moves pages in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from kvlib.placement import PageStats
from kvlib.storage.pools.formats.page_format import extend_rows


class PlacementState:
    """Placement facts of a pool of ``capacity`` pages, ordered by ``leaving_order``."""

    def __init__(self, capacity: int, leaving_order: Callable[[PageStats], torch.Tensor]) -> None:
        self.last_use = torch.zeros(capacity, dtype=torch.int64)
        self.score = torch.full((capacity,), float("inf"))
        self._clock = 0
        self._leaving_order = leaving_order

    def grow(self, capacity: int) -> None:
        self.last_use = extend_rows(self.last_use, capacity, 0)
        self.score = extend_rows(self.score, capacity, float("inf"))

    def allocated(self, ids: torch.Tensor) -> None:
        """Pages ``ids`` were just allocated: unranked (``+inf``) and just used."""
        self.score[ids] = float("inf")
        self.used(ids)

    def used(self, ids: torch.Tensor) -> None:
        """Pages ``ids`` were just allocated or written: one clock tick, theirs."""
        self._clock += 1
        self.last_use[ids] = self._clock

    def rank(self, ids: torch.Tensor, scores: torch.Tensor) -> None:
        """Pages ``ids`` score ``scores`` (float; a page named more than once takes its highest)."""
        self.score[ids] = float("-inf")
        self.score.scatter_reduce_(0, ids, scores.float(), "amax")

    def stats(self, ids: torch.Tensor, tier: Literal["device", "host"]) -> PageStats:
        """What the rule is shown of pages ``ids`` (int64, distinct) when asked which of them leave ``tier`` first."""
        return PageStats(ids, self.last_use[ids], self.score[ids], tier)

    def leaving(self, ids: torch.Tensor, tier: Literal["device", "host"]) -> torch.Tensor:
        """Pages ``ids`` (int64, distinct) in the order the rule has them leave ``tier``, first
        first. ``ValueError`` if the rule's order is not a permutation of them."""
        order = self._leaving_order(self.stats(ids, tier))
        if order.shape != ids.shape or not torch.equal(order.sort().values, torch.arange(ids.numel())):
            raise ValueError(f"a placement's leaving_order must be a permutation of range({ids.numel()}), got {order!r}")
        return ids[order]
