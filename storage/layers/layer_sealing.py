"""Sealing one layer of the paged store: which full pages of a batch are new since the last
seal, handed to the layer's pool to encode (with the pages holding the same tokens in the
partner layer, for a pool that seals in pairs): :class:`LayerSealing`, a part of
:class:`~kvlib.storage.layers.layer_pages.LayerPages`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlib.storage.layers.layer_state import LayerState


class LayerSealing(LayerState):
    """Sealing the full pages of one layer."""

    def seal(self, rows: torch.Tensor, salience: Callable[[], torch.Tensor] | None = None, partner: LayerState | None = None) -> int:
        """Seal the full pages of ``rows`` not considered before (past ``table.sealed``), with
        :meth:`~kvlib.storage.pools.page_pool.PagePool.seal_full_pages`; returns how many pages (or
        pairs) were sealed: 0 for a pool that does not seal now. ``partner``: the layer that
        ``pool.partner_layer`` names, for a pool that seals in pairs (None otherwise).

        ``salience``, called only when some page is to be sealed, gives float ``[len(rows),
        kv_heads, slots]`` scores of the layer's stored slots (slot ``s`` of a head lies in its
        table's page ``s // page_size``); each page sealed gets its tokens' scores.

        With a partner layer, a page counts as full once both it and its partner page are (the
        shorter of the two heads decides), and ``sealed`` counters then mean "considered", not
        "sealed": a page whose partner does not hold the same tokens stays open.
        """
        pool, table = self.pool, self.table
        if not pool.seals:
            return 0
        if partner is None:  # the common case, looked up in numpy: a decode step seals a page a page_size of steps
            rows_np = rows.numpy()
            if not bool((table.lengths_np[rows_np] // table.page_size > table.sealed_np[rows_np]).any()):
                return 0
        paired = [table] if partner is None else [table, partner.table]
        page_size = table.page_size
        full = torch.stack([t.lengths[rows] for t in paired]).amin(0) // page_size
        done = table.sealed[rows]
        if not bool((full > done).any()):
            return 0
        width = min(t.pages.shape[2] for t in paired)
        page_slot = torch.arange(width)
        candidate = (page_slot >= done.unsqueeze(-1)) & (page_slot < full.unsqueeze(-1))
        ids = [t.pages[rows][:, :, :width][candidate] for t in paired]
        table.sealed[rows] = torch.maximum(done, full)
        scores = None if salience is None else page_scores(salience(), candidate, page_size)
        return pool.seal_full_pages(ids[0], ids[1] if partner is not None else None, scores)


def page_scores(scores: torch.Tensor, candidate: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[n, page_size]``: the slot ``scores [batch, heads, slots]`` of the pages ``candidate``
    (bool ``[batch, heads, pages]``) marks, in its order; slots past ``scores``' last are ``-inf``."""
    batch, heads, pages = candidate.shape
    width = pages * page_size
    if scores.shape[-1] < width:
        scores = torch.nn.functional.pad(scores, (0, width - scores.shape[-1]), value=-torch.inf)
    return scores[..., :width].reshape(batch, heads, pages, page_size)[candidate.to(scores.device)]
