"""The shipped default model's acceptance figures (issue 5): needle retrieval with the full cache,
and eviction policies that differ on it. The figures are printed (``pytest -s``) for the notes."""

import pytest

import kvlib
from kvlib.default_model import MODEL_DIR, load_default_model
from kvlib.eval import NeedleTask

TASK = NeedleTask(context=1024)


@pytest.fixture(scope="module")
def default():
    return load_default_model()


def needle(model, tokenizer, policy: str | None, fraction: float = 1.0):
    def make(tokens):
        return kvlib.make_cache(model) if policy is None else kvlib.make_cache(model, policy, budget=round(fraction * tokens))

    result = TASK.run(model, tokenizer, make)
    print(f"needle@1024 {policy or 'full'} {fraction:g}: {result.score:.3f} by depth {result.metrics['by_depth']}")
    return result.score


def test_ships_inside_the_package_under_10_mb_with_context_1024(default):
    model, _ = default
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 10 * 2**20
    config = model.config
    assert config.max_position_embeddings >= 1024 and config.num_key_value_heads < config.num_attention_heads


def test_full_cache_finds_the_needle_at_1024(default):
    assert needle(*default, None) >= 0.9


def test_eviction_policies_differ_on_the_needle(default):
    scores = {policy: needle(*default, policy, 0.5) for policy in ("h2o", "streaming_llm")}
    assert scores["h2o"] >= scores["streaming_llm"] + 0.3


@pytest.mark.xfail(
    strict=True,
    reason="measured: snapkv 0.00 vs streaming_llm 0.14 at 12.5%; this model's "
    "retrieval needs more of the context than SnapKV's window attention selects (issue 5 note)",
)
def test_snapkv_keeps_the_needle_where_streaming_llm_loses_it(default):
    assert needle(*default, "snapkv", 0.125) >= needle(*default, "streaming_llm", 0.125) + 0.3
