"""Prefill/decode hand-over between two Engines through one Redis-protocol server.

An Engine with ``role="prefill"`` runs each prompt but its last token, then hands the request over;
an Engine with ``role="decode"`` on the same server (``remote=``) and queue receives it, attaches
the prompt's pages and decodes: its outputs equal those of one Engine doing both (the decode
side computes the prompt's last token, so every sampled token is drawn there, from the request's
seed).

The protocol, all on the server of the engines' remote tier (:mod:`~kvlib.storage.tiers.remote_tier`):

1. Full pages: the prefill engine's prefix cache writes every full page of ``prompt[:-1]`` as a
   checked block record under ``kvlib:p:`` + namespace digest + chain key, as any engine with a
   remote tier does (tagged with the engines' ``remote_key``).
2. The last partial page (``prompt[full * page_size : -1]``, possibly empty): one *tail record*
   under ``kvlib:p:`` + namespace digest + :func:`tail_key` (the chain key of the last full block
   and the tail's token ids, in a key space of its own), in the block record format with a
   layout of its own (:func:`tail_layout`): per layer, ``keys`` ``[heads, n, head_dim]`` and
   ``values`` ``[heads, n, value_dim]`` in the compute dtype (an open page is never coded).
3. The request: a JSON message (:class:`HandOver`, never pickled) pushed to the queue's list on
   the server (its name derived from the key), sealed by the remote tier like the records (AES-GCM
   or a keyed BLAKE3 tag, under the queue's server name): ``id`` (the prefill side's request id), ``sender`` (a
   random token naming the prefill engine), ``model`` (the model's fingerprint, hex), ``tokens``
   (the whole prompt), ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
   ``eos_token_ids``, ``seed`` (drawn by the prefill side when sampling without one) and
   ``sent_at`` (``time.time()`` when pushed: the message's age is checked, and hand-over timings).

The decode side reads messages without taking them (:meth:`Engine.receive
<kvlib.adapters.engine.engine.Engine.receive>`), opens each (its seal must be this engine's key's),
validates every field before anything is queued (:meth:`HandOver.from_bytes` against
:class:`MessageLimits`: the size before parsing, then types, ranges, token ids within the
vocabulary, prompt plus new tokens within the model's context, the model's fingerprint equal to its
own) and its age, takes it off the queue once per server (a ``(sender, id)`` taken before, by any
decode engine, is refused: :mod:`~kvlib.adapters.engine.handover_roles`), fetches the
full pages (the remote prefix path) and the tail record, verifies both against the message's token
ids (a record that fails is a miss: those tokens are computed instead), and queues the request as
its own. A message that fails any check is counted and skipped, never raised. A lost message is a
lost request (a push the server refuses is counted by the prefill side, never as handed over); a
lost page only costs compute.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, fields

import torch

from kvlib.adapters.engine.sampling import check_sampling
from kvlib.codec import Field
from kvlib.errors import cut
from kvlib.limits import check_seed
from kvlib.storage.prefix.prefix_index import chain_hash
from kvlib.storage.records.prefix_block_record import BlockLayout, FieldBlock, decode_parts, encode

TAIL_SPACE = b"|handover-tail"
"""Appended to the namespace key space for tail records' chain keys (never a full block's)."""
MAX_REQUEST_ID = 2**63
"""Request ids of a message are ints in ``[0, MAX_REQUEST_ID)``."""
MAX_EOS_IDS = 64
"""Most end-of-sequence ids a message may carry."""
SENDER_HEX = 32
"""Hex digits of a sender token (16 random bytes)."""


@dataclass(frozen=True)
class MessageLimits:
    """What a decode engine accepts: messages for its ``model`` (fingerprint, hex), token ids in
    ``[0, vocab)``, at most ``max_tokens`` tokens of prompt plus new tokens (the model's context)."""

    model: str
    vocab: int
    max_tokens: int

    @property
    def max_bytes(self) -> int:
        """Bytes of the longest valid message (every id of ``max_tokens`` tokens and the end
        ids at their widest), checked before a message is parsed."""
        return 1024 + (len(str(self.vocab)) + 2) * (self.max_tokens + MAX_EOS_IDS)


@dataclass
class HandOver:
    """One request handed from a prefill engine to a decode engine (see the module docstring)."""

    id: int
    sender: str
    model: str
    tokens: list[int]
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    eos_token_ids: list[int]
    seed: int | None
    sent_at: float = 0.0

    @classmethod
    def of(cls, request_id: int, tokens: list[int], settings: dict, *, model: str, sender: str) -> HandOver:
        """The message for a request added with ``settings`` (``add_request``'s sampling keywords,
        checked), from the engine ``sender`` serving ``model`` (fingerprint, hex)."""
        eos = settings.get("eos_token_id")
        seed = settings.get("seed")
        if settings.get("do_sample") and seed is None:
            seed = random.getrandbits(63)
        return cls(
            request_id,
            sender,
            model,
            list(tokens),
            settings.get("max_new_tokens", 32),
            bool(settings.get("do_sample", False)),
            float(settings.get("temperature", 1.0)),
            int(settings.get("top_k", 0)),
            float(settings.get("top_p", 1.0)),
            [] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            seed,
        )

    def to_bytes(self) -> bytes:
        """The JSON message (``sent_at`` as set: the prefill side stamps it before publishing the tail)."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, message: bytes | memoryview, limits: MessageLimits) -> HandOver:
        """The message in ``message`` if every field is valid for ``limits``; ``ValueError`` naming
        the first problem otherwise (a message too long is refused before it is parsed)."""
        if len(message) > limits.max_bytes:
            raise ValueError(
                f"a hand-over message of {len(message)} bytes; one of at most {limits.max_tokens} tokens takes {limits.max_bytes}"
            )
        try:
            values = json.loads(bytes(message), parse_constant=_no_constant)
        except (ValueError, RecursionError) as error:  # bad JSON, bad UTF-8, NaN, or nesting past the parser's depth
            raise ValueError(f"not a kvlib hand-over message: {cut(str(error))}") from None
        names = [field.name for field in fields(cls)]
        if not isinstance(values, dict) or sorted(values) != sorted(names):
            got = sorted(values) if isinstance(values, dict) else type(values).__name__
            raise ValueError(f"a hand-over message is a JSON object with the fields {names}; got {cut(str(got))}")
        handover = cls(**values)
        handover._check(limits)
        return handover

    def _check(self, limits: MessageLimits) -> None:
        """``ValueError`` naming the first field of this (parsed) message that ``limits`` refuse."""
        _check_int("id", self.id, 0, MAX_REQUEST_ID)
        if not isinstance(self.sender, str) or len(self.sender) != SENDER_HEX or not _is_hex(self.sender):
            raise ValueError(f"sender must be {SENDER_HEX} hex digits, got {cut(repr(self.sender))}")
        if self.model != limits.model:
            raise ValueError(f"a message for another model (fingerprint {cut(repr(self.model))}); this engine serves {limits.model}")
        _check_int("max_new_tokens", self.max_new_tokens, 1, limits.max_tokens)
        if not isinstance(self.tokens, list) or not 0 < len(self.tokens) <= limits.max_tokens - self.max_new_tokens:
            count = len(self.tokens) if isinstance(self.tokens, list) else type(self.tokens).__name__
            raise ValueError(
                f"tokens must be 1 to {limits.max_tokens} - max_new_tokens ids (the model's context), got {count} with"
                f" max_new_tokens={self.max_new_tokens}"
            )
        _check_ids("tokens", self.tokens, limits.vocab)
        if not isinstance(self.eos_token_ids, list) or len(self.eos_token_ids) > MAX_EOS_IDS:
            raise ValueError(f"eos_token_ids must be a list of at most {MAX_EOS_IDS} ids")
        _check_ids("eos_token_ids", self.eos_token_ids, limits.vocab)
        check_sampling(self.do_sample, self.temperature, self.top_k, self.top_p)
        check_seed(self.seed)
        if isinstance(self.sent_at, bool) or not isinstance(self.sent_at, (int, float)) or not math.isfinite(self.sent_at):
            raise ValueError(f"sent_at must be a finite number of seconds, got {cut(repr(self.sent_at))}")

    def settings(self) -> dict:
        """``add_request`` keywords for this request."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.do_sample,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "eos_token_id": self.eos_token_ids or None,
            "seed": self.seed,
        }


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a hand-over message may carry")


