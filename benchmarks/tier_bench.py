"""The disk tier in one run: page record write and read throughput against raw sequential file
I/O of the same bytes, and restoring a cached prefix from disk against recomputing it.

- Throughput: the prefix pages of a ``--prefix-len``-token prompt of the model (one record per
  16-token block: every layer's and KV head's keys and values, a
  :mod:`~kvlib.storage.records.prefix_block_record` record), written with
  ``DiskTier.put_many`` of ``encode`` (record encoding and checksum included, one durable
  lmdb commit for the prompt's records, as the prefix store writes them) and read back with
  ``DiskTier.get`` + ``decode_parts``; against writing the same record bytes to one file with
  ``write`` and ``fsync`` and reading them back. MB/s of record bytes; medians of ``--repeats``.
  Target: >= 50% of raw file I/O. Same durability class: lmdb commits with its default sync
  (fdatasync of the data file, then the meta page written synchronously), the raw file is
  fsynced once.
- Host tier: greedy decode tokens/s after a ``--prefix-len`` prompt with ``lru`` placement
  keeping half of the pages on the device and half on the host, against all pages on the device
  (the exact cache without its read mirror, the same read path) and the default exact cache (with
  its dense mirror), and with the next layer's prefetch off; medians of ``--repeats``,
  interleaved, tokens asserted equal.
- Disk tier for live sequences: greedy decode tokens/s after a ``--prefix-len`` prompt with
  ``lru`` keeping a third of the pages on the device, a third on the host and spilling the rest
  to page records in an lmdb directory (read from their checked records every step), against
  all pages on the device (no mirror, the same read path), and with the prefetch off;
  interleaved, tokens asserted equal.
- Restore: a process's first request whose prefix an earlier process persisted (a fresh
  ``PrefixStore`` over the same lmdb directory): ``make_cache(reuse=..., prompt=...)`` (reading,
  checking and loading the records) + the forward pass over the tail, against a full prefill.

- Quest (always on the embedded default model, whose attention is trained): the model's own
  greedy text from BOS; the first ``QUEST["context"]`` tokens are the prompt, the next ``QUEST["steps"]`` are fed
  one at a time (teacher forcing) to ``quest(top_k=K)`` and to ``random_pages(top_k=K)`` for K at
  1/8, 1/4 and 1/2 of the prompt's pages: greedy agreement and KL(full || sparse) against the full
  cache, and pages read per decode step and layer (all layers averaged, the dense ones included). Placement: ``quest`` at 1/4 of the pages over ``lru`` and over
  ``score_aware`` (knorm) with a device tier of 1/4 of the pages: the share of the pages quest
  reads that were already on the device.

Model: the ~100M random Llama (``--model llama100m``) or the embedded default model (``--model default``).

Usage:

    python benchmarks/tier_bench.py [--model llama100m|default] [--prefix-len 2000] [--tail-len 32]
        [--repeats 3] [--threads N] [--out benchmarks/results]
    python benchmarks/tier_bench.py --quick --out /tmp/x

Writes ``tier_bench.md`` and ``tier_bench.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import kvlib
from kvlib.eval.agreement import agreement_metrics, greedy_reference, teacher_forced_logits
from kvlib.model_shape import kv_shape
from kvlib.storage.records.prefix_block_record import decode_parts, encode
from kvlib.storage.tiers.disk_tier import DiskTier
from kvlib.transformers_compat import cache_argument

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from provenance import add_run_arguments, command_line, load_bench_model, parse_run_arguments, run_metadata, write_report  # noqa: E402
from reuse_bench import first_token  # noqa: E402

FULL = {"model": "llama100m", "prefix_len": 2000, "tail_len": 32, "repeats": 3, "decode_steps": 32}
QUICK = {"model": "default", "prefix_len": 64, "tail_len": 8, "repeats": 1, "decode_steps": 4}
QUEST = {"context": 256, "steps": 128}
QUEST_QUICK = {"context": 64, "steps": 4}
QUEST_FRACTIONS = (1 / 8, 1 / 4, 1 / 2)


def throughput(records: list[tuple[bytes, bytes]], layout, repeats: int, scratch: Path) -> dict:
    total = sum(len(encode(layout, block)) for _, block in records)
    write, read, raw_write, raw_read = [], [], [], []
    for attempt in range(repeats):
        tier = DiskTier(scratch / f"tier{attempt}", capacity_bytes=4 * total)
        start = time.perf_counter()
        tier.put_many([(key, encode(layout, block)) for key, block in records])  # one commit per prompt, as the store writes
        write.append(time.perf_counter() - start)
        start = time.perf_counter()
        for key, _ in records:
            assert tier.get(key, lambda parts: decode_parts(layout, parts)) is not None
        read.append(time.perf_counter() - start)
        tier.close()
        path = scratch / f"raw{attempt}.bin"
        data = [encode(layout, block) for _, block in records]
        start = time.perf_counter()
        with open(path, "wb") as handle:
            for chunk in data:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        raw_write.append(time.perf_counter() - start)
        start = time.perf_counter()
        with open(path, "rb") as handle:
            for chunk in data:
                handle.read(len(chunk))
        raw_read.append(time.perf_counter() - start)
    mb = total / 1e6
    rates = {
        name: mb / statistics.median(times)
        for name, times in (("write", write), ("read", read), ("raw_write", raw_write), ("raw_read", raw_read))
    }
    return {
        "record_bytes": total,
        "records": len(records),
        **{f"{k}_mb_s": v for k, v in rates.items()},
        "write_vs_raw": rates["write"] / rates["raw_write"],
        "read_vs_raw": rates["read"] / rates["raw_read"],
    }


def decode_rate(
    model: torch.nn.Module, spec: str | None, options: dict, prompt: torch.Tensor, steps: int
) -> tuple[float, torch.Tensor, dict]:
    cache = kvlib.make_cache(model, spec, **options)
    tokens = []
    with torch.inference_mode():
        token = model(input_ids=prompt, **cache_argument(cache), use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            token = model(input_ids=token, **cache_argument(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
        seconds = time.perf_counter() - start
    return steps / seconds, torch.cat(tokens, 1), cache.memory_report()["by_tier"]


def kv_mebibytes(model: torch.nn.Module, tokens: int) -> float:
    """MiB of keys and values that ``tokens`` tokens take over all layers of ``model``."""
    shape = kv_shape(model)
    element = next(model.parameters()).element_size()
    return tokens * shape.num_layers * shape.num_kv_heads * (shape.head_dim + shape.value_dim) * element / 2**20


def decode_rates(model: torch.nn.Module, configs: dict, prompt: torch.Tensor, steps: int, repeats: int) -> tuple[dict, dict, dict]:
    """Median decode tok/s, generated tokens and bytes by tier of each ``name: (spec, options)``
    config (a short warm-up first; configs interleaved over ``repeats``)."""
    for spec, options in configs.values():
        decode_rate(model, spec, options, prompt[:, :32], 2)
    rates = {name: [] for name in configs}
    tokens, tiers = {}, {}
    for _ in range(repeats):
        for name, (spec, options) in configs.items():
            rate, tokens[name], tiers[name] = decode_rate(model, spec, options, prompt, steps)
            rates[name].append(rate)
    return {name: statistics.median(r) for name, r in rates.items()}, tokens, tiers


def host_tier(model: torch.nn.Module, prompt: torch.Tensor, steps: int, repeats: int) -> dict:
    half = f"lru(device_mb={kv_mebibytes(model, prompt.shape[1]) / 2:.4f}"
    configs = {
        "device (no mirror)": (None, {"read_cache": False}),
        "half on host": (half + ")", {}),
        "half on host, no prefetch": (half + ", prefetch=False)", {}),
        "device (mirror)": (None, {}),
    }
    medians, tokens, tiers = decode_rates(model, configs, prompt, steps, repeats)
    assert all(torch.equal(tokens[name], tokens["device (mirror)"]) for name in configs)
    return {"spec": half + ")", "tok_s": medians, "by_tier": tiers}


def quest_text(model: torch.nn.Module, context: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full cache's greedy text from BOS: ``(prompt [1, context], fed [1, steps], reference
    logits [1, steps, vocab])``, step ``t``'s logits predicting ``fed[:, t]``."""
    bos = torch.tensor([[model.config.bos_token_id]])
    tokens, logits = greedy_reference(model, kvlib.make_cache(model), bos, context + steps - 1)
    text = torch.cat([bos, tokens], 1)
    return text[:, :context], text[:, context:], logits[:, context - 1 :]


