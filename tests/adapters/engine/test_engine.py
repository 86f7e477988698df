"""kvlib.Engine: exactness against ``model.generate`` alone, whatever the batch mix, arrival order,
chunk size, page budget (preemption in both modes) and prefix sharing; per-request eviction;
aborts, errors and page accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvlib
from kvlib.adapters.engine.engine_request import RequestState
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model

NEW = 6


def prompts_with_shared_prefix(vocab: int, seed: int = 0) -> list[list[int]]:
    """Seven prompts: five share a 37-token system prompt (two share 3 more pages), two do not."""
    generator = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    system, document = draw(37), draw(48)
    return [
        system + draw(5),
        system + draw(40),
        draw(17),
        system + document + draw(3),
        system + document + draw(9),
        draw(1),
        system + draw(20),
    ]


def alone(model: torch.nn.Module, prompt: list[int], new: int = NEW) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def pages_held(engine: kvlib.Engine) -> int:
    """Pages in use once the prefix index lets go of everything it caches."""
    if engine.prefix is not None:
        engine.prefix.index.clear()
    return sum(pool.pages_in_use for pool in engine.store.pools)


def page_bytes(model: torch.nn.Module, page_size: int = 16) -> int:
    """Bytes of one page of every layer (keys and values of one KV head)."""
    shape = kvlib.model_shape.kv_shape(model)
    return shape.num_layers * page_size * (shape.head_dim + shape.value_dim) * next(model.parameters()).element_size()


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return build_model("llama")


@pytest.fixture(scope="module")
def llama_case(llama) -> tuple[list[list[int]], list[list[int]]]:
    prompts = prompts_with_shared_prefix(97)
    return prompts, [alone(llama, p) for p in prompts]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_batch_tokens": 8},
        {"max_batch_tokens": 24, "page_size": 4},
        {"prefix_cache": False, "max_batch_tokens": 64},
        {"read_cache": True},
    ],
    ids=["defaults", "chunks-of-8", "pages-of-4", "no-prefix-cache", "read-mirror"],
)
def test_greedy_outputs_equal_generate_alone(llama, llama_case, options) -> None:
    prompts, expected = llama_case
    engine = kvlib.Engine(llama, **options)
    assert engine.generate(prompts, max_new_tokens=NEW) == expected
    assert pages_held(engine) == 0


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_a_tight_page_budget_preempts_and_stays_exact(llama, llama_case, preemption) -> None:
    prompts, expected = llama_case
    budget = 10 * 2 * page_bytes(llama)  # 20 pages per layer: the longest request needs 14
    engine = kvlib.Engine(llama, page_budget_bytes=budget, max_batch_tokens=32, preemption=preemption, reserve_pages=0)
    # queued all at once (no prefix grouping, which would queue them a group at a time), they preempt each other
    assert engine.generate(prompts, max_new_tokens=NEW, group_prefixes=False) == expected
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert max(pool.capacity for pool in engine.store.pools) == 20  # fixed pools: the budget, never grown
    assert pages_held(engine) == 0


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_forecast_admission_stays_exact_and_learns_the_output_lengths(llama, llama_case, preemption) -> None:
    prompts, expected = llama_case
    budget = 10 * 2 * page_bytes(llama)
    engine = kvlib.Engine(llama, page_budget_bytes=budget, max_batch_tokens=32, preemption=preemption, admission="forecast")
    assert engine.generate(prompts, max_new_tokens=NEW, group_prefixes=False) == expected
    assert len(engine.scheduler.lengths) == len(prompts)  # each finished request's output length
    assert pages_held(engine) == 0
    with pytest.raises(ValueError, match=r"^admission must be one of \('reserve', 'forecast'\), got 'peak'$"):
        kvlib.Engine(llama, admission="peak")
    with pytest.raises(ValueError, match=r"^forecast_quantile must be a number in \(0, 1\], got 0$"):
        kvlib.Engine(llama, admission="forecast", forecast_quantile=0)


def test_requests_arriving_while_others_run(llama, llama_case) -> None:
    prompts, expected = llama_case
    engine = kvlib.Engine(llama, max_batch_tokens=16)
    ids = {}
    order = [3, 0, 5, 1, 6, 2, 4]
    for step, index in enumerate(order):
        ids[index] = engine.add_request(prompts[index], max_new_tokens=NEW)
        for _ in range(step % 3):
            engine.step()
    streamed: dict[int, list[int]] = {i: [] for i in ids.values()}
    while engine.has_unfinished:
        for request_id, tokens in engine.step().items():
            streamed[request_id].extend(tokens)
    for index, request_id in ids.items():
        assert engine.requests[request_id].output == expected[index]
        assert engine.request_stats(request_id)["state"] == "finished"
    assert sum(len(t) for t in streamed.values()) == sum(NEW - len(engine.requests[i].output) + len(t) for i, t in streamed.items())


def test_shared_prefixes_are_computed_once(llama, llama_case) -> None:
    prompts, _ = llama_case
    engine = kvlib.Engine(llama)
    engine.generate(prompts, max_new_tokens=NEW)
    stats = engine.stats()
    # five prompts share 2 full pages of the system prompt; two of them 3 more of the document
    assert stats["cached_tokens"] == 4 * 32 + 3 * 16
    assert stats["prefix_hit_rate"] == pytest.approx(stats["cached_tokens"] / sum(len(p) for p in prompts))
    assert stats["forward_tokens"] == sum(len(p) for p in prompts) - stats["cached_tokens"] + len(prompts) * (NEW - 1)


def test_a_later_request_reuses_an_earlier_requests_output(llama) -> None:
    """Multi-turn: the next turn's prompt holds the previous prompt and answer."""
    prompt = prompts_with_shared_prefix(97)[1]
    engine = kvlib.Engine(llama, page_size=4)
    (answer,) = engine.generate([prompt], max_new_tokens=12)
    turn = prompt + answer + [5, 6, 7]
    (second,) = engine.generate([turn], max_new_tokens=NEW)
    assert second == alone(llama, turn)
    assert engine.request_stats(1)["cached_tokens"] == (len(prompt) + 11) // 4 * 4


