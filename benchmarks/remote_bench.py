"""The remote tier on a real Valkey server (127.0.0.1, started here): restore against compute,
record throughput against plain pipelined SET/GET, planted records, a server killed mid-trace, and
the prefill/decode hand-over between two processes.

- ``restore``: another process writes a prompt's pages (a ``--prefix``-token prefix); this one
  serves the prompt with a fresh remote Engine (pages fetched) and with a fresh Engine computing
  the prefix, interleaved: time to first token of each (target: restore >= 3x sooner).
- ``throughput``: the prompt's records written with ``RemoteTier.put_many`` (keyed and unkeyed)
  and read back with ``get_many`` checking and decoding each record, against plain pipelined
  SET/GET of the same bytes from Python, interleaved (target: >= 50%); unkeyed
  (``trust="any-writer"``) against keyed.
- ``planted``: records written with another key, and records altered on the server, are never
  decoded (reused tokens 0, every read rejected or corrupt).
- ``faults``: a 40-request trace (two arrivals a step) whose server is killed after 5 steps and
  restarted after 15: every request finishes with the outputs of an Engine without a remote tier.
- ``handover``: a prefill Engine in another process hands ``--handovers`` requests to a decode
  Engine here: outputs against one Engine doing both, seconds per hand-over (prefill done to
  decode queued with its pages, wall clock of one machine).

    python benchmarks/remote_bench.py [--models llama100m,smollm2] [--prefix 2000] [--quick]

Timings on a shared machine are distorted by other jobs: the report gives each figure's spread
(min, median, max over ``--repeats``) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import redis
import torch

import kvlib
from kvlib.storage.records.prefix_block_record import decode_parts
from kvlib.storage.tiers.local_server import LocalServer
from kvlib.storage.tiers.remote_tier import PREFIX, RemoteTier

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import LLAMA100M, add_run_arguments, command_line, parse_run_arguments, run_metadata, write_report  # noqa: E402

MODELS = ("llama100m", "smollm2", "tiny")
FULL = {"models": "llama100m,smollm2", "prefix": 2000, "repeats": 5, "trace_prefix": 160, "handovers": 8, "handover_prompt": 512}
QUICK = {"models": "tiny", "prefix": 200, "repeats": 2, "trace_prefix": 40, "handovers": 4, "handover_prompt": 60}
TAIL = 7
"""Prompt tokens after the restored prefix (computed in both arms)."""
KEY = "remote-bench-key-0123456789"
"""The tier key of the benchmark's engines (a passphrase of at least 20 characters)."""
OWNER, INTRUDER = "the-owner-key-0123456789ab", "an-intruder-key-0123456789"
"""The key the benchmark's genuine engines share (a remote tier needs one: kvlib.storage.tiers.remote_tier)."""


def build_model(name: str) -> torch.nn.Module:
    """``llama100m`` (seeded random ~100M Llama, fp32), ``smollm2`` (SmolLM2-135M-Instruct) or ``tiny``."""
    if name == "smollm2":
        from kvlib.eval import load_model

        return load_model("smollm2").model.eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = LLAMA100M if name == "llama100m" else {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    sizes = {"num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512} | sizes
    model = LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=True))
    model.set_attn_implementation("sdpa")
    return model.eval()


