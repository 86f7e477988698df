"""LeoAM: variable-size chunks of pages, judged coarse to fine by their key abstracts, fetched by importance."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlib.policies.tiering.quest import Quest
from kvlib.registry import register


@dataclass
class ChunkLevels:
    """What one sparse step's coarse-to-fine judgement kept, per level (coarsest first): ``sizes``
    the chunk size of each level in pages (``chunk_pages``, halved down to 1); ``kept[i]`` bool
    ``[batch, kv_heads, chunks]``, the level's chunks that were judged important (candidates whose
    bound is within ``desert`` of the best); ``scored[i]`` the chunks judged there (int, summed over
    rows and heads). A chunk not kept is a desert: none of its pages is judged again or fetched."""

    sizes: list[int]
    kept: list[torch.Tensor]
    scored: list[int]


def chunk_abstracts(
    key_min: torch.Tensor, key_max: torch.Tensor, alive: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The abstracts of the chunks of ``size`` consecutive pages (page ``p`` in chunk ``p // size``):
    each chunk's channel-wise key minimum and maximum over its ``alive`` pages (bool ``[batch,
    kv_heads, pages]``, ``pages`` a multiple of ``size``), float32 ``[batch, kv_heads, chunks,
    head_dim]`` (0 where a chunk has no alive page), and bool ``[batch, kv_heads, chunks]``: the
    chunks with an alive page. ``key_min`` / ``key_max``: the pages' ``[batch, kv_heads, pages, head_dim]``."""
    batch, heads, pages, dim = key_min.shape
    gone = ~alive.unsqueeze(-1)
    low = key_min.float().masked_fill(gone, float("inf")).view(batch, heads, pages // size, size, dim).amin(3)
    high = key_max.float().masked_fill(gone, float("-inf")).view(batch, heads, pages // size, size, dim).amax(3)
    live = alive.view(batch, heads, pages // size, size).any(-1)
    return low.masked_fill(~live.unsqueeze(-1), 0.0), high.masked_fill(~live.unsqueeze(-1), 0.0), live


def chunk_bounds(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Each query head's bound on its scaled score against any key of each chunk, float32
    ``[batch, kv_heads, group, chunks]``: ``sum_c max(q_c low_c, q_c high_c) / sqrt(head_dim)``
    (Quest's bound over the chunk's abstract). ``query`` ``[batch, query_heads, 1, head_dim]``
    (grouped by KV head as ``repeat_kv`` lays them out); ``low`` / ``high`` ``[batch, kv_heads,
    chunks, head_dim]``."""
    batch, kv_heads, chunks, dim = low.shape
    q = query[:, :, -1].float().view(batch, kv_heads, -1, 1, dim)
    return torch.maximum(q * low.unsqueeze(2), q * high.unsqueeze(2)).sum(-1) / dim**0.5


@register("leoam")
@dataclass
class LeoAM(Quest):
    """LeoAM (Sun, Li, Xiao and Xu, 2025, "Breaking the Boundaries of Long-Context LLM Inference:
    Adaptive KV Management on a Single Commodity GPU", arXiv:2506.20187): the KV cache is spread
    over GPU, CPU memory and disk; attention is skewed, with long contiguous runs of tokens that
    receive almost none ("attention deserts"), and how much of the context is desert varies with
    the layer and the decoding step. LeoAM therefore judges the KV in variable-size chunks from a
    small abstract of each (its Lightweight KV Abstract, so that judging a chunk does not need its
    KV), skips deserts whole and fetches only the important chunks from wherever they lie.

    How this maps onto kvlib's paged store (what the paper's text available here did not pin
    down is this implementation's reading, said as such):

    - Chunks: pages have a fixed size (``page_size`` tokens), so a chunk is a run of consecutive
      pages of one (row, KV head). Chunk sizes are chosen adaptively at every decode step, coarse to
      fine (this implementation's reading of the paper's adaptive partition): the head's pages
      (its newest excepted) are judged in aligned chunks of ``chunk_pages`` pages; a chunk whose
      bound trails the best chunk's by more than ``desert`` (a scaled logit, so its keys get at
      most ``exp(-desert)`` of the best chunk's weight by that estimate) is a desert and dropped
      whole; each kept chunk is halved and its halves judged the same way, down to single pages
      (:class:`ChunkLevels` records each level). What survives is runs of pages of any length:
      long where the attention has no desert, cut where it has. Of the surviving pages the
      ``top_k - 1`` best are read, with each head's newest page (it holds the current token), so
      a step reads fewer pages where the attention is concentrated (more deserts) and at most
      ``top_k`` per head.
    - Abstracts: a page's abstract is its channel-wise key minimum and maximum, which the store
      keeps on the device for every page (the key summaries, ``2 * head_dim`` numbers per page,
      kept as the page is written); a chunk's abstract is the minimum and maximum over its pages
      (:func:`chunk_abstracts`), computed when judged and never stored, so coarse levels cost no
      memory. A chunk's importance is the bound ``sum_c max(q_c min_c, q_c max_c) / sqrt(d)`` on
      the query's score against any of its keys (:func:`chunk_bounds`; Quest's bound, the paper's
      abstract being per-chunk key statistics), the largest over the query heads of a KV group
      (GQA: a chunk one head needs is kept for the group). The paper keeps its abstracts beside
      the chunks on disk and reads them there; here they stay on the device.
    - Tiers: the chunks themselves (the pages' keys and values) live where the ``placement``
      puts them (``lru(device_mb=..., host_mb=..., disk=...)``: the newest pages on the device, the
      rest in the host arena and, past ``host_mb``, as checked lmdb records), and the chosen pages
      are staged from there by the store's own read path
      (:meth:`~kvlib.storage.store.paged_store.PagedStore.paged_selection`); nothing is copied
      aside. The paper's dynamic compression is the spec's codec (``kivi(bits=4)+leoam(...)``: sealed
      pages travel encoded; a tiering policy does not choose codecs per chunk), and its three-tier
      pipeline is the store's prefetcher, which takes dense reads of the next layer, not a selection.
    - Nothing is evicted; the first ``dense_layers`` layers and every multi-token call attend over
      every page. With ``top_k`` covering every page and ``desert`` larger than any gap, the output
      is the full cache's.

    Per layer, :attr:`fetched` counts the pages its sparse steps chose (summed over rows and heads,
    the newest included), :attr:`judged` the chunks their levels judged and :attr:`steps` its sparse
    steps, each keyed by the ``layer_idx`` the cache passes to :meth:`select_pages`. One object
    serves one cache at a time.

    Args:
        top_k: pages each (row, KV head) reads at most at a decode step (>= 1), its newest included.
        chunk_pages: pages of the coarsest chunks, a power of two (>= 1; 1 judges pages alone).
        desert: how far (scaled logit, > 0) a chunk's bound may trail the best one of its level
            before it is skipped whole; larger keeps more.
        dense_layers: leading layers that always attend over every page (>= 0).
        placement: the device/host/disk placement giving the page budgets (``lru(...)``,
            ``score_aware(...)``), as for :class:`Quest`; without one every page stays on the device.
    """

    chunk_pages: int = 8
    desert: float = 6.0
    fetched: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per layer, pages its sparse steps chose (rows and heads summed; state, not a parameter)."""
    judged: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per layer, chunks its sparse steps judged over every level (rows and heads summed)."""
    steps: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per layer, its sparse steps."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_pages < 1 or self.chunk_pages & (self.chunk_pages - 1):
            raise ValueError(f"chunk_pages must be a power of two >= 1 (pages of the coarsest chunks), got {self.chunk_pages}")
        if not self.desert > 0:
            raise ValueError(f"desert must be > 0 (a scaled-logit gap to the best chunk), got {self.desert}")

    def select_pages(
        self, layer_idx: int, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor
    ) -> torch.Tensor:
        """The pages this step reads, int64 ``[batch, kv_heads, min(top_k, pages)]`` on the CPU,
        ascending, ``-1`` last: each head's newest and the ``top_k - 1`` best pages that survive
        the coarse-to-fine judgement (:meth:`judge`). Counts them in :attr:`fetched`."""
        newest, pages, levels = self.judge(query, key_min, key_max, pages_used)
        count = key_min.shape[2]
        score = chunk_bounds(query, key_min, key_max).amax(2).masked_fill(~levels.kept[-1][..., :count], float("-inf"))
        chosen = newest & pages
        if self.top_k > 1 and count:
            best, index = score.topk(min(self.top_k - 1, count), dim=-1)
            chosen |= torch.zeros_like(chosen).scatter_(-1, index, best > float("-inf"))
        width = min(self.top_k, count)
        page = torch.arange(count, device=chosen.device)
        ordered = torch.where(chosen, page, count).sort(-1).values[..., :width]
        selection = torch.where(ordered == count, -1, ordered).cpu()
        self.steps[layer_idx] = self.steps.get(layer_idx, 0) + 1
        self.fetched[layer_idx] = self.fetched.get(layer_idx, 0) + int((selection >= 0).sum())
        self.judged[layer_idx] = self.judged.get(layer_idx, 0) + sum(levels.scored)
        return selection

    def judge(
        self, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, ChunkLevels]:
        """The coarse-to-fine judgement of one step: bool ``[batch, kv_heads, pages]`` each head's
        newest page and its held pages, and the :class:`ChunkLevels` (over the pages padded to a
        multiple of ``chunk_pages``). At each level (``chunk_pages`` halved down to 1) the
        candidates are the pages of the chunks kept at the level above (every held page but the
        newest at the first); a chunk is kept when, for some query head of its group, its bound
        (:func:`chunk_bounds`) is at least that head's best bound at the level minus ``desert``."""
        batch, kv_heads, count, dim = key_min.shape
        used = pages_used.to(key_min.device).unsqueeze(-1)
        page = torch.arange(count, device=key_min.device)
        pages, newest = page < used, page == used - 1
        padded = -(-count // self.chunk_pages) * self.chunk_pages
        pad = (0, 0, 0, padded - count)
        low_pages, high_pages = torch.nn.functional.pad(key_min, pad), torch.nn.functional.pad(key_max, pad)
        alive = torch.nn.functional.pad(pages & ~newest, (0, padded - count))
        levels = ChunkLevels([], [], [])
        size = self.chunk_pages
        while True:
            low, high, live = chunk_abstracts(low_pages, high_pages, alive, size)
            bound = chunk_bounds(query, low, high).masked_fill(~live.unsqueeze(2), float("-inf"))
            best = bound.amax(-1, keepdim=True)
            kept = live & (bound >= best - self.desert).any(2)
            levels.sizes.append(size)
            levels.kept.append(kept)
            levels.scored.append(int(live.sum()))
            alive = alive & kept.repeat_interleave(size, dim=-1)
            if size == 1:
                return newest, pages, levels
            size //= 2
