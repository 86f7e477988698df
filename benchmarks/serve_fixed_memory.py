"""Serving capacity at fixed memory: the exact ``kvlib.Engine`` and codec Engines given the same
page budget in bytes, on a trace that saturates it, and what a serving user buys with the codec.

Every Engine gets ``page_budget_bytes = memory_bytes`` (sealed pages count at their encoded
size, each head's open last page at its raw size: see :mod:`kvlib.adapters.engine.kv_manager`), no
prefix cache (the prompts share nothing), and every request of the trace at once (they all
arrive at 0 s), so admission and preemption are decided by the pages alone. Figures per Engine:

- concurrent requests: after each step, the requests holding pages (running, plus those that
  finished in that step); the most and the mean over steps;
- preemptions (``engine.stats()``), output tokens/s (output tokens over the seconds spent in
  ``step()``; an untimed two-request warm-up runs first), the most bytes held after a step
  (``memory_report()["total_bytes"]``: pages, codec metadata, positions, tables) and the most
  page bytes at any moment (``peak_pages_bytes``, which includes a prefill chunk's raw pages
  before its layer seals them);
- KL(exact || codec) in nats per output step. The exact Engine records each request's
  next-token log-probabilities at every output step (the LM head's rows, by a forward hook on
  the model's output embeddings while ``step()`` runs; the rows come in the order ``step()``
  returns the requests). A codec Engine's step ``t`` of a request is compared when its first
  ``t`` output tokens equal the exact Engine's: both distributions are then conditioned on the
  same tokens (prompt and the same ``t`` outputs), which is teacher forcing on the exact
  Engine's outputs up to the first greedy disagreement, that step included. Steps after it are
  not compared (their contexts differ); how many steps were compared is reported.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from serve_metrics import agreement
from serve_trace import Lengths, Request

import kvlib
from kvlib.adapters.engine.engine_request import RequestState


@dataclass(frozen=True)
class FixedMemorySettings:
    """What every Engine of the comparison gets: ``memory_bytes`` of page budget, ``page_size``
    tokens per page, ``max_batch_tokens`` per forward pass, at most ``max_running`` requests at
    once; ``codecs`` are the engine-wide codec specs compared with the exact Engine."""

    memory_bytes: int
    codecs: tuple[str, ...] = ("kivi(bits=4)", "rotated(bits=4)", "gear")
    page_size: int = 16
    max_batch_tokens: int = 256
    max_running: int = 64

    def __post_init__(self) -> None:
        if self.memory_bytes < 1:
            raise ValueError(f"--fixed-memory-mb must give at least one byte, got {self.memory_bytes} bytes")
        for spec in self.codecs:
            if kvlib.parse_spec(spec).quantization is None:
                raise ValueError(
                    f"--codecs takes engine-wide quantization codecs (kivi(bits=4), rotated(bits=4), gear, ...); {spec!r} has none"
                )


def random_prompts(count: int, lengths: Lengths, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of uniform random token ids, lengths drawn from ``lengths``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(lengths.draw(rng))] for _ in range(count)]


def text_prompts(encode: Callable[[str], list[int]], count: int, lengths: Lengths, seed: int) -> list[list[int]]:
    """``count`` natural-text prompts (essay sentences, RULER's haystack filler), each from its own
    seed, encoded by ``encode`` and cut to a length drawn from ``lengths``."""
    from kvlib.eval.ruler.haystack import essay

    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length, text_rng = lengths.draw(rng), random.Random(rng.random())
        ids: list[int] = []
        while len(ids) < length:
            ids = encode(" ".join(essay(max(1, length // 6) + len(ids), text_rng)))
        prompts.append(ids[:length])
    return prompts


def saturating_trace(prompts: list[list[int]], new_tokens: int) -> list[Request]:
    """Every prompt as one request arriving at 0 s, each asking ``new_tokens`` tokens."""
    return [Request(0.0, prompt, new_tokens, "long", i) for i, prompt in enumerate(prompts)]


def kl_nats(reference_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || q) in nats of each row: ``reference_logp`` are log-probabilities
    ``[..., vocab]``, ``logits`` q's unnormalized logits of the same shape."""
    logq = torch.log_softmax(logits.float(), -1)
    return (reference_logp.exp() * (reference_logp - logq)).sum(-1)


@contextmanager
def head_rows(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """While open, the last output of ``model``'s output embeddings (the LM head), as the one
    item of the yielded list (``[rows, vocab]``); the hook is removed on exit."""
    seen: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen[:] = [output.reshape(-1, output.shape[-1])]

    handle = model.get_output_embeddings().register_forward_hook(keep)
    try:
        yield seen
    finally:
        handle.remove()


@dataclass
class CapacityRun:
    """One Engine's run of the trace: ``tokens`` per request (trace order), ``logp`` per request
    (its next-token log-probabilities per output step; kept for the exact Engine only),
    ``kl`` (one value per compared step) and ``figures``."""

    tokens: list[list[int]]
    logp: list[list[torch.Tensor]] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    figures: dict = field(default_factory=dict)


def run_engine(
    model: torch.nn.Module, requests: list[Request], spec: str | None, settings: FixedMemorySettings, reference: CapacityRun | None = None
) -> CapacityRun:
    """Serve ``requests`` on a fresh Engine with ``spec``'s codec (None: exact) in the fixed
    budget; with ``reference`` (the exact Engine's run), the KL of every step whose context
    matches it (see the module docstring), else each step's log-probabilities are kept."""
    _serve(model, [replace(r, prompt_ids=r.prompt_ids[:16], max_new_tokens=2) for r in requests[:2]], spec, settings, None)
    return _serve(model, requests, spec, settings, reference)


def _serve(model: torch.nn.Module, requests: list[Request], spec: str | None, settings: FixedMemorySettings, reference) -> CapacityRun:
    engine = kvlib.Engine(
        model,
        spec,
        page_budget_bytes=settings.memory_bytes,
        page_size=settings.page_size,
        max_batch_tokens=settings.max_batch_tokens,
        max_running=settings.max_running,
        prefix_cache=False,
    )
    index = {engine.add_request(r.prompt_ids, max_new_tokens=r.max_new_tokens, eos_token_id=None): i for i, r in enumerate(requests)}
    run = CapacityRun([[] for _ in requests], [[] for _ in requests] if reference is None else [])
    concurrent, seconds, peak_held = [], 0.0, 0
    with head_rows(model) as rows:
        while engine.has_unfinished:
            rows.clear()
            started = time.perf_counter()
            produced = engine.step()
            seconds += time.perf_counter() - started
            finished = sum(engine.requests[rid].state is RequestState.FINISHED for rid in produced)
            concurrent.append(len(engine.scheduler.running) + finished)
            peak_held = max(peak_held, engine.memory_report()["total_bytes"])
            for (rid, new), row in zip(produced.items(), rows[0] if produced else ()):
                _record(run, reference, index[rid], row)
                run.tokens[index[rid]].extend(new)
    stats, report = engine.stats(), engine.memory_report()
    run.figures = {
        "spec": spec or "exact",
        "pages_per_layer": engine.store.pools[0].capacity,
        "open_page_cost": engine.kv.open_page_cost,
        "max_concurrent": max(concurrent),
        "mean_concurrent": sum(concurrent) / len(concurrent),
        "preemptions": stats["preemptions"],
        "steps": stats["steps"],
        "output_tokens": stats["output_tokens"],
        "tokens_per_s": stats["output_tokens"] / seconds,
        "peak_held_bytes": peak_held,
        "peak_pages_bytes": report["peak_pages_bytes"],
    }
    return run


def _record(run: CapacityRun, reference: CapacityRun | None, i: int, row: torch.Tensor) -> None:
    """Keep request ``i``'s next-token log-probabilities (exact run) or its KL against the
    reference when the context matches (codec run)."""
    step = len(run.tokens[i])
    if reference is None:
        run.logp[i].append(torch.log_softmax(row.float(), -1).cpu())
    elif run.tokens[i] == reference.tokens[i][:step]:
        run.kl.append(float(kl_nats(reference.logp[i][step], row.cpu())))


def compare(model: torch.nn.Module, requests: list[Request], settings: FixedMemorySettings) -> dict:
    """Every Engine's figures (exact first), with concurrency ratios over the exact Engine's and
    each codec's KL and greedy agreement against it."""
    exact = run_engine(model, requests, None, settings)
    results = {"exact": exact.figures}
    print(f"exact: {exact.figures}", flush=True)
    for spec in settings.codecs:
        run = run_engine(model, requests, spec, settings, exact)
        steps = sum(len(t) for t in exact.tokens)
        figures = run.figures | {
            "max_concurrent_ratio": run.figures["max_concurrent"] / exact.figures["max_concurrent"],
            "mean_concurrent_ratio": run.figures["mean_concurrent"] / exact.figures["mean_concurrent"],
            "kl_mean_nats": sum(run.kl) / len(run.kl),
            "kl_max_nats": max(run.kl),
            "kl_steps": len(run.kl),
            "output_steps": steps,
            "agreement": agreement(exact.tokens, run.tokens),
        }
        results[spec] = figures
        print(f"{spec}: {figures}", flush=True)
    return results


def markdown(result: dict, command: str, target: float = 3.5, kl_target: float = 0.01) -> str:
    """The report: a table per Engine and the target's verdict for each codec."""
    t, s = result["trace"], result["settings"]
    mib = 2**20
    rows = []
    for name, m in result["engines"].items():
        ratio = f"{m['max_concurrent_ratio']:.2f}x / {m['mean_concurrent_ratio']:.2f}x" if name != "exact" else "1x / 1x"
        kl = f"{m['kl_mean_nats']:.4f} / {m['kl_max_nats']:.3f} ({m['kl_steps']}/{m['output_steps']})" if name != "exact" else ""
        agree = f"{m['agreement']['requests_identical']}/{m['agreement']['requests']}" if name != "exact" else ""
        rows.append(
            f"| {name} | {m['pages_per_layer']} ({m['open_page_cost']}) | {m['max_concurrent']} | {m['mean_concurrent']:.1f} | {ratio} "
            f"| {m['preemptions']} | {m['tokens_per_s']:.1f} | {m['peak_held_bytes'] / mib:.2f} | {m['peak_pages_bytes'] / mib:.2f} "
            f"| {kl} | {agree} |"
        )
    verdicts = [
        f"- {name}: {m['max_concurrent_ratio']:.2f}x the most concurrent requests, {m['mean_concurrent_ratio']:.2f}x the mean, "
        f"KL {m['kl_mean_nats']:.4f} nats: target (>= {target}x at KL <= {kl_target}) "
        + ("**met**" if m["max_concurrent_ratio"] >= target and m["kl_mean_nats"] <= kl_target else "**not met**")
        for name, m in result["engines"].items()
        if name != "exact"
    ]
    return "\n".join(
        [
            "# serve_bench, fixed memory: concurrent requests at the same page budget",
            "",
            f"Command: `{command}`",
            "",
            f"Model {result['config']['model']} ({result['model_note']}). Trace: {t['requests']} requests arriving at once, prompts "
            f"{t['prompt_tokens_min']}-{t['prompt_tokens_max']} tokens ({t['prompt_tokens']} in all), {t['new_tokens']} output tokens each, "
            f"greedy, no EOS. Every Engine: page budget {s['memory_bytes'] / mib:.2f} MiB, pages of {s['page_size']} tokens, "
            f"{s['max_batch_tokens']} tokens per forward pass, at most {s['max_running']} running, no prefix cache. "
            f"Machine: {result['machine']}; 1-minute load {result['load_avg_1min'][0]} before, {result['load_avg_1min'][1]} after "
            f"(other processes share the cores: tokens/s are noisy); {result['seconds']} s. Library revision: {result['git']}.",
            "",
            "| engine | pages per layer (open page cost) | most concurrent | mean concurrent | ratio (most / mean) | preemptions "
            "| output tok/s | most held after a step (MiB) | page bytes peak in a step (MiB) | KL mean / max nats (steps compared) "
            "| greedy identical |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            *verdicts,
            "",
            "Concurrent: requests holding pages after a step (running, or finishing in it). Held after a step: pages (open raw, "
            "sealed encoded), codec metadata, positions (int64 per slot, outside the page budget) and block tables. The in-step "
            "page peak adds a prefill chunk's raw pages before its layer seals them. KL(exact || codec) per output step, on the steps "
            "whose context (prompt and earlier outputs) equals the exact Engine's: teacher forcing on the exact outputs up to the "
            "first greedy disagreement, that step included (see benchmarks/serve_fixed_memory.py).",
        ]
    )
