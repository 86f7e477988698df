"""The model fingerprint: equal exactly when class, config and every weight are equal; cached
per model object and taken again after a tracked in-place edit."""

from __future__ import annotations

import copy

import pytest
import torch

from kvlib import model_identity
from kvlib.model_identity import ModelIdentity, forget_fingerprint, model_fingerprint
from tests.adapters.conftest import build_model, edit_one_weight


def test_equal_weights_and_config_give_equal_fingerprints() -> None:
    model = build_model("llama")
    assert model_fingerprint(build_model("llama")) == model_fingerprint(model) == model_fingerprint(copy.deepcopy(model))
    moved = copy.deepcopy(model)
    moved.config._name_or_path = "/somewhere/else"  # where it was loaded from is not what it is
    assert model_fingerprint(moved) == model_fingerprint(model)


def test_one_value_in_the_middle_of_one_tensor_changes_it() -> None:
    model = build_model("llama")
    edited = copy.deepcopy(model)
    edit_one_weight(edited)
    assert model_fingerprint(edited) != model_fingerprint(model)
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert model_fingerprint(half) != model_fingerprint(model)
    configured = copy.deepcopy(model)
    configured.config.rms_norm_eps = 1e-5
    assert model_fingerprint(configured) != model_fingerprint(model)


def test_persistent_buffers_count_and_derived_ones_do_not() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    before = model_fingerprint(net)
    net[1].running_mean[2] += 1.0  # a persistent buffer: part of the weights
    assert model_fingerprint(net) != before
    model = build_model("llama")
    before = model_fingerprint(model)
    rotary = model.model.rotary_emb
    rotary.register_buffer("inv_freq", rotary.inv_freq * 0.5, persistent=False)  # as dynamic RoPE does mid-forward
    assert model_fingerprint(model) == before


def test_the_fingerprint_is_cached_per_object_until_a_weight_changes(monkeypatch) -> None:
    model = build_model("llama")
    identity = ModelIdentity(model)
    hashed = []
    raw_bytes = model_identity._raw_bytes
    monkeypatch.setattr(model_identity, "_raw_bytes", lambda tensor: hashed.append(tensor) or raw_bytes(tensor))
    assert identity.matches(model) and identity.matches(model) and not hashed  # a version check, no hashing
    edit_one_weight(model)  # in place, under no_grad: the version counter moves
    assert not identity.matches(model) and hashed
    hashed.clear()
    untracked = build_model("llama")
    assert identity.matches(untracked) and hashed  # a new object is hashed once, then cached
    untracked.model.layers[1].mlp.up_proj.weight.data[3, 5] += 1e-3  # .data bypasses the version counter
    assert identity.matches(untracked)  # not seen by the cached check (documented) ...
    forget_fingerprint(untracked)
    assert not identity.matches(untracked)  # ... until the fingerprint is forgotten


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_are_hashed_byte_for_byte(dtype) -> None:
    model = build_model("llama").to(dtype)
    edited = copy.deepcopy(model)
    edit_one_weight(edited, delta=0.25)
    assert model_fingerprint(edited) != model_fingerprint(model) == model_fingerprint(copy.deepcopy(model))
