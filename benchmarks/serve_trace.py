"""A seeded serving trace: requests with arrival times (seconds from the trace's start), prompt
token ids and output lengths, mixing three kinds of sessions that share prompt prefixes.

- ``system``: one of ``system_prompts`` shared system prompts, then a unique user part.
- ``chat``: a multi-turn conversation. Turn 1 is a user part; turn n's prompt is turn n-1's
  prompt, then turn n-1's answer, then a new user part. The answers are random tokens fixed in the
  trace (every system replays the same prompts; the benchmark ignores what the model said), each
  exactly as long as that turn's ``max_new_tokens``.
- ``rag``: 1 to ``max_documents_per_request`` distinct documents from a pool of ``documents``
  (in random order), then a question.

Sessions arrive as a Poisson process at ``rate`` sessions per second; each picks its kind by
``weights``. A system or rag session is one request. A chat's first turn arrives with its session;
turn n arrives between 1 and 2 x ``turn_delay_s`` after turn n-1 (a server would wait for turn n-1
to finish; the delay stands for its service time plus the user's thinking). Token ids are uniform
in ``[0, vocab_size)``. Every length (tokens) is drawn from a ``Lengths`` and lies in its bounds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

KINDS = ("system", "chat", "rag")


@dataclass(frozen=True)
class Lengths:
    """A token count drawn uniformly from ``[low, high]`` or from a lognormal with the given
    ``median`` and ``sigma`` (of the log), clipped to ``[low, high]``. Counts are >= 1."""

    low: int
    high: int
    shape: Literal["uniform", "lognormal"] = "uniform"
    median: float | None = None
    sigma: float = 0.5

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"lengths need 1 <= low <= high, got low={self.low}, high={self.high}")
        if self.shape not in ("uniform", "lognormal"):
            raise ValueError(f"unknown length shape {self.shape!r}; choose from uniform, lognormal")
        if self.shape == "lognormal" and (self.median is None or self.median <= 0 or self.sigma <= 0):
            raise ValueError(f"a lognormal length needs median > 0 and sigma > 0, got median={self.median}, sigma={self.sigma}")

    def draw(self, rng: random.Random) -> int:
        if self.shape == "uniform":
            return rng.randint(self.low, self.high)
        return min(self.high, max(self.low, round(rng.lognormvariate(math.log(self.median), self.sigma))))


@dataclass(frozen=True)
class TraceConfig:
    """What a trace holds. ``rate`` in sessions per second, ``turn_delay_s`` in seconds, every
    ``Lengths`` in tokens; ``weights`` maps each of ``KINDS`` to a relative weight (>= 0)."""

    requests: int = 40
    rate: float = 4.0
    weights: dict[str, float] = field(default_factory=lambda: {"system": 0.4, "chat": 0.2, "rag": 0.4})
    system_prompts: int = 4
    system_len: Lengths = Lengths(128, 256)
    user_len: Lengths = Lengths(16, 64, "lognormal", median=32)
    chat_turns: Lengths = Lengths(2, 4)
    turn_delay_s: float = 3.0
    documents: int = 8
    document_len: Lengths = Lengths(64, 160)
    max_documents_per_request: int = 3
    question_len: Lengths = Lengths(8, 32)
    output_len: Lengths = Lengths(16, 48, "lognormal", median=24)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.weights) - set(KINDS))
        if unknown or any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError(f"weights must map some of {', '.join(KINDS)} to non-negative numbers with a positive sum, got {self.weights}")
        if self.requests < 1 or self.rate <= 0 or self.turn_delay_s < 0:
            raise ValueError(f"need requests >= 1, rate > 0 and turn_delay_s >= 0, got {self.requests}, {self.rate}, {self.turn_delay_s}")
        if self.system_prompts < 1 or self.documents < 1 or not 1 <= self.max_documents_per_request <= self.documents:
            raise ValueError("need system_prompts >= 1, documents >= 1 and 1 <= max_documents_per_request <= documents")


@dataclass(frozen=True)
class Request:
    """One request of a trace. ``shared`` names what its prompt starts with: the system prompt's
    index (``system``), the documents' indices in prompt order (``rag``), nothing (``chat``: turn
    n's prompt starts with turn n-1's). ``turn`` counts from 1 within ``session``."""

    arrival_s: float
    prompt_ids: list[int]
    max_new_tokens: int
    kind: str
    session: int
    turn: int = 1
    shared: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    """The requests in arrival order, and the shared pools their prompts draw on."""

    requests: list[Request]
    system_prompts: list[list[int]]
    documents: list[list[int]]


def make_trace(config: TraceConfig, vocab_size: int, seed: int) -> Trace:
    """The trace ``config`` describes; the same ``seed`` gives the same trace."""
    rng = random.Random(seed)

    def tokens(lengths: Lengths) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(lengths.draw(rng))]

    system_prompts = [tokens(config.system_len) for _ in range(config.system_prompts)]
    documents = [tokens(config.document_len) for _ in range(config.documents)]
    kinds = [k for k in KINDS if config.weights.get(k, 0) > 0]
    requests: list[Request] = []
    clock, session = 0.0, 0
    while len(requests) < config.requests:
        clock += rng.expovariate(config.rate)
        kind = rng.choices(kinds, weights=[config.weights[k] for k in kinds])[0]
        left = config.requests - len(requests)
        if kind == "system":
            which = rng.randrange(config.system_prompts)
            requests.append(
                Request(clock, system_prompts[which] + tokens(config.user_len), config.output_len.draw(rng), kind, session, shared=(which,))
            )
        elif kind == "rag":
            picked = tuple(rng.sample(range(config.documents), rng.randint(1, config.max_documents_per_request)))
            prompt = [t for d in picked for t in documents[d]] + tokens(config.question_len)
            requests.append(Request(clock, prompt, config.output_len.draw(rng), kind, session, shared=picked))
        else:
            requests.extend(_chat(config, rng, tokens, clock, session, min(left, config.chat_turns.draw(rng))))
        session += 1
    return Trace(sorted(requests, key=lambda r: r.arrival_s), system_prompts, documents)


def _chat(
    config: TraceConfig, rng: random.Random, tokens: Callable[[Lengths], list[int]], start_s: float, session: int, turns: int
) -> list[Request]:
    """The ``turns`` requests of one conversation, the first arriving at ``start_s``."""
    arrival, prompt, out = start_s, tokens(config.user_len), []
    for turn in range(1, turns + 1):
        new_tokens = config.output_len.draw(rng)
        out.append(Request(arrival, prompt, new_tokens, "chat", session, turn))
        if turn < turns:
            answer = tokens(Lengths(new_tokens, new_tokens))
            prompt = prompt + answer + tokens(config.user_len)
            arrival += config.turn_delay_s * rng.uniform(1.0, 2.0)
    return out
