"""KVzip: reconstruction scores against an independent computation (the model's own attention
weights over context + reconstruction prompt, no cache), a compressed cache that meets its budget
and serves several questions, the per-call fallback score, and bad input."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.eviction.kvzip import FIRST_PROMPT, LATER_PROMPT, KVzip, RepeatPrompt, compress, reconstruction_scores
from kvlib.policy import LayerView
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model

PROMPT = RepeatPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10,), prefix=3, overlap=2)


def reference_scores(model, context: torch.Tensor, chunk: int, sinks: int) -> list[torch.Tensor]:
    """Per chunk, one uncached eager pass over context + the chunk's prompt; each context token's
    score is the max over the prompt's queries and the KV group of the attention renormalised
    over (first sinks, chunk, prompt)."""
    model.set_attn_implementation("eager")
    length = context.shape[1]
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    scores = [torch.zeros(1, kv_heads, length) for _ in range(layers)]
    for index, start in enumerate(range(PROMPT.prefix, length, chunk)):
        end = min(start + chunk, length)
        head = list(PROMPT.first) if index == 0 else [*PROMPT.later, *context[0, max(start - PROMPT.overlap, 0) : start].tolist()]
        ids = torch.tensor([[*head, *PROMPT.suffix, *context[0, start:end].tolist()]])
        with torch.no_grad():
            attentions = model(torch.cat([context, ids], 1), output_attentions=True).attentions
        sink = min(sinks, start)
        for layer, weights in enumerate(attentions):
            rows = weights[0, :, length:, :]  # [heads, q, all]
            subset = [*range(sink), *range(start, end), *range(length, length + ids.shape[1])]
            sub = rows[..., subset] / rows[..., subset].sum(-1, keepdim=True)
            block = sub[..., sink : sink + end - start]  # [heads, q, chunk]
            scores[layer][0, :, start:end] = block.view(kv_heads, -1, end - start).amax(1)
    return scores


@pytest.mark.parametrize("chunk", [64, 10])
def test_reconstruction_scores_match_an_uncached_eager_computation(chunk: int) -> None:
    model = build_model("llama")
    context = torch.randint(11, 97, (1, 37), generator=torch.Generator().manual_seed(0))
    ours = reconstruction_scores(model, context, PROMPT, sinks=4, chunk=chunk)
    assert model.config._attn_implementation == "sdpa"  # restored
    expected = reference_scores(model, context, chunk, sinks=4)
    for layer in range(len(ours)):
        torch.testing.assert_close(ours[layer], expected[layer], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_compress_keeps_the_top_reconstruction_scores_and_serves_several_questions(family: str) -> None:
    model = build_model(family)
    context = torch.randint(11, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    scores = reconstruction_scores(model, context, PROMPT, sinks=4, chunk=2048)
    cache = kvlib.make_cache(model, "kvzip", budget=0.25, page_size=4)
    compress(model, cache, context, PROMPT)
    heads = cache.shape.num_kv_heads
    for layer in range(cache.shape.num_layers):  # one top-k of 10 * heads over the layer's heads, sinks first
        kept = cache.kept_positions(layer)[0]
        assert int((kept >= 0).sum()) == 10 * heads
        ranked = torch.where(torch.arange(40) < 4, torch.inf, scores[layer][0]).flatten()
        expected = set(torch.topk(ranked, 10 * heads).indices.tolist())
        assert {h * 40 + int(p) for h in range(heads) for p in kept[h].tolist() if p >= 0} == expected
    report = cache.memory_report()
    assert report["stored_tokens"] == 10 * heads * cache.shape.num_layers
    questions = torch.randint(11, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    cache.batch_repeat_interleave(2)  # two rows sharing the compressed pages
    both = model.generate(
        torch.cat([context.expand(2, -1), questions], 1), **cache_argument(cache), do_sample=False, max_new_tokens=5, pad_token_id=PAD
    )
    for row in range(2):  # each answer is what a fresh compression of the context gives that question
        alone = kvlib.make_cache(model, "kvzip", budget=0.25, page_size=4)
        compress(model, alone, context, PROMPT)
        answer = model.generate(
            torch.cat([context, questions[row : row + 1]], 1), **cache_argument(alone), do_sample=False, max_new_tokens=5, pad_token_id=PAD
        )
        assert torch.equal(both[row], answer[0])
        alone.crop(-(6 + 4))  # drop the question and the answer: the compressed context is left for the next one
        assert int((alone.kept_positions(0)[0] >= 0).sum()) == 10 * heads


def test_smollm2_compressed_context_answers_two_questions(smollm2) -> None:
    loaded = smollm2
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = RepeatPrompt.for_tokenizer(tokenizer)
    assert prompt.prefix > 0 and prompt.suffix  # SmolLM2 has a chat template
    text = "The secret code of the blue door is 7421. " + "The weather was mild and the river ran slowly past the mill. " * 10
    context = torch.tensor([tokenizer.encode(text)])
    cache = kvlib.make_cache(model, "kvzip", budget=0.5)
    compress(model, cache, context, prompt)
    budget = -(-context.shape[1] // 2)
    assert cache.memory_report()["stored_tokens"] == budget * cache.shape.num_kv_heads * cache.shape.num_layers
    for question in [" What is the secret code of the blue door?", " What ran past the mill?"]:
        ids = torch.cat([context, torch.tensor([tokenizer.encode(question)])], 1)
        out = model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=4, pad_token_id=0)
        cache.crop(-(out.shape[1] - 1 - context.shape[1]))
        assert cache.memory_report()["stored_tokens"] == budget * cache.shape.num_kv_heads * cache.shape.num_layers


def test_without_reconstruction_a_call_scores_by_its_other_queries() -> None:
    generator = torch.Generator().manual_seed(3)
    valid = torch.ones(1, 2, 12, dtype=torch.bool)
    positions = torch.arange(12).expand(1, 2, 12)
    attention = torch.rand(1, 4, 12, 12, generator=generator).tril()
    view = LayerView(0, 1, torch.zeros(1, 2, 12, 0), torch.zeros(1, 2, 12, 0), positions, valid, attention=attention)
    scores = KVzip(sinks=2).score(view)
    expected = attention.view(1, 2, 2, 12, 12).amax(2)  # [batch, kv, q, k]
    expected = expected.masked_fill(torch.eye(12, dtype=torch.bool), 0.0).amax(2)
    expected[..., :2] = torch.inf
    assert torch.equal(scores, expected)


def test_compress_refuses_another_cache_and_bad_parameters() -> None:
    model = build_model("llama")
    context = torch.randint(11, 97, (1, 20))
    with pytest.raises(ValueError, match="make_cache\\(model, 'kvzip', budget"):
        compress(model, kvlib.make_cache(model, "snapkv", budget=0.5), context, PROMPT)
    with pytest.raises(ValueError, match="more than prompt.prefix"):
        compress(model, kvlib.make_cache(model, "kvzip", budget=0.5), context[:, :2], PROMPT)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        kvlib.parse_policy("kvzip(chunk=0)")
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        kvlib.parse_policy("kvzip(sinks=-1)")


def kvpress_repeat_prompt(tokenizer) -> RepeatPrompt:
    """kvpress's construction (``KVzipPress``): the chat template's text split around a dummy
    user turn, each part encoded alone."""
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False)
    context, suffix = text.split(separator)

    def encode(part: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(part, add_special_tokens=False))

    return RepeatPrompt(encode(FIRST_PROMPT), encode(LATER_PROMPT), encode(suffix), len(encode(context.split(dummy)[0])))


def test_the_repeat_prompt_is_kvpress_s_for_a_chat_template_and_plain_without(smollm2) -> None:
    from kvlib.default_model import ByteTokenizer

    tokenizer = smollm2.tokenizer
    assert RepeatPrompt.for_tokenizer(tokenizer) == kvpress_repeat_prompt(tokenizer.tokenizer)
    plain = RepeatPrompt.for_tokenizer(ByteTokenizer())
    assert plain.suffix == tuple(ByteTokenizer().encode("\n")) and plain.prefix == 1  # BOS only
    assert plain.first == tuple(ByteTokenizer().encode(FIRST_PROMPT))


def test_context_prefill_is_compress_with_the_tokenizer_s_prompt() -> None:
    from kvlib.default_model import ByteTokenizer
    from kvlib.eval.task import prefill_context
    from tests.eval.conftest import tiny_byte_model

    model = tiny_byte_model()  # its vocabulary holds the byte tokenizer's prompt
    context = torch.randint(11, 97, (1, 40), generator=torch.Generator().manual_seed(4))
    tokenizer = ByteTokenizer()
    by_hook = kvlib.make_cache(model, "kvzip", budget=0.25, page_size=4)
    prefill_context(model, by_hook, context, tokenizer)
    by_hand = kvlib.make_cache(model, "kvzip", budget=0.25, page_size=4)
    compress(model, by_hand, context, RepeatPrompt.for_tokenizer(tokenizer))
    assert by_hook.evictor is None  # compressed once, then it keeps what it holds
    for layer in range(by_hand.shape.num_layers):
        assert torch.equal(by_hook.kept_positions(layer), by_hand.kept_positions(layer))
    plain = kvlib.make_cache(model, "snapkv", budget=10, page_size=4)
    prefill_context(model, plain, context, tokenizer)  # no procedure of its own: one forward call
    assert int((plain.kept_positions(0)[0] >= 0).sum(-1).max()) == 10


def test_the_memo_keeps_the_reconstruction_scores_for_other_budgets() -> None:
    """The scores depend on the context, not the budget: the first compression keeps them in the
    memo and a later one, at another budget, compresses by the memo's scores (here replaced by
    reversed ones, to see that they are the ones used) instead of recomputing them."""
    from kvlib.default_model import ByteTokenizer
    from kvlib.eval.task import prefill_context
    from tests.eval.conftest import tiny_byte_model

    model, tokenizer = tiny_byte_model(), ByteTokenizer()
    context = torch.randint(11, 97, (1, 40), generator=torch.Generator().manual_seed(5))
    memo: dict = {}
    quarter = kvlib.make_cache(model, "kvzip", budget=0.25, page_size=4)
    prefill_context(model, quarter, context, tokenizer, memo)
    prompt = RepeatPrompt.for_tokenizer(tokenizer)
    ((key, scores),) = memo.items()
    expected = reconstruction_scores(model, context, prompt, sinks=4, chunk=2048)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(scores, expected))
    reversed_scores = [layer.flip(-1) for layer in scores]
    memo[key] = reversed_scores
    half = kvlib.make_cache(model, "kvzip", budget=0.5, page_size=4)
    prefill_context(model, half, context, tokenizer, memo)
    by_hand = kvlib.make_cache(model, "kvzip", budget=0.5, page_size=4)
    compress(model, by_hand, context, prompt, reversed_scores)
    fresh = kvlib.make_cache(model, "kvzip", budget=0.5, page_size=4)
    compress(model, fresh, context, prompt)
    assert any(not torch.equal(by_hand.kept_positions(layer), fresh.kept_positions(layer)) for layer in range(half.shape.num_layers))
    for layer in range(half.shape.num_layers):
        assert torch.equal(half.kept_positions(layer), by_hand.kept_positions(layer))
    other = kvlib.make_cache(model, "kvzip(chunk=16)", budget=0.5, page_size=4)
    prefill_context(model, other, context, tokenizer, memo)  # another chunk: scores of its own
    assert len(memo) == 2
