"""Head-importance allocation: per-head budgets from a profile measured once on calibration text."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvlib.errors import cut
from kvlib.limits import MAX_PROFILE_BYTES, read_bounded
from kvlib.model_shape import kv_heads_text, kv_shape
from kvlib.policy import Budget, BudgetRequest
from kvlib.registry import register
from kvlib.selection import apportion

PROFILE_FORMAT = "kvlib.head_importance/1"
"""The ``format`` field of a saved profile (JSON; nothing in it is executed)."""


@register("head_importance")
@dataclass
class HeadImportance(Budget):
    """HeadKV-style allocation (Fu et al., 2024, "Not All Heads Matter: A Head-Level KV Cache
    Compression Method with Integrated Retrieval and Reasoning"): the whole model's budget,
    ``num_layers * kv_heads * B`` tokens per row, is shared across every head of every layer in
    proportion to a measured importance, after each head gets ``floor(floor * B)``.

    The profile is a JSON file written by :func:`calibrate`: for each (layer, KV head), the
    attention mass its queries put on distant tokens (outside the first ``sinks`` and the last
    ``window`` positions). Heads that only look locally need few tokens; heads that retrieve
    from far back get more. (HeadKV scores heads by retrieval and reasoning tests; the distant
    attention mass is a cheaper measure of the same need, computed from any text.)

    Args:
        profile: path of the profile JSON (its layer and head counts must match the model).
        floor: fraction of the budget each head is guaranteed, in [0, 1] (HeadKV's shared base).
    """

    profile: str
    floor: float = 0.2
    weights: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")
        self.weights = load_profile(self.profile)

    def check_model(self, layer_kv_heads: Sequence[int]) -> None:
        layers, heads = self.weights.shape
        if list(layer_kv_heads) != [heads] * layers:
            raise ValueError(
                f"head_importance profile {self.profile!r} is for {layers} layers x {heads} KV heads, but the model has"
                f" {kv_heads_text(layer_kv_heads)}: calibrate a profile for this model"
            )

    def layer_tokens(self, request: BudgetRequest) -> torch.Tensor:
        return self.caps(request).sum(-1)

    def caps(self, request: BudgetRequest) -> torch.Tensor:
        """Each head's floor plus its importance share of the rest of the model-wide budget."""
        layers, heads = self.weights.shape
        self.check_model([request.counts.shape[1]] * request.num_layers)
        tokens = request.tokens.cpu()
        base = (tokens.to(torch.float64) * self.floor).floor().to(torch.int64)
        rest = tokens * layers * heads - base * layers * heads
        shares = apportion(rest, self.weights.flatten()).view(-1, layers, heads)
        return (base.view(-1, 1) + shares[:, request.layer_idx]).to(request.tokens.device)


def load_profile(path: str) -> torch.Tensor:
    """The float64 ``[num_layers, kv_heads]`` weights of a saved profile; ``ValueError`` naming the
    problem (a file that is not a regular one, or over :data:`~kvlib.limits.MAX_PROFILE_BYTES`,
    is refused before it is read)."""
    content = read_bounded(path, MAX_PROFILE_BYTES, "head_importance profile")
    try:
        data = json.loads(content)
    except (ValueError, RecursionError) as exc:  # not JSON or UTF-8, or nested past the parser's depth
        raise ValueError(f"cannot read head_importance profile {path!r}: {cut(str(exc))}") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path!r} is not a head_importance profile (expected format {PROFILE_FORMAT!r})")
    weights = data.get("weights")
    rows = weights if isinstance(weights, list) and weights and all(isinstance(r, list) for r in weights) else None
    if rows is None or len({len(r) for r in rows}) != 1 or not rows[0]:
        raise ValueError(f"{path!r}: weights must be a non-empty [num_layers][kv_heads] list of numbers")
    try:
        numbers = all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0 for r in rows for w in r)
    except OverflowError:  # an integer too large for a float
        numbers = False
    if not numbers:
        raise ValueError(f"{path!r}: weights must be finite numbers >= 0")
    tensor = torch.tensor(rows, dtype=torch.float64)
    if not float(tensor.sum()) > 0:
        raise ValueError(f"{path!r}: weights sum to 0; at least one head must matter")
    return tensor


def calibrate(model: torch.nn.Module, input_ids: torch.Tensor, path: str | Path, *, window: int = 32, sinks: int = 4) -> torch.Tensor:
    """Measure each KV head's distant attention mass on ``input_ids`` and save it as a profile.

    Runs one forward pass with eager attention (the model's implementation is switched for the
    pass and restored after it). For every query at position ``t >= sinks + window``, a head's
    distant mass is the attention on keys at positions ``sinks <= p < t - window``; the profile
    weight is its mean over such queries and over the query heads of the KV group, plus 1e-3 so
    every head keeps a share. ``input_ids``: int ``[batch, tokens]`` with ``tokens > sinks +
    window``. Returns the weights ``[num_layers, kv_heads]`` (float64) and writes ``path``.
    """
    shape = kv_shape(model)
    length = input_ids.shape[-1]
    if input_ids.ndim != 2 or length <= sinks + window:
        raise ValueError(
            f"calibration needs input_ids [batch, tokens] with tokens > sinks + window = {sinks + window}, got shape"
            f" {list(input_ids.shape)}"
        )
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(input_ids, output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation(previous)
    position = torch.arange(length)
    query = position.view(-1, 1)
    distant = (position.view(1, -1) >= sinks) & (position.view(1, -1) < query - window) & (query >= sinks + window)
    rows = []
    for weights in attentions:
        mass = (weights.float() * distant.to(weights.device)).sum(-1)[..., sinks + window :].mean(dim=(0, 2))
        rows.append(mass.view(shape.num_kv_heads, -1).mean(-1).double().cpu() + 1e-3)
    profile = torch.stack(rows)
    Path(path).write_text(
        json.dumps({"format": PROFILE_FORMAT, "calibration_tokens": length, "window": window, "sinks": sinks, "weights": profile.tolist()})
    )
    return profile
