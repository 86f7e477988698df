"""LouisKV: pages retrieved only at semantic boundaries (when the query drifts), reused in between."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kvlib.policies.tiering.quest import Quest
from kvlib.registry import register


@dataclass
class Retrieval:
    """One layer's last retrievals, per (row, KV head): ``query`` float32 ``[batch, query_heads,
    head_dim]`` (on the device) and ``chosen`` int64 ``[batch, kv_heads, k]`` (CPU, block-table
    indices, ascending, ``-1`` last): the query each head's last retrieval used and the pages it
    chose; ``since`` int64 ``[batch, kv_heads]``: the pages the head held then (pages opened since,
    the tokens generated since, are read too); ``seen``: the pages each head held at the layer's
    last step."""

    query: torch.Tensor
    chosen: torch.Tensor
    since: torch.Tensor
    seen: torch.Tensor

    def fits(self, query: torch.Tensor, pages_used: torch.Tensor) -> bool:
        """Whether these retrievals belong to the step before one with this ``query`` and heads
        holding ``pages_used``: the same rows and heads, each head holding what it held at the
        last step or one page more. Anything else (a new prompt, other rows) fits not."""
        if pages_used.shape != self.seen.shape or query.shape[:2] != self.query.shape[:2]:
            return False
        grown = pages_used - self.seen
        return bool(((grown == 0) | (grown == 1)).all())


def query_similarity(query: torch.Tensor, last: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The cosine similarity of each query head's ``query`` ``[batch, query_heads, head_dim]`` to
    ``last`` (the same shape), the least over the query heads of each KV group: float32
    ``[batch, kv_heads]`` (a group drifts when any of its heads does)."""
    similarity = torch.nn.functional.cosine_similarity(query.float(), last.float(), dim=-1)
    return similarity.view(query.shape[0], kv_heads, -1).amin(-1)


