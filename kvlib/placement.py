"""Placement rules: the order in which a tiered pool's pages leave a tier.

A rule is a :class:`Placement`: ``leaving_order(pages)`` ranks candidate pages, first to leave
first. The pool (:class:`~kvlib.storage.pools.formats.tiered_format.TieredPages`) keeps the facts
(:class:`PageStats`) and applies the order; it never decides one. Every tiering policy is a
placement (:meth:`kvlib.policy.Tiering.leaving_order`), and the cache hands its policy to the
pools it builds.

Where a pool asks:

- a page needs a device row and none is free: the first of the other device pages leave for the
  host (``tier="device"``);
- a move would take the host past its budget: the first of the host pages go on to disk
  (``tier="host"``);
- a ranking (:meth:`~kvlib.storage.pools.formats.tiered_format.TieredPages.rank`) asks for the order of every
  page in use, wherever it lies (``tier="device"``): the last ``device_pages`` of it are the
  pages the device then holds.

An order only chooses pages: outputs are the same whatever a rule says (reads return what was
written, whatever tier holds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch


@dataclass(frozen=True)
class PageStats:
    """What a pool knows of candidate pages, one entry per page (CPU tensors of equal length).

    ``ids`` int64: the page ids, distinct, in no particular order (ascending, for a pool's own
    calls). ``last_write`` int64: the pool's clock at each page's last allocation or write (a step
    counter, higher is more recent; reads never count: a decode step reads every page).
    ``score`` float32: each page's placement score from the last ranking, higher stays
    (``+inf`` for a page never ranked since it was allocated). ``tier``: the tier whose leaving
    order is asked, ``"device"`` or ``"host"`` (see the module docstring).
    """

    ids: torch.Tensor
    last_write: torch.Tensor
    score: torch.Tensor
    tier: Literal["device", "host"]


class Placement(Protocol):
    """A placement rule (every :class:`~kvlib.policy.Tiering` policy is one)."""

    def leaving_order(self, pages: PageStats) -> torch.Tensor:
        """int64 ``[len(pages.ids)]``, a permutation of ``range(len(pages.ids))``: the candidates'
        indices in the order they leave ``pages.tier``, first to leave first."""


def least_recently_written(pages: PageStats) -> torch.Tensor:
    """Pages written longest ago first (scores ignored). Equal clocks: leaving the device, in
    candidate order; leaving the host, in the order torch's default (unstable) sort gives them,
    as the disk tier has always chosen."""
    if pages.tier == "host":
        return pages.last_write.argsort()
    return pages.last_write.argsort(stable=True)


def lowest_score_first(pages: PageStats) -> torch.Tensor:
    """Leaving the device: the lowest-scored pages first, the least recently written first among
    equal scores (so pages never ranked leave least recently written first). Leaving the host:
    :func:`least_recently_written` (a ranking chooses the device's pages only)."""
    if pages.tier == "host":
        return least_recently_written(pages)
    order = pages.last_write.argsort(stable=True)
    return order[pages.score[order].argsort(stable=True)]
