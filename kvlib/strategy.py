"""Strategy base classes, one per kind, and what the engine hands to strategies.

A strategy is a dataclass with typed, documented fields, registered under a short name with
:func:`kvlib.register`. Its fields are validated on construction (by type annotation, see
:mod:`kvlib.params`); a subclass with range checks of its own defines ``__post_init__`` and calls
``super().__post_init__()`` first.

Kinds and how many of each one spec may hold:

=============  ====  ==========================================================
kind           max   decides
=============  ====  ==========================================================
eviction       1     which stored tokens to drop (wrappers take another inside)
budget         1     how a token budget splits over layers and heads
quantization   1     the codec of sealed pages
lowrank        1     a codec or transform in a lower-rank space
reuse          any   what is shared between sequences and requests
tiering        1     where pages live and when they move
=============  ====  ==========================================================
"""

from __future__ import annotations

import abc
import dataclasses
import typing
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.params import coerce

NEEDS = frozenset({"queries", "window_queries", "attention", "hidden_states"})
"""What an eviction strategy may ask the engine for in ``needs``:

- ``queries``: the current step's queries ``[batch, heads, q_len, head_dim]``;
- ``window_queries``: the last prompt queries (observation window) at prefill;
- ``attention``: attention weights of the current step ``[batch, heads, q_len, kv_len]``;
- ``hidden_states``: the layer's input hidden states.
"""


class Strategy:
    """Base of every strategy. Subclasses are dataclasses; ``name`` is set by ``register``."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value = coerce(self.name or type(self).__name__, field.name, hints[field.name], getattr(self, field.name))
            object.__setattr__(self, field.name, value)

    def spec(self) -> str:
        """This strategy as a spec string, naming only parameters that differ from the defaults."""
        changed = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not field.init:
                continue
            default = field_default(field)
            if default is dataclasses.MISSING or value != default:
                shown = value.spec() if isinstance(value, Strategy) else value
                changed.append(f"{field.name}={shown!r}")
        return f"{self.name}({', '.join(changed)})" if changed else self.name


def field_default(field: dataclasses.Field) -> object:
    """A dataclass field's default value (calling its factory), or ``dataclasses.MISSING``."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


@dataclass
class LayerView:
    """What an eviction strategy sees of one layer of a batch (physical slots, padded).

    keys ``[batch, kv_heads, slots, head_dim]``, values ``[batch, kv_heads, slots, value_dim]``,
    positions int64 ``[batch, kv_heads, slots]`` (original absolute positions, -1 where invalid),
    valid bool ``[batch, kv_heads, slots]``. The optional fields are filled only for strategies
    that declare them in ``needs``.
    """

    layer_idx: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    queries: torch.Tensor | None = None
    window_queries: torch.Tensor | None = None
    attention: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


class Eviction(Strategy, abc.ABC):
    """Decides which stored tokens to drop: scores each stored token, higher means keep.

    The engine keeps each head's top-scored valid tokens within its budget; scores of invalid
    slots are ignored.
    """

    kind = "eviction"
    needs: ClassVar[frozenset[str]] = frozenset()

    @abc.abstractmethod
    def score(self, view: LayerView) -> torch.Tensor:
        """Keep-scores ``[batch, kv_heads, slots]`` (float) for the tokens of ``view``."""


class Budget(Strategy):
    """Splits a token budget over layers and heads."""

    kind = "budget"


class Quantization(Strategy):
    """A codec for sealed pages that stores them in fewer bits."""

    kind = "quantization"


class LowRank(Strategy):
    """A codec or transform that stores pages in a lower-rank space."""

    kind = "lowrank"


class Reuse(Strategy):
    """Decides what is shared between sequences and requests."""

    kind = "reuse"


class Tiering(Strategy):
    """Decides where pages live (device, host, disk) and when they move."""

    kind = "tiering"


KIND_BASES: dict[str, type[Strategy]] = {
    base.kind: base for base in (Eviction, Budget, Quantization, LowRank, Reuse, Tiering)
}
MAX_PER_SPEC: dict[str, int | None] = {
    "eviction": 1,
    "budget": 1,
    "quantization": 1,
    "lowrank": 1,
    "reuse": None,
    "tiering": 1,
}
"""How many strategies of each kind one spec may hold (None: any number)."""
