"""KV-Direct's policy: registered and spelled as a spec, its projections give the keys and values the
model's attention computes from the same input, and the models and compositions it does not serve
are refused in one line before any model work."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib.policies.recompute.kv_direct import GPT2Projection, KVDirect, RopeProjection
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model


def test_registered_as_the_recompute_kind_and_round_trips() -> None:
    assert kvlib.available_policies()["recompute"] == ["kv_direct"]
    policy = kvlib.parse_policy("kv_direct")
    assert isinstance(policy, KVDirect) and policy.kind == "recompute"
    assert str(kvlib.parse_spec(policy.spec())) == "kv_direct" and kvlib.parse_spec("kv_direct").recompute == policy
    with pytest.raises(kvlib.SpecError, match="at most 1 recompute policy"):
        kvlib.parse_spec("kv_direct+kv_direct")
    with pytest.raises(ValueError, match="kv_direct"):
        kvlib.parse_policy("kv_direct(window=3)")


@pytest.mark.parametrize("family, projection", [("llama", RopeProjection), ("qwen2", RopeProjection), ("gpt2", GPT2Projection)])
def test_projections_give_the_models_own_keys_and_values(family: str, projection: type) -> None:
    """Each layer's attention input at the positions the model used, projected, equals the keys
    (after RoPE) and values ``DynamicCache`` holds for them, left padding included."""
    model = build_model(family)
    projections = KVDirect().bind(model)
    assert all(isinstance(p, projection) for p in projections) and len(projections) == 2
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda module, args, kwargs: inputs.__setitem__(module.layer_idx, kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True,
        )
        for module in model.modules()
        if type(module).__name__.endswith("Attention")
    ]
    ids = torch.randint(3, 90, (2, 21), generator=torch.Generator().manual_seed(1))
    positions = torch.stack([torch.arange(21), torch.arange(21).clamp(min=5) - 5])  # row 1: five left-padding positions at 0
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, position_ids=positions, **cache_argument(cache), use_cache=True)
        for layer, projection_of_layer in enumerate(projections):
            keys, values = projection_of_layer.keys_values(inputs[layer], positions)
            assert torch.allclose(keys, cache.layers[layer].keys, atol=1e-6) and torch.allclose(
                values, cache.layers[layer].values, atol=1e-6
            )
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize(
    "family, message",
    [
        ("mistral", r"kv_direct keeps every token; MistralForCausalLM has sliding-window layers \(\[8\] tokens\)"),
        ("gemma3", "kv_direct keeps every token; Gemma3ForCausalLM has sliding-window layers"),
    ],
)
def test_models_it_does_not_serve_are_refused_in_one_line(family: str, message: str) -> None:
    model = build_model(family)
    with pytest.raises(ValueError, match=message) as info:
        kvlib.make_cache(model, "kv_direct")
    assert "\n" not in str(info.value)


def test_an_attention_it_does_not_know_is_refused_naming_what_is_served() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM  # keys normed per head: not served

    model = Qwen3ForCausalLM(
        Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    )
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM's attention \(Qwen3Attention\) is not served: valid: LlamaAttention"):
        kvlib.make_cache(model, "kv_direct")


@pytest.mark.parametrize(
    "spec, options, message",
    [
        ("snapkv+kv_direct", {"budget": 16}, "combines with no other policy and no prefix reuse, got snapkv"),
        ("kivi(bits=4)+kv_direct", {}, "got kivi"),
        ("kv_direct", {"budget": 16}, "budget"),
    ],
)
def test_other_policies_beside_it_are_refused(spec: str, options: dict, message: str) -> None:
    model = build_model("llama")
    with pytest.raises(ValueError, match=message):
        kvlib.make_cache(model, spec, **options)


def test_prefix_reuse_is_refused() -> None:
    model = build_model("llama")
    with pytest.raises(ValueError, match="no prefix reuse, got prefix reuse"):
        kvlib.make_cache(model, "kv_direct", reuse=kvlib.PrefixStore(model, capacity_bytes=1 << 20))
