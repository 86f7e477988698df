"""pyramid: PyramidKV's layer budgets, an arithmetic sequence from 2B - B/beta down to B/beta."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.policies.budget.pyramid import Pyramid
from tests.adapters.conftest import build_model
from tests.policies.budget.conftest import check_memory, kept_counts, make_request, run, run_alone


def exact_layer_budgets(budget: int, layers: int, beta: int) -> list[Fraction]:
    """Per-head tokens of each layer before rounding: the paper's arithmetic sequence from
    ``2B - B/beta`` (first layer) to ``B/beta`` (last), in exact arithmetic."""
    if layers == 1:
        return [Fraction(budget)]
    first, last = 2 * Fraction(budget) - Fraction(budget, beta), Fraction(budget, beta)
    exact = [first + (last - first) * layer / (layers - 1) for layer in range(layers)]
    assert sum(exact) == layers * budget  # the sequence's mean is B
    return exact


def reference_layer_budgets(budget: int, layers: int, beta: int) -> list[int]:
    """The exact shares rounded by largest remainder so that they sum to ``layers * B``. Only for
    parameters where that rounding is unambiguous (no tie between a layer that rounds up and
    one that does not: the allocation does not promise how such ties break)."""
    exact = exact_layer_budgets(budget, layers, beta)
    counts = [math.floor(share) for share in exact]
    remainders = sorted((share - count for share, count in zip(exact, counts)), reverse=True)
    leftover = layers * budget - sum(counts)  # < layers: the remainders sum to it and each is < 1
    if not leftover:
        return counts
    assert remainders[leftover - 1] > remainders[leftover], "ambiguous rounding"
    return [count + int(share - count >= remainders[leftover - 1]) for share, count in zip(exact, counts)]


def all_layer_caps(pyramid: Pyramid, layers: int, tokens: list[int], heads: int) -> torch.Tensor:
    """int64 ``[layers, batch, heads]``: the caps of every layer for rows with budgets ``tokens``."""
    counts = [[10**6] * heads for _ in tokens]
    return torch.stack([pyramid.caps(make_request(layer, layers, tokens, counts)) for layer in range(layers)])


@settings(max_examples=120, deadline=None)
@given(
    layers=st.integers(1, 40),
    heads=st.integers(1, 8),
    beta=st.one_of(st.integers(1, 60), st.just(20)),
    tokens=st.lists(st.integers(0, 400), min_size=1, max_size=3),
)
def test_layer_budgets_follow_the_arithmetic_sequence_and_sum_to_the_model_budget(layers, heads, beta, tokens):
    pyramid = Pyramid(beta=beta)
    caps = all_layer_caps(pyramid, layers, tokens, heads)
    assert caps.dtype == torch.int64 and caps.shape == (layers, len(tokens), heads)
    for row, budget in enumerate(tokens):
        exact = exact_layer_budgets(budget, layers, beta)
        per_head = caps[:, row, 0].tolist()
        assert caps[:, row].tolist() == [[count] * heads for count in per_head]  # every head of a layer alike
        assert int(caps[:, row].sum()) == layers * heads * budget  # the model's budget, exactly
        assert all(math.floor(share) <= count <= math.ceil(share) for share, count in zip(exact, per_head))
        raised = [share - math.floor(share) for share, count in zip(exact, per_head) if count > share]
        kept_down = [share - math.floor(share) for share, count in zip(exact, per_head) if count < share]
        assert not raised or not kept_down or min(raised) >= max(kept_down), "not the largest remainders"
        assert all(a >= b for a, b in zip(per_head, per_head[1:])), "budgets must not grow with depth"
    for layer in range(layers):
        request = make_request(layer, layers, tokens, [[0] * heads for _ in tokens])
        assert torch.equal(pyramid.layer_tokens(request), caps[layer].sum(-1))


def test_exact_ties_between_layers_round_either_way():
    # 2 layers, B = 190, beta = 20: 370.5 and 9.5, one of them rounds up; which one is not promised
    caps = all_layer_caps(Pyramid(beta=20), 2, [190], 1)[:, 0, 0].tolist()
    assert caps in ([371, 9], [370, 10])


def test_worked_examples():
    # B = 8, 5 layers, beta = 20: 15.6, 11.8, 8, 4.2, 0.4 -> largest remainders 0.8 and 0.6 round up
    assert reference_layer_budgets(8, 5, 20) == [16, 12, 8, 4, 0]
    assert all_layer_caps(Pyramid(), 5, [8], 1).flatten().tolist() == [16, 12, 8, 4, 0]
    # 32 layers, B = 128: first 2B - B/beta = 249.6, last B/beta = 6.4, step 7.8
    caps = all_layer_caps(Pyramid(beta=20), 32, [128], 2)[:, 0, 0].tolist()
    assert caps[0] in (249, 250) and caps[-1] in (6, 7) and sum(caps) == 32 * 128
    assert all(7 <= a - b <= 9 for a, b in zip(caps, caps[1:]))


@pytest.mark.parametrize("layers", [1, 2, 7])
def test_beta_one_is_uniform(layers):
    caps = all_layer_caps(Pyramid(beta=1), layers, [13, 0, 5], 3)
    assert caps.tolist() == [[[13] * 3, [0] * 3, [5] * 3]] * layers


def test_one_layer_keeps_the_budget_whatever_beta():
    assert all_layer_caps(Pyramid(beta=50), 1, [9], 4).tolist() == [[[9] * 4]]


def test_parameters_and_spec_round_trip():
    assert kvlib.get_policy("pyramid") is Pyramid and not Pyramid.needs_scores
    assert Pyramid().beta == 20 and Pyramid().spec() == "pyramid"
    spec = kvlib.parse_spec("tova+pyramid(beta=5)")
    assert spec.budget == Pyramid(beta=5) and str(spec) == "tova+pyramid(beta=5)"
    for bad in ("beta=0", "beta=-3"):
        with pytest.raises(ValueError, match="beta"):
            kvlib.parse_spec(f"tova+pyramid({bad})")
    with pytest.raises(ValueError, match="'beta' must be int"):
        kvlib.parse_spec("tova+pyramid(beta=2.5)")


@pytest.mark.parametrize("spec, beta", [("knorm+pyramid", 20), ("tova+pyramid(beta=4)", 4)])
def test_through_generate_each_layer_keeps_its_pyramid_budget(spec, beta):
    model = build_model("default")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    budget, lengths, new_tokens = 8, [26, 40], 3
    cache, ids = run(model, spec, budget, lengths, seed=3, new_tokens=new_tokens)
    counts = kept_counts(cache)
    expected = reference_layer_budgets(budget, layers, beta)
    assert expected[0] < min(lengths)  # every layer holds more than its budget, so each is cut to it
    assert counts.tolist() == [[[count] * heads] * 2 for count in expected]
    check_memory(cache, counts)
    alone = kept_counts(run_alone(model, spec, budget, ids, 0, lengths[0], new_tokens=new_tokens))
    assert torch.equal(counts[:, 0], alone[:, 0])


def test_through_generate_on_gpt2_a_budget_over_the_held_tokens_keeps_them_all():
    model = build_model("gpt2")  # 2 layers: 2B - B/beta and B/beta
    budget, lengths, new_tokens = 12, [14, 30], 3
    cache, _ = run(model, "knorm+pyramid(beta=3)", budget, lengths, seed=4, new_tokens=new_tokens)
    first, last = reference_layer_budgets(budget, 2, 3)
    assert (first, last) == (20, 4)
    held = [length + new_tokens - 1 for length in lengths]
    counts = kept_counts(cache)
    assert counts.tolist() == [[[min(first, h)] * 4 for h in held], [[last] * 4] * 2]
    check_memory(cache, counts)


def test_through_generate_a_fraction_budget_splits_each_rows_prompt_budget():
    model = build_model("default")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    lengths, new_tokens = [30, 41], 3
    cache, _ = run(model, "knorm+pyramid(beta=4)", 0.5, lengths, seed=5, new_tokens=new_tokens)
    counts = kept_counts(cache)
    for row, length in enumerate(lengths):
        per_layer = reference_layer_budgets(math.ceil(0.5 * length), layers, 4)  # the prompt is compressed ...
        expected = [count + new_tokens - 1 for count in per_layer]  # ... and decoding keeps every new token
        assert counts[:, row].tolist() == [[count] * heads for count in expected]
    check_memory(cache, counts)


@pytest.mark.parametrize(("tokens", "reserved"), [(100, 32), (20, 32), (33, 32), (64, 0)])
def test_reserved_tokens_go_to_every_layer_before_the_pyramid_split(tokens, reserved):
    layers, beta = 5, 20
    first_reserved = min(tokens, reserved)
    rest = tokens - first_reserved
    shares = [
        Fraction(rest) * (Fraction(2) - Fraction(1, beta) - Fraction(layer, layers - 1) * (2 - Fraction(2, beta)))
        for layer in range(layers)
    ]
    caps = [
        int(Pyramid(beta=beta, reserved=reserved).caps(make_request(layer, layers, [tokens], [[10_000]]))[0, 0]) for layer in range(layers)
    ]
    assert sum(caps) == layers * tokens
    for cap, share in zip(caps, shares):
        assert cap - first_reserved in (math.floor(share), math.ceil(share))
    with pytest.raises(ValueError, match="reserved"):
        Pyramid(reserved=-1)
