"""The kvlib attention functions and :func:`route_attention`.

``route_attention(model)`` sets the model's attention implementation to ``kvlib_sdpa`` (or
``kvlib_eager`` for a model that ran eager attention) through ``set_attn_implementation``; both
names are registered in `transformers`' ``AttentionInterface`` (and its mask interface) when this
module is imported. Only models routed so use them: nothing existing is replaced. The Engine
routes its model; :func:`kvlib.attach` (:mod:`kvlib.adapters.cache.model_hooks`) routes it and
adds the forward hooks a :class:`~kvlib.adapters.KVCache` needs.

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

from kvlib.adapters.runtime import layer_step
from kvlib.adapters.runtime.layer_step import AttentionCall, module_key

INNER_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention implementations a kvlib attention function can delegate to."""


def attention_name(inner: str) -> str:
    """The registered name of the kvlib attention function delegating to ``inner``."""
    return f"kvlib_{inner}"


_MODULES: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
"""Routed models' attention modules by :func:`module_key` (held weakly), for the operators of a
compiled forward (:mod:`kvlib.adapters.cache.compiled_calls`), which name a module by an int."""


def attention_module(key: int) -> torch.nn.Module:
    """The attention module of a routed model named by ``key`` (:func:`module_key`)."""
    return _MODULES[key]


def route_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Route ``model``'s attention through kvlib (idempotent); returns the model.

    A model on SDPA or eager keeps that math; other implementations (flash, flex) switch to SDPA,
    which handles per-head masks over physical slots. Raises ``ValueError`` if the model does not
    take the change (its attention does not go through ``AttentionInterface``). Its modules with
    an int ``layer_idx`` are named for compiled forwards (:func:`module_key`).
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
    for module in model.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            _MODULES[module_key(module)] = module
    return model


def inner_attention(inner: str, module: torch.nn.Module) -> Callable:
    """The attention function doing the math of a kvlib attention function on ``module``: SDPA,
    or the eager attention of the module's own model file (``inner``: "sdpa" or "eager")."""
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
        run = inner_attention(inner, module)
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
