"""fastkv: SnapKV per head below the TSP layer (against the SnapKV loop reference); at the TSP
layer one shared score per position (against a loop reference summing heads); later layers of
the same call reuse it by position; through generate (tiny Llama, GPT-2, the embedded default model, SmolLM2)
every layer from the TSP layer on keeps one token set in every head, budget met exactly, bytes
matching the kept tokens; bad parameters refused."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.eviction.fastkv import NOTE, FastKV
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import DEFAULT_BYTES, PAD, build_model, left_padded, prompt_vocab
from tests.policies.eviction.kept_bytes import assert_budget_and_bytes, same_positions_in_every_head, smollm2_prompt
from tests.policies.eviction.test_snapkv import make_view, snapkv_reference


def shared_reference(view, window: int, kernel: int) -> torch.Tensor:
    """Each valid token's score: over the heads of its row holding its position, +inf if any
    head's SnapKV score is +inf, else the sum of their SnapKV scores; invalid -inf."""
    per_head = snapkv_reference(view, window, kernel, "avg")
    batch, heads, slots = view.valid.shape
    out = torch.full((batch, heads, slots), -float("inf"), dtype=torch.float64)
    for b in range(batch):
        sums: dict[int, float] = {}
        for h in range(heads):
            for s in range(slots):
                if view.valid[b, h, s]:
                    p = int(view.positions[b, h, s])
                    sums[p] = sums.get(p, 0.0) + float(per_head[b, h, s])
        for h in range(heads):
            for s in range(slots):
                if view.valid[b, h, s]:
                    out[b, h, s] = sums[int(view.positions[b, h, s])]
    return out


def assert_scores_equal(scores: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(scores == torch.inf, expected == torch.inf)
    assert torch.equal(scores == -torch.inf, expected == -torch.inf)
    finite = expected.isfinite()
    torch.testing.assert_close(scores[finite].double(), expected[finite], rtol=1e-5, atol=1e-6)


def test_layers_below_the_tsp_layer_score_as_snapkv() -> None:
    view = make_view(seed=1, layer=1)
    view.call_notes = {}
    scores = FastKV(window=4, kernel=5, tsp_layer=2).score(view)
    assert_scores_equal(scores, snapkv_reference(view, 4, 5, "avg"))
    assert view.call_notes == {}


def test_the_tsp_layer_scores_each_position_by_its_heads_together_and_leaves_the_choice() -> None:
    view = make_view(seed=2, layer=2)
    view.call_notes = {}
    scores = FastKV(window=4, kernel=5, tsp_layer=2).score(view)
    assert_scores_equal(scores, shared_reference(view, 4, 5))
    assert view.call_notes[NOTE][0] == 2


def test_later_layers_of_the_call_reuse_the_tsp_choice_by_position() -> None:
    policy = FastKV(window=4, kernel=5, tsp_layer=2)
    notes: dict = {}
    tsp_view = make_view(seed=2, layer=2)
    tsp_view.call_notes = notes
    tsp_scores = policy.score(tsp_view)
    later = make_view(seed=9, layer=3)  # other attention, the same positions
    later.call_notes = notes
    assert_scores_equal(policy.score(later), tsp_scores.double())
    alone = make_view(seed=9, layer=3)  # a call in which the TSP layer chose nothing: it chooses itself
    alone.call_notes = {}
    assert_scores_equal(policy.score(alone), shared_reference(alone, 4, 5))


@pytest.mark.parametrize("family", ["llama", "gpt2", "default"])
def test_from_the_tsp_layer_on_every_layer_and_head_keeps_one_token_set(family: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([30, 41], seed=6, vocab=prompt_vocab(family))
    tsp = 1 if family != "default" else 2
    cache = kvlib.make_cache(model, f"fastkv(window=4, kernel=3, tsp_layer={tsp})", budget=12, slack=0)
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=6, pad_token_id=PAD)
    assert_budget_and_bytes(cache, 12)
    layers = cache.shape.num_layers
    propagated = cache.kept_positions(tsp)
    for layer in range(tsp, layers):
        assert same_positions_in_every_head(cache, layer)
        assert torch.equal(cache.kept_positions(layer), propagated)
    if family == "default":  # below the TSP layer heads choose for themselves
        assert not all(same_positions_in_every_head(cache, layer) for layer in range(tsp))


def test_a_float_budget_compresses_the_prompt_only() -> None:
    model = build_model("default")
    ids, mask = left_padded([40], seed=7, vocab=DEFAULT_BYTES)
    cache = kvlib.make_cache(model, "fastkv", budget=0.5)
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=5, pad_token_id=PAD)
    for layer in range(cache.shape.num_layers):
        assert bool(((cache.kept_positions(layer) >= 0).sum(-1) == 20 + 4).all())
    assert same_positions_in_every_head(cache, cache.shape.num_layers - 1)  # the last layer: past the TSP layer


def test_smollm2_short_prompt_meets_the_budget(smollm2) -> None:
    loaded = smollm2
    ids = smollm2_prompt(loaded)
    cache = kvlib.make_cache(loaded.model, "fastkv", budget=24, slack=0)
    out = loaded.model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=6, eos_token_id=None)
    assert out.shape[1] == ids.shape[1] + 6
    assert_budget_and_bytes(cache, 24)
    tsp = FastKV().propagation_layer(30)
    assert tsp == 14
    assert all(torch.equal(cache.kept_positions(layer), cache.kept_positions(tsp)) for layer in range(tsp, 30))


def test_the_engine_takes_it_per_request_as_generate_does() -> None:
    assert_engine_matches_generate("fastkv(window=4, kernel=3, tsp_layer=1)")


def assert_engine_matches_generate(spec: str, budget: int = 16) -> None:
    """A request with ``spec`` and ``budget`` in the Engine, beside a lossless one, gives what
    ``generate`` gives with ``make_cache(spec, budget)``."""
    model = build_model("llama", attn_implementation="eager")
    prompt = torch.randint(3, 97, (45,), generator=torch.Generator().manual_seed(11)).tolist()
    engine = kvlib.Engine(model)
    evicting = engine.add_request(prompt, max_new_tokens=6, spec=spec, budget=budget)
    engine.add_request(prompt[:20], max_new_tokens=6)
    while engine.has_unfinished:
        engine.step()
    cache = kvlib.make_cache(model, spec, budget=budget)
    reference = model.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, **cache_argument(cache)
    )
    assert engine.requests[evicting].output == reference[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "spec, message",
    [("fastkv(tsp_layer=-2)", "tsp_layer must be"), ("fastkv(window=0)", "window must be >= 1"), ("fastkv(kernel=4)", "kernel must be")],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)


def test_a_tsp_layer_past_the_model_is_refused() -> None:
    model = build_model("llama")  # 2 layers
    cache = kvlib.make_cache(model, "fastkv(tsp_layer=2)", budget=8, slack=0)
    ids, mask = left_padded([20], seed=1)
    with pytest.raises(ValueError, match="tsp_layer must be below the model's 2 layers"):
        model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=2, pad_token_id=PAD)