def prompt_of(model: torch.nn.Module, length: int, seed: int) -> list[int]:
    return torch.randint(3, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def first_token_s(engine: kvlib.Engine, prompt: list[int]) -> tuple[float, dict]:
    """Seconds from ``add_request`` (the remote fetch included) to the first token, and the request's stats."""
    started = time.perf_counter()
    request_id = engine.add_request(prompt, max_new_tokens=1)
    while engine.has_unfinished:
        engine.step()
    return time.perf_counter() - started, engine.request_stats(request_id)


def child(argv: list[str]) -> None:
    """Run in another process: ``write MODEL URL LENGTH KEY`` serves the restore prompt with a
    remote Engine (its pages go to the server); ``prefill MODEL URL COUNT LENGTH`` hands requests over."""
    mode, name, url, count = argv[0], argv[1], argv[2], int(argv[3])
    model = build_model(name)
    if mode == "write":
        engine = kvlib.Engine(model, max_batch_tokens=4096, remote=url, remote_key=argv[4])
        first_token_s(engine, prompt_of(model, count, 1) + prompt_of(model, TAIL, 2))
        print(json.dumps(engine.stats()["remote"]))
        return
    engine = kvlib.Engine(model, max_batch_tokens=4096, remote=url, remote_key=KEY, role="prefill", handover_queue="bench")
    for prompt, settings in handover_requests(model, count, int(argv[4])):
        engine.add_request(prompt, **settings)
    while engine.has_unfinished:
        engine.step()
    print(json.dumps({"handed_over": engine.stats().get("handed_over", 0)}))


def spawn(*argv: object) -> dict:
    done = subprocess.run([sys.executable, __file__, "child", *map(str, argv)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def bench_restore(model: torch.nn.Module, name: str, server: LocalServer, args: argparse.Namespace) -> dict:
    writer = spawn("write", name, server.url, args.prefix, KEY)
    prompt = prompt_of(model, args.prefix, 1) + prompt_of(model, TAIL, 2)
    first_token_s(kvlib.Engine(model, max_batch_tokens=4096), prompt[:64])  # warm-up
    compute, restore, cached = [], [], []
    for _ in range(args.repeats):
        seconds, _ = first_token_s(kvlib.Engine(model, max_batch_tokens=4096), prompt)
        compute.append(seconds)
        engine = kvlib.Engine(model, max_batch_tokens=4096, remote=server.url, remote_key=KEY)
        seconds, stats = first_token_s(engine, prompt)
        restore.append(seconds)
        cached.append(stats["cached_tokens"])
    speedups = [c / r for c, r in zip(compute, restore)]
    return {
        "prompt_tokens": len(prompt),
        "writer": writer,
        "cached_tokens": cached,
        "compute_ttft_s": spread(compute),
        "restore_ttft_s": spread(restore),
        "speedup": spread(speedups),
    }


def bench_throughput(model: torch.nn.Module, server: LocalServer, args: argparse.Namespace) -> dict:
    client = redis.Redis.from_url(server.url)
    reader = RemoteTier(server.url, key=KEY)  # the records the restore run wrote, sealed: opened with the key
    names = [name for name in sorted(client.keys(PREFIX + b"*")) if reader.open(name, client.get(name)) is not None]
    values = [client.get(name) for name in names]
    keys = [name[len(PREFIX) :] for name in names]
    engine = kvlib.Engine(model, remote=server.url, remote_key=KEY)
    layout = engine.prefix._record_layout(engine.kv.namespace)
    records = [reader.open(name, value) for name, value in zip(names, values)]
    total = sum(len(record) for record in records)
    arms: dict[str, list[float]] = {arm: [] for arm in ("raw_set", "raw_get", "put", "get", "keyed_put", "keyed_get")}
    for _ in range(args.repeats):
        pipe = client.pipeline(transaction=False)
        started = time.perf_counter()
        for i, value in enumerate(values):
            pipe.set(b"raw:%d" % i, value)
        pipe.execute()
        arms["raw_set"].append(time.perf_counter() - started)
        started = time.perf_counter()
        for i in range(len(values)):
            pipe.get(b"raw:%d" % i)
        assert sum(map(len, pipe.execute())) == sum(map(len, values))
        arms["raw_get"].append(time.perf_counter() - started)
        for arm, tier in (("", RemoteTier(server.url, trust="any-writer")), ("keyed_", RemoteTier(server.url, key=KEY))):
            started = time.perf_counter()
            assert tier.put_many([(b"b" + arm.encode() + key, record) for key, record in zip(keys, records)]) == len(keys)
            arms[arm + "put"].append(time.perf_counter() - started)
            started = time.perf_counter()
            got = tier.get_many([b"b" + arm.encode() + key for key in keys], lambda record: decode_parts(layout, [record]))
            arms[arm + "get"].append(time.perf_counter() - started)
            assert all(block is not None for block in got)
    mb_s = {arm: [total / 1e6 / s for s in seconds] for arm, seconds in arms.items()}
    ratio = {}
    for arm, base in (("put", "raw_set"), ("get", "raw_get"), ("keyed_put", "raw_set"), ("keyed_get", "raw_get")):
        ratio[arm] = spread([a / b for a, b in zip(mb_s[arm], mb_s[base])])
    return {
        "records": len(records),
        "record_bytes": total // max(len(records), 1),
        "mb_s": {a: spread(v) for a, v in mb_s.items()},
        "vs_raw": ratio,
    }


def bench_planted(model: torch.nn.Module, args: argparse.Namespace) -> dict:
    with LocalServer() as server:
        spawn("write", args.current, server.url, args.trace_prefix, INTRUDER)
        prompt = prompt_of(model, args.trace_prefix, 1) + prompt_of(model, TAIL, 2)
        owner = kvlib.Engine(model, remote=server.url, remote_key=OWNER)
        _, planted = first_token_s(owner, prompt)
        planted_stats = owner.stats()["remote"]
        client = redis.Redis.from_url(server.url)
        for name in client.keys(PREFIX + b"*"):  # the owner's own records now: alter each
            value = bytearray(client.get(name))
            value[len(value) // 2] ^= 0x10
            client.set(name, bytes(value))
        again = kvlib.Engine(model, remote=server.url, remote_key=OWNER)
        _, altered = first_token_s(again, prompt)
        return {
            "planted": {"reused_tokens": planted["cached_tokens"], **planted_stats},
            "altered": {"reused_tokens": altered["cached_tokens"], **again.stats()["remote"]},
        }


def trace(model: torch.nn.Module, prefix: int, count: int = 40) -> list[list[int]]:
    shared = [prompt_of(model, prefix + 8 * i, 10 + i) for i in range(4)]
    return [shared[i % 4] + prompt_of(model, 3 + i % 7, 100 + i) for i in range(count)]


def bench_faults(model: torch.nn.Module, args: argparse.Namespace) -> dict:
    prompts = trace(model, args.trace_prefix)
    expected = kvlib.Engine(model, max_batch_tokens=512).generate(prompts, max_new_tokens=4)
    with LocalServer() as server:
        kvlib.Engine(model, max_batch_tokens=512, remote=server.url, remote_key=KEY).generate(prompts[:4], max_new_tokens=4)
        engine = kvlib.Engine(model, max_batch_tokens=512, remote=RemoteTier(server.url, key=KEY, timeout_s=0.2, retry_s=0.5))
        ids, outputs, steps, started = [], {}, 0, time.perf_counter()
        while engine.has_unfinished or len(ids) < len(prompts):
            ids += [engine.add_request(prompt, max_new_tokens=4) for prompt in prompts[len(ids) : len(ids) + 2]]
            for request_id, tokens in engine.step().items():
                outputs[request_id] = outputs.get(request_id, []) + tokens
            steps += 1
            if steps == 5:
                server.kill()
            if steps == 15:
                server.start()
        finished = sum(engine.requests[i].state.value == "finished" for i in ids)
        return {
            "requests": len(prompts),
            "finished": finished,
            "outputs_equal": [outputs.get(i, []) for i in ids] == expected,
            "seconds": time.perf_counter() - started,
            "remote": engine.stats()["remote"],
        }


def handover_requests(model: torch.nn.Module, count: int, length: int) -> list[tuple[list[int], dict]]:
    out = []
    for i in range(count):
        settings = {"max_new_tokens": 8} | ({"do_sample": True, "temperature": 0.8, "top_k": 40, "seed": i} if i % 2 else {})
        out.append((prompt_of(model, length + 5 * i, 500 + i), settings))
    return out


def bench_handover(model: torch.nn.Module, args: argparse.Namespace) -> dict:
    requests = handover_requests(model, args.handovers, args.handover_prompt)
    single = kvlib.Engine(model, max_batch_tokens=4096)
    ids = [single.add_request(prompt, **settings) for prompt, settings in requests]
    while single.has_unfinished:
        single.step()
    with LocalServer() as server:
        decode = kvlib.Engine(model, max_batch_tokens=4096, remote=server.url, remote_key=KEY, role="decode", handover_queue="bench")
        prefill = subprocess.Popen(
            [sys.executable, __file__, "child", "prefill", args.current, server.url, str(len(requests)), str(args.handover_prompt)],
            stdout=subprocess.PIPE,
            text=True,
        )
        received = {}
        deadline = time.monotonic() + 600
        while len(received) < len(requests) and time.monotonic() < deadline:
            received |= decode.receive(wait_s=0.1)
            if decode.has_unfinished:
                decode.step()
        while decode.has_unfinished:
            decode.step()
        prefill.communicate(timeout=60)
    received = {key.id: local for key, local in received.items()}  # one prefill process: its ids are unique
    outputs = [decode.requests[received[i]].output if i in received else None for i in range(len(requests))]
    seconds = [decode.handover_s[received[i]] for i in range(len(requests)) if i in received]
    return {
        "requests": len(requests),
        "received": len(received),
        "outputs_equal": outputs == [single.requests[i].output for i in ids],
        "cached_tokens": [decode.request_stats(received[i])["cached_tokens"] for i in range(len(requests)) if i in received],
        "handover_s": spread(seconds) if seconds else None,
    }


def run(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help=f"comma-separated, from {','.join(MODELS)} (default {FULL['models']})")
    parser.add_argument("--prefix", type=int, help=f"restored prefix tokens (default {FULL['prefix']})")
    parser.add_argument("--repeats", type=int, help=f"interleaved rounds (default {FULL['repeats']})")
    parser.add_argument("--trace-prefix", type=int, help=f"shared prefix tokens of the fault trace (default {FULL['trace_prefix']})")
    parser.add_argument("--handovers", type=int, help=f"requests handed over (default {FULL['handovers']})")
    parser.add_argument("--handover-prompt", type=int, help=f"prompt tokens of a handed-over request (default {FULL['handover_prompt']})")
    add_run_arguments(parser, QUICK)
    args = parse_run_arguments(parser, argv, QUICK, FULL)
    load_before, started = os.getloadavg()[0], time.perf_counter()
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    rows = []
    for name in models:
        args.current = name
        model = build_model(name)
        row = {"model": name, "load_before": round(os.getloadavg()[0], 2)}
        with LocalServer() as server:
            row["restore"] = bench_restore(model, name, server, args)
            row["throughput"] = bench_throughput(model, server, args)
        row["planted"] = bench_planted(model, args)
        row["faults"] = bench_faults(model, args)
        row["handover"] = bench_handover(model, args)
        row["load_after"] = round(os.getloadavg()[0], 2)
        rows.append(row)
        del model
    del args.current
    result = {**run_metadata(args, load_before, started), "command": command_line("remote_bench.py", argv), "rows": rows}
    write_report(args.out, "remote_bench", _markdown(result), result)
    return result


def _markdown(result: dict) -> str:
    lines = [
        "# Remote tier (Valkey on 127.0.0.1)",
        "",
        f"`{result['command']}` on {result['machine']}, git {result['git']}. Spreads are min / median / max over the",
        "interleaved rounds; the machine is shared, so timings move with its load (given per model).",
        "",
    ]

    def fmt(s: dict, unit: str = "") -> str:
        return f"{s['min']:.3g} / {s['median']:.3g} / {s['max']:.3g}{unit}"

    for row in result["rows"]:
        r, t, p, f, h = row["restore"], row["throughput"], row["planted"], row["faults"], row["handover"]
        lines += [
            f"## {row['model']} (load {row['load_before']} -> {row['load_after']})",
            "",
            f"- restore of a {r['prompt_tokens'] - TAIL}-token prefix written by another process: first token "
            f"{fmt(r['restore_ttft_s'], ' s')} against {fmt(r['compute_ttft_s'], ' s')} computing: **{fmt(r['speedup'], 'x')} sooner** "
            f"(target >= 3x; cached tokens {r['cached_tokens'][0]})",
            f"- {t['records']} records of {t['record_bytes']} bytes, MB/s: raw SET {fmt(t['mb_s']['raw_set'])}, put {fmt(t['mb_s']['put'])}, "
            f"keyed put {fmt(t['mb_s']['keyed_put'])}; raw GET {fmt(t['mb_s']['raw_get'])}, get+decode {fmt(t['mb_s']['get'])}, "
            f"keyed get+decode {fmt(t['mb_s']['keyed_get'])}",
            f"- against raw (target >= 0.5): put {fmt(t['vs_raw']['put'])}, get {fmt(t['vs_raw']['get'])}, "
            f"keyed put {fmt(t['vs_raw']['keyed_put'])}, keyed get {fmt(t['vs_raw']['keyed_get'])}",
            f"- planted (another key): reused {p['planted']['reused_tokens']} tokens, rejected {p['planted']['rejected']}, hits {p['planted']['hits']}; "
            f"altered on the server: reused {p['altered']['reused_tokens']}, rejected {p['altered']['rejected']}, hits {p['altered']['hits']}",
            f"- server killed after 5 steps of a {f['requests']}-request trace, restarted after 15: {f['finished']} finished, "
            f"outputs equal to no remote tier: {f['outputs_equal']}; counters {f['remote']}",
            f"- hand-over of {h['received']}/{h['requests']} requests from a prefill process: outputs equal to one Engine: {h['outputs_equal']}; "
            f"seconds per hand-over {fmt(h['handover_s']) if h['handover_s'] else 'n/a'}; cached tokens {h['cached_tokens']}",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2:])
    else:
        run()
