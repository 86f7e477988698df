"""SCOPE: separate prompt and decode budgets; decode tokens slide, the compressed prompt stays."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvlib.policies.eviction.h2o import protected_scores
from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import Eviction, EvictionWrapper, LayerView, WithInner
from kvlib.registry import register

_OWN_NEEDS = frozenset({"attention", "prompt_length"})


@register("scope")
@dataclass
class SCOPE(EvictionWrapper):
    """SCOPE (Wu et al., 2024, "SCOPE: Optimizing Key-Value Cache Compression in Long-context
    Generation"): the prompt and the generated tokens get separate budgets. The prompt is
    compressed once, by the ``inner`` (prefill) policy, and then stays fixed; decode-phase
    tokens compete only among themselves for the rest of the budget, by SCOPE's "slide" policy:
    each head keeps its ``recent`` newest decode tokens and the older decode tokens the current
    query attends to most (its softmax attention over every stored token, averaged over the
    query heads of the KV group).

    How the budget splits (an int budget ``B`` per (layer, head), held at every compaction): the
    decode share is ``D = max(1, floor(B * decode_budget))``; a prompt call (more than one token)
    compresses the prompt to ``B - D`` by the inner policy; decode steps keep every kept prompt
    token and fill the rest of ``B`` (at least ``D``; more when the prompt was shorter) with
    decode tokens. Decode tokens are
    those at or past the row's prompt length (``prompt_length``). SCOPE's "discontinuous"
    policy (re-select every few steps) is this with the cache's ``interval``; its "adaptive"
    policy (a decode budget growing with the generation) is not built, since the cache's cap
    is one int. A float budget compresses the prompt only (the inner at that fraction) and keeps
    every decode token.

    Args:
        inner: the prefill policy (an eviction policy or its spec string; default SnapKV, as
            in the paper's plug-in results).
        decode_budget: the fraction of an int budget reserved for decode tokens, in (0, 1) (the
            paper's 4K-output runs give the prompt 2048 and decoding 512 to 1024 tokens); the
            budget must leave the prompt at least one token.
        recent: newest decode tokens of each head always kept (tokens >= 0; the official code's
            ``decoding_recent_size``), within the decode share.
    """

    inner: Eviction = field(default_factory=SnapKV)
    decode_budget: float = 0.25
    recent: int = 8
    needs = WithInner(_OWN_NEEDS, frozenset.union)
    reads_kv = WithInner(True, lambda own, inner: inner)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.decode_budget < 1.0:
            raise ValueError(
                f"decode_budget must be in (0, 1) (the fraction of the budget kept for decode tokens), got {self.decode_budget}"
            )
        if self.recent < 0:
            raise ValueError(f"recent must be >= 0 (tokens), got {self.recent}")

    def observed_queries(self) -> int | None:
        return self.inner.observed_queries() if "attention" in self.inner.needs else 1

    def prompt_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The prompt's share of an int budget, ``B - D`` (ValueError if it leaves the prompt nothing)."""
        prompt = tokens - (tokens.to(torch.float64) * self.decode_budget).floor().clamp(min=1).to(tokens.dtype)
        if bool((prompt < 1).any()):
            raise ValueError(
                f"scope needs an int budget of at least 2 tokens per head (a prompt share and a decode share), got {tokens.min().item()}"
            )
        return self.inner.prompt_tokens(prompt)

    def score(self, view: LayerView) -> torch.Tensor:
        """Inner scores in rows still in their prompt; in decoding rows, every prompt token above
        every decode token, decode tokens ranked by the slide policy."""
        decode = view.valid & (view.positions >= view.prompt_lengths.to(view.positions.device).view(-1, 1, 1))
        decoding = decode.flatten(1).any(-1).view(-1, 1, 1)
        if not bool(decoding.all()):
            prompt_scores = self.inner.score(view).to(torch.float64)
            if not bool(decoding.any()):
                return prompt_scores
        batch, heads, slots = view.valid.shape
        last = view.attention[:, :, -1, :].float().view(batch, heads, -1, slots).mean(dim=2)
        slide = protected_scores(last, replace(view, valid=decode), recent=self.recent)
        ceiling = slide.masked_fill(~decode, -torch.inf).flatten(1).amax(-1).clamp(min=0.0).view(-1, 1, 1) + 1.0
        scores = torch.where(decode, slide, torch.where(view.valid, ceiling, -torch.inf))
        return scores if bool(decoding.all()) else torch.where(decoding, scores, prompt_scores)
