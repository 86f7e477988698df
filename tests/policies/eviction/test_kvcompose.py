"""kvcompose: the tokens each head keeps against a reference written from kvpress's
``KVComposePress`` (``compute_scores``, ``enhance_scores``, ``prepare_important_masks``, structured),
the mean across heads matched by position, and the budget and freed pages through generate and the
Engine (with a codec: ``tests/adapters/cache/test_codecs.py`` walks every eviction policy as
``<name>+kivi(bits=4)``)."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.eviction.kvcompose import KVCompose
from kvlib.policy import LayerView
from kvlib.selection import select_keep
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded
from tests.policies.eviction.kept_bytes import assert_budget_and_bytes
from tests.policies.eviction.test_fastkv import assert_engine_matches_generate

HEADS, GROUP, QUERIES, SLOTS, DIM = 3, 2, 5, 40, 4


def kvpress_kept(
    attention: torch.Tensor, values: torch.Tensor, count: int, task: str, group: str, v_norm: bool, across: bool
) -> list[set[int]]:
    """kvpress's KVComposePress for one layer of a batch of one, written out: a task aggregator per
    attention head over its queries, a group aggregator over each KV head's attention heads, the
    value norm and the mean across heads (``enhance_scores``), then each head's ``count`` best
    (``prepare_important_masks`` with ``structured=True`` and ``important_per_layer = count``)."""
    scores = torch.zeros(HEADS, SLOTS, dtype=torch.float64)
    for kv_head in range(HEADS):
        per_head = []
        for att_head in range(kv_head * GROUP, (kv_head + 1) * GROUP):
            rows = attention[0, att_head].double()  # [queries, slots]
            per_head.append(rows.amax(dim=0) if task == "max" else rows.mean(dim=0))
        stacked = torch.stack(per_head)
        scores[kv_head] = stacked.mean(dim=0) if group == "mean" else stacked.amax(dim=0)
    if v_norm:
        for kv_head in range(HEADS):
            scores[kv_head] = scores[kv_head] * values[0, kv_head].double().norm(dim=1)
    if across:
        scores += scores.mean(dim=0, keepdim=True)
    return [set(torch.argsort(scores[h], descending=True)[:count].tolist()) for h in range(HEADS)]


@pytest.mark.parametrize(
    "task, group, v_norm, across", [("max", "mean", False, True), ("mean", "max", True, False), ("max", "max", True, True)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_tokens_match_kvpress(seed: int, task: str, group: str, v_norm: bool, across: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    attention = torch.softmax(torch.randn(1, HEADS * GROUP, QUERIES, SLOTS, generator=generator) * 3, dim=-1)
    values = torch.randn(1, HEADS, SLOTS, DIM, generator=generator)
    keys = torch.randn(1, HEADS, SLOTS, DIM, generator=generator)
    positions = torch.arange(SLOTS).expand(1, HEADS, SLOTS)
    valid = torch.ones(1, HEADS, SLOTS, dtype=torch.bool)
    view = LayerView(0, 1, keys, values, positions, valid, attention=attention)
    policy = KVCompose(window=QUERIES, task=task, group=group, value_norm=v_norm, mean_across_heads=across)
    for count in (6, 17):
        ours = select_keep(policy.score(view), valid, torch.full((1, HEADS), count))
        expected = kvpress_kept(attention, values, count, task, group, v_norm, across)
        assert [{int(s) for s in ours[0, h]} for h in range(HEADS)] == expected


def test_the_mean_across_heads_matches_tokens_by_position() -> None:
    """Head 0 holds positions 0-3, head 1 positions 2, 3, 5 (one empty slot): position 2 and 3 are
    in both, 0, 1 and 5 in one."""
    positions = torch.tensor([[[0, 1, 2, 3], [2, 3, 5, -1]]])
    valid = positions >= 0
    attention = torch.zeros(1, 2, 1, 4)
    attention[0, 0, 0] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    attention[0, 1, 0] = torch.tensor([0.5, 0.1, 0.4, 0.0])
    keys = torch.zeros(1, 2, 4, 0)
    view = LayerView(0, 1, keys, keys.clone(), positions, valid, attention=attention)
    scores = KVCompose(window=1).score(view)
    # own + mean over the heads holding the position: 0: 0.1+0.1, 1: 0.2+0.2, 2: 0.3+0.4, 3: 0.4+0.25, 5: 0.4+0.4
    torch.testing.assert_close(scores[0, 0], torch.tensor([0.2, 0.4, 0.7, 0.65]))
    torch.testing.assert_close(scores[0, 1, :3], torch.tensor([0.9, 0.35, 0.8]))
    assert scores[0, 1, 3] == -torch.inf


def test_registration_and_what_it_reads() -> None:
    assert kvlib.get_policy("kvcompose") is KVCompose
    assert KVCompose().needs == frozenset({"attention"}) and not KVCompose().reads_kv
    assert KVCompose(value_norm=True).reads_kv and KVCompose(window=8).observed_queries() == 8
    text = "kvcompose(window=8, task='mean', group='max', value_norm=True, mean_across_heads=False)"
    assert kvlib.parse_policy(text).spec() == text


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_through_generate_every_head_keeps_the_same_count_and_frees_the_pages(family: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([30, 41], seed=3)
    cache = kvlib.make_cache(model, "kvcompose(window=4, value_norm=True)", budget=20, slack=0)
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=6, pad_token_id=PAD)
    assert_budget_and_bytes(cache, 20)


def test_the_engine_takes_it_per_request_as_generate_does() -> None:
    assert_engine_matches_generate("kvcompose(window=4)")


@pytest.mark.parametrize(
    "spec, message",
    [("kvcompose(window=0)", "window must be >= 1"), ("kvcompose(task='sum')", "task"), ("kvcompose(group='min')", "group")],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)


def kvpress_procedure(family: str, ids: torch.Tensor, budget: float, across: bool) -> list[list[set[int]]]:
    """kvpress's ``KVComposePress`` over a whole prompt, written out (structured, ``agg_task="max"``,
    ``agg_group="mean"``, ``agg_head="mean"``, mean across heads): the prompt, then the prompt again
    after it with eager attention, each query head's max attention from the second copy to each
    first-copy token, the group mean, the mean across heads; then the per-layer counts (a top-k of
    ``layers * budget * tokens`` over every layer's rank-wise mean of sorted scores, the first layer's
    raised to the max over layers, at least 1; ``across=False``: the budget in every layer) and each
    head's best by its scores. Returns ``[layer][kv head] -> kept positions``."""
    from transformers import DynamicCache

    tokens = ids.shape[-1]
    keep = round(budget * tokens)
    eager = build_model(family, attn_implementation="eager")
    with torch.no_grad():
        cache = DynamicCache()
        eager(input_ids=ids, **cache_argument(cache), use_cache=True)
        attentions = eager(input_ids=ids, **cache_argument(cache), use_cache=True, output_attentions=True).attentions
    heads = eager.config.num_key_value_heads
    scores = []
    for layer in attentions:  # [1, query heads, tokens, 2 * tokens]
        per_query_head = layer[0, :, :, :tokens].double().amax(dim=1)
        per_kv_head = per_query_head.view(heads, -1, tokens).mean(dim=1)
        scores.append(per_kv_head + per_kv_head.mean(dim=0, keepdim=True))
    layers = len(scores)
    if across:
        composite = torch.stack([s.sort(dim=-1, descending=True).values.mean(dim=0) for s in scores])
        composite[0] = composite.max(dim=0).values
        best = composite.reshape(-1).topk(layers * keep).indices // tokens
        counts = torch.bincount(best, minlength=layers).clamp(min=1).tolist()
    else:
        counts = [keep] * layers
    return [[set(torch.argsort(s[h], descending=True)[: counts[layer]].tolist()) for h in range(heads)] for layer, s in enumerate(scores)]


