"""``tailorkv`` on tensors: the share of pages covering the estimated attention (against a loop
reference and hand-made cases); a layer is identified at its first decode step, then a dense layer
reads every page and a sparse one its ``top_k`` (Quest's choice) until its next prompt; bad
parameters are refused."""

from __future__ import annotations

import math

import pytest
import torch

import kvlib
from kvlib.policies.tiering.quest import Quest
from kvlib.policies.tiering.tailorkv import TailorKV, pages_for_mass


def spiky(pages: int, dim: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summaries of one head whose page 2 lies far along the query; the others near zero."""
    key_min = torch.full((1, 1, pages, dim), -0.1)
    key_max = torch.full((1, 1, pages, dim), 0.1)
    key_min[0, 0, 2, 0] = key_max[0, 0, 2, 0] = 40.0
    return torch.tensor([1.0, 0, 0, 0]).view(1, 1, 1, dim), key_min, key_max


def test_pages_for_mass_matches_a_loop_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    key_min = torch.randn(2, 2, 6, 4, generator=generator)
    key_max = key_min + torch.rand(2, 2, 6, 4, generator=generator)
    query = torch.randn(2, 4, 1, 4, generator=generator) * 3  # two query heads per KV head
    used = torch.tensor([[6, 4], [5, 6]])
    share = pages_for_mass(query, key_min, key_max, used, 0.8)
    for b in range(2):
        for g in range(4):
            h, n = g // 2, int(used[b, g // 2])
            logits = [float(query[b, g, 0] @ ((key_min[b, h, p] + key_max[b, h, p]) / 2)) / 2.0 for p in range(n)]
            top = max(logits)
            probs = sorted((math.exp(x - top) for x in logits), reverse=True)
            total, needed = sum(probs), 0
            while sum(probs[:needed]) / total < 0.8 - 1e-6:
                needed += 1
            assert abs(float(share[b, g]) - needed / n) < 1e-6, (b, g)


def test_a_spike_needs_one_page_and_flat_attention_most() -> None:
    query, key_min, key_max = spiky(10)
    assert float(pages_for_mass(query, key_min, key_max, torch.tensor([[10]]), 0.9)) == pytest.approx(0.1)
    flat = torch.zeros(1, 1, 10, 4)
    assert float(pages_for_mass(query, flat, flat, torch.tensor([[10]]), 0.9)) == pytest.approx(0.9)


def test_a_layer_is_identified_at_its_first_step_and_kept_until_its_next_prompt() -> None:
    policy = TailorKV(top_k=2, dense_share=0.5)
    query, key_min, key_max = spiky(10)
    flat = torch.zeros(1, 1, 10, 4)
    used = torch.tensor([[10]])
    assert policy.sparse(1, 1)
    assert policy.select_pages(1, query, key_min, key_max, used).tolist() == [[[2, 9]]]  # sparse: Quest's top 2
    assert policy.dense == {1: False}
    assert policy.sparse(0, 1)
    assert policy.select_pages(0, query, flat, flat, used).tolist() == [[list(range(10))]]  # dense: every page
    assert policy.dense == {1: False, 0: True}
    assert not policy.sparse(0, 1) and policy.sparse(1, 1)  # a dense layer's later steps attend densely
    assert policy.select_pages(1, query, flat, flat, used).shape == (1, 1, 2)  # layer 1 stays sparse, even over flat pages
    assert not policy.arranges_tokens(0, 30)  # a prompt: layer 0 is identified anew
    assert policy.dense == {1: False} and policy.sparse(0, 1)
    assert policy.select_pages(0, query, key_min, key_max, used).tolist() == [[[2, 9]]]


def test_a_dense_layer_reads_every_held_page_of_each_head() -> None:
    policy = TailorKV(dense_share=0.01)
    flat = torch.zeros(2, 2, 5, 4)
    assert policy.sparse(3, 1)
    chosen = policy.select_pages(3, torch.ones(2, 2, 1, 4), flat, flat, torch.tensor([[5, 3], [1, 4]]))
    assert chosen.tolist() == [[[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]], [[0, -1, -1, -1, -1], [0, 1, 2, 3, -1]]]


def test_a_sparse_layer_chooses_as_quest() -> None:
    generator = torch.Generator().manual_seed(3)
    key_min = torch.randn(1, 2, 8, 4, generator=generator)
    key_max = key_min + 0.1
    query = torch.randn(1, 2, 1, 4, generator=generator) * 20
    policy = TailorKV(top_k=3, dense_share=1.0)
    used = torch.tensor([[8, 6]])
    assert torch.equal(policy.select_pages(0, query, key_min, key_max, used), Quest(top_k=3).select_pages(0, query, key_min, key_max, used))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tailorkv(top_k=0)", "top_k must be >= 1"),
        ("tailorkv(mass=0)", r"mass must be in \(0, 1\]"),
        ("tailorkv(mass=1.5)", r"mass must be in \(0, 1\]"),
        ("tailorkv(dense_share=0)", r"dense_share must be in \(0, 1\]"),
        ("tailorkv(dense_layers=-1)", "dense_layers must be >= 0"),
        ("tailorkv(placement='specache')", "placement must be a device/host placement"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)


def test_registered_as_a_tiering_policy_and_its_spec_round_trips() -> None:
    assert "tailorkv" in kvlib.available_policies()["tiering"]
    policy = kvlib.parse_policy("tailorkv(top_k=4, mass=0.8, placement='lru(device_mb=2.0)')")
    assert kvlib.parse_policy(policy.spec()) == policy
    assert policy.spec() == "tailorkv(top_k=4, placement='lru(device_mb=2.0)', mass=0.8)"
    spec = kvlib.parse_spec("kivi(bits=2)+tailorkv(top_k=4)")
    assert spec.quantization is not None and isinstance(spec.tiering, TailorKV)
