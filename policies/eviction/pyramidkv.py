"""PyramidKV: SnapKV scores with budgets that shrink with depth."""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.policies.budget.pyramid import Pyramid
from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.registry import register


@register("pyramidkv")
@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
    Information Funneling"): attention funnels from broad in the lower layers to a few tokens in
    the upper ones, so lower layers keep more tokens and upper layers fewer, the same in total.

    Tokens are scored as in :class:`SnapKV` (the official code selects with SnapKV's pooled
    window attention); the pyramid is the budget allocation this policy comes with,
    :class:`~kvlib.policies.budget.pyramid.Pyramid`, used when the spec names no budget (a spec
    that names one, e.g. ``pyramidkv+uniform``, overrides it).

    Args:
        window, kernel, pooling: as in :class:`SnapKV`.
        beta: steepness of the pyramid, handed to :class:`Pyramid`: with a mean budget of ``B``
            tokens per head, the last layer keeps ``B / beta`` and the first ``2B - B / beta``,
            linear in between; ``>= 1`` (1: uniform). The paper uses 20. As in the official
            code, the pyramid splits the budget left after the ``window`` tokens every layer keeps.
    """

    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def default_budget(self) -> Pyramid:
        """A :class:`Pyramid` allocation with this ``beta``, the observation window reserved in every layer."""
        return Pyramid(beta=self.beta, reserved=self.window)
