"""Serving benchmark: one seeded trace (shared system prompts, multi-turn chats, RAG over shared
documents; Poisson arrivals) replayed in one run on ``kvlib.Engine``, on ``model.generate`` with
static padded batches and on transformers' continuous batching (the manager behind
``model.generate_batch``), on the same model.

Model: the ~100M random Llama (``--model llama100m``, fp32, CPU; no EOS, so every request produces
exactly its ``max_new_tokens``) or a tiny random Llama (``--model tiny``, for ``--quick``). The
trace is ``serve_trace.py``'s (its docstring says how requests are made); the systems are
``serve_systems.py``'s (how each replays arrivals and timestamps tokens); the figures are
``serve_metrics.py``'s: output tokens/s = total output tokens / makespan (replay start to last
token), TTFT (first token minus arrival) and TBT (between consecutive tokens of a request)
p50/p99, and for the Engine the prefix hit rate from ``engine.stats()``. Each system first runs
an untimed two-request warm-up. Greedy agreement is counted per pair of systems (padded batches
may differ by float noise; reported, never asserted). Targets: Engine >= 2x padded, >= 1x
generate_batch in tokens/s.

Usage:

    python benchmarks/serve_bench.py [--systems engine,padded,generate_batch] [--model llama100m|tiny]
        [--requests 40] [--rate 4] [--weights system=0.4,chat=0.2,rag=0.4] [--seed 0]
        [--batch-size 8] [--max-batch-tokens 256] [--page-size 16] [--threads N] [--out benchmarks/results]
    python benchmarks/serve_bench.py --quick --out /tmp/x   # tiny model, 6 short requests

Writes ``serve_bench.md`` and ``serve_bench.json`` to ``--out``.

Fixed-memory mode (``--fixed-memory-mb N``): the exact Engine and codec Engines (``--codecs``)
with the same page budget of N MiB serve a trace that saturates it (``--requests`` prompts of
``--prompt-len LOW,HIGH`` tokens, all arriving at once, ``--new-tokens`` each; SmolLM2 with
``--model smollm2``, natural-text prompts); the figures are concurrent requests, preemptions,
output tokens/s and KL against the exact Engine (``serve_fixed_memory.py`` says how each is
measured). Target: a codec holds >= 3.5x the exact Engine's concurrent requests at KL <= 0.01
nats. Writes ``serve_bench_fixed_memory.md`` and ``.json``:

    python benchmarks/serve_bench.py --fixed-memory-mb 64 --model llama100m --requests 32

Features mode (``--features``): the Engine's serving features each on and off in one run,
interleaved (``serve_features.py`` says how each is measured): global prefix grouping in
``Engine.generate`` (prompt tokens computed and wall time on a shuffled batch sharing prefixes),
forecast admission against reserve-based admission (preemptions, goodput, TTFT and TBT p50/p99 on
a trace with skewed output lengths), shared-prefix attention (K/V read and decode tok/s, requests
sharing a prompt) and suffix speculation (tok/s on repeated edits, a JSON loop and the mixed
trace). Targets: forecast preemptions <= 0.5x reserve's, goodput >= 1.0x; speculation >= 2x on
the repetitive workloads, >= 1.0x on the mixed trace. Default model: the embedded default model (``--model default``; ``tiny`` under
``--quick``). Writes ``serve_bench_features.md`` and ``.json``:

    python benchmarks/serve_bench.py --features [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, replace
from itertools import combinations
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvlib

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import LLAMA100M, add_run_arguments, command_line, parse_run_arguments, run_metadata, write_report  # noqa: E402
from serve_features import FeatureSettings, run_forecast, run_grouping, run_shared_prefix, run_speculation  # noqa: E402
from serve_features import markdown as features_markdown
from serve_fixed_memory import FixedMemorySettings, compare, markdown, random_prompts, saturating_trace, text_prompts  # noqa: E402
from serve_metrics import agreement, summarize, ttft_p50_by_kind  # noqa: E402
from serve_systems import SYSTEMS, ServeSettings, replay  # noqa: E402
from serve_trace import KINDS, Lengths, Request, TraceConfig, make_trace  # noqa: E402

TINY_LLAMA = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}
"""``LlamaConfig`` sizes of the tiny random Llama the smoke test runs."""
MODELS = {"llama100m": LLAMA100M, "tiny": TINY_LLAMA}
FULL = {"model": "llama100m", "requests": 40, "rate": 40.0, "batch_size": 8}
"""Full-run defaults: sessions arrive faster than any of the three systems serves them, so
tokens/s measures throughput, not the trace's arrival rate (``--rate 4 --turn-delay 3`` gives a
light load, where every system keeps up and the makespans are the arrivals')."""
FULL_TURN_DELAY_S = 0.5
QUICK = {"model": "tiny", "requests": 6, "rate": 50.0, "batch_size": 4}
QUICK_TRACE = {
    "system_len": Lengths(16, 32),
    "user_len": Lengths(4, 8),
    "chat_turns": Lengths(2, 2),
    "turn_delay_s": 0.02,
    "document_len": Lengths(16, 24),
    "question_len": Lengths(4, 8),
    "output_len": Lengths(2, 4),
}
"""Trace lengths (tokens) and turn delay (s) under ``--quick``; the full run keeps ``TraceConfig``'s."""
FIXED_MEMORY = {"model": "llama100m", "requests": 32, "prompt_len": "384,512", "new_tokens": 32}
FIXED_MEMORY_QUICK = {"model": "tiny", "requests": 6, "prompt_len": "24,40", "new_tokens": 6}
"""The fixed-memory mode's defaults (model, requests, prompt tokens LOW,HIGH, output tokens), full and ``--quick``."""


