"""uniform: every (layer, KV head) keeps the spec's budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.policies.budget.uniform import Uniform
from tests.adapters.conftest import build_model
from tests.policies.budget.conftest import check_memory, kept_counts, make_request, run, run_alone


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 6),
    heads=st.integers(1, 6),
    data=st.data(),
)
def test_every_head_gets_the_budget_and_the_layer_its_sum(layers, heads, data):
    batch = data.draw(st.integers(1, 4))
    tokens = data.draw(st.lists(st.integers(0, 500), min_size=batch, max_size=batch))
    head_counts = st.lists(st.integers(0, 600), min_size=heads, max_size=heads)
    counts = data.draw(st.lists(head_counts, min_size=batch, max_size=batch))
    layer = data.draw(st.integers(0, layers - 1))
    request = make_request(layer, layers, tokens, counts)
    caps = Uniform().caps(request)
    assert caps.dtype == torch.int64 and caps.shape == (batch, heads)
    assert caps.tolist() == [[t] * heads for t in tokens]  # counts do not matter: the engine clamps
    assert Uniform().layer_tokens(request).tolist() == [t * heads for t in tokens]
    assert caps.sum(-1).tolist() == Uniform().layer_tokens(request).tolist()


def test_caps_are_a_fresh_tensor():
    request = make_request(0, 2, [5, 7], [[9, 9], [9, 9]])
    caps = Uniform().caps(request)
    caps[0, 0] = 0
    assert request.tokens.tolist() == [5, 7] and Uniform().caps(request).tolist() == [[5, 5], [7, 7]]


def test_registered_without_parameters_and_the_default_allocation():
    assert kvlib.get_policy("uniform") is Uniform
    assert not Uniform.needs_scores
    assert kvlib.parse_spec("knorm+uniform").budget == Uniform()
    assert Uniform().spec() == "uniform"
    with pytest.raises(ValueError, match="uniform has no parameter 'beta'"):
        kvlib.parse_spec("knorm+uniform(beta=2)")
    cache = kvlib.make_cache(build_model("gpt2"), "knorm", budget=4)
    assert isinstance(cache.evictor.allocation, Uniform)


@pytest.mark.parametrize("spec", ["knorm+uniform", "tova+uniform"])
def test_through_generate_every_head_keeps_the_budget_in_real_pages(spec):
    model = build_model("default")
    budget, lengths = 10, [22, 35]
    cache, ids = run(model, spec, budget, lengths, seed=1)
    counts = kept_counts(cache)
    assert (counts == budget).all()
    check_memory(cache, counts)
    alone = kept_counts(run_alone(model, spec, budget, ids, 0, lengths[0]))  # the left-padded row
    assert torch.equal(counts[:, 0], alone[:, 0])


def test_through_generate_a_short_prompt_keeps_what_it_has():
    model = build_model("gpt2")
    cache, _ = run(model, "knorm+uniform", 20, [7, 12], seed=2, new_tokens=3)
    counts = kept_counts(cache)
    assert counts[:, 0].eq(7 + 2).all() and counts[:, 1].eq(12 + 2).all()  # prompt + stored new tokens < 20
    check_memory(cache, counts)
