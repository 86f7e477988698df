"""ShotKV: the prompt keeps or drops whole few-shot examples; decode tokens compete among themselves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("shotkv")
@dataclass
class ShotKV(Eviction):
    """ShotKV (Liu, Tang, Chen, Dong, Li, Zhou, Li, Hu and Chu, 2025, "Can LLMs Maintain Fundamental
    Abilities under KV Cache Compression?", arXiv:2502.01941): the prefill and the decoding phase are
    compressed apart. The prompt is compressed once, keeping or dropping whole *shots* (few-shot
    examples), since a shot cut in pieces loses what it teaches; generated tokens then compete only
    among themselves for their own share of the budget.

    Shots: ``starts`` are the positions (counted from the row's first real token, as
    ``kept_positions`` counts them) where shots begin; the tokens before the first start (an
    instruction) form one more segment. :meth:`for_prompt` finds them in a prompt's token ids as
    the tokens after each occurrence of a separator (``"\\n\\n"``, ``"Question:"``); a prompt
    without one (or ``starts=()``) falls back to fixed segments of ``chunk`` tokens, the
    chunk-level unit the same paper finds ahead of token-level selection. The starts hold for
    every row of a batch (Engine requests carry a spec each).

    Prefill (a call of more than one token, rows that have not decoded yet), per layer:

    1. the call's last ``window`` queries vote, as SnapKV's do: each token's attention summed over
       them and averaged over the query heads of its KV group; the window's own tokens are kept
       (``+inf``);
    2. a shot's score is its tokens' mean vote over every KV head of the layer (the paper averages
       over tokens and heads; it also averages over layers, which a cache that compacts each layer
       right after its attention cannot see, so each layer chooses for itself, one set of shots for
       all its heads);
    3. shots are taken whole, best score first, while each head's tokens of the taken shots fit in
       its budget (the call's budget, ``B - D`` below, less the window); the first shot that does
       not fit ends the whole-shot choice, and what is left of the budget goes to the best of the
       remaining tokens by their own votes, so the budget is met exactly.

    Decoding (an int budget ``B`` per head, held at every compaction): ``D = max(1, floor(B *
    decode_budget))`` tokens are reserved for generated tokens (prompt calls compress to ``B - D``,
    :meth:`prompt_tokens`); once a row decodes, every kept prompt token stays, and generated tokens
    (positions at or past the prompt length) are ranked by the attention the newest query gives
    them (averaged over the query heads of the KV group), the paper's token-level decode score. A
    float budget compresses the prompt only and keeps every decode token.

    Invariants: taken shots are kept whole (each of their tokens scores above every token outside
    them and the window); the window scores ``+inf`` at prefill; in decoding rows every prompt token
    outranks every generated one; invalid slots score ``-inf``.

    Args:
        starts: positions where shots begin, ascending, >= 0 (``()``: no shots known: ``chunk``).
        chunk: tokens per segment when no shots are known (>= 1).
        window: observation window, in queries (>= 1), as SnapKV's (the official default 32).
        decode_budget: fraction of an int budget reserved for generated tokens, in (0, 1); the
            budget must leave the prompt at least one token.
    """

    starts: tuple[int, ...] = ()
    chunk: int = 10
    window: int = 32
    decode_budget: float = 0.25
    reads_kv: ClassVar[bool] = False
    needs: ClassVar[frozenset[str]] = frozenset({"attention", "prompt_length"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(start < 0 for start in self.starts) or any(b <= a for a, b in zip(self.starts, self.starts[1:])):
            raise ValueError(f"starts must be ascending positions >= 0 (where shots begin), got {self.starts}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1 (tokens per segment without shots), got {self.chunk}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (queries), got {self.window}")
        if not 0.0 < self.decode_budget < 1.0:
            raise ValueError(
                f"decode_budget must be in (0, 1) (the fraction of the budget kept for decode tokens), got {self.decode_budget}"
            )

    @classmethod
    def for_prompt(cls, ids: Sequence[int] | torch.Tensor, separator: Sequence[int], opens: bool = False, **parameters: object) -> ShotKV:
        """A ShotKV whose shots begin after each occurrence of ``separator`` (token ids, non-empty)
        in ``ids`` (one prompt's token ids, no padding; occurrences do not overlap, and one that
        ends the prompt starts nothing), or, with ``opens``, at each occurrence (a marker that
        opens every shot, such as ``"Question:"``); no occurrence: ``starts=()``, the ``chunk``
        fallback. ``parameters``: the other fields.

        ``separator`` must be the ids the separator has *inside* the prompt: a BPE tokenizer
        may encode it otherwise alone (SmolLM2 encodes ``"\\n\\n"`` alone as one token, and as
        two ``"\\n"`` after ``"5"``); encode a piece of the prompt around it to see."""
        tokens = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        pattern = list(separator)
        if not pattern:
            raise ValueError("separator must hold at least one token id")
        found, at = [], 0
        while at + len(pattern) <= len(tokens):
            if tokens[at : at + len(pattern)] == pattern:
                start = at if opens else at + len(pattern)
                at += len(pattern)
                if start < len(tokens):
                    found.append(start)
            else:
                at += 1
        return cls(starts=tuple(found), **parameters)

    def observed_queries(self) -> int:
        return self.window

    def prompt_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The prompt's share of an int budget, ``B - D`` (ValueError if it leaves the prompt nothing)."""
        prompt = tokens - (tokens.to(torch.float64) * self.decode_budget).floor().clamp(min=1).to(tokens.dtype)
        if bool((prompt < 1).any()):
            raise ValueError(
                f"shotkv needs an int budget of at least 2 tokens per head (a prompt share and a decode share), got {tokens.min().item()}"
            )
        return prompt

    def score(self, view: LayerView) -> torch.Tensor:
        """Whole shots in rows still in their prompt; in decoding rows, every prompt token above
        every generated token, generated tokens by the newest query's attention."""
        decode = view.valid & (view.positions >= view.prompt_lengths.to(view.positions.device).view(-1, 1, 1))
        decoding = decode.flatten(1).any(-1).view(-1, 1, 1)
        batch, heads, slots = view.valid.shape
        if not bool(decoding.all()):
            prompt_scores = self.shot_scores(view)
            if not bool(decoding.any()):
                return prompt_scores
        last = view.attention[:, :, -1, :].float().view(batch, heads, -1, slots).mean(dim=2).to(torch.float64)
        scores = torch.where(decode, last, torch.where(view.valid, 2.0, -torch.inf))  # attention <= 1 < 2
        return scores if bool(decoding.all()) else torch.where(decoding, scores, prompt_scores)

    def segments(self, positions: torch.Tensor) -> torch.Tensor:
        """int64, the shape of ``positions``: each position's segment (0: before the first start,
        ``k``: from ``starts[k-1]``; without starts, ``position // chunk``); invalid positions 0."""
        held = positions.clamp(min=0)
        if not self.starts:
            return held // self.chunk
        starts = torch.tensor(self.starts, dtype=held.dtype, device=held.device)
        return torch.bucketize(held, starts, right=True)

    def shot_scores(self, view: LayerView) -> torch.Tensor:
        """Float64 ``[batch, kv_heads, slots]`` of a prompt call: the window ``+inf``, the tokens of
        the shots taken whole in ``[1.5, 2)`` (better shots higher), the others by their own vote in ``[0, 1)``; invalid ``-inf``."""
        batch, heads, slots = view.valid.shape
        attention = view.attention[:, :, -self.window :, :].float()
        votes = attention.sum(dim=2).view(batch, heads, -1, slots).mean(dim=2).to(torch.float64)
        newest = view.positions.amax(dim=-1, keepdim=True)
        in_window = view.valid & (view.positions > newest - attention.shape[2])
        context = view.valid & ~in_window
        segment = self.segments(view.positions)
        count = int(segment.max()) + 1 if segment.numel() else 1
        members = torch.zeros(batch, heads, count, dtype=torch.float64, device=votes.device).scatter_add_(
            -1, segment, context.to(torch.float64)
        )
        totals = torch.zeros_like(members).scatter_add_(-1, segment, torch.where(context, votes, 0.0))
        shot_score = totals.sum(1) / members.sum(1).clamp(min=1)  # [batch, segments]: mean vote over the layer's heads
        present = members.sum(1) > 0
        order = torch.where(present, shot_score, -1.0).argsort(dim=-1, descending=True, stable=True)  # best shot first
        sizes = members.gather(-1, order.unsqueeze(1).expand(-1, heads, -1))
        room = (
            view.budget_tokens.to(votes.device).view(-1, 1, 1) - in_window.sum(-1, keepdim=True) if view.budget_tokens is not None else None
        )
        fits = torch.ones_like(sizes, dtype=torch.bool) if room is None else (sizes.cumsum(-1) <= room)
        fits &= present.gather(-1, order).unsqueeze(1)
        taken = torch.zeros_like(fits).scatter(-1, order.unsqueeze(1).expand(-1, heads, -1), fits.to(torch.int8).cummin(-1).values.bool())
        whole = context & taken.gather(-1, segment)
        ceiling = shot_score.amax(-1).clamp(min=0.0).view(-1, 1, 1) + 1.0
        own = votes / (votes.masked_fill(~context, 0.0).amax(dim=(1, 2), keepdim=True) + 1.0)
        score = torch.where(whole, 1.5 + shot_score.gather(-1, segment.flatten(1)).view(batch, heads, slots) / ceiling / 2.0, own)
        score = torch.where(in_window, torch.inf, score)
        return score.masked_fill(~view.valid, -torch.inf)
