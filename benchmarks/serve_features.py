"""The Engine's scheduling features on and off, side by side in one run, interleaved
(``serve_bench.py --features``): global prefix grouping in ``Engine.generate`` (BatchLLM) and
forecast admission (Past-Future) against reserve-based admission.

- Prefix grouping: ``groups`` prefixes of ``prefix`` tokens, each opening ``per_group`` prompts
  with their own 8 to 40 tokens, shuffled, served by one ``Engine.generate`` call under a page
  budget (``page_mib``), with ``group_prefixes`` on and off. Figures: prompt tokens computed
  (``stats()["prompt_tokens"] - stats()["cached_tokens"]``: every admission's uncached tokens,
  recomputations included), preemptions, steps and wall time; greedy outputs compared.
- Forecast admission: ``requests`` requests arriving at once, prompts of 32 to 96 tokens, output
  lengths skewed (``short_share`` of them 4 to 16 tokens, the rest 96 to 160; each request's
  ``max_new_tokens`` is its length: the random models have no EOS), served by ``add_request``
  and ``step`` under a page budget, ``admission="forecast"`` against ``"reserve"``. Each engine
  first serves an untimed warm-up trace of ``requests`` more requests drawn from the same
  distribution (a serving engine's history: the forecast learns the output lengths from it, and
  first calls' compilation happens outside the timing). Figures for the measured trace only:
  preemptions, goodput (output tokens / makespan, s), TTFT and TBT p50/p99; greedy outputs compared.

Each variant runs ``repeats`` times, variants interleaved; a variant's times are the median.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

import kvlib

MIB = 2**20


@dataclass(frozen=True)
class FeatureSettings:
    groups: int = 8
    per_group: int = 6
    prefix: int = 256
    group_page_mib: float = 1.0
    requests: int = 48
    short_share: float = 0.8
    forecast_page_mib: float = 2.0
    page_size: int = 16
    max_batch_tokens: int = 256
    repeats: int = 3
    seed: int = 0


def grouped_prompts(settings: FeatureSettings, vocab: int) -> list[list[int]]:
    rng = random.Random(settings.seed)
    prompts = []
    for _ in range(settings.groups):
        prefix = [rng.randrange(3, vocab) for _ in range(settings.prefix)]
        prompts += [prefix + [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 41))] for _ in range(settings.per_group)]
    rng.shuffle(prompts)
    return prompts


def skewed_requests(settings: FeatureSettings, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    requests = []
    for _ in range(settings.requests):
        length = rng.randrange(4, 17) if rng.random() < settings.short_share else rng.randrange(96, 161)
        requests.append(([rng.randrange(3, vocab) for _ in range(rng.randrange(32, 97))], length))
    return requests


def _percentile(values: list[float], q: float) -> float:
    return float(torch.tensor(values, dtype=torch.float64).quantile(q)) if values else 0.0


def run_grouping(model: torch.nn.Module, settings: FeatureSettings) -> dict:
    prompts = grouped_prompts(settings, model.config.vocab_size)
    budget = round(settings.group_page_mib * MIB)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    outputs = {}
    for group_prefixes in (True, False):  # untimed, whole runs: the first grouped one took 5x longer (first calls' compilation)
        engine = kvlib.Engine(model, page_budget_bytes=budget, page_size=settings.page_size, max_batch_tokens=settings.max_batch_tokens)
        engine.generate(prompts, max_new_tokens=16, group_prefixes=group_prefixes)
    for _ in range(settings.repeats):
        for group_prefixes in (True, False):
            engine = kvlib.Engine(model, page_budget_bytes=budget, page_size=settings.page_size, max_batch_tokens=settings.max_batch_tokens)
            started = time.perf_counter()
            outputs[group_prefixes] = engine.generate(prompts, max_new_tokens=16, group_prefixes=group_prefixes)
            wall = time.perf_counter() - started
            stats = engine.stats()
            runs[group_prefixes].append(
                {
                    "wall_s": wall,
                    "prompt_tokens_computed": stats["prompt_tokens"] - stats["cached_tokens"],
                    "preemptions": stats["preemptions"],
                    "steps": stats["steps"],
                }
            )
    summary = {name: _summary(runs[flag]) for name, flag in (("grouped", True), ("ungrouped", False))}
    return {
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "page_budget_mib": settings.group_page_mib,
        "variants": summary,
        "outputs_equal": outputs[True] == outputs[False],
        "ratios": {
            "prompt_tokens_computed ungrouped/grouped": summary["ungrouped"]["prompt_tokens_computed"]
            / summary["grouped"]["prompt_tokens_computed"],
            "wall_s ungrouped/grouped": summary["ungrouped"]["wall_s"] / summary["grouped"]["wall_s"],
        },
    }


def _serve(
    model: torch.nn.Module,
    warm_up: list[tuple[list[int], int]],
    requests: list[tuple[list[int], int]],
    settings: FeatureSettings,
    admission: str,
) -> tuple[dict, list]:
    engine = kvlib.Engine(
        model,
        page_budget_bytes=round(settings.forecast_page_mib * MIB),
        page_size=settings.page_size,
        max_batch_tokens=settings.max_batch_tokens,
        admission=admission,
    )
    for prompt, length in warm_up:
        engine.add_request(prompt, max_new_tokens=length)
    while engine.has_unfinished:
        engine.step()
    warm_preemptions, warm_steps = engine.stats()["preemptions"], engine.stats()["steps"]
    started = time.perf_counter()
    ids = [engine.add_request(prompt, max_new_tokens=length) for prompt, length in requests]
    while engine.has_unfinished:
        engine.step()
    makespan = time.perf_counter() - started
    stats = [engine.request_stats(i) for i in ids]
    ttft = [s["ttft_s"] for s in stats]
    tbt = [gap for s in stats for gap in s["tbt_s"]]
    output_tokens = sum(s["output_tokens"] for s in stats)
    figures = {
        "wall_s": makespan,
        "preemptions": engine.stats()["preemptions"] - warm_preemptions,
        "goodput_tok_s": output_tokens / makespan,
        "ttft_p50_s": _percentile(ttft, 0.5),
        "ttft_p99_s": _percentile(ttft, 0.99),
        "tbt_p50_s": _percentile(tbt, 0.5),
        "tbt_p99_s": _percentile(tbt, 0.99),
        "steps": engine.stats()["steps"] - warm_steps,
    }
    return figures, [engine.collect(i) for i in ids]


def run_forecast(model: torch.nn.Module, settings: FeatureSettings) -> dict:
    warm_up = skewed_requests(settings, model.config.vocab_size, settings.seed + 2)
    requests = skewed_requests(settings, model.config.vocab_size, settings.seed + 1)
    runs: dict[str, list[dict]] = {"forecast": [], "reserve": []}
    outputs = {}
    for _ in range(settings.repeats):
        for admission in runs:
            figures, outputs[admission] = _serve(model, warm_up, requests, settings, admission)
            runs[admission].append(figures)
    summary = {name: _summary(values) for name, values in runs.items()}
    forecast, reserve = summary["forecast"], summary["reserve"]
    return {
        "requests": len(requests),
        "output_tokens": sum(length for _, length in requests),
        "page_budget_mib": settings.forecast_page_mib,
        "variants": summary,
        "outputs_equal": outputs["forecast"] == outputs["reserve"],
        "ratios": {
            "preemptions forecast/reserve": forecast["preemptions"] / reserve["preemptions"] if reserve["preemptions"] else None,
            "goodput forecast/reserve": forecast["goodput_tok_s"] / reserve["goodput_tok_s"],
        },
    }


def _summary(runs: list[dict]) -> dict:
    """Medians over repeats, with each figure's spread (min, max) as ``<name>_range``."""
    out = {}
    for name in runs[0]:
        values = [run[name] for run in runs]
        out[name] = statistics.median(values)
        out[f"{name}_range"] = [min(values), max(values)]
    return out


