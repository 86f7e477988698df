"""What the engine hands an eviction policy of one layer: :class:`LayerView`, the inputs a
policy may declare in ``needs`` (:data:`NEEDS`), and a model's rotary embedding (:class:`Rope`).

Part of the policy API (:mod:`kvlib.policy` imports these names, and policies may import
them from there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

NEEDS = frozenset(
    {
        "queries",
        "window_queries",
        "attention",
        "accumulated_attention",
        "hidden_states",
        "rope",
        "recent_queries",
        "prompt_length",
        "output_projection",
        "budget",
        "call_notes",
    }
)
"""What an eviction policy may ask the engine for in ``needs`` (the :class:`LayerView` fields it fills):

- ``queries``: the current call's queries ``[batch, query_heads, q_len, head_dim]`` (after RoPE)
  and ``query_positions`` int64 ``[batch, q_len]`` (-1 for padding);
- ``window_queries``: the last ``observed_queries()`` of them (the observation window);
- ``attention``: softmax attention weights of those last queries over the stored slots,
  float32 ``[batch, query_heads, observed, slots]``, 0 where the mask forbids;
- ``accumulated_attention``: float32 ``[batch, kv_heads, slots]``, the attention each stored token
  has received from every query since it was stored (prefill and decoding, this call included),
  summed over queries and averaged over the query heads of its KV group;
- ``hidden_states``: the attention module's input ``[batch, q_len, hidden]``;
- ``rope``: the model's rotary embedding as a :class:`Rope` (None for a model without RoPE);
- ``recent_queries``: the layer's last ``observed_queries()`` real queries *across calls* (a decode
  step adds one; the engine keeps them between calls, in step with the cache's rows): their
  positions ``recent_query_positions`` int64 ``[batch, observed]`` (oldest first, -1 where a row
  has seen fewer) and ``recent_attention`` float32 ``[batch, query_heads, observed, slots]``, each
  one's softmax attention over the stored slots it can see (position <= its own), recomputed
  over the keys stored now, 0 elsewhere and in rows of missing queries. The attention is computed
  from the view's keys, so such a policy keeps ``reads_kv`` True;
- ``prompt_length``: ``prompt_lengths`` int64 ``[batch]``, the positions each row's first call and
  its calls of more than one token (its prompt, or prompt chunks) have written; positions at or
  past it were written by decode steps.
- ``output_projection``: the layer's attention output projection ``W_o`` split by query head,
  ``[query_heads, value_dim, hidden]`` (the module's output is ``sum_h out_h @ W_o[h]`` plus its
  bias), in the model's dtype and device;
- ``budget``: ``budget_tokens`` int64 ``[batch]``, the call's budget in tokens per (layer, head) on
  average (what :class:`~kvlib.policy.BudgetRequest` ``tokens`` holds), None when the call compacts nothing.
- ``call_notes``: a dict shared by the layers of one model call (one forward pass, layers in
  order), empty at its first layer: what a layer chose, left for later layers of the same call
  (FastKV's propagated tokens, WindowKV's group selection). The engine owns it per cache (or per
  Engine request) and clears it when a call begins, so nothing outlives a call or passes between
  caches; keys are the policy's to choose.
"""


@dataclass(frozen=True)
class Rope:
    """A model's rotary position embedding (Llama-family "rotate half" layout).

    ``inv_freq`` float32 ``[head_dim // 2]``: radians per position of channel pair ``i`` (channel
    ``i`` pairs with ``i + head_dim // 2``); ``scaling``: the factor on cos and sin. A query at
    position ``p`` is ``R(p) q`` with ``R`` rotating each pair by ``p * inv_freq[i]``.
    """

    inv_freq: torch.Tensor
    scaling: float = 1.0


@dataclass
class LayerView:
    """What an eviction policy sees of one layer of a batch (physical slots, padded).

    keys ``[batch, kv_heads, slots, head_dim]`` (after RoPE), values ``[batch, kv_heads, slots,
    value_dim]``, positions int64 ``[batch, kv_heads, slots]`` (original positions counted from the
    row's first real token, -1 where invalid), valid bool ``[batch, kv_heads, slots]`` (the tokens
    the policy chooses among; padding is never valid). Slots of a head are in position order
    (ascending), except for an :attr:`~kvlib.policy.Eviction.order_free` policy, which sees them where they
    are stored: after a decode-step eviction that reused a slot, in no particular order. Invalid
    slots may sit anywhere: a left-padded row's padding comes
    before its real tokens at prefill, and a head holding fewer tokens than others ends in
    invalid slots; count ranks among valid slots, not slot indices. The optional fields are filled only for
    policies that declare them in ``needs`` (see :data:`NEEDS`).
    """

    layer_idx: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    queries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    window_queries: torch.Tensor | None = None
    attention: torch.Tensor | None = None
    accumulated_attention: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    rope: Rope | None = None
    recent_attention: torch.Tensor | None = None
    recent_query_positions: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None
    output_projection: torch.Tensor | None = None
    budget_tokens: torch.Tensor | None = None
    call_notes: dict[str, Any] | None = None
    page_size: int | None = None
    """Tokens per page of the store (slot ``s`` of a head lies in its page ``s // page_size``):
    given to :meth:`~kvlib.policy.Tiering.ranking_scores`, None for eviction policies."""
