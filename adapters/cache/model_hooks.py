""":func:`attach`: a model's attention routed through kvlib, with the forward hooks a
:class:`~kvlib.adapters.KVCache` needs.

The routing itself (:func:`~kvlib.adapters.runtime.attention.route_attention`) is the runtime's,
shared with the Engine; the hooks are the cache's: they act on a ``KVCache`` passed to the
forward and leave any other cache (the Engine's packed batch, ``DynamicCache``) alone.
"""

from __future__ import annotations

import weakref

import torch
from transformers import PreTrainedModel

from kvlib.adapters.cache.recomputed_layer import record_checkpoint
from kvlib.adapters.cache.transformers_cache import KVCache
from kvlib.adapters.runtime.attention import route_attention
from kvlib.transformers_compat import passed_cache

_hooked_models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Models with the forward pre-hook that prepares a KVCache's call."""
_recording_models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Models whose attention modules hand their input to a cache that needs it."""
_checkpointing_models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Models whose attention modules hand their input and position ids to a cache storing checkpoints."""


def attach(model: PreTrainedModel, *, hidden_states: bool = False, route: bool = True, checkpoints: bool = False) -> PreTrainedModel:
    """Route ``model``'s attention through kvlib (idempotent; not with ``route`` False: a model
    whose attention does not go through ``AttentionInterface``, served densely); returns the model.

    A model on SDPA or eager keeps that math; other implementations (flash, flex) switch to SDPA,
    which handles per-head masks over physical slots. Raises ``ValueError`` if the model does not
    take the change (its attention does not go through ``AttentionInterface``).

    Hooks added to this model only: a forward pre-hook that makes a :class:`KVCache` refuse a
    second thread and a batch of another size before any work (holding its PrefixStore's lock,
    if it lives in one, until a forward hook that runs however the call ends:
    :meth:`KVCache.enter_call`) and plan a decode step for every layer before the
    forward runs (:meth:`KVCache.prepare_step`), and, with ``hidden_states`` (a cache whose
    policy needs them; once added they stay), pre-hooks on the attention modules that hand
    their input to such a cache; with ``checkpoints`` (a cache whose layers store checkpoints,
    :mod:`~kvlib.adapters.cache.recomputed_layer`), pre-hooks handing it their input and position ids.
    """
    if route:
        route_attention(model)
    if model not in _hooked_models:
        model.register_forward_pre_hook(_prepare_cache, with_kwargs=True)
        model.register_forward_hook(_finish_call, with_kwargs=True, always_call=True)
        _hooked_models.add(model)
    if hidden_states and model not in _recording_models:
        for module in _attention_modules(model):
            module.register_forward_pre_hook(_record_hidden_states, with_kwargs=True)
        _recording_models.add(model)
    if checkpoints and model not in _checkpointing_models:
        for module in _attention_modules(model):
            module.register_forward_pre_hook(_record_checkpoint, with_kwargs=True)
        _checkpointing_models.add(model)
    return model


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s attention modules (those carrying an int ``layer_idx``)."""
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")]


def _prepare_cache(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on an attached model: a KVCache refuses another batch size before any work,
    then plans the call if it is a decode step (:meth:`KVCache.prepare_step`), outside the forward."""
    cache = passed_cache(kwargs)
    if isinstance(cache, KVCache) and not torch.compiler.is_compiling():  # traced: each operator does this (compiled_calls)
        cache.enter_call()
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        if inputs is not None:
            cache.check_batch(inputs.shape[0])
            cache.prepare_step(inputs.shape[1], kwargs.get("attention_mask"))


def _finish_call(model: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    """Forward hook on an attached model, run however the call ends: the call :func:`_prepare_cache`
    started is over (:meth:`KVCache.leave_call`)."""
    cache = passed_cache(kwargs)
    if isinstance(cache, KVCache) and not torch.compiler.is_compiling():
        cache.leave_call()


def _record_hidden_states(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on attention modules: hands the input to a KVCache whose policy needs it."""
    cache = passed_cache(kwargs)
    if isinstance(cache, KVCache):
        cache.record_hidden_states(module.layer_idx, kwargs.get("hidden_states", args[0] if args else None))


def _record_checkpoint(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on attention modules: hands the input and position ids to a KVCache storing checkpoints."""
    cache = passed_cache(kwargs)
    if isinstance(cache, KVCache) and cache.projections is not None:
        record_checkpoint(cache, module.layer_idx, kwargs.get("hidden_states", args[0] if args else None), kwargs.get("position_ids"))
