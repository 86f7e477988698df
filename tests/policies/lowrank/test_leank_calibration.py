"""LeanK's calibration: the rounding rule on a hand-made case, training that prunes the channels the
output does not depend on, and the mask cached per model and settings."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvlib
from kvlib.policies.lowrank.leank import LeanK
from kvlib.policies.lowrank.leank_calibration import CalibrationCase, LeanKSettings, calibrate_leank, calibrated_mask, copy_cases, sparsify

FAST = LeanKSettings(keep=0.5, align=2, sink=2, recent=4, stage1_steps=20, stage2_steps=4)


def test_sparsify_keeps_a_global_fraction_rounded_per_head_to_align() -> None:
    """Global threshold at the 50% quantile: head 0 has 3 channels above it (rounded to 4), head 1
    has 1 (rounded to 2: ties up), head 2 none; each keeps its highest factors."""
    alphas = torch.tensor(
        [
            [
                [0.9, 0.8, 0.1, 0.7, 0.05, 0.6, 0.0, 0.02],
                [0.0, 0.95, 0.1, 0.2, 0.3, 0.01, 0.4, 0.03],
                [0.1, 0.2, 0.3, 0.01, 0.02, 0.03, 0.04, 0.05],
            ]
        ]
    )
    mask = sparsify(alphas, keep=0.25, align=2)
    assert [torch.nonzero(head).flatten().tolist() for head in mask[0]] == [[0, 1, 3, 5], [1, 6], []]
    assert bool(sparsify(alphas, keep=1.0, align=4).all())


def dead_channel_llama() -> LlamaForCausalLM:
    """A random Llama (2 layers, 2 KV heads of 8 channels) whose keys are zero in channels 2, 3 and
    their RoPE partners 6, 7 of every head: pruning those changes nothing, the others are used."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.self_attn.k_proj.weight.view(2, 8, 32)
            weight[:, [2, 3, 6, 7]] = 0.0
            weight[:, [0, 1, 4, 5]] *= 4.0  # sharp attention, so the live channels matter
    return model


def test_training_prunes_the_channels_the_output_does_not_read(tmp_path) -> None:
    model = dead_channel_llama()
    mask = calibrate_leank(model, copy_cases(64, count=2, length=48, needle=4), tmp_path / "mask.json", FAST)
    assert [[torch.nonzero(head).flatten().tolist() for head in layer] for layer in mask] == [[[0, 1, 4, 5]] * 2] * 2
    policy = LeanK(mask=str(tmp_path / "mask.json"))
    assert policy.channels == [[[0, 1, 4, 5]] * 2] * 2
    assert model.config._attn_implementation == "sdpa" and all(p.requires_grad for p in model.parameters())  # restored


def test_the_mask_is_cached_per_model_and_settings(tmp_path) -> None:
    model = dead_channel_llama()
    cases = copy_cases(64, count=1, length=48, needle=4)
    first = calibrated_mask(model, tmp_path, FAST, cases)
    stamp = first.stat().st_mtime_ns
    assert calibrated_mask(model, tmp_path, FAST, cases) == first and first.stat().st_mtime_ns == stamp  # read, not learned again
    with torch.inference_mode():  # the calibration trains its factors all the same
        other_settings = calibrated_mask(
            model, tmp_path, LeanKSettings(keep=0.25, align=2, sink=2, recent=4, stage1_steps=2, stage2_steps=1), cases
        )
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] += 1.0
    other_model = calibrated_mask(model, tmp_path, FAST, cases)
    assert len({first, other_settings, other_model}) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (first, other_settings, other_model))  # no scratch left
    cache = kvlib.make_cache(model, f"leank(mask={str(first)!r})")
    assert cache.codec.channels == LeanK(mask=str(first)).channels


@pytest.mark.parametrize(
    "settings, cases, message",
    [
        (LeanKSettings(keep=0.0), None, r"keep must be in \(0, 1\]"),
        (LeanKSettings(align=0), None, "align must be an int >= 1"),
        (LeanKSettings(recent=-1), None, "recent must be an int >= 0"),
        (LeanKSettings(stage1_lr=float("nan")), None, "stage1_lr must be a float >= 0"),
        (FAST, [], "at least one case"),
        (FAST, [CalibrationCase((1, 2, 3), 3)], r"1 <= context < len\(ids\) = 3"),
    ],
)
def test_bad_settings_and_cases_are_refused_before_any_model_work(tmp_path, settings, cases, message) -> None:
    model = dead_channel_llama()
    with pytest.raises(ValueError, match=message):
        calibrate_leank(model, copy_cases(64, length=48, needle=4) if cases is None else cases, tmp_path / "mask.json", settings)
    assert not (tmp_path / "mask.json").exists()
