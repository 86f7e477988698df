"""Retrieval-head profiles: which KV heads copy a needle back when the model answers from it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlib.model_shape import attention_modules, kv_shape
from kvlib.policies.budget.head_importance import PROFILE_FORMAT


@dataclass(frozen=True)
class RetrievalCase:
    """One calibration prompt: ``ids`` (the prompt with its answer appended, teacher-forced),
    the positions of the needle tokens the answer copies, and the positions of the queries that
    produce the answer (the query at position ``p`` predicts token ``p + 1``).

    Invariants (checked by :func:`calibrate_retrieval`): positions lie in ``[0, len(ids))``, both
    are non-empty, and every needle position precedes every answer query (causal attention can
    only see earlier keys).
    """

    ids: tuple[int, ...]
    needle: tuple[int, ...]
    answer_queries: tuple[int, ...]

    def check(self) -> None:
        """``ValueError`` naming the broken invariant."""
        n = len(self.ids)
        if not self.needle or not self.answer_queries:
            raise ValueError("a retrieval case needs at least one needle position and one answer query")
        if min(self.needle + self.answer_queries) < 0 or max(self.needle + self.answer_queries) >= n:
            raise ValueError(f"needle and answer-query positions must lie in [0, {n}) (the case's tokens)")
        if max(self.needle) >= min(self.answer_queries):
            raise ValueError(
                f"the needle (last position {max(self.needle)}) must precede the answer's queries (first {min(self.answer_queries)})"
            )


def calibrate_retrieval(model: torch.nn.Module, cases: Sequence[RetrievalCase], path: str | Path) -> torch.Tensor:
    """Measure each KV head's retrieval mass over ``cases`` and save it as a head profile.

    A head's retrieval mass on one case is the attention its answer queries put on the needle's
    tokens, averaged over those queries and over the query heads of its KV group; the profile
    weight is its mean over the cases, plus 1e-3 so every head keeps a share. This is the
    retrieval-head criterion of Wu et al. 2024 ("Retrieval Head Mechanistically Explains
    Long-Context Factuality", heads that copy from the needle while the answer is produced),
    which HeadKV uses to rank heads and DuoAttention's passkey-retrieval training approximates;
    unlike :func:`~kvlib.policies.budget.head_importance.calibrate`'s distant-attention mass it
    singles out the few heads a needle question depends on.

    One forward pass per case with eager attention (switched for the calibration and restored
    after it); each layer's weights are reduced as that layer returns them, so the peak is one
    layer's ``[query_heads, tokens, tokens]`` float tensor. Writes ``path`` in the
    :data:`PROFILE_FORMAT` that ``head_importance`` and ``duo_attention`` read and returns the
    float64 weights ``[num_layers, kv_heads]``. ``ValueError`` before any model work for an empty
    ``cases`` or a case that breaks :class:`RetrievalCase`'s invariants.
    """
    shape = kv_shape(model)
    if not cases:
        raise ValueError("calibrate_retrieval needs at least one case")
    for case in cases:
        case.check()
    modules = attention_modules(model, shape)
    device = next(model.parameters()).device
    total = torch.zeros(shape.num_layers, shape.num_kv_heads, dtype=torch.float64)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        for case in cases:
            mass: dict[int, torch.Tensor] = {}
            queries = torch.tensor(case.answer_queries, device=device)
            needle = torch.tensor(case.needle, device=device)

            def reduce(layer: int):
                def hook(module, args, output) -> None:
                    weights = output[1]  # [1, query_heads, tokens, tokens], eager attention's probabilities
                    picked = weights[0].index_select(1, queries).index_select(2, needle).float().sum(-1).mean(-1)
                    mass[layer] = picked.view(shape.num_kv_heads, -1).mean(-1).double().cpu()

                return hook

            handles = [module.register_forward_hook(reduce(layer)) for layer, module in enumerate(modules)]
            try:
                with torch.no_grad():
                    model(torch.tensor([list(case.ids)], device=device), use_cache=False)
            finally:
                for handle in handles:
                    handle.remove()
            total += torch.stack([mass[layer] for layer in range(shape.num_layers)])
    finally:
        model.set_attn_implementation(previous)
    profile = total / len(cases) + 1e-3
    Path(path).write_text(json.dumps({"format": PROFILE_FORMAT, "measure": "retrieval", "cases": len(cases), "weights": profile.tolist()}))
    return profile
