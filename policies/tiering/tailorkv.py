"""TailorKV: each layer found dense or sparse from its attention; sparse layers read their top pages."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlib.policies.tiering.quest import Quest
from kvlib.registry import register


def pages_for_mass(
    query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor, mass: float
) -> torch.Tensor:
    """The share of its held pages each (row, query head) needs to cover ``mass`` of its estimated
    attention, float32 ``[batch, query_heads]`` in ``(0, 1]``.

    The estimate: each query head's softmax over the pages its KV head holds of ``q . c / sqrt(d)``,
    ``c = (min + max) / 2`` the centre of the box a page's keys lie in (``key_min`` / ``key_max``
    ``[batch, kv_heads, pages, d]``; query heads grouped by KV head as ``repeat_kv`` lays them
    out); the count is the fewest pages, largest first, whose estimates sum to at least ``mass``."""
    batch, kv_heads, count, dim = key_min.shape
    q = query[:, :, -1].float().view(batch, kv_heads, -1, dim)
    centre = (key_min.float() + key_max.float()) / 2
    held = torch.arange(count, device=key_min.device) < pages_used.to(key_min.device).view(batch, kv_heads, 1, 1)
    logits = torch.einsum("bhgd,bhpd->bhgp", q, centre) / dim**0.5
    probs = logits.masked_fill(~held, float("-inf")).softmax(-1)
    covered = probs.sort(-1, descending=True).values.cumsum(-1)
    needed = (covered < mass - 1e-6).sum(-1) + 1  # the page that reaches the mass counts
    used = pages_used.to(key_min.device).view(batch, kv_heads, 1).float()
    return (needed.clamp(max=count).float() / used).view(batch, -1)


@register("tailorkv")
@dataclass
class TailorKV(Quest):
    """TailorKV (Yao, Shen, Lin, Liu, Luan, Wang and Wang, 2025, "TailorKV: A Hybrid Framework for
    Long-Context Inference via Tailored KV Cache Optimization", arXiv:2505.19586): some layers
    attend broadly (global information: selective loading loses it, but aggressive quantization
    keeps enough), others put their attention on a few dominant tokens (quantization errs on
    exactly those, but loading only them suffices). TailorKV quantizes the first kind whole (1-2
    bit) and offloads the second, fetching each step's top-k tokens from the host.

    How this maps onto kvlib:

    - Identification: the paper identifies the layers once, offline. A tiering policy is handed no
      prompt queries, so here each layer is identified by its first decode step after a prompt:
      the query's attention over the layer's pages is estimated from the device-side page summaries
      (:func:`pages_for_mass`: softmax of the query against each page's key-box centre), and a
      layer whose heads need, on average, at least ``dense_share`` of their pages to cover
      ``mass`` of it is dense; the others are sparse. The choice holds until the next prompt.
    - Dense layers attend over every page at every step (the first step included, so it is
      exact). Sparse layers attend over the ``top_k`` pages per head whose Quest bound is highest
      (the newest always); only those are read, from whichever tier holds them (host rows, pinned
      under CUDA, or lmdb records under ``placement='lru(..., disk=...)'``). The unit is the page,
      not the token.
    - Quantization: a tiering policy does not choose a layer's codec; the spec names one for every
      layer (``"kivi(bits=2)+tailorkv(...)"``), so sealed pages of sparse layers are coded too and
      travel between tiers encoded. Device budgets (``placement``) are the same for every layer.
    - Nothing is evicted; with ``top_k`` covering every page each layer's output is the full
      cache's whatever its kind.

    Per layer the decision is kept (:attr:`dense`), keyed by the ``layer_idx`` the cache passes to
    :meth:`select_pages`; every multi-token call of a layer (a prompt, a chunk) forgets its
    decision (:meth:`arranges_tokens` is asked after each). One object serves one cache at a
    time.

    Args:
        top_k: pages each (row, KV head) of a sparse layer attends over at a decode step (>= 1),
            its newest included.
        mass: the share of the estimated attention a head's pages must cover, in (0, 1].
        dense_share: a layer whose heads need this share of their pages or more to cover ``mass``
            (averaged over rows and query heads) is dense, in (0, 1].
        dense_layers: leading layers dense whatever their attention (>= 0; the paper finds the
            first layers dense, by measurement).
        placement: the device/host placement (``lru(...)``, ``score_aware(...)``), as for :class:`Quest`.
    """

    mass: float = 0.9
    dense_share: float = 0.5
    dense_layers: int = 0
    dense: dict[int, bool] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per layer identified since its last prompt: whether it is dense (state, not a parameter)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.mass <= 1:
            raise ValueError(f"mass must be in (0, 1] (a share of the estimated attention), got {self.mass}")
        if not 0 < self.dense_share <= 1:
            raise ValueError(f"dense_share must be in (0, 1] (a share of a head's pages), got {self.dense_share}")

    def sparse(self, layer_idx: int, query_length: int) -> bool:
        """Whether a call of ``layer_idx`` with ``query_length`` new tokens per row attends over chosen
        pages: decode steps of layers past ``dense_layers`` not identified as dense (a layer's first
        decode step is, and identifies it)."""
        return super().sparse(layer_idx, query_length) and not self.dense.get(layer_idx, False)

    def arranges_tokens(self, layer_idx: int, query_length: int) -> bool:
        """Never (the store keeps the slot order); a multi-token call of ``layer_idx`` forgets
        whether the layer was found dense (a new prompt is identified anew)."""
        if query_length > 1:
            self.dense.pop(layer_idx, None)
        return False

    def select_pages(
        self, layer_idx: int, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor
    ) -> torch.Tensor:
        """The pages this step attends over, int64 ``[batch, kv_heads, k]`` on the CPU, ascending,
        ``-1`` last: a layer not yet identified is identified first (:meth:`is_dense`); a dense
        layer's every page, a sparse layer's ``top_k`` (Quest's choice)."""
        if layer_idx not in self.dense:
            self.dense[layer_idx] = self.is_dense(query, key_min, key_max, pages_used)
        if self.dense[layer_idx]:
            page = torch.arange(key_min.shape[2])
            return torch.where(page < pages_used.unsqueeze(-1), page, -1)
        return super().select_pages(layer_idx, query, key_min, key_max, pages_used)

    def is_dense(self, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor) -> bool:
        """Whether the layer's heads need at least ``dense_share`` of their pages, on average, to
        cover ``mass`` of the query's estimated attention (:func:`pages_for_mass`)."""
        return float(pages_for_mass(query, key_min, key_max, pages_used, self.mass).mean()) >= self.dense_share
