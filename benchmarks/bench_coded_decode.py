"""Decode tokens/s and bytes of quantized caches (sealed pages decoded inside the paged-attention
kernel) against the exact kvlib cache and ``DynamicCache``, in one run.

Each run is :func:`bench_generate.generate_once`: one forward over the prompt with a fresh cache
(prefill), then ``--new-tokens`` single-token greedy forwards (decode, timed); decode tok/s is
``batch * new_tokens / decode_seconds``. ``kvlib.attach(model)`` runs first, so every cache goes
through ``kvlib_sdpa``. Runs go through :func:`kvlib.eval.decode_timing.measure`: a warm-up run of
each cache (the same run, untimed; what it took beyond a timed run, kernel compilation included,
is its first call's extra seconds), then ``--repeats`` interleaved rounds (DynamicCache, exact,
each spec, ...); speeds are medians with their range, ratios the median and range of each round's. Bytes: at the
end of decode, ``memory_report()["total_bytes"]`` of the kvlib caches and the DynamicCache's keys
and values. A quantized cache's greedy tokens need not equal the exact ones: the share of
decode steps whose token agrees with the exact cache's is reported.

Targets (issue 19): ``kivi(bits=4)`` decode >= 0.9x the exact cache's, bytes <= 0.20x
DynamicCache's (fp32 model).

    python benchmarks/bench_coded_decode.py [--models llama100m] [--specs "kivi(bits=4);int8"]
        [--batch-sizes 1] [--prompt-len 2048] [--new-tokens 64] [--repeats 3] [--threads N]
    python benchmarks/bench_coded_decode.py --quick --out /tmp/x   # the default model, prompt 40, 8 tokens, 1 round
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import kvlib
from kvlib.eval.decode_timing import Spread, measure

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from bench_generate import MODELS, decode_timer, new_cache  # noqa: E402
from provenance import add_run_arguments, command_line, load_bench_model, parse_run_arguments, run_metadata, write_report  # noqa: E402

FULL = {"models": "llama100m", "specs": "kivi(bits=4)", "batch_sizes": "1", "prompt_len": 2048, "new_tokens": 64, "repeats": 3}
QUICK = {"models": "default", "specs": "kivi(bits=4)", "batch_sizes": "1", "prompt_len": 40, "new_tokens": 8, "repeats": 1}
BASELINES = ("dynamic", "kvlib")
"""DynamicCache and the exact kvlib cache (``make_cache(model)``)."""


def bench_case(model: torch.nn.Module, specs: list[str], batch: int, args: argparse.Namespace) -> dict:
    generator = torch.Generator().manual_seed(1000 + batch)
    prompt = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=generator)
    kinds = [*BASELINES, *specs]
    timers = [decode_timer(model, lambda kind=kind: new_cache(kind, model), prompt, args.new_tokens) for kind in kinds]
    timings = dict(zip(kinds, measure(timers, args.repeats, errors=())))
    runs = {kind: [run.detail for run in timing.runs] for kind, timing in timings.items()}
    exact = runs["kvlib"][0]["tokens"]
    row: dict = {"batch": batch, "repeats": args.repeats, "caches": {}}
    for kind, timing in timings.items():
        speed = timing.speed
        against = {"dynamic": Spread.of(timing.vs(timings["dynamic"])), "exact": Spread.of(timing.vs(timings["kvlib"]))}
        row["caches"][kind] = {
            "decode_tok_s": speed.median,
            "decode_tok_s_low": speed.low,
            "decode_tok_s_high": speed.high,
            "all_decode_tok_s": timing.tokens_per_s,
            "first_call_s": timing.first_call_s,
            "prefill_s": statistics.median(run["prefill_s"] for run in runs[kind]),
            "cache_bytes": runs[kind][-1]["cache_bytes"],
            "cache_components": runs[kind][-1]["cache_components"],
            "token_agreement_with_exact": float((runs[kind][0]["tokens"] == exact).float().mean()),
            **{f"speed_vs_{name}": spread.median for name, spread in against.items()},
            **{f"speed_vs_{name}_low": spread.low for name, spread in against.items()},
            **{f"speed_vs_{name}_high": spread.high for name, spread in against.items()},
        }
    dynamic = row["caches"]["dynamic"]
    for entry in row["caches"].values():
        entry["bytes_vs_dynamic"] = entry["cache_bytes"] / dynamic["cache_bytes"]
    return row


def run(argv: Sequence[str] | None = None) -> dict:
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help=f"comma-separated, from {','.join(MODELS)} (default {FULL['models']})")
    parser.add_argument("--specs", help=f"quantized caches, ';'-separated spec strings (default {FULL['specs']!r})")
    parser.add_argument("--batch-sizes", help=f"comma-separated (default {FULL['batch_sizes']})")
    parser.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {FULL['prompt_len']})")
    parser.add_argument("--new-tokens", type=int, help=f"decode steps (default {FULL['new_tokens']})")
    parser.add_argument("--repeats", type=int, help=f"interleaved rounds per case (default {FULL['repeats']})")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    specs = [s.strip() for s in args.specs.split(";") if s.strip()]
    for spec in specs:
        kvlib.parse_spec(spec)  # a bad spec is a ValueError before any model is loaded
    rows = []
    for name in models:
        model = load_bench_model(name)
        kvlib.attach(model)
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            row = {"model": name, "params": sum(p.numel() for p in model.parameters()), **bench_case(model, specs, batch, args)}
            rows.append(row)
            print(", ".join(f"{name} b{batch} {kind}: {c['decode_tok_s']:.1f} tok/s" for kind, c in row["caches"].items()), flush=True)
        del model
        gc.collect()
    result = {**run_metadata(args, load_before, started), "rows": rows}
    write_report(args.out, "bench_coded_decode", _markdown(result, argv), result)
    return result


def _markdown(result: dict, argv: Sequence[str] | None) -> str:
    c = result["config"]
    mib = 2**20
    lines = [
        "# bench_coded_decode: quantized caches read through the page kernel, against the exact cache and DynamicCache",
        "",
        f"Command: `{command_line('bench_coded_decode.py', argv)}`",
        "",
        f"Prompt {c['prompt_len']} random token ids, {c['new_tokens']} greedy decode steps, fp32, CPU. Machine: "
        f"{result['machine']}. Library revision: {result['git']}. 1-minute load before and after: "
        f"{result['load_avg_1min'][0]}, {result['load_avg_1min'][1]}. Median [min, max] of {c['repeats']} interleaved rounds "
        "after a warm-up run of each cache (first call: what the warm-up took beyond a timed run, kernel compilation "
        "included); ratios against the DynamicCache and the exact kvlib cache of the same round. Agreement: share of the greedy "
        "tokens equal to the exact cache's (a quantized cache may diverge after its first differing token).",
        "",
        "| model | batch | cache | decode tok/s | vs DynamicCache | vs exact | first call (s) | bytes (MiB) | bytes vs DynamicCache "
        "| codec metadata (MiB) | agreement with exact |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for kind, e in row["caches"].items():
            label = {"dynamic": "DynamicCache", "kvlib": "exact (`make_cache(model)`)"}.get(kind, f"`{kind}`")
            lines.append(
                f"| {row['model']} ({row['params'] / 1e6:.1f}M) | {row['batch']} | {label} | "
                f"{Spread(e['decode_tok_s'], e['decode_tok_s_low'], e['decode_tok_s_high']).text('{:.1f}'.format)} | "
                f"{Spread(e['speed_vs_dynamic'], e['speed_vs_dynamic_low'], e['speed_vs_dynamic_high']).text('{:.3f}'.format)} | "
                f"{Spread(e['speed_vs_exact'], e['speed_vs_exact_low'], e['speed_vs_exact_high']).text('{:.3f}'.format)} | "
                f"{e['first_call_s']:.2f} | {e['cache_bytes'] / mib:.1f} | "
                f"{e['bytes_vs_dynamic']:.3f} | {e['cache_components'].get('codec_metadata', 0) / mib:.1f} | "
                f"{e['token_agreement_with_exact']:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    run()