def quest_run(model: torch.nn.Module, spec: str, text: tuple) -> dict:
    """Teacher-forced ``spec`` (a tiered one) over ``text`` (:func:`quest_text`): agreement, KL, and
    pages read and host pages copied per decode step and layer."""
    prompt, fed, reference = text
    counts = []
    for steps in (1, fed.shape[1]):  # the prefill alone, then the whole run: the difference is decoding
        cache = kvlib.make_cache(model, spec)
        logits = teacher_forced_logits(model, cache, prompt, fed[:, :steps])
        counts.append([sum(getattr(pool, name) for pool in cache.store.pools) for name in ("pages_read", "host_pages_read")])
    metrics = agreement_metrics(fed, reference, logits)
    per_step = max(fed.shape[1] - 1, 1) * len(cache.store.pools)
    return {
        "spec": spec,
        "agreement": metrics["agreement"],
        "kl": metrics["kl"],
        "pages_per_step_layer": (counts[1][0] - counts[0][0]) / per_step,
        "host_pages_per_step_layer": (counts[1][1] - counts[0][1]) / per_step,
    }


def quest_quality(model: torch.nn.Module, context: int, steps: int) -> dict:
    """Quest against random pages at several top-K budgets, and the device-hit rate of its reads
    under lru and score_aware placement (see the module docstring)."""
    text = quest_text(model, context, steps)
    shape = kv_shape(model)
    pages = -(-context // 16)
    one_page = "lru(device_mb=1e-9)"  # one device page per layer: reads are counted by the tiered pool
    budgets = []
    for fraction in QUEST_FRACTIONS:
        top_k = max(1, round(fraction * pages))
        budgets.append(
            {
                "fraction": fraction,
                "top_k": top_k,
                **{name: quest_run(model, f"{name}(top_k={top_k}, placement={one_page!r})", text) for name in ("quest", "random_pages")},
            }
        )
    page_bytes = 16 * (shape.head_dim + shape.value_dim) * next(model.parameters()).element_size()
    device_mb = pages / 4 * shape.num_layers * shape.num_kv_heads * page_bytes / 2**20
    top_k = max(1, round(pages / 4))
    placements = {}
    for placement in (f"lru(device_mb={device_mb:.6f})", f"score_aware(device_mb={device_mb:.6f})"):
        result = quest_run(model, f"quest(top_k={top_k}, placement={placement!r})", text)
        result["device_hit_rate"] = 1 - result["host_pages_per_step_layer"] / result["pages_per_step_layer"]
        placements[placement.split("(")[0]] = result
    return {"context": context, "steps": steps, "pages": pages, "layers": shape.num_layers, "budgets": budgets, "placement": placements}


def _quest_markdown(quest: dict) -> list[str]:
    lines = [
        "",
        f"Quest on the default model: prompt {quest['context']} tokens ({quest['pages']} pages per head), {quest['steps']} teacher-forced"
        f" decode steps against the full cache (first 2 of {quest['layers']} layers dense, as in the paper).",
        "",
        "| top-K pages | quest agreement | quest KL | random agreement | random KL | pages read / step / layer (quest) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for b in quest["budgets"]:
        q, r = b["quest"], b["random_pages"]
        lines.append(
            f"| {b['top_k']} ({b['fraction']:.3g}) | {q['agreement']:.3f} | {q['kl']:.4f} | {r['agreement']:.3f} | {r['kl']:.4f}"
            f" | {q['pages_per_step_layer']:.1f} |"
        )
    lines.append("")
    lines.append(
        "Placement under quest (device tier 1/4 of the pages): share of the pages read already on the device: "
        + ", ".join(f"{name} {p['device_hit_rate']:.2f}" for name, p in quest["placement"].items())
        + "."
    )
    return lines


def spill_tier(model: torch.nn.Module, prompt: torch.Tensor, steps: int, repeats: int, directory: Path) -> dict:
    """Decode tokens/s with the pages in thirds over device, host and disk, against all on the device."""
    third = kv_mebibytes(model, prompt.shape[1]) / 3
    spread = f"lru(device_mb={third:.4f}, host_mb={third:.4f}, disk={str(directory)!r}, disk_mb={4 * third + 1:.4f}"
    configs = {
        "device (no mirror)": (None, {"read_cache": False}),
        "device+host+disk": (spread + ")", {}),
        "device+host+disk, no prefetch": (spread + ", prefetch=False)", {}),
    }
    medians, tokens, tiers = decode_rates(model, configs, prompt, steps, repeats)
    assert all(torch.equal(tokens[name], tokens["device (no mirror)"]) for name in configs)
    assert all(tiers["device+host+disk"][tier] > 0 for tier in ("device", "host", "disk"))
    return {
        "spec": spread + ")",
        "tok_s": medians,
        "ratio": medians["device+host+disk"] / medians["device (no mirror)"],
        "prefetch_gain": medians["device+host+disk"] / medians["device+host+disk, no prefetch"],
        "by_tier": tiers["device+host+disk"],
    }


def _spill_markdown(result: dict) -> str:
    s, c = result["spill"], result["config"]
    return (
        f"Disk tier for live sequences, decode tok/s after {c['prefix_len']} tokens (`{s['spec']}`: a third of the pages "
        f"on each tier, spilled pages read from their checked records every step): "
        + ", ".join(f"{name} {rate:.1f}" for name, rate in s["tok_s"].items())
        + f"; device+host+disk / all on device (no mirror) = **{s['ratio']:.2f}x**; prefetch on / off = {s['prefetch_gain']:.2f}x;"
        f" bytes by tier: {s['by_tier']}."
    )


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["llama100m", "default"], help="default llama100m")
    parser.add_argument("--prefix-len", type=int, help=f"prefix tokens (default {FULL['prefix_len']})")
    parser.add_argument("--tail-len", type=int, help=f"tail tokens (default {FULL['tail_len']})")
    parser.add_argument("--repeats", type=int, help=f"timed repeats (default {FULL['repeats']})")
    parser.add_argument("--decode-steps", type=int, help=f"host tier: decode steps timed (default {FULL['decode_steps']})")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    model = load_bench_model(args.model)
    kvlib.attach(model)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.config.vocab_size, (1, args.prefix_len), generator=generator)
    prompts = [
        torch.cat([prefix, torch.randint(0, model.config.vocab_size, (1, args.tail_len), generator=generator)], 1)
        for _ in range(args.repeats + 1)
    ]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        disk = DiskTier(scratch / "prefixes", capacity_bytes=2**33)
        writer = kvlib.PrefixStore(model, capacity_bytes=2**33, disk=disk)
        cache = kvlib.make_cache(model, reuse=writer, prompt=prompts[0])  # computes and persists the prefix
        first_token(model, cache, prompts[0])
        namespace = next(iter(writer.stores))
        layout = writer._record_layout(namespace)
        records = [(key, decode_parts(layout, [disk.raw(key)])) for key in disk.keys()]
        result = {"throughput": throughput(records, layout, args.repeats, scratch)}
        restores, fulls, reused = [], [], 0
        for prompt in prompts[1:]:
            reader = kvlib.PrefixStore(model, capacity_bytes=2**33, disk=disk)  # a new process's empty memory
            start = time.perf_counter()
            restored = kvlib.make_cache(model, reuse=reader, prompt=prompt)
            reused = restored.get_seq_length()
            logits, _ = first_token(model, restored, prompt)
            restores.append(time.perf_counter() - start)
            start = time.perf_counter()
            full_logits, _ = first_token(model, kvlib.make_cache(model), prompt)
            fulls.append(time.perf_counter() - start)
            assert torch.equal(logits.argmax(-1), full_logits.argmax(-1))
            restored.reset()
        result["host"] = host_tier(model, prompts[0][:, : args.prefix_len], args.decode_steps, args.repeats)
        result["quest"] = quest_quality(load_bench_model("default"), **(QUEST_QUICK if args.quick else QUEST))
        result["spill"] = spill_tier(model, prompts[0][:, : args.prefix_len], args.decode_steps, args.repeats, scratch / "spill")
        result["restore"] = {
            "reused_tokens": reused,
            "restore_s": statistics.median(restores),
            "full_s": statistics.median(fulls),
            "speedup": statistics.median(fulls) / statistics.median(restores),
            "disk": disk.stats(),
        }
        disk.close()
    result.update(run_metadata(args, load_before, started))
    write_report(args.out, "tier_bench", _markdown(result, argv), result)
    return result


