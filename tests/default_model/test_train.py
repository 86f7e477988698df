"""The default model's training script (kvlib.default_model.train): deterministic, loadable output."""

import json

import torch

from kvlib.default_model.files import is_byte_model, load_default_model
from kvlib.default_model.train import Phase, TrainingConfig, learning_rate, train

TINY = TrainingConfig(
    hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, context=256,
    phases=(Phase(length=256, batch=2, steps=2),), warmup_steps=1,
)


def test_two_runs_give_identical_weights_and_a_loadable_byte_model(tmp_path):
    first = train(TINY, tmp_path / "a", log_every=1)
    train(TINY, tmp_path / "b", log_every=1)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert is_byte_model(tmp_path / "a")
    log = json.loads((tmp_path / "a" / "training.json").read_text())
    assert log["curve"] == first["curve"] and [e["step"] for e in log["curve"]] == [1, 2]
    model, tokenizer = load_default_model(folder=tmp_path / "a")
    assert model.config.num_key_value_heads == 1 and model.config.vocab_size == 259
    logits = model(torch.tensor([tokenizer.encode("x = 1", bos=True)])).logits
    assert logits.shape == (1, 6, 259)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    config = TrainingConfig(phases=(Phase(256, 1, 1000),), warmup_steps=100, learning_rate=1.0)
    assert learning_rate(config, 0) == 0.01 and learning_rate(config, 99) == 1.0
    assert learning_rate(config, 100) == 1.0
    assert abs(learning_rate(config, 1000) - 0.1) < 1e-9
    rates = [learning_rate(config, s) for s in range(100, 1001)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
