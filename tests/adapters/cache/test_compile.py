"""The drop-in cache under ``torch.compile`` in the flows users write, for every registered policy
and codec: ``model.forward`` compiled then ``generate`` (the prefill through the compiled forward
too), ``model.compile()`` (the module form: its forward pre-hooks traced with it), a manual loop over
``torch.compile(model)``, and ``generate``'s own compile path (``is_compileable``). Every flow
traces with ``fullgraph=True`` (no graph break), compiles at most twice over 64 decode steps that
cross page boundaries, evictions and codec seals (the prompt's shape, then the decode step with its
lengths dynamic: one graph serves every cache and every policy), and gives the eager tokens.
Inductor runs too, on a few policies (``slow``: its C++ compilation takes minutes here).

The default suite walks :data:`IN_THE_SUITE` (the exact cache, an eviction with its received
attention folded by the kernel and a codec sealing pages) and the module flows once; the whole
registry, the manual loop and inductor are ``slow`` (CI runs them after the suite: each case pays
numba's kernel compilation for its codec and eviction, about half a minute here)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import CompileConfig

import kvlib
from kvlib.policies.budget.head_importance import PROFILE_FORMAT
from kvlib.policies.lowrank.leank import save_mask
from tests.adapters.conftest import PAD, build_model, left_padded

NEW_TOKENS = 64
BUDGET = 24
"""Tokens each (layer, row, KV head) keeps under eviction: the 33- and 40-token prompts are
compressed, and decoding 64 tokens compacts every page of slack."""

_TIERING = {
    "clusterkv": "clusterkv(top_k=4, dense_layers=0, cluster_tokens=8)",
    "leoam": "leoam(top_k=2, dense_layers=0, chunk_pages=2, placement='lru(device_mb=0.01)')",
    "louiskv": "louiskv(top_k=2, dense_layers=0, threshold=0.5, placement='lru(device_mb=0.01)')",
    "lru": "lru(device_mb=0.01)",
    "quest": "quest(top_k=2)",
    "random_pages": "random_pages(top_k=2)",
    "score_aware": "score_aware(device_mb=0.01, refresh=4)",
    "shadowkv": "shadowkv(pages=2, window=1, outliers=1, dense_layers=0, device_mb=0.01)",
    "specache": "specache(top_k=2, dense_layers=0, placement='lru(device_mb=0.01)')",
    "tailorkv": "tailorkv(top_k=2, placement='lru(device_mb=0.01)')",
}
_CODECS = {
    "minicache": "minicache(start=0.0)",  # the test model has 2 layers: one pair from layer 0
    "leank": "leank(mask={leank_mask!r})",  # a mask written by the ``leank_mask`` fixture
}
_BUDGETS = {"head_importance": "head_importance(profile={profile!r})"}  # a profile written by the ``profile`` fixture


IN_THE_SUITE = {"exact", "h2o+kivi"}
"""The cases of the compiled-forward walk that run in the default suite; the others are ``slow``."""


def _specs() -> list[pytest.param]:
    """Every registered policy a cache can run alone (eviction at :data:`BUDGET`), and the
    compositions the README shows; the cases outside :data:`IN_THE_SUITE` marked ``slow``."""
    policies = kvlib.available_policies()
    specs = [pytest.param("", None, id="exact")]
    specs += [pytest.param(name, BUDGET, id=name) for name in policies["eviction"]]
    specs += [pytest.param(_CODECS.get(name, name), None, id=name) for name in policies["quantization"] + policies["lowrank"]]
    specs += [pytest.param(_TIERING[name], None, id=name) for name in policies["tiering"]]
    specs += [pytest.param(f"snapkv+{_BUDGETS.get(name, name)}", BUDGET, id=f"snapkv+{name}") for name in policies["budget"]]
    specs += [pytest.param("snapkv+kivi(bits=4)", BUDGET, id="snapkv+kivi"), pytest.param("h2o+kivi(bits=4)", BUDGET, id="h2o+kivi")]
    return [spec if spec.id in IN_THE_SUITE else pytest.param(*spec.values, id=spec.id, marks=pytest.mark.slow) for spec in specs]


SPECS = _specs()
RECOMPUTE = kvlib.available_policies()["recompute"]
"""Recompute policies: their forward records each layer's checkpoint (one more operator,
``kvlib::record_checkpoint``, from a hook of their own), so they trace graphs of their own
(:func:`test_a_recompute_policy_compiles_in_a_forward_of_its_own`)."""


def test_every_registered_policy_is_walked() -> None:
    """A policy registered without a case here fails this test: it must be added to :func:`_specs`."""
    walked = (
        {param.values[0].split("(")[0] for param in SPECS}
        | {part.split("(")[0] for param in SPECS for part in param.values[0].split("+")}
        | set(RECOMPUTE)
    )
    registered = {name for kind, names in kvlib.available_policies().items() if kind != "reuse" for name in names}
    assert registered <= walked, sorted(registered - walked)


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    """A head-importance profile for the test model (2 layers x 2 KV heads)."""
    path = tmp_path_factory.mktemp("profile") / "heads.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "weights": [[1.0, 3.0], [2.0, 1.0]]}))
    return str(path)


@pytest.fixture(scope="module")
def leank_mask(tmp_path_factory) -> str:
    """A LeanK mask for the test model (2 layers x 2 KV heads of 8 key channels): half of them kept."""
    path = tmp_path_factory.mktemp("leank") / "mask.json"
    save_mask(path, [[[0, 1, 4, 5], [2, 3, 6, 7]]] * 2, {"by": "test"})
    return str(path)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model("llama")


@pytest.fixture(scope="module")
def prompt(model) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded([40, 33], seed=3, vocab=model.config.vocab_size)


class Frames:
    """A ``torch.compile`` backend counting the graphs it is handed (and running them as traced)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return graph.forward


