"""Decode tokens/s of ``kvlib.make_cache(model)`` (exact, no spec) against ``DynamicCache``, in one run.

Each run drives the model by hand under ``torch.inference_mode()``: one forward over the prompt
with a fresh cache (timed as prefill; ``logits_to_keep=1``), then ``--new-tokens`` single-token
greedy forwards feeding the cache (timed as decode). Decode tokens/s is
``batch * new_tokens / decode_seconds``.

Fairness: ``kvlib.attach(model)`` runs once before anything is measured, so both caches go
through the same attention function (``kvlib_sdpa``; for a cache that is not a kvlib cache it
calls plain SDPA unchanged). Runs go through :func:`kvlib.eval.decode_timing.measure`: a warm-up
run of each cache (the same run as a timed one; what it took beyond a timed one is reported as
the first call's extra seconds), then ``--repeats`` interleaved rounds (DynamicCache, kvlib,
DynamicCache, kvlib, ...); tokens/s are medians with their range, and the ratio is the median of
each round's kvlib / DynamicCache (with its range).
Every run's greedy tokens must equal the first DynamicCache run's (asserted after the report is
written). Memory at the end of decode: kvlib's ``memory_report()["total_bytes"]`` (pages,
positions, tables and the dense read mirror) and the DynamicCache's keys and values bytes.

Models: ``default`` (kvlib's embedded trained model, which ships in the package: a byte-level
Llama of 4 layers, 2 KV heads of 32 channels, 1024 trained positions, ~0.8M parameters) and
``llama100m`` (a seeded random-weight ``LlamaForCausalLM``: hidden 768, 12 layers, 12 heads, 4 KV
heads, MLP 2048, vocab 32000, tied embeddings: ~100M parameters, fp32); both through
``provenance.load_bench_model``. Prompts are random token ids (seeded).

Usage (defaults: both models, prompt 2048, 256 new tokens, batch 1 and 8, 3 repeats):

    python benchmarks/bench_generate.py [--models default,llama100m] [--batch-sizes 1,8]
        [--prompt-len 2048] [--new-tokens 256] [--repeats 3] [--repeats-llama100m N] [--threads N]
        [--out benchmarks/results]
    python benchmarks/bench_generate.py --quick --out /tmp/x   # default, prompt 32, 8 tokens, batch 1,2, 1 repeat

Writes ``bench_generate.md`` and ``bench_generate.json`` to ``--out``. Target: kvlib / DynamicCache >= 0.9.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

import kvlib
from kvlib.eval.decode_timing import Decoded, Spread, Timer, measure
from kvlib.transformers_compat import cache_argument

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import (  # noqa: E402
    RANDOM_LLAMA,
    add_run_arguments,
    git_revision,
    load_bench_model,
    no_machine_path,
    parse_run_arguments,
    write_report,
)

REPO = Path(__file__).resolve().parents[1]
MODELS = ("default", RANDOM_LLAMA)
FULL = {"models": "default,llama100m", "batch_sizes": "1,8", "prompt_len": 2048, "new_tokens": 256, "repeats": 3}
QUICK = {"models": "default", "batch_sizes": "1,2", "prompt_len": 32, "new_tokens": 8, "repeats": 1}
CACHES = ("dynamic", "kvlib")


def new_cache(kind: str, model: torch.nn.Module):
    """``"dynamic"``: a DynamicCache; ``"kvlib"``: ``make_cache(model)``; any other kind: ``make_cache(model, kind)``
    (a spec string, for benchmarks that import this one)."""
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    return kvlib.make_cache(model, None if kind == "kvlib" else kind)


def cache_bytes(cache) -> tuple[int, dict[str, int]]:
    """Total bytes held and, for a kvlib cache, the ``memory_report`` components."""
    if isinstance(cache, kvlib.KVCache):
        report = cache.memory_report()
        return report["total_bytes"], report["by_component"]
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None), {}


def generate_once(model: torch.nn.Module, make: Callable[[], object], prompt: torch.Tensor, new_tokens: int) -> dict:
    """Prefill + ``new_tokens`` greedy single-token forwards with a fresh cache from ``make()``."""
    gc.collect()
    cache = make()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=prompt, **cache_argument(cache), use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if token.is_cuda:
            torch.cuda.synchronize(token.device)
        prefill = time.perf_counter() - start
        tokens = [token]
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = model(input_ids=token, **cache_argument(cache), use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
        if token.is_cuda:  # the last step's kernels may still be queued
            torch.cuda.synchronize(token.device)
        decode = time.perf_counter() - start
    assert cache.get_seq_length() == prompt.shape[1] + new_tokens, (type(cache).__name__, cache.get_seq_length())
    held, components = cache_bytes(cache)
    result = {
        "prefill_s": prefill,
        "decode_s": decode,
        "decode_tok_s": prompt.shape[0] * new_tokens / decode,
        "cache_bytes": held,
        "cache_components": components,
        "peak_workspace_bytes": cache.memory_report()["peak_workspace_bytes"] if isinstance(cache, kvlib.KVCache) else 0,
        "tokens": torch.cat(tokens, dim=1),
    }
    del cache, out
    return result


def decode_timer(model: torch.nn.Module, make: Callable[[], object], prompt: torch.Tensor, new_tokens: int) -> Timer:
    """A timer (:func:`kvlib.eval.decode_timing.measure`) of :func:`generate_once`: its decode seconds,
    its whole result as the detail."""

    def timed() -> Decoded:
        result = generate_once(model, make, prompt, new_tokens)
        return Decoded(prompt.shape[0] * new_tokens, result["decode_s"], result)

    return timed


def bench_case(model: torch.nn.Module, vocab: int, batch: int, args: argparse.Namespace, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(1000 + batch)
    prompt = torch.randint(0, vocab, (batch, args.prompt_len), generator=generator)
    timers = [decode_timer(model, lambda kind=kind: new_cache(kind, model), prompt, args.new_tokens) for kind in CACHES]
    timings = dict(zip(CACHES, measure(timers, repeats, errors=())))
    runs = {kind: [run.detail for run in timing.runs] for kind, timing in timings.items()}
    reference = runs["dynamic"][0]["tokens"]
    tokens_match = all(torch.equal(run["tokens"], reference) for kind in CACHES for run in runs[kind])
    row = {"batch": batch, "repeats": repeats, "tokens_match": tokens_match}
    for kind, timing in timings.items():
        speed = timing.speed
        row[kind] = {
            "decode_tok_s": speed.median,
            "decode_tok_s_low": speed.low,
            "decode_tok_s_high": speed.high,
            "first_call_s": timing.first_call_s,
            "decode_s": statistics.median(run["decode_s"] for run in runs[kind]),
            "prefill_s": statistics.median(run["prefill_s"] for run in runs[kind]),
            "cache_bytes": runs[kind][-1]["cache_bytes"],
            "cache_components": runs[kind][-1]["cache_components"],
            "all_decode_tok_s": timing.tokens_per_s,
            "all_prefill_s": [run["prefill_s"] for run in runs[kind]],
        }
    ratios = timings["kvlib"].vs(timings["dynamic"])
    ratio = Spread.of(ratios)
    row.update(ratio=ratio.median, ratio_low=ratio.low, ratio_high=ratio.high, all_ratios=ratios)
    return row


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help=f"comma-separated, from {','.join(MODELS)} (default {FULL['models']})")
    parser.add_argument("--batch-sizes", help=f"comma-separated (default {FULL['batch_sizes']})")
    parser.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {FULL['prompt_len']})")
    parser.add_argument("--new-tokens", type=int, help=f"decode steps (default {FULL['new_tokens']})")
    parser.add_argument("--repeats", type=int, help=f"interleaved rounds per case (default {FULL['repeats']})")
    parser.add_argument("--repeats-llama100m", type=int, default=None, help="rounds for llama100m only (default: --repeats)")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    rows = []
    for name in models:
        model = load_bench_model(name)
        kvlib.attach(model)  # both caches measured on the same attention function (kvlib_sdpa)
        repeats = args.repeats_llama100m if name == "llama100m" and args.repeats_llama100m else args.repeats
        for batch in batch_sizes:
            load_before = os.getloadavg()[0]
            row = {
                "model": name,
                "params": sum(p.numel() for p in model.parameters()),
                "attn_implementation": model.config._attn_implementation,
                **bench_case(model, model.config.vocab_size, batch, args, repeats),
            }
            row["load_avg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            rows.append(row)
            print(_row_line(row), flush=True)
        del model
        gc.collect()

    config = {k: v for k, v in vars(args).items() if k != "out"}
    result = {
        "config": config,
        "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "git": git_revision(),
        "rows": rows,
        "all_tokens_match": all(row["tokens_match"] for row in rows),
    }
    report = _markdown(result, argv)
    write_report(args.out, "bench_generate", report, result)
    mismatched = [(row["model"], row["batch"]) for row in rows if not row["tokens_match"]]
    assert not mismatched, f"kvlib and DynamicCache greedy tokens differ for {mismatched}"
    return result


def _row_line(row: dict) -> str:
    return (
        f"{row['model']} batch {row['batch']}: DynamicCache {row['dynamic']['decode_tok_s']:.1f} tok/s, "
        f"kvlib {row['kvlib']['decode_tok_s']:.1f} tok/s, ratio {row['ratio']:.3f} [{row['ratio_low']:.3f}, {row['ratio_high']:.3f}], "
        f"tokens match {row['tokens_match']}"
    )


def _markdown(result: dict, argv: Sequence[str] | None) -> str:
    c = result["config"]
    given = list(sys.argv[1:] if argv is None else argv)
    given = [no_machine_path(a) for a in given]
    command = shlex.join(["python", "benchmarks/bench_generate.py", *given])
    mib = 2**20
    lines = [
        "# bench_generate: decode tokens/s, kvlib.make_cache(model) vs DynamicCache",
        "",
        f"Command: `{command}`",
        "",
        f"Prompt {c['prompt_len']} random token ids, {c['new_tokens']} greedy decode steps (single-token forwards), fp32, "
        f"CPU. Machine: {result['machine']}. Library revision: {result['git']}.",
        "",
        "Prefill (one forward over the prompt) and decode are timed separately; decode tok/s = batch x new tokens / "
        "decode seconds (the machine's 1-minute load average before and after each case is listed: other processes "
        "on this machine skew absolute figures; interleaving keeps the ratio fairer). `kvlib.attach(model)` runs "
        "before any measurement, so both caches run through the same attention function (`kvlib_sdpa`, which calls plain SDPA "
        "for a DynamicCache). Each cache runs once untimed first (the same run: kernels compile there; first call = the seconds "
        "it took beyond a timed run), then runs are interleaved (DynamicCache, kvlib, ...); decode tok/s are medians "
        "[min, max] over the rounds, ratio = the median [min, max] of each round's kvlib / DynamicCache (target >= 0.9). "
        "Memory: at the end of decode, kvlib "
        "`memory_report()['total_bytes']` (pages, positions, tables and the dense read mirror; the read mirror's "
        "share is listed) and the DynamicCache's keys + values bytes.",
        "",
    ]
    if c.get("repeats_llama100m") and c["repeats_llama100m"] != c["repeats"]:
        lines += [
            f"llama100m ran {c['repeats_llama100m']} rounds (`--repeats-llama100m`) instead of {c['repeats']}, to bound the run time.",
            "",
        ]
    lines += [
        "| model | batch | rounds | DynamicCache tok/s | kvlib tok/s | ratio | first call DynamicCache, kvlib (s) "
        "| prefill DynamicCache (s) | prefill kvlib (s) "
        "| DynamicCache memory (MiB) | kvlib memory (MiB) | of which read mirror (MiB) | tokens match "
        "| load avg (before, after) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in result["rows"]:
        d, k = row["dynamic"], row["kvlib"]
        lines.append(
            f"| {row['model']} ({row['params'] / 1e6:.2f}M params) | {row['batch']} | {row['repeats']} | "
            f"{Spread(d['decode_tok_s'], d['decode_tok_s_low'], d['decode_tok_s_high']).text('{:.1f}'.format)} | "
            f"{Spread(k['decode_tok_s'], k['decode_tok_s_low'], k['decode_tok_s_high']).text('{:.1f}'.format)} | "
            f"{Spread(row['ratio'], row['ratio_low'], row['ratio_high']).text('{:.3f}'.format)} | "
            f"{d['first_call_s']:.2f}, {k['first_call_s']:.2f} | {d['prefill_s']:.2f} | "
            f"{k['prefill_s']:.2f} | {d['cache_bytes'] / mib:.1f} | {k['cache_bytes'] / mib:.1f} | "
            f"{k['cache_components'].get('read_cache', 0) / mib:.1f} | "
            f"{'yes' if row['tokens_match'] else '**NO**'} | {row['load_avg_1min'][0]:.1f}, {row['load_avg_1min'][1]:.1f} |"
        )
    lines += ["", f"Greedy tokens identical in every run: {'yes' if result['all_tokens_match'] else '**NO**'}."]
    return "\n".join(lines)


if __name__ == "__main__":
    run()
