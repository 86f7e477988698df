"""Eviction through generate: streaming_llm against a hand-written reference, padding, needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib import registry
from kvlib.policy import NEEDS, Eviction, LayerView
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, assert_same_logits, build_model, left_padded

SINKS, BUDGET = 4, 16


def _keep_sinks_and_window(cache: DynamicCache, room: int = 0) -> None:
    """Cut every layer to the sinks and the newest ``BUDGET - SINKS - room`` tokens."""
    for layer in cache.layers:
        if layer.keys.shape[-2] > BUDGET - room:
            window = BUDGET - SINKS - room
            layer.keys = torch.cat([layer.keys[..., :SINKS, :], layer.keys[..., -window:, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :SINKS, :], layer.values[..., -window:, :]], dim=-2)


def reference_streaming(model, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """StreamingLLM by hand, as its reference code runs a held cache: a DynamicCache cut to sinks +
    window after the prompt, and cut to make room for each new token before its forward (so each
    step attends over the budget), with the true positions passed explicitly. Returns the greedy
    tokens and the logits of each step."""
    cache = DynamicCache(config=model.config)
    tokens, logits = [], []
    with torch.no_grad():
        out = model(input_ids=ids, **cache_argument(cache))
        _keep_sinks_and_window(cache)
        position = ids.shape[1]
        for _ in range(new_tokens):
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
            _keep_sinks_and_window(cache, room=1)
            out = model(input_ids=token, **cache_argument(cache), position_ids=torch.tensor([[position]]))
            position += 1
    return torch.cat(tokens, dim=1), logits


@pytest.mark.smoke
@pytest.mark.parametrize("family", ["default", "llama", "gpt2"])
def test_streaming_llm_generate_equals_the_reference_loop(family):
    model = build_model(family)
    ids, _ = left_padded([40], seed=11)
    expected, expected_logits = reference_streaming(model, ids, new_tokens=20)
    cache = kvlib.make_cache(model, f"streaming_llm(sinks={SINKS})", budget=BUDGET)
    out = model.generate(
        ids,
        **cache_argument(cache),
        do_sample=False,
        max_new_tokens=20,
        pad_token_id=PAD,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert torch.equal(out.sequences[:, ids.shape[1] :], expected)
    assert_same_logits(out.logits, expected_logits)
    logical = ids.shape[1] + 20 - 1
    window = list(range(SINKS)) + list(range(logical - (BUDGET - SINKS), logical))
    for layer in range(cache.shape.num_layers):
        kept = cache.kept_positions(layer)
        assert kept.shape == (1, cache.shape.num_kv_heads, BUDGET)
        assert (kept == torch.tensor(window)).all()
    assert cache.get_seq_length() == logical


def test_left_padded_batch_equals_each_prompt_alone():
    model = build_model("default")
    lengths = [24, 31, 38]
    ids, mask = left_padded(lengths, seed=12)
    batched_cache = kvlib.make_cache(model, "streaming_llm", budget=BUDGET)
    batched = model.generate(
        ids, attention_mask=mask, **cache_argument(batched_cache), do_sample=False, max_new_tokens=12, pad_token_id=PAD
    )
    for row, length in enumerate(lengths):
        alone_ids = ids[row : row + 1, ids.shape[1] - length :]
        alone_cache = kvlib.make_cache(model, "streaming_llm", budget=BUDGET)
        alone = model.generate(alone_ids, **cache_argument(alone_cache), do_sample=False, max_new_tokens=12, pad_token_id=PAD)
        assert torch.equal(batched[row, ids.shape[1] :], alone[0, length:])
        for layer in range(batched_cache.shape.num_layers):
            assert torch.equal(batched_cache.kept_positions(layer)[row], alone_cache.kept_positions(layer)[0])
        assert (batched_cache.kept_positions(0)[row, 0, :SINKS] == torch.arange(SINKS)).all()


def test_rows_under_budget_keep_all_real_tokens_and_drop_padding():
    model = build_model("llama")
    lengths = [6, 14, 30]  # the first two fit the budget: different physical lengths per row
    ids, mask = left_padded(lengths, seed=13)
    cache = kvlib.make_cache(model, "streaming_llm", budget=20)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
    kept = cache.kept_positions(0)
    assert ((kept >= 0).sum(-1) == torch.tensor([[6, 6], [14, 14], [20, 20]])).all()
    assert torch.equal(kept[0, 0, :6], torch.arange(6))
    assert cache.store.physical_lengths(0, cache._rows).tolist() == [[6, 6], [14, 14], [20, 20]]
    batched = model.generate(
        ids,
        attention_mask=mask,
        **cache_argument(kvlib.make_cache(model, "streaming_llm", budget=20)),
        do_sample=False,
        max_new_tokens=6,
        pad_token_id=PAD,
    )
    for row, length in enumerate(lengths):
        alone = model.generate(
            ids[row : row + 1, ids.shape[1] - length :],
            **cache_argument(kvlib.make_cache(model, "streaming_llm", budget=20)),
            do_sample=False,
            max_new_tokens=6,
            pad_token_id=PAD,
        )
        assert torch.equal(batched[row, ids.shape[1] :], alone[0, length:])


def test_fraction_budget_compresses_the_prompt_once():
    model = build_model("default")
    ids, _ = left_padded([40], seed=14)
    cache = kvlib.make_cache(model, "streaming_llm", budget=0.25)
    model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=8, pad_token_id=PAD)
    kept = cache.kept_positions(0)[0, 0]
    prompt_kept = list(range(SINKS)) + list(range(40 - (10 - SINKS), 40))
    assert kept.tolist() == prompt_kept + list(range(40, 47))
    report = cache.memory_report()
    assert report["stored_tokens"] < report["logical_tokens"]


@dataclass
class Probe(Eviction):
    """Test policy: records what the engine hands it and keeps the most recent tokens."""

    needs: ClassVar[frozenset[str]] = frozenset()
    seen: ClassVar[list[LayerView]] = []

    def score(self, view: LayerView) -> torch.Tensor:
        type(self).seen.append(view)
        return view.positions.to(torch.float32)


@dataclass
class NeedyProbe(Probe):
    """Probe that declares every need."""

    needs: ClassVar[frozenset[str]] = NEEDS


@pytest.fixture
def probes(scratch_registry):
    registry.register("probe")(Probe)
    registry.register("needy_probe")(NeedyProbe)
    Probe.seen = []
    NeedyProbe.seen = []
    return Probe, NeedyProbe


@pytest.mark.smoke
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_policies_get_exactly_what_they_need(probes, attn):
    probe, needy = probes
    model = build_model("llama", attn_implementation=attn)
    ids, mask = left_padded([10, 14], seed=15)
    for cls in (probe, needy):
        cache = kvlib.make_cache(model, cls(), budget=8)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **cache_argument(cache), output_attentions=attn == "eager")
    plain, rich = probe.seen[0], needy.seen[0]
    assert plain.queries is None and plain.attention is None and plain.hidden_states is None
    assert rich.queries.shape == (2, 4, 14, 8) and torch.equal(rich.window_queries, rich.queries)
    assert torch.equal(rich.query_positions[0], torch.cat([torch.full((4,), -1), torch.arange(10)]))
    assert torch.equal(rich.query_positions[1], torch.arange(14))
    assert rich.hidden_states.shape == (2, 14, 32)
    assert torch.equal(rich.rope.inv_freq, model.model.rotary_emb.inv_freq.float())
    attention = rich.attention
    assert attention.shape == (2, 4, 14, 14)
    real = mask.bool()
    assert torch.allclose(attention[1].sum(-1), torch.ones(4, 14), atol=1e-5)
    assert torch.allclose(attention[0][:, real[0]].sum(-1), torch.ones(4, 10), atol=1e-5)
    assert (attention[0][:, real[0]][..., ~real[0]] == 0).all()  # real queries give padding no weight
    assert (attention[0][:, ~real[0]] == 0).all()  # padding queries give nothing
    groups = attention.shape[1] // rich.keys.shape[1]
    expected = attention.sum(2).view(2, rich.keys.shape[1], groups, 14).mean(2)
    assert torch.allclose(rich.accumulated_attention, expected.masked_fill(~rich.valid, 0), atol=1e-6)
    assert not rich.valid[0, :, :4].any() and rich.valid[0, :, 4:].all()
    assert torch.equal(rich.positions[0, 0, 4:], torch.arange(10))


def test_a_score_of_the_wrong_shape_is_a_clear_error(probes, monkeypatch):
    probe, _ = probes
    monkeypatch.setattr(probe, "score", lambda self, view: torch.zeros(3))
    model = build_model("llama")
    cache = kvlib.make_cache(model, probe(), budget=4, slack=0)  # scored at once, not a page of tokens later
    with pytest.raises(ValueError, match="must return a tensor of shape"), torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]]), **cache_argument(cache))


def test_eviction_without_kvlib_attention_is_refused():
    model = build_model("llama")
    cache = kvlib.make_cache(model, "streaming_llm", budget=4)
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="kvlib.attach"), torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]]), **cache_argument(cache))


@pytest.mark.parametrize("options", [{"slack": 3}, {"interval": 4}], ids=["slack", "interval"])
def test_heads_grow_past_the_budget_then_compact_back(options):
    """slack 3: compact once a head holds more than budget + 3; interval 4: every 4th decode step."""
    model = build_model("llama")
    ids, _ = left_padded([30], seed=16)
    cache = kvlib.make_cache(model, "streaming_llm", budget=BUDGET, **options)
    held = []
    with torch.no_grad():
        out = model(input_ids=ids, **cache_argument(cache))
        held.append(int(cache.store.physical_lengths(0, cache._rows).max()))
        for _ in range(8):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), **cache_argument(cache))
            held.append(int(cache.store.physical_lengths(0, cache._rows).max()))
    assert held == [16, 17, 18, 19, 16, 17, 18, 19, 16]
    assert cache.kept_positions(0)[0, 0].tolist() == list(range(SINKS)) + list(range(38 - (BUDGET - SINKS), 38))


@pytest.mark.parametrize("budget", [0.25, 40])
def test_chunked_prefill_bounds_peak_pages_by_budget_plus_chunk(budget):
    model = build_model("default")
    shape = kvlib.model_shape.kv_shape(model)
    ids = torch.randint(1, 90, (1, 400), generator=torch.Generator().manual_seed(17))
    chunk, page = 32, 16
    caches = {}
    for chunk_size in (None, chunk):
        cache = caches[chunk_size] = kvlib.make_cache(model, "streaming_llm", budget=budget, read_cache=False)
        model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=4, pad_token_id=PAD, prefill_chunk_size=chunk_size)
    kept_tokens = 100 if isinstance(budget, float) else budget
    page_bytes = page * (shape.head_dim + shape.value_dim) * 4
    bound = shape.num_layers * shape.num_kv_heads * -(-(kept_tokens + chunk) // page) * page_bytes
    chunked, whole = caches[chunk].memory_report(), caches[None].memory_report()
    assert chunked["peak_pages_bytes"] <= bound < whole["peak_pages_bytes"]
    assert whole["peak_pages_bytes"] < whole["full_equivalent_bytes"]  # layers compact one after another
    for layer in range(shape.num_layers):
        assert torch.equal(caches[chunk].kept_positions(layer), caches[None].kept_positions(layer))


@dataclass
class AccumulatingProbe(Probe):
    """Probe that needs accumulated attention (the engine keeps it even when nothing is evicted)."""

    needs: ClassVar[frozenset[str]] = frozenset({"accumulated_attention"})


def test_accumulated_attention_sums_every_query_over_prefill_and_decoding(scratch_registry):
    registry.register("accumulating_probe")(AccumulatingProbe)
    model = build_model("llama", attn_implementation="eager")
    ids, _ = left_padded([12], seed=18)
    cache = kvlib.make_cache(model, AccumulatingProbe(), budget=64)
    reference = DynamicCache(config=model.config)
    expected = None
    with torch.no_grad():
        inputs = ids
        for _ in range(4):
            ours = model(input_ids=inputs, **cache_argument(cache))
            theirs = model(input_ids=inputs, **cache_argument(reference), output_attentions=True)
            received = [a.sum(2) for a in theirs.attentions]  # [batch, query_heads, slots] per layer
            if expected is None:
                expected = received
            else:
                expected = [torch.nn.functional.pad(e, (0, r.shape[-1] - e.shape[-1])) + r for e, r in zip(expected, received)]
            inputs = ours.logits[:, -1:].argmax(-1)
    kv_heads = cache.shape.num_kv_heads
    for layer, total in enumerate(expected):
        grouped = total.view(1, kv_heads, -1, total.shape[-1]).mean(2)
        state = cache.evictor._accumulated[layer]  # planned steps leave it room to grow, at 0
        assert torch.allclose(state[..., : grouped.shape[-1]], grouped, atol=1e-5) and (state[..., grouped.shape[-1] :] == 0).all()


def test_accumulated_attention_follows_beam_reordering(scratch_registry):
    registry.register("accumulating_probe")(AccumulatingProbe)
    model = build_model("llama")
    ids, _ = left_padded([12], seed=19)
    cache = kvlib.make_cache(model, AccumulatingProbe(), budget=8, slack=0)  # held to the token: 8 slots a head
    model.generate(ids, **cache_argument(cache), num_beams=3, do_sample=False, max_new_tokens=5, pad_token_id=PAD)
    for layer in range(cache.shape.num_layers):
        state = cache.evictor._accumulated[layer]
        lengths = cache.store.physical_lengths(layer, cache._rows)
        assert state.shape[0] == 3 and (lengths == 8).all()
        assert (state[..., :8] > 0).all() and (state[..., 8:] == 0).all()


@pytest.mark.parametrize("spec", ["h2o", "random", "snapkv"])
def test_on_a_sliding_layer_eviction_spends_its_budget_inside_the_window(spec: str) -> None:
    """Gemma 3's layer mix (window 16): after a 40-token prompt under a cap of 12, each sliding
    layer keeps 12 tokens, all among the 15 its window keeps (positions 25..39); no budget goes to
    a token the slide frees anyway. The global layer keeps 12 of the whole prompt. The windows come from
    ``make_evictor``, which the Engine's per-request evictors come from too."""
    from tests.adapters.conftest import GEMMA3_WINDOW

    model = build_model("gemma3")
    prompt = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = kvlib.make_cache(model, spec, budget=12)
    with torch.inference_mode():
        model(prompt, **cache_argument(cache), use_cache=True)
    windows = kvlib.model_shape.kv_shape(model).windows
    oldest_in_window = 40 - GEMMA3_WINDOW + 1
    for layer, window in enumerate(windows):
        kept = cache.kept_positions(layer)
        assert (kept >= 0).sum(-1).eq(12).all(), (layer, kept)
        if window is not None:
            assert bool((kept >= oldest_in_window).all()), (layer, kept)
    assert any(window is None for window in windows) and any(window is not None for window in windows)
