"""Prefill/decode hand-over between two Engines through one Redis-protocol server.

An Engine with ``role="prefill"`` runs each prompt but its last token, then hands the request over;
an Engine with ``role="decode"`` on the same server (``remote=``) and queue receives it, attaches
the prompt's pages and decodes: its outputs equal those of one Engine doing both (the decode
side computes the prompt's last token, so every sampled token is drawn there, from the request's
seed).

The protocol, all on the server of the engines' remote tier (:mod:`~kvlib.storage.remote_tier`):

1. Full pages: the prefill engine's prefix cache writes every full page of ``prompt[:-1]`` as a
   checked block record under ``kvlib:p:`` + namespace digest + chain key, as any engine with a
   remote tier does (keyed with ``remote_key`` when set).
2. The last partial page (``prompt[full * page_size : -1]``, possibly empty): one *tail record*
   under ``kvlib:p:`` + namespace digest + :func:`tail_key` (the chain key of the last full block
   and the tail's token ids, in a key space of its own), in the block record format with a
   layout of its own (:func:`tail_layout`): per layer, ``keys`` ``[heads, n, head_dim]`` and
   ``values`` ``[heads, n, value_dim]`` in the compute dtype (an open page is never coded).
3. The request: a JSON message (:class:`HandOver`, never pickled) pushed to the list
   ``kvlib:q:`` + queue name: ``id`` (the prefill side's request id, echoed for tracing),
   ``tokens`` (the whole prompt), ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``,
   ``top_p``, ``eos_token_ids``, ``seed`` (drawn by the prefill side when sampling without one)
   and ``sent_at`` (``time.time()`` when pushed, for hand-over timings).

The decode side pops messages (:meth:`Engine.receive <kvlib.adapters.engine.Engine.receive>`),
fetches the full pages (the remote prefix path) and the tail record, verifies both against the
message's token ids (a record that fails is a miss: those tokens are computed instead), and
queues the request as its own. A lost message is a lost request; a lost page only costs compute.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

import torch

from kvlib.codec import Field
from kvlib.prefix_index import chain_hash
from kvlib.storage.block_record import BlockLayout, FieldBlock, decode_parts, encode

TAIL_SPACE = b"|handover-tail"
"""Appended to the namespace key space for tail records' chain keys (never a full block's)."""


@dataclass
class HandOver:
    """One request handed from a prefill engine to a decode engine (see the module docstring)."""

    id: int
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
    def of(cls, request_id: int, tokens: list[int], settings: dict) -> HandOver:
        """The message for a request added with ``settings`` (``add_request``'s sampling keywords)."""
        eos = settings.get("eos_token_id")
        seed = settings.get("seed")
        if settings.get("do_sample") and seed is None:
            seed = random.getrandbits(63)
        return cls(
            request_id,
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
    def from_bytes(cls, message: bytes) -> HandOver:
        """The message in ``message``; ValueError when it is not one."""
        try:
            fields = json.loads(message)
            handover = cls(**fields)
        except (TypeError, json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"not a kvlib hand-over message: {error}") from None
        if not handover.tokens or not all(isinstance(t, int) for t in handover.tokens):
            raise ValueError("a hand-over message needs token ids")
        return handover

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