def _is_hex(text: str) -> bool:
    return all(char in "0123456789abcdef" for char in text)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    """``ValueError`` unless ``value`` is an int (not a bool) in ``[low, high)``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"{name} must be an int in [{low}, {high}), got {cut(repr(value))}")


def _check_ids(name: str, ids: list, vocab: int) -> None:
    """``ValueError`` unless every item of ``ids`` is a token id in ``[0, vocab)``."""
    if not all(type(token) is int and 0 <= token < vocab for token in ids):
        raise ValueError(f"{name} must hold token ids in [0, {vocab})")


@dataclass
class Tail:
    """The last partial page of a handed-over prompt: it starts at token ``start``; per layer,
    keys ``[heads, n, head_dim]`` and values ``[heads, n, value_dim]``."""

    start: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0


def tail_layout(namespace: bytes, heads: int, tokens: int, head_dim: int, value_dim: int, dtype: torch.dtype, layers: int) -> BlockLayout:
    """The record layout of a tail of ``tokens`` tokens (its ``page_size`` is the tail's length)."""
    fields = (("keys", Field((tokens, head_dim), dtype)), ("values", Field((tokens, value_dim), dtype)))
    return BlockLayout(namespace, heads, tokens, (fields,) * layers)


def tail_key(parent: bytes, tokens: list[int], key_space: bytes) -> bytes:
    """The chain key of a tail of ``tokens`` after the block keyed ``parent`` (``b""``: none)."""
    return chain_hash(parent, tokens, key_space + TAIL_SPACE)


def tail_record(layout: BlockLayout, key: bytes, parent: bytes, tokens: list[int], tail: Tail) -> bytes | memoryview:
    layers = [{"keys": k, "values": v} for k, v in zip(tail.keys, tail.values)]
    return encode(layout, FieldBlock(key, parent, tokens, layers))


def read_tail(layout: BlockLayout, key: bytes, parent: bytes, tokens: list[int], start: int, record: memoryview) -> Tail:
    """The tail in ``record``; ValueError unless it is the tail keyed ``key`` after ``parent`` holding ``tokens``."""
    block = decode_parts(layout, [record])
    if block.key != key or block.parent != parent or block.tokens != tokens:
        raise ValueError("a tail record of other tokens")
    layers = [block.layers[layer] for layer in range(len(block.layers))]
    return Tail(start, [fields["keys"] for fields in layers], [fields["values"] for fields in layers])