def test_a_recomputed_block_pins_no_second_copy(llama, llama_case) -> None:
    """A request that computes blocks the index holds on other pages (here: the prompt's first
    block was evicted, so the lookup found nothing) holds only its own pages: the index's copies
    stay unused and reclaimable, so a request alone never holds more pages than its tokens fill."""
    prompt = llama_case[0][1]  # 77 tokens: 19 full pages of 4
    engine = kvlib.Engine(llama, page_size=4, max_batch_tokens=128)
    engine.generate([prompt], max_new_tokens=NEW, group_prefixes=False)  # grouped, its last block would be the oldest
    index = engine.prefix.index
    assert index.evict_oldest()  # the first block (the oldest unused entry): later lookups miss at once
    request_id = engine.add_request(prompt, max_new_tokens=NEW)
    engine.step()  # the whole prompt computed again, its full pages indexed
    request = engine.requests[request_id]
    own = engine.store.tables[0].referenced_pages(torch.tensor([request.seq]))
    assert request.cached_tokens == 0 and len(request.entries) >= 1
    assert all(bool(torch.isin(entry.pages[1][0].flatten(), own).all()) for entry in request.entries)
    first_run = (len(prompt) + NEW - 1) // 4  # full pages the first run indexed (prompt and output)
    assert engine.stats()["prefix_cache"]["unused_entries"] == first_run - 1  # its copies, all but the evicted first
    while engine.has_unfinished:
        engine.step()
    assert request.output == llama_case[1][1]


@pytest.mark.parametrize("family", ["qwen2", "gpt2", "default"])
def test_other_families_stay_exact(family) -> None:
    model = build_model(family)
    prompts = prompts_with_shared_prefix(model.config.vocab_size, seed=1)[:5]
    engine = kvlib.Engine(model, max_batch_tokens=32)
    assert engine.generate(prompts, max_new_tokens=NEW) == [alone(model, p) for p in prompts]


