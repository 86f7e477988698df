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
from kvlib.limits import MAX_TASK_FILE_BYTES, read_bounded


@functools.lru_cache(maxsize=8)
def text_ids(tokenizer, path: str | None = None) -> tuple[int, ...]:
    """Token ids of the file at ``path`` (UTF-8, at most :data:`~kvlib.limits.MAX_TASK_FILE_BYTES`),
    or of the default evaluation text; ``ValueError`` naming the file when it cannot be read."""
    text = holdout_text() if path is None else utf8_text(read_bounded(path, MAX_TASK_FILE_BYTES, "text file"), path)
    return tuple(tokenizer.encode(text))


def utf8_text(content: bytes, path: str | Path) -> str:
    """``content`` (the bytes of the file at ``path``) as text; ``ValueError`` naming the file unless it is UTF-8."""
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


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