def markdown(result: dict, command: str) -> str:
    g, f = result["grouping"], result["forecast"]
    lines = [
        "# serve_bench --features: scheduling features on and off, one run, interleaved",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {result['machine']}; load {result['load_avg_1min'][0]} before, {result['load_avg_1min'][1]} after; "
        f"revision {result['git']}. Medians of {result['settings']['repeats']} interleaved repeats [min, max].",
        "",
        f"## Global prefix grouping: {g['prompts']} shuffled prompts, {g['prompt_tokens']} prompt tokens, {g['page_budget_mib']} MiB of pages",
        "",
        "| variant | prompt tokens computed | preemptions | steps | wall (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, v in g["variants"].items():
        lines.append(
            f"| {name} | {v['prompt_tokens_computed']:.0f} | {v['preemptions']:.0f} | {v['steps']:.0f} "
            f"| {v['wall_s']:.2f} [{v['wall_s_range'][0]:.2f}, {v['wall_s_range'][1]:.2f}] |"
        )
    lines += ["", *[f"- {k}: **{r:.2f}x**" for k, r in g["ratios"].items()], f"- greedy outputs equal: {g['outputs_equal']}", ""]
    lines += [
        f"## Forecast admission: {f['requests']} requests at once, {f['output_tokens']} output tokens (skewed), {f['page_budget_mib']} MiB of pages",
        "",
        "| admission | preemptions | goodput (tok/s) | TTFT p50 (ms) | TTFT p99 (ms) | TBT p50 (ms) | TBT p99 (ms) | steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in f["variants"].items():
        lines.append(
            f"| {name} | {v['preemptions']:.0f} | {v['goodput_tok_s']:.1f} [{v['goodput_tok_s_range'][0]:.1f}, {v['goodput_tok_s_range'][1]:.1f}] "
            f"| {v['ttft_p50_s'] * 1e3:.0f} | {v['ttft_p99_s'] * 1e3:.0f} | {v['tbt_p50_s'] * 1e3:.0f} | {v['tbt_p99_s'] * 1e3:.0f} | {v['steps']:.0f} |"
        )
    ratios = [f"- {k}: **{r:.2f}x**" if r is not None else f"- {k}: no preemptions with reserve" for k, r in f["ratios"].items()]
    lines += ["", *ratios, "- targets: preemptions <= 0.5x, goodput >= 1.0x", f"- greedy outputs equal: {f['outputs_equal']}"]
    return "\n".join(lines)
