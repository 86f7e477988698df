"""KVCompose: per-head attention scores, with every head of a layer keeping the same count (composite tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from kvlib.policies.eviction.measured_prefill import empty_cache_policy, prefill_measured
from kvlib.policy import Budget, BudgetRequest, ContextPrefill, Eviction, LayerView
from kvlib.registry import register


@register("kvcompose")
@dataclass
class KVCompose(Eviction):
    """KVCompose (Akulov, Sana, De Domenico, Si Salem, Piovesan and Ayed, 2025, "KVCompose: Efficient
    Structured KV Cache Compression with Composite Tokens", arXiv:2509.05165), scored as kvpress's
    ``KVComposePress``: each KV head ranks its tokens by its own attention scores, and the ``r``-th
    best token of every head of a layer form the layer's ``r``-th *composite token*, so every head
    keeps the same number of tokens (different tokens per head) and the cache stays one dense
    ``[heads, tokens]`` layout.

    Scores per (row, KV head, token), as ``compute_scores`` and ``enhance_scores`` do:

    1. each query head aggregates the attention its observed queries (the call's last ``window``)
       give the token: ``task="max"`` (kvpress's default) or ``"mean"``;
    2. the query heads of a KV group are aggregated: ``group="mean"`` (default) or ``"max"``;
    3. with ``value_norm``, times the L2 norm of the token's value;
    4. with ``mean_across_heads`` (default), plus the mean of that token's score over the layer's
       KV heads (kvpress's ``add_mean_across_heads``). Tokens are matched across heads by position
       (heads that have evicted differently still agree which token is which); the mean runs over
       the heads that hold the token.

    Each head keeps its best tokens by these scores, within the cap the allocation gives it; under
    the default (uniform) allocation every head of a layer keeps the same count, the composite
    layout. Here a per-head budget is real memory in any case (per-head pages), so the alignment
    costs nothing and saves nothing. Not built: the paper's cross-layer allocation (a global top-k
    over every layer's composite scores, the mean over heads of each rank's score, the first layer
    given the largest), which needs every layer's scores before the first layer compacts, while a
    cache here compacts each layer right after its own attention; each layer keeps the call's
    budget instead, except in :func:`compress`.

    :func:`compress` is KVCompose as kvpress runs it: the context runs a second time right after
    itself on a plain cache, each context token is scored by the attention the second copy's
    queries give it (every one of them sees the whole first copy), and the context is then
    prefilled into the kvlib cache, which keeps its budget by those scores, split over the layers
    by the paper's cross-layer allocation (:class:`CompositeAllocation`: every layer's scores are
    known before the first compacts). :meth:`context_prefill` hands it to protocols that read a
    context before its questions (``kvlib compare --context-first``). Used as a plain policy
    (``make_cache(model, "kvcompose", budget=...)``, the Engine), the observed queries are each
    call's own last ``window``, causal (a token is seen only by the queries after it), and every
    layer keeps the budget.

    Invariants: invalid slots score ``-inf``; scores are finite and >= 0 elsewhere.

    Args:
        window: observed queries, the call's last (>= 1).
        task: aggregation over the observed queries, ``"max"`` or ``"mean"``.
        group: aggregation over a KV group's query heads, ``"mean"`` or ``"max"``.
        value_norm: multiply by the value's L2 norm (kvpress's ``add_v_norm``; reads the values).
        mean_across_heads: add the token's mean score over the layer's KV heads.
    """

    window: int = 32
    task: Literal["max", "mean"] = "max"
    group: Literal["mean", "max"] = "mean"
    value_norm: bool = False
    mean_across_heads: bool = True
    measured: RepeatScores | None = field(default=None, init=False, repr=False, compare=False)
    """Set by :func:`compress` while it prefills: the repeat pass's scores, by position."""
    needs: ClassVar[frozenset[str]] = frozenset({"attention"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (queries), got {self.window}")

    @property
    def reads_kv(self) -> bool:
        """Whether :meth:`score` reads the values: only with ``value_norm`` (see :attr:`Eviction.reads_kv`)."""
        return self.value_norm

    def observed_queries(self) -> int:
        return self.window

    def context_prefill(self) -> ContextPrefill:
        """:func:`compress`: the repeat pass, then the context's prefill by its scores."""
        return prefill_by_repeat

    def score(self, view: LayerView) -> torch.Tensor:
        """Aggregated attention per KV head (times the value norm), plus its mean over the heads."""
        batch, heads, slots = view.valid.shape
        if self.measured is not None:
            table = self.measured.attention[view.layer_idx].to(view.valid.device)  # [batch, query_heads, tokens]
            group = table.shape[1] // heads
            at = view.positions.clamp(0, table.shape[-1] - 1).repeat_interleave(group, dim=1)
            inside = (view.valid & (view.positions < table.shape[-1])).repeat_interleave(group, dim=1)
            per_query_head = torch.where(inside, table.gather(-1, at), 0.0)
        else:
            attention = view.attention[:, :, -self.window :, :].float()
            per_query_head = attention.amax(dim=2) if self.task == "max" else attention.mean(dim=2)
        grouped = per_query_head.view(batch, heads, -1, slots)
        scores = grouped.mean(dim=2) if self.group == "mean" else grouped.amax(dim=2)
        if self.value_norm:
            scores = scores * view.values.float().norm(dim=-1)
        scores = scores.masked_fill(~view.valid, 0.0)
        if self.mean_across_heads:
            scores = scores + _mean_by_position(scores, view)
        return scores.masked_fill(~view.valid, -torch.inf)


def _mean_by_position(scores: torch.Tensor, view: LayerView) -> torch.Tensor:
    """float32 ``[batch, kv_heads, slots]``: for each held token, the mean of its score over the
    layer's KV heads that hold its position (0 on invalid slots)."""
    batch, heads, slots = scores.shape
    width = int(view.positions.max()) + 2 if view.positions.numel() else 1
    at = torch.where(view.valid, view.positions, width - 1).view(batch, heads * slots)  # the last column: no position
    totals = torch.zeros(batch, width, dtype=scores.dtype, device=scores.device).scatter_add_(-1, at, scores.view(batch, -1))
    holders = torch.zeros_like(totals).scatter_add_(-1, at, view.valid.to(scores.dtype).view(batch, -1))
    mean = totals / holders.clamp(min=1.0)
    return mean.gather(-1, at).view(batch, heads, slots).masked_fill(~view.valid, 0.0)


@dataclass(frozen=True)
class RepeatScores:
    """What the repeat pass measures, per layer: ``attention`` float32 ``[batch, query_heads,
    tokens]``, the attention each context token receives from the second copy's queries
    (aggregated over them by the policy's ``task``); ``value_norms`` float32 ``[batch, kv_heads,
    tokens]``, the L2 norm of each token's value."""

    attention: list[torch.Tensor]
    value_norms: list[torch.Tensor]

    def head_scores(self, policy: KVCompose, layer: int) -> torch.Tensor:
        """float32 ``[batch, kv_heads, tokens]``: ``layer``'s scores as ``policy`` ranks a full
        context (every head holding every token): grouped, times the value norm, plus the mean
        over the heads."""
        norms = self.value_norms[layer]
        batch, heads, tokens = norms.shape
        grouped = self.attention[layer].to(norms.device).view(batch, heads, -1, tokens)
        scores = grouped.mean(dim=2) if policy.group == "mean" else grouped.amax(dim=2)
        if policy.value_norm:
            scores = scores * norms
        if policy.mean_across_heads:
            scores = scores + scores.mean(dim=1, keepdim=True)
        return scores


@dataclass
class CompositeAllocation(Budget):
    """KVCompose's cross-layer allocation (kvpress's ``compute_important_per_layer``): a layer's
    composite score at rank ``r`` is the mean over its KV heads of each head's ``r``-th best score
    (the first layer's raised to the largest over the layers); the ``layers * B`` best composite
    scores of all layers together (``B`` the budget per layer and head) give each layer its count,
    at least 1, which every head of the layer keeps. Built by :func:`compress` from the repeat
    pass's scores, for one prefill; not a registered allocation (it needs every layer's scores
    before the first compacts)."""

    composite: torch.Tensor = field(default=None, init=False, repr=False)
    """float32 ``[batch, layers, tokens]``: each layer's composite scores, best rank first."""

    @classmethod
    def of(cls, policy: KVCompose, scores: RepeatScores) -> CompositeAllocation:
        allocation = cls()
        ranked = [
            scores.head_scores(policy, layer).sort(dim=-1, descending=True).values.mean(dim=1) for layer in range(len(scores.attention))
        ]
        composite = torch.stack(ranked, dim=1)  # [batch, layers, tokens]
        composite[:, 0] = composite.amax(dim=1)
        allocation.composite = composite
        return allocation

    def layer_counts(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 ``[batch, layers]``: each layer's count per head for a budget of ``tokens``
        (``[batch]``) per layer and head."""
        batch, layers, width = self.composite.shape
        counts = torch.zeros(batch, layers, dtype=torch.int64)
        for row in range(batch):
            total = min(int(tokens[row]) * layers, layers * width)
            best = self.composite[row].reshape(-1).topk(total).indices // width
            counts[row] = torch.bincount(best.cpu(), minlength=layers).clamp(min=1)
        return counts

    def layer_tokens(self, request: BudgetRequest) -> torch.Tensor:
        return self.layer_counts(request.tokens)[:, request.layer_idx].to(request.tokens.device) * request.counts.shape[1]

    def caps(self, request: BudgetRequest) -> torch.Tensor:
        per_head = self.layer_counts(request.tokens)[:, request.layer_idx].to(request.tokens.device)
        return per_head.unsqueeze(-1).expand_as(request.counts).clone()


def repeat_scores(model: torch.nn.Module, context_ids: torch.Tensor, task: str) -> RepeatScores:
    """The repeat pass over ``context_ids`` (int ``[batch, tokens]``, no padding), as
    ``KVComposePress`` observes it: the context is prefilled into a plain ``DynamicCache`` with
    the model's own attention (its values' norms read there), then run a second time right after
    itself with eager attention (its weights read by a forward hook on each attention module; eager
    is switched on for that pass only and restored), and the cache is dropped."""
    from transformers import DynamicCache

    from kvlib.transformers_compat import cache_argument

    if context_ids.ndim != 2 or context_ids.shape[-1] < 1:
        raise ValueError(f"context_ids must be [batch, tokens] with at least one token, got {list(context_ids.shape)}")
    length = context_ids.shape[-1]
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")]
    attention: list[torch.Tensor | None] = [None] * len(modules)

    def record(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        weights = output[1][..., :length].float()  # [batch, query_heads, second copy, first copy]
        attention[module.layer_idx] = weights.amax(dim=2) if task == "max" else weights.mean(dim=2)
        return (output[0], None, *output[2:])

    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=context_ids, **cache_argument(cache), use_cache=True, logits_to_keep=1)
    value_norms = [layer.values[..., :length, :].float().norm(dim=-1) for layer in cache.layers]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    hooks = []
    try:
        with torch.no_grad():
            hooks = [m.register_forward_hook(record) for m in modules]
            model(input_ids=context_ids, **cache_argument(cache), use_cache=True, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
        model.set_attn_implementation(previous)
    return RepeatScores(attention, value_norms)


def compress(
    model: torch.nn.Module, cache: Any, context_ids: torch.Tensor, scores: RepeatScores | None = None, *, across_layers: bool = True
) -> torch.Tensor:
    """Fill the empty ``cache`` (made with ``make_cache(model, "kvcompose...", budget=...)``) with
    ``context_ids`` compressed by KVCompose as kvpress runs it, and return the context's last
    logits ``[batch, vocab]``: :func:`repeat_scores` (unless ``scores``, computed for this context
    and the policy's ``task``, are given), then the context's prefill into ``cache``, which keeps
    its budget by those scores, split over the layers by :class:`CompositeAllocation`
    (``across_layers=False``: by the cache's own allocation, the budget in every layer).
    Afterwards the cache evicts nothing more (its evictor is removed): questions and answers are
    added to the compressed context. Costs three context prefills (the repeat pass with eager
    attention)."""
    policy = empty_cache_policy(cache, KVCompose, "kvcompose")
    if scores is None:
        scores = repeat_scores(model, context_ids, policy.task)
    if across_layers:
        cache.evictor.allocation = CompositeAllocation.of(policy, scores)
    return prefill_measured(model, cache, context_ids, policy, scores)


def prefill_by_repeat(model: torch.nn.Module, cache: Any, context_ids: torch.Tensor, tokenizer: Any, memo: dict) -> None:
    """:func:`compress` ``context_ids`` into ``cache`` (:meth:`KVCompose.context_prefill`; no
    tokenizer is needed). The repeat scores depend on the context and ``task``, not on the budget:
    they are kept in ``memo``, so the same context compressed to another budget costs one prefill."""
    policy = empty_cache_policy(cache, KVCompose, "kvcompose")
    key = ("kvcompose.repeat_scores", policy.task)
    scores = memo.get(key)
    if scores is None:
        scores = memo[key] = repeat_scores(model, context_ids, policy.task)
    compress(model, cache, context_ids, scores)
