"""A ``kv_direct`` cache through ``generate``: the exact cache's outputs (greedy tokens, sampling,
beams, left padding; logits to float rounding) from pages holding one checkpoint per token and
layer, at under 0.6x the exact cache's bytes on multi-head models; the Engine refuses it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvlib
from kvlib.adapters.cache.shared_prefill import sharing_refusal
from kvlib.adapters.cache.transformers_cache import KVCache
from kvlib.model_shape import kv_shape
from kvlib.policies.recompute.kv_direct import KVDirect
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, VOCAB, build_model, left_padded

NEW_TOKENS = 12


def multi_head_llama() -> LlamaForCausalLM:
    """A random Llama with as many KV heads as query heads (a checkpoint is half its keys and values)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4
    )
    return LlamaForCausalLM(config).eval()


MODELS = {
    "llama_mha": multi_head_llama,
    "gpt2": lambda: build_model("gpt2"),
    "llama": lambda: build_model("llama"),
}
MULTI_HEAD = {"llama_mha", "gpt2"}


def run(model, cache, ids, mask, **options):
    return model.generate(
        ids,
        attention_mask=mask,
        **cache_argument(cache),
        max_new_tokens=NEW_TOKENS,
        pad_token_id=PAD,
        output_logits=True,
        return_dict_in_generate=True,
        **options,
    )


@pytest.mark.parametrize("name", MODELS)
def test_greedy_outputs_equal_the_exact_caches_from_checkpoints(name: str) -> None:
    model = MODELS[name]()
    ids, mask = left_padded([33, 20], seed=7)
    cache, exact = kvlib.make_cache(model, "kv_direct"), kvlib.make_cache(model)
    recomputed, reference = run(model, cache, ids, mask, do_sample=False), run(model, exact, ids, mask, do_sample=False)
    assert torch.equal(recomputed.sequences, reference.sequences)
    for ours, theirs in zip(recomputed.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    held, full = cache.memory_report(), exact.memory_report()
    hidden = model.config.get_text_config().hidden_size
    tokens = ids.shape[1] + NEW_TOKENS - 1  # the last token is generated, never stored
    pages = kv_shape(model).num_layers * 2 * -(-tokens // 16)  # per layer and row: one checkpoint a token, 16 a page
    assert held["by_component"]["pages"] == pages * 16 * hidden * 4  # float32 checkpoints
    assert held["full_equivalent_bytes"] == full["full_equivalent_bytes"]
    if name in MULTI_HEAD:
        assert held["total_bytes"] <= 0.6 * full["total_bytes"], (held["total_bytes"], full["total_bytes"])


def test_pages_hold_each_tokens_checkpoint_and_position() -> None:
    """What a layer stores is the attention input itself, split over the row's key and value, at
    the position ids the model gave the tokens (0 for left padding, as ``generate`` gives it)."""
    model = multi_head_llama()
    ids, mask = left_padded([12, 7], seed=2)
    inputs: list[torch.Tensor] = []
    hook = model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.append(kwargs["hidden_states"]), with_kwargs=True
    )
    cache = kvlib.make_cache(model, "kv_direct")
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **cache_argument(cache), use_cache=True)
    hook.remove()
    read = cache.store.read(1, cache.rows)
    assert read.keys.shape == (2, 1, 12, 16) and read.values.shape == (2, 1, 12, 16)
    assert torch.equal(torch.cat([read.keys[:, 0], read.values[:, 0]], -1), inputs[0])
    assert read.positions[1, 0].tolist() == [0] * 5 + list(range(7))


@pytest.mark.parametrize("options", [{"do_sample": True, "top_k": 5}, {"do_sample": False, "num_beams": 2}], ids=["sampling", "beams"])
def test_sampling_and_beams_equal_the_exact_caches(options: dict) -> None:
    model = build_model("gpt2")
    ids, mask = left_padded([30, 22], seed=3)
    outputs = []
    for spec in ("kv_direct", None):
        torch.manual_seed(5)
        outputs.append(run(model, kvlib.make_cache(model, spec), ids, mask, **options).sequences)
    assert torch.equal(*outputs)


def test_the_engine_refuses_it_in_one_line() -> None:
    with pytest.raises(ValueError, match="kv_direct stores checkpoints instead of keys and values; the engine's packed attention") as info:
        kvlib.Engine(build_model("llama"), spec="kv_direct")
    assert "\n" not in str(info.value)


def test_a_call_without_its_checkpoint_is_refused() -> None:
    """A kv_direct cache used on a model its hooks were not added to has no checkpoint to store."""
    model = build_model("llama")
    cache = KVCache(kv_shape(model), projections=KVDirect().bind(model), home=(torch.float32, torch.device("cpu")))
    with pytest.raises(RuntimeError, match="without the checkpoint they were computed from"):
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]), **cache_argument(cache), use_cache=True)


def test_a_comparison_runs_it_apart_not_from_a_shared_prompt_call() -> None:
    cache = kvlib.make_cache(build_model("llama"), "kv_direct")
    assert (
        sharing_refusal(cache) == "its layers store the attention input (checkpoints), which a replayed call's keys and values do not give"
    )


def test_eager_attention_gives_the_exact_caches_tokens() -> None:
    """Through kvlib's eager attention function as through its SDPA one."""
    model = build_model("gpt2", attn_implementation="eager")
    ids, mask = left_padded([33, 20], seed=4)
    outputs = [run(model, kvlib.make_cache(model, spec), ids, mask, do_sample=False).sequences for spec in ("kv_direct", None)]
    assert torch.equal(*outputs) and model.config._attn_implementation == "kvlib_eager"
