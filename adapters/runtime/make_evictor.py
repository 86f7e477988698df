"""The evictors a spec asks for: :func:`make_evictor` (the spec's eviction policy within a
budget, split by its budget policy) and :func:`salience_scorer` (a codec's token scorer that
never evicts), with the budget checked first (:func:`check_budget`). ``make_cache`` and the
Engine both build their evictors here."""

from __future__ import annotations

import numbers

import torch

from kvlib.adapters.runtime.evictor import Evictor
from kvlib.errors import quoted
from kvlib.limits import MAX_BUDGET_TOKENS
from kvlib.model_shape import kv_shape, output_projections, rope_of
from kvlib.policies.budget.uniform import Uniform
from kvlib.spec import Spec


def make_evictor(
    model: torch.nn.Module,
    spec: Spec,
    budget: int | float | None,
    slack: int | None = None,
    interval: int = 1,
    merge: bool = False,
    *,
    page_size: int = 16,
) -> Evictor | None:
    """The evictor applying ``spec``'s eviction (and budget allocation) within ``budget``, or
    None for a spec without eviction; ``ValueError`` for a budget that does not fit the spec.
    ``slack`` None: :func:`default_slack` for pages of ``page_size`` tokens."""
    budget = check_budget(budget, spec)
    if spec.eviction is None:
        return None
    shape = kv_shape(model)
    allocation = spec.budget or spec.eviction.default_budget() or Uniform()
    allocation.check_model(shape.layer_kv_heads)
    projections = output_projections(model, shape) if "output_projection" in spec.eviction.needs else None
    rope = rope_of(model, shape)
    slack = default_slack(spec, budget, page_size) if slack is None else slack
    return Evictor(
        spec.eviction, budget, shape.num_layers, allocation, slack, interval, rope, merge, projections, shape.layer_kv_heads, shape.windows
    )


def default_slack(spec: Spec, budget: int | float | None, page_size: int) -> int:
    """The tokens a head may hold over an int budget before it is compacted back, when none is
    given: ``page_size`` (a compaction a page of decode steps, not one a step), 0 for a policy
    kept as a ring (:meth:`~kvlib.policy.Eviction.ring_start`: it never holds more than its
    cap) and for other budgets (prompt compression holds no cap while decoding)."""
    if not isinstance(budget, int) or spec.eviction is None or spec.eviction.ring_start() is not None:
        return 0
    return page_size


def salience_scorer(model: torch.nn.Module, spec: Spec) -> Evictor | None:
    """For a spec without eviction whose codec reads token salience (``mixed``): an evictor
    that never evicts (no budget) and scores tokens with the codec's own scorer; else None (with
    an eviction policy, the eviction evictor's scores decide salience)."""
    scorer = spec.quantization.salience_scorer() if spec.quantization is not None and spec.eviction is None else None
    if scorer is None:
        return None
    shape = kv_shape(model)
    return Evictor(scorer, None, shape.num_layers, rope=rope_of(model, shape), layer_heads=shape.layer_kv_heads, windows=shape.windows)


def check_budget(budget: object, spec: Spec) -> int | float | None:
    """``budget`` as a Python int (tokens) or float (fraction of the prompt) fit for ``spec``, or
    None when the spec evicts nothing; ``ValueError`` naming the problem otherwise (a budget with
    no eviction policy, none with one, a bad type, out of range)."""
    if spec.eviction is None and spec.budget is not None:
        raise ValueError(f"budget policy {spec.budget.spec()} splits an eviction budget; add an eviction policy")
    budget = _plain_number(budget)
    if spec.eviction is None:
        if budget is not None:
            raise ValueError(f"budget={quoted(budget)} needs an eviction policy in the spec (e.g. 'streaming_llm')")
        return None
    name = spec.eviction.spec()
    if budget is None:
        raise ValueError(
            f"{name} needs a budget: a token count per layer and head (int >= 1) or a fraction of the prompt (float in (0, 1])"
        )
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(
            f"budget must be an int >= 1 or a float in (0, 1] (or a numpy or torch scalar of one), got {quoted(budget)}"
            f" ({type(budget).__name__})"
        )
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"budget as a token count must be >= 1, got {budget}")
    if isinstance(budget, int) and budget > MAX_BUDGET_TOKENS:
        raise ValueError(
            f"budget as a token count must be at most {MAX_BUDGET_TOKENS} (2**32: more than any context, a larger"
            f" budget evicts nothing), got {budget}"
        )
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"budget as a fraction of the prompt must be in (0, 1], got {budget}")
    return budget


def _plain_number(value: object) -> object:
    """``value`` as a Python int or float when it is a numpy integer or real scalar or a
    one-element torch tensor of an integer or floating dtype; anything else (bools included)
    unchanged."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return value
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value
