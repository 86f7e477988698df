"""Prefill/decode hand-over through a real server: a prefill Engine in another process publishes
each prompt's pages (its last partial page included) and hands the request over; a decode Engine
here attaches them and decodes, with the outputs of one Engine doing both.

Faults and attacks (a server per module; each test its own queue): hostile messages between
genuine ones (bad values, wrong types, deep nesting, oversized, replayed, forged by a writer
without the key) are counted and skipped, and every genuine one popped in the call is returned; a
message from an engine serving another model is refused; pages and tails planted with a valid
checksum by a writer without the key are never decoded; a full server's refusal is a lost
hand-over, never a handed-over one; a server evicting records keeps the queued messages; an empty
queue is waited on as long as asked. Each asserts the decode side's outputs equal one Engine's
without any server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch

import kvlib
from kvlib.adapters.engine import handover_roles
from kvlib.adapters.engine.handover import HandOver, MessageLimits
from kvlib.adapters.engine.handover_roles import HandOverKey
from kvlib.errors import RemoteAccessDenied
from kvlib.storage.records.prefix_block_record import DIGEST
from kvlib.storage.records.record_digest import digest
from kvlib.storage.tiers.local_server import LocalServer
from kvlib.storage.tiers.remote_tier import OVERHEAD, PREFIX, RemoteTier
from tests.adapters.conftest import VOCAB, build_model, edit_one_weight

KEY = "handover-test-key-0123456789"
REPO = Path(__file__).resolve().parents[3]
PREFILL = """
import json, sys
sys.path.insert(0, {repo!r})
import kvlib
from kvlib.errors import RemoteAccessDenied
from tests.adapters.conftest import build_model
from tests.adapters.engine.test_handover import KEY, requests
engine = kvlib.Engine(build_model("llama"), max_batch_tokens=64, remote=sys.argv[1], remote_key=KEY, role="prefill", handover_queue="q")
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


def served_alone(model: torch.nn.Module, cases: list[tuple[list[int], dict]]) -> list[list[int]]:
    """Each case's output from one Engine doing both roles, without any server."""
    single = kvlib.Engine(model, max_batch_tokens=64)
    ids = [single.add_request(prompt, **settings) for prompt, settings in cases]
    while single.has_unfinished:
        single.step()
    return [single.requests[i].output for i in ids]


def hand_over(
    model: torch.nn.Module, url: str, queue: str, cases: list[tuple[list[int], dict]], *, tier: RemoteTier | None = None, **options
) -> kvlib.Engine:
    """A prefill Engine here that has handed ``cases`` over on ``queue`` (through ``tier``, or a
    tier of its own on ``url`` with :data:`KEY`)."""
    remote = {"remote": tier} if tier is not None else {"remote": url, "remote_key": KEY}
    prefill = kvlib.Engine(model, max_batch_tokens=64, role="prefill", handover_queue=queue, **remote, **options)
    for prompt, settings in cases:
        prefill.add_request(prompt, **settings)
    while prefill.has_unfinished:
        prefill.step()
    return prefill


def decoded(decode: kvlib.Engine, received: dict[HandOverKey, int], count: int) -> list[list[int]]:
    """The outputs of the ``count`` requests handed over (by the prefill side's ids 0..count-1,
    from one prefill engine)."""
    while decode.has_unfinished:
        decode.step()
    by_id = {key.id: local for key, local in received.items()}
    assert len(by_id) == len(received) == count
    return [decode.requests[by_id[i]].output for i in range(count)]


def decode_engine(model: torch.nn.Module, url: str, queue: str) -> kvlib.Engine:
    return kvlib.Engine(model, max_batch_tokens=64, remote=url, remote_key=KEY, role="decode", handover_queue=queue)


def test_a_decode_engine_continues_what_a_prefill_process_handed_over(redis_server) -> None:
    model = build_model("llama")
    expected = served_alone(model, requests())
    prefill = subprocess.run(
        [sys.executable, "-c", PREFILL.format(repo=str(REPO)), redis_server.url], capture_output=True, text=True, check=True, cwd=REPO
    )
    report = json.loads(prefill.stdout.strip().splitlines()[-1])
    assert report["handed_over"] == len(expected) and report["stats"]["errors"] == 0

    decode = decode_engine(model, redis_server.url, "q")
    received: dict[HandOverKey, int] = {}
    deadline = time.monotonic() + 30
    while len(received) < len(expected) and time.monotonic() < deadline:
        received |= decode.receive(wait_s=0.1)
    assert decoded(decode, received, len(expected)) == expected
    stats = [decode.request_stats(local) for _, local in sorted(received.items())]
    prompts = [prompt for prompt, _ in requests()]
    assert [s["cached_tokens"] for s in stats] == [len(p) - 1 for p in prompts]  # every prompt token but the last came over
    assert all(seconds >= 0 for seconds in decode.handover_s.values())
    assert decode.stats()["remote"]["hits"] == 8  # each of the 5 distinct full pages once, and the 3 tails: all used


