"""CriticalKV: the output projection the cache hands it, its two-stage selection against an
independent (kvpress-style) computation, and its budget through generate and the Engine."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.model_shape import kv_shape, output_projections
from kvlib.policies.eviction.critical_kv import CriticalKV
from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import LayerView
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded

BATCH, KV_HEADS, GROUP, SLOTS, OBSERVED, DIM, HIDDEN = 2, 3, 2, 48, 6, 8, 20


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_output_projections_split_the_module_output_by_query_head(family: str) -> None:
    model = build_model(family)
    shape = kv_shape(model)
    projections = output_projections(model, shape)
    assert len(projections) == shape.num_layers
    module = model.model.layers[1].self_attn.o_proj if family == "llama" else model.transformer.h[1].attn.c_proj
    x = torch.randn(3, shape.num_query_heads * shape.value_dim)
    bias = module.bias if module.bias is not None else 0.0
    by_head = torch.einsum("thd,hdo->to", x.view(3, shape.num_query_heads, shape.value_dim), projections[1])
    torch.testing.assert_close(module(x) - bias, by_head)


def view_with(seed: int, tokens: int) -> LayerView:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([[48, 40, 44], [30, 48, 48]])
    valid = torch.arange(SLOTS) < lengths.unsqueeze(-1)
    positions = torch.where(valid, torch.arange(SLOTS).expand(BATCH, KV_HEADS, SLOTS), -1)
    attention = torch.rand(BATCH, KV_HEADS * GROUP, OBSERVED, SLOTS, generator=generator) ** 4
    attention = attention.masked_fill(~valid.repeat_interleave(GROUP, 1).unsqueeze(2), 0.0)
    return LayerView(
        layer_idx=0,
        num_layers=2,
        keys=torch.randn(BATCH, KV_HEADS, SLOTS, DIM, generator=generator),
        values=torch.randn(BATCH, KV_HEADS, SLOTS, DIM, generator=generator) * torch.rand(BATCH, KV_HEADS, SLOTS, 1, generator=generator),
        positions=positions,
        valid=valid,
        attention=attention / attention.sum(-1, keepdim=True),
        output_projection=torch.randn(KV_HEADS * GROUP, DIM, HIDDEN, generator=generator),
        budget_tokens=torch.full((BATCH,), tokens),
    )


def reference_kept(view: LayerView, tokens: int, floor: float, first_stage: float, epsilon: float) -> list[list[set[int]]]:
    """kvpress's CriticalAdaKVPress.compress, written out per row with plain top-k (window tokens
    as the largest finite score) and the projected norm head by head."""
    inner = SnapKV(window=OBSERVED).score(view).double()
    kept = []
    for b in range(BATCH):
        valid = view.valid[b]
        big = inner[b][inner[b].isfinite()].max() + 1e6
        base = torch.where(inner[b] == torch.inf, big, inner[b]).masked_fill(~valid, -1e30)
        n_safe = int(tokens * floor)
        safe = base.clone()
        for h in range(KV_HEADS):
            safe[h, torch.topk(base[h], n_safe).indices] = 1e29
        winners = torch.topk(safe.flatten(), tokens * KV_HEADS).indices // SLOTS
        budgets = torch.bincount(winners, minlength=KV_HEADS)
        norm = torch.zeros(KV_HEADS, SLOTS, dtype=torch.float64)
        for h in range(KV_HEADS):
            for g in range(GROUP):
                w = view.output_projection[h * GROUP + g].double()
                norm[h] += (view.values[b, h].double() @ w).abs().sum(-1) / GROUP
        rows = []
        for h in range(KV_HEADS):
            stage1 = set(torch.topk(safe[h], int(budgets[h] * first_stage)).indices.tolist()) | set(
                torch.topk(base[h], n_safe).indices.tolist()
            )
            second = (base[h] + epsilon) * norm[h]
            second = torch.where(base[h] >= big, 1e31, second).masked_fill(~valid[h], -1e30)
            second[list(stage1)] = 1e30
            rows.append(set(torch.topk(second, int(budgets[h])).indices.tolist()))
        kept.append(rows)
    return kept


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tokens, floor, first_stage", [(12, 0.2, 0.5), (20, 0.0, 0.25), (8, 0.5, 1.0)])
def test_two_stage_selection_matches_a_kvpress_style_reference(seed: int, tokens: int, floor: float, first_stage: float) -> None:
    view = view_with(seed, tokens)
    policy = CriticalKV(inner=SnapKV(window=OBSERVED), floor=floor, first_stage=first_stage)
    scores = policy.score(view)
    expected = reference_kept(view, tokens, floor, first_stage, policy.epsilon)
    for b in range(BATCH):
        for h in range(KV_HEADS):
            assert set((scores[b, h] == torch.inf).nonzero().flatten().tolist()) == expected[b][h]
        assert int((scores[b] == torch.inf).sum()) == tokens * KV_HEADS


def test_without_a_budget_it_gives_the_corrected_scores() -> None:
    view = view_with(0, 12)
    view.budget_tokens = None
    scores = CriticalKV(inner=SnapKV(window=OBSERVED)).score(view)
    inner = SnapKV(window=OBSERVED).score(view)
    finite = inner.isfinite()
    norms = torch.stack([(view.values @ view.output_projection[g::GROUP].unsqueeze(0)).abs().sum(-1) for g in range(GROUP)]).mean(0)
    torch.testing.assert_close(scores[finite], ((inner + 1e-4) * norms)[finite])
    assert torch.equal(scores[~finite], inner[~finite])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_through_generate_each_layer_keeps_its_budget_and_frees_the_pages(family: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([26, 33], seed=5)
    cache = kvlib.make_cache(model, "critical_kv(inner='snapkv(window=4)')", budget=0.5, page_size=4)
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=4, pad_token_id=PAD)
    kept = torch.stack([(cache.kept_positions(layer) >= 0).sum(-1) for layer in range(cache.shape.num_layers)])  # [layers, batch, heads]
    heads = cache.shape.num_kv_heads
    prompt_budget = torch.tensor([13, 17])  # ceil(0.5 * prompt), then every decoded token kept
    assert torch.equal(kept.sum(-1), ((prompt_budget + 3) * heads).expand(cache.shape.num_layers, -1))
    report = cache.memory_report()
    page_bytes = 2 * 4 * cache.shape.head_dim * 4  # keys and values of 4 float32 tokens
    assert report["by_component"]["pages"] == int(((kept + 3) // 4).sum()) * page_bytes
    assert report["stored_tokens"] == int(kept.sum())


@pytest.mark.slow  # the real model: test_through_generate_each_layer_keeps_its_budget_and_frees_the_pages checks it in the default suite; .ci/run runs this after
def test_smollm2_short_prompt_meets_the_budget(smollm2) -> None:
    loaded = smollm2
    model = loaded.model
    ids = torch.tensor([loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)])
    cache = kvlib.make_cache(model, "critical_kv", budget=0.25)
    model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=3, pad_token_id=0)
    budget = -(-ids.shape[1] // 4)
    for layer in range(cache.shape.num_layers):
        kept = (cache.kept_positions(layer)[0] >= 0).sum(-1)
        assert int(kept.sum()) == (budget + 2) * cache.shape.num_kv_heads
    assert cache.memory_report()["stored_tokens"] == (budget + 2) * cache.shape.num_kv_heads * cache.shape.num_layers


def test_the_engine_serves_it_per_request() -> None:
    model = build_model("llama")
    prompt = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = kvlib.Engine(model)
    request = engine.add_request(prompt, max_new_tokens=5, spec="critical_kv", budget=16)
    while engine.has_unfinished:
        engine.step()
    cache = kvlib.make_cache(model, "critical_kv", budget=16)
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0, **cache_argument(cache))
    assert engine.requests[request].output == reference[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("critical_kv(floor=1.5)", "floor must be in"),
        ("critical_kv(first_stage=-0.1)", "first_stage must be in"),
        ("critical_kv(epsilon=-1.0)", "epsilon must be"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)