def random_llama(sizes: dict) -> LlamaForCausalLM:
    """A seeded random-weight Llama (fp32, tied embeddings, SDPA) with no EOS token."""
    torch.manual_seed(0)
    config = LlamaConfig(**sizes, max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=None, dtype=torch.float32)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.set_attn_implementation("sdpa")
    return model


def parse_weights(text: str) -> dict[str, float]:
    """``"system=0.4,chat=0.2,rag=0.4"`` -> ``{"system": 0.4, ...}``; kinds left out weigh 0."""
    weights = {}
    for item in text.split(","):
        kind, eq, value = item.partition("=")
        if not eq or kind.strip() not in KINDS:
            raise ValueError(f"bad weight {item!r}: write kind=number with kind one of {', '.join(KINDS)}")
        weights[kind.strip()] = float(value)
    return weights


def parse_systems(text: str) -> list[str]:
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValueError(f"unknown systems {unknown}; choose one or more of {', '.join(SYSTEMS)}")
    if "engine" in systems and not hasattr(kvlib, "Engine"):
        raise ValueError("kvlib has no Engine yet (issue 9): run with --systems padded,generate_batch")
    return systems


def warm_up_requests(requests: list[Request]) -> list[Request]:
    """Two short requests arriving at once: first calls' allocations happen outside the timing."""
    return [replace(r, arrival_s=0.0, prompt_ids=r.prompt_ids[:16], max_new_tokens=2) for r in requests[:2]]


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {','.join(SYSTEMS)} (default all)")
    parser.add_argument("--model", choices=[*sorted(MODELS), "smollm2"], help=f"default {FULL['model']} (smollm2: --fixed-memory-mb only)")
    parser.add_argument("--requests", type=int, help=f"requests in the trace (default {FULL['requests']})")
    parser.add_argument("--rate", type=float, help=f"session arrivals per second (default {FULL['rate']})")
    parser.add_argument("--turn-delay", type=float, help=f"seconds between a chat's turns, 1 to 2 times this (default {FULL_TURN_DELAY_S})")
    parser.add_argument("--weights", default="system=0.4,chat=0.2,rag=0.4", help="session kinds' relative weights")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--batch-size", type=int, help=f"requests per padded batch (default {FULL['batch_size']})")
    parser.add_argument("--max-batch-tokens", type=int, default=256, help="tokens per forward pass (Engine, generate_batch)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (Engine, generate_batch)")
    parser.add_argument(
        "--engine-read-cache",
        action="store_true",
        help="the Engine keeps a dense read mirror of its decode group instead of attending over the pages",
    )
    parser.add_argument("--fixed-memory-mb", type=float, help="fixed-memory mode: every Engine gets this page budget (MiB)")
    parser.add_argument("--codecs", default="kivi(bits=4);rotated(bits=4);gear", help="fixed-memory mode: codec specs, ';'-separated")
    parser.add_argument("--prompt-len", help=f"fixed-memory mode: LOW,HIGH prompt tokens (default {FIXED_MEMORY['prompt_len']})")
    parser.add_argument(
        "--new-tokens", type=int, help=f"fixed-memory mode: output tokens per request (default {FIXED_MEMORY['new_tokens']})"
    )
    parser.add_argument("--max-running", type=int, default=64, help="fixed-memory mode: requests running at once at most")
    parser.add_argument("--features", action="store_true", help="features mode: prefix grouping and forecast admission, on and off")
    parser.add_argument("--repeats", type=int, default=3, help="features mode: interleaved repeats of each variant")
    add_run_arguments(parser, QUICK)
    known = parser.parse_known_args(argv)[0]
    if known.features:
        return run_features(parser.parse_args(argv), argv)
    fixed_memory = known.fixed_memory_mb is not None
    args = parse_run_arguments(parser, argv, *((FIXED_MEMORY_QUICK, FIXED_MEMORY) if fixed_memory else (QUICK, FULL)))
    if fixed_memory:
        return run_fixed_memory(parser, args, argv)
    if args.model == "smollm2":
        parser.error("--model smollm2 serves the fixed-memory mode only (it has an EOS token the baselines would stop at)")
    try:
        systems = parse_systems(args.systems)
        delay = (
            {}
            if args.quick and args.turn_delay is None
            else {"turn_delay_s": FULL_TURN_DELAY_S if args.turn_delay is None else args.turn_delay}
        )
        trace_config = TraceConfig(
            requests=args.requests, rate=args.rate, weights=parse_weights(args.weights), **{**(QUICK_TRACE if args.quick else {}), **delay}
        )
        settings = ServeSettings(
            max_batch_tokens=args.max_batch_tokens,
            page_size=args.page_size,
            batch_size=args.batch_size,
            engine_read_cache=args.engine_read_cache,
        )
    except ValueError as error:
        parser.error(str(error))
    model = random_llama(MODELS[args.model])
    requests = make_trace(trace_config, model.config.vocab_size, args.seed).requests
    load_before = os.getloadavg()[0]
    started = time.perf_counter()

    replays, summaries = {}, {}
    for system in systems:
        replay(system, model, warm_up_requests(requests), settings)
        replays[system] = replay(system, model, requests, settings)
        summaries[system] = {
            **summarize(requests, replays[system]),
            "ttft_p50_s_by_kind": ttft_p50_by_kind(requests, replays[system]),
            **replays[system].extra,
        }
        print(f"{system}: {summaries[system]}", flush=True)
    result = {
        "trace": _trace_summary(requests),
        "trace_config": asdict(trace_config),
        "settings": asdict(settings),
        "systems": summaries,
        "ratios": {
            f"engine/{other}": summaries["engine"]["tokens_per_s"] / summaries[other]["tokens_per_s"]
            for other in systems
            if other != "engine" and "engine" in systems
        },
        "agreement": {f"{a} vs {b}": agreement(replays[a].tokens, replays[b].tokens) for a, b in combinations(systems, 2)},
    }
    result.update(run_metadata(args, load_before, started))
    write_report(args.out, "serve_bench", _markdown(result, argv), result)
    return result


