"""The Engine's serving features on and off, side by side in one run, interleaved
(``serve_bench.py --features``): global prefix grouping in ``Engine.generate`` (BatchLLM),
forecast admission (Past-Future) against reserve-based admission, shared-prefix attention
(Hydragen) and suffix speculation (SuffixDecoding).

- Prefix grouping: ``groups`` prefixes of ``prefix`` tokens, each opening ``per_group`` prompts
  with their own 8 to 40 tokens, shuffled, served by one ``Engine.generate`` call under a page
  budget (``page_mib``), with ``group_prefixes`` on and off. Figures: prompt tokens computed
  (``stats()["prompt_tokens"] - stats()["cached_tokens"]``: every admission's uncached tokens,
  recomputations included), preemptions, steps and wall time; greedy outputs compared.
- Forecast admission: ``requests`` requests arriving at once, prompts of ``prompt_tokens`` (128 to
  384 by default: with 32 to 96, a preemption recomputes little and both admissions ran within
  the noise of each other), output lengths skewed (``short_share`` of them 4 to 16 tokens, the rest 96 to 160; each request's
  ``max_new_tokens`` is its length: the random models have no EOS), served by ``add_request``
  and ``step`` under a page budget, ``admission="forecast"`` against ``"reserve"``. Each engine
  first serves an untimed warm-up trace of ``requests`` more requests drawn from the same
  distribution (a serving engine's history: the forecast learns the output lengths from it, and
  first calls' compilation happens outside the timing). Figures for the measured trace only:
  preemptions, goodput (output tokens / makespan, s), TTFT and TBT p50/p99; greedy outputs compared.
- Shared-prefix attention: ``shared_rows`` requests share a prompt of ``shared_prompt`` tokens;
  decode steps of one engine alternate the split on (``shared_prefix=0``: wherever pages are
  shared) and off (``shared_prefix_bench.interleaved``). Figures: K/V MiB read per decode step,
  decode tokens/s; greedy outputs of a short run each compared.
- Suffix speculation: ``speculate_requests`` repeated-edit and JSON-loop requests of
  ``speculate_new`` output tokens, and ``speculate_trace_requests`` requests of the mixed serving
  trace, with ``speculate="suffix"`` and without (``speculate_bench.compare``). Figures: output
  tokens/s, steps, accepted tokens per verification; greedy outputs compared.

Each variant runs ``repeats`` times, variants interleaved; a variant's times are the median (the
shared-prefix split: ``shared_steps`` decode steps, half each way).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch
from shared_prefix_bench import PAGE_SIZE, interleaved
from shared_prefix_bench import outputs as shared_prefix_outputs
from shared_prefix_bench import prompts as shared_prompts
from speculate_bench import compare as compare_speculation
from speculate_bench import edit_prompts, json_prompts, mixed_prompts

import kvlib

MIB = 2**20


@dataclass(frozen=True)
class FeatureSettings:
    groups: int = 8
    per_group: int = 6
    prefix: int = 256
    group_page_mib: float = 1.0
    requests: int = 64
    prompt_tokens: tuple[int, int] = (128, 384)
    short_share: float = 0.8
    forecast_page_mib: float = 2.0
    page_size: int = 16
    max_batch_tokens: int = 256
    shared_rows: int = 16
    shared_prompt: int = 768
    shared_steps: int = 16
    speculate_requests: int = 8
    speculate_new: int = 128
    speculate_trace_requests: int = 16
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
        low, high = settings.prompt_tokens
        requests.append(([rng.randrange(3, vocab) for _ in range(rng.randrange(low, high + 1))], length))
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


def run_shared_prefix(model: torch.nn.Module, settings: FeatureSettings) -> dict:
    batch = shared_prompts(model.config.vocab_size, settings.shared_rows, settings.shared_prompt, settings.seed)
    shared = settings.shared_prompt // PAGE_SIZE * PAGE_SIZE  # the full pages the later requests attach
    variants = interleaved(model, batch, shared, settings.shared_steps, max_batch_tokens=2 * settings.max_batch_tokens)
    on, off = (shared_prefix_outputs(model, batch, 4, 2 * settings.max_batch_tokens, flag) for flag in (0, False))
    return {
        "rows": settings.shared_rows,
        "prompt": settings.shared_prompt,
        "variants": variants,
        "outputs_equal": on == off,
        "ratios": {
            "K/V read off/on": variants["off"]["kv_read_mib_per_step"] / variants["on"]["kv_read_mib_per_step"],
            "decode tok/s on/off": variants["on"]["tokens_per_s"] / variants["off"]["tokens_per_s"],
        },
    }


def run_speculation(model: torch.nn.Module, settings: FeatureSettings, byte_level: bool) -> dict:
    """``byte_level``: the model's ids 0-255 are bytes (the embedded default model), so the JSON
    loop is text."""
    vocab, new = model.config.vocab_size, settings.speculate_new
    workloads = {
        "edits": [(prompt, new) for prompt in edit_prompts(vocab, settings.speculate_requests, settings.seed)],
        "json": [
            (prompt, new) for prompt in json_prompts("default" if byte_level else "", vocab, settings.speculate_requests, settings.seed)
        ],
        "mixed": mixed_prompts(vocab, settings.speculate_trace_requests, settings.seed, quick=not byte_level),
    }
    return compare_speculation(model, workloads, settings.repeats, settings.max_batch_tokens)


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
        "# serve_bench --features: serving features on and off, one run, interleaved",
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
    h = result["shared_prefix"]
    lines += [
        "",
        f"## Shared-prefix attention: {h['rows']} requests sharing a {h['prompt']}-token prompt, decode steps alternating",
        "",
        "| split | K/V MiB read per step | as expected | decode tok/s |",
        "|---|---:|---|---:|",
        *[
            f"| {name} | {v['kv_read_mib_per_step']:.2f} | {v['kv_read_as_expected']} | {v['tokens_per_s']:.0f} {v['tokens_per_s_range']} |"
            for name, v in h["variants"].items()
        ],
        "",
        *[f"- {k}: **{r:.2f}x**" for k, r in h["ratios"].items()],
        "- targets: K/V read 1 prefix + each request's suffix; decode tok/s >= 2x (16 x 2k)",
        f"- greedy outputs equal: {h['outputs_equal']}",
        "",
        "## Suffix speculation: repetitive workloads and the mixed trace, with and without",
        "",
        "| workload | requests | output tokens | tok/s off | tok/s suffix | speedup | steps off / suffix | accepted per verification | outputs equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in result["speculation"].items():
        off, on = row["variants"]["off"], row["variants"]["suffix"]
        lines.append(
            f"| {name} | {row['requests']} | {row['output_tokens']} | {off['tokens_per_s']:.1f} {off['tokens_per_s_runs']}"
            f" | {on['tokens_per_s']:.1f} {on['tokens_per_s_runs']} | **{row['speedup']:.2f}x** | {off['steps']} / {on['steps']}"
            f" | {on['accepted_per_verification']:.2f} | {row['outputs_equal']} |"
        )
    lines += ["", "- targets: repetitive workloads >= 2x, the mixed trace >= 1.0x"]
    return "\n".join(lines)
