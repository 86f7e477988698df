"""The kvlib attention functions and :func:`attach`.

``attach(model)`` sets the model's attention implementation to ``kvlib_sdpa`` (or
``kvlib_eager`` for a model that ran eager attention) through ``set_attn_implementation``; both
names are registered in `transformers`' ``AttentionInterface`` (and its mask interface) when this
module is imported. Only models that are attached use them: nothing existing is replaced.

A kvlib attention function delegates the math to SDPA or to the model's own eager attention. It
takes the step the cache layer published for this call (:func:`~kvlib.adapters.runtime.layer_step.take`)
and lets the step attend (:meth:`~kvlib.adapters.runtime.layer_step.Step.attend`):

- a :class:`~kvlib.adapters.KVCache` layer's step translates the model's mask, built over logical
  positions, to the stored physical slots (:func:`~kvlib.adapters.runtime.masks.physical_mask`) once
  tokens have been dropped, attends straight over the pages where it may, or over the pages the
  query chooses (``quest``), then runs the layer's after-attention work (eviction, sealing...);
- a packed ragged batch of the engine (:mod:`kvlib.adapters.engine.packed_batch`) runs each segment's
  attention over its own sequences.

Calls with no step (keys from any other cache, cross-attention) run the inner attention unchanged.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward as generic_eager_attention

from kvlib.adapters.cache.transformers_cache import KVCache
from kvlib.adapters.runtime import layer_step
from kvlib.adapters.runtime.layer_step import AttentionCall
from kvlib.transformers_compat import passed_cache

INNER_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention implementations a kvlib attention function can delegate to."""

_hooked_models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_recording_models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Models whose attention modules hand their input to a cache that needs it."""


def attention_name(inner: str) -> str:
    """The registered name of the kvlib attention function delegating to ``inner``."""
    return f"kvlib_{inner}"


def attach(model: PreTrainedModel, *, hidden_states: bool = False) -> PreTrainedModel:
    """Route ``model``'s attention through kvlib (idempotent); returns the model.

    A model on SDPA or eager keeps that math; other implementations (flash, flex) switch to SDPA,
    which handles per-head masks over physical slots. Raises ``ValueError`` if the model does not
    take the change (its attention does not go through ``AttentionInterface``).

    Hooks added to this model only: a forward pre-hook that makes a :class:`KVCache` refuse a
    batch of another size before any work and plan a decode step for every layer before the
    forward runs (:meth:`KVCache.prepare_step`), and, with ``hidden_states`` (a cache whose
    strategy needs them; once added they stay), pre-hooks on the attention modules that hand
    their input to such a cache.
    """
    current = model.config._attn_implementation
    if current not in {attention_name(inner) for inner in INNER_IMPLEMENTATIONS}:
        inner = current if current in INNER_IMPLEMENTATIONS else "sdpa"
        model.set_attn_implementation(attention_name(inner))
        if model.config._attn_implementation != attention_name(inner):
            raise ValueError(
                f"{type(model).__name__} did not accept attn_implementation={attention_name(inner)!r}; kvlib needs a model"
                " whose attention goes through transformers' AttentionInterface"
            )
    if model not in _hooked_models:
        model.register_forward_pre_hook(_prepare_cache, with_kwargs=True)
        _hooked_models.add(model)
    if hidden_states and model not in _recording_models:
        for module in model.modules():
            if isinstance(getattr(module, "layer_idx", None), int) and type(module).__name__.endswith("Attention"):
                module.register_forward_pre_hook(_record_hidden_states, with_kwargs=True)
        _recording_models.add(model)
    return model


def _prepare_cache(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on an attached model: a KVCache refuses another batch size before any work,
    then plans the call if it is a decode step (:meth:`KVCache.prepare_step`), outside the forward."""
    cache = passed_cache(kwargs)
    if isinstance(cache, KVCache):
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        if inputs is not None:
            cache.check_batch(inputs.shape[0])
            cache.prepare_step(inputs.shape[1], kwargs.get("attention_mask"))


def _record_hidden_states(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on attention modules: hands the input to a KVCache whose strategy needs it."""
    cache = passed_cache(kwargs)
    if isinstance(cache, KVCache):
        cache.record_hidden_states(module.layer_idx, kwargs.get("hidden_states", args[0] if args else None))


def _inner_attention(inner: str, module: torch.nn.Module) -> Callable:
    if inner == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return own or generic_eager_attention


def _kvlib_attention(inner: str) -> Callable:
    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        run = _inner_attention(inner, module)
        step = layer_step.take(module, key, kwargs)
        if step is None:
            return run(module, query, key, value, attention_mask, **kwargs)
        return step.attend(
            AttentionCall(
                module=module,
                query=query,
                key=key,
                value=value,
                attention_mask=attention_mask,
                inner=run,
                eager=inner == "eager",
                kwargs=kwargs,
            )
        )

    attention.__name__ = f"{attention_name(inner)}_attention"
    attention.__doc__ = f"kvlib attention over the paged store, delegating the math to {inner}."
    return attention


def _register() -> None:
    masks = {"sdpa": sdpa_mask, "eager": eager_mask}
    for inner in INNER_IMPLEMENTATIONS:
        AttentionInterface.register(attention_name(inner), _kvlib_attention(inner))
        AttentionMaskInterface.register(attention_name(inner), masks[inner])


_register()
