"""kvlib.Engine with suffix speculation: greedy outputs equal the Engine's without it, request by
request (repetitive prompts where drafts are accepted, random prompts, other families, chunking,
page sizes, preemption by swap and by recompute, stop tokens inside an accepted run); rejected
tokens leave no trace (every layer stores exactly each running request's computed tokens after
every step, the prefix index holds the same blocks as without speculation, no page leaks);
sampling keeps the target distribution (a chi-square test); bad combinations are refused."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.adapters.engine.suffix_speculator import SuffixSpeculation
from tests.adapters.conftest import build_model
from tests.adapters.engine.test_engine import page_bytes, pages_held
from tests.adapters.engine.test_sampling import chi_square_p

NEW = 24


def repetitive_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Edits of one document (a block of it repeated, a line changed) and a loop of records."""
    generator = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    document, record = draw(30), draw(6)
    edited = document[:12] + draw(3) + document[15:]
    return [document + edited + document[:10], record * 6 + record[:2], document + draw(4), draw(9) + record * 3]


def random_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 23, 41, 17, 60)]


def stored_exactly_what_was_computed(engine: kvlib.Engine) -> None:
    """Every running request's sequence holds, in every layer and head, positions 0 .. computed - 1
    and nothing else: no rejected draft token stayed."""
    store = engine.store
    for request in engine.scheduler.running:
        for layer in range(store.num_layers):
            lengths = store.physical_lengths(layer, [request.seq])
            assert bool((lengths == request.computed).all()), (layer, lengths, request.computed)
            positions = store.stored_positions(layer, [request.seq])[0]
            expected = torch.arange(request.computed).expand(positions.shape[0], -1)
            assert torch.equal(positions[:, : request.computed].cpu(), expected)
        assert store.logical_lengths(0, [request.seq]).tolist() == [request.computed]


def served(engine: kvlib.Engine, prompts: list[list[int]], **options) -> list[list[int]]:
    """Serve ``prompts`` step by step, checking the stored tokens after every step."""
    ids = [engine.add_request(prompt, **options) for prompt in prompts]
    while engine.has_unfinished:
        engine.step()
        stored_exactly_what_was_computed(engine)
    return [engine.requests[i].output for i in ids]


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return build_model("llama")


@pytest.fixture(scope="module")
def repetitive_case(llama) -> tuple[list[list[int]], list[list[int]]]:
    prompts = repetitive_prompts(97)
    return prompts, kvlib.Engine(llama).generate(prompts, max_new_tokens=NEW)


@pytest.mark.parametrize(
    "options",
    [{}, {"max_batch_tokens": 12}, {"page_size": 4}, {"prefix_cache": False}, {"read_cache": True}],
    ids=["defaults", "small-token-budget", "pages-of-4", "no-prefix-cache", "read-mirror"],
)
def test_greedy_outputs_equal_the_engine_without_speculation(llama, repetitive_case, options) -> None:
    prompts, expected = repetitive_case
    engine = kvlib.Engine(llama, speculate="suffix", **options)
    assert served(engine, prompts, max_new_tokens=NEW) == expected
    stats = engine.stats()
    assert stats["accepted_tokens"] > 0 and stats["verifications"] > 0
    assert stats["output_tokens"] == NEW * len(prompts)
    assert pages_held(engine) == 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "default"])
def test_random_prompts_stay_exact_on_every_family(family) -> None:
    model = build_model(family)
    prompts = random_prompts(97)
    expected = kvlib.Engine(model).generate(prompts, max_new_tokens=16)
    speculating = kvlib.Engine(model, speculate=SuffixSpeculation(max_draft=4, alpha=2.0, min_probability=0.0, segment_cost=0.0))
    assert served(speculating, prompts, max_new_tokens=16) == expected
    assert speculating.stats()["verifications"] > 0
    assert pages_held(speculating) == 0


def test_verifications_attend_over_their_pages_in_one_segment(llama, repetitive_case) -> None:
    """Once every prompt is in, steps that verify drafts read no dense workspace (the page kernel
    reads the pages in place) and run their verifications as one segment (one length)."""
    prompts, expected = repetitive_case
    engine = kvlib.Engine(llama, speculate="suffix")
    ids = [engine.add_request(prompt, max_new_tokens=NEW) for prompt in prompts]
    while engine.scheduler.waiting or any(request.remaining > 1 for request in engine.scheduler.running):
        engine.step()
    engine.store.peak_workspace = 0
    lengths = []
    while engine.has_unfinished:
        plan = engine.scheduler.plan(
            engine.kv, engine._drafts(), engine.speculator.options.token_cost, engine.speculator.options.segment_cost
        )
        longest = engine.speculator.options.max_draft
        lengths.append({len(draft) for request, draft in plan.drafts.items() if request.max_new_tokens - len(request.output) > longest})
        engine.step()
    assert engine.stats()["verifications"] > 0 and engine.store.peak_workspace == 0
    assert all(len(step) <= 1 for step in lengths) and any(lengths)
    assert [engine.requests[i].output for i in ids] == expected


