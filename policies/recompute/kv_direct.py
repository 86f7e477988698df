"""KV-Direct: each layer stores its attention input per token, and recomputes keys and values from it."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from kvlib.model_shape import attention_modules, kv_shape
from kvlib.policy import CheckpointProjection, Recompute
from kvlib.registry import register

ROPE_ATTENTION = ("LlamaAttention", "Qwen2Attention")
"""Attention modules whose keys are ``RoPE(k_proj(x))`` and values ``v_proj(x)`` of their input
``x``, with the decoder's ``rotary_emb`` and their modeling module's ``apply_rotary_pos_emb``
(no key norm, no sliding window): served, and tested."""
GPT2_ATTENTION = ("GPT2Attention",)
"""Attention modules whose keys and values are split from ``c_attn(x)`` (no RoPE: positions are
in the residual stream already)."""


class RopeProjection(CheckpointProjection):
    """Keys ``RoPE(k_proj(x))`` and values ``v_proj(x)``, as Llama-family attention computes them:
    the module's own projections, the decoder's rotary embedding and the modeling module's
    ``apply_rotary_pos_emb`` (so the recomputation is the model's own arithmetic)."""

    def __init__(self, module: torch.nn.Module, rotary: torch.nn.Module) -> None:
        self.module, self.rotary = module, rotary
        self.apply_rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
        self.dim = module.k_proj.in_features

    def keys_values(self, checkpoints: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads = (*checkpoints.shape[:-1], -1, self.module.head_dim)
        keys = self.module.k_proj(checkpoints).view(heads).transpose(1, 2)
        values = self.module.v_proj(checkpoints).view(heads).transpose(1, 2)
        cos, sin = self.rotary(checkpoints, positions)
        _, keys = self.apply_rope(keys, keys, cos, sin)
        return keys, values


class GPT2Projection(CheckpointProjection):
    """Keys and values split from GPT-2's fused ``c_attn(x)`` (queries, keys, values)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.dim = module.embed_dim

    def keys_values(self, checkpoints: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, keys, values = self.module.c_attn(checkpoints).split(self.module.split_size, dim=2)
        heads = (*keys.shape[:-1], -1, self.module.head_dim)
        return keys.view(heads).transpose(1, 2), values.view(heads).transpose(1, 2)


@register("kv_direct")
@dataclass
class KVDirect(Recompute):
    """KV-Direct (Qasim, Zhang, Shaheen, Alharith and Zhang, 2026, "The Residual Stream Is All You
    Need: On the Redundancy of the KV Cache in Transformer Inference", arXiv:2603.19664): a layer's
    keys and values are deterministic projections of the residual stream, so the cache keeps, per
    token and layer, the vector that enters the layer's key and value projections (the attention
    module's input: the residual after the layer's input norm) and recomputes keys and values from
    it (projections, RoPE at the token's position) whenever the layer is read. A checkpoint holds
    ``hidden_size`` channels where keys and values hold ``2 * kv_heads * head_dim``: half the bytes
    on a model with as many KV heads as query heads (GPT-2, an MHA Llama), more than the cache on a
    grouped-query model with fewer than ``hidden_size / (2 * head_dim)`` KV heads.

    Outputs equal the exact cache's: the new tokens' keys and values are the model's own, older
    ones are recomputed with the model's own modules (equal to float rounding). Served: Llama and
    Qwen2 attention (:data:`ROPE_ATTENTION`) and GPT-2; any other model, sliding-window layers, and
    every other policy in the same spec are refused in one line before any model work.
    """

    def bind(self, model: torch.nn.Module) -> list[CheckpointProjection]:
        shape = kv_shape(model)
        if shape.dense or shape.has_state_layers:
            raise ValueError(f"kv_direct recomputes attention layers' keys and values; {type(model).__name__} is not served")
        if any(window is not None for window in shape.windows):
            raise ValueError(
                f"kv_direct keeps every token; {type(model).__name__} has sliding-window layers"
                f" ({sorted({w for w in shape.windows if w is not None})} tokens), which it does not serve"
            )
        modules = attention_modules(model, shape)
        names = sorted({type(module).__name__ for module in modules})
        if set(names) <= set(GPT2_ATTENTION):
            return [GPT2Projection(module) for module in modules]
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        if set(names) <= set(ROPE_ATTENTION) and rotary is not None:
            return [RopeProjection(module, rotary) for module in modules]
        raise ValueError(
            f"kv_direct recomputes keys and values with a model's own modules; {type(model).__name__}'s attention"
            f" ({', '.join(names)}) is not served: valid: {', '.join(ROPE_ATTENTION + GPT2_ATTENTION)}"
        )
