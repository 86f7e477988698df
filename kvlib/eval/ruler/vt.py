"""RULER's variable tracking, ``vt`` (``scripts/data/synthetic/variable_tracking.py``).

A chain of ``hops`` assignments, ``VAR A = 12345``, ``VAR B = VAR A``, ..., is hidden line by line,
in order, at random places of the ``noise`` haystack (one line per unit); the question gives the
value and the answers are the ``hops + 1`` variable names it reaches. ``chains`` chains are hidden
(the first is asked). As in RULER, a solved example (a short haystack, at most 500 tokens or a
quarter of the context, with its answer) comes first in the message.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import ClassVar

from kvlib.eval.ruler.haystack import NOISE, insert_at_depths
from kvlib.eval.ruler.task import Prompt, RulerTask

EXAMPLE_TOKENS = 500
"""RULER's size of the solved example, in tokens (capped at a quarter of the context)."""


@dataclass(frozen=True)
class VariableTrackingTask(RulerTask):
    """``chains`` chains of ``hops`` hops in a noise haystack; the first chain's variables are the answers."""

    name: str = "vt"
    tokens_to_generate: int = 30
    asks_apart: ClassVar[bool] = True
    chains: int = 1
    hops: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chains < 1 or self.hops < 1:
            raise ValueError(f"{self.name}: chains and hops must be >= 1, got {self.chains} and {self.hops}")

    def prompt(self, size: int, rng: random.Random, tokenizer) -> Prompt:
        example = self._example(rng, tokenizer)
        task = self._task(size, rng)
        return Prompt(example + "\n" + task.message, task.reply_start, task.answers, task.depths, task.question)

    def _task(self, size: int, rng: random.Random) -> Prompt:
        names: list[str] = []
        while len(names) < self.chains * (self.hops + 1):
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names:
                names.append(name)
        chains = [names[c * (self.hops + 1) : (c + 1) * (self.hops + 1)] for c in range(self.chains)]
        values = [str(rng.randint(10000, 99999)) for _ in chains]
        lines, depths = [], []
        for chain, value in zip(chains, values):
            lines += [f"VAR {chain[0]} = {value}"] + [f"VAR {chain[j + 1]} = VAR {chain[j]}" for j in range(self.hops)]
            depths += sorted(rng.random() for _ in chain)
        text, landed = insert_at_depths([NOISE] * size, lines, depths)
        question = f"Question: Find all variables that are assigned the value {values[0]} in the text above."
        message = (
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n" + "\n".join(text) + "\n" + question
        )
        reply = (
            " Answer: According to the chain(s) of variable assignment in the text above, "
            f"{self.hops + 1} variables are assigned the value {values[0]}, they are: "
        )
        return Prompt(message, reply, tuple(chains[0]), tuple(landed[: self.hops + 1]), question)

    def _example(self, rng: random.Random, tokenizer) -> str:
        """A solved example: the largest haystack within the example's tokens (one line at least)."""
        limit = min(EXAMPLE_TOKENS, self.context // 4)
        state = rng.getstate()
        size, best = 1, None
        while True:
            rng.setstate(state)
            shown = self._task(size, rng)
            text = shown.message + shown.reply_start + " ".join(shown.answers)
            if best is not None and len(tokenizer.encode(text)) > limit:
                break
            best, end = text, rng.getstate()
            size += 1
        rng.setstate(end)
        return best
