"""ShadowKV and ClusterKV against Quest at equal device bytes on SmolLM2-135M-Instruct: quality and decode speed.

- Quality: a natural-text prompt of ``--context`` tokens (RULER's essay filler, BOS first); the
  full cache decodes ``--steps`` greedy tokens; each spec's cache is fed them one at a time
  (teacher forcing): mean KL(full || spec) in nats per step and agreement (its argmax is the full
  cache's token). For each pages-read budget K (pages per KV head and decode step): ``quest(top_k=K)``,
  ``shadowkv(pages=K - 4, window=2, outliers=2)``, ``clusterkv(top_k=K)`` (pages arranged by key
  cluster after the prompt, chosen by centre score) and ``random_pages(top_k=K)`` (the control), all
  with the same device budget for whole pages (``window + outliers`` pages per head and layer:
  quest's, clusterkv's and random_pages' through ``lru``), so the device holds the same bytes; the device and host bytes of
  each at the end (``memory_report``) and the host pages read per decode step and layer.
- Speed: greedy decode tok/s after the same prompt, configs interleaved over ``--repeats``
  (medians; the spread is reported): the exact cache (no read mirror), ``lru`` at that device
  budget (every step reads every host page), ``quest(top_k=16)`` over it, ``shadowkv(pages=12)``,
  and ``quest(top_k=16)`` with every page on the device.

Usage:

    python benchmarks/shadowkv_bench.py [--context 2048] [--steps 32] [--decode-steps 16] [--repeats 3] [--sections quality,speed]
        [--out benchmarks/results]
    python benchmarks/shadowkv_bench.py --quick --out /tmp/x

Writes ``shadowkv_bench.md`` and ``shadowkv_bench.json`` to ``--out`` (``shadowkv_bench_<section>.*`` for one section).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import kvlib
from kvlib.eval import load_model
from kvlib.eval.agreement import agreement_metrics, greedy_reference
from kvlib.model_shape import kv_shape
from kvlib.transformers_compat import cache_argument

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from codec_quality_smollm2 import natural_prompt  # noqa: E402
from provenance import add_run_arguments, command_line, parse_run_arguments, run_metadata, write_report  # noqa: E402
from tier_bench import decode_rate  # noqa: E402

FULL = {"context": 2048, "steps": 32, "decode_steps": 16, "repeats": 3}
QUICK = {"context": 160, "steps": 4, "decode_steps": 2, "repeats": 1}
BUDGETS = (8, 16)
"""Pages read per KV head and decode step (window + outliers + chosen)."""
WINDOW, OUTLIERS = 2, 2


def device_mb(model: torch.nn.Module, pages_per_head: int) -> float:
    """MiB of ``pages_per_head`` whole 16-token pages of every layer and KV head (batch 1)."""
    shape = kv_shape(model)
    element = next(model.parameters()).element_size()
    return pages_per_head * shape.num_layers * shape.num_kv_heads * 16 * (shape.head_dim + shape.value_dim) * element / 2**20


def specs(budget: int, device: float) -> dict[str, str]:
    """The compared specs at ``budget`` pages read per head and step and ``device`` MiB of pages."""
    lru = f"lru(device_mb={device:.6f})"
    return {
        "quest": f"quest(top_k={budget}, placement={lru!r})",
        "shadowkv": f"shadowkv(pages={budget - WINDOW - OUTLIERS}, window={WINDOW}, outliers={OUTLIERS}, device_mb={device:.6f})",
        "clusterkv": f"clusterkv(top_k={budget}, placement={lru!r})",
        "random_pages": f"random_pages(top_k={budget}, placement={lru!r})",
    }


def quality_run(model: torch.nn.Module, spec: str, prompt: torch.Tensor, fed: torch.Tensor, reference: torch.Tensor) -> dict:
    """Teacher-forced ``spec`` over ``fed`` (prefill ``prompt``, then ``fed[:, :-1]`` one token at a
    time): KL, agreement, bytes by tier, host pages read per decode step and layer."""
    cache = kvlib.make_cache(model, spec)
    with torch.inference_mode():
        logits = [model(input_ids=prompt, **cache_argument(cache), use_cache=True, logits_to_keep=1).logits[:, -1].float()]
        before = sum(pool.host_pages_read for pool in cache.store.pools)
        for t in range(fed.shape[1] - 1):
            logits.append(model(input_ids=fed[:, t : t + 1], **cache_argument(cache), use_cache=True).logits[:, -1].float())
    report = cache.memory_report()
    metrics = agreement_metrics(fed, reference, torch.stack(logits, 1))
    host_reads = sum(pool.host_pages_read for pool in cache.store.pools) - before
    return {
        "spec": spec,
        "kl": metrics["kl"],
        "agreement": metrics["agreement"],
        "by_tier": report["by_tier"],
        "key_summaries": report["by_component"]["key_summaries"],
        "host_pages_per_step_layer": host_reads / max(fed.shape[1] - 1, 1) / len(cache.store.pools),
    }


def quality(model: torch.nn.Module, prompt: torch.Tensor, steps: int, device: float) -> list[dict]:
    tokens, reference = greedy_reference(model, kvlib.make_cache(model), prompt, steps)
    rows = []
    for budget in BUDGETS:
        for name, spec in specs(budget, device).items():
            rows.append({"budget": budget, "name": name, **quality_run(model, spec, prompt, tokens, reference)})
            print(f"quality {spec}: KL {rows[-1]['kl']:.4f}", file=sys.stderr, flush=True)
    return rows


def speed(model: torch.nn.Module, prompt: torch.Tensor, steps: int, repeats: int, device: float) -> dict:
    """Decode tok/s of each config, interleaved: medians, minima and maxima over ``repeats``."""
    budget = 16
    configs = {
        "exact (no mirror)": (None, {"read_cache": False}),
        "lru": (f"lru(device_mb={device:.6f})", {}),
        "quest over lru": (specs(budget, device)["quest"], {}),
        "shadowkv": (specs(budget, device)["shadowkv"], {}),
        "quest, all on device": (f"quest(top_k={budget})", {}),
    }
    for spec, options in configs.values():  # warm-up
        decode_rate(model, spec, options, prompt[:, :32], 2)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, (spec, options) in configs.items():
            rates[name].append(decode_rate(model, spec, options, prompt, steps)[0])
            print(f"speed {name}: {rates[name][-1]:.2f} tok/s", file=sys.stderr, flush=True)
    return {name: {"spec": configs[name][0], "median": statistics.median(r), "min": min(r), "max": max(r)} for name, r in rates.items()}


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, help=f"prompt tokens (default {FULL['context']})")
    parser.add_argument("--steps", type=int, help=f"teacher-forced steps for quality (default {FULL['steps']})")
    parser.add_argument("--decode-steps", type=int, help=f"greedy steps timed (default {FULL['decode_steps']})")
    parser.add_argument("--repeats", type=int, help=f"timed repeats (default {FULL['repeats']})")
    parser.add_argument("--sections", default="quality,speed", help="comma-separated sections to run: quality, speed (default both)")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    loaded = load_model("smollm2")
    model = loaded.model
    kvlib.attach(model)
    prompt = natural_prompt(loaded.tokenizer, args.context)
    device = device_mb(model, WINDOW + OUTLIERS)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    sections = args.sections.split(",")
    if not sections or set(sections) - {"quality", "speed"}:
        parser.error(f"--sections takes quality and/or speed, comma-separated; got {args.sections!r}")
    result = {
        "device_mb": device,
        "quality": quality(model, prompt, args.steps, device) if "quality" in sections else [],
        "speed": speed(model, prompt, args.decode_steps, args.repeats, device) if "speed" in sections else {},
    }
    result.update(run_metadata(args, load_before, started))
    name = "shadowkv_bench" if set(sections) == {"quality", "speed"} else "shadowkv_bench_" + "_".join(sections)
    write_report(args.out, name, _markdown(result, argv), result)
    return result


def _markdown(result: dict, argv: Sequence[str] | None) -> str:
    c = result["config"]
    lines = [
        "# shadowkv_bench: ShadowKV and ClusterKV against Quest at equal device bytes (SmolLM2-135M-Instruct)",
        "",
        f"Command: `{command_line('shadowkv_bench.py', argv)}`",
        "",
        f"Prompt {c['context']} tokens of essay text; quality: {c['steps']} teacher-forced steps against the full cache. Machine:"
        f" {result['machine']}; 1-minute load {result['load_avg_1min'][0]} before, {result['load_avg_1min'][1]} after;"
        f" {result['seconds']} s. Library revision: {result['git']}.",
        "",
        f"Device budget for whole pages: {result['device_mb']:.3f} MiB ({WINDOW + OUTLIERS} pages per KV head and layer: the window and"
        " the outliers) for every spec; the key summaries (min and max per page) come on top for all of them.",
    ]
    if result["quality"]:
        lines += _quality_markdown(result["quality"])
    if result["speed"]:
        lines += _speed_markdown(result["speed"], c)
    return "\n".join(lines) + "\n"


def _quality_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "| pages read / head / step | policy | KL (nats/step) | agreement | device bytes | host bytes | key summaries |"
        " host pages read / step / layer |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        tiers = row["by_tier"]
        lines.append(
            f"| {row['budget']} | `{row['spec']}` | {row['kl']:.4f} | {row['agreement']:.3f} | {tiers['device']:,} | {tiers['host']:,} |"
            f" {row['key_summaries']:,} | {row['host_pages_per_step_layer']:.1f} |"
        )
    return lines


def _speed_markdown(speed: dict, c: dict) -> list[str]:
    lines = [
        "",
        f"Decode tok/s after the prompt ({c['decode_steps']} greedy steps, median [min, max] of {c['repeats']}, configs interleaved):",
        "",
        "| config | spec | tok/s | vs exact |",
        "|---|---|---:|---:|",
    ]
    exact = speed["exact (no mirror)"]["median"]
    for name, row in speed.items():
        lines.append(
            f"| {name} | `{row['spec']}` | {row['median']:.2f} [{row['min']:.2f}, {row['max']:.2f}] | {row['median'] / exact:.2f}x |"
        )
    return lines


if __name__ == "__main__":
    run()
