"""Output quality of every registered eviction policy on a trained model (``--model``, default the
embedded ``default`` model), against the full cache.

Text: the model writes it. The contexts are sampled as one batch from ``BOS + PROMPT`` (the
default model learnt Python's standard library, so ``PROMPT`` opens a class) with the full cache
(``DynamicCache``), row ``i`` drawing from a generator seeded ``--seed + i``, temperature
``--temperature``, BOS and EOS (which end a text) forbidden, so each sample is one long text whose
later lines can refer back to names introduced early (what eviction must keep). Its first ``--context-len`` tokens are the context; the next
``--continuation-len`` are the held-out continuation. Perplexity on the model's own samples is
lower than on human text: compare it across policies, not with published figures.

For each policy (every registered eviction policy, each with its default parameters, plus
``full``: ``kvlib.make_cache(model)`` with no spec) and each budget, all contexts run as one
batch (eviction works per row and head, so a row keeps what it would keep alone). Two teacher-forced passes, each a prefill of the
context followed by single-token forwards, so the cache evicts while the tokens stream, give:

- greedy agreement: the full cache decodes ``--new-tokens`` greedy tokens; the evicted cache is
  fed the same tokens, and each step's argmax is compared with the full cache's token (one early
  mismatch does not derail the rest). Also the first step whose argmax differs (``new_tokens``
  if none), averaged over contexts;
- KL: mean ``KL(full || evicted)`` of the next-token distributions over those same steps (nats);
- perplexity of the held-out continuation, ``exp`` of the mean negative log-likelihood over all
  its tokens of all contexts (pooled).

Budgets: ``--budgets`` are fractions of the context turned into token counts per head (``int(f *
context_len)``: an int budget, a cap held at all times, during the prefill and every decode
step); ``--float-budgets`` are passed as floats (prompt compression: the prefill keeps that
fraction, then decode steps keep every new token). KV bytes vs full: ``memory_report()`` at the
end of the perplexity pass (context + continuation stored), ``total_bytes`` (pages, positions,
tables, read mirror) and ``pages`` alone, over the full cache's. What is kept, at the same point:
the share of (row, layer, KV head) slots holding each of positions 0-3 and each of the 16 newest
positions, and tokens per head by layer (JSON). A policy that raises is reported with its error
and the run goes on.

Usage (defaults: 8 contexts of 400 tokens, 100 new tokens, 100 continuation tokens, budgets
0.25,0.5 as token counts and 0.25,0.5 as floats; the default model's trained context is 1024 tokens):

    python benchmarks/eviction_quality.py [--policies all|name,name] [--contexts 8] [--context-len 400]
        [--new-tokens 100] [--continuation-len 100] [--budgets 0.25,0.5] [--float-budgets 0.25,0.5]
        [--seed 0] [--temperature 0.8] [--threads N] [--model default] [--out benchmarks/results]
    python benchmarks/eviction_quality.py --quick --out /tmp/x   # 2 contexts of 48 tokens, 8 + 8 tokens

Writes ``eviction_quality.md`` and ``eviction_quality.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

import kvlib
from kvlib.eval import load_model
from kvlib.eval.agreement import agreement_metrics, greedy_reference, teacher_forced_logits
from kvlib.transformers_compat import cache_argument

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import (  # noqa: E402
    add_run_arguments,
    git_revision,
    no_machine_path,
    parse_run_arguments,
    write_report,
)

FULL = {"contexts": 8, "context_len": 400, "new_tokens": 100, "continuation_len": 100, "budgets": "0.25,0.5", "float_budgets": "0.25,0.5"}
QUICK = {"contexts": 2, "context_len": 48, "new_tokens": 8, "continuation_len": 8, "budgets": "0.25", "float_budgets": "0.25"}
PROMPT = "class "
"""Where every sampled text starts (after BOS)."""


def sample_texts(model, tokenizer, count: int, length: int, seed: int, temperature: float) -> torch.Tensor:
    """int64 ``[count, length]``: ``count`` texts sampled as one batch from BOS + PROMPT with the full
    cache, row ``i`` drawing from a generator seeded ``seed + i``; BOS and EOS are forbidden after the
    first token. ``tokenizer``: a ``kvlib.eval`` text tokenizer (``encode(text, bos=...)``)."""
    tokens = torch.tensor([tokenizer.encode(PROMPT, bos=True)]).repeat(count, 1)
    forbidden = [i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None]
    generators = [torch.Generator().manual_seed(seed + i) for i in range(count)]
    cache = DynamicCache(config=model.config)
    fed = tokens
    with torch.inference_mode():
        while tokens.shape[1] < length:
            logits = model(input_ids=fed, **cache_argument(cache), use_cache=True).logits[:, -1].float()
            logits[:, forbidden] = -torch.inf
            probs = torch.softmax(logits / temperature, dim=-1)
            fed = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)]).unsqueeze(-1)
            tokens = torch.cat([tokens, fed], dim=1)
    return tokens


def evaluate(model, make, context, greedy_tokens, full_logits, continuation) -> dict:
    """Agreement, first divergence, KL and perplexity for caches built by ``make()``; memory at the end."""
    agreement = agreement_metrics(greedy_tokens, full_logits, teacher_forced_logits(model, make(), context, greedy_tokens))
    cache = make()
    logp = torch.log_softmax(teacher_forced_logits(model, cache, context, continuation), -1)
    nll = -logp.gather(-1, continuation.unsqueeze(-1)).squeeze(-1)
    report = cache.memory_report()
    return {
        **kept_profile(cache, cache.get_seq_length()),
        "agreement": agreement["agreement"],
        "agreement_per_context": agreement["agreement_per_row"],
        "first_divergence": agreement["first_divergence"],
        "first_divergence_per_context": agreement["first_divergence_per_row"],
        "kl": agreement["kl"],
        "kl_per_context": agreement["kl_per_row"],
        "ppl": math.exp(nll.mean().item()),
        "ppl_per_context": nll.mean(-1).exp().tolist(),
        "total_bytes": report["total_bytes"],
        "pages_bytes": report["by_component"]["pages"],
        "codec_metadata_bytes": report["by_component"]["codec_metadata"],
        "positions_bytes": report["by_component"]["positions"],
        "stored_tokens": report["stored_tokens"],
        "logical_tokens": report["logical_tokens"],
    }


def kept_profile(cache, seen: int) -> dict:
    """What the cache holds after ``seen`` tokens: the share of (row, layer, head) slots holding each of
    the first 4 positions and each of the last 16, and the mean tokens per head of every layer."""
    first = last = 0.0
    per_layer = []
    for layer in range(len(cache.layers)):
        kept = cache.kept_positions(layer)
        heads = kept.shape[0] * kept.shape[1]
        first += ((kept >= 0) & (kept < 4)).sum().item() / (4 * heads)
        last += (kept >= seen - 16).sum().item() / (16 * heads)
        per_layer.append(round((kept >= 0).sum().item() / heads, 1))
    layers = len(per_layer)
    return {"first4_kept": first / layers, "last16_kept": last / layers, "kept_per_layer": per_layer}


def _fractions(text: str) -> list[float]:
    return [float(f) for f in text.split(",") if f.strip()]


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="all", help="'all' (every registered eviction policy) or a comma-separated list")
    parser.add_argument("--contexts", type=int, help=f"contexts (seeds), one batch (default {FULL['contexts']})")
    parser.add_argument("--context-len", type=int, help=f"context tokens (default {FULL['context_len']})")
    parser.add_argument("--new-tokens", type=int, help=f"greedy steps compared (default {FULL['new_tokens']})")
    parser.add_argument("--continuation-len", type=int, help=f"held-out tokens scored (default {FULL['continuation_len']})")
    parser.add_argument("--budgets", help=f"fractions of the context, applied as int token caps (default {FULL['budgets']})")
    parser.add_argument("--float-budgets", help=f"fractions passed as float budgets; '' for none (default {FULL['float_budgets']})")
    parser.add_argument("--seed", type=int, default=0, help="context i is sampled with seed + i")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of the texts")
    parser.add_argument("--model", default="default", help="any kvlib.eval.load_model name (default: the embedded model)")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    registered = kvlib.available_policies()["eviction"]
    policies = registered if args.policies == "all" else [s.strip() for s in args.policies.split(",") if s.strip()]
    unknown = sorted(set(policies) - set(registered))
    if unknown:
        parser.error(f"unknown policies {unknown}; registered: {', '.join(registered)}")
    budgets = [max(1, int(f * args.context_len)) for f in _fractions(args.budgets)]
    budgets += _fractions(args.float_budgets)
    steps = max(args.new_tokens, args.continuation_len)

    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    if args.context_len + steps > model.config.max_position_embeddings:
        print(
            f"note: {args.context_len} + {steps} tokens run past the trained context ({model.config.max_position_embeddings})",
            file=sys.stderr,
        )
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    length = args.context_len + args.continuation_len
    texts = sample_texts(model, tokenizer, args.contexts, length, args.seed, args.temperature)
    context, continuation = texts[:, : args.context_len], texts[:, args.context_len :]
    kvlib.attach(model)
    greedy_tokens, full_logits = greedy_reference(model, kvlib.make_cache(model), context, args.new_tokens)

    rows = []
    full = evaluate(model, lambda: kvlib.make_cache(model), context, greedy_tokens, full_logits, continuation)
    rows.append({"policy": "full", "budget": None, **full})
    print(_row_line(rows[-1]), flush=True)
    for budget in budgets:
        for name in policies:
            row = {"policy": name, "budget": budget}
            start = time.perf_counter()
            try:
                row.update(
                    evaluate(model, lambda: kvlib.make_cache(model, name, budget=budget), context, greedy_tokens, full_logits, continuation)
                )
                row["bytes_vs_full"] = row["total_bytes"] / full["total_bytes"]
                row["pages_vs_full"] = row["pages_bytes"] / full["pages_bytes"]
            except Exception as error:  # a policy in progress must not stop the others' measurement
                row["error"] = f"{type(error).__name__}: {error}"
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            print(_row_line(row), flush=True)

    config = {k: v for k, v in vars(args).items() if k != "out"}
    config.update(policies=policies, budget_values=budgets)
    result = {
        "config": config,
        "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "git": git_revision(),
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "seconds": round(time.perf_counter() - started, 1),
        "sample_text": tokenizer.decode(texts[0].tolist()),
        "rows": rows,
    }
    report = _markdown(result, argv)
    write_report(args.out, "eviction_quality", report, result)
    return result


def _budget_label(budget: int | float | None, context_len: int) -> str:
    if budget is None:
        return "-"
    if isinstance(budget, float):
        return f"{budget:g} (float: prompt only)"
    return f"{budget} tokens ({budget / context_len:.0%} of context)"


def _row_line(row: dict) -> str:
    if "error" in row:
        return f"{row['policy']} budget {row['budget']}: ERROR {row['error']}"
    return (
        f"{row['policy']} budget {row['budget']}: agreement {row['agreement']:.3f}, first divergence "
        f"{row['first_divergence']:.1f}, ppl {row['ppl']:.3f}, KL {row['kl']:.4f}"
    )


def _markdown(result: dict, argv: Sequence[str] | None) -> str:
    c = result["config"]
    given = [no_machine_path(a) for a in (sys.argv[1:] if argv is None else argv)]
    command = shlex.join(["python", "benchmarks/eviction_quality.py", *given])
    full = result["rows"][0]
    lines = [
        f"# eviction_quality: eviction policies vs the full cache on the {c['model']} model",
        "",
        f"Command: `{command}`",
        "",
        f"{c['contexts']} contexts of {c['context_len']} tokens (model-sampled texts from {PROMPT!r}, seeds {c['seed']}.."
        f"{c['seed'] + c['contexts'] - 1}, temperature {c['temperature']}, BOS and EOS forbidden), one batch. Greedy "
        f"agreement, first divergence and KL(full || evicted) over {c['new_tokens']} steps teacher-forced on the full "
        f"cache's greedy tokens; perplexity of the {c['continuation_len']}-token held-out continuation, teacher-forced "
        f"while the cache "
        f"keeps evicting. Every policy with its default parameters. Machine: {result['machine']}; 1-minute load "
        f"{result['load_avg_1min'][0]} before, {result['load_avg_1min'][1]} after; {result['seconds']} s. "
        f"Library revision: {result['git']}.",
        "",
        "Int budgets are caps per (layer, KV head) held during the prefill and every decode step; float budgets "
        "compress the prompt only (decode steps keep every new token). KV bytes vs full: `memory_report()` after the "
        "context + continuation, `total_bytes` (with the read mirror) and `pages` alone, over the full cache's. "
        "First 4 / last 16 kept: at the end of the perplexity pass, the share of (row, layer, KV head) slots that "
        "still hold each of positions 0-3 (attention-sink candidates) and each of the 16 newest positions.",
        "",
        f"Full cache: perplexity {full['ppl']:.3f}, agreement {full['agreement']:.3f}, KL {full['kl']:.2g}.",
    ]
    for budget in c["budget_values"]:
        rows = sorted((r for r in result["rows"] if r["budget"] == budget), key=lambda r: r.get("kl", math.inf))
        lines += [
            "",
            f"## Budget {_budget_label(budget, c['context_len'])}",
            "",
            "| policy | greedy agreement | first divergence (mean step) | perplexity | ppl / full | KL (nats) "
            "| KV bytes vs full | pages vs full | first 4 kept | last 16 kept |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['policy']} | error: {r['error'][:120]} | | | | | | | | |")
                continue
            lines.append(
                f"| {r['policy']} | {r['agreement']:.3f} | {r['first_divergence']:.1f} | {r['ppl']:.3f} | "
                f"{r['ppl'] / full['ppl']:.3f} | {r['kl']:.4f} | {r['bytes_vs_full']:.3f} | {r['pages_vs_full']:.3f} | "
                f"{r['first4_kept']:.2f} | {r['last16_kept']:.2f} |"
            )
    lines += ["", "Rows sorted by KL (lowest first)."]
    return "\n".join(lines)


if __name__ == "__main__":
    run()