def test_eager_attention_stays_exact() -> None:
    model = build_model("llama", attn_implementation="eager")
    prompts = prompts_with_shared_prefix(97, seed=2)[:4]
    assert kvlib.Engine(model, max_batch_tokens=16).generate(prompts, max_new_tokens=NEW) == [alone(model, p) for p in prompts]


def test_a_request_with_eviction_runs_beside_a_lossless_one(llama) -> None:
    prompts = prompts_with_shared_prefix(97, seed=3)
    long_prompt, other = prompts[4], prompts[1]
    engine = kvlib.Engine(llama)
    evicting = engine.add_request(long_prompt, max_new_tokens=NEW, spec="streaming_llm", budget=24)
    lossless = engine.add_request(other, max_new_tokens=NEW)
    while engine.has_unfinished:
        engine.step()
    cache = kvlib.make_cache(llama, "streaming_llm", budget=24)
    reference = llama.generate(
        torch.tensor([long_prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0, **cache_argument(cache)
    )
    assert engine.requests[evicting].output == reference[0, len(long_prompt) :].tolist()
    assert engine.requests[lossless].output == alone(llama, other)
    assert pages_held(engine) == 0


def dense_reads_while_decoding(engine: kvlib.Engine, requests: list[tuple[list[int], dict]]) -> tuple[list[list[int]], list[int]]:
    """Serve ``requests`` (prompt, add_request options); returns the sequences of every dense read
    of the store made once every request has its first token (only decode steps run then), and
    each request's sequence id then."""
    ids = [engine.add_request(prompt, max_new_tokens=NEW, **options) for prompt, options in requests]
    while any(not engine.requests[i].output for i in ids):
        engine.step()
    seqs = [engine.requests[i].seq for i in ids]
    reads, original = [], engine.store.read
    engine.store.read = lambda layer, rows, **options: reads.append(list(rows)) or original(layer, rows, **options)
    while engine.has_unfinished:
        engine.step()
    return reads, seqs


def test_decode_steps_attend_over_the_pages_without_a_dense_read(llama, llama_case) -> None:
    prompts, expected = llama_case
    engine = kvlib.Engine(llama)
    reads, _ = dense_reads_while_decoding(engine, [(prompt, {}) for prompt in prompts])
    assert reads == []
    assert [request.output for request in engine.requests.values()] == expected
    report = engine.memory_report()
    assert report["by_component"]["read_cache"] == 0
    assert report["peak_workspace_bytes"] > 0  # the prefill chunks' transient dense copies, not held
    assert report["total_bytes"] == sum(report["by_component"].values())


@pytest.mark.parametrize("spec", ["streaming_llm", "h2o", "snapkv", "knorm"])
def test_decode_steps_read_densely_only_the_rows_whose_policy_reads_keys(llama, spec) -> None:
    """Evicting rows score over their pages (positions, attention weights from the pages) unless
    their policy reads keys or values (knorm): then that row alone is read densely."""
    prompts = prompts_with_shared_prefix(97, seed=3)
    engine = kvlib.Engine(llama)
    options = {"spec": spec, "budget": 24, "slack": 0}  # a compaction every decode step
    reads, (evicting, _) = dense_reads_while_decoding(engine, [(prompts[4], options), (prompts[1], {})])
    if kvlib.parse_policy(spec).reads_kv:
        assert reads and all(seqs == [evicting] for seqs in reads)
    else:
        assert reads == []
    cache = kvlib.make_cache(llama, spec, budget=24, slack=0)
    reference = llama.generate(
        torch.tensor([prompts[4]]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0, **cache_argument(cache)
    )
    assert engine.requests[0].output == reference[0, len(prompts[4]) :].tolist()
    assert engine.requests[1].output == alone(llama, prompts[1])


def test_sampling_is_reproducible_per_seed(llama) -> None:
    prompt = prompts_with_shared_prefix(97)[0]
    runs = []
    for _ in range(2):
        engine = kvlib.Engine(llama)
        runs.append(engine.generate([prompt, prompt], max_new_tokens=8, do_sample=True, temperature=1.5, seed=7))
    assert runs[0] == runs[1]
    greedy_by_top_k = kvlib.Engine(llama).generate([prompt], max_new_tokens=NEW, do_sample=True, top_k=1, seed=1)
    assert greedy_by_top_k == [alone(llama, prompt)]


def test_abort_releases_pages_at_once(llama, llama_case) -> None:
    prompts, expected = llama_case
    engine = kvlib.Engine(llama, max_batch_tokens=16, prefix_cache=False)
    first = engine.add_request(prompts[1], max_new_tokens=NEW)
    second = engine.add_request(prompts[3], max_new_tokens=NEW)
    engine.step()
    engine.abort(first)
    assert engine.requests[first].state is RequestState.ABORTED
    while engine.has_unfinished:
        engine.step()
    assert engine.requests[second].output == expected[3]
    assert pages_held(engine) == 0


def test_end_of_sequence_ends_a_request(llama, llama_case) -> None:
    prompts, expected = llama_case
    eos = expected[0][2]
    (output,) = kvlib.Engine(llama).generate([prompts[0]], max_new_tokens=NEW, eos_token_id=eos)
    assert output == expected[0][: expected[0].index(eos) + 1]


def test_metrics(llama, llama_case) -> None:
    prompts, _ = llama_case
    engine = kvlib.Engine(llama)
    engine.generate(prompts[:3], max_new_tokens=NEW)
    stats = engine.request_stats(0)
    assert stats["output_tokens"] == NEW and stats["ttft_s"] > 0 and len(stats["tbt_s"]) == NEW - 1
    totals = engine.stats()
    assert totals["output_tokens"] == 3 * NEW and totals["tokens_per_s"] > 0 and totals["steps"] >= NEW


def test_bad_input_is_refused_before_any_work(llama) -> None:
    engine = kvlib.Engine(llama, page_budget_bytes=4 * 2 * page_bytes(llama))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([])
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 97])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="page budget"):
        engine.add_request([1] * 100, max_new_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request([1, 2], do_sample=True, top_p=0)
    with pytest.raises(ValueError, match="needs a budget"):
        engine.add_request([1, 2], spec="snapkv")
    with pytest.raises(ValueError, match="per request"):
        engine.add_request([1, 2], spec="kivi(bits=4)")
    with pytest.raises(ValueError, match=r"^budget=8 without spec: a request's budget goes with its own eviction spec"):
        engine.add_request([1, 2], budget=8)
    with pytest.raises(ValueError, match=r"budget as a token count must be at most 4294967296"):
        engine.add_request([1, 2], spec="streaming_llm", budget=2**40)
    with pytest.raises(ValueError, match="unknown request"):
        engine.abort(99)
    assert not engine.has_unfinished and engine.requests == {}
    engine.abort(engine.add_request([1, 2], spec="streaming_llm", budget=np.int64(8)))  # numpy scalars are budgets
    with pytest.raises(ValueError, match="preemption"):
        kvlib.Engine(llama, preemption="drop")
    with pytest.raises(ValueError, match="page_budget_bytes"):
        kvlib.Engine(llama, page_budget_bytes=10)


def test_requests_are_bounded_by_the_models_context_and_checked_before_any_is_queued(llama) -> None:
    engine = kvlib.Engine(llama)  # max_position_embeddings 2048
    for prompt, new in (([5] * 5001, 1), ([5] * 2040, 10), ([5] * 10, 10**12)):
        with pytest.raises(
            ValueError, match=rf"a request of {len(prompt)} prompt \+ {new} new tokens is longer than the model's context of 2048"
        ):
            engine.add_request(prompt, max_new_tokens=new)
    bad = [
        ({"seed": "abc", "do_sample": True}, r"seed must be None or an int in \[0, 2\*\*63\)"),
        ({"seed": 2**80, "do_sample": True}, "seed must be"),
        ({"temperature": "hot", "do_sample": True}, "temperature must be a finite number > 0"),
        ({"temperature": float("nan"), "do_sample": True}, "temperature"),
        ({"top_p": 2}, r"top_p must be a number in \(0, 1\]"),
        ({"top_k": 1.5}, "top_k"),
        ({"max_new_tokens": "5"}, "max_new_tokens must be an int"),
        ({"eos_token_id": "abc"}, "eos_token_id must be None, a token id or token ids"),
        ({"eos_token_id": [1, 97]}, "eos_token_id"),
    ]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request([5, 6], **options)
    with pytest.raises(ValueError, match="1-D sequence"):
        engine.add_request(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="a request of 3000 prompt"):
        engine.generate([[5] * 3, [5] * 3000], max_new_tokens=4)  # the second prompt: the first is not queued either
    with pytest.raises(ValueError, match="unknown options"):
        engine.generate([[5] * 3], temprature=0.5)
    assert engine.requests == {} and not engine.has_unfinished
    assert len(engine.generate([[5] * 2040], max_new_tokens=8)[0]) == 8  # the whole context is fine


def test_decode_attention_equals_sdpa() -> None:
    from kvlib.adapters.engine.packed_batch import decode_attention

    generator = torch.Generator().manual_seed(0)
    query, keys, values = (
        torch.randn(3, 4, 1, 8, generator=generator),
        torch.randn(3, 2, 10, 8, generator=generator),
        torch.randn(3, 2, 10, 6, generator=generator),
    )
    visible = torch.rand(3, 4, 1, 10, generator=generator) > 0.3
    visible[..., 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1), attn_mask=visible, scale=0.3
    ).transpose(1, 2)
    torch.testing.assert_close(decode_attention(query, keys, values, visible, 0.3), expected)
    shared = visible[:, :1]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1), attn_mask=shared
    ).transpose(1, 2)
    torch.testing.assert_close(decode_attention(query, keys, values, shared, None), expected)