def _markdown(result: dict, argv: Sequence[str] | None) -> str:
    c, t, r, h = result["config"], result["throughput"], result["restore"], result["host"]
    return "\n".join(
        [
            "# tier_bench: the lmdb disk tier (throughput, restoring a prefix)",
            "",
            f"Command: `{command_line('tier_bench.py', argv)}`",
            "",
            f"Model {c['model']}, prefix {c['prefix_len']} tokens. Machine: {result['machine']}; 1-minute load "
            f"{result['load_avg_1min'][0]} before, {result['load_avg_1min'][1]} after; {result['seconds']} s. Library revision: {result['git']}.",
            "",
            f"{t['records']} page records, {t['record_bytes'] / 1e6:.1f} MB (one per 16-token block, all layers and KV heads).",
            "",
            "| measure | disk tier | raw file I/O | ratio (target >= 50%) |",
            "|---|---:|---:|---:|",
            f"| write (encode + checksum + one lmdb commit; raw: write + fsync) | {t['write_mb_s']:.0f} MB/s | {t['raw_write_mb_s']:.0f} MB/s | {t['write_vs_raw']:.0%} |",
            f"| read (lmdb get + checks + decode; raw: read) | {t['read_mb_s']:.0f} MB/s | {t['raw_read_mb_s']:.0f} MB/s | {t['read_vs_raw']:.0%} |",
            "",
            f"Host tier, decode tok/s after {c['prefix_len']} tokens ({h['spec']}: half of the pages on the host): "
            + ", ".join(f"{name} {rate:.1f}" for name, rate in h["tok_s"].items())
            + f"; half on host / all on device (no mirror) = **{h['tok_s']['half on host'] / h['tok_s']['device (no mirror)']:.2f}x**"
            f" (prefetch on / off {h['tok_s']['half on host'] / h['tok_s']['half on host, no prefetch']:.2f}x); "
            f"bytes by tier with half on host: {h['by_tier']['half on host']}.",
            "",
            _spill_markdown(result),
            "",
            f"Restoring the {r['reused_tokens']}-token prefix from disk in a fresh PrefixStore + the tail's forward pass: "
            f"{r['restore_s'] * 1e3:.1f} ms, against a full prefill {r['full_s'] * 1e3:.1f} ms: **{r['speedup']:.1f}x** (must be > 1).",
            *_quest_markdown(result["quest"]),
        ]
    )


if __name__ == "__main__":
    run()
