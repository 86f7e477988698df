"""What one request to the :class:`~kvlib.adapters.engine.engine.Engine` may ask for, checked before
anything is queued or run: :meth:`Engine.add_request <kvlib.adapters.engine.engine.Engine.add_request>`,
``generate`` and every hand-over message a decode engine takes go through :func:`checked_request`.

Bounds: a prompt of token ids in ``[0, vocab)``, at least one; prompt plus ``max_new_tokens``
within the model's context (:func:`~kvlib.limits.check_request_tokens`; the prompt's length is
checked before its ids are read, so a prompt of millions of tokens costs nothing); sampling
values of the right types and ranges (:func:`~kvlib.adapters.engine.sampling.check_sampling`); a seed in
``[0, 2**63)``; end-of-sequence ids that are token ids. Every failure is a ``ValueError`` naming
the argument and what is valid.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlib.adapters.engine.sampling import check_sampling
from kvlib.errors import quoted
from kvlib.limits import check_request_tokens, check_seed

REQUEST_OPTIONS = {
    "max_new_tokens": 32,
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "eos_token_id": None,
    "spec": None,
    "budget": None,
    "seed": None,
}
"""The keyword arguments of :meth:`Engine.add_request <kvlib.adapters.engine.engine.Engine.add_request>`
and their defaults (``generate`` takes them too)."""


def checked_request(
    prompt: Sequence[int] | torch.Tensor, settings: dict, *, vocab: int, context: int | None
) -> tuple[list[int], frozenset[int]]:
    """The prompt's token ids and the end-of-sequence ids of a request ``add_request(prompt,
    **settings)`` to a model with ``vocab`` token ids and ``context`` positions (None: none
    declared); ``ValueError`` for any bad value (eviction specs and budgets are the engine's to check)."""
    max_new_tokens = settings["max_new_tokens"]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {quoted(max_new_tokens)}")
    if isinstance(prompt, torch.Tensor) and prompt.dim() != 1:
        raise ValueError(f"prompt must be a 1-D sequence of token ids, got a tensor of shape {tuple(prompt.shape)}")
    if not isinstance(prompt, (Sequence, torch.Tensor)) or isinstance(prompt, (str, bytes)):
        raise ValueError(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
    check_request_tokens(len(prompt), max_new_tokens, context)
    ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
    if not ids or not all(type(token) is int and 0 <= token < vocab for token in ids):
        raise ValueError(f"prompt must be a non-empty sequence of token ids in [0, {vocab})")
    check_sampling(settings["do_sample"], settings["temperature"], settings["top_k"], settings["top_p"])
    check_seed(settings["seed"])
    return ids, _eos_ids(settings["eos_token_id"], vocab)


def _eos_ids(eos_token_id: object, vocab: int) -> frozenset[int]:
    """The end-of-sequence ids ``eos_token_id`` names (None: none); ``ValueError`` unless each is a token id."""
    ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if (
        not isinstance(ids, (Sequence, frozenset, set))
        or isinstance(ids, (str, bytes))
        or not all(type(t) is int and 0 <= t < vocab for t in ids)
    ):
        raise ValueError(f"eos_token_id must be None, a token id or token ids in [0, {vocab}), got {quoted(eos_token_id)}")
    return frozenset(ids)
