"""DuoAttention: the retrieval/streaming split against a brute-force count, each head's kept set
through generate (retrieval heads everything, streaming heads sinks + newest), memory that follows
the kept tokens, profiles and bad parameters."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.policies.budget.head_importance import calibrate
from kvlib.policies.eviction.duo_attention import DuoAttention, DuoSplit
from kvlib.policy import BudgetRequest
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model


def brute_force(layers: int, heads: int, tokens: int, seen: int, streaming: int, weights: torch.Tensor | None) -> torch.Tensor:
    """Caps ``[layers, heads]``: the most retrieval heads (ranked) whose full ``seen`` tokens fit with
    every other head holding ``streaming``; the rest split equally, to a token."""
    total, count = tokens * layers * heads, layers * heads
    retrieval = 0
    if seen > streaming:
        while retrieval < count and (retrieval + 1) * seen + (count - retrieval - 1) * streaming <= total:
            retrieval += 1
    if weights is None:
        ranked = [(h, layer) for h in range(heads) for layer in range(layers)]
        order = [layer * heads + h for h, layer in ranked]
    else:
        order = sorted(range(count), key=lambda i: (-float(weights.flatten()[i]), i))
    caps = [0] * count
    for i in order[:retrieval]:
        caps[i] = seen
    rest = order[retrieval:]
    left = total - retrieval * seen
    for position, i in enumerate(sorted(rest)):
        caps[i] = left // len(rest) + (1 if position < left % len(rest) else 0)
    return torch.tensor(caps).view(layers, heads)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 5),
    heads=st.integers(1, 4),
    seen=st.integers(1, 300),
    streaming=st.integers(1, 80),
    fraction=st.floats(0.01, 1.0),
    weighted=st.booleans(),
)
def test_the_split_matches_a_brute_force_count(layers, heads, seen, streaming, fraction, weighted) -> None:
    tokens = max(1, int(seen * fraction))
    weights = torch.rand(layers, heads, generator=torch.Generator().manual_seed(seen)).double() if weighted else None
    split = DuoSplit(streaming)
    split.weights = weights
    caps = torch.stack(
        [
            split.caps(BudgetRequest(layer, layers, torch.tensor([tokens]), torch.full((1, heads), seen), seen=torch.tensor([seen])))[0]
            for layer in range(layers)
        ]
    )
    expected = brute_force(layers, heads, tokens, seen, streaming, weights)
    assert int(caps.sum()) == tokens * layers * heads
    assert torch.equal((caps == seen) & (caps > streaming), (expected == seen) & (expected > streaming))
    assert torch.equal(caps, expected)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_through_generate_retrieval_heads_keep_all_and_streaming_heads_sinks_and_newest(family: str) -> None:
    model = build_model(family)
    length = 48
    ids = torch.randint(3, 97, (1, length), generator=torch.Generator().manual_seed(2))
    cache = kvlib.make_cache(model, "duo_attention(sinks=2, recent=6)", budget=0.5, page_size=4)
    model(input_ids=ids, **cache_argument(cache))
    shape = cache.shape
    split = DuoSplit(8)
    expected = torch.stack(
        [
            split.caps(
                BudgetRequest(
                    layer, shape.num_layers, torch.tensor([24]), torch.full((1, shape.num_kv_heads), length), seen=torch.tensor([length])
                )
            )[0]
            for layer in range(shape.num_layers)
        ]
    )
    kept_total = 0
    for layer in range(shape.num_layers):
        positions = cache.kept_positions(layer)[0]
        for head in range(shape.num_kv_heads):
            kept = sorted(p for p in positions[head].tolist() if p >= 0)
            cap = int(expected[layer, head])
            assert kept == [0, 1, *range(length - cap + 2, length)] if cap < length else kept == list(range(length))
            kept_total += len(kept)
    assert kept_total == 24 * shape.num_layers * shape.num_kv_heads
    assert bool((expected == length).any()) and bool((expected < length).any())  # both kinds of head
    report = cache.memory_report()
    assert report["stored_tokens"] == kept_total
    page_bytes = 4 * (shape.head_dim + shape.value_dim) * 4
    assert report["by_component"]["pages"] == int(((expected + 3) // 4).sum()) * page_bytes


def test_smollm2_quarter_budget_holds_under_three_tenths_of_the_full_bytes(smollm2) -> None:
    loaded = smollm2
    model = loaded.model
    ids = torch.tensor([loaded.tokenizer.encode("A long and winding road leads to the old mill by the river. " * 40)])[:, :512]
    cache = kvlib.make_cache(model, "duo_attention(sinks=16, recent=48)", budget=0.25)
    model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=2, pad_token_id=0)
    counts = torch.stack([(cache.kept_positions(layer)[0] >= 0).sum(-1) for layer in range(cache.shape.num_layers)])
    assert int(counts.sum()) == (128 + 1) * counts.numel()  # 1/4 of 512 per head on average, then the decoded token
    assert int((counts == 513).sum()) > 0  # retrieval heads hold everything
    report = cache.memory_report()
    assert report["by_component"]["pages"] <= 0.30 * report["full_equivalent_bytes"]


def test_a_profile_chooses_the_retrieval_heads(tmp_path) -> None:
    model = build_model("llama")
    path = tmp_path / "profile.json"
    weights = calibrate(model, torch.randint(3, 97, (1, 60), generator=torch.Generator().manual_seed(0)), path, window=8, sinks=2)
    policy = DuoAttention(sinks=2, recent=6, profile=str(path))
    split = policy.default_budget()
    top = int(torch.argmax(weights.flatten()))
    caps = split.caps(BudgetRequest(top // 2, 2, torch.tensor([20]), torch.full((1, 2), 48), seen=torch.tensor([48])))
    assert int(caps[0, top % 2]) == 48
    ids = torch.randint(3, 97, (1, 48), generator=torch.Generator().manual_seed(1))
    cache = kvlib.make_cache(model, f"duo_attention(sinks=2, recent=6, profile={str(path)!r})", budget=20)
    model(input_ids=ids, **cache_argument(cache))
    assert int((cache.kept_positions(top // 2)[0, top % 2] >= 0).sum()) == 48


def test_a_profile_for_another_shape_is_refused(tmp_path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": "kvlib.head_importance/1", "weights": [[1.0, 2.0, 3.0]]}))
    with pytest.raises(ValueError, match="duo_attention profile is for 1 layers x 3 KV heads"):
        kvlib.make_cache(build_model("llama"), f"duo_attention(profile={str(path)!r})", budget=8)


def test_the_engine_serves_it_per_request() -> None:
    model = build_model("llama")
    prompt = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = kvlib.Engine(model)
    request = engine.add_request(prompt, max_new_tokens=5, spec="duo_attention(sinks=2, recent=6)", budget=16)
    while engine.has_unfinished:
        engine.step()
    cache = kvlib.make_cache(model, "duo_attention(sinks=2, recent=6)", budget=16)
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0, **cache_argument(cache))
    assert engine.requests[request].output == reference[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("duo_attention(sinks=-1)", "sinks must be >= 0"),
        ("duo_attention(recent=0)", "recent must be >= 1"),
        ("duo_attention(profile='/nonexistent.json')", "cannot read head_importance profile"),
        ("duo_attention(profile='/dev/zero')", "head_importance profile '/dev/zero' is not a regular file"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)
