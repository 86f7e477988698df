"""Prefill/decode hand-over: a prefill Engine in another process publishes each prompt's pages
(its last partial page included) and hands the request over through a real server; a decode
Engine here attaches them and decodes, with the outputs of one Engine doing both."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvlib
from kvlib.adapters.handover import HandOver

from .conftest import build_model

REPO = Path(__file__).resolve().parents[2]
PREFILL = """
import json, sys
sys.path.insert(0, {repo!r})
import kvlib
from tests.adapters.conftest import build_model
from tests.adapters.test_handover import requests
engine = kvlib.Engine(build_model("llama"), max_batch_tokens=64, remote=sys.argv[1], role="prefill", handover_queue="q")
for prompt, settings in requests():
    engine.add_request(prompt, **settings)
while engine.has_unfinished:
    engine.step()
print(json.dumps({{"stats": engine.stats()["remote"], "handed_over": engine.stats()["handed_over"]}}))
"""


def requests() -> list[tuple[list[int], dict]]:
    """Prompts of every tail length class (one token, a page and one, pages and a partial page),
    greedy and sampled with a seed."""
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 90, (40,), generator=generator).tolist()
    out = []
    for i, length in enumerate([1, 17, 33, 45, 70, 52]):
        prompt = (shared + torch.randint(3, 90, (length,), generator=generator).tolist())[:length] if i != 5 else shared + [7] * 12
        settings = {"max_new_tokens": 6}
        if i % 2:
            settings |= {"do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 100 + i}
        out.append((prompt, settings))
    return out


def test_a_decode_engine_continues_what_a_prefill_process_handed_over(redis_server) -> None:
    model = build_model("llama")
    single = kvlib.Engine(model, max_batch_tokens=64)
    ids = [single.add_request(prompt, **settings) for prompt, settings in requests()]
    while single.has_unfinished:
        single.step()
    expected = [single.requests[i].output for i in ids]

    prefill = subprocess.run(
        [sys.executable, "-c", PREFILL.format(repo=str(REPO)), redis_server.url], capture_output=True, text=True, check=True, cwd=REPO
    )
    report = json.loads(prefill.stdout.strip().splitlines()[-1])
    assert report["handed_over"] == len(expected) and report["stats"]["errors"] == 0

    decode = kvlib.Engine(model, max_batch_tokens=64, remote=redis_server.url, role="decode", handover_queue="q")
    received: dict[int, int] = {}
    deadline = time.monotonic() + 30
    while len(received) < len(expected) and time.monotonic() < deadline:
        received |= decode.receive(wait_s=0.1)
    while decode.has_unfinished:
        decode.step()
    assert [decode.requests[received[i]].output for i in range(len(expected))] == expected
    stats = [decode.request_stats(received[i]) for i in range(len(expected))]
    prompts = [prompt for prompt, _ in requests()]
    assert [s["cached_tokens"] for s in stats] == [len(p) - 1 for p in prompts]  # every prompt token but the last came over
    assert all(seconds >= 0 for seconds in decode.handover_s.values())


def test_roles_are_checked() -> None:
    model = build_model("llama")
    with pytest.raises(ValueError, match="role"):
        kvlib.Engine(model, role="both-ways")
    with pytest.raises(ValueError, match="remote"):
        kvlib.Engine(model, role="decode")
    with pytest.raises(ValueError, match="role='decode'"):
        kvlib.Engine(model).receive()
    with pytest.raises(ValueError, match="hand-over"):
        HandOver.from_bytes(b"{not json")