def test_an_engine_wide_codec_equals_make_cache_with_it(llama, llama_case) -> None:
    prompts, expected = llama_case
    engine = kvlib.Engine(llama, "kivi(bits=4)")
    outputs = engine.generate(prompts[:4], max_new_tokens=NEW)
    for prompt, output in zip(prompts[:4], outputs):
        cache = kvlib.make_cache(llama, "kivi(bits=4)")
        reference = llama.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0, **cache_argument(cache)
        )
        assert output == reference[0, len(prompt) :].tolist()
    assert engine.stats()["cached_tokens"] > 0  # sealed pages are shared like raw ones
    with pytest.raises(ValueError, match="engine-wide|every request"):
        engine.add_request([1, 2], spec="int8")
    with pytest.raises(ValueError, match="fits itself"):
        kvlib.Engine(llama, "svd(rank=4)")
    with pytest.raises(ValueError, match="fits itself to each prompt's first call"):  # an uncalibrated SQuat would stay raw
        kvlib.Engine(llama, "squat")


def test_an_engine_wide_codec_with_default_eviction(llama, llama_case) -> None:
    prompts, _ = llama_case
    engine = kvlib.Engine(llama, "streaming_llm+int8", budget=24, page_budget_bytes=40 * 2 * page_bytes(llama))
    outputs = engine.generate(prompts[:3], max_new_tokens=NEW)
    assert all(len(output) == NEW for output in outputs)
    assert engine.requests[0].evictor is not None and pages_held(engine) == 0


