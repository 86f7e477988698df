"""LeanK's codec: a mask file read and checked, sealed pages hold only each head's kept key channels
(bytes shrink in ``memory_report``), attention over them reads those channels only, and the cache
runs through ``generate`` and the Engine."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.codec import TensorShape
from kvlib.policies.lowrank.leank import MASK_FORMAT, LeanK, StaticChannelMask, save_mask
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import DEFAULT_BYTES, PAD, build_model, left_padded

CPU = torch.device("cpu")
DEFAULT_LAYOUT = (4, 2, 32)
"""The default model's layers, KV heads and key channels per head."""


def write_mask(path, channels) -> str:
    save_mask(path, channels, {"by": "test"})
    return str(path)


def even_channels(layers: int, heads: int, dim: int) -> list:
    return [[list(range(0, dim, 2)) for _ in range(heads)] for _ in range(layers)]


@settings(max_examples=40, deadline=None)
@given(
    dim=st.sampled_from([4, 8, 16]),
    kept=st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=3),
    pages=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_sealed_pages_hold_the_kept_channels_and_read_back_zero_elsewhere(dim: int, kept: list, pages: int, seed: int) -> None:
    heads = len(kept)
    channels = [[c for c in range(dim) if bits >> c & 1] for bits in kept]
    codec = StaticChannelMask(TensorShape(0, 1, heads, 4, dim, torch.float32, CPU), channels)
    width = max(1, max(len(head) for head in channels))
    assert codec.fields["channels"].shape == (4, width)  # the layer's widest head, at least one channel
    generator = torch.Generator().manual_seed(seed)
    block = torch.randn(pages * heads, 4, dim, generator=generator)
    page_heads = torch.arange(heads).repeat(pages)
    decoded = codec.decode(codec.encode(block, page_heads), page_heads)
    for page, head in enumerate(page_heads.tolist()):
        mask = torch.zeros(dim, dtype=torch.bool)
        mask[channels[head]] = True
        assert torch.equal(decoded[page], block[page] * mask)


def test_the_mask_file_round_trips_through_a_spec(tmp_path) -> None:
    path = write_mask(tmp_path / "mask.json", even_channels(*DEFAULT_LAYOUT))
    policy = kvlib.parse_policy(f"leank(mask={path!r})")
    assert isinstance(policy, LeanK) and policy.channels[3][1] == list(range(0, 32, 2))
    assert kvlib.parse_policy(policy.spec()) == policy
    assert str(kvlib.parse_spec(f"snapkv+leank(mask={path!r})")) == f"snapkv+leank(mask={path!r})"


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "is not a file"),
        ("not json", "not readable JSON"),
        (json.dumps({"format": "other", "channels": [[[0]]]}), "is not a 'kvlib-leank-mask/1' file"),
        (json.dumps({"format": MASK_FORMAT, "channels": []}), "must be a non-empty list"),
        (json.dumps({"format": MASK_FORMAT, "channels": [[[3, 1]]]}), "ascending distinct ints"),
        (json.dumps({"format": MASK_FORMAT, "channels": [[[0, True]]]}), "ascending distinct ints"),
    ],
)
def test_a_bad_mask_file_is_one_line_naming_it(tmp_path, content, message) -> None:
    path = tmp_path / "mask.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        LeanK(mask=str(path))
    assert "\n" not in str(info.value)


def test_a_mask_for_another_model_is_refused_before_any_model_work(tmp_path) -> None:
    model = build_model("default")
    wrong_layers = write_mask(tmp_path / "layers.json", even_channels(2, 2, 32))
    with pytest.raises(ValueError, match=r"is for 2 layers with KV heads \[2, 2\], but the model has 4 layers"):
        kvlib.make_cache(model, f"leank(mask={wrong_layers!r})")
    wide = write_mask(tmp_path / "wide.json", [[[0, 40]] * 2] * 4)
    with pytest.raises(ValueError, match="keeps channel 40 of layer 0, whose keys have 32 channels"):
        kvlib.make_cache(model, f"leank(mask={wide!r})")


