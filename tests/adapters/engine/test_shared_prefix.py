"""Shared-prefix attention in the Engine's decode group (``Engine(shared_prefix=0)``: split wherever
pages are shared; the default splits only a saving of ``MIN_SAVED_READS`` reads): greedy outputs per request equal the Engine with it off, on Llama, Qwen2, GPT-2 and the
embedded model, with groups of 2-8 requests sharing prompts of several page counts (one ending
mid-page) beside requests sharing nothing; the K/V bytes the decode groups read drop by exactly
the shared pages read once per group; eviction rows, codecs, sliding-window models and the read
mirror keep their outputs; a bad option value is refused in one line."""

from __future__ import annotations

import pytest
import torch

import kvlib
from tests.adapters.conftest import build_model, prompt_vocab

NEW = 8


def draw(generator: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=generator).tolist()


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Nine prompts: three share a 37-token system prompt (two full pages of 16, then mid-page),
    four share a 48-token prompt (three pages), two of those 32 more (five pages), two share nothing."""
    generator = torch.Generator().manual_seed(seed)
    system, long, document = draw(generator, vocab, 37), draw(generator, vocab, 48), draw(generator, vocab, 32)
    return [
        system + draw(generator, vocab, 3),
        draw(generator, vocab, 5),
        system + draw(generator, vocab, 11),
        long + draw(generator, vocab, 1),
        long + document + draw(generator, vocab, 4),
        system + draw(generator, vocab, 20),
        long + draw(generator, vocab, 9),
        draw(generator, vocab, 30),
        long + document + draw(generator, vocab, 6),
    ]


def served(model: torch.nn.Module, prompts: list[list[int]], **options) -> tuple[list[list[int]], int]:
    """Each prompt's greedy output from an Engine with ``options``, and the K/V bytes its decode groups read."""
    engine = kvlib.Engine(model, **{"shared_prefix": 0, **options})  # split wherever pages are shared: small models save few reads
    outputs = engine.generate(prompts, max_new_tokens=NEW)
    return outputs, engine.stats()["kv_read_bytes"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2", "default"])
def family_model(request) -> tuple[str, torch.nn.Module]:
    return request.param, build_model(request.param)


def test_greedy_outputs_equal_the_engine_without_it(family_model) -> None:
    family, model = family_model
    prompts = mixed_prompts(prompt_vocab(family))
    shared, read_shared = served(model, prompts)
    apart, read_apart = served(model, prompts, shared_prefix=False)
    assert shared == apart
    assert 0 < read_shared < read_apart  # the decode groups read shared pages once


@pytest.mark.parametrize(
    "rows, prompt_tokens, options",
    [(2, 16, {}), (8, 40, {}), (4, 64, {"max_batch_tokens": 16, "page_size": 8})],
    ids=["2-rows-1-page", "8-rows-2.5-pages", "4-rows-8-pages-of-8-in-chunks-of-16"],
)
def test_rows_sharing_prompts_of_several_page_counts(rows, prompt_tokens, options) -> None:
    """``rows`` requests share a prompt of one page, two and a half (the rest of its third page
    each computes itself) or eight pages of 8 (prefilled in chunks), each with its own question."""
    model = build_model("llama")
    generator = torch.Generator().manual_seed(rows + prompt_tokens)
    common = draw(generator, 97, prompt_tokens)
    prompts = [common + draw(generator, 97, 1 + 3 * row) for row in range(rows)]
    shared, read_shared = served(model, prompts, **options)
    apart, read_apart = served(model, prompts, shared_prefix=False, **options)
    assert shared == apart and read_shared < read_apart


def test_kv_bytes_read_count_the_shared_pages_once() -> None:
    """Four requests of one 33-token prompt: the first computes it, the others attach its two full
    pages (the last token is always computed). Once all four decode, a step reads, per layer and
    KV head, each request's stored tokens without sharing, and the 32 shared tokens once plus
    each request's own with it."""
    model = build_model("llama")
    shape = kvlib.model_shape.kv_shape(model)
    token_bytes = shape.num_layers * shape.num_kv_heads * (shape.head_dim + shape.value_dim) * 4
    prompt = draw(torch.Generator().manual_seed(3), 97, 33)
    steps = {}
    for variant, shared_prefix in (("on", 0), ("off", False)):
        engine = kvlib.Engine(model, shared_prefix=shared_prefix)
        for _ in range(4):
            engine.add_request(prompt, max_new_tokens=12)
        for _ in range(20):
            decoding = [request for request in engine.scheduler.running if request.remaining == 1]
            if len(decoding) == 4:
                break
            engine.step()
        assert len(decoding) == 4 and all(request.attached_tokens == 32 for request in decoding[1:])
        before = engine.stats()["kv_read_bytes"]
        stored = [request.computed + 1 for request in decoding]  # each step's new token is stored before attention
        engine.step()
        steps[variant] = (engine.stats()["kv_read_bytes"] - before, stored)
    (read_shared, stored), (read_apart, stored_apart) = steps["on"], steps["off"]
    assert stored == stored_apart
    assert read_apart == sum(stored) * token_bytes
    assert read_shared == (32 + sum(tokens - 32 for tokens in stored)) * token_bytes


def test_rows_with_their_own_eviction_decode_beside_sharing_rows() -> None:
    """Requests with their own eviction spec attach no prefix: they decode beside the sharing rows
    (in no group), and every output stays."""
    model = build_model("llama")
    prompts = mixed_prompts(97, seed=1)

    def outputs(**options) -> tuple[list[list[int]], int]:
        engine = kvlib.Engine(model, **options)
        ids = [engine.add_request(prompt, max_new_tokens=NEW) for prompt in prompts[:6]]
        ids += [engine.add_request(prompt, max_new_tokens=NEW, spec="snapkv", budget=24) for prompt in prompts[6:]]
        while engine.has_unfinished:
            engine.step()
        return [engine.requests[i].output for i in ids], engine.stats()["kv_read_bytes"]

    shared, read_shared = outputs(shared_prefix=0)
    apart, read_apart = outputs(shared_prefix=False)
    assert shared == apart and read_shared < read_apart


@pytest.mark.parametrize("spec", ["kivi(bits=4)", "int8"])
def test_a_codec_engine_shares_its_sealed_prefix_pages(spec) -> None:
    """Shared prefix pages are sealed: the split reads them through the codec's kernel reader."""
    model = build_model("llama")
    prompts = mixed_prompts(97, seed=1)[:6]
    coded, read_coded = served(model, prompts, spec=spec)
    coded_apart, read_coded_apart = served(model, prompts, spec=spec, shared_prefix=False)
    assert coded == coded_apart and read_coded < read_coded_apart


def test_with_the_read_mirror_the_decode_group_reads_densely() -> None:
    model = build_model("llama")
    prompts = mixed_prompts(97, seed=1)[:6]
    mirrored, read_mirrored = served(model, prompts, read_cache=True)
    assert mirrored == served(model, prompts, shared_prefix=False)[0] and read_mirrored == 0


def test_sliding_window_models_share_nothing_and_keep_their_outputs() -> None:
    """A model whose layers slide keeps no prefix cache: no pages are shared, the path never runs."""
    model = build_model("mistral")
    prompts = mixed_prompts(97, seed=2)[:6]
    assert served(model, prompts) == served(model, prompts, shared_prefix=False)


def test_by_default_a_split_saving_few_reads_is_not_made() -> None:
    """The default (``shared_prefix=True``) splits only where a layer saves ``MIN_SAVED_READS``
    reads: on a small model's short shared prompts it reads what the Engine without it reads."""
    model = build_model("llama")
    prompts = mixed_prompts(97)
    default, read_default = served(model, prompts, shared_prefix=True)
    apart, read_apart = served(model, prompts, shared_prefix=False)
    assert default == apart and read_default == read_apart


def test_a_bad_value_is_refused_in_one_line() -> None:
    model = build_model("llama")
    for value in ("yes", -1, None, 1.5):
        with pytest.raises(ValueError, match=rf"^shared_prefix must be True, False or an int >= 0 .*, got {value!r}$"):
            kvlib.Engine(model, shared_prefix=value)