def refuse_to_build(*args, **kwargs):
    raise AssertionError("a store was built")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"page_size": 10**6}, r"^page_size=1000000 is over the limit of 4096 tokens per page"),
        (
            {"page_budget_bytes": 2**60},
            r"^page_budget_bytes=1152921504606846976 would allocate \d+ bytes .* on cpu up front,"
            r" more than the \d+ bytes .* available there",
        ),
        (
            {"page_budget_bytes": 2**20, "prefix_cache_bytes": 2**21},
            r"^prefix_cache_bytes=2097152 is more than page_budget_bytes=1048576: the cached pages live in the page budget",
        ),
        (
            {"prefix_cache_bytes": 2**60},
            r"^prefix_cache_bytes=1152921504606846976 \(cached pages, no page budget\) would"
            r" allocate",
        ),
        ({"prefix_cache_bytes": -1}, r"^prefix_cache_bytes must be an int >= 0 \(bytes\) or None, got -1"),
        ({"budget": 8}, r"^budget=8 needs an eviction policy in the spec"),
        ({"spec": "kivi(bits=4)", "budget": 8}, r"^budget=8 needs an eviction policy in the spec"),
        ({"spec": "streaming_llm", "budget": 2**40}, r"budget as a token count must be at most 4294967296"),
    ],
    ids=[
        "page-size",
        "page-budget",
        "prefix-over-page-budget",
        "prefix-budget",
        "negative-prefix",
        "budget-alone",
        "budget-with-a-codec",
        "huge-budget",
    ],
)
def test_bad_engine_sizes_fail_before_anything_is_allocated_or_run(monkeypatch, options, message) -> None:
    model = build_model("llama")
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    monkeypatch.setattr("kvlib.adapters.engine.kv_manager.PagedStore", refuse_to_build)
    monkeypatch.setattr("kvlib.adapters.engine.kv_manager.PrefixStore", refuse_to_build)
    with pytest.raises(ValueError, match=message):
        kvlib.Engine(model, **options)
    assert calls == [] and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_drained_engine_gives_back_its_read_mirror_and_table_rows(llama, llama_case, prefix_cache) -> None:
    prompts, expected = llama_case
    engine = kvlib.Engine(llama, prefix_cache=prefix_cache, read_cache=True)
    baseline = engine.stats()["memory_bytes"]
    ids = [engine.add_request(prompt, max_new_tokens=NEW) for prompt in prompts]
    busiest = {"tables": 0, "read_cache": 0}
    while engine.has_unfinished:
        engine.step()
        memory = engine.stats()["memory_bytes"]
        busiest = {part: max(busiest[part], memory[part]) for part in busiest}
    assert [engine.requests[i].output for i in ids] == expected
    drained = engine.stats()["memory_bytes"]
    assert busiest["tables"] > baseline["tables"] and busiest["read_cache"] > 0
    assert drained["tables"] == baseline["tables"] and drained["read_cache"] == 0
    if not prefix_cache:  # no index holding pages: every component but the arenas is back at the start
        assert drained == {**baseline, "reserved": drained["reserved"]}


