"""SpeCache: each decode step reads the pages the previous step's query chose (a speculative fetch)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlib.policies.tiering.quest import Quest
from kvlib.registry import register


@dataclass
class SpeculatedPages:
    """One layer's choice for its next decode step: ``chosen`` int64 ``[batch, kv_heads, k]`` (CPU,
    block-table indices, ascending, ``-1`` last), made when each head held ``pages_used`` pages
    (int64 ``[batch, kv_heads]``, CPU)."""

    chosen: torch.Tensor
    pages_used: torch.Tensor

    def fits(self, pages_used: torch.Tensor) -> bool:
        """Whether this choice was made for the step before one whose heads hold ``pages_used``:
        the same rows and heads, each head holding the pages it held then or one more (a decode
        step opens at most one page). Anything else (a new prompt, other rows) fits not."""
        if pages_used.shape != self.pages_used.shape:
            return False
        grown = pages_used - self.pages_used
        return bool(((grown == 0) | (grown == 1)).all())


@register("specache")
@dataclass
class SpeCache(Quest):
    """SpeCache (Jie, Tang, Han, Deng and Han, 2025, "SpeCache: Speculative Key-Value Caching for
    Efficient Generation of LLMs", arXiv:2503.16163): the whole KV cache lives in host memory, a
    low-bit copy of the keys stays on the device, and each decode step attends over the KV pairs
    that copy rates highest, fetched from the host. The fetch is speculative: the pairs the *next*
    step will read are chosen during the current step (the paper decodes a speculative next token
    beside the real one and lets its query choose), so their copy to the device overlaps the
    current step's computation instead of stalling the next one.

    How this maps onto kvlib's paged store:

    - The device-side key copy is the store's per-page key summaries (each page's channel-wise key
      minimum and maximum, :mod:`~kvlib.storage.pools.key_summaries`): they are exactly the two
      levels of a 1-bit, per-channel quantization of the page's keys (KIVI's key grouping, with the
      page as the group). The store keeps no per-token codes, so a page is rated by the best score
      any key of its 1-bit grid could give, ``sum_c max(q_c min_c, q_c max_c)`` (:meth:`page_scores`,
      Quest's bound; the largest over the query heads of a KV group), and the ``top_k`` best pages
      are chosen, the newest always. The paper chooses tokens; here the unit is the page.
    - Speculation: the query of step ``t`` stands for the query of step ``t + 1`` (the paper's
      speculative token is not decoded: kvlib runs the model's forward as the caller made it). A
      sparse decode step therefore attends over the pages the same layer chose at the previous
      step, plus each head's newest page (it holds the current token and any page opened since),
      and chooses with its own query the pages the next step reads. The first decode step after
      a prompt (nothing chosen yet) attends over the pages its own query chooses.
    - Reads: the chosen pages are staged from whichever tier holds them
      (:meth:`~kvlib.storage.store.paged_store.PagedStore.paged_selection`: host rows, pinned
      under CUDA, or lmdb records); the untouched pages are not read. The copy overlaps: right
      after a layer's sparse step, the store starts fetching the host and disk pages it chose for
      the next step (:meth:`expected_pages`, on the store's prefetcher: a background thread and,
      on CUDA, a copy stream; with a ``placement`` that prefetches, ``lru``'s default), while the
      rest of the step computes; the next step's read takes them where they are unchanged
      (``prefetched_pages_read``).
    - Nothing is evicted: every token stays stored (on the host under a ``placement``) and may be
      chosen again. When ``top_k`` covers every page a head holds, the output is the full cache's.

    The choice made at one step is kept per layer for the next (:class:`SpeculatedPages`), keyed
    by the ``layer_idx`` the cache passes to :meth:`select_pages`; every multi-token call of a
    layer (a prompt, a chunk) forgets its choice (:meth:`arranges_tokens` is asked after each),
    and a choice that does not fit the step's page counts (other rows, another prompt) is
    dropped. One object serves one cache at a time.

    Args:
        top_k: pages each (row, KV head) chooses for the next decode step (>= 1), its newest
            included; a step reads those and its newest page (``top_k + 1`` at most).
        dense_layers: leading layers that always attend over every page (>= 0).
        placement: the device/host placement giving the page budgets and disk tier
            (``lru(device_mb=..., host_mb=..., disk=...)``), as for :class:`Quest`; without one
            every page stays on the device.
    """

    speculated: dict[int, SpeculatedPages] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per layer, the choice its last sparse step made for the next (state, not a parameter)."""

    def arranges_tokens(self, layer_idx: int, query_length: int) -> bool:
        """Never (the store keeps the slot order); a multi-token call of ``layer_idx`` forgets the
        layer's speculated pages (a new prompt or chunk: they were chosen for other pages)."""
        if query_length > 1:
            self.speculated.pop(layer_idx, None)
        return False

    def select_pages(
        self, layer_idx: int, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor
    ) -> torch.Tensor:
        """The pages this step reads: those the layer chose at its previous step and each head's
        newest, int64 ``[batch, kv_heads, width]`` on the CPU (``width``: the most any head reads,
        ``top_k + 1`` at most), ascending, ``-1`` last; the first
        step after a prompt reads what its own query chooses. Chooses, with ``query``, the
        ``top_k`` pages the next step reads (:meth:`choose`)."""
        chosen = self.choose(layer_idx, query, key_min, key_max, pages_used)
        previous = self.speculated.get(layer_idx)
        self.speculated[layer_idx] = SpeculatedPages(chosen, pages_used.clone())
        if previous is None or not previous.fits(pages_used):
            return chosen
        newest = (pages_used - 1).unsqueeze(-1)
        listed = torch.cat([previous.chosen, newest], dim=-1)
        duplicate = (listed.unsqueeze(-1) == listed.unsqueeze(-2)).triu(1).any(-2)  # a later copy of an earlier entry
        past_end = int(pages_used.max()) + 1
        kept = (listed >= 0) & ~duplicate
        ordered = torch.where(kept, listed, past_end).sort(-1).values[..., : int(kept.sum(-1).max())]
        return torch.where(ordered == past_end, -1, ordered)

    def expected_pages(self, layer_idx: int) -> torch.Tensor | None:
        """The pages layer ``layer_idx`` chose at its last sparse step for its next one (the
        speculated pages: with a ``placement`` that prefetches, fetched from the host and disk
        while the rest of this step computes); None before its first."""
        speculated = self.speculated.get(layer_idx)
        return None if speculated is None else speculated.chosen

    def choose(
        self, layer_idx: int, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor
    ) -> torch.Tensor:
        """The ``top_k`` pages the 1-bit key grid rates highest for ``query``, newest included:
        Quest's choice (:meth:`Quest.select_pages`) for layer ``layer_idx``."""
        return super().select_pages(layer_idx, query, key_min, key_max, pages_used)
