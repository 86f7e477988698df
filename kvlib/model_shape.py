"""What a `transformers` model stores per token: attention layers, KV heads and head sizes.

:func:`kv_shape` reads it from the model's (text) config and rejects, with a message naming the
problem, models kvlib cannot cache: no attention KV (state-space and linear-attention layers),
encoder-decoder models, models whose attention does not go through ``AttentionInterface``,
multi-head latent attention (MLA: DeepSeek V2/V3, Kimi, MiniCPM3, ...: its layers cache one
compressed latent and one shared rotary key per token, not keys and values per head) and layers
that keep compressed or indexed KV state beside their keys and values (DeepSeek V4). Key and
value heads of different sizes (``head_dim`` and ``v_head_dim``, as in MiMo-V2-Flash) are held
as they are: a page keeps ``head_dim`` key and ``value_dim`` value channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlib.strategy import Rope

_NON_ATTENTION_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv", "recurrent", "ssm"})
_COMPRESSED_LAYER_TYPES = frozenset(
    {"compressed_sparse_attention", "heavily_compressed_attention", "indexed_attention", "minimax_m3_sparse"}
)
"""Attention layers whose cache keeps compressed KV or indexer keys beside keys and values."""


@dataclass(frozen=True)
class KVShape:
    """Per-token KV layout of a decoder.

    Attributes:
        num_layers: attention layers (each calls ``cache.update`` with its ``layer_idx``).
        num_kv_heads: key/value heads per layer.
        num_query_heads: query heads per layer (a multiple of ``num_kv_heads``).
        head_dim: channels per key head; ``value_dim`` per value head.
        windows: per layer, the sliding window of a sliding-window layer (a query at position
            ``q`` sees positions ``q - window + 1 .. q``), None for a layer that sees every
            position; empty: no layer slides.
    """

    num_layers: int
    num_kv_heads: int
    num_query_heads: int
    head_dim: int
    value_dim: int
    windows: tuple[int | None, ...] = ()

    def window(self, layer: int) -> int | None:
        """``layer``'s sliding window, or None where it attends to every position."""
        return self.windows[layer] if self.windows else None


def kv_shape(model: torch.nn.Module) -> KVShape:
    """The KV layout of ``model``; ``ValueError`` (before any model work) if it has none kvlib can hold."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"kvlib caches `transformers` PreTrainedModel decoders; got {type(model).__name__}, which has no config"
            " or no set_attn_implementation"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; kvlib caches decoder-only models")
    text = config.get_text_config(decoder=True)
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(layers, int) or not isinstance(heads, int) or layers < 1 or heads < 1:
        raise ValueError(
            f"{type(model).__name__} has no attention KV to cache: its config lacks num_hidden_layers /"
            " num_attention_heads (state-space and other attention-free models are not supported)"
        )
    layer_types = getattr(text, "layer_types", None) or ()
    other = sorted(set(layer_types) & _NON_ATTENTION_LAYER_TYPES)
    if other:
        raise ValueError(
            f"{type(model).__name__} has non-attention layers ({', '.join(other)}); kvlib caches models whose every layer is attention"
        )
    _check_attention_form(model, text, layer_types)
    if not type(model)._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so kvlib"
            " cannot attach its attention function"
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return KVShape(layers, kv_heads, heads, head_dim, getattr(text, "v_head_dim", None) or head_dim, sliding_windows(text, layers))


def sliding_windows(text: object, layers: int) -> tuple[int | None, ...]:
    """Per layer, the sliding window the model's masks apply, as ``transformers``' ``DynamicCache``
    reads it: ``sliding_window`` for the ``"sliding_attention"`` entries of ``layer_types``, for
    every layer where the config has no ``layer_types`` (Mistral); empty where no layer slides.
    Chunked attention (Llama 4) is not a window: its layers hold every token."""
    window = getattr(text, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return ()
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        return (window,) * layers
    windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(w is not None for w in windows) else ()


def _check_attention_form(model: torch.nn.Module, text: object, layer_types: Sequence[str]) -> None:
    """``ValueError`` for attention whose cache holds something other than per-head keys and values."""
    name = f"{type(model).__name__} (model_type {getattr(text, 'model_type', '?')!r})"
    rank = getattr(text, "kv_lora_rank", None)
    if rank is not None:
        raise ValueError(
            f"{name} uses multi-head latent attention (MLA, kv_lora_rank={rank}): its layers cache one compressed"
            f" latent of {rank} channels and one shared rotary key per token, not keys and values per head, and"
            " kvlib's pages and attention hold per-head keys and values only; MLA models are not supported"
        )
    compressed = sorted(set(layer_types) & _COMPRESSED_LAYER_TYPES)
    if compressed:
        raise ValueError(
            f"{name} has {', '.join(compressed)} layers, whose cache keeps compressed or indexed KV state beside keys"
            " and values; kvlib holds per-head keys and values only, so these models are not supported"
        )


def rope_of(model: torch.nn.Module, head_dim: int) -> Rope | None:
    """The model's rotary embedding (its first module with an ``inv_freq`` buffer), or None
    without RoPE. Partial rotary embeddings (``inv_freq`` covering fewer than ``head_dim``
    channels) are reported as None too: :class:`Rope` describes whole-head rotations only."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            if 2 * inv_freq.numel() != head_dim:
                return None
            return Rope(inv_freq.detach().float(), float(getattr(module, "attention_scaling", 1.0)))
    return None


