"""calibrate_retrieval: each KV head's attention from the answer's queries onto the needle, as a
head profile that head_importance and duo_attention read."""

from __future__ import annotations

import json

import pytest
import torch

import kvlib
from kvlib.policies.budget.head_importance import PROFILE_FORMAT, load_profile
from kvlib.policies.budget.retrieval_calibration import RetrievalCase, calibrate_retrieval
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model
from tests.policies.budget.conftest import kept_counts


def case(length: int, needle: tuple[int, ...], queries: tuple[int, ...], seed: int = 0) -> RetrievalCase:
    ids = torch.randint(3, 97, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return RetrievalCase(tuple(ids), needle, queries)


def retrieval_mass_by_hand(model, cases: list[RetrievalCase]) -> torch.Tensor:
    """The profile by explicit loops over eager attention weights returned by the model."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        per_case = []
        for c in cases:
            with torch.no_grad():
                attentions = model(torch.tensor([list(c.ids)]), output_attentions=True, use_cache=False).attentions
            rows = []
            for weights in attentions:  # [1, query_heads, tokens, tokens]
                heads = weights.shape[1]
                per_head = [
                    sum(float(weights[0, h, q, p]) for q in c.answer_queries for p in c.needle) / len(c.answer_queries)
                    for h in range(heads)
                ]
                kv_heads = model.config.num_key_value_heads if hasattr(model.config, "num_key_value_heads") else heads
                group = heads // kv_heads
                rows.append([sum(per_head[k * group : (k + 1) * group]) / group for k in range(kv_heads)])
            per_case.append(rows)
    finally:
        model.set_attn_implementation(previous)
    return torch.tensor(per_case, dtype=torch.float64).mean(0) + 1e-3


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_profile_is_the_answer_queries_attention_on_the_needle(tmp_path, family):
    model = build_model(family)
    cases = [case(30, (4, 5, 6), (20, 21, 22, 23)), case(26, (10,), (25,), seed=1)]
    path = tmp_path / "profile.json"
    weights = calibrate_retrieval(model, cases, path)
    assert weights.dtype == torch.float64 and weights.shape == (2, 2 if family == "llama" else 4)
    assert torch.allclose(weights, retrieval_mass_by_hand(model, cases), rtol=1e-5, atol=1e-7)
    assert torch.equal(load_profile(str(path)), weights)
    saved = json.loads(path.read_text())
    assert saved["format"] == PROFILE_FORMAT and saved["measure"] == "retrieval" and saved["cases"] == 2
    assert model.config._attn_implementation == "sdpa"


def test_the_profile_drives_duo_attention_and_the_attention_is_restored(tmp_path):
    model = build_model("llama")
    kvlib.attach(model)
    path = tmp_path / "profile.json"
    weights = calibrate_retrieval(model, [case(24, (2, 3), (18, 19))], path)
    assert model.config._attn_implementation == "kvlib_sdpa"
    cache = kvlib.make_cache(model, f"duo_attention(sinks=1, recent=2, profile={str(path)!r})", budget=0.5)
    ids = torch.randint(3, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=ids, **cache_argument(cache))
    counts = kept_counts(cache)[:, 0]  # [layers, kv_heads]
    strongest = divmod(int(weights.flatten().argmax()), 2)
    assert int(counts[strongest]) == 24  # the head that attends to the needle most retrieves: it keeps everything
    assert int((counts == 24).sum()) == 1 and int(counts.sum()) <= 2 * 2 * 12


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (RetrievalCase((5, 6, 7), (), (2,)), "at least one needle position"),
        (RetrievalCase((5, 6, 7), (0,), (3,)), r"must lie in \[0, 3\)"),
        (RetrievalCase((5, 6, 7), (2,), (1, 2)), "must precede the answer's queries"),
    ],
)
def test_bad_cases_are_refused_before_any_model_work(tmp_path, bad, message):
    model = build_model("gpt2")

    def never(*args, **kwargs):
        raise AssertionError("the model ran")

    model.forward = never
    with pytest.raises(ValueError, match=message):
        calibrate_retrieval(model, [case(10, (1,), (5,)), bad], tmp_path / "never.json")
    with pytest.raises(ValueError, match="at least one case"):
        calibrate_retrieval(model, [], tmp_path / "never.json")
    assert not (tmp_path / "never.json").exists() and model.config._attn_implementation == "sdpa"


def test_the_attention_is_restored_when_the_forward_fails(tmp_path):
    model = build_model("gpt2")

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    model.forward = broken
    with pytest.raises(RuntimeError, match="out of memory"):
        calibrate_retrieval(model, [case(10, (1,), (5,))], tmp_path / "never.json")
    assert model.config._attn_implementation == "sdpa" and not (tmp_path / "never.json").exists()
