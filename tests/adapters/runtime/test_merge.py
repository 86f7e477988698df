"""merge: evicted values folded into the most similar kept token (by key cosine), as a mean."""

from __future__ import annotations

import torch

import kvlib
from kvlib.adapters.runtime.merge import merged_values
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded


def reference_merge(keys, values, candidates, kept):
    batch, heads, _, _ = keys.shape
    out = torch.zeros(batch, heads, kept.shape[-1], values.shape[-1])
    for b in range(batch):
        for h in range(heads):
            slots = [int(s) for s in kept[b, h] if s >= 0]
            groups = {s: [values[b, h, s]] for s in slots}
            for e in range(keys.shape[2]):
                if not candidates[b, h, e] or e in slots:
                    continue
                sims = [float(torch.nn.functional.cosine_similarity(keys[b, h, e], keys[b, h, s], dim=0)) for s in slots]
                groups[slots[max(range(len(slots)), key=lambda i: (sims[i], -i))]].append(values[b, h, e])
            for i, s in enumerate(slots):
                out[b, h, i] = torch.stack(groups[s]).mean(0)
    return out


def test_merged_values_match_a_loop():
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 3, 9, 4, generator=generator), torch.randn(2, 3, 9, 5, generator=generator)
    candidates = torch.ones(2, 3, 9, dtype=torch.bool)
    candidates[1, :, :2] = False  # padding slots are neither kept nor folded in
    kept = torch.tensor([[[0, 3, 7], [1, 2, -1], [4, 5, 8]], [[2, 6, -1], [3, 4, 5], [7, 8, -1]]])
    ours = merged_values(keys, values, candidates, kept)
    expected = reference_merge(keys, values, candidates, kept)
    real = kept >= 0
    assert torch.allclose(ours[real], expected[real], atol=1e-6)


def test_merge_through_generate_keeps_the_same_tokens_with_merged_values():
    model = build_model("default")
    ids, _ = left_padded([40], seed=21)
    plain = kvlib.make_cache(model, "streaming_llm", budget=16)
    merged = kvlib.make_cache(model, "streaming_llm", budget=16, merge=True)
    full = kvlib.make_cache(model)
    with torch.no_grad():
        for cache in (plain, merged, full):
            model(input_ids=ids, **cache_argument(cache))
    for layer in range(plain.shape.num_layers):
        assert torch.equal(plain.kept_positions(layer), merged.kept_positions(layer))
        read = full.store.read(layer, full._rows)
        kept = plain.kept_positions(layer)
        expected = reference_merge(read.keys, read.values, read.valid, kept)
        assert torch.allclose(merged.store.read(layer, merged._rows).values, expected, atol=1e-5)
    out = model.generate(
        ids, **cache_argument(kvlib.make_cache(model, "tova", budget=16, merge=True)), do_sample=False, max_new_tokens=6, pad_token_id=PAD
    )
    assert out.shape == (1, 46)