FEATURES_QUICK = FeatureSettings(
    groups=3,
    per_group=3,
    prefix=48,
    group_page_mib=0.125,
    requests=12,
    prompt_tokens=(16, 48),
    forecast_page_mib=0.25,
    shared_rows=3,
    shared_prompt=64,
    shared_steps=4,
    speculate_requests=2,
    speculate_new=8,
    speculate_trace_requests=4,
    repeats=1,
)
"""The features mode's sizes under ``--quick`` (tiny model): a smoke test, not a measurement."""


def run_features(args: argparse.Namespace, argv: Sequence[str] | None) -> dict:
    """The features mode (see the module docstring): one run, one report."""
    from kvlib.devices import set_cpu_threads

    set_cpu_threads(args.threads)
    if args.quick:
        model, settings = random_llama(TINY_LLAMA), replace(FEATURES_QUICK, repeats=min(args.repeats, FEATURES_QUICK.repeats))
    else:
        from kvlib.default_model import load_default_model

        model, settings = load_default_model()[0].eval(), FeatureSettings(repeats=args.repeats)
    load_before, started = os.getloadavg()[0], time.perf_counter()
    kvlib.Engine(model).generate(run_grouping_warm_up(model), max_new_tokens=2)
    result = {
        "settings": asdict(settings),
        "grouping": run_grouping(model, settings),
        "forecast": run_forecast(model, settings),
        "shared_prefix": run_shared_prefix(model, settings),
        "speculation": run_speculation(model, settings, byte_level=not args.quick),
    }
    result.update(run_metadata(args, load_before, started))
    write_report(args.out, "serve_bench_features", features_markdown(result, command_line("serve_bench.py", argv)), result)
    return result


