"""Codecs through ``generate``: every quantization and low-rank policy, alone and under every
eviction policy, for fp32, fp16 and bf16, on the embedded default model and a GPT-2 config; bytes held follow
the codec's layout; int8 stays within a stated KL of the uncompressed cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvlib
from kvlib.eval.agreement import agreement_metrics, greedy_reference, teacher_forced_logits
from kvlib.model_shape import kv_shape
from kvlib.policies.lowrank.leank import save_mask
from kvlib.storage.pools.formats.coded_format import CodedPages
from kvlib.storage.pools.formats.partnered_format import PARTNER_ID_BYTES, PartneredPages
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import DEFAULT_BYTES, PAD, build_model, left_padded

_CODEC_CASES = {
    "minicache": "minicache(start=0.0)",  # the GPT-2 config has 2 layers: one pair from layer 0
    "leank": "leank(mask={leank_mask!r})",  # a mask for the family's model: :func:`leank_mask`
}
CODECS = [_CODEC_CASES.get(name, name) for name in kvlib.available_policies()["quantization"] + kvlib.available_policies()["lowrank"]]
INT8_KL_BOUND = 2e-5
"""Mean KL(full || int8) of the default model's next-token distributions, nats (measured 2.5e-6;
the bound keeps the 7-8x margin the stories260K test model's had, 0.002 over 0.0003)."""


def test_every_codec_kind_is_registered() -> None:
    assert {"kivi", "int8", "kv_bits", "fp8"} <= set(kvlib.available_policies()["quantization"])
    assert {"svd", "xkv", "think", "minicache", "leank"} <= set(kvlib.available_policies()["lowrank"])


def held_bytes_follow_the_layout(cache) -> None:
    """``pages`` and ``codec_metadata`` equal what the pools' open and sealed pages hold."""
    pages = metadata = sealed_total = 0
    for pool in cache.store.pools:
        if not isinstance(pool.format, CodedPages):  # a layer the codec leaves alone (MiniCache's first layers)
            pages += pool.pages_in_use * pool.kv_page_bytes
            continue
        sealed = int(pool.sealed.sum())
        sealed_total += sealed
        open_pages = pool.pages_in_use - sealed
        pages += open_pages * pool.kv_page_bytes + (sealed * pool.codec.page_bytes(metadata=False) if sealed else 0)
        metadata += (sealed * pool.codec.page_bytes(metadata=True) if sealed else 0) + pool.codec.state_bytes()
        if isinstance(pool.format, PartneredPages):
            metadata += sealed * PARTNER_ID_BYTES
    report = cache.memory_report()["by_component"]
    assert report["pages"] == pages and report["codec_metadata"] == metadata
    assert report["read_cache"] == 0  # no dense mirror by default with a codec
    assert sealed_total > 0


def leank_mask(model: torch.nn.Module, folder: Path) -> str:
    """A LeanK mask for ``model`` keeping every other key channel of each head."""
    shape = kv_shape(model)
    path = folder / "leank.json"
    save_mask(path, [[list(range(0, shape.head_dim, 2))] * shape.num_kv_heads] * shape.num_layers, {"by": "test"})
    return str(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ["default", "gpt2"])
@pytest.mark.parametrize("spec", CODECS)
def test_codec_through_generate(spec: str, family: str, dtype: torch.dtype, tmp_path: Path) -> None:
    model = build_model(family).to(dtype)
    spec = spec.format(leank_mask=leank_mask(model, tmp_path))
    ids, mask = left_padded([40, 33], seed=7)
    cache = kvlib.make_cache(model, spec)
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    assert out.shape == (2, ids.shape[1] + 12)
    held_bytes_follow_the_layout(cache)
    exact = kvlib.make_cache(model)
    model.generate(ids, attention_mask=mask, **cache_argument(exact), do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    if spec in kvlib.available_policies()["quantization"]:
        coded, full = cache.memory_report()["by_component"], exact.memory_report()["by_component"]
        assert coded["pages"] + coded["codec_metadata"] < full["pages"]


@pytest.mark.parametrize("codec", ["kivi(bits=4)", "svd(rank=4)"])
@pytest.mark.parametrize("eviction", kvlib.available_policies()["eviction"])
def test_codecs_compose_with_every_eviction_policy(eviction: str, codec: str) -> None:
    model = build_model("gpt2")
    ids, mask = left_padded([40, 33], seed=8)
    for slack, most in ((None, 24 + 16), (0, 24)):  # with a codec, slack defaults to a page
        options = {} if slack is None else {"slack": slack}
        cache = kvlib.make_cache(model, f"{eviction}+{codec}", budget=24, **options)
        model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=10, pad_token_id=PAD)
        held_bytes_follow_the_layout(cache)
        by_scores = cache.evictor.allocation.needs_scores  # a split by scores (Ada-KV) fixes each layer's total
        for layer in range(cache.shape.num_layers):
            kept = (cache.kept_positions(layer) >= 0).sum(-1)
            if by_scores:
                assert int(kept.sum(-1).max()) <= most * kept.shape[-1]
            else:
                assert int(kept.max()) <= most


