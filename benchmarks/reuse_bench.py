"""Prefix reuse in one run: time to first token with a cached prefix against a full prefill, the
index's cost per prompt token, and the memory of requests sharing a prefix against copies.

Model: the ~100M random Llama (``--model llama100m``, fp32) or the embedded default model
(``--model default``). Prompts are random
token ids (seeded): a ``--prefix-len`` shared prefix (a system prompt, a document) and distinct
``--tail-len`` tails.

- TTFT: one request whose prefix another request already computed. Cached: ``make_cache(model,
  reuse=store, prompt=ids)`` (hash chain, lookup, attaching the pages) plus the forward pass over
  the uncached tail; full: ``make_cache(model)`` plus the forward pass over the whole prompt. Both
  end with the first token's logits (asserted equal). Medians of ``--repeats``, interleaved.
- Index cost: hashing and looking up a prompt's blocks (``PrefixStore.lookup``: a miss on a cold
  store, a hit on a warm one) and inserting them (``PrefixStore.insert``), per prompt token.
- Memory: ``--requests`` requests sharing the prefix, each primed from the store and run to its
  first token, against the same requests with separate exact caches: bytes of pages and positions
  held (the paged store's, and the sum of the separate caches').

Chunk reuse (CacheBlend, ``kvlib.blend_cache``):

- quality on the embedded default model (trained) against full recomputation: ``--chunk-contexts``
  model-sampled texts, each cut into three consecutive ``--chunk-len``-token chunks (computed
  alone, so a chunk misses the text so far) and the next 16 tokens as the question; KL(full || blended) and greedy
  agreement over 32 teacher-forced steps, for recompute shares 0, 0.15, 0.3 and 1 (KV-deviation
  rule) and 0.15 with the ``first`` and ``random`` rules;
- time to first token on the benchmark model: three ``--prefix-len / 3``-token chunks already in
  the ChunkStore plus a ``--tail-len`` question, ``blend_cache`` + the question's forward pass,
  against a full prefill of the same prompt.

Target: cached TTFT >= 5x faster than the full prefill.

Usage:

    python benchmarks/reuse_bench.py [--model llama100m|default] [--prefix-len 2000] [--tail-len 32]
        [--requests 8] [--repeats 3] [--threads N] [--out benchmarks/results]
    python benchmarks/reuse_bench.py --quick --out /tmp/x   # the default model, prefix 64, tail 8

Writes ``reuse_bench.md`` and ``reuse_bench.json`` to ``--out``.
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
from kvlib.transformers_compat import cache_argument

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from eviction_quality import sample_texts  # noqa: E402
from provenance import (  # noqa: E402
    add_run_arguments,
    command_line,
    load_bench_model,
    median_seconds,
    parse_run_arguments,
    run_metadata,
    write_report,
)

FULL = {"model": "llama100m", "prefix_len": 2000, "tail_len": 32, "requests": 8, "repeats": 3, "chunk_contexts": 8, "chunk_len": 128}
QUICK = {"model": "default", "prefix_len": 64, "tail_len": 8, "requests": 3, "repeats": 1, "chunk_contexts": 1, "chunk_len": 32}
BLENDS = (("deviation", 0.0), ("deviation", 0.15), ("deviation", 0.3), ("deviation", 1.0), ("first", 0.15), ("random", 0.15))


def first_token(model: torch.nn.Module, cache, prompt: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Logits of the prompt's next token, and the seconds of the forward pass over the uncached part."""
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(input_ids=prompt[:, cache.get_seq_length() :], **cache_argument(cache), use_cache=True, logits_to_keep=1).logits[
            :, -1
        ]
    return logits, time.perf_counter() - start


def ttft(model: torch.nn.Module, store: kvlib.PrefixStore, prompt: torch.Tensor) -> dict:
    gc.collect()
    start = time.perf_counter()
    cached = kvlib.make_cache(model, reuse=store, prompt=prompt)
    prime = time.perf_counter() - start
    reused = cached.get_seq_length()
    cached_logits, forward = first_token(model, cached, prompt)
    cached.reset()
    gc.collect()
    start = time.perf_counter()
    full_cache = kvlib.make_cache(model)
    full_logits, full_forward = first_token(model, full_cache, prompt)
    full = time.perf_counter() - start
    assert torch.equal(cached_logits.argmax(-1), full_logits.argmax(-1))
    return {
        "cached_s": prime + forward,
        "prime_s": prime,
        "full_s": full,
        "reused_tokens": reused,
        "max_logit_diff": float((cached_logits - full_logits).abs().max()),
    }