def run_grouping_warm_up(model: torch.nn.Module) -> list[list[int]]:
    """Two short prompts sharing a page: first calls' compilation happens outside the timing."""
    return [[5] * 20 + [6], [5] * 20 + [7, 8]]


def run_fixed_memory(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> dict:
    """The fixed-memory mode (see the module docstring): one run, one report."""
    try:
        low, high = (int(n) for n in args.prompt_len.split(","))
        lengths = Lengths(low, high)
        settings = FixedMemorySettings(
            round(args.fixed_memory_mb * 2**20),
            tuple(s.strip() for s in args.codecs.split(";") if s.strip()),
            args.page_size,
            args.max_batch_tokens,
            args.max_running,
        )
    except ValueError as error:
        parser.error(f"{error} (--prompt-len takes LOW,HIGH tokens)")
    if args.model == "smollm2":
        from kvlib.eval import load_model

        loaded = load_model("smollm2")
        model, note = loaded.model.eval(), "SmolLM2-135M-Instruct, fp32, natural-text prompts"
        prompts = text_prompts(loaded.tokenizer.encode, args.requests, lengths, args.seed)
    else:
        model, note = random_llama(MODELS[args.model]), "random weights, fp32, random-token prompts"
        prompts = random_prompts(args.requests, lengths, model.config.vocab_size, args.seed)
    requests = saturating_trace(prompts, args.new_tokens)
    load_before, started = os.getloadavg()[0], time.perf_counter()
    engines = compare(model, requests, settings)
    result = {
        "trace": {
            "requests": len(requests),
            "prompt_tokens": sum(len(p) for p in prompts),
            "prompt_tokens_min": min(len(p) for p in prompts),
            "prompt_tokens_max": max(len(p) for p in prompts),
            "new_tokens": args.new_tokens,
        },
        "settings": asdict(settings),
        "model_note": note,
        "engines": engines,
    }
    result.update(run_metadata(args, load_before, started))
    write_report(args.out, "serve_bench_fixed_memory", markdown(result, command_line("serve_bench.py", argv)), result)
    return result


def _trace_summary(requests: list[Request]) -> dict:
    prompts = [len(r.prompt_ids) for r in requests]
    return {
        "requests": len(requests),
        "by_kind": dict(Counter(r.kind for r in requests)),
        "prompt_tokens": sum(prompts),
        "prompt_tokens_max": max(prompts),
        "output_tokens": sum(r.max_new_tokens for r in requests),
        "last_arrival_s": requests[-1].arrival_s,
    }


def _engine_memory(result: dict) -> list[str]:
    """The Engine's memory by component (largest after any step), as markdown lines; none
    without an Engine run."""
    memory = result["systems"].get("engine", {}).get("memory")
    if memory is None:
        return []
    mib = 2**20
    parts = ", ".join(f"{name} {value / mib:.1f}" for name, value in memory["peak_by_component"].items())
    mode = "a dense read mirror of the decode group" if result["settings"]["engine_read_cache"] else "decode over the pages, no mirror"
    return [
        f"Engine memory ({mode}), MiB, each component at its largest after any step: {parts}; "
        f"peak pages {memory['peak_pages_bytes'] / mib:.1f}; transient workspace peak (prefill chunks, not held) "
        f"{memory['peak_workspace_bytes'] / mib:.1f}.",
        "",
    ]


def _markdown(result: dict, argv: Sequence[str] | None) -> str:
    t, c, s = result["trace"], result["config"], result["settings"]
    rows = []
    for name, m in result["systems"].items():
        hit = m["stats"]["prefix_hit_rate"] if "stats" in m else None
        rows.append(
            f"| {name} | {m['tokens_per_s']:.1f} | {m['makespan_s']:.1f} | {m['ttft_p50_s'] * 1e3:.0f} | {m['ttft_p99_s'] * 1e3:.0f} "
            f"| {m['tbt_p50_s'] * 1e3:.0f} | {m['tbt_p99_s'] * 1e3:.0f} | {'' if hit is None else f'{hit:.2f}'} |"
        )
    targets = {"engine/padded": 2.0, "engine/generate_batch": 1.0}
    kinds = sorted(t["by_kind"])
    return "\n".join(
        [
            "# serve_bench: kvlib Engine vs padded generate vs transformers continuous batching",
            "",
            f"Command: `{command_line('serve_bench.py', argv)}`",
            "",
            f"Model {c['model']} (random weights, fp32, CPU, greedy, no EOS). Trace: {t['requests']} requests {t['by_kind']}, seed {c['seed']}, "
            f"sessions at {c['rate']}/s (last arrival {t['last_arrival_s']:.1f} s), {t['prompt_tokens']} prompt tokens (longest {t['prompt_tokens_max']}), "
            f"{t['output_tokens']} output tokens. Padded batches of {s['batch_size']}; Engine and generate_batch: {s['max_batch_tokens']} tokens "
            f"per forward pass, pages of {s['page_size']} tokens. Machine: {result['machine']}; 1-minute load {result['load_avg_1min'][0]} before, "
            f"{result['load_avg_1min'][1]} after (other processes share the cores: figures are noisy); {result['seconds']} s. "
            f"Library revision: {result['git']}.",
            "",
            "| system | output tok/s | makespan (s) | TTFT p50 (ms) | TTFT p99 (ms) | TBT p50 (ms) | TBT p99 (ms) | prefix hit rate |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            *(
                [f"- {name}: **{ratio:.2f}x** (target >= {targets[name]:g}x)" for name, ratio in result["ratios"].items()]
                or ["- No ratios: the engine system was not run."]
            ),
            "",
            *_engine_memory(result),
            "TTFT p50 by request kind (ms):",
            "",
            f"| system | {' | '.join(kinds)} |",
            f"|---|{'---:|' * len(kinds)}",
            *[
                f"| {name} | " + " | ".join(f"{m['ttft_p50_s_by_kind'][k] * 1e3:.0f}" for k in kinds) + " |"
                for name, m in result["systems"].items()
            ],
            "",
            "Greedy agreement (same tokens for the same request):",
            "",
            "| systems | requests identical | token positions identical |",
            "|---|---:|---:|",
            *[
                f"| {pair} | {a['requests_identical']} / {a['requests']} | {a['tokens_identical']:.3f} |"
                for pair, a in result["agreement"].items()
            ],
        ]
    )


if __name__ == "__main__":
    run()
