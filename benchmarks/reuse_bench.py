"""Prefix reuse in one run: time to first token with a cached prefix against a full prefill, the
index's cost per prompt token, and the memory of requests sharing a prefix against copies.

Model: the ~100M random Llama (``--model llama100m``, fp32) or stories260K. Prompts are random
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

Target: cached TTFT >= 5x faster than the full prefill.

Usage:

    python benchmarks/reuse_bench.py [--model llama100m|stories] [--prefix-len 2000] [--tail-len 32]
        [--requests 8] [--repeats 3] [--threads N] [--out benchmarks/results]
    python benchmarks/reuse_bench.py --quick --out /tmp/x   # stories, prefix 64, tail 8

Writes ``reuse_bench.md`` and ``reuse_bench.json`` to ``--out``.
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

import kvlib

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from bench_generate import load_model  # noqa: E402
from provenance import add_run_arguments, git_revision, no_machine_path, parse_run_arguments, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FULL = {"model": "llama100m", "prefix_len": 2000, "tail_len": 32, "requests": 8, "repeats": 3}
QUICK = {"model": "stories", "prefix_len": 64, "tail_len": 8, "requests": 3, "repeats": 1}


def first_token(model: torch.nn.Module, cache, prompt: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Logits of the prompt's next token, and the seconds of the forward pass over the uncached part."""
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(input_ids=prompt[:, cache.get_seq_length():], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
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
    return {"cached_s": prime + forward, "prime_s": prime, "full_s": full, "reused_tokens": reused,
            "max_logit_diff": float((cached_logits - full_logits).abs().max())}


def index_cost(model: torch.nn.Module, store: kvlib.PrefixStore, prompt: torch.Tensor) -> dict:
    """Seconds per prompt token to hash + look up (cold and warm) and to insert a prompt's blocks."""
    cache = kvlib.make_cache(model, reuse=store)
    first_token(model, cache, prompt)  # a sequence holding the prompt, not indexed (no prompt given)
    session = cache._session
    blocks = session_blocks(prompt, cache.store.page_size)
    namespace = session.namespace
    tokens = len(blocks) * cache.store.page_size
    cold = _seconds(lambda: store.lookup(namespace, blocks))
    start = time.perf_counter()
    entries = store.insert(namespace, cache._rows[0], blocks, 0)
    insert = time.perf_counter() - start
    warm = _seconds(lambda: store.lookup(namespace, blocks))
    store.release(entries)
    cache.reset()
    return {"tokens": tokens, "lookup_miss_us_per_token": cold / tokens * 1e6,
            "lookup_hit_us_per_token": warm / tokens * 1e6, "insert_us_per_token": insert / tokens * 1e6}


def session_blocks(prompt: torch.Tensor, size: int) -> list[list[int]]:
    row = prompt[0].tolist()
    return [row[i * size : (i + 1) * size] for i in range(len(row) // size)]


def _seconds(action, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    return {"requests": len(prompts), "shared_bytes": shared_bytes, "separate_bytes": separate_bytes,
            "ratio": shared_bytes / separate_bytes}


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["llama100m", "stories"], help="default llama100m")
    parser.add_argument("--prefix-len", type=int, help=f"shared prefix tokens (default {FULL['prefix_len']})")
    parser.add_argument("--tail-len", type=int, help=f"distinct tail tokens per request (default {FULL['tail_len']})")
    parser.add_argument("--requests", type=int, help=f"requests sharing the prefix (default {FULL['requests']})")
    parser.add_argument("--repeats", type=int, help=f"TTFT measurements (default {FULL['repeats']})")
    add_run_arguments(parser, QUICK, stories=True)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    stories_path = args.stories_path if args.stories_path.is_absolute() else REPO / args.stories_path
    model = load_model(args.model, stories_path)
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
    }
    result["ttft"]["speedup"] = result["ttft"]["full_s"] / result["ttft"]["cached_s"]
    config = {k: v for k, v in vars(args).items() if k not in ("out", "stories_path")}
    result.update(config=config, machine=f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
                  git=git_revision(), load_avg_1min=[round(load_before, 2), round(os.getloadavg()[0], 2)],
                  seconds=round(time.perf_counter() - started, 1))
    write_report(args.out, "reuse_bench", _markdown(result, argv), result)
    return result


def _markdown(result: dict, argv: Sequence[str] | None) -> str:
    c, t, i, m = result["config"], result["ttft"], result["index"], result["memory"]
    given = [no_machine_path(a) for a in (sys.argv[1:] if argv is None else argv)]
    return "\n".join([
        "# reuse_bench: prefix reuse (TTFT, index cost, shared memory)",
        "",
        f"Command: `{shlex.join(['python', 'benchmarks/reuse_bench.py', *given])}`",
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
    ])


if __name__ == "__main__":
    run()