def index_cost(model: torch.nn.Module, store: kvlib.PrefixStore, prompt: torch.Tensor) -> dict:
    """Seconds per prompt token to hash + look up (cold and warm) and to insert a prompt's blocks."""
    cache = kvlib.make_cache(model, reuse=store)
    first_token(model, cache, prompt)  # a sequence holding the prompt, not indexed (no prompt given)
    session = cache.session
    blocks = session_blocks(prompt, cache.store.page_size)
    namespace = session.namespace
    tokens = len(blocks) * cache.store.page_size
    cold = median_seconds(lambda: store.release(store.lookup(namespace, blocks)), 5)
    start = time.perf_counter()
    entries = store.insert(namespace, cache._rows[0], blocks, 0)
    insert = time.perf_counter() - start
    warm = median_seconds(lambda: store.release(store.lookup(namespace, blocks)), 5)
    store.release(entries)
    cache.reset()
    return {
        "tokens": tokens,
        "lookup_miss_us_per_token": cold / tokens * 1e6,
        "lookup_hit_us_per_token": warm / tokens * 1e6,
        "insert_us_per_token": insert / tokens * 1e6,
    }


def session_blocks(prompt: torch.Tensor, size: int) -> list[list[int]]:
    row = prompt[0].tolist()
    return [row[i * size : (i + 1) * size] for i in range(len(row) // size)]


def memory(model: torch.nn.Module, store: kvlib.PrefixStore, prompts: list[torch.Tensor]) -> dict:
    shared = [kvlib.make_cache(model, reuse=store, prompt=p) for p in prompts]
    for cache, prompt in zip(shared, prompts):
        first_token(model, cache, prompt)
    paged = shared[0].store
    held = paged.memory_bytes()
    shared_bytes = held["pages"] + held["positions"] + held["codec_metadata"]
    separate_bytes = 0
    for prompt in prompts:
        cache = kvlib.make_cache(model, read_cache=False)
        first_token(model, cache, prompt)
        report = cache.memory_report()["by_component"]
        separate_bytes += report["pages"] + report["positions"]
    for cache in shared:
        cache.reset()
    return {
        "requests": len(prompts),
        "shared_bytes": shared_bytes,
        "separate_bytes": separate_bytes,
        "ratio": shared_bytes / separate_bytes,
    }


def chunk_quality(contexts: int, length: int) -> list[dict]:
    """KL and agreement of blended caches against full recomputation on the embedded default model."""
    from kvlib.eval import load_model
    from kvlib.eval.agreement import agreement_metrics, greedy_reference, teacher_forced_logits
    from kvlib.policies.reuse.cacheblend import CacheBlend

    loaded = load_model("default")
    model = loaded.model
    texts = sample_texts(model, loaded.tokenizer, contexts, 3 * length + 16, 100, 0.8)
    kvlib.attach(model)
    store = kvlib.ChunkStore(model, capacity_bytes=2**30)
    rows = {rule_share: {"kl": [], "agreement": []} for rule_share in BLENDS}
    for text in texts:
        chunks = [text[i * length : (i + 1) * length] for i in range(3)]
        question = text[None, 3 * length :]
        prompt = torch.cat([torch.cat(chunks)[None], question], 1)
        tokens, reference = greedy_reference(model, kvlib.make_cache(model), prompt, 32)
        for rule, share in BLENDS:
            cache = kvlib.blend_cache(model, chunks, store, CacheBlend(recompute=share, select=rule))
            metrics = agreement_metrics(tokens, reference, teacher_forced_logits(model, cache, question, tokens))
            rows[(rule, share)]["kl"].append(metrics["kl"])
            rows[(rule, share)]["agreement"].append(metrics["agreement"])
    return [
        {"select": rule, "recompute": share, "kl": statistics.mean(r["kl"]), "agreement": statistics.mean(r["agreement"])}
        for (rule, share), r in rows.items()
    ]


def chunk_ttft(model: torch.nn.Module, chunks: list[torch.Tensor], question: torch.Tensor, repeats: int) -> list[dict]:
    """Blended cache (chunks cached) + the question's forward pass, against a full prefill."""
    from kvlib.policies.reuse.cacheblend import CacheBlend

    store = kvlib.ChunkStore(model, capacity_bytes=2**34)
    for chunk in chunks:
        store.kv(model, chunk)
    prompt = torch.cat([torch.cat(chunks)[None], question], 1)
    rows = []
    for share in (0.15, 0.3):
        blended, full = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            cache = kvlib.blend_cache(model, chunks, store, CacheBlend(recompute=share))
            first_token(model, cache, prompt)
            blended.append(time.perf_counter() - start)
            start = time.perf_counter()
            first_token(model, kvlib.make_cache(model), prompt)
            full.append(time.perf_counter() - start)
        rows.append(
            {
                "recompute": share,
                "blend_s": statistics.median(blended),
                "full_s": statistics.median(full),
                "speedup": statistics.median(full) / statistics.median(blended),
            }
        )
    return rows


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["llama100m", "default"], help="default llama100m")
    parser.add_argument("--prefix-len", type=int, help=f"shared prefix tokens (default {FULL['prefix_len']})")
    parser.add_argument("--tail-len", type=int, help=f"distinct tail tokens per request (default {FULL['tail_len']})")
    parser.add_argument("--requests", type=int, help=f"requests sharing the prefix (default {FULL['requests']})")
    parser.add_argument("--repeats", type=int, help=f"TTFT measurements (default {FULL['repeats']})")
    parser.add_argument("--chunk-contexts", type=int, help=f"chunk quality prompts (default {FULL['chunk_contexts']})")
    parser.add_argument("--chunk-len", type=int, help=f"tokens per chunk in the quality runs (default {FULL['chunk_len']})")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    model = load_bench_model(args.model)
    kvlib.attach(model)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, args.prefix_len), generator=generator)
    tails = [torch.randint(0, vocab, (1, args.tail_len), generator=generator) for _ in range(args.requests + args.repeats + 2)]
    prompts = [torch.cat([prefix, tail], 1) for tail in tails]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()

    store = kvlib.PrefixStore(model, capacity_bytes=2**34)
    warm = kvlib.make_cache(model, reuse=store, prompt=prompts[0])  # the first request computes the prefix
    first_token(model, warm, prompts[0])
    warm.reset()
    runs = [ttft(model, store, prompts[1 + i]) for i in range(args.repeats)]
    result = {
        "ttft": {
            "cached_s": statistics.median(r["cached_s"] for r in runs),
            "prime_s": statistics.median(r["prime_s"] for r in runs),
            "full_s": statistics.median(r["full_s"] for r in runs),
            "reused_tokens": runs[0]["reused_tokens"],
            "max_logit_diff": max(r["max_logit_diff"] for r in runs),
            "runs": runs,
        },
        "index": index_cost(model, kvlib.PrefixStore(model, capacity_bytes=2**34), prompts[-1]),
        "memory": memory(model, store, prompts[-args.requests - 1 : -1]),
        "stats": store.stats(),
        "chunk_quality": chunk_quality(args.chunk_contexts, args.chunk_len),
        "chunk_ttft": chunk_ttft(
            model, [prefix[:, i * (args.prefix_len // 3) : (i + 1) * (args.prefix_len // 3)][0] for i in range(3)], tails[-1], args.repeats
        ),
    }
    result["ttft"]["speedup"] = result["ttft"]["full_s"] / result["ttft"]["cached_s"]
    result.update(run_metadata(args, load_before, started))
    write_report(args.out, "reuse_bench", _markdown(result, argv), result)
    return result


def _markdown(result: dict, argv: Sequence[str] | None) -> str:
    c, t, i, m = result["config"], result["ttft"], result["index"], result["memory"]
    return "\n".join(
        [
            "# reuse_bench: prefix reuse (TTFT, index cost, shared memory)",
            "",
            f"Command: `{command_line('reuse_bench.py', argv)}`",
            "",
            f"Model {c['model']}, prefix {c['prefix_len']} tokens, tails {c['tail_len']} tokens. Machine: {result['machine']}; "
            f"1-minute load {result['load_avg_1min'][0]} before, {result['load_avg_1min'][1]} after; {result['seconds']} s. "
            f"Library revision: {result['git']}.",
            "",
            "| measure | value |",
            "|---|---:|",
            f"| TTFT, full prefill ({c['prefix_len'] + c['tail_len']} tokens) | {t['full_s'] * 1e3:.1f} ms |",
            f"| TTFT, cached prefix ({t['reused_tokens']} tokens reused; prime {t['prime_s'] * 1e3:.1f} ms) | {t['cached_s'] * 1e3:.1f} ms |",
            f"| speedup (target >= 5x) | **{t['speedup']:.1f}x** |",
            f"| first-token logits, max abs difference (same argmax asserted) | {t['max_logit_diff']:.2g} |",
            f"| index: hash + lookup, miss | {i['lookup_miss_us_per_token']:.2f} us / token |",
            f"| index: hash + lookup, hit | {i['lookup_hit_us_per_token']:.2f} us / token |",
            f"| index: insert | {i['insert_us_per_token']:.2f} us / token |",
            f"| memory, {m['requests']} requests sharing the prefix | {m['shared_bytes'] / 2**20:.1f} MiB |",
            f"| memory, {m['requests']} separate caches | {m['separate_bytes'] / 2**20:.1f} MiB |",
            f"| shared / separate | **{m['ratio']:.3f}** |",
            "",
            f"Index counters at the end: {result['stats']}.",
            "",
            f"## Chunk reuse (CacheBlend) on the default model: {c['chunk_contexts']} sampled texts cut into three {c['chunk_len']}-token chunks + the next 16 tokens",
            "",
            "Against full recomputation, over 32 teacher-forced greedy steps.",
            "",
            "| selection | tokens recomputed | KL (nats) | greedy agreement |",
            "|---|---:|---:|---:|",
            *[f"| {r['select']} | {r['recompute']:.0%} | {r['kl']:.4f} | {r['agreement']:.3f} |" for r in result["chunk_quality"]],
            "",
            f"Time to first token on {c['model']}, three {c['prefix_len'] // 3}-token chunks in the ChunkStore + a {c['tail_len']}-token question:",
            "",
            "| tokens recomputed | blend + question | full prefill | speedup |",
            "|---:|---:|---:|---:|",
            *[
                f"| {r['recompute']:.0%} | {r['blend_s'] * 1e3:.1f} ms | {r['full_s'] * 1e3:.1f} ms | {r['speedup']:.1f}x |"
                for r in result["chunk_ttft"]
            ],
        ]
    )


if __name__ == "__main__":
    run()
