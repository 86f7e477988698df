"""The text the tasks read: a user's file, or by default the held-out stdlib modules.

The default text (:func:`kvlib.default_model.corpus.holdout_text`, Python source the default model
never trained on) exists on every machine with Python. Encoded ids are memoised per
(tokenizer, path), since every run of a comparison reads the same text.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from kvlib.default_model.corpus import holdout_text


@functools.lru_cache(maxsize=8)
def text_ids(tokenizer, path: str | None = None) -> tuple[int, ...]:
    """Token ids of the file at ``path`` (UTF-8), or of the default evaluation text."""
    text = holdout_text() if path is None else Path(path).read_text(encoding="utf-8")
    return tuple(tokenizer.encode(text))


def windows(ids: tuple[int, ...], length: int, count: int, seed: int) -> list[list[int]]:
    """``count`` windows of ``length`` ids at seeded, evenly spread offsets (distinct when possible).

    Raises ``ValueError`` when the text is shorter than one window.
    """
    if len(ids) < length:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than the {length} one window needs")
    rng = np.random.default_rng(seed)
    span = len(ids) - length
    starts = [int((i + rng.random()) * span / count) for i in range(count)]
    return [list(ids[s : s + length]) for s in starts]