def test_the_prefix_index_holds_the_same_blocks_as_without_speculation(llama, repetitive_case) -> None:
    prompts, _ = repetitive_case
    engines = [kvlib.Engine(llama, page_size=4), kvlib.Engine(llama, page_size=4, speculate="suffix")]
    for prompt in prompts:  # one at a time: after each, both indexes hold its prompt's and output's full blocks
        outputs = [engine.generate([prompt], max_new_tokens=NEW - 3) for engine in engines]
        assert outputs[0] == outputs[1]
        keys = [set(engine.prefix.index.entries) for engine in engines]
        assert keys[0] == keys[1]
        assert [pool.pages_in_use for pool in engines[0].store.pools] == [pool.pages_in_use for pool in engines[1].store.pools]
    assert engines[1].stats()["accepted_tokens"] > 0


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_preemption_during_speculation_stays_exact(llama, repetitive_case, preemption) -> None:
    prompts, expected = repetitive_case
    budget = 12 * 2 * page_bytes(llama)  # 12 pages per layer: two requests at most, so the others wait or are preempted
    engine = kvlib.Engine(llama, page_budget_bytes=budget, preemption=preemption, reserve_pages=0, speculate="suffix")
    assert served(engine, prompts, max_new_tokens=NEW) == expected
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["accepted_tokens"] > 0
    assert pages_held(engine) == 0


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(llama, repetitive_case) -> None:
    prompts, expected = repetitive_case
    eos = expected[1][NEW // 2]  # a token of the record loop, deep in the output
    cut = expected[1][: expected[1].index(eos) + 1]
    engine = kvlib.Engine(llama, speculate="suffix")
    assert served(engine, [prompts[1]], max_new_tokens=NEW, eos_token_id=eos) == [cut]
    short = kvlib.Engine(llama, speculate="suffix")
    assert served(short, [prompts[1]], max_new_tokens=5) == [expected[1][:5]]
    assert pages_held(engine) == 0 and pages_held(short) == 0


def test_sampling_keeps_the_target_distribution(llama) -> None:
    """Over many seeded requests, the pair (second, third) output token given the first follows the
    model's own distribution (top_k=2: at most four pairs), with drafts proposed and both accepted
    and rejected."""
    record = [11, 45, 72, 30]
    prompt = record * 5
    options = {"do_sample": True, "temperature": 2.0, "top_k": 2}
    engine = kvlib.Engine(
        llama,
        speculate=SuffixSpeculation(max_draft=2, alpha=4.0, min_probability=0.0, token_cost=0.0, segment_cost=0.0),
        max_running=256,
        max_batch_tokens=2048,
    )
    ids = [engine.add_request(prompt, max_new_tokens=3, seed=seed, **options) for seed in range(800)]
    while engine.has_unfinished:
        engine.step()
    outputs = [engine.requests[i].output for i in ids]
    stats = engine.stats()
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    first = max({output[0] for output in outputs}, key=lambda token: sum(output[0] == token for output in outputs))
    pairs = [tuple(output[1:]) for output in outputs if output[0] == first]
    with torch.inference_mode():  # the model's own distribution of the pair after prompt + first
        second = kvlib.adapters.engine.sampling.target_probabilities(llama(torch.tensor([prompt + [first]])).logits[0, -1], 2.0, 2, 1.0)
        cells, expected = [], []
        for token in second.nonzero().flatten().tolist():
            third = llama(torch.tensor([prompt + [first, token]])).logits[0, -1]
            third = kvlib.adapters.engine.sampling.target_probabilities(third, 2.0, 2, 1.0)
            for after in third.nonzero().flatten().tolist():
                cells.append((token, after))
                expected.append(float(second[token] * third[after]))
    observed = torch.tensor([sum(pair == cell for pair in pairs) for cell in cells], dtype=torch.float64)
    assert int(observed.sum()) == len(pairs) > 300
    assert chi_square_p(observed, torch.tensor(expected, dtype=torch.float64)) > 1e-3


def test_bad_combinations_are_refused_before_any_work(llama) -> None:
    with pytest.raises(ValueError, match="speculate must be None, one of"):
        kvlib.Engine(llama, speculate="medusa")
    with pytest.raises(ValueError, match="this engine has the eviction spec 'snapkv"):
        kvlib.Engine(llama, "snapkv", budget=32, speculate="suffix")
    with pytest.raises(ValueError, match="this engine has the codec"):
        kvlib.Engine(llama, "kivi(bits=4)", speculate="suffix")
    with pytest.raises(ValueError, match="sliding windows of"):
        kvlib.Engine(build_model("mistral"), speculate="suffix")
    engine = kvlib.Engine(llama, speculate="suffix")
    with pytest.raises(ValueError, match="on a speculating engine"):
        engine.add_request([5, 6, 7], spec="snapkv", budget=8)
    assert not engine.has_unfinished and engine.requests == {}
