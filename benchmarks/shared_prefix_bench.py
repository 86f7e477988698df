"""Shared-prefix (Hydragen) attention in the Engine's decode group, on and off, interleaved step by
step in one run: K/V bytes read per decode step and decode output tokens/s.

Workload: ``rows`` requests share one prompt of ``prompt`` tokens (whole pages), each followed by
a question of its own (8 tokens). The first request computes the prompt; the others attach its
pages from the prefix cache (so their block tables begin with the same pages) and compute their
questions. Once every request decodes, the engine runs ``steps`` decode steps, switching its
runner's ``shared_prefix`` between steps (on, off, off, on, ...: the same requests, pages and load
for both; on is ``Engine(shared_prefix=0)``, the split wherever pages are shared, whatever it saves;
the Engine's default splits only where it saves ``MIN_SAVED_READS`` reads per layer), after one untimed step of
each. Per step: wall seconds (rows output tokens each) and the K/V bytes its decode group read
(``stats()["kv_read_bytes"]``). The greedy tokens of a separate short run of each variant are
compared (``outputs equal``).

The model: ``kvread`` (default), a random-weight Llama sized so that K/V reads matter: 4 layers,
4 query and 4 KV heads of 64 channels (multi-head: one query row per KV head and row, as decode
attention is at its most memory-bound), hidden 256, 8192 positions, fp32; or ``llama100m``, or a
name ``kvlib.eval.load_model`` takes (its context must hold the prompt). ``--device cuda`` runs it
on a GPU (the Triton kernels; each step's tokens come back to the host, so a step's time includes
its device work).
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
from transformers import LlamaConfig, LlamaForCausalLM

import kvlib
from kvlib.kernels.shared_prefix import MAX_GROUP_ROWS

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import add_run_arguments, command_line, load_bench_model, parse_run_arguments, run_metadata, write_report  # noqa: E402

KV_READ = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
}
"""``LlamaConfig`` sizes of the ``kvread`` model (about 3M parameters: a decode step's time is its K/V reads)."""
QUESTION = 8
PAGE_SIZE = 16
"""The Engine's default page size (tokens per page)."""
"""Tokens of each request's own question after the shared prompt."""
FULL = {"model": "kvread", "rows": "8,16,32", "prompts": "1024,2048,4096", "steps": 16, "new": 4}
QUICK = {"model": "kvread", "rows": "3", "prompts": "64", "steps": 4, "new": 2}


def load(name: str) -> torch.nn.Module:
    """The benchmark's model (module docstring)."""
    if name == "kvread":
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**KV_READ, dtype=torch.float32)).to(torch.float32).eval()
    return load_bench_model(name)


