"""The step hand-off between a cache's update and the attention call: through the attention
kwargs (transformers 5.24+) and, for releases and models that pass none, the context variable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvlib
from kvlib.adapters.cache.cache_layer import KVCacheLayer
from kvlib.adapters.engine.packed_batch import PackedCache
from kvlib.adapters.runtime import layer_step
from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded


def _without_attention_kwargs(monkeypatch, cache_class: type) -> None:
    """Make ``cache_class.update`` ignore the attention kwargs, as before transformers 5.24."""
    update = cache_class.update

    def update_without_kwargs(self, key_states, value_states, *args, kwargs=None, **rest):
        return update(self, key_states, value_states, *args, **rest)

    monkeypatch.setattr(cache_class, "update", update_without_kwargs)


def _generate(model, ids, mask, cache):
    return model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=6, pad_token_id=PAD)


@pytest.mark.parametrize("spec, budget", [(None, None), ("h2o", 8), ("quest(top_k=2, dense_layers=1)", None)])
def test_the_context_variable_hands_the_step_over_as_the_kwargs_do(monkeypatch, spec, budget) -> None:
    model = build_model("llama")
    ids, mask = left_padded([14, 9], seed=4)
    with_kwargs = _generate(model, ids, mask, kvlib.make_cache(model, spec, budget=budget))
    with monkeypatch.context() as patch:
        _without_attention_kwargs(patch, KVCacheLayer)
        cache = kvlib.make_cache(model, spec, budget=budget)
        without = _generate(model, ids, mask, cache)
    assert torch.equal(with_kwargs, without)
    assert all(layer.pending is None for layer in cache.layers)  # every step's attention ran through kvlib


def test_the_engine_hands_packed_steps_over_without_kwargs_too(monkeypatch) -> None:
    model = build_model("llama")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    expected = kvlib.Engine(model, max_batch_tokens=8).generate(prompts, max_new_tokens=4)
    _without_attention_kwargs(monkeypatch, PackedCache)
    assert kvlib.Engine(model, max_batch_tokens=8).generate(prompts, max_new_tokens=4) == expected


@pytest.mark.parametrize("in_kwargs", [True, False], ids=["attention-kwargs", "context-variable"])
def test_a_step_is_taken_once_and_only_by_its_own_call(in_kwargs: bool) -> None:
    keys = torch.zeros(1, 1, 2, 4)
    positions = torch.arange(2).view(1, 1, 2)
    owner = SimpleNamespace(module_layer=3)  # the layer whose attention module carries layer_idx 3
    step = LayerStep(owner, 3, LayerRead(keys, keys, positions, positions >= 0), 0, 2, identity=True)
    layer_3, layer_4 = torch.nn.Module(), torch.nn.Module()
    layer_3.layer_idx, layer_4.layer_idx = 3, 4

    def published() -> dict:
        attention_kwargs: dict = {}
        layer_step.publish(step, attention_kwargs if in_kwargs else None)
        return attention_kwargs

    assert layer_step.take(layer_4, keys, published()) is None  # another layer's call
    assert layer_step.take(layer_3, keys.clone(), published()) is step  # other keys: the step checks them when it attends
    attention_kwargs = published()
    assert layer_step.take(layer_3, keys, attention_kwargs) is step
    assert layer_step.STEP_KEYWORD not in attention_kwargs  # the inner attention never sees it
    assert layer_step.take(layer_3, keys, attention_kwargs) is None
