"""scope: the budget split, the inner's scores for the prompt, the slide scores among decode
tokens against a loop reference, and a compressed prompt that stays fixed while decoding."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.eviction.scope import SCOPE
from kvlib.policies.eviction.streaming_llm import StreamingLLM
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model
from tests.policies.eviction.recent_view import GROUPS, newest_tokens, recent_view


def test_the_prompt_gets_the_budget_less_the_decode_share():
    policy = SCOPE(decode_budget=0.25)
    assert policy.prompt_tokens(torch.tensor([12, 40, 2])).tolist() == [9, 30, 1]
    with pytest.raises(ValueError, match="at least 2 tokens per head"):
        policy.prompt_tokens(torch.tensor([1]))


def test_rows_in_their_prompt_get_the_inner_scores_and_decoding_rows_the_slide_scores():
    view = recent_view(1, seed=2)
    view.attention = view.recent_attention  # the current query's attention
    newest = view.positions.amax(dim=(1, 2))
    view.prompt_lengths = torch.stack([newest[0] + 1, newest[1] - 5])  # row 0 in its prompt, row 1 six steps in
    inner = StreamingLLM(sinks=2)
    scores = SCOPE(inner=inner, recent=2).score(view)
    assert torch.equal(scores[0], inner.score(view)[0].double())
    prompt_length = int(view.prompt_lengths[1])
    for h in range(view.valid.shape[1]):
        slots = range(view.valid.shape[2])
        decode = [s for s in slots if view.valid[1, h, s] and int(view.positions[1, h, s]) >= prompt_length]
        prompt = [s for s in slots if view.valid[1, h, s] and int(view.positions[1, h, s]) < prompt_length]
        recent = newest_tokens(view, 1, h, 2)
        older = [s for s in decode if s not in recent]
        for s in older:  # the current query's attention averaged over the group
            expected = sum(float(view.attention[1, j, 0, s]) for j in range(h * GROUPS, (h + 1) * GROUPS)) / GROUPS
            assert abs(float(scores[1, h, s]) - expected) < 1e-6
        assert min(float(scores[1, h, s]) for s in recent) > max(float(scores[1, h, s]) for s in older)
        assert min(float(scores[1, h, s]) for s in prompt) > max(float(scores[1, h, s]) for s in decode)
        assert all(scores[1, h, s] == -torch.inf for s in slots if not view.valid[1, h, s])


def test_the_compressed_prompt_stays_fixed_while_decode_tokens_slide():
    model = build_model("llama")
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    spec, budget = "scope(inner='snapkv(window=4)', decode_budget=0.25, recent=2)", 16  # the prompt keeps 12, decoding 4
    after_prompt = kvlib.make_cache(model, spec, budget=budget, slack=0)
    model.generate(ids, **cache_argument(after_prompt), do_sample=False, max_new_tokens=1)
    decoded = kvlib.make_cache(model, spec, budget=budget, slack=0)
    model.generate(ids, **cache_argument(decoded), do_sample=False, max_new_tokens=15, min_new_tokens=15)
    for layer in range(model.config.num_hidden_layers):
        prompt = after_prompt.kept_positions(layer)
        kept = decoded.kept_positions(layer)
        assert ((prompt >= 0).sum(-1) == 12).all() and ((kept >= 0).sum(-1) == budget).all()
        assert torch.equal(kept[..., :12], prompt[..., :12])  # ascending: the prompt's 12 come first
        assert (kept[..., 12:] >= 40).all() and (kept[..., -2:] == torch.tensor([52, 53])).all()  # newest decode tokens kept


@pytest.mark.parametrize(
    "options, message",
    [
        ({"decode_budget": 0.0}, "decode_budget must be in"),
        ({"decode_budget": 1.0}, "decode_budget must be in"),
        ({"recent": -1}, "recent must be >= 0"),
    ],
)
def test_bad_parameters_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SCOPE(**options)