@pytest.mark.parametrize("across", [True, False])
def test_compress_keeps_what_kvpress_keeps_by_the_repeat_pass_and_the_cross_layer_allocation(across: bool) -> None:
    """``compress`` against kvpress's procedure written out: the same tokens in every layer and head,
    per-layer counts that differ across layers (and sum to the budget) with the allocation, the
    budget in every layer without it; afterwards the cache evicts nothing and decodes on."""
    from kvlib.policies.eviction.kvcompose import compress

    model = build_model("default")  # the trained model: its layers' attention differs, so their counts do
    ids = torch.tensor([list(b"KVCompose keeps composite tokens; the answer is 42. What is it?")])
    cache = kvlib.make_cache(model, "kvcompose", budget=0.25)
    with torch.no_grad():
        logits = compress(model, cache, ids, across_layers=across)
        full = model(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(logits, full)  # the last query attends before its layer compacts
    expected = kvpress_procedure("default", ids, 0.25, across)
    kept = [[{int(p) for p in head if p >= 0} for head in cache.kept_positions(layer)[0].tolist()] for layer in range(len(expected))]
    assert kept == expected
    counts = [len(layer[0]) for layer in kept]
    assert sum(counts) == len(counts) * round(0.25 * ids.shape[-1]) and (len(set(counts)) > 1) == across
    assert cache.evictor is None
    with torch.no_grad():
        model(input_ids=torch.tensor([[7]]), **cache_argument(cache))
    assert [len(head) for head in cache.kept_positions(0)[0].tolist()] == [counts[0] + 1] * len(kept[0])


def test_context_prefill_reuses_the_repeat_pass_across_budgets_and_compress_refuses_other_caches() -> None:
    from kvlib.policies.eviction.kvcompose import compress, prefill_by_repeat

    model = build_model("llama")
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(6))
    assert KVCompose().context_prefill() is prefill_by_repeat
    memo: dict = {}
    kept = {}
    for budget in (0.25, 0.5):
        cache = kvlib.make_cache(model, "kvcompose", budget=budget)
        prefill_by_repeat(model, cache, ids, None, memo)
        kept[budget] = sum(len([p for p in head if p >= 0]) for head in cache.kept_positions(1)[0].tolist())
    assert len(memo) == 1 and kept[0.5] > kept[0.25]
    with pytest.raises(ValueError, match="make_cache\\(model, 'kvcompose', budget=...\\)"):
        compress(model, kvlib.make_cache(model, "snapkv", budget=0.25), ids)
    used = kvlib.make_cache(model, "kvcompose", budget=0.25)
    with torch.no_grad():
        model(input_ids=ids, **cache_argument(used))
    with pytest.raises(ValueError, match="empty cache"):
        compress(model, used, ids)
