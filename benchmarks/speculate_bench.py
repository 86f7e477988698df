"""Suffix speculation in the Engine on and off, side by side in one run, interleaved: output
tokens/s, steps, accepted draft tokens per verification, and whether the greedy outputs agree.

Workloads (each served as one offline batch: every request added, then steps until done):

- ``edits``: repeated edits of one document: a document (``document`` tokens), then it again with
  a few spans changed, then its start once more; each request asks ``new`` tokens (256 by default:
  with 64, the prompts, which speculation does not touch, take over half the run).
- ``json``: a JSON-emitting loop: ``records`` records of one schema (text through the model's
  tokenizer where it has one, else the record's token ids repeated), then ``new`` tokens.
- ``mixed``: the serving trace of ``serve_bench.py`` (``serve_trace.make_trace``: shared system
  prompts, multi-turn chats, RAG over shared documents; token ids uniform over the vocabulary),
  every request queued at once (the trace's arrivals ignored: a saturated server).

The model: ``default`` (the embedded trained byte-level Llama, by default), ``llama100m`` or any
name ``kvlib.eval.load_model`` takes. Each workload runs once untimed per variant (first calls'
compilation), then ``repeats`` times with the variants alternating; times are medians.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import kvlib

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import add_run_arguments, command_line, load_bench_model, parse_run_arguments, run_metadata, write_report  # noqa: E402
from serve_trace import Lengths, TraceConfig, make_trace  # noqa: E402

FULL = {"model": "default", "requests": 16, "new": 256, "trace_requests": 24, "repeats": 3}
QUICK = {"model": "default", "requests": 3, "new": 8, "trace_requests": 4, "repeats": 1}
QUICK_TRACE = {"system_len": Lengths(16, 32), "user_len": Lengths(4, 8), "document_len": Lengths(16, 24), "output_len": Lengths(4, 8)}
VARIANTS = ("off", "suffix")


def edit_prompts(vocab: int, requests: int, seed: int, document: int = 120) -> list[list[int]]:
    """Per request: a document, the document with three spans of 4 tokens replaced, its first half again."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(requests):
        text = [rng.randrange(3, vocab) for _ in range(document)]
        edited = list(text)
        for start in rng.sample(range(0, document - 4), 3):
            edited[start : start + 4] = [rng.randrange(3, vocab) for _ in range(4)]
        prompts.append(text + edited + text[: document // 2])
    return prompts


def json_prompts(model_name: str, vocab: int, requests: int, seed: int, records: int = 6) -> list[list[int]]:
    """Per request: ``[`` and ``records`` JSON records of one schema with its own field values."""
    rng = random.Random(seed)
    prompts = []
    for number in range(requests):
        lines = [
            f'{{"id": {number * 100 + i}, "name": "user{rng.randrange(1000)}", "score": {rng.randrange(100)}}},' for i in range(records)
        ]
        text = "[\n" + "\n".join(lines) + "\n"
        if model_name == "default":  # the byte-level model: ids 0-255 are the text's bytes
            prompts.append(list(text.encode()))
        else:
            record = [rng.randrange(3, vocab) for _ in range(24)]
            prompts.append(record * records)
    return prompts


def mixed_prompts(vocab: int, requests: int, seed: int, quick: bool) -> list[tuple[list[int], int]]:
    """The serving trace's prompts and output lengths, in arrival order."""
    config = TraceConfig(requests=requests, rate=40.0, turn_delay_s=0.5, **(QUICK_TRACE if quick else {}))
    return [(r.prompt_ids, r.max_new_tokens) for r in make_trace(config, vocab, seed).requests]


def serve(model: torch.nn.Module, variant: str, requests: list[tuple[list[int], int]], max_batch_tokens: int) -> dict:
    """One offline batch on a fresh Engine; its wall seconds, outputs and counters."""
    engine = kvlib.Engine(model, max_batch_tokens=max_batch_tokens, speculate=None if variant == "off" else variant)
    start = time.perf_counter()
    ids = [engine.add_request(prompt, max_new_tokens=new, eos_token_id=None) for prompt, new in requests]
    prompts_in = None  # seconds until every prompt has run (nothing waits or prefills any more)
    while engine.has_unfinished:
        engine.step()
        if prompts_in is None and not engine.scheduler.waiting and all(r.remaining <= 1 for r in engine.scheduler.running):
            prompts_in = time.perf_counter() - start
    seconds = time.perf_counter() - start
    stats = engine.stats()
    outputs = [engine.requests[i].output for i in ids]
    return {
        "seconds": seconds,
        "prompt_seconds": prompts_in if prompts_in is not None else seconds,
        "outputs": outputs,
        "output_tokens": sum(map(len, outputs)),
        "steps": stats["steps"],
        "forward_tokens": stats["forward_tokens"],
        "verifications": stats["verifications"],
        "draft_tokens": stats["draft_tokens"],
        "accepted_tokens": stats["accepted_tokens"],
    }


def compare(model: torch.nn.Module, workloads: dict[str, list[tuple[list[int], int]]], repeats: int, max_batch_tokens: int) -> dict:
    """Every workload under both variants: an untimed run each, then ``repeats`` interleaved runs."""
    result = {}
    for name, requests in workloads.items():
        runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
        for variant in VARIANTS:
            serve(model, variant, requests, max_batch_tokens)
        for repeat in range(repeats):
            for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                runs[variant].append(serve(model, variant, requests, max_batch_tokens))
        rows = {}
        for variant, done in runs.items():
            last = done[-1]
            rates = [run["output_tokens"] / run["seconds"] for run in done]
            rows[variant] = {
                "tokens_per_s": statistics.median(rates),
                "tokens_per_s_runs": [round(rate, 1) for rate in rates],
                "ceiling": statistics.median(run["seconds"] / run["prompt_seconds"] for run in done),
                "steps": last["steps"],
                "forward_tokens": last["forward_tokens"],
                "verifications": last["verifications"],
                "accepted_per_verification": last["accepted_tokens"] / last["verifications"] if last["verifications"] else 0.0,
                "draft_acceptance": last["accepted_tokens"] / last["draft_tokens"] if last["draft_tokens"] else 0.0,
            }
        same = all(run["outputs"] == runs["off"][0]["outputs"] for variant in VARIANTS for run in runs[variant])
        result[name] = {
            "requests": len(requests),
            "output_tokens": runs["off"][0]["output_tokens"],
            "variants": rows,
            "speedup": rows["suffix"]["tokens_per_s"] / rows["off"]["tokens_per_s"],
            "outputs_equal": same,
        }
    return result


def markdown(result: dict, argv: Sequence[str] | None) -> str:
    meta = result["meta"]
    lines = [
        "# Suffix speculation in the Engine (SuffixDecoding), on and off",
        "",
        f"`{command_line('speculate_bench.py', argv)}` ({meta['machine']}, {meta['git']}, load {meta['load_avg_1min']}, {meta['seconds']} s)",
        "",
        "| workload | requests | output tokens | tok/s off | tok/s suffix | speedup | ceiling | steps off / suffix"
        " | accepted per verification | draft tokens accepted | outputs equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in result["workloads"].items():
        off, on = row["variants"]["off"], row["variants"]["suffix"]
        lines.append(
            f"| {name} | {row['requests']} | {row['output_tokens']} | {off['tokens_per_s']:.1f} {off['tokens_per_s_runs']}"
            f" | {on['tokens_per_s']:.1f} {on['tokens_per_s_runs']} | **{row['speedup']:.2f}x** | {off['ceiling']:.2f}x"
            f" | {off['steps']} / {on['steps']}"
            f" | {on['accepted_per_verification']:.2f} | {on['draft_acceptance']:.0%} | {row['outputs_equal']} |"
        )
    lines += [
        "",
        "tok/s: output tokens over the batch's wall time (median of the runs listed); a verification outputs its"
        " accepted draft tokens and one more token of the model's. ceiling: the off run's wall time over its time until every"
        " prompt had run (median), the speedup if every output token after that cost nothing: no speculation passes it.",
    ]
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help=f"default {FULL['model']}")
    parser.add_argument("--requests", type=int, help=f"requests of each repetitive workload (default {FULL['requests']})")
    parser.add_argument("--new", type=int, help=f"output tokens per repetitive request (default {FULL['new']})")
    parser.add_argument("--trace-requests", type=int, help=f"requests of the mixed trace (default {FULL['trace_requests']})")
    parser.add_argument("--repeats", type=int, help=f"interleaved timed runs of each variant (default {FULL['repeats']})")
    parser.add_argument("--max-batch-tokens", type=int, default=256, help="tokens per forward pass")
    parser.add_argument("--seed", type=int, default=0)
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    load_before, started = os.getloadavg()[0], time.perf_counter()
    model = load_bench_model(args.model)
    vocab = model.config.get_text_config().vocab_size
    workloads = {
        "edits": [(prompt, args.new) for prompt in edit_prompts(vocab, args.requests, args.seed)],
        "json": [(prompt, args.new) for prompt in json_prompts(args.model, vocab, args.requests, args.seed)],
        "mixed": mixed_prompts(vocab, args.trace_requests, args.seed, args.quick),
    }
    result = {"workloads": compare(model, workloads, args.repeats, args.max_batch_tokens)}
    result["meta"] = run_metadata(args, load_before, started)
    write_report(args.out, "speculate_bench" + ("_quick" if args.quick else ""), markdown(result, argv), result)
    return result


if __name__ == "__main__":
    run()
