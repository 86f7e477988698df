"""What a policy's view gets beyond the stored tokens, by the ``needs`` it declares.

The evictor (:mod:`~kvlib.adapters.runtime.evictor`) builds a :class:`~kvlib.policy.LayerView`
of a layer's stored tokens and fills in only what its policy asks for (:func:`fill_needs`): the
call's queries, its attention weights (returned by the inner attention, or recomputed in bounded
blocks), hidden states, RoPE, output projections, the call's budget, notes shared across the
call's layers, and what earlier calls left (:func:`history_after_call`: recent queries and prompt
lengths; :func:`accumulated_attention`: each stored token's running attention). Positions here
count from each row's first real token (left padding excluded), as the policy sees them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlib.adapters.runtime.attention_weights import attention_blocks
from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.query_history import QueryHistory
from kvlib.policy import Eviction, LayerView, Rope


@dataclass
class AttentionInputs:
    """What the attention function saw, for policies that need it (references, no copies).

    query ``[batch, query_heads, query_length, head_dim]``; mask: the mask attention ran with
    (model mask if the layer was untouched, else the physical one); weights: attention weights
    if the inner attention returned them; scaling: softmax scale; hidden_states: the attention
    module's input, when a policy needs it; real_new: bool ``[batch, query_length]`` or None.
    prompt_memo: where a shared prefill replays one prompt call into many caches, what the caches
    before computed from it (see :func:`accumulated_attention`), shared by them; None otherwise.
    """

    query: torch.Tensor
    mask: torch.Tensor | None
    weights: torch.Tensor | None
    scaling: float | None
    real_new: torch.Tensor | None
    hidden_states: torch.Tensor | None = None
    prompt_memo: dict[tuple[str, int], torch.Tensor] | None = None


def fill_needs(
    view: LayerView,
    policy: Eviction,
    step: LayerStep,
    inputs: AttentionInputs,
    real_offsets: torch.Tensor,
    tokens: torch.Tensor | None,
    *,
    history: QueryHistory | None,
    rope: Rope | None,
    output_projections: list[torch.Tensor] | None,
    call_notes: dict[str, Any],
) -> None:
    """Set the fields of ``view`` (the layer's stored tokens) that ``policy.needs`` names, from the
    call's ``inputs``, the layer's query ``history``, ``rope``, the per-layer ``output_projections``,
    the call's budget per head ``tokens`` and the model call's ``call_notes``."""
    needs = policy.needs
    total = inputs.query.shape[2]
    observed = min(policy.observed_queries() or total, total)
    if "queries" in needs:
        view.queries = inputs.query
        view.query_positions = query_positions(step, inputs.real_new, real_offsets)
    if "window_queries" in needs:
        view.window_queries = inputs.query[:, :, total - observed :]
    if "hidden_states" in needs:
        view.hidden_states = inputs.hidden_states
    if "rope" in needs:
        view.rope = rope
    if "recent_queries" in needs:
        view.recent_attention = history.attention(view.keys, view.positions, view.valid, inputs.scaling)
        view.recent_query_positions = history.positions
    if "prompt_length" in needs:
        view.prompt_lengths = history.prompt_lengths
    if "output_projection" in needs:
        view.output_projection = output_projections[step.layer_idx]
    if "budget" in needs:
        view.budget_tokens = tokens
    if "call_notes" in needs:
        view.call_notes = call_notes
    if "attention" in needs:
        if inputs.weights is not None:
            view.attention = returned_weights(inputs, total - observed)
        else:
            blocks = attention_blocks(step, inputs.query, inputs.mask, inputs.real_new, inputs.scaling, total - observed)
            view.attention = torch.cat([weights for _, weights in blocks], dim=2)


def history_after_call(
    policy: Eviction, history: QueryHistory | None, step: LayerStep, inputs: AttentionInputs, real_offsets: torch.Tensor
) -> QueryHistory | None:
    """The layer's query ``history`` (None: none yet) with this call's queries added, for a policy
    that needs ``recent_queries`` or ``prompt_length``; None for any other policy."""
    needs = policy.needs
    if "recent_queries" not in needs and "prompt_length" not in needs:
        return None
    count = (policy.observed_queries() or 0) if "recent_queries" in needs else 0
    history = history or QueryHistory.empty(inputs.query)
    return history.after_call(inputs.query, query_positions(step, inputs.real_new, real_offsets), count)


def accumulated_attention(
    policy: Eviction,
    step: LayerStep,
    inputs: AttentionInputs,
    real_offsets: torch.Tensor,
    previous: torch.Tensor | None,
    history: QueryHistory | None,
) -> torch.Tensor:
    """float32 ``[batch, kv_heads, slots]``: each stored token's attention so far, ``previous`` (the
    layer's running sums before this call, aligned with its slots; None: none) plus this call's (as
    the policy counts it, :meth:`~kvlib.policy.Eviction.attention_received`, given the prompt
    lengths of the layer's query ``history`` if it keeps one, averaged over the query heads of
    each KV head); 0 for slots holding no token.

    This call's part is a function of the call (queries, mask, the layer's stored keys) and of the
    policy's fields (``repr``), so a replayed prompt call computes it once per policy and
    layer: ``inputs.prompt_memo`` keeps it for the next cache the same call is replayed into
    (H2O at three budgets recomputes no attention).
    """
    valid = step.read.valid
    batch, heads, slots = valid.shape
    total = torch.zeros(batch, heads, slots, dtype=torch.float32, device=valid.device)
    if previous is not None:
        width = min(previous.shape[-1], slots)
        total[..., :width] = previous[..., :width]
    shown_positions = query_positions(step, inputs.real_new, real_offsets)
    key_positions = torch.where(valid, step.read.positions - real_offsets.to(valid.device).view(-1, 1, 1), -1)
    prompt_lengths = None if history is None else history.prompt_lengths

    def counted(first: int, weights: torch.Tensor) -> torch.Tensor:
        shown = shown_positions[:, first : first + weights.shape[2]].to(weights.device)
        return policy.attention_received(weights, shown, key_positions.to(weights.device), prompt_lengths, step.layer_idx).sum(2)

    memo_key = None if inputs.prompt_memo is None else (repr(policy), step.layer_idx)  # decode steps build no key
    received = None if memo_key is None else inputs.prompt_memo.get(memo_key)
    if received is None:
        if inputs.weights is not None:
            received = counted(0, returned_weights(inputs, 0))
        else:
            blocks = attention_blocks(step, inputs.query, inputs.mask, inputs.real_new, inputs.scaling, 0)
            received = sum(counted(first, weights) for first, weights in blocks)
        received = received.to(total.device).view(batch, heads, -1, slots).mean(2)
        if memo_key is not None:
            inputs.prompt_memo[memo_key] = received
    total += received
    return total.masked_fill_(~valid, 0.0)


def returned_weights(inputs: AttentionInputs, first: int) -> torch.Tensor:
    """The inner attention's weights of queries ``first..``, float32, with padding queries' rows zeroed."""
    weights = inputs.weights[:, :, first:].float()
    if inputs.real_new is not None:
        weights = weights * inputs.real_new[:, first:].view(weights.shape[0], 1, -1, 1)
    return weights


def query_positions(step: LayerStep, real_new: torch.Tensor | None, real_offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``[batch, query_length]``: each query's position from its row's first real token, -1 for padding."""
    device = step.read.positions.device
    logical = step.query_offset + torch.arange(step.query_length, device=device)
    positions = logical.unsqueeze(0) - real_offsets.to(device).view(-1, 1)
    return positions if real_new is None else torch.where(real_new.to(device), positions, -1)


def padding_slots(step: LayerStep, real_new: torch.Tensor | None) -> torch.Tensor:
    """Bool ``[batch, heads, slots]``: stored slots holding this call's padding tokens."""
    read = step.read
    if real_new is None:
        return torch.zeros_like(read.valid)
    new_index = read.positions - step.query_offset
    is_new = read.valid & (new_index >= 0)
    batch = torch.arange(read.valid.shape[0], device=read.valid.device).view(-1, 1, 1)
    real = real_new[batch, new_index.clamp(0, step.query_length - 1)]
    return is_new & ~real
