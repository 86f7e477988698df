"""pyramidkv: SnapKV's scores, with a Pyramid budget of the same beta by default."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.budget.pyramid import Pyramid
from kvlib.policies.eviction.pyramidkv import PyramidKV
from kvlib.policies.eviction.snapkv import SnapKV
from tests.policies.eviction.test_snapkv import make_view, snapkv_reference


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_scores_are_snapkv_scores(pooling):
    view = make_view(seed=11)
    scores = PyramidKV(window=3, kernel=3, pooling=pooling, beta=5).score(view)
    expected = snapkv_reference(view, 3, 3, pooling)
    finite = expected.isfinite()
    assert torch.equal(scores == torch.inf, expected == torch.inf)
    assert torch.equal(scores == -torch.inf, expected == -torch.inf)
    torch.testing.assert_close(scores[finite].double(), expected[finite], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [1, 4, 20])
def test_default_budget_is_a_pyramid_with_the_same_beta(beta):
    budget = PyramidKV(beta=beta).default_budget()
    assert isinstance(budget, Pyramid) and budget.beta == beta
    assert PyramidKV().default_budget() == Pyramid(beta=20, reserved=32)
    assert PyramidKV(window=8).default_budget().reserved == 8
    assert SnapKV().default_budget() is None


def test_registration_and_inherited_parameters():
    assert kvlib.get_policy("pyramidkv") is PyramidKV
    assert PyramidKV.name == "pyramidkv" and SnapKV.name == "snapkv"
    assert PyramidKV.needs == frozenset({"attention"})
    policy = PyramidKV()
    assert (policy.window, policy.kernel, policy.pooling, policy.beta) == (32, 5, "avg", 20)
    assert policy.observed_queries() == 32


def test_spec_round_trip():
    text = "pyramidkv(window=8, pooling='max', beta=10)"
    policy = kvlib.parse_policy(text)
    assert policy == PyramidKV(window=8, pooling="max", beta=10)
    assert policy.spec() == text
    assert kvlib.parse_policy(policy.spec()) == policy
    assert PyramidKV().spec() == "pyramidkv"


@pytest.mark.parametrize(
    "params, message",
    [({"beta": 0}, "beta must be >= 1"), ({"beta": 2.5}, "beta"), ({"kernel": 2}, "kernel must be an odd integer")],
)
def test_invalid_parameters_are_rejected(params, message):
    with pytest.raises(ValueError, match=message):
        PyramidKV(**params)
    arguments = ", ".join(f"{name}={value!r}" for name, value in params.items())
    with pytest.raises(kvlib.SpecError, match=message):
        kvlib.parse_spec(f"pyramidkv({arguments})")