def make(model: torch.nn.Module, spec: str, budget: int | None) -> kvlib.KVCache:
    return kvlib.make_cache(model, spec or None, **({} if budget is None else {"budget": budget}))


def generate(model: torch.nn.Module, cache: kvlib.KVCache, prompt, **options) -> torch.Tensor:
    ids, mask = prompt
    return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD, **options)


@pytest.fixture(scope="module")
def compiled_forward(model):
    """``model.forward`` compiled (``fullgraph=True``) for the module's tests, and its frame count."""
    frames = Frames()
    original = model.forward
    model.forward = torch.compile(original, backend=frames, fullgraph=True)
    yield frames
    model.forward = original
    torch._dynamo.reset()


@pytest.mark.parametrize("spec, budget", SPECS)
def test_compiled_forward_then_generate(
    model, prompt, compiled_forward, profile: str, leank_mask: str, spec: str, budget: int | None
) -> None:
    """``model.forward = torch.compile(model.forward, fullgraph=True)``, then ``generate``: the
    prompt and 64 decode steps through the compiled forward give the eager tokens; every policy
    shares two graphs (the prompt's, the decode step's)."""
    spec = spec.format(profile=profile, leank_mask=leank_mask)
    original = model.forward
    model.forward = original._torchdynamo_orig_callable.__get__(model)  # eager, for the reference
    try:
        eager = generate(model, make(model, spec, budget), prompt)
    finally:
        model.forward = original
    compiled = generate(model, make(model, spec, budget), prompt)
    assert torch.equal(compiled, eager)
    assert compiled_forward.graphs <= 2


def test_model_compile_traces_the_hooks_with_the_forward(prompt) -> None:
    """``model.compile(fullgraph=True)`` (``torch.compile`` of the module: its forward pre-hooks,
    where an eager call plans the decode step, are traced too) for an exact cache, an evicting one
    and a codec: eager tokens, two graphs for all three."""
    model = build_model("llama")
    cases = [("", None), ("h2o", BUDGET), ("snapkv+kivi(bits=4)", BUDGET)]
    eager = [generate(model, make(model, spec, budget), prompt) for spec, budget in cases]
    frames = Frames()
    model.compile(backend=frames, fullgraph=True)
    try:
        for (spec, budget), expected in zip(cases, eager):
            assert torch.equal(generate(model, make(model, spec, budget), prompt), expected), spec
    finally:
        torch._dynamo.reset()
    assert frames.graphs <= 2


