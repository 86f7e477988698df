"""Memory and decode speed of an evicting cache against the full cache, in one run.

Model: a seeded random-weight ``LlamaForCausalLM`` with ``bench_generate.py``'s llama100m
config (hidden 768, 12 layers, 12 heads, 4 KV heads, MLP 2048, vocab 32000, tied embeddings:
~100M parameters, fp32; ``max_position_embeddings`` raised to fit prompt + decode, which
changes no weight). Prompt: ``--prompt-len`` random token ids (seeded), batch 1.

Caches, each built fresh for every run:

- ``DynamicCache`` and ``kvlib exact`` (``kvlib.make_cache(model)``, with its read mirror): the
  full-cache baselines;
- for each of ``--policies``: ``kvlib.make_cache(model, name, budget=B, read_cache=False)``
  and the same with the read mirror (``read_cache=True``), ``B = int(--budget * prompt_len)``
  tokens per (layer, KV head): an int budget, a cap held during the prefill and at every decode
  step (each step stores one token and compacts back to ``B``);
- the same two with ``+in_order`` (``--in-order``): every compaction rewrites in order, as
  decode-step eviction did before slot reuse (the cache's ``reuse_slots`` set to False): the before/after of slot reuse in one run;
- the same two with ``interval=--interval`` (unless it is 1): decode steps compact only every
  ``interval``-th step, so a head holds at most ``B + interval - 1`` tokens between compactions
  (memory is read right after one, at the end of decode when ``new_tokens`` is a multiple of
  ``interval``).

A run: ``model.generate(prompt, cache=cache, prefill_chunk_size=--chunk,
max_new_tokens=1)`` (the chunked prefill, timed), then ``--new-tokens`` greedy single-token
forwards by hand under ``torch.inference_mode()`` (timed as decode; tokens/s = new tokens /
seconds). ``kvlib.attach(model)`` runs first, so every cache goes through the same attention
function. Runs go through :func:`kvlib.eval.decode_timing.measure`: a warm-up run of each cache
(the same run, untimed; what it took beyond a timed run, kernel compilation included, is its
first call's extra seconds), then ``--repeats`` interleaved rounds (each cache once per round);
speeds are medians, and each ratio is the median of the rounds' ratios (with its range).

Reported ratios:

- memory: ``memory_report()["total_bytes"]`` after decode, over the full K/V bytes
  (DynamicCache's keys + values; target <= 0.3 for the cache without mirror), and over
  kvlib exact's ``total_bytes`` (which holds a mirror too); and the same after one more
  (untimed) decode step, between compactions for the interval variants;
- decode tokens/s over kvlib exact's and over DynamicCache's, round by round (target >= 1.3);
- ``memory_report()["peak_pages_bytes"]`` (the most page bytes held at any moment of the run:
  the chunked prefill's peak, unless decoding between compactions goes higher) over kvlib
  exact's peak pages bytes (the full K/V; target <= 0.5).

A compaction drops a layer's read mirror (the next read rebuilds it from the pages), so with
compaction at every step the mirror is rebuilt every step and a cache read right after a
compaction reports no mirror bytes (hence the second memory reading).

Timings on a shared machine are noisy: the 1-minute load average before and after each round is
recorded.

Usage (defaults: prompt 4096, budget 0.25, chunk 512, 64 new tokens, interval 64, 3 rounds,
streaming_llm and snapkv):

    python benchmarks/eviction_speed.py [--policies streaming_llm,snapkv] [--prompt-len 4096]
        [--budget 0.25] [--chunk 512] [--new-tokens 64] [--interval 64] [--repeats 3] [--threads N]
        [--out benchmarks/results]
    python benchmarks/eviction_speed.py --quick --out /tmp/x   # tiny 2-layer model, prompt 64, chunk 16

Writes ``eviction_speed.md`` and ``eviction_speed.json`` to ``--out``.
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
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvlib
from kvlib.eval.decode_timing import Decoded, Spread, measure
from kvlib.transformers_compat import cache_argument

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import (  # noqa: E402
    LLAMA100M,
    add_run_arguments,
    git_revision,
    no_machine_path,
    parse_run_arguments,
    write_report,
)

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}
FULL = {"model": "llama100m", "prompt_len": 4096, "chunk": 512, "new_tokens": 64, "interval": 64, "repeats": 3}
QUICK = {"model": "tiny", "prompt_len": 64, "chunk": 16, "new_tokens": 4, "interval": 4, "repeats": 1}
BASELINES = ("dynamic", "kvlib")


def load_model(name: str, positions: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    sizes = LLAMA100M if name == "llama100m" else TINY
    config = LlamaConfig(**sizes, max_position_embeddings=max(4096, positions), tie_word_embeddings=True, dtype=torch.float32)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def new_cache(kind: str, model, budget: int, interval: int):
    """``dynamic``, ``kvlib`` (exact), or ``<policy>[+mirror][+interval]`` (see the module docstring)."""
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "kvlib":
        return kvlib.make_cache(model)
    name, *flags = kind.split("+")
    cache = kvlib.make_cache(model, name, budget=budget, read_cache="mirror" in flags, interval=interval if "interval" in flags else 1)
    cache.reuse_slots = "in_order" not in flags
    return cache


def cache_memory(cache) -> dict:
    if isinstance(cache, kvlib.KVCache):
        report = cache.memory_report()
        return {
            "total_bytes": report["total_bytes"],
            "peak_pages_bytes": report["peak_pages_bytes"],
            "by_component": report["by_component"],
            "stored_tokens": report["stored_tokens"],
        }
    held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
    return {"total_bytes": held, "peak_pages_bytes": None, "by_component": {}, "stored_tokens": None}


def run_once(model, kind: str, prompt: torch.Tensor, args: argparse.Namespace, budget: int) -> dict:
    """Chunked prefill through ``generate`` (one new token), then ``new_tokens`` greedy forwards by hand."""
    gc.collect()
    cache = new_cache(kind, model, budget, args.interval)
    with torch.inference_mode():
        start = time.perf_counter()
        sequence = model.generate(
            prompt,
            **cache_argument(cache),
            do_sample=False,
            max_new_tokens=1,
            min_new_tokens=1,
            prefill_chunk_size=args.chunk,
            pad_token_id=0,
        )
        prefill = time.perf_counter() - start
        token = sequence[:, -1:]
        tokens = [token]
        start = time.perf_counter()
        for _ in range(args.new_tokens):
            out = model(input_ids=token, **cache_argument(cache), use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
        decode = time.perf_counter() - start
    assert cache.get_seq_length() == prompt.shape[1] + args.new_tokens, (kind, cache.get_seq_length())
    after_decode = cache_memory(cache)
    with torch.inference_mode():  # one more step, untimed: the memory between compactions
        model(input_ids=token, **cache_argument(cache), use_cache=True)
    next_step = cache_memory(cache)
    result = {
        "prefill_s": prefill,
        "decode_s": decode,
        "decode_tok_s": args.new_tokens / decode,
        "tokens": torch.cat(tokens, dim=1).tolist(),
        "total_bytes": after_decode["total_bytes"],
        "by_component": after_decode["by_component"],
        "stored_tokens": after_decode["stored_tokens"],
        "next_step_total_bytes": next_step["total_bytes"],
        "next_step_read_cache_bytes": next_step["by_component"].get("read_cache", 0),
        "peak_pages_bytes": next_step["peak_pages_bytes"],
    }
    del cache
    return result


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="streaming_llm,snapkv", help="comma-separated eviction policies")
    parser.add_argument("--model", choices=("llama100m", "tiny"), help=f"(default {FULL['model']})")
    parser.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {FULL['prompt_len']})")
    parser.add_argument("--budget", type=float, default=0.25, help="fraction of the prompt kept, as an int token cap")
    parser.add_argument("--chunk", type=int, help=f"prefill_chunk_size (default {FULL['chunk']})")
    parser.add_argument("--new-tokens", type=int, help=f"decode steps timed (default {FULL['new_tokens']})")
    parser.add_argument("--interval", type=int, help=f"compaction interval of the extra variants; 1: none (default {FULL['interval']})")
    parser.add_argument("--repeats", type=int, help=f"interleaved rounds (default {FULL['repeats']})")
    parser.add_argument("--in-order", action="store_true", help="add each variant with in-order compaction (+in_order)")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    registered = kvlib.available_policies()["eviction"]
    unknown = sorted(set(policies) - set(registered))
    if unknown:
        parser.error(f"unknown policies {unknown}; registered: {', '.join(registered)}")
    budget = max(1, int(args.budget * args.prompt_len))
    variants = ["", "+mirror", "+interval", "+mirror+interval"] if args.interval > 1 else ["", "+mirror"]
    if args.in_order:
        variants += [variant + "+in_order" for variant in variants]
    kinds = [*BASELINES, *(s + variant for s in policies for variant in variants)]

    model = load_model(args.model, args.prompt_len + args.new_tokens + 1)
    kvlib.attach(model)
    generator = torch.Generator().manual_seed(1001)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=generator)
    loads = []
    started = time.perf_counter()

    def timer(kind: str):
        def timed() -> Decoded:
            result = run_once(model, kind, prompt, args, budget)
            print(f"{kind}: decode {result['decode_tok_s']:.1f} tok/s, prefill {result['prefill_s']:.2f} s", flush=True)
            return Decoded(args.new_tokens, result["decode_s"], result)

        return timed

    def after_round(round_: int, _) -> None:
        loads.append(round(os.getloadavg()[0], 2))

    loads.append(round(os.getloadavg()[0], 2))
    timings = dict(zip(kinds, measure([timer(kind) for kind in kinds], args.repeats, errors=(), on_round=after_round)))
    runs = {kind: [run.detail for run in timing.runs] for kind, timing in timings.items()}

    rows = {}
    for kind in kinds:
        last = runs[kind][-1]
        rows[kind] = {
            "decode_tok_s": timings[kind].speed.median,
            "first_call_s": timings[kind].first_call_s,
            "prefill_s": statistics.median(r["prefill_s"] for r in runs[kind]),
            "all_decode_tok_s": timings[kind].tokens_per_s,
            **{
                key: last[key]
                for key in (
                    "total_bytes",
                    "by_component",
                    "stored_tokens",
                    "next_step_total_bytes",
                    "next_step_read_cache_bytes",
                    "peak_pages_bytes",
                )
            },
        }
    full_kv = rows["dynamic"]["total_bytes"]
    exact = rows["kvlib"]
    for kind, row in rows.items():
        row["bytes_vs_full_kv"] = row["total_bytes"] / full_kv
        row["next_step_bytes_vs_full_kv"] = row["next_step_total_bytes"] / rows["dynamic"]["next_step_total_bytes"]
        row["bytes_vs_kvlib_exact"] = row["total_bytes"] / exact["total_bytes"]
        for name, base in (("kvlib_exact", "kvlib"), ("dynamic", "dynamic")):
            ratio = Spread.of(timings[kind].vs(timings[base]))
            row[f"speed_vs_{name}"], row[f"speed_vs_{name}_low"], row[f"speed_vs_{name}_high"] = ratio.median, ratio.low, ratio.high
        if row["peak_pages_bytes"] is not None:
            row["peak_pages_vs_full"] = row["peak_pages_bytes"] / exact["peak_pages_bytes"]
    reference = runs["dynamic"][0]["tokens"]
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config.update(policies=policies, budget_tokens=budget)
    result = {
        "config": config,
        "params": sum(p.numel() for p in model.parameters()),
        "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs",
        "git": git_revision(),
        "load_avg_1min_per_round": [[before, after] for before, after in zip(loads[1:], loads[2:])],
        "seconds": round(time.perf_counter() - started, 1),
        "exact_tokens_match": all(r["tokens"] == reference for kind in BASELINES for r in runs[kind]),
        "rows": rows,
    }
    report = _markdown(result, argv)
    write_report(args.out, "eviction_speed", report, result)
    return result


def _label(kind: str, budget: int, interval: int) -> str:
    if kind == "dynamic":
        return "DynamicCache (full)"
    if kind == "kvlib":
        return "kvlib exact (full, read mirror)"
    name, *flags = kind.split("+")
    every = f", interval {interval}" if "interval" in flags else ""
    order = ", in-order compaction" if "in_order" in flags else ""
    return f"{name}, budget {budget}, {'read mirror' if 'mirror' in flags else 'no read mirror'}{every}{order}"


def _markdown(result: dict, argv: Sequence[str] | None) -> str:
    c = result["config"]
    given = [no_machine_path(a) for a in (sys.argv[1:] if argv is None else argv)]
    command = shlex.join(["python", "benchmarks/eviction_speed.py", *given])
    mib = 2**20
    loads = "; ".join(f"{a}, {b}" for a, b in result["load_avg_1min_per_round"])
    lines = [
        "# eviction_speed: evicting cache vs full cache, memory and decode speed",
        "",
        f"Command: `{command}`",
        "",
        f"Model: {c['model']} ({result['params'] / 1e6:.2f}M params, random weights, fp32), batch 1, prompt "
        f"{c['prompt_len']} random token ids, chunked prefill (`generate(..., prefill_chunk_size={c['chunk']}, "
        f"max_new_tokens=1)`), then {c['new_tokens']} greedy single-token forwards timed. Budget {c['budget_tokens']} "
        f"tokens per (layer, KV head) ({c['budget']:g} of the prompt), an int cap: without an interval every decode "
        f"step compacts back to it; with interval {c['interval']} every {c['interval']}th step does, so a head holds "
        f"up to {c['budget_tokens'] + c['interval'] - 1} tokens in between. A warm-up run of every cache, then "
        f"{c['repeats']} interleaved rounds: decode tok/s the median, ratios the median [min, max] of each round's; first "
        f"call: the seconds the warm-up run took beyond a timed one (kernel compilation included). Machine: {result['machine']}. 1-minute load average before, after each round: {loads}. Library "
        f"revision: {result['git']}. {result['seconds']} s.",
        "",
        "Memory: `total_bytes` (pages, positions, tables, read mirror) after decode, and after one more untimed decode "
        "step. A decode step's slot-reuse eviction patches the read mirror in place (an in-order compaction drops "
        "it and the next read rebuilds it), so a mirrored evicting cache holds its mirror beside its pages. Full K/V = "
        "DynamicCache's keys + values. Peak pages: `peak_pages_bytes`, the most page bytes held at any moment of the "
        "run (the chunked prefill's peak, unless decoding between compactions goes higher), over kvlib exact's. "
        "Targets: memory without mirror <= 0.3x full K/V; decode >= 1.3x the full cache; peak pages <= 0.5x.",
        "",
        "| cache | decode tok/s | vs kvlib exact | vs DynamicCache | first call (s) | prefill (s) | memory after decode (MiB) "
        "| vs full K/V | vs kvlib exact memory | one step later (MiB) | of which read mirror (MiB) | vs full K/V "
        "| peak pages (MiB) | peak pages vs full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, r in result["rows"].items():
        peak = "-" if r["peak_pages_bytes"] is None else f"{r['peak_pages_bytes'] / mib:.1f}"
        peak_ratio = f"{r['peak_pages_vs_full']:.3f}" if "peak_pages_vs_full" in r else "-"
        lines.append(
            f"| {_label(kind, c['budget_tokens'], c['interval'])} | {r['decode_tok_s']:.1f} | "
            f"{Spread(r['speed_vs_kvlib_exact'], r['speed_vs_kvlib_exact_low'], r['speed_vs_kvlib_exact_high']).text('{:.3f}'.format)} | "
            f"{Spread(r['speed_vs_dynamic'], r['speed_vs_dynamic_low'], r['speed_vs_dynamic_high']).text('{:.3f}'.format)} | "
            f"{r['first_call_s']:.2f} | {r['prefill_s']:.2f} | {r['total_bytes'] / mib:.1f} | "
            f"{r['bytes_vs_full_kv']:.3f} | {r['bytes_vs_kvlib_exact']:.3f} | {r['next_step_total_bytes'] / mib:.1f} | "
            f"{r['next_step_read_cache_bytes'] / mib:.1f} | {r['next_step_bytes_vs_full_kv']:.3f} | {peak} | "
            f"{peak_ratio} |"
        )
    lines += [
        "",
        "Decode tok/s of every round: "
        + "; ".join(f"{kind} {', '.join(f'{v:.1f}' for v in r['all_decode_tok_s'])}" for kind, r in result["rows"].items())
        + ".",
        "",
        f"DynamicCache and kvlib exact greedy tokens identical in every run: {'yes' if result['exact_tokens_match'] else '**NO**'}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    run()
