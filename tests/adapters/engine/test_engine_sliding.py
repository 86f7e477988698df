"""kvlib.Engine on sliding-window models: Gemma 3's mix (five sliding layers to each global one),
Mistral (every layer slides) and Qwen2 with ``use_sliding_window`` (a full layer, then a sliding
one). Each request's greedy output equals ``model.generate`` on its prompt alone (prompts past
the window, chunks crossing it, pages of 4, a read mirror, eager attention, preemption by swap
and recompute, random schedules); between steps a sliding layer holds only the ``window - 1``
positions before a request's next token while a full layer holds all of them; per-request
eviction and an engine-wide codec equal the drop-in cache with the same spec; what the Engine
cannot serve is refused in one line."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Llama4ForCausalLM, Llama4TextConfig, Qwen2Config, Qwen2ForCausalLM

import kvlib
from kvlib.model_shape import kv_shape
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import GEMMA3_WINDOW, build_model
from tests.adapters.engine.test_engine import alone, page_bytes
from tests.adapters.engine.test_engine_schedules import references_match_holders

NEW = 8
WINDOW = GEMMA3_WINDOW
SLIDING = [0, 1, 2, 3, 4]
"""The sliding layers of the ``gemma3`` test family; layer 5 is global."""


def draw_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=generator).tolist() for n in lengths]


def with_spec(model: torch.nn.Module, prompt: list[int], spec: str | None, budget: int | None = None) -> list[int]:
    """Greedy new tokens of ``model.generate`` on ``prompt`` alone with the drop-in cache of ``spec``."""
    cache = kvlib.make_cache(model, spec, budget=budget)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0, **cache_argument(cache)
    )
    return out[0, len(prompt) :].tolist()


def window_is_all_a_sliding_layer_holds(engine: kvlib.Engine) -> None:
    """Between steps, each running request's sequence holds, in every sliding layer, exactly the
    positions ``computed - window + 1 .. computed - 1`` (all it has computed, below the window)
    in as few pages as they fill, and in every other layer all ``computed`` of its tokens."""
    store, shape = engine.store, engine.shape
    for request in engine.scheduler.running:
        seq, computed = [request.seq], request.computed
        for layer in range(store.num_layers):
            window = shape.window(layer)
            kept = computed if window is None else min(computed, window - 1)
            positions = store.stored_positions(layer, seq)[0]
            assert store.physical_lengths(layer, seq).tolist() == [[kept] * positions.shape[0]]
            for head in positions:
                assert sorted(head[head >= 0].tolist()) == list(range(computed - kept, computed)), (request.request_id, layer)
            pages = store.tables[layer].referenced_pages(torch.tensor(seq))
            assert len(pages) == positions.shape[0] * math.ceil(kept / engine.page_size)
    for layer, pool in enumerate(store.pools):  # no prefix cache on a sliding model: the running requests hold every page
        rows = torch.tensor([request.seq for request in engine.scheduler.running], dtype=torch.int64)
        assert pool.pages_in_use == len(store.tables[layer].referenced_pages(rows).unique())


@pytest.fixture(scope="module")
def gemma3() -> torch.nn.Module:
    return build_model("gemma3")


@pytest.fixture(scope="module")
def gemma3_case(gemma3) -> tuple[list[list[int]], list[list[int]]]:
    """Five prompts of different lengths, three past the window of 16."""
    prompts = draw_prompts([5, 23, 40, 61, 9])
    return prompts, [alone(gemma3, prompt, NEW) for prompt in prompts]


def test_gemma3s_windows_are_the_engines() -> None:
    engine = kvlib.Engine(build_model("gemma3"))
    assert engine.shape.windows == (WINDOW,) * 5 + (None,)
    assert engine.prefix is None and engine.stats()["prefix_cache"] is None  # no prefix cache on a sliding model


@pytest.mark.parametrize(
    "options",
    [{}, {"max_batch_tokens": 8}, {"max_batch_tokens": 24, "page_size": 4}, {"read_cache": True}],
    ids=["defaults", "chunks-of-8", "pages-of-4", "read-mirror"],
)
def test_gemma3_greedy_outputs_equal_generate_alone(gemma3, gemma3_case, options) -> None:
    prompts, expected = gemma3_case
    engine = kvlib.Engine(gemma3, **options)
    assert engine.generate(prompts, max_new_tokens=NEW) == expected
    assert sum(pool.pages_in_use for pool in engine.store.pools) == 0


def test_gemma3_with_eager_attention_stays_exact() -> None:
    model = build_model("gemma3", attn_implementation="eager")
    prompts = draw_prompts([30, 7, 45], seed=1)
    assert kvlib.Engine(model, max_batch_tokens=16).generate(prompts, max_new_tokens=NEW) == [alone(model, p, NEW) for p in prompts]


def qwen2_sliding() -> torch.nn.Module:
    """Qwen2 with ``use_sliding_window``: layer 0 full (``max_window_layers=1``), layer 1 over 8 tokens."""
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config = Qwen2Config(**sizes, vocab_size=97, pad_token_id=0, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model.eval()


@pytest.mark.parametrize(("family", "windows"), [("mistral", (8, 8)), ("qwen2-sliding", (None, 8))])
def test_mistral_and_qwen2_windows_stay_exact(family, windows) -> None:
    model = qwen2_sliding() if family == "qwen2-sliding" else build_model(family)
    assert kv_shape(model).windows == windows
    prompts = draw_prompts([20, 3, 33, 12], seed=2)
    engine = kvlib.Engine(model, max_batch_tokens=12, page_size=4)
    assert engine.kv.every_layer_slides == (None not in windows)
    assert engine.generate(prompts, max_new_tokens=NEW) == [alone(model, p, NEW) for p in prompts]


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_a_tight_page_budget_preempts_and_stays_exact(gemma3, gemma3_case, preemption) -> None:
    prompts = gemma3_case[0]
    budget = 7 * page_bytes(gemma3)  # 7 pages per layer (one KV head): the longest request needs 6 in its global layer
    engine = kvlib.Engine(gemma3, page_budget_bytes=budget, max_batch_tokens=16, preemption=preemption, reserve_pages=0)
    outputs = engine.generate(prompts, max_new_tokens=24, group_prefixes=False)
    assert outputs == [alone(gemma3, prompt, 24) for prompt in prompts]
    assert engine.stats()["preemptions"] > 0
    assert all(pool.capacity == 7 for pool in engine.store.pools)
    assert sum(pool.pages_in_use for pool in engine.store.pools) == 0


def test_sliding_layers_hold_only_their_window(gemma3) -> None:
    """A long generation, chunked, several requests at once: after every step each sliding layer
    holds at most ``window - 1 = 15`` tokens (one page of 16) per request, the global layer all."""
    prompts = draw_prompts([50, 21, 9], seed=3)
    engine = kvlib.Engine(gemma3, max_batch_tokens=20)
    ids = [engine.add_request(prompt, max_new_tokens=40) for prompt in prompts]
    most = [0] * engine.store.num_layers
    while engine.has_unfinished:
        engine.step()
        window_is_all_a_sliding_layer_holds(engine)
        for layer, pool in enumerate(engine.store.pools):
            most[layer] = max(most[layer], pool.pages_in_use)
    assert most[: len(SLIDING)] == [len(prompts)] * len(SLIDING)  # one page (15 tokens at most) per request
    assert most[5] > 3 * len(prompts)  # the global layer: every token, up to 89 of the longest request
    for request_id, prompt in zip(ids, prompts):
        reference = gemma3.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert engine.requests[request_id].output == reference[0, len(prompt) :].tolist()


@pytest.mark.parametrize("spec", ["streaming_llm", "snapkv", "knorm"])
def test_eviction_on_a_sliding_model_equals_the_drop_in_cache(gemma3, spec) -> None:
    """Per-request eviction chooses among the tokens each window keeps, as the drop-in cache does:
    two evicting requests (their prompts in one chunk each) beside a lossless one."""
    prompts = draw_prompts([61, 40, 23], seed=4)
    engine = kvlib.Engine(gemma3)
    ids = [engine.add_request(prompt, max_new_tokens=NEW, spec=spec, budget=24) for prompt in prompts[:2]]
    ids.append(engine.add_request(prompts[2], max_new_tokens=NEW))
    while engine.has_unfinished:
        engine.step()
    expected = [with_spec(gemma3, prompt, spec, 24) for prompt in prompts[:2]] + [alone(gemma3, prompts[2], NEW)]
    assert [engine.requests[i].output for i in ids] == expected


def test_an_engine_wide_codec_equals_make_cache_with_it(gemma3, gemma3_case) -> None:
    prompts = gemma3_case[0][1:4]
    engine = kvlib.Engine(gemma3, "kivi(bits=4)", max_batch_tokens=32)
    assert engine.generate(prompts, max_new_tokens=NEW) == [with_spec(gemma3, prompt, "kivi(bits=4)") for prompt in prompts]


@pytest.fixture(scope="module")
def mistral_case() -> tuple[torch.nn.Module, list[list[int]], list[list[int]]]:
    model = build_model("mistral")
    prompts = draw_prompts([31, 5, 18, 1, 40], seed=5)
    return model, prompts, [alone(model, prompt, 4) for prompt in prompts]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10)), min_size=1, max_size=6),
    max_batch_tokens=st.integers(2, 48),
    page_size=st.sampled_from([4, 8]),
    spare_pages=st.integers(0, 16),
    preemption=st.sampled_from(["swap", "recompute"]),
)
def test_random_schedules_of_a_model_that_slides_every_layer(
    mistral_case, arrivals, max_batch_tokens, page_size, spare_pages, preemption
) -> None:
    """Mistral (both layers slide over 8 tokens): pages are counted from what each sequence holds,
    and every request still finishes exactly, every page reference matches its holders, the window
    holds after every step and nothing is left at the end."""
    model, prompts, expected = mistral_case
    largest = max(len(prompts[index]) for index, _ in arrivals) + 4
    pages = 2 * math.ceil(largest / page_size) + spare_pages  # two KV heads
    engine = kvlib.Engine(
        model,
        max_batch_tokens=max_batch_tokens,
        page_size=page_size,
        page_budget_bytes=pages * page_bytes(model, page_size),
        preemption=preemption,
        reserve_pages=0,
    )
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][1])
    ids: dict[int, int] = {}
    step = 0
    while pending or engine.has_unfinished:
        while pending and pending[0][1][1] <= step:
            order, (index, _) = pending.pop(0)
            ids[order] = engine.add_request(prompts[index], max_new_tokens=4)
        engine.step()
        references_match_holders(engine)
        window_is_all_a_sliding_layer_holds(engine)
        step += 1
        assert step < 3000, "the engine stopped making progress"
    assert [engine.requests[ids[order]].output for order in range(len(arrivals))] == [expected[index] for index, _ in arrivals]
    assert sum(pool.pages_in_use for pool in engine.store.pools) == 0


def test_what_the_engine_cannot_serve_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^remote holds prefix-cache pages, and the engine keeps no prefix cache for Gemma3ForCausalLM"):
        kvlib.Engine(build_model("gemma3"), remote="redis://127.0.0.1:1/0", remote_trust="any-writer")
    sizes = dict(vocab_size=97, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4)
    config = Llama4TextConfig(
        **sizes, num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_chunk_size=8, num_local_experts=1
    )
    with pytest.raises(
        ValueError, match=r"^the engine serves full-attention and sliding-window layers; Llama4ForCausalLM has chunked_attention"
    ):
        kvlib.Engine(Llama4ForCausalLM(config).eval())
