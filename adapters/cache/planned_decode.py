"""A cache's decode step planned for every layer: what :func:`~kvlib.adapters.cache.step_planning.plan_decode_step`
gives and the cache's layers read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.adapters.runtime.evictor import PlannedWork
from kvlib.storage.store.step_plan import StepPlan


@dataclass
class PlannedDecode:
    """A cache's decode step planned for every layer (:func:`plan_decode_step`).

    Invariant: ``work`` and ``idle`` hold one entry per layer; ``real_new`` is only set by layer
    0's attention, and only when ``known_real`` is False and some new token is padding."""

    plan: StepPlan
    """The store's plan: pages, slots, block tables and lengths for every layer."""
    known_real: bool
    """Whether planning knew every new token is real (else layer 0's attention reads the mask)."""
    work: tuple[PlannedWork, ...]
    """Per layer, what the evictor does after the step's attention (``NONE``: no evictor)."""
    idle: tuple[bool, ...]
    """Per layer, whether nothing at all follows the step's attention (an ``ACCUMULATE`` layer's
    received attention is added up by its attention's kernel)."""
    real_new: torch.Tensor | None = None
    """The step's real new tokens (bool ``[batch, tokens]``) where not all are, found by layer 0's
    attention when ``known_real`` is False; None: all real."""