def test_bytes_held_shrink_to_the_kept_channels(tmp_path) -> None:
    """Half the key channels kept: a sealed page holds its keys at half their bytes, values whole;
    ``memory_report`` counts exactly that, and open pages at full size."""
    model = build_model("default")
    path = write_mask(tmp_path / "mask.json", even_channels(*DEFAULT_LAYOUT))
    prompt = torch.randint(3, DEFAULT_BYTES, (1, 64), generator=torch.Generator().manual_seed(4))
    cache, exact = kvlib.make_cache(model, f"leank(mask={path!r})"), kvlib.make_cache(model)
    with torch.inference_mode():
        model(input_ids=prompt, **cache_argument(cache), use_cache=True)
        model(input_ids=prompt, **cache_argument(exact), use_cache=True)
    layers, heads, dim = DEFAULT_LAYOUT
    sealed = layers * heads * 4  # 64 tokens: four full pages per head, all sealed
    assert sum(int(pool.sealed.sum()) for pool in cache.store.pools) == sealed
    element = 4  # float32
    held, full = cache.memory_report()["by_component"], exact.memory_report()["by_component"]
    assert full["pages"] == sealed * 16 * (dim + dim) * element
    assert held["pages"] == sealed * 16 * (dim // 2 + dim) * element
    assert held["codec_metadata"] == sum(codec.state_bytes() for codec in cache.codecs)


def test_attention_over_sealed_pages_reads_the_kept_channels_only(tmp_path) -> None:
    """A sealed page's keys read back as the exact keys with the pruned channels zeroed, so every
    query's score against them is its product over the kept channels; the open page is exact."""
    model = build_model("default")
    channels = [[list(range(0, 32, 2)), list(range(8))] for _ in range(4)]  # heads keep 16 and 8 channels
    path = write_mask(tmp_path / "mask.json", channels)
    prompt = torch.randint(3, DEFAULT_BYTES, (1, 40), generator=torch.Generator().manual_seed(5))
    cache, exact = kvlib.make_cache(model, f"leank(mask={path!r})"), kvlib.make_cache(model)
    with torch.inference_mode():
        model(input_ids=prompt, **cache_argument(cache), use_cache=True)
        model(input_ids=prompt, **cache_argument(exact), use_cache=True)
    for layer in range(4):
        pruned, full = cache.store.read(layer, cache.rows).keys, exact.store.read(layer, exact.rows).keys
        for head, kept in enumerate(channels[layer]):
            mask = torch.zeros(32, dtype=torch.bool)
            mask[kept] = True
            assert torch.equal(pruned[0, head, :32], full[0, head, :32] * mask)  # two sealed pages
            assert torch.equal(pruned[0, head, 32:40], full[0, head, 32:40])  # the open page
        assert torch.equal(cache.store.read(layer, cache.rows).values, exact.store.read(layer, exact.rows).values)


def test_every_channel_kept_gives_the_exact_cache_through_generate(tmp_path) -> None:
    model = build_model("default")
    path = write_mask(tmp_path / "all.json", [[list(range(32))] * 2] * 4)
    ids, mask = left_padded([50, 41], seed=9, vocab=DEFAULT_BYTES)
    options = {"attention_mask": mask, "do_sample": False, "max_new_tokens": 16, "pad_token_id": PAD}
    exact = model.generate(ids, **options, **cache_argument(kvlib.make_cache(model)))
    cache = kvlib.make_cache(model, f"leank(mask={path!r})")
    assert torch.equal(model.generate(ids, **options, **cache_argument(cache)), exact)


def test_the_engine_serves_leank_as_the_drop_in_cache_does(tmp_path) -> None:
    """One mask for every prompt: the Engine shares LeanK pages between requests (a codec fitted
    to each prompt, ``think``, is refused there) and gives each prompt the drop-in cache's tokens."""
    model = build_model("default")
    path = write_mask(tmp_path / "mask.json", even_channels(*DEFAULT_LAYOUT))
    spec = f"leank(mask={path!r})"
    prompts = [torch.randint(3, DEFAULT_BYTES, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 57, 33)]
    served = kvlib.Engine(model, spec=spec).generate(prompts, max_new_tokens=12)
    for prompt, tokens in zip(prompts, served):
        alone = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=PAD, **cache_argument(kvlib.make_cache(model, spec))
        )
        assert tokens == alone[0, len(prompt) :].tolist()
    with pytest.raises(ValueError, match="think.* fits itself to each prompt"):
        kvlib.Engine(model, spec="think")
