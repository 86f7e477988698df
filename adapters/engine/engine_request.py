"""One request of the :class:`~kvlib.adapters.engine.engine.Engine`: its tokens, its state and its timings.

Token bookkeeping (invariant after every engine step): ``tokens = prompt + output``; the store
sequence ``seq`` holds the keys and values of ``tokens[:computed]`` (``computed <= len(tokens)``;
a sliding-window layer only the last ``window - 1`` of them, an evicting request what it keeps);
``tokens[computed:]`` are still to run through the model. A decoding request has exactly one
token to run (its last sampled one); a prefilling request more. When the model has run the last
of ``tokens``, the logits of that token give the next output token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvlib.adapters.engine.handover import Tail
from kvlib.adapters.runtime.evictor import Evictor
from kvlib.storage.prefix.prefix_index import Entry


class RequestState(enum.Enum):
    WAITING = "waiting"
    """Not admitted yet, or preempted by recompute (it holds no pages)."""
    RUNNING = "running"
    """Admitted: its sequence holds its computed tokens."""
    SWAPPED = "swapped"
    """Preempted by swapping: its keys and values wait in host memory or on disk."""
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    """A prompt being served.

    Attributes:
        request_id: the id :meth:`Engine.add_request` returned.
        prompt: prompt token ids.
        max_new_tokens: output tokens to produce at most.
        do_sample, temperature, top_k, top_p: how the next token is chosen (greedy by default).
        eos_token_ids: ids that end the request once produced (empty: run to ``max_new_tokens``).
        evictor: this request's eviction (None: every token kept).
        generator: random source for sampling (seeded per request when a seed is given).
        arrival: ``time.perf_counter()`` at :meth:`Engine.add_request`, seconds.
        token_times: when each output token was produced (perf_counter seconds).
        cached_tokens: prompt tokens taken from the prefix cache instead of computed (summed
            over admissions, so a recomputed request counts again).
        entries: prefix index entries this request holds (released when its sequence is).
        block_keys: chain keys of the full blocks of its tokens (prompt and output; extended as
            it grows, never hashed again).
        waited_steps: engine steps spent waiting since arrival or preemption (fairness bound).
    """

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: frozenset[int] = frozenset()
    evictor: Evictor | None = None
    generator: torch.Generator | None = None
    arrival: float = 0.0
    state: RequestState = RequestState.WAITING
    output: list[int] = field(default_factory=list)
    seq: int | None = None
    computed: int = 0
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    preemptions: int = 0
    entries: list[Entry] = field(default_factory=list)
    block_keys: list[bytes] | None = None
    waited_steps: int = 0
    attached_tokens: int = 0
    """Leading tokens of ``seq`` attached from the prefix cache at admission (shared pages; 0
    after a swap-in, whose pages are its own)."""
    indexed_blocks: int = 0
    """Leading prompt blocks attached from or inserted into the prefix index."""
    tail: Tail | None = None
    """A handed-over prompt's last partial page, fetched for admission (decode role; see
    :mod:`~kvlib.adapters.engine.handover`), dropped once attached or preempted."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next output token."""
        return len(self.prompt) + len(self.output) - self.computed

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens or bool(self.output and self.output[-1] in self.eos_token_ids)

    def stats(self) -> dict:
        """Timings (seconds) and counts: ``ttft_s`` (arrival to first token), ``tbt_s`` (gaps
        between consecutive tokens), prompt, cached and output tokens, preemptions, state."""
        times = self.token_times
        return {
            "state": self.state.value,
            "prompt_tokens": len(self.prompt),
            "cached_tokens": self.cached_tokens,
            "output_tokens": len(self.output),
            "preemptions": self.preemptions,
            "ttft_s": times[0] - self.arrival if times else None,
            "tbt_s": [b - a for a, b in zip(times, times[1:])],
        }