def hostile_messages(genuine: dict) -> list[bytes]:
    """Messages a writer holding the key could push (they pass the tag): well-formed JSON with bad
    values, wrong types and missing or extra fields; bad JSON; nesting past the parser's depth
    and far past the size limit; a 10 MB message of 5M tokens."""
    changes = [
        {"temperature": "hot"},
        {"top_p": 2},
        {"seed": 2**80},
        {"seed": "abc"},
        {"max_new_tokens": "5"},
        {"max_new_tokens": 10**12},
        {"id": [1]},
        {"id": -1},
        {"sent_at": None},
        {"tokens": [VOCAB + 5]},
        {"tokens": [True, 4]},
        {"tokens": [5] * 3000},  # past the model's context of 2048
        {"eos_token_ids": ["a"]},
        {"do_sample": 1},
        {"top_k": -1},
        {"sender": "../../etc/passwd"},
        {"model": "00" * 16},  # another model's fingerprint
        {"extra": 1},
    ]
    messages = [json.dumps(genuine | change).encode() for change in changes]
    messages.append(json.dumps({name: value for name, value in genuine.items() if name != "seed"}).encode())
    messages.append(json.dumps(genuine | {"temperature": float("nan")}).encode())  # NaN is not JSON
    messages += [b"{not json", b"\xff\xfe", b"[]", b"null"]
    messages.append(b'{"tokens": ' + b"[" * 3000 + b"]" * 3000 + b"}")  # under the size limit, past the parser's depth
    messages.append(b'{"tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    messages.append(b'{"id": 0, "tokens": [' + b"1," * 5_000_000 + b"1]}")
    return messages


def test_hostile_messages_between_genuine_ones_are_counted_and_skipped(module_redis_server) -> None:
    model, url, queue = build_model("llama"), module_redis_server.url, "hostile"
    cases = requests()[2:5]
    expected = served_alone(model, cases)
    prefill = hand_over(model, url, queue, cases)
    client = redis.Redis.from_url(url)
    tier = RemoteTier(url, key=KEY)
    name = tier.queue_names(queue)[0]  # the key's server name for the queue
    genuine = [client.lpop(name) for _ in cases]
    first = json.loads(bytes(tier.open_message(queue, genuine[0], 1 << 20)))
    hostile = hostile_messages(first)
    for message in hostile[:12]:
        tier.push(queue, message)
    client.rpush(name, genuine[0], genuine[1], genuine[0])  # genuine, genuine, a replay
    for message in hostile[12:]:
        tier.push(queue, message)
    for writer in (RemoteTier(url, trust="any-writer"), RemoteTier(url, key="another-key-0123456789ab")):  # writers without the key
        client.rpush(name, b"".join(writer.seal(name, json.dumps(first | {"id": 2}).encode())))  # written straight into the key's queue
    client.rpush(name, genuine[2])

    decode = decode_engine(model, url, queue)
    received = decode.receive()
    assert sorted(received) == [(prefill.handover_sender, i) for i in range(3)] and prefill.stats()["handed_over"] == 3
    assert decode.stats()["bad_handovers"] == len(hostile) + 3  # the replay, the unkeyed and the other key's
    assert decoded(decode, received, len(cases)) == expected
    assert decode.receive() == {} and client.llen(name) == 0


def test_receive_pops_a_bounded_number_of_messages_per_call(module_redis_server, monkeypatch) -> None:
    model, url, queue = build_model("llama"), module_redis_server.url, "bounded"
    cases = requests()[2:5]
    expected = served_alone(model, cases)
    hand_over(model, url, queue, cases)
    monkeypatch.setattr(handover_roles, "MAX_MESSAGES_PER_RECEIVE", 2)
    decode = decode_engine(model, url, queue)
    first, second = decode.receive(), decode.receive()
    assert (
        len(first) == 2 and len(second) == 1 and sorted(key.id for key in first | second) == [0, 1, 2]
    )  # in the order the prefills finished
    assert decoded(decode, first | second, len(cases)) == expected


def test_a_message_from_an_engine_of_another_model_is_refused(module_redis_server) -> None:
    url, queue = module_redis_server.url, "another-model"
    other = build_model("llama")
    edit_one_weight(other)  # same config, same vocabulary: only its fingerprint tells them apart
    hand_over(other, url, queue, requests()[2:3])
    decode = decode_engine(build_model("llama"), url, queue)
    assert decode.receive() == {} and decode.stats()["bad_handovers"] == 1 and not decode.has_unfinished


def forged(record: bytes) -> bytes:
    """``record`` with the top byte of its last value flipped and its checksum recomputed: it
    passes every check of the record format; only a tag tells it from the original."""
    out = bytearray(record)
    end = len(out) - DIGEST.size
    out[end - 1] ^= 0x40
    DIGEST.pack_into(out, end, digest(bytes(out[:end])))
    return bytes(out)


def test_pages_and_tails_planted_with_a_valid_checksum_are_never_decoded(module_redis_server) -> None:
    model, url, queue = build_model("llama"), module_redis_server.url, "planted"
    cases = requests()[3:5]
    expected = served_alone(model, cases)
    hand_over(model, url, queue, cases, tier=RemoteTier(url, key=KEY, encrypt=False))  # records in clear, tagged: a forger can read them
    client = redis.Redis.from_url(url)
    names = client.keys(PREFIX + b"*")
    for name in names:  # every page and tail the prefill side published, forged by a writer without the key
        for planter in (RemoteTier(url, trust="any-writer"), RemoteTier(url, key="a-forger-key-0123456789ab", encrypt=False)):
            client.set(name, b"".join(planter.seal(name, forged(client.get(name)[OVERHEAD:]))))
    decode = decode_engine(model, url, queue)
    received = decode.receive()
    assert decoded(decode, received, len(cases)) == expected
    remote = decode.stats()["remote"]
    assert remote["hits"] == 0 and remote["rejected"] == 8  # 2 + 4 pages and 2 tails read, none decoded


def test_a_push_a_full_server_refuses_is_a_lost_hand_over() -> None:
    with LocalServer(maxmemory=1 << 20, policy="noeviction") as server:
        client = redis.Redis.from_url(server.url)
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            for i in range(64):
                client.set(b"filler:%d" % i, bytes(64 << 10))
        prefill = hand_over(build_model("llama"), server.url, "full", requests()[2:4])
        assert prefill.stats()["handed_over"] == 0 and prefill.stats()["lost_handovers"] == 2
        assert prefill.stats()["remote"]["write_errors"] >= 2 and client.llen(prefill.prefix.remote.queue_names("full")[0]) == 0


def test_queued_messages_outlive_a_server_evicting_records() -> None:
    model, cases = build_model("llama"), requests()[2:5]
    expected = served_alone(model, cases)
    with LocalServer(maxmemory=4 << 20, policy="volatile-lru") as server:
        hand_over(model, server.url, "busy", cases)
        flood = RemoteTier(server.url, key="other-tenant-key-0123456789")
        for i in range(64):  # 16 MiB of another tenant's records through the 4 MiB budget
            flood.put_many([(i.to_bytes(32, "big"), bytes(256 << 10))])
        decode = decode_engine(model, server.url, "busy")
        received = decode.receive()
        assert decoded(decode, received, len(cases)) == expected and flood.write_errors == 0
    with LocalServer(policy="allkeys-lru") as server, pytest.warns(RuntimeWarning, match="allkeys-lru: when it fills, queued hand-over"):
        decode_engine(model, server.url, "busy")


def test_receive_waits_as_long_as_asked_on_an_empty_queue(module_redis_server) -> None:
    decode = decode_engine(build_model("llama"), module_redis_server.url, "empty")
    started = time.monotonic()
    assert decode.receive(wait_s=1.2) == {}
    assert 1.2 <= time.monotonic() - started < 2.5  # it returned after about 0.3 s before
    for wait_s in (-1, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="wait_s"):
            decode.receive(wait_s=wait_s)


def test_roles_and_messages_are_checked() -> None:
    model = build_model("llama")
    with pytest.raises(ValueError, match="role"):
        kvlib.Engine(model, role="both-ways")
    with pytest.raises(ValueError, match="remote"):
        kvlib.Engine(model, role="decode")
    with pytest.raises(ValueError, match="role='decode'"):
        kvlib.Engine(model).receive()
    limits = MessageLimits("ab" * 16, VOCAB, 2048)
    with pytest.raises(ValueError, match="hand-over"):
        HandOver.from_bytes(b"{not json", limits)
    with pytest.raises(ValueError, match=f"one of at most 2048 tokens takes {limits.max_bytes}"):
        HandOver.from_bytes(b" " * (limits.max_bytes + 1), limits)
    message = HandOver.of(7, [5] * 2047, {"max_new_tokens": 1, "eos_token_id": list(range(64))}, model="ab" * 16, sender="cd" * 16)
    assert len(message.to_bytes()) <= limits.max_bytes  # the longest valid message fits
    assert HandOver.from_bytes(message.to_bytes(), limits) == message


def test_a_captured_message_is_refused_by_every_decode_engine_and_after_restarts(module_redis_server) -> None:
    """Taken ids live on the server: a sealed message captured off the queue and pushed again is
    refused by the engine that took it, by another decode engine, and by one started afresh."""
    model, url, queue = build_model("llama"), module_redis_server.url, "replayed"
    cases = requests()[2:3]
    expected = served_alone(model, cases)
    hand_over(model, url, queue, cases)
    client, name = redis.Redis.from_url(url), RemoteTier(url, key=KEY).queue_names(queue)[0]
    (captured,) = client.lrange(name, 0, -1)
    first = decode_engine(model, url, queue)
    assert decoded(first, first.receive(), 1) == expected
    for decode in (first, decode_engine(model, url, queue), decode_engine(model, url, queue)):  # the taker, another, a restart
        client.rpush(name, captured)
        assert decode.receive() == {} and decode.stats()["bad_handovers"] == 1 and client.llen(name) == 0


def test_a_stale_message_is_refused(module_redis_server) -> None:
    """A genuine message sealed with the key but sent 30 days ago (or from far in the future) is
    refused: replay protection does not rest on the server remembering ids forever."""
    model, url, queue = build_model("llama"), module_redis_server.url, "stale"
    prompt, settings = requests()[2]
    tier = RemoteTier(url, key=KEY)
    decode = decode_engine(model, url, queue)
    limits = decode.handover_role._message_limits()
    for i, sent_at in enumerate((time.time() - 30 * 24 * 3600, time.time() + 3600)):
        message = HandOver.of(i, prompt, settings, model=limits.model, sender="ab" * 16)
        message.sent_at = sent_at
        tier.push(queue, message.to_bytes())
    assert decode.receive() == {} and decode.stats()["bad_handovers"] == 2 and not decode.has_unfinished


def test_equal_request_ids_from_two_prefill_engines_never_collide(module_redis_server) -> None:
    """Two prefill engines number their requests from 0: the decode side keys each request by its
    sender and id, so neither replaces the other and each output is its own prompt's."""
    model, url, queue = build_model("llama"), module_redis_server.url, "two-senders"
    cases_a, cases_b = requests()[2:4], requests()[4:6]
    expected = served_alone(model, cases_a + cases_b)
    a, b = hand_over(model, url, queue, cases_a), hand_over(model, url, queue, cases_b)
    decode = decode_engine(model, url, queue)
    received = decode.receive()
    assert sorted(received) == sorted([(a.handover_sender, 0), (a.handover_sender, 1), (b.handover_sender, 0), (b.handover_sender, 1)])
    while decode.has_unfinished:
        decode.step()
    outputs = [decode.requests[received[(sender, i)]].output for sender in (a.handover_sender, b.handover_sender) for i in range(2)]
    assert outputs == expected


def test_tenants_sharing_a_queue_name_never_take_each_others_hand_overs(module_redis_server) -> None:
    """A decode engine of another tenant (another key) on the same queue name takes nothing of
    this tenant's and loses nothing: the queue's server name comes from the key."""
    model, url, queue = build_model("llama"), module_redis_server.url, "default"
    cases = requests()[2:5]
    expected = served_alone(model, cases)
    prefill = hand_over(model, url, queue, cases)
    other = kvlib.Engine(
        model, max_batch_tokens=64, remote=url, remote_key="other-tenant-key-0123456789", role="decode", handover_queue=queue
    )
    assert other.receive() == {} and other.stats()["bad_handovers"] == 0
    decode = decode_engine(model, url, queue)
    received = decode.receive()
    assert decoded(decode, received, len(cases)) == expected and prefill.stats()["handed_over"] == 3


def test_a_refused_password_raises_before_any_hand_over(redis_server) -> None:
    """A prefill Engine on a server that refuses its password raises when it is built (it used to
    count every push as an outage and lose every request)."""
    redis.Redis.from_url(redis_server.url).config_set("requirepass", "the-server-password-1234")
    wrong = redis_server.url.replace("redis://", "redis://:not-the-password-1234@")
    with pytest.raises(RemoteAccessDenied, match=r"redis://\*\*\*@"):
        kvlib.Engine(build_model("llama"), remote=wrong, remote_key=KEY, role="prefill")


def test_a_decode_engine_holds_a_bounded_amount_over_many_hand_overs(module_redis_server) -> None:
    """Finished requests leave ``requests`` and ``handover_s`` beyond ``max_finished``; taken ids
    are not kept in the engine at all (the server keeps them, pruned by age)."""
    model, url, queue = build_model("llama"), module_redis_server.url, "long-running"
    cases = [([5 + i % 50, 7], {"max_new_tokens": 1}) for i in range(40)]
    hand_over(model, url, queue, cases)
    decode = kvlib.Engine(model, max_batch_tokens=64, remote=url, remote_key=KEY, role="decode", handover_queue=queue, max_finished=4)
    assert len(decode.receive()) == 40
    while decode.has_unfinished:
        decode.step()
    assert len(decode.requests) == 4 and len(decode.handover_s) == 4 and not vars(decode.handover_role).get("taken")
