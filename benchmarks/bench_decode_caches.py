"""Bytes held and decode speed of kvlib caches against ``DynamicCache``, in one run (issue 19's table).

For each model and context length, every cache runs the same prompt (random token ids, seeded):
one forward over the prompt, then ``--new-tokens`` greedy single-token forwards (see
``bench_generate.generate_once``), through :func:`kvlib.eval.decode_timing.measure`: a warm-up run
of each cache (the same run, untimed: kernels compile there, and what it took beyond a timed run
is reported as the first call's extra seconds), then ``--repeats`` interleaved rounds. Reported
per cache, as ratios against the DynamicCache of the same round (median and range):

- ``bytes``: what the cache holds at the end of decode (kvlib: ``memory_report()["total_bytes"]``,
  pages, positions, tables and any read mirror; DynamicCache: its keys and values), and kvlib's
  ``peak_workspace_bytes`` (transient dense copies for attention, freed after each call);
- ``decode``: decode tokens/s.

Caches (``--caches``, comma-separated): ``exact`` (``make_cache(model)``), ``streaming_llm``,
``snapkv`` and ``h2o`` with an ``int`` budget of a quarter of the context held while decoding
(``*_int25``; ``*_int25_slack16``: the same cap with ``slack=16``, so a head evicts 16 tokens
every 16 decode steps instead of one every step), ``snapkv_0.25`` (prompt compression to a
quarter), ``kivi4`` (``kivi(bits=4)``).
The exact cache's greedy tokens must equal DynamicCache's (asserted after the report is written).

Models (``provenance.load_bench_model``): ``llama100m`` (a seeded random-weight ~100M Llama, fp32,
see ``provenance.LLAMA100M``), ``smollm2`` (SmolLM2-135M-Instruct through ``kvlib.eval.load_model``;
30 layers, 3 KV heads) and ``default`` (the embedded default model; ``--quick`` runs it).

    python benchmarks/bench_decode_caches.py [--models llama100m,smollm2] [--contexts 2048,8192]
        [--caches exact,streaming_llm_int25,...] [--new-tokens 32] [--repeats 2] [--threads N] [--device cuda]
    python benchmarks/bench_decode_caches.py --quick --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

import kvlib
from kvlib.eval.decode_timing import Spread, measure

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from bench_generate import decode_timer  # noqa: E402
from provenance import add_run_arguments, command_line, load_bench_model, parse_run_arguments, run_metadata, write_report  # noqa: E402

MODELS = ("llama100m", "smollm2", "default")
FULL = {
    "models": "llama100m,smollm2",
    "contexts": "2048,8192",
    "caches": "exact,streaming_llm_int25,snapkv_int25,h2o_int25,snapkv_0.25,kivi4",
    "new_tokens": 32,
    "repeats": 2,
}
QUICK = {"models": "default", "contexts": "64", "caches": "exact,streaming_llm_int25,snapkv_0.25,kivi4", "new_tokens": 4, "repeats": 1}


def cache_factories(context: int) -> dict[str, Callable[[torch.nn.Module], object]]:
    """Each cache name's constructor for a model, budgets sized to ``context``."""
    quarter = max(1, context // 4)
    return {
        "dynamic": lambda model: DynamicCache(config=model.config),
        "exact": lambda model: kvlib.make_cache(model),
        "streaming_llm_int25": lambda model: kvlib.make_cache(model, "streaming_llm", budget=quarter),
        "snapkv_int25": lambda model: kvlib.make_cache(model, "snapkv", budget=quarter),
        "h2o_int25": lambda model: kvlib.make_cache(model, "h2o", budget=quarter),
        "streaming_llm_int25_slack16": lambda model: kvlib.make_cache(model, "streaming_llm", budget=quarter, slack=16),
        "snapkv_int25_slack16": lambda model: kvlib.make_cache(model, "snapkv", budget=quarter, slack=16),
        "snapkv_0.25": lambda model: kvlib.make_cache(model, "snapkv", budget=0.25),
        "kivi4": lambda model: kvlib.make_cache(model, "kivi(bits=4)"),
    }


def bench_context(model: torch.nn.Module, context: int, caches: list[str], args: argparse.Namespace) -> dict:
    factories = cache_factories(context)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(context)).to(model.device)
    kinds = ["dynamic", *caches]
    timers = [decode_timer(model, lambda kind=kind: factories[kind](model), prompt, args.new_tokens) for kind in kinds]
    timings = dict(zip(kinds, measure(timers, args.repeats, errors=())))
    runs = {kind: [run.detail for run in timing.runs] for kind, timing in timings.items()}
    dynamic = runs["dynamic"]
    row: dict = {
        "context": context,
        "dynamic_bytes": dynamic[-1]["cache_bytes"],
        "dynamic_decode_tok_s": timings["dynamic"].speed.median,
        "dynamic_first_call_s": timings["dynamic"].first_call_s,
        "caches": {},
    }
    for kind in caches:
        speed = timings[kind].vs(timings["dynamic"])
        ratio = Spread.of(speed)
        last = runs[kind][-1]
        row["caches"][kind] = {
            "bytes": last["cache_bytes"],
            "bytes_vs_dynamic": last["cache_bytes"] / row["dynamic_bytes"],
            "components": last["cache_components"],
            "peak_workspace_bytes": last["peak_workspace_bytes"],
            "decode_tok_s": timings[kind].speed.median,
            "decode_vs_dynamic": ratio.median,
            "decode_vs_dynamic_low": ratio.low,
            "decode_vs_dynamic_high": ratio.high,
            "all_decode_vs_dynamic": speed,
            "first_call_s": timings[kind].first_call_s,
            "tokens_match": all(torch.equal(run["tokens"], dynamic[0]["tokens"]) for run in runs[kind]),
        }
    return row


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help=f"comma-separated, from {','.join(MODELS)} (default {FULL['models']})")
    parser.add_argument("--contexts", help=f"prompt tokens, comma-separated (default {FULL['contexts']})")
    parser.add_argument("--caches", help=f"comma-separated, from {','.join(list(cache_factories(4))[1:])} (default {FULL['caches']})")
    parser.add_argument("--new-tokens", type=int, help=f"decode steps (default {FULL['new_tokens']})")
    parser.add_argument("--repeats", type=int, help=f"interleaved rounds (default {FULL['repeats']})")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model and caches live (default cpu)")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    load_before, started = os.getloadavg()[0], time.perf_counter()
    models = [m for m in args.models.split(",") if m]
    caches = [c for c in args.caches.split(",") if c]
    known = list(cache_factories(4))[1:]
    for given, allowed, what in ((models, MODELS, "models"), (caches, known, "caches")):
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            parser.error(f"unknown {what} {unknown}; choose from {', '.join(allowed)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device; none is available")
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for name in models:
        model = load_bench_model(name).to(args.device)
        kvlib.attach(model)  # every cache runs through the same attention function
        for context in contexts:
            load_before = os.getloadavg()[0]
            row = {"model": name, "device": args.device, **bench_context(model, context, caches, args)}
            row["load_avg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            rows.append(row)
            for kind, figures in row["caches"].items():
                print(
                    f"{name} {context}: {kind} bytes {figures['bytes_vs_dynamic']:.3f}x decode {figures['decode_vs_dynamic']:.2f}x",
                    flush=True,
                )
        del model
    result = {**run_metadata(args, load_before, started), "command": command_line("bench_decode_caches.py", argv), "rows": rows}
    write_report(args.out, "bench_decode_caches", _markdown(result), result)
    mismatched = [(row["model"], row["context"]) for row in rows if "exact" in row["caches"] and not row["caches"]["exact"]["tokens_match"]]
    assert not mismatched, f"the exact cache's greedy tokens differ from DynamicCache's for {mismatched}"
    return result


def _markdown(result: dict) -> str:
    lines = [
        "# bench_decode_caches: bytes held and decode speed against DynamicCache",
        "",
        f"Command: `{result['command']}`. Machine: {result['machine']}. Library revision: {result['git']}. "
        f"1-minute load before/after: {result['load_avg_1min']}; {result['seconds']} s.",
        "",
        "Ratios against DynamicCache measured in the same run (a warm-up run of every cache, then interleaved rounds; "
        "decode: median [min, max] of the per-round ratios, all rounds listed; first call: the seconds the warm-up run "
        "took beyond a timed one, kernel compilation included). Bytes: held at the end of decode; workspace: kvlib's "
        "peak transient dense copy (freed after each call), as a share of DynamicCache's bytes.",
        "",
        f"Device: {', '.join(sorted({row['device'] for row in result['rows']})) or '-'}.",
        "",
        "| model | context | cache | bytes vs DynamicCache | workspace peak | decode vs DynamicCache | rounds | first call (s) "
        "| tokens = DynamicCache | load |",
        "|---|---:|---|---:|---:|---:|---|---:|---|---|",
    ]
    for row in result["rows"]:
        for kind, f in row["caches"].items():
            workspace = f["peak_workspace_bytes"] / row["dynamic_bytes"]
            rounds = ", ".join(f"{r:.2f}" for r in f["all_decode_vs_dynamic"])
            lines.append(
                f"| {row['model']} | {row['context']} | {kind} | {f['bytes_vs_dynamic']:.3f}x | {workspace:.3f}x | "
                f"{Spread(f['decode_vs_dynamic'], f['decode_vs_dynamic_low'], f['decode_vs_dynamic_high']).text('{:.2f}x'.format)} | "
                f"{rounds} | {f['first_call_s']:.2f} | {'yes' if f['tokens_match'] else 'no'} | "
                f"{row['load_avg_1min'][0]:.1f}, {row['load_avg_1min'][1]:.1f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run()
