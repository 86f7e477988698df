"""DuoAttention: retrieval heads keep the whole context, streaming heads sinks and a recent window."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlib.model_shape import kv_heads_text
from kvlib.policies.budget.head_importance import load_profile
from kvlib.policy import Budget, BudgetRequest, Eviction, LayerView
from kvlib.registry import register
from kvlib.selection import apportion, position_rank


@register("duo_attention")
@dataclass
class DuoAttention(Eviction):
    """DuoAttention (Xiao et al., 2024, "DuoAttention: Efficient Long-Context LLM Inference with
    Retrieval and Streaming Heads").

    A few KV heads (retrieval heads) need the whole context; the others (streaming heads) only
    look at the attention sinks and the recent tokens. Retrieval heads keep every token they have
    seen; streaming heads keep their first ``sinks`` tokens and their newest ones, each in its own
    pages, so the heads really hold different numbers of tokens. How many heads retrieve follows
    from the budget (see :class:`DuoSplit`): at ``B`` tokens per head on average over the
    ``N = layers * kv_heads`` heads and ``t`` tokens seen, ``R = floor(N (B - w) / (t - w))``
    heads retrieve, ``w = sinks + recent``, and the streaming heads share what is left equally
    (at least ``w`` each), so the model holds exactly ``N * B`` tokens. Which heads retrieve: the
    ``R`` with the highest weight in ``profile``.

    The paper learns a gate per head on synthetic passkey retrieval; kvpress loads those
    published patterns or estimates them on the fly. Here the profile is a head profile JSON
    measured once per model. The one to use is a retrieval profile
    (:func:`kvlib.policies.budget.retrieval_calibration.calibrate_retrieval`, or
    :func:`kvlib.eval.retrieval_profile.retrieval_profile` for a loaded model: each KV head's
    attention from the answer's queries onto the needle while the model answers RULER needle
    questions), which picks out the few heads that copy from far back, as the paper's gates do.
    A head_importance profile (:func:`kvlib.policies.budget.head_importance.calibrate`, distant
    attention mass on any text) is also read, but it ranks many local-reading heads above the
    retrieval ones: on SmolLM2 at 4k tokens and 25% of the bytes it lost the needle that the
    retrieval profile keeps (``benchmarks/results/duo_attention_niah.md``). Without a profile
    (``profile=""``, the default) the retrieval heads are spread evenly over the layers: head
    ``h`` of layer ``l`` ranks by ``(h, l)``, so the first ``num_layers`` chosen are head 0 of
    every layer.

    Invariants: a head's budget is met exactly when it holds at least its cap; retrieval heads
    never lose a token while they retrieve (the retrieval set only shrinks as a fixed int budget
    is spread over more tokens); when the budget per head is at most ``w`` (or ``t <= w``) no
    head retrieves and every head streams within its share, sinks first.

    Args:
        sinks: initial tokens each streaming head keeps (the paper's sink size, 64).
        recent: recent tokens a streaming head keeps at least (the paper's recent size, 256);
            only decides how many heads retrieve: the streaming heads' actual window is their
            share of the budget.
        profile: path of a head profile for this model, best a retrieval profile ("" : the even spread above).
    """

    sinks: int = 64
    recent: int = 256
    profile: str = ""
    reads_kv: ClassVar[bool] = False
    order_free: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0 (tokens), got {self.sinks}")
        if self.recent < 1:
            raise ValueError(f"recent must be >= 1 (tokens), got {self.recent}")
        self.default_budget()  # reads the profile now: a bad one is refused before any model work

    def default_budget(self) -> Budget:
        return DuoSplit(self.sinks + self.recent, self.profile)

    def score(self, view: LayerView) -> torch.Tensor:
        """Sinks ``+inf``, then recency rank (newest highest); invalid slots ``-inf``. A retrieval
        head's cap is its whole count, so its order does not matter."""
        rank = position_rank(view.positions, view.valid).to(torch.float32)
        score = torch.where(rank < self.sinks, torch.inf, rank)
        return torch.where(view.valid, score, -torch.inf)


@dataclass
class DuoSplit(Budget):
    """DuoAttention's allocation (not a registered policy: :class:`DuoAttention` brings it).

    Per row, with ``N = num_layers * kv_heads`` heads, ``B`` tokens per head on average,
    ``t`` real tokens seen and ``w = streaming`` tokens: ``R = clamp(floor(N (B - w) / (t - w)),
    0, N)`` heads retrieve (cap ``t``: all their tokens) when ``t > w``, else none; the other
    ``N - R`` heads share ``N B - R t`` tokens, equal to a token (:func:`~kvlib.selection.apportion`).
    The retrieval heads are the ``R`` first in the ranking: the ``profile``'s weights ``[num_layers,
    kv_heads]`` descending (ties: lower layer, then lower head, first), or without a profile by
    ``(head, layer)``. A request without ``seen`` (built by hand) takes the layer's largest count
    for ``t``.

    Args:
        streaming: tokens a streaming head keeps at least (DuoAttention's sinks + recent), >= 1.
        profile: path of a head_importance profile ("": none).
    """

    streaming: int
    profile: str = ""
    weights: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    """float64 ``[num_layers, kv_heads]``, the profile's weights (None without one)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.streaming < 1:
            raise ValueError(f"streaming must be >= 1 (tokens), got {self.streaming}")
        self.weights = load_profile(self.profile) if self.profile else None

    def check_model(self, layer_kv_heads: Sequence[int]) -> None:
        if self.weights is not None and list(layer_kv_heads) != [self.weights.shape[1]] * self.weights.shape[0]:
            layers, heads = self.weights.shape
            raise ValueError(
                f"duo_attention profile is for {layers} layers x {heads} KV heads, but the model has"
                f" {kv_heads_text(layer_kv_heads)}: calibrate a profile for this model"
                " (kvlib.policies.budget.retrieval_calibration.calibrate_retrieval)"
            )

    def layer_tokens(self, request: BudgetRequest) -> torch.Tensor:
        return self.caps(request).sum(-1)

    def caps(self, request: BudgetRequest) -> torch.Tensor:
        """Each head's cap in this layer: ``t`` for a retrieval head, its share of the rest otherwise."""
        layers, heads = request.num_layers, request.counts.shape[1]
        self.check_model([heads] * layers)
        tokens = request.tokens.cpu()
        seen = (request.seen if request.seen is not None else request.counts.amax(-1)).cpu()
        total = tokens * layers * heads
        heads_all = layers * heads
        span = (seen - self.streaming).clamp(min=1)
        retrieval = torch.where(seen > self.streaming, (total - heads_all * self.streaming).clamp(min=0) // span, 0)
        retrieval = retrieval.clamp(max=heads_all)
        rank = self.ranking(layers, heads)  # rank of each head, model-wide, 0 first
        retrieves = rank.view(1, -1) < retrieval.view(-1, 1)  # [batch, heads_all]
        caps = torch.zeros(len(tokens), heads_all, dtype=torch.int64)
        for row in range(len(tokens)):
            streaming = ~retrieves[row]
            rest = total[row] - seen[row] * retrieval[row]
            caps[row, retrieves[row]] = seen[row]
            if bool(streaming.any()):
                caps[row, streaming] = apportion(rest.view(1), torch.ones(int(streaming.sum())))[0]
        return caps.view(-1, layers, heads)[:, request.layer_idx].to(request.tokens.device)

    def ranking(self, layers: int, heads: int) -> torch.Tensor:
        """int64 ``[layers * heads]``: each head's place in the retrieval order (0: retrieves first)."""
        if self.weights is None:
            order = torch.arange(layers * heads).view(layers, heads).t().flatten()  # (head, layer) order
        else:
            order = torch.sort(-self.weights.flatten(), stable=True).indices
        return torch.empty_like(order).scatter_(0, order, torch.arange(layers * heads))