def test_finished_requests_are_released_so_a_long_running_engine_stays_bounded(llama) -> None:
    """Over 600 requests, ``requests`` never holds more than the running ones and ``max_finished``
    finished ones (each finished request held about 0.7 KB forever before); ``collect`` hands a
    finished request's output over and forgets it; ``generate`` returns every output whatever the bound."""
    engine = kvlib.Engine(llama, max_batch_tokens=64, max_finished=8)
    largest, collected = 0, {}
    for i in range(600):
        request = engine.add_request([3 + i % 90, 5, 7], max_new_tokens=2)
        engine.step()
        largest = max(largest, len(engine.requests))
        if i % 100 == 0:
            while engine.requests[request].state is not RequestState.FINISHED:
                engine.step()
            collected[request] = engine.collect(request)
            with pytest.raises(ValueError, match="unknown request id"):
                engine.collect(request)
    while engine.has_unfinished:
        engine.step()
    assert largest <= 8 + engine.scheduler.max_running and len(engine.requests) == 8 and len(engine._finished) == 8
    assert all(output == alone(llama, [3 + i % 90, 5, 7], new=2) for i, output in zip(range(0, 600, 100), collected.values()))
    running = engine.add_request([3, 5, 7], max_new_tokens=4)
    with pytest.raises(ValueError, match="collect it once it has finished"):
        engine.collect(running)
    outputs = kvlib.Engine(llama, max_finished=0).generate([[3, 5, 7], [4, 6, 8]], max_new_tokens=3)
    assert outputs == [alone(llama, [3, 5, 7], new=3), alone(llama, [4, 6, 8], new=3)]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_finished"):
            kvlib.Engine(llama, max_finished=bad)