@pytest.mark.parametrize("spec", ["svd(rank=32)", "xkv(rank=32)", "think(keep=1.0)", "minicache(start=0.2, retain=0.99)"])  # head_dim 32
def test_full_rank_low_rank_codecs_change_nothing(spec: str) -> None:
    model = build_model("default")
    ids, mask = left_padded([50, 41], seed=9, vocab=DEFAULT_BYTES)
    exact = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD, **cache_argument(kvlib.make_cache(model))
    )
    cache = kvlib.make_cache(model, spec)
    coded = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD, **cache_argument(cache))
    assert torch.equal(coded, exact)
    held_bytes_follow_the_layout(cache)


def test_int8_stays_within_a_small_kl_of_the_full_cache() -> None:
    model = build_model("default")
    prompt = torch.randint(3, DEFAULT_BYTES, (2, 64), generator=torch.Generator().manual_seed(1))
    tokens, reference = greedy_reference(model, kvlib.make_cache(model), prompt, 32)
    logits = teacher_forced_logits(model, kvlib.make_cache(model, "int8"), prompt, tokens)
    metrics = agreement_metrics(tokens, reference, logits)
    assert metrics["kl"] < INT8_KL_BOUND, metrics["kl"]
    assert metrics["agreement"] >= 0.9


def test_the_open_page_stays_exact_and_sealed_pages_hold_codes() -> None:
    model = build_model("default")
    cache = kvlib.make_cache(model, "kivi(bits=2)")
    prompt = torch.randint(3, DEFAULT_BYTES, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model(input_ids=prompt, **cache_argument(cache), use_cache=True)
    pool = cache.store.pools[0]
    assert int(pool.sealed.sum()) == 2 * cache.shape.num_kv_heads  # 40 tokens: two full pages per head, one open
    exact = kvlib.make_cache(model)
    with torch.inference_mode():
        model(input_ids=prompt, **cache_argument(exact), use_cache=True)
    coded, full = cache.store.read(0, cache._rows), exact.store.read(0, exact._rows)
    assert torch.equal(coded.keys[:, :, 32:40], full.keys[:, :, 32:40])  # the open page: compute dtype
    assert not torch.equal(coded.keys[:, :, :32], full.keys[:, :, :32])  # sealed pages: 2-bit codes


def test_beam_search_works_with_a_codec() -> None:
    model = build_model("default")
    ids, mask = left_padded([30, 25], seed=3, vocab=DEFAULT_BYTES)
    cache = kvlib.make_cache(model, "kivi(bits=4)")
    out = model.generate(
        ids, attention_mask=mask, **cache_argument(cache), num_beams=2, do_sample=False, max_new_tokens=20, pad_token_id=PAD
    )
    assert out.shape[0] == 2
    held_bytes_follow_the_layout(cache)


def test_a_read_mirror_reads_what_the_pages_decode_to() -> None:
    """With ``read_cache=True`` the mirror is rebuilt from decoded pages after each seal, so
    outputs equal the mirror-free cache's exactly."""
    model = build_model("default")
    ids, mask = left_padded([30, 25], seed=3, vocab=DEFAULT_BYTES)
    outputs = []
    for read_cache in (False, True):
        cache = kvlib.make_cache(model, "kivi(bits=2)", read_cache=read_cache)
        outputs.append(
            model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=24, pad_token_id=PAD)
        )
        assert (cache.memory_report()["by_component"]["read_cache"] > 0) == read_cache
    assert torch.equal(*outputs)


def test_a_reset_cache_refits_its_codec() -> None:
    model = build_model("default")
    cache = kvlib.make_cache(model, "svd(rank=4)")
    first = torch.randint(3, DEFAULT_BYTES, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        model(input_ids=first, **cache_argument(cache), use_cache=True)
        basis = cache.codecs[0].key.basis.clone()
        cache.reset()
        model(input_ids=first.flip(-1), **cache_argument(cache), use_cache=True)
    assert not torch.equal(cache.codecs[0].key.basis, basis)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("kivi(group=3)", "does not divide the value head dim 32"),
        ("kivi(bits=5)", "bits must be one of"),
        ("kivi+svd", "one codec per cache"),
        ("svd(energy=1.5)", "energy must be in"),
        ("think(keep=0)", "keep must be in"),
        ("minicache(start=0.9)", "no pair to merge"),
    ],
)
def test_bad_codec_specs_fail_before_any_model_work(spec: str, message: str) -> None:
    model = build_model("default")
    with pytest.raises(ValueError, match=message):
        kvlib.make_cache(model, spec)


def test_a_fitted_codec_waits_for_enough_tokens_before_fitting() -> None:
    """Fed one token at a time, SVD fits once a layer holds head_dim (32) real tokens per head;
    the pages filled before then are sealed as soon as it has."""
    model = build_model("default")
    cache = kvlib.make_cache(model, "svd(rank=4)")
    tokens = torch.randint(3, DEFAULT_BYTES, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        for t in range(40):
            model(input_ids=tokens[:, t : t + 1], **cache_argument(cache), use_cache=True)
            assert cache.codecs[0].ready == (t + 1 >= model.config.head_dim)
    assert int(cache.store.pools[0].sealed.sum()) == 2 * cache.shape.num_kv_heads  # 40 tokens: two full pages per head
    held_bytes_follow_the_layout(cache)
