"""make_cache: bad input gets a clear error before any model work, and loses nothing stored."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

import kvlib
from kvlib import registry
from kvlib.policy import Reuse
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded


def test_models_without_attention_kv_are_refused():
    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2))
    with pytest.raises(ValueError, match="has no attention layer .*linear_attention only.*use DynamicCache"):
        kvlib.make_cache(mamba)
    with pytest.raises(ValueError, match="PreTrainedModel"):
        kvlib.make_cache(torch.nn.Linear(4, 4))


@pytest.mark.parametrize(
    ("spec", "budget", "options", "message"),
    [
        ("no_such_policy", None, {}, "no_such_policy"),
        ("streaming_llm(window=3)", 8, {}, "window"),
        ("streaming_llm", None, {}, "needs a budget"),
        ("streaming_llm", 0, {}, ">= 1"),
        ("streaming_llm", -5, {}, ">= 1"),
        ("streaming_llm", 0.0, {}, r"\(0, 1\]"),
        ("streaming_llm", 1.5, {}, r"\(0, 1\]"),
        ("streaming_llm", True, {}, "int >= 1 or a float"),
        ("streaming_llm", "64", {}, "int >= 1 or a float"),
        (None, 64, {}, "needs an eviction policy"),
        (None, None, {"pagesize": 8}, "unknown make_cache options"),
        (None, None, {"page_size": 0}, "page_size"),
        (None, None, {"read_cache": "yes"}, "read_cache"),
        ("streaming_llm", 8, {"slack": -1}, "slack"),
        ("streaming_llm", 0.5, {"slack": 4}, "slack and interval apply to an int budget"),
        ("streaming_llm", 8, {"interval": 0}, "interval must be an int >= 1"),
        ("streaming_llm", 0.5, {"interval": 4}, "slack and interval apply to an int budget"),
        ("uniform", None, {}, "add an eviction policy"),
        ("streaming_llm+pyramid(beta=0)", 8, {}, "beta"),
        ("streaming_llm+head_importance(profile='/nonexistent.json')", 8, {}, "cannot read head_importance profile"),
    ],
)
def test_bad_arguments_fail_before_the_model_is_touched(spec, budget, options, message):
    model = build_model("llama")
    with pytest.raises(ValueError, match=message):
        kvlib.make_cache(model, spec, budget=budget, **options)
    assert model.config._attn_implementation == "sdpa"


def forward_calls(model: torch.nn.Module) -> list:
    """A list that grows by one at every forward call of ``model``."""
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize(
    ("spec", "budget", "options", "message"),
    [
        (None, None, {"page_size": 10**6}, r"page_size=1000000 is over the limit of 4096 tokens per page"),
        ("streaming_llm", 2**40, {}, r"budget as a token count must be at most 4294967296 .*, got 1099511627776"),
        ("streaming_llm", np.bool_(True), {}, r"budget must be an int >= 1 or a float in \(0, 1\] .*, got np.True_ \(bool\)"),
        ("streaming_llm", torch.tensor([8, 8]), {}, r"got tensor\(\[8, 8\]\) \(Tensor\)"),
        (None, np.int64(8), {}, r"budget=8 needs an eviction policy in the spec"),
        ("kivi(bits=4)", torch.tensor(8), {}, r"budget=8 needs an eviction policy in the spec"),
    ],
    ids=["page-size", "huge-budget", "numpy-bool", "tensor-of-two", "numpy-budget-alone", "tensor-budget-with-a-codec"],
)
def test_bad_sizes_fail_before_anything_is_allocated_or_run(spec, budget, options, message):
    model = build_model("llama")
    calls = forward_calls(model)
    with pytest.raises(ValueError, match=message):
        cache = kvlib.make_cache(model, spec, budget=budget, **options)
        model.generate(torch.tensor([[4, 5, 6]]), **cache_argument(cache), max_new_tokens=2, pad_token_id=PAD)
    assert calls == [] and model.config._attn_implementation == "sdpa"


def test_first_arenas_over_available_memory_fail_before_the_model_runs(monkeypatch):
    model = build_model("llama")
    calls = forward_calls(model)
    monkeypatch.setattr("kvlib.devices.available_bytes", lambda device: 2**20)
    with pytest.raises(
        ValueError,
        match=r"^make_cache\(page_size=4096\) for 2 layers would allocate \d+ bytes .* on cpu up"
        r" front, more than the 1048576 bytes \(0.000977 GiB\) available there",
    ):
        kvlib.make_cache(model, page_size=4096)
    assert calls == [] and model.config._attn_implementation == "sdpa"
    kvlib.make_cache(model, page_size=16)  # 2 layers x 64 pages of 16 tokens fit in 1 MiB


@pytest.mark.parametrize(("scalar", "plain"), [(np.int64(6), 6), (torch.tensor(6), 6), (np.float32(0.5), 0.5), (torch.tensor(0.5), 0.5)])
def test_numpy_and_torch_scalars_are_budgets(scalar, plain):
    model = build_model("llama")
    ids = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    outputs = []
    for budget in (scalar, plain):
        cache = kvlib.make_cache(model, "streaming_llm(sinks=2)", budget=budget)
        assert type(cache.evictor.budget) is type(plain) and cache.evictor.budget == plain
        outputs.append(model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=4, pad_token_id=PAD))
    assert torch.equal(*outputs)


def test_unknown_spec_lists_what_is_registered():
    with pytest.raises(ValueError, match="streaming_llm"):
        kvlib.make_cache(build_model("llama"), "snapkvv")


def test_kinds_the_cache_does_not_apply_yet_are_refused(scratch_registry):
    @registry.register("test_share")
    @dataclass
    class Share(Reuse):
        """Test-only reuse policy."""

    with pytest.raises(ValueError, match="reuse"):
        kvlib.make_cache(build_model("llama"), "streaming_llm+test_share", budget=8)


@pytest.mark.smoke
def test_reusing_a_cache_with_another_batch_size_needs_reset_and_keeps_what_is_stored():
    model = build_model("default")
    cache = kvlib.make_cache(model, "streaming_llm", budget=8)
    ids, _ = left_padded([12], seed=20)
    model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=4, pad_token_id=PAD)
    before = [cache.kept_positions(layer) for layer in range(cache.shape.num_layers)]
    report = cache.memory_report()
    wider, mask = left_padded([5, 7], seed=21)
    with pytest.raises(ValueError, match=r"batch of 1 .* got a batch of 2; call cache.reset\(\)"):
        model.generate(wider, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=2, pad_token_id=PAD)
    assert all(torch.equal(old, cache.kept_positions(layer)) for layer, old in enumerate(before))
    assert cache.memory_report() == report
    cache.reset()
    model.generate(wider, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=2, pad_token_id=PAD)
    assert cache.batch_size == 2


def test_kept_positions_checks_its_layer_and_needs_tokens():
    model = build_model("llama")
    cache = kvlib.make_cache(model)
    with pytest.raises(ValueError, match="holds no tokens"):
        cache.kept_positions(0)
    with torch.no_grad():
        model(input_ids=torch.tensor([[4, 5, 6]]), **cache_argument(cache))
    with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 2\)"):
        cache.kept_positions(2)
    assert cache.kept_positions(1).tolist() == [[[0, 1, 2], [0, 1, 2]]]


def test_a_held_cap_decodes_with_a_page_of_slack_by_default_and_reports_it():
    """An int budget: the prompt is compacted to the cap; while decoding a scoring policy's head
    grows by up to a page (``slack=page_size``) and is compacted back once over it, and
    ``memory_report()["slack_tokens"]`` counts what it holds over the cap; a ring policy
    (``streaming_llm``) and ``slack=0`` hold the cap to the token."""
    model = build_model("llama")
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    held = {}
    for spec, options in (("snapkv", {}), ("snapkv", {"slack": 0}), ("streaming_llm", {})):
        cache = kvlib.make_cache(model, spec, budget=12, page_size=4, **options)
        with torch.no_grad():
            model(ids, **cache_argument(cache), use_cache=True)
            assert cache.memory_report()["stored_tokens"] == 12 * cache.shape.num_kv_heads * cache.shape.num_layers
            token, counts = ids[:, -1:], []
            for _ in range(12):
                token = model(token, **cache_argument(cache), use_cache=True).logits[:, -1:].argmax(-1)
                per_head = torch.stack([(cache.kept_positions(layer) >= 0).sum(-1) for layer in range(cache.shape.num_layers)])
                counts.append(int(per_head.max()))
                assert cache.memory_report()["slack_tokens"] == int((per_head - 12).clamp(min=0).sum())
        held[(spec, tuple(options.items()))] = (cache.evictor.slack, counts)
    assert held[("snapkv", ())] == (4, [13, 14, 15, 16, 12, 13, 14, 15, 16, 12, 13, 14])
    assert held[("snapkv", (("slack", 0),))] == (0, [12] * 12)
    assert held[("streaming_llm", ())] == (0, [12] * 12)
