"""windowkv: review-window scores against a loop reference; whole windows kept; the first layer
of a group chooses for the group within one call; through generate (tiny Llama, GPT-2,
the embedded default model, SmolLM2, the Engine) budget met exactly with bytes matching the kept tokens; bad
parameters refused."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.eviction.windowkv import NOTE, WindowKV
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded, prompt_vocab
from tests.policies.eviction.kept_bytes import assert_budget_and_bytes, smollm2_prompt
from tests.policies.eviction.test_fastkv import assert_engine_matches_generate, assert_scores_equal
from tests.policies.eviction.test_snapkv import make_view


def windowkv_reference(view, window: int, review: int) -> torch.Tensor:
    """Loops: a valid token among its row's newest ``window`` positions scores +inf; any other
    valid token the sum, over the valid non-window tokens of its head with the same ``position //
    review``, of the attention the last ``window`` queries give them (summed over those queries,
    averaged over the KV group's query heads); invalid -inf."""
    batch, heads, slots = view.valid.shape
    groups = view.attention.shape[1] // heads
    observed = min(window, view.attention.shape[2])
    out = torch.full((batch, heads, slots), -float("inf"), dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            newest = max(int(view.positions[b, h, s]) for s in range(slots) if view.valid[b, h, s])
            in_window = [bool(view.valid[b, h, s]) and int(view.positions[b, h, s]) > newest - observed for s in range(slots)]
            sums: dict[int, float] = {}
            for s in range(slots):
                if view.valid[b, h, s] and not in_window[s]:
                    vote = sum(
                        float(view.attention[b, g, view.attention.shape[2] - observed + i, s])
                        for g in range(h * groups, (h + 1) * groups)
                        for i in range(observed)
                    )
                    key = int(view.positions[b, h, s]) // review
                    sums[key] = sums.get(key, 0.0) + vote / groups
            for s in range(slots):
                if view.valid[b, h, s]:
                    out[b, h, s] = float("inf") if in_window[s] else sums[int(view.positions[b, h, s]) // review]
    return out


@pytest.mark.parametrize("window, review", [(4, 3), (2, 1), (6, 5), (1, 4)])
def test_scores_match_the_loop_reference(window: int, review: int) -> None:
    view = make_view(seed=window * 7 + review)
    view.call_notes = {}
    scores = WindowKV(window=window, review_window=review).score(view)
    assert scores.dtype == torch.float32
    assert_scores_equal(scores, windowkv_reference(view, window, review))


def test_the_first_layer_of_a_group_chooses_for_the_group() -> None:
    policy = WindowKV(window=4, review_window=3, group_layers=2)
    notes: dict = {}
    first = make_view(seed=1, layer=2)
    first.call_notes = notes
    chosen = policy.score(first)
    assert list(notes[NOTE]) == [1]
    second = make_view(seed=5, layer=3)  # same group, other attention: the group's choice
    second.call_notes = notes
    assert_scores_equal(policy.score(second), chosen.double())
    other = make_view(seed=5, layer=4)  # the next group chooses for itself
    other.call_notes = notes
    assert_scores_equal(policy.score(other), windowkv_reference(other, 4, 3))


@pytest.mark.parametrize("family", ["llama", "gpt2", "default"])
def test_whole_windows_kept_and_groups_keep_the_same_tokens(family: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([50, 37], seed=8, vocab=prompt_vocab(family))
    cache = kvlib.make_cache(model, "windowkv(window=4, review_window=4, group_layers=2)", budget=20, slack=0)
    with torch.no_grad():  # the prompt alone: every kept context window is whole but the last one reached
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
    lengths = [50, 37]
    for layer in range(cache.shape.num_layers):
        kept = cache.kept_positions(layer)
        for row, length in enumerate(lengths):
            for head in range(kept.shape[1]):
                boundary = (length - 4) // 4  # its context part is whatever precedes the observation window
                context = [p for p in kept[row, head].tolist() if 0 <= p < length - 4 and p // 4 != boundary]
                counts: dict[int, int] = {}
                for p in context:
                    counts[p // 4] = counts.get(p // 4, 0) + 1
                assert sum(1 for c in counts.values() if c != 4) <= 1
        if layer % 2 == 1:
            assert torch.equal(kept, cache.kept_positions(layer - 1))
    model.generate(
        torch.cat([ids, ids[:, -1:]], 1),
        attention_mask=torch.cat([mask, mask[:, -1:]], 1),
        **cache_argument(cache),
        do_sample=False,
        max_new_tokens=5,
        pad_token_id=PAD,
    )
    assert_budget_and_bytes(cache, 20)


def test_smollm2_short_prompt_meets_the_budget(smollm2) -> None:
    loaded = smollm2
    ids = smollm2_prompt(loaded)
    cache = kvlib.make_cache(loaded.model, "windowkv", budget=24, slack=0)
    out = loaded.model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=6, eos_token_id=None)
    assert out.shape[1] == ids.shape[1] + 6
    assert_budget_and_bytes(cache, 24)


def test_the_engine_takes_it_per_request_as_generate_does() -> None:
    assert_engine_matches_generate("windowkv(window=4, review_window=4, group_layers=2)")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("windowkv(window=0)", "window must be >= 1"),
        ("windowkv(review_window=0)", "review_window must be >= 1"),
        ("windowkv(group_layers=0)", "group_layers must be >= 1"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)
