"""Synthetic retrieval episodes mixed into the default model's training text.

An episode is filler text with facts hidden at random line starts and questions about them at the
end, so that the model learns to find and copy a fact from anywhere in its context (retrieval
heads), which is what makes eviction policies differ on it. Three kinds:

- passkey (half of the episodes): one :func:`kvlib.eval.needle_format.needle_line` with a 4-7 digit key, asked by
  :data:`~kvlib.eval.needle_format.QUESTION`;
- recall (a quarter): 1-6 (at most one per 128 bytes of episode) ``# remember: name = value`` lines, then ``# recall: name = value`` for a random
  subset of them in random order;
- repeat (a quarter): a ``# copy: `` line of 16-64 random letters and digits, repeated verbatim at the end
  (the plainest induction signal: every byte after the first is predictable by copying).

:func:`episode` returns the bytes and a mask of the answer bytes (the trainer adds a loss term
on them).
"""

from __future__ import annotations

import string

import numpy as np

from kvlib.eval.needle_format import QUESTION, needle_line

LETTERS = np.frombuffer(string.ascii_lowercase.encode(), dtype=np.uint8)
ALPHANUMERIC = np.frombuffer((string.ascii_lowercase + string.digits).encode(), dtype=np.uint8)


def random_word(rng: np.random.Generator, alphabet: np.ndarray, low: int, high: int) -> str:
    """A word of ``low..high`` characters drawn from ``alphabet``."""
    return bytes(rng.choice(alphabet, size=int(rng.integers(low, high + 1)))).decode()


def facts_and_questions(rng: np.random.Generator, max_facts: int) -> tuple[list[bytes], bytes, list[tuple[int, int]]]:
    """Needle lines, the question text, and the (start, end) byte spans of answers in it."""
    kind = rng.random()
    if kind < 1 / 4:
        line = f"# copy: {random_word(rng, ALPHANUMERIC, 16, 64)}\n".encode()
        return [line], line, [(len("# copy: "), len(line) - 1)]
    if kind < 3 / 4:
        key = str(int(rng.integers(10 ** (n := int(rng.integers(4, 8))) // 10, 10**n)))
        question = f"{QUESTION}{key}.\n".encode()
        start = len(QUESTION)
        return [needle_line(key).encode()], question, [(start, start + len(key))]
    names = list(dict.fromkeys(random_word(rng, LETTERS, 4, 8) for _ in range(int(rng.integers(1, max_facts + 1)))))
    values = [random_word(rng, ALPHANUMERIC, 3, 6) for _ in names]
    needles = [f"# remember: {n} = {v}\n".encode() for n, v in zip(names, values)]
    asked = rng.permutation(len(names))[: int(rng.integers(1, len(names) + 1))]
    question, spans = b"", []
    for i in asked:
        prefix = f"# recall: {names[i]} = ".encode()
        spans.append((len(question) + len(prefix), len(question) + len(prefix) + len(values[i])))
        question += prefix + f"{values[i]}\n".encode()
    return needles, question, spans


def episode(rng: np.random.Generator, text: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """``length`` bytes: a window of ``text`` with facts inserted, questions at the end.

    Returns ``(tokens uint8[length], answer_mask bool[length])``. The window ends a line (``text``
    must end with a newline); facts go at uniformly random line starts in it; the window is cut
    so the total is exactly ``length``.
    """
    needles, question, spans = facts_and_questions(rng, max_facts=max(1, min(6, length // 128)))
    filler_len = length - len(question) - sum(len(n) for n in needles)
    end = int(rng.integers(filler_len, len(text) - 1))
    end += int(np.argmax(text[end - 1 :] == ord("\n")))  # the filler ends a line
    filler = text[end - filler_len : end]
    line_starts = np.concatenate([[0], np.flatnonzero(filler[:-1] == ord("\n")) + 1])
    cuts = np.sort(line_starts[rng.integers(0, len(line_starts), size=len(needles))])
    pieces, previous = [], 0
    for cut, needle in zip(cuts, needles):
        pieces += [filler[previous:cut], np.frombuffer(needle, dtype=np.uint8)]
        previous = cut
    pieces += [filler[previous:], np.frombuffer(question, dtype=np.uint8)]
    tokens = np.concatenate(pieces)
    mask = np.zeros(length, dtype=bool)
    for begin, end in spans:
        mask[length - len(question) + begin : length - len(question) + end] = True
    return tokens, mask