def prompts(vocab: int, rows: int, prompt: int, seed: int) -> list[list[int]]:
    """``rows`` prompts: one shared prompt of ``prompt`` tokens, then a question of :data:`QUESTION` tokens each."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (prompt,), generator=generator).tolist()
    return [shared + torch.randint(3, vocab, (QUESTION,), generator=generator).tolist() for _ in range(rows)]


def decoding(engine: kvlib.Engine, rows: int) -> kvlib.Engine:
    """Step ``engine`` until all ``rows`` requests decode (each has computed its prompt)."""
    while sum(request.remaining == 1 for request in engine.scheduler.running) < rows:
        engine.step()
    return engine


def interleaved(model: torch.nn.Module, batch: list[list[int]], shared: int, steps: int, max_batch_tokens: int) -> dict:
    """Decode steps of one engine over ``batch`` (whose requests share ``shared`` tokens of full
    pages), alternating shared-prefix attention on and off; per variant the tokens/s and K/V MiB
    read per step, and the MiB a step would read without sharing and with the shared tokens
    read once (``expected``, from the requests' stored tokens)."""
    rows = len(batch)
    shape = kvlib.model_shape.kv_shape(model)
    token_bytes = shape.num_layers * shape.num_kv_heads * (shape.head_dim + shape.value_dim) * next(model.parameters()).element_size()
    engine = kvlib.Engine(model, max_batch_tokens=max_batch_tokens)
    for prompt in batch:
        engine.add_request(prompt, max_new_tokens=steps + 64, eos_token_id=None)  # none finishes while measured
    decoding(engine, rows)
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    read: dict[str, list[int]] = {"on": [], "off": []}
    expected: dict[str, list[int]] = {"on": [], "off": []}
    order = ["on", "off"] + [variant for index in range(steps // 2) for variant in (("on", "off") if index % 2 else ("off", "on"))]
    for index, variant in enumerate(order):
        engine.runner.shared_prefix = 0 if variant == "on" else None  # on: split wherever pages are shared
        before = engine.stats()["kv_read_bytes"]
        stored = [request.computed + 1 for request in engine.scheduler.running]  # each step's token is stored before attention
        tokens = shared * -(-rows // MAX_GROUP_ROWS) + sum(held - shared for held in stored) if variant == "on" else sum(stored)
        start = time.perf_counter()
        produced = engine.step()
        elapsed = time.perf_counter() - start
        assert len(produced) == rows, "every request decodes in every measured step"
        if index >= 2:  # the first of each: untimed
            seconds[variant].append(elapsed)
            read[variant].append(engine.stats()["kv_read_bytes"] - before)
            expected[variant].append(tokens * token_bytes)
    result = {}
    for variant in ("on", "off"):
        times = seconds[variant]
        result[variant] = {
            "tokens_per_s": rows / statistics.median(times),
            "tokens_per_s_range": [round(rows / max(times), 1), round(rows / min(times), 1)],
            "step_ms": [round(t * 1e3, 1) for t in times],
            "kv_read_mib_per_step": statistics.median(read[variant]) / 2**20,
            "kv_read_as_expected": read[variant] == expected[variant],
        }
    return result


def outputs(model: torch.nn.Module, batch: list[list[int]], new: int, max_batch_tokens: int, shared_prefix: bool | int) -> list[list[int]]:
    engine = kvlib.Engine(model, max_batch_tokens=max_batch_tokens, shared_prefix=shared_prefix)
    return engine.generate(batch, max_new_tokens=new)


def markdown(result: dict, argv: Sequence[str] | None) -> str:
    meta = result["meta"]
    lines = [
        "# Shared-prefix attention (Hydragen) in the Engine's decode group, on and off",
        "",
        f"`{command_line('shared_prefix_bench.py', argv)}` ({meta['machine']}, {meta['git']}, load {meta['load_avg_1min']},"
        f" {meta['seconds']} s)",
        "",
        "| rows | shared prompt | K/V MiB read per step off | on | off / on | as expected | decode tok/s off | on | on / off"
        " | outputs equal |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for row in result["cases"]:
        off, on = row["off"], row["on"]
        lines.append(
            f"| {row['rows']} | {row['prompt']} | {off['kv_read_mib_per_step']:.1f} | {on['kv_read_mib_per_step']:.1f}"
            f" | {off['kv_read_mib_per_step'] / on['kv_read_mib_per_step']:.1f}x | {off['kv_read_as_expected'] and on['kv_read_as_expected']}"
            f" | {off['tokens_per_s']:.0f} {off['tokens_per_s_range']} | {on['tokens_per_s']:.0f} {on['tokens_per_s_range']}"
            f" | **{on['tokens_per_s'] / off['tokens_per_s']:.2f}x** | {row['outputs_equal']} |"
        )
    lines += [
        "",
        "K/V read: keys and values the decode group's attention read over its pages, every layer (median per step,"
        " `stats()['kv_read_bytes']`); as expected: every step read each request's stored tokens (off), or the shared"
        " prompt's full pages once per 16 requests plus each request's own tokens (on). Decode tok/s: rows / step seconds, median"
        " [slowest, fastest] of the interleaved steps of each variant.",
    ]
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help=f"default {FULL['model']}")
    parser.add_argument("--rows", help=f"requests sharing the prompt, comma-separated (default {FULL['rows']})")
    parser.add_argument("--prompts", help=f"shared prompt lengths in tokens, comma-separated (default {FULL['prompts']})")
    parser.add_argument("--steps", type=int, help=f"timed decode steps, half of them each variant (default {FULL['steps']})")
    parser.add_argument("--new", type=int, help=f"tokens of the short runs whose outputs are compared (default {FULL['new']})")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per forward pass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the model, pages and kernels run (cuda: the Triton kernels)")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    load_before, started = os.getloadavg()[0], time.perf_counter()
    model = load(args.model).to(args.device)
    vocab = model.config.get_text_config().vocab_size
    cases = []
    for prompt in (int(n) for n in args.prompts.split(",")):
        for rows in (int(n) for n in args.rows.split(",")):
            batch = prompts(vocab, rows, prompt, args.seed)
            shared = prompt // PAGE_SIZE * PAGE_SIZE  # the full pages the later requests attach
            row = {"rows": rows, "prompt": prompt} | interleaved(model, batch, shared, args.steps, args.max_batch_tokens)
            on, off = (outputs(model, batch, args.new, args.max_batch_tokens, flag) for flag in (0, False))
            row["outputs_equal"] = on == off
            cases.append(row)
    result = {"cases": cases, "meta": run_metadata(args, load_before, started)}
    write_report(args.out, "shared_prefix_bench" + ("_quick" if args.quick else ""), markdown(result, argv), result)
    return result


if __name__ == "__main__":
    run()
