"""Index arithmetic of the paged store: which heads copy a shared page, where new pages go in
the block table, the first occurrence of each id, and validated keep sets (no state; vectorized)."""

from __future__ import annotations

import torch

from kvlib.storage.pools.page_pool import PagePool


def heads_to_copy(pool: PagePool, open_pages: torch.Tensor, shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch, head)`` of the shared open pages that must be copied before an append.

    When every reference to a shared page is in this append's batch, its first holder keeps
    the original (it is the last owner once the others have their copies): no copy is wasted.
    """
    b, h = shared.nonzero(as_tuple=True)
    if b.numel() == 0:
        return b, h
    pages = open_pages[b, h]
    unique, inverse, counts = torch.unique(pages, return_inverse=True, return_counts=True)
    order = torch.arange(pages.numel())
    first = torch.full_like(unique, pages.numel()).scatter_reduce(0, inverse, order, "amin")
    keeps = torch.zeros(pages.numel(), dtype=torch.bool)
    keeps[first[pool.refcount[unique] == counts]] = True
    return b[~keeps], h[~keeps]


def first_occurrences(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique ids, index of each one's first occurrence in ids)``."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((unique.numel(),), ids.numel(), dtype=torch.int64).scatter_reduce(0, inverse, torch.arange(ids.numel()), "amin")
    return unique, first


def page_coordinates(first: torch.Tensor, counts: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """Table coordinates ``(batch, head, page_index)`` of ``counts[b*heads+h]`` new pages per
    head, numbered from ``first[b, h]`` on, in (batch, head, page) order."""
    # (nonzero of a [groups, max count] grid rather than repeat_interleave with tensor repeats,
    # which costs milliseconds per call on multi-threaded CPU torch)
    group, offset = (torch.arange(int(counts.max()) if counts.numel() else 0) < counts.unsqueeze(-1)).nonzero(as_tuple=True)
    page_index = first.flatten()[group] + offset
    return group // heads, group % heads, page_index


def sorted_keep(keep: torch.Tensor, lengths: torch.Tensor, *, in_given_order: bool = False) -> torch.Tensor:
    """Validate ``keep`` against ``lengths [batch, heads]``; return it sorted with -1 padding last
    (``in_given_order``: as given, on the CPU, its -1 padding required to come last)."""
    if not isinstance(keep, torch.Tensor) or keep.dtype.is_floating_point or keep.dtype == torch.bool:
        raise ValueError("keep must be an integer tensor [batch, kv_heads, k] of token indices (-1 pads)")
    if keep.device.type != "cpu" or keep.dtype != torch.int64:
        keep = keep.to("cpu", torch.int64)
    if keep.dim() != 3 or tuple(keep.shape[:2]) != tuple(lengths.shape):
        raise ValueError(f"keep must have shape [{lengths.shape[0]}, {lengths.shape[1]}, k], got {list(keep.shape)}")
    past_end = torch.iinfo(torch.int64).max
    ordered = torch.where(keep >= 0, keep, past_end).sort(dim=-1).values
    out_of_range = (keep < -1) | (keep >= lengths.unsqueeze(-1))
    repeated = (ordered.diff(dim=-1) == 0) & (ordered[..., 1:] != past_end)  # sorted: a repeat sits beside its twin
    if bool(out_of_range.any() | repeated.any()):  # one check on the way through; the message says which
        if bool(out_of_range.any()):
            raise ValueError("keep indices must be -1 (padding) or in [0, physical length) of their head")
        raise ValueError("keep indices repeat within a head")
    if in_given_order:
        if bool(((keep[..., 1:] >= 0) & (keep[..., :-1] < 0)).any()):
            raise ValueError("keep must list each head's kept slots first, its -1 padding last")
        return keep
    return torch.where(ordered == past_end, -1, ordered)
