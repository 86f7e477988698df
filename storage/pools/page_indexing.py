"""Index arithmetic of the paged store: which heads copy a shared page, where new pages go in
the block table, the first occurrence of each id, and validated keep sets (no state; vectorized).

Block-table arithmetic runs on numpy arrays (the tables' numpy views, :class:`~kvlib.storage.layers.block_table.BlockTable`):
a handful of small integer ops on the host, none of them a trip through torch's dispatcher."""

from __future__ import annotations

import numpy as np
import torch


def heads_to_copy(refcount: np.ndarray, open_pages: np.ndarray, shared: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(batch, head)`` of the shared open pages that must be copied before an append
    (``refcount``: the pool's reference counts; ``open_pages`` int64 and ``shared`` bool ``[batch, heads]``).

    When every reference to a shared page is in this append's batch, its first holder keeps
    the original (it is the last owner once the others have their copies): no copy is wasted.
    """
    b, h = np.nonzero(shared)
    if b.size == 0:
        return b, h
    pages = open_pages[b, h]
    unique, first, counts = np.unique(pages, return_index=True, return_counts=True)
    keeps = np.zeros(pages.size, dtype=bool)
    keeps[first[refcount[unique] == counts]] = True
    return b[~keeps], h[~keeps]


def first_occurrences(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique ids, index of each one's first occurrence in ids)``."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((unique.numel(),), ids.numel(), dtype=torch.int64).scatter_reduce(0, inverse, torch.arange(ids.numel()), "amin")
    return unique, first


def page_coordinates(first: np.ndarray, counts: np.ndarray, heads: int) -> tuple[np.ndarray, ...]:
    """Table coordinates ``(batch, head, page_index)`` of ``counts[b*heads+h]`` new pages per
    head, numbered from ``first[b, h]`` on, in (batch, head, page) order."""
    group, offset = np.nonzero(np.arange(counts.max() if counts.size else 0) < counts[:, None])
    page_index = first.reshape(-1)[group] + offset
    return group // heads, group % heads, page_index


def sorted_keep(keep: torch.Tensor, lengths: np.ndarray, *, in_given_order: bool = False) -> np.ndarray:
    """Validate ``keep`` (int ``[batch, heads, k]``, any device) against ``lengths [batch, heads]``;
    return it as an int64 array sorted with -1 padding last (``in_given_order``: as given, its -1
    padding required to come last)."""
    if not isinstance(keep, torch.Tensor) or keep.dtype.is_floating_point or keep.dtype == torch.bool:
        raise ValueError("keep must be an integer tensor [batch, kv_heads, k] of token indices (-1 pads)")
    if keep.dim() != 3 or tuple(keep.shape[:2]) != tuple(lengths.shape):
        raise ValueError(f"keep must have shape [{lengths.shape[0]}, {lengths.shape[1]}, k], got {list(keep.shape)}")
    given = (keep if keep.device.type == "cpu" and keep.dtype == torch.int64 else keep.to("cpu", torch.int64)).numpy()
    past_end = np.iinfo(np.int64).max
    ordered = np.sort(np.where(given >= 0, given, past_end), axis=-1)
    out_of_range = (given < -1) | (given >= lengths[..., None])
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != past_end)  # sorted: a repeat sits beside its twin
    if out_of_range.any() or repeated.any():  # the message says which
        if out_of_range.any():
            raise ValueError("keep indices must be -1 (padding) or in [0, physical length) of their head")
        raise ValueError("keep indices repeat within a head")
    if in_given_order:
        if ((given[..., 1:] >= 0) & (given[..., :-1] < 0)).any():
            raise ValueError("keep must list each head's kept slots first, its -1 padding last")
        return given
    return np.where(ordered == past_end, -1, ordered)
