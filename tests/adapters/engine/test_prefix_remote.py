"""The remote prefix tier against a real server: a second process reuses the prefixes a first one
wrote, with identical output; records planted by a writer with the same public model (altered
values, a recomputed checksum), before or after the owner ran, or altered on the server, are never
decoded by a keyed reader (the block is recomputed, the output unchanged); ``hits`` count only the
records used; a URL without a key is refused unless the caller opts out by name; an Engine whose
server is killed or paused in the middle of a 40-request trace, or full from the start, finishes
every request with the output of an Engine without a remote tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch

import kvlib
from kvlib.storage.tiers.local_server import LocalServer
from kvlib.storage.tiers.remote_tier import ENVELOPE, PREFIX, RemoteTier
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model

from .test_handover import forged

REPO = Path(__file__).resolve().parents[3]
KEY = "prefix-remote-test-key-0123"
OWNER = "the-owner-key-0123456789abc"
PROMPT = torch.randint(3, 90, (1, 70), generator=torch.Generator().manual_seed(0))
PROCESS = """
import json, sys
sys.path.insert(0, {repo!r})
from tests.adapters.conftest import build_model
from tests.adapters.engine.test_prefix_remote import KEY, run
print(json.dumps(run(build_model("llama"), sys.argv[1], key=KEY)))
"""


def run(model: torch.nn.Module, url: str, *, key: str | None = None, trust: str = "key") -> dict:
    """A fresh prefix store on ``url`` serving :data:`PROMPT`: tokens reused from the server, the
    generated tokens and the tier's counters."""
    store = kvlib.PrefixStore(model, capacity_bytes=2**24, remote=url, remote_key=key, remote_trust=trust)
    cache = kvlib.make_cache(model, reuse=store, prompt=PROMPT)
    reused = cache.get_seq_length()
    out = model.generate(PROMPT, **cache_argument(cache), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    return {"reused": reused, "tokens": out[0].tolist(), "remote": store.remote.stats()}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model("llama")


@pytest.fixture(scope="module")
def reference(model: torch.nn.Module) -> list[int]:
    """The prompt's output without any remote tier."""
    return model.generate(PROMPT, max_new_tokens=8, do_sample=False, pad_token_id=PAD)[0].tolist()


def test_a_second_process_reuses_what_the_first_wrote(redis_server, model, reference) -> None:
    first = run(model, redis_server.url, key=KEY)
    assert first["reused"] == 0 and first["tokens"] == reference and first["remote"]["writes"] == 4
    done = subprocess.run(
        [sys.executable, "-c", PROCESS.format(repo=str(REPO)), redis_server.url], capture_output=True, text=True, check=True, cwd=REPO
    )
    second = json.loads(done.stdout.strip().splitlines()[-1])
    assert second["reused"] == 64 and second["tokens"] == reference and second["remote"]["hits"] == 4 and second["remote"]["writes"] == 0


def public_records(url: str) -> dict[bytes, bytes]:
    """The records an unkeyed store wrote (``remote_trust="any-writer"``: in clear, under plain
    names), by chain key and namespace: what anyone running the public model can compute."""
    client = redis.Redis.from_url(url)
    return {name[len(PREFIX) :]: client.get(name)[ENVELOPE.size :] for name in client.keys(PREFIX + b"*") if len(name) == len(PREFIX) + 32}


def plant(url: str, planter: RemoteTier, records: dict[bytes, bytes], *, everywhere: bool = False) -> int:
    """Write forged copies of ``records`` (:func:`forged`: altered, checksum recomputed) sealed by
    ``planter``: under their own names (as ``planter`` names them), and with ``everywhere`` over
    every record name on the server too (an owner's keyed names are visible, if not which prompt
    they hold); returns how many values were written."""
    client, fakes = redis.Redis.from_url(url), [forged(record) for record in records.values()]
    targets = [planter.record_name(key) for key in records]
    if everywhere:
        targets += [name for name in client.keys(PREFIX + b"*") if name not in targets]
    for i, name in enumerate(targets):
        client.set(name, b"".join(planter.seal(name, fakes[i % len(fakes)])))
    return len(targets)


def test_records_planted_by_a_writer_with_the_public_model_are_never_decoded(redis_server, model, reference) -> None:
    url, anyone = redis_server.url, RemoteTier(redis_server.url, trust="any-writer")
    run(model, url, trust="any-writer")  # the planter runs the public model, then forges its records
    records = public_records(url)
    assert plant(url, anyone, records) == 4
    opted_out = run(model, url, trust="any-writer")
    assert opted_out["reused"] == 64 and opted_out["remote"]["hits"] == 4  # what remote_trust="any-writer" lets through
    before = run(model, url, key=OWNER)  # planted before the owner ran: under names the owner never reads
    assert before["reused"] == 0 and before["tokens"] == reference and before["remote"]["hits"] == 0
    assert run(model, url, key=OWNER)["reused"] == 64  # the owner's own records
    for planter in (anyone, RemoteTier(url, key="intruder-key-0123456789ab", encrypt=False)):  # planted over every name after the owner ran
        plant(url, planter, records, everywhere=True)
        after = run(model, url, key=OWNER)
        assert after["reused"] == 0 and after["tokens"] == reference and after["remote"]["rejected"] == 4
    run(model, url, key=OWNER)  # the owner's records written again
    client = redis.Redis.from_url(url)
    owned = [RemoteTier(url, key=OWNER).record_name(key) for key in records]  # the same chain keys, under the owner's names
    assert all(client.exists(name) for name in owned)
    for name in owned:  # altered on the server
        value = bytearray(client.get(name))
        value[len(value) // 2] ^= 0x10
        client.set(name, bytes(value))
    altered = run(model, url, key=OWNER)
    assert altered["reused"] == 0 and altered["tokens"] == reference and altered["remote"]["rejected"] == 4


def test_hits_count_only_the_records_used(redis_server, model, reference) -> None:
    store = kvlib.PrefixStore(model, capacity_bytes=2**24, remote=redis_server.url, remote_key=KEY)
    model.generate(PROMPT, **cache_argument(kvlib.make_cache(model, reuse=store, prompt=PROMPT)), max_new_tokens=8, pad_token_id=PAD)
    (namespace,) = store.stores
    keys = store.block_keys(namespace, [PROMPT[0, i * 16 : (i + 1) * 16].tolist() for i in range(4)])
    redis.Redis.from_url(redis_server.url).delete(
        store.remote.record_name(store.record_namespace(namespace) + keys[1])
    )  # a gap after block 0
    gap = run(model, redis_server.url, key=KEY)
    assert gap["reused"] == 16 and gap["tokens"] == reference
    assert {name: gap["remote"][name] for name in ("hits", "misses", "unused")} == {"hits": 1, "misses": 3, "unused": 2}


def test_a_url_without_a_key_is_refused_before_any_work(redis_server, model, monkeypatch) -> None:
    monkeypatch.delenv("KVLIB_REMOTE_KEY", raising=False)
    untouched = build_model("llama")
    for make in (
        lambda: kvlib.PrefixStore(untouched, 2**20, remote=redis_server.url),
        lambda: kvlib.Engine(untouched, remote=redis_server.url),
    ):
        with pytest.raises(ValueError, match="remote_key=.*KVLIB_REMOTE_KEY.*remote_trust='any-writer'"):
            make()
    assert untouched.config._attn_implementation == "sdpa"  # refused before the model's attention was routed through kvlib
    with pytest.raises(ValueError, match="RemoteTier takes key= and trust= itself"):
        kvlib.PrefixStore(model, 2**20, remote=RemoteTier(redis_server.url, key=KEY), remote_trust="any-writer")
    monkeypatch.setenv("KVLIB_REMOTE_KEY", "from-the-environment-0123456789")
    assert kvlib.Engine(model, remote=redis_server.url).prefix.remote.keyed


def trace(vocab: int, count: int = 40, seed: int = 0) -> list[list[int]]:
    """``count`` prompts over four shared prefixes of 2-3 pages, each with its own tail."""
    generator = torch.Generator().manual_seed(seed)
    shared = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (32, 40, 48, 35)]
    return [shared[i % 4] + torch.randint(3, vocab, (3 + i % 7,), generator=generator).tolist() for i in range(count)]


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_an_engine_finishes_every_request_when_its_server_fails_mid_trace(redis_server, model, fault: str) -> None:
    prompts = trace(model.config.vocab_size)
    expected = kvlib.Engine(model, max_batch_tokens=64).generate(prompts, max_new_tokens=4)
    warm = kvlib.Engine(model, max_batch_tokens=64, remote=RemoteTier(redis_server.url, key=KEY))
    warm.generate(prompts[:4], max_new_tokens=4)  # the shared prefixes on the server
    tier = RemoteTier(redis_server.url, key=KEY, timeout_s=0.2, retry_s=0.5)
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


def test_an_engine_on_a_full_server_gives_the_outputs_of_one_without_it(model) -> None:
    prompts = trace(model.config.vocab_size, count=8)
    expected = kvlib.Engine(model, max_batch_tokens=64).generate(prompts, max_new_tokens=4)
    with LocalServer(maxmemory=1 << 20, policy="noeviction") as server:
        client = redis.Redis.from_url(server.url)
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            for i in range(64):
                client.set(b"filler:%d" % i, bytes(64 << 10))
        engine = kvlib.Engine(model, max_batch_tokens=64, remote=server.url, remote_key=KEY)
        assert engine.generate(prompts, max_new_tokens=4) == expected
        stats = engine.stats()["remote"]
        assert stats["writes"] == 0 and stats["write_errors"] > 0 and stats["hits"] == 0


def test_tenants_with_different_keys_keep_their_own_records(redis_server, model, reference) -> None:
    """Two tenants serving the same model on one server: records are named from the key, so the
    second tenant's writes never replace the first's (its reuse stays whole)."""
    first = run(model, redis_server.url, key=KEY)
    other = run(model, redis_server.url, key=OWNER)
    again = run(model, redis_server.url, key=KEY)
    assert first["reused"] == other["reused"] == 0 and other["remote"]["writes"] == 4
    assert again["reused"] == 64 and again["tokens"] == reference and again["remote"]["rejected"] == 0
