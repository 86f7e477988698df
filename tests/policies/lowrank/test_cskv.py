"""CSKV: the calibration is the SVD of the model's own keys and values, cached per model and ids;
on the calibration's own tokens the error is exactly the discarded singular energy; the
full-precision window (the open page) stays exact; page bytes shrink to the kept channels, as
``memory_report`` shows through ``generate``; the Engine serves a calibrated basis as ``generate``
does and refuses a fitted one; bad input refused before model work."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib.default_model.corpus import holdout_text
from kvlib.default_model.tokenizer import ByteTokenizer
from kvlib.policies.lowrank.basis import head_rows
from kvlib.policies.lowrank.cskv import calibrate_cskv
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model("default")


@pytest.fixture(scope="module")
def text_ids() -> torch.Tensor:
    """The project's own text (the default model's holdout), 256 tokens."""
    return torch.tensor([ByteTokenizer().encode(holdout_text()[5000:], bos=True)[:256]])


@pytest.fixture(scope="module")
def calibration(model, text_ids, tmp_path_factory) -> str:
    return str(calibrate_cskv(model, text_ids, tmp_path_factory.mktemp("cskv") / "calibration.safetensors"))


def kv_of(model: torch.nn.Module, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **cache_argument(cache))
    return cache


def test_on_its_own_tokens_the_error_is_the_discarded_singular_energy(model, text_ids, calibration) -> None:
    """Eckart-Young: the calibration's keys stored on their first ``r`` directions lose exactly
    ``sum_{i > r} s_i^2``; the directions are orthonormal."""
    cskv = kvlib.parse_policy(f"cskv(key_keep=0.25, value_keep=0.5, calibration={calibration!r})")
    cache = kvlib.make_cache(model, cskv)
    codec = cache.store.pools[1].codec
    stored = kv_of(model, text_ids).layers[1]
    for part, tensor, rank in (("keys", stored.keys, 8), ("values", stored.values, 16)):
        tensor_codec = codec.key if part == "keys" else codec.value
        basis = tensor_codec.basis.float()
        assert basis.shape == (2, 32, rank)
        torch.testing.assert_close(basis.transpose(1, 2) @ basis, torch.eye(rank).expand(2, rank, rank), atol=1e-5, rtol=0)
        rows = head_rows(tensor, torch.ones(tensor.shape[:3], dtype=torch.bool))  # [heads, tokens, dim]
        singular = torch.linalg.svdvals(rows)
        pages = rows.view(2, -1, 16, 32).reshape(-1, 16, 32)
        heads = torch.arange(2).repeat_interleave(rows.shape[1] // 16)
        decoded = tensor_codec.decode(tensor_codec.encode(pages, heads), heads)
        lost = (decoded - pages).square().view(2, -1).sum(-1)
        torch.testing.assert_close(lost, singular[:, rank:].square().sum(-1), rtol=1e-3, atol=1e-3)


def test_the_calibration_is_cached_per_model_and_ids(model, text_ids, tmp_path) -> None:
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        path = tmp_path / "c.safetensors"
        calibrate_cskv(model, text_ids, path)
        written = path.stat().st_mtime_ns
        calibrate_cskv(model, text_ids, path)
        assert len(calls) == 1 and path.stat().st_mtime_ns == written  # the same model and ids: kept, the model not run
        calibrate_cskv(model, text_ids[:, :200], path)
        assert len(calls) == 2  # other ids: run again
        other = build_model("default")
        with torch.no_grad():
            other.model.layers[0].self_attn.k_proj.weight.mul_(2)
        other.register_forward_pre_hook(lambda module, args: calls.append(1))
        calibrate_cskv(other, text_ids[:, :200], path)
        assert len(calls) == 3  # another model (its fingerprint): run again
    finally:
        hook.remove()


@pytest.mark.parametrize(
    "spec", ["cskv(key_keep=0.75, value_keep=0.25, calibration={path!r})"]
)  # fitted: tests/adapters/cache/test_codecs.py
def test_page_bytes_shrink_to_the_kept_channels_through_generate(model, calibration, spec: str) -> None:
    spec = spec.format(path=calibration)
    ids, mask = left_padded([50, 41], seed=9, vocab=256)
    run = {"attention_mask": mask, "do_sample": False, "max_new_tokens": 16, "pad_token_id": PAD}
    cache, exact = kvlib.make_cache(model, spec), kvlib.make_cache(model)
    out = model.generate(ids, **run, **cache_argument(cache))
    model.generate(ids, **run, **cache_argument(exact))
    assert out.shape == (2, ids.shape[1] + 16)
    policy = kvlib.parse_policy(spec)
    kept = round(policy.key_keep * 32) + round(policy.value_keep * 32)
    pages = sealed_total = 0
    for pool in cache.store.pools:
        sealed = int(pool.sealed.sum())
        sealed_total += sealed
        assert pool.codec.page_bytes() == 16 * kept * 4  # coefficients in float32
        pages += (pool.pages_in_use - sealed) * pool.kv_page_bytes + sealed * pool.codec.page_bytes()
    report = cache.memory_report()["by_component"]
    assert report["pages"] == pages and sealed_total > 0
    assert report["codec_metadata"] == sum(pool.codec.state_bytes() for pool in cache.store.pools)
    full_pages = exact.memory_report()["by_component"]["pages"]
    assert report["pages"] < full_pages and sealed_total * (64 - kept) * 16 * 4 == full_pages - report["pages"]


def test_the_window_of_recent_tokens_stays_exact(model, calibration) -> None:
    """40 prompt tokens at 16-token pages: the open page (tokens 32-39) is kept as computed, the
    sealed ones hold the shrunk channels."""
    prompt = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    cache, exact = kvlib.make_cache(model, f"cskv(calibration={calibration!r})"), kvlib.make_cache(model)
    with torch.inference_mode():
        model(input_ids=prompt, **cache_argument(cache), use_cache=True)
        model(input_ids=prompt, **cache_argument(exact), use_cache=True)
    coded, full = cache.store.read(0, cache._rows), exact.store.read(0, exact._rows)
    assert torch.equal(coded.keys[:, :, 32:40], full.keys[:, :, 32:40]) and torch.equal(coded.values[:, :, 32:40], full.values[:, :, 32:40])
    assert not torch.equal(coded.keys[:, :, :32], full.keys[:, :, :32])


def test_cskv_composes_with_eviction(model, calibration) -> None:
    ids, mask = left_padded([50, 41], seed=5, vocab=256)
    cache = kvlib.make_cache(model, f"snapkv+cskv(calibration={calibration!r})", budget=24)
    model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD, **cache_argument(cache))
    for layer in range(cache.shape.num_layers):
        assert int((cache.kept_positions(layer) >= 0).sum(-1).max()) <= 24 + 16
    assert sum(int(pool.sealed.sum()) for pool in cache.store.pools) > 0


def test_the_engine_serves_a_calibrated_basis_as_generate_does_and_refuses_a_fitted_one(model, calibration) -> None:
    """A calibration fixes the basis before any prompt, so the Engine's shared pages take it: each
    request's greedy output equals ``generate`` with the drop-in cache (sealed pages in the basis);
    without one the basis is fitted to each prompt, which shared pages cannot hold."""
    spec = f"cskv(calibration={calibration!r})"
    prompts = [list(b"The basis is fixed before any prompt. ") * 2, list(b"Pages of two requests share it."), list(b"short")]
    engine = kvlib.Engine(model, spec, page_size=8)
    outputs = engine.generate(prompts, max_new_tokens=12)
    for prompt, output in zip(prompts, outputs):
        cache = kvlib.make_cache(model, spec, page_size=8)
        expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=PAD, **cache_argument(cache))
        assert output == expected[0, len(prompt) :].tolist()
    assert engine.stats()["memory_bytes"]["pages"] > 0
    with pytest.raises(ValueError, match="fits itself to each prompt"):
        kvlib.Engine(model, "cskv")


def test_bad_input_is_refused_before_model_work(tmp_path, calibration) -> None:
    with pytest.raises(ValueError, match=r"key_keep must be in \(0, 1\]"):
        kvlib.parse_policy("cskv(key_keep=0.0)")
    with pytest.raises(ValueError, match=r"value_keep must be in \(0, 1\]"):
        kvlib.parse_policy("cskv(value_keep=1.5)")
    missing = str(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="is not a readable kvlib-cskv-calibration-1 file"):
        kvlib.parse_policy(f"cskv(calibration={missing!r})")
    with pytest.raises(ValueError, match=r"does not fit this model: layer 0 keys are \[2, 32, 32\], the model's \[2, 8, 8\]"):
        kvlib.make_cache(build_model("llama"), f"cskv(calibration={calibration!r})")
    with pytest.raises(ValueError, match=r"calibration needs input_ids \[batch, tokens\]"):
        calibrate_cskv(build_model("llama"), torch.zeros(5, dtype=torch.int64), tmp_path / "x.safetensors")
