"""Per-page key summaries: the channel-wise minimum and maximum of each page's stored keys.

Quest (Tang et al., 2024) bounds the attention score a query can give a page from these two
vectors alone, so they stay on the compute device (a few bytes per page) whatever tier holds
the page's keys. The pool that owns a :class:`KeySummaries` keeps it current on every change
to its pages; nothing recomputes them from the keys at read time.

Invariant (``tests/kvlib/test_key_summaries.py`` checks it after every step of the store state
machine): for a page in use, ``key_min[page]`` and ``key_max[page]`` are the channel-wise min and
max of the keys in the page's first ``n`` slots, where ``n`` is the number of tokens the heads
referencing it hold in that page (the same for all of them: a head truncated inside a shared page
gets a private copy); a free page has ``+inf`` / ``-inf`` (the identities of min and max).
"""

from __future__ import annotations

import torch

from kvlib.devices import to_arena_device


class KeySummaries:
    """Channel-wise key minima and maxima per page, ``[capacity, head_dim]`` each, on ``device``
    in the compute ``dtype`` (min and max of values are exact in any dtype)."""

    def __init__(self, capacity: int, page_size: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.page_size = page_size
        self.key_min = torch.full((capacity, head_dim), float("inf"), dtype=dtype, device=device)
        self.key_max = torch.full((capacity, head_dim), float("-inf"), dtype=dtype, device=device)

    def nbytes(self) -> int:
        return 2 * self.key_min.numel() * self.key_min.element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's summaries (its key minimum and maximum)."""
        return 2 * self.key_min.shape[1] * self.key_min.element_size()

    def grow(self, capacity: int) -> None:
        """Extend to ``capacity`` pages; new pages are empty."""
        for name, fill in (("key_min", float("inf")), ("key_max", float("-inf"))):
            old = getattr(self, name)
            new = torch.full((capacity, old.shape[1]), fill, dtype=old.dtype, device=old.device)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def shrink(self, capacity: int) -> None:
        """Keep the first ``capacity`` pages' summaries (the rest were freed)."""
        self.key_min = self.key_min[:capacity].clone()
        self.key_max = self.key_max[:capacity].clone()

    def clear(self, ids: torch.Tensor) -> None:
        """Pages ``ids`` (int64, CPU) hold no tokens any more (freed)."""
        if ids.numel():
            index = to_arena_device(ids, self.key_min.device)
            self.key_min.index_fill_(0, index, float("inf"))
            self.key_max.index_fill_(0, index, float("-inf"))

    def add(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Fold the keys written at flat ``slots`` (int64 ``[n]``, CPU) into their pages' summaries
        (``keys [n, head_dim]`` on the summaries' device)."""
        if slots.numel():
            pages = to_arena_device(slots // self.page_size, self.key_min.device).unsqueeze(-1).expand(keys.shape)
            self.key_min.scatter_reduce_(0, pages, keys.to(self.key_min.dtype), "amin")
            self.key_max.scatter_reduce_(0, pages, keys.to(self.key_max.dtype), "amax")

    def copy(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Pages ``target[i]`` became copies of ``source[i]``."""
        src = to_arena_device(source, self.key_min.device)
        dst = to_arena_device(target, self.key_min.device)
        self.key_min.index_copy_(0, dst, self.key_min.index_select(0, src))
        self.key_max.index_copy_(0, dst, self.key_max.index_select(0, src))

    def recompute(self, ids: torch.Tensor, keys: torch.Tensor, filled: torch.Tensor) -> None:
        """Summaries of pages ``ids`` from their keys ``[n, page_size, head_dim]`` (on the device),
        counting only each page's first ``filled[i]`` slots (int64, CPU): after a truncation."""
        if ids.numel() == 0:
            return
        device = self.key_min.device
        held = to_arena_device((torch.arange(self.page_size) < filled.unsqueeze(-1)).unsqueeze(-1), device)
        index = to_arena_device(ids, device)
        self.key_min.index_copy_(0, index, keys.masked_fill(~held, float("inf")).amin(1).to(self.key_min.dtype))
        self.key_max.index_copy_(0, index, keys.masked_fill(~held, float("-inf")).amax(1).to(self.key_max.dtype))