@pytest.mark.slow
@pytest.mark.parametrize("spec", RECOMPUTE)
def test_a_recompute_policy_compiles_in_a_forward_of_its_own(prompt, spec: str) -> None:
    """A recompute policy's cache, in the flow of :func:`test_compiled_forward_then_generate` on a
    model of its own (its checkpoint hook changes what the forward traces): the prompt and 64
    decode steps through the compiled forward give the eager tokens, in at most two graphs."""
    model = build_model("llama")
    eager = generate(model, make(model, spec, None), prompt)
    frames = Frames()
    model.forward = torch.compile(model.forward, backend=frames, fullgraph=True)
    compiled = generate(model, make(model, spec, None), prompt)
    assert torch.equal(compiled, eager)
    assert frames.graphs <= 2


@pytest.mark.slow
def test_a_loop_over_the_compiled_module(prompt) -> None:
    """A manual decode loop over ``torch.compile(model, fullgraph=True)`` (the module wrapper
    called directly, as a serving loop does) with a streaming_llm ring: the eager tokens."""
    model = build_model("llama")
    compiled = torch.compile(model, backend=(frames := Frames()), fullgraph=True)

    def loop(forward) -> torch.Tensor:
        ids, mask = prompt
        cache, tokens = make(model, "streaming_llm", BUDGET), []
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                logits = forward(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True).logits
                ids = logits[:, -1:].argmax(-1)
                tokens.append(ids)
                mask = torch.cat([mask, torch.ones_like(ids)], 1)
                positions = mask.sum(-1, keepdim=True) - 1
        return torch.cat(tokens, 1)

    try:
        assert torch.equal(loop(compiled), loop(model))
    finally:
        torch._dynamo.reset()
    assert frames.graphs <= 2


def test_generates_own_compile_path(prompt) -> None:
    """``make_cache(..., compileable=True)`` reports ``is_compileable``: ``generate`` compiles its
    decode steps itself (``compile_config``; on the CPU only when asked with
    ``_compile_all_devices``, as for ``StaticCache``), handing the forward a 4-D mask it builds
    outside: eager tokens, at most two graphs (the decode step's, then with its lengths dynamic).
    By default the cache is not compileable and ``generate`` compiles nothing."""
    model = build_model("llama")
    cases = [("", None), ("snapkv+kivi(bits=4)", BUDGET)]
    eager = [generate(model, make(model, spec, budget), prompt) for spec, budget in cases]
    graphs: list[int] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(len(graph.graph.nodes))
        return graph.forward

    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True
    try:
        assert not make(model, "", None).is_compileable
        generate(model, make(model, "", None), prompt, compile_config=config)
        assert graphs == []
        for (spec, budget), expected in zip(cases, eager):
            cache = kvlib.make_cache(model, spec or None, compileable=True, **({} if budget is None else {"budget": budget}))
            assert cache.is_compileable
            assert torch.equal(generate(model, cache, prompt, compile_config=config), expected), spec
    finally:
        torch._dynamo.reset()
    assert 1 <= len(graphs) <= 2


@pytest.mark.slow
@pytest.mark.parametrize("spec, budget", [("", None), ("h2o", BUDGET), ("snapkv+kivi(bits=4)", BUDGET), ("streaming_llm", BUDGET)])
def test_inductor(prompt, spec: str, budget: int | None) -> None:
    """Inductor (C++ on the CPU) compiles the forward, kvlib's operators as calls out of its code:
    the eager tokens."""
    model = build_model("llama")
    eager = generate(model, make(model, spec, budget), prompt)
    model.forward = torch.compile(model.forward, backend="inductor", fullgraph=True)
    try:
        assert torch.equal(generate(model, make(model, spec, budget), prompt), eager)
    finally:
        torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec, budget", [("", None), ("snapkv", BUDGET), ("kivi(bits=4)", None)], ids=["exact", "snapkv", "kivi4"])
def test_cuda_graphs_captured_by_reduce_overhead(spec: str, budget: int | None) -> None:
    """``torch.compile(model.forward, mode="reduce-overhead")`` on a CUDA device: the decode steps
    run as captured CUDA graphs around kvlib's operators and give the eager tokens."""
    model = build_model("llama").cuda()
    ids, mask = left_padded([40, 33], seed=3, vocab=model.config.vocab_size)
    ids, mask = ids.cuda(), mask.cuda()
    eager = generate(model, make(model, spec, budget), (ids, mask))
    model.forward = torch.compile(model.forward, mode="reduce-overhead")
    try:
        compiled = generate(model, make(model, spec, budget), (ids, mask))
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled, eager)
