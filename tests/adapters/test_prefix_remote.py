"""The remote prefix tier against a real server: a second process reuses the prefixes a first one
wrote, with identical output; a record planted without the key, or altered on the server, is never
decoded (the block is recomputed); an Engine whose server is killed in the middle of a 40-request
trace finishes every request with the output of an Engine without a remote tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch

import kvlib
from kvlib.storage.remote_tier import PREFIX, RemoteTier

from .conftest import build_model

REPO = Path(__file__).resolve().parents[2]
PROCESS = """
import json, sys, torch
sys.path.insert(0, {repo!r})
import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model, PAD
model = build_model("llama")
prompt = torch.randint(3, 90, (1, 70), generator=torch.Generator().manual_seed(0))
key = sys.argv[2] or None
store = kvlib.PrefixStore(model, capacity_bytes=2**24, remote=sys.argv[1], remote_key=key)
cache = kvlib.make_cache(model, reuse=store, prompt=prompt)
reused = cache.get_seq_length()
out = model.generate(prompt, **cache_argument(cache), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
same = torch.equal(out, model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=PAD))
print(json.dumps({{"reused": reused, "same": same, "remote": store.remote.stats()}}))
"""


def run(url: str, key: str = "") -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROCESS.format(repo=str(REPO)), url, key], capture_output=True, text=True, check=True, cwd=REPO
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_process_reuses_what_the_first_wrote(redis_server) -> None:
    first = run(redis_server.url)
    assert first["reused"] == 0 and first["same"] and first["remote"]["writes"] == 4
    second = run(redis_server.url)
    assert second["reused"] == 64 and second["same"] and second["remote"]["hits"] == 4 and second["remote"]["writes"] == 0


def test_records_planted_without_the_key_or_altered_are_never_decoded(redis_server) -> None:
    planted = run(redis_server.url, key="intruder")  # writes the prompt's records under another key
    assert planted["remote"]["writes"] == 4
    owner = run(redis_server.url, key="owner")
    assert owner["reused"] == 0 and owner["same"] and owner["remote"]["rejected"] >= 1 and owner["remote"]["hits"] == 0
    again = run(redis_server.url, key="owner")  # the owner's own records replaced the planted ones
    assert again["reused"] == 64 and again["same"]
    client = redis.Redis.from_url(redis_server.url)
    for name in client.keys(PREFIX + b"*"):
        value = bytearray(client.get(name))
        value[len(value) // 2] ^= 0x10  # altered on the server
        client.set(name, bytes(value))
    altered = run(redis_server.url, key="owner")
    assert altered["reused"] == 0 and altered["same"] and altered["remote"]["rejected"] >= 1


def trace(vocab: int, count: int = 40, seed: int = 0) -> list[list[int]]:
    """``count`` prompts over four shared prefixes of 2-3 pages, each with its own tail."""
    generator = torch.Generator().manual_seed(seed)
    shared = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (32, 40, 48, 35)]
    return [shared[i % 4] + torch.randint(3, vocab, (3 + i % 7,), generator=generator).tolist() for i in range(count)]


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_an_engine_finishes_every_request_when_its_server_fails_mid_trace(redis_server, fault: str) -> None:
    model = build_model("llama")
    prompts = trace(model.config.vocab_size)
    expected = kvlib.Engine(model, max_batch_tokens=64).generate(prompts, max_new_tokens=4)
    warm = kvlib.Engine(model, max_batch_tokens=64, remote=RemoteTier(redis_server.url))
    warm.generate(prompts[:4], max_new_tokens=4)  # the shared prefixes on the server
    tier = RemoteTier(redis_server.url, timeout_s=0.2, retry_s=0.5)
    engine = kvlib.Engine(model, max_batch_tokens=64, remote=tier)
    ids, outputs, steps = [], {}, 0
    try:
        while engine.has_unfinished or len(ids) < len(prompts):
            for prompt in prompts[len(ids) : len(ids) + 2]:  # two arrivals a step
                ids.append(engine.add_request(prompt, max_new_tokens=4))
            for request_id, tokens in engine.step().items():
                outputs[request_id] = outputs.get(request_id, []) + tokens
            steps += 1
            if steps == 5:  # the server fails with 10 of the 40 requests in
                getattr(redis_server, fault)()
    finally:
        if fault == "pause":
            redis_server.resume()
    assert [outputs[i] for i in ids] == expected
    stats = engine.stats()["remote"]
    assert stats["hits"] > 0 and stats["errors"] >= 1 and stats["misses"] > 0
