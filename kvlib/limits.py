"""Bounds on the sizes users give kvlib, checked before anything is allocated or run.

Each bound is far above what a working configuration uses and low enough that a typo (an extra
zero, a byte count passed as a token count) fails at once with a ``ValueError`` naming the
argument, its value, the bound and why, instead of allocating for minutes and being killed:

- :data:`MAX_PAGE_SIZE`: tokens per page;
- :data:`MAX_BUDGET_TOKENS`: an eviction budget given as a token count;
- :data:`MAX_SPEC_CHARS` and :data:`MAX_SPEC_TERMS`: the size of a spec string;
- :data:`MAX_REQUEST_TOKENS`: prompt plus new tokens of one request to a model whose config
  declares no context (with one, the context is the bound: :func:`check_request_tokens`);
- :data:`MAX_SEED`: random seeds (:func:`check_seed`);
- :data:`MAX_PROFILE_BYTES` and :data:`MAX_TASK_FILE_BYTES`: files kvlib reads whole (head
  profiles, task files), read with :func:`read_bounded`, which refuses anything but a regular
  file and stops at the bound, so a device (``/dev/zero``) or a pipe is a clear error, not a read
  that runs until the process is killed;
- memory: what a store preallocates (its first page arenas, or a fixed page budget) must fit in
  the memory its device has available (:func:`kvlib.devices.check_fits`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvlib.errors import quoted

MAX_PAGE_SIZE = 4096
"""Most tokens per page. Pages amortise per-page costs (a block-table entry, a kernel's page
loop, a codec's scales) and are the unit of eviction, sharing and sealing: 16 to 256 tokens
already amortise the costs, while every head's open page, a store's first arenas (64 pages per
layer) and the read mirror's rounding all grow with the page. At 4096 a prefix is shared, and
a quantized page sealed, only in 4096-token steps."""

MAX_BUDGET_TOKENS = 2**32
"""Most tokens an int eviction budget may keep per (layer, KV head): beyond any model's context
(a larger budget evicts nothing), and small enough that budgets summed over heads and layers,
and positions, stay exact in int64."""

MAX_SPEC_CHARS = 4096
"""Longest spec string parsed (``ast`` builds a tree as deep as the spec has terms)."""

MAX_SPEC_TERMS = 64
"""Most policies in one spec: a spec holds one per kind, and reuse policies beside them."""


def check_page_size(page_size: object) -> int:
    """``page_size`` if it is an int in ``[1, MAX_PAGE_SIZE]``; else ``ValueError`` saying why."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1 (tokens per page), got {quoted(page_size)}")
    if page_size > MAX_PAGE_SIZE:
        raise ValueError(
            f"page_size={page_size} is over the limit of {MAX_PAGE_SIZE} tokens per page: every head's open page and"
            " the first page arenas grow with it, and pages past a few hundred tokens save nothing (typical: 16-256)"
        )
    return page_size


MAX_REQUEST_TOKENS = 2**20
"""Most tokens (prompt plus new tokens) of one request when the model's config declares no
context (``max_position_embeddings``): about a million, beyond the contexts models are trained
for, and small enough that a request's token list and its pages are checked before they take
minutes to build."""

MAX_SEED = 2**63
"""Seeds are ints in ``[0, MAX_SEED)``: what ``torch.Generator.manual_seed`` and numpy take as a signed 64-bit int."""


def check_request_tokens(prompt_tokens: int, new_tokens: int, context: int | None) -> None:
    """``ValueError`` when a request of ``prompt_tokens + new_tokens`` tokens is longer than the
    model's ``context`` (None: the model declares none, so :data:`MAX_REQUEST_TOKENS`)."""
    limit = context if context is not None else MAX_REQUEST_TOKENS
    if prompt_tokens + new_tokens > limit:
        bound = (
            f"the model's context of {limit} tokens (max_position_embeddings)" if context is not None else f"the limit of {limit} tokens"
        )
        raise ValueError(
            f"a request of {prompt_tokens} prompt + {new_tokens} new tokens is longer than {bound}: shorten the prompt or lower max_new_tokens"
        )


def check_seed(seed: object, name: str = "seed") -> None:
    """``ValueError`` unless ``seed`` is None or an int (not a bool) in ``[0, MAX_SEED)``."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED):
        raise ValueError(f"{name} must be None or an int in [0, 2**63), got {quoted(seed)}")


MAX_PROFILE_BYTES = 16 * 2**20
"""Largest head profile read (:mod:`kvlib.policies.budget.head_importance`): a profile holds one
number per (layer, KV head), a few KB for any model."""

MAX_TASK_FILE_BYTES = 2**30
"""Largest task file read (``jsonl:`` tasks, evaluation texts): 1 GiB."""


def read_bounded(path: str | os.PathLike, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at ``path``; ``ValueError`` naming ``what`` and the file when
    it cannot be opened, is not a regular file (a directory, a device such as ``/dev/zero``, a
    pipe: opened without blocking and refused before a byte is read), or holds more than
    ``max_bytes`` (at most ``max_bytes + 1`` bytes are read)."""
    name = quoted(str(Path(path)))
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise ValueError(f"cannot read {what} {name}: {error.strerror or error}") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ValueError(f"{what} {name} is not a regular file")
    with os.fdopen(descriptor, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{what} {name} holds more than {max_bytes} bytes, the most a {what} may hold")
    return data