def attention_modules(model: torch.nn.Module, shape: KVShape) -> list[torch.nn.Module]:
    """Each layer's attention module, in layer order: the modules with an int ``layer_idx`` and an
    output projection (``o_proj``, a ``Linear``: Llama family; or GPT-2's ``c_attn`` with a
    ``c_proj``). ``ValueError`` for a model without one in every layer."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            continue
        if isinstance(getattr(module, "o_proj", None), torch.nn.Linear) or (
            hasattr(module, "c_attn") and isinstance(getattr(getattr(module, "c_proj", None), "weight", None), torch.Tensor)
        ):
            found[layer] = module
    if sorted(found) != list(range(shape.num_layers)):
        raise ValueError(
            f"{type(model).__name__}: no attention module with an output projection (o_proj or GPT-2's c_proj) found in"
            f" every layer (found layers {sorted(found)})"
        )
    return [found[layer] for layer in range(shape.num_layers)]


def output_projections(model: torch.nn.Module, shape: KVShape) -> list[torch.Tensor]:
    """Each layer's attention output projection split by query head: ``[query_heads, value_dim,
    hidden]`` per layer (views of the weights, no copies), so that the attention module's output
    is ``sum_h out_h @ W_o[h]`` plus its bias.

    The modules are :func:`attention_modules`'; ``o_proj`` is a ``Linear`` (``weight`` is
    ``[hidden, heads * value_dim]``), GPT-2's ``c_proj`` a ``Conv1D`` (``weight`` is ``[heads *
    value_dim, hidden]``). ``ValueError`` (naming output_projection) for a model without them."""
    try:
        modules = attention_modules(model, shape)
    except ValueError as exc:
        raise ValueError(f"{exc}; strategies that need output_projection cannot run on it") from None
    weights = [m.o_proj.weight.detach().t() if hasattr(m, "o_proj") else m.c_proj.weight.detach() for m in modules]
    return [w.reshape(shape.num_query_heads, shape.value_dim, -1) for w in weights]


def model_context(model: torch.nn.Module) -> int | None:
    """The most positions ``model``'s (text) config declares it takes (``max_position_embeddings``,
    ``n_positions`` for GPT-2), or None where it declares none."""
    text = model.config.get_text_config(decoder=True)
    context = getattr(text, "max_position_embeddings", None)
    return context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None


def shares_kv_across_layers(model: torch.nn.Module) -> bool:
    """Whether some layers of ``model`` attend over keys and values another layer computed and
    stored, calling no cache ``update`` of their own (Gemma 3n and Gemma 4's KV sharing: the
    config's ``kv_sharing_modes`` has ``"reuse"`` layers)."""
    text = model.config.get_text_config(decoder=True)
    modes = getattr(text, "kv_sharing_modes", None) or ()
    return "reuse" in modes