@register("louiskv")
@dataclass
class LouisKV(Quest):
    """LouisKV (Wu, Si, Pan, Wang and Zhang, 2025, "LouisKV: Efficient KV Cache Retrieval for Long
    Input-Output Sequences", arXiv:2510.11292): the KV entries a decode step needs change little from
    one step to the next (temporal locality), so retrieval runs only at semantic boundaries, when
    the query has drifted from the one the last retrieval used; in between, every step attends
    over the last retrieved entries and what was generated since.

    Rule (per row and KV head, at each decode step of a sparse layer): the boundary test is the
    cosine similarity between the step's query and the query of the head's last retrieval, the
    least over the query heads of its group; below ``threshold`` (or at the first step after a
    prompt) the head retrieves: the ``top_k`` pages whose Quest bound is highest for this query,
    its newest page always. Otherwise it reuses its last retrieved pages, plus every page opened
    since that retrieval (the generated tokens' pages, the paper's recent output segment). Only
    the pages read are copied from their tier (host rows, pinned under CUDA, or lmdb records under
    ``placement='lru(..., disk=...)'``); nothing is evicted.

    Departures: the paper's retrieval units are clusters of the prompt's keys and temporal segments
    of the output, with centroids on the device; here the unit is the page and its stand-in the
    page's key minimum and maximum (Quest's bound), as for ``quest``. The boundary criterion is
    the paper's (query similarity to the last retrieval's query, under a threshold); the default
    ``threshold`` is this implementation's choice.

    Per layer the last retrievals are kept (:class:`Retrieval`), keyed by the ``layer_idx`` the
    cache passes to :meth:`select_pages`; every multi-token call of a layer (a prompt, a chunk)
    forgets them (:meth:`arranges_tokens` is asked after each), as do page counts that do not
    follow the last step's. :attr:`retrievals` counts, per layer, the (row, KV head) retrievals
    made. One object serves one cache at a time.

    Args:
        top_k: pages a head retrieves at a boundary (>= 1), its newest included.
        threshold: a head retrieves when its query's cosine similarity to its last retrieval's
            query falls below this, in [-1, 1] (-1: never after the first step; 1: at every step
            whose query changed).
        dense_layers: leading layers that always attend over every page (>= 0).
        placement: the device/host placement (``lru(...)``, ``score_aware(...)``), as for :class:`Quest`.
    """

    threshold: float = 0.9
    last: dict[int, Retrieval] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per layer, its heads' last retrievals (state, not a parameter)."""
    retrievals: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per layer, the (row, KV head) retrievals made since this object was built."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not -1 <= self.threshold <= 1:
            raise ValueError(f"threshold must be in [-1, 1] (a cosine similarity), got {self.threshold}")

    def arranges_tokens(self, layer_idx: int, query_length: int) -> bool:
        """Never (the store keeps the slot order); a multi-token call of ``layer_idx`` forgets the
        layer's retrievals (a new prompt or chunk)."""
        if query_length > 1:
            self.last.pop(layer_idx, None)
        return False

    def select_pages(
        self, layer_idx: int, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor
    ) -> torch.Tensor:
        """The pages this step reads, int64 ``[batch, kv_heads, width]`` on the CPU, ascending, ``-1``
        last: for a head at a boundary (:meth:`boundaries`) its fresh ``top_k`` (Quest's choice),
        for the others their last retrieved pages and every page opened since."""
        kv_heads = key_min.shape[1]
        now = query[:, :, -1].float()
        last = self.last.get(layer_idx)
        if last is None or not last.fits(now, pages_used):
            boundary = torch.ones(pages_used.shape, dtype=torch.bool)
            last = Retrieval(
                now, super().select_pages(layer_idx, query, key_min, key_max, pages_used), pages_used.clone(), pages_used.clone()
            )
        else:
            boundary = self.boundaries(now, last.query, kv_heads)
            if bool(boundary.any()):  # pages are scored only where some head retrieves
                last = self.retrieve(last, boundary, now, super().select_pages(layer_idx, query, key_min, key_max, pages_used), pages_used)
            else:
                last = dataclasses.replace(last, seen=pages_used.clone())
        self.last[layer_idx] = last
        self.retrievals[layer_idx] = self.retrievals.get(layer_idx, 0) + int(boundary.sum())
        return self.reading(last, pages_used)

    def expected_pages(self, layer_idx: int) -> torch.Tensor | None:
        """What layer ``layer_idx`` read at its last sparse step (its heads' retrievals and the
        pages opened since): the next step reads the same wherever no boundary comes (temporal
        locality, the paper's premise), so a store that prefetches fetches those; None before
        the layer's first retrieval."""
        last = self.last.get(layer_idx)
        return None if last is None else self.reading(last, last.seen)

    def boundaries(self, query: torch.Tensor, last: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """bool ``[batch, kv_heads]`` (CPU): the heads whose query (``[batch, query_heads,
        head_dim]``) drifted from their last retrieval's ``last``: similarity below ``threshold``
        (:func:`query_similarity`)."""
        return (query_similarity(query, last, kv_heads) < self.threshold).cpu()

    @staticmethod
    def retrieve(last: Retrieval, boundary: torch.Tensor, query: torch.Tensor, fresh: torch.Tensor, pages_used: torch.Tensor) -> Retrieval:
        """``last`` with the heads at a ``boundary`` retrieved anew (``fresh`` pages, this ``query``,
        ``pages_used`` held since), every head having seen ``pages_used``."""
        width = max(fresh.shape[-1], last.chosen.shape[-1])
        pad = torch.nn.functional.pad
        chosen = torch.where(
            boundary.unsqueeze(-1),
            pad(fresh, (0, width - fresh.shape[-1]), value=-1),
            pad(last.chosen, (0, width - last.chosen.shape[-1]), value=-1),
        )
        groups = query.shape[1] // boundary.shape[1]
        drifted = boundary.to(query.device).repeat_interleave(groups, dim=1).unsqueeze(-1)
        return Retrieval(torch.where(drifted, query, last.query), chosen, torch.where(boundary, pages_used, last.since), pages_used.clone())

    @staticmethod
    def reading(last: Retrieval, pages_used: torch.Tensor) -> torch.Tensor:
        """Each head's retrieved pages and those opened since its retrieval (indices from its
        ``since - 1``, the newest page then, up to its newest now), ascending, ``-1`` last."""
        count = int(pages_used.max())
        page = torch.arange(count)
        held = page < pages_used.unsqueeze(-1)
        listed = torch.zeros(*pages_used.shape, count + 1, dtype=torch.bool)
        listed.scatter_(-1, torch.where(last.chosen >= 0, last.chosen, count), True)
        read = (listed[..., :count] | (page >= (last.since - 1).unsqueeze(-1))) & held
        ordered = torch.where(read, page, count).sort(-1).values[..., : int(read.sum(-1).max())]
        return torch.where(ordered == count, -1, ordered)
