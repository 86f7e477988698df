"""The default model's training script (kvlib.default_model.train): deterministic, loadable output."""

import json

import numpy as np
import torch

from kvlib.default_model.files import is_byte_model, load_default_model
from kvlib.default_model.train import REPEAT_ALPHABET, Phase, TrainingConfig, learning_rate, repeat_sequence, train

TINY = TrainingConfig(
    hidden_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=32,
    context=256,
    phases=(Phase(length=128, batch=2, steps=1, repeats=True), Phase(length=256, batch=2, steps=1, lr_scale=0.5)),
    warmup_steps=1,
)


def test_two_runs_give_identical_weights_and_a_loadable_byte_model(tmp_path):
    first = train(TINY, tmp_path / "a", log_every=1)
    train(TINY, tmp_path / "b", log_every=1)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert is_byte_model(tmp_path / "a")
    log = json.loads((tmp_path / "a" / "training.json").read_text())
    assert log["curve"] == first["curve"] and [(e["step"], e["length"]) for e in log["curve"]] == [(1, 128), (2, 256)]
    model, tokenizer = load_default_model(folder=tmp_path / "a")
    assert model.config.num_key_value_heads == 1 and model.config.vocab_size == 259
    logits = model(torch.tensor([tokenizer.encode("x = 1", bos=True)])).logits
    assert logits.shape == (1, 6, 259)


def test_learning_rate_warms_up_holds_then_decays_to_a_tenth_over_the_last_phase():
    config = TrainingConfig(phases=(Phase(128, 1, 500, repeats=True), Phase(256, 1, 1000)), warmup_steps=100, learning_rate=1.0)
    assert learning_rate(config, 0) == 0.01 and learning_rate(config, 99) == 1.0
    assert learning_rate(config, 100) == learning_rate(config, 500) == 1.0
    assert abs(learning_rate(config, 1500) - 0.1) < 1e-9
    rates = [learning_rate(config, s) for s in range(100, 1501)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_repeat_sequences_copy_a_unit_at_a_random_distance():
    text = np.frombuffer(b"line of code\n" * 200, dtype=np.uint8)
    rng = np.random.default_rng(0)
    distances = set()
    for random_filler, length in ((True, 128), (False, 256)):
        for _ in range(50):
            tokens, mask = repeat_sequence(rng, text, length, random_filler)
            assert tokens.shape == mask.shape == (length,)
            start = int(np.flatnonzero(mask)[0]) - 1  # the second copy's first byte is not predictable
            size = int(mask.sum()) + 1
            unit = bytes(tokens[start : start + size])
            first = bytes(tokens).find(unit)
            assert first < start and set(unit) <= set(REPEAT_ALPHABET.tobytes())
            assert size == 24 if random_filler else 16 <= size <= 64
            distances.add(start - first)
    assert len(distances) > 20
