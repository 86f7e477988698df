"""Specs: a composition of strategies such as ``"snapkv(window=32)+kivi(bits=2)"``.

Every Python entry point accepts a spec string (read by :mod:`kvlib.spec_text`), strategy
objects, or a :class:`Spec`. A spec holds at most :data:`~kvlib.limits.MAX_SPEC_TERMS` strategies
and at most one of each kind but reuse (:data:`~kvlib.strategy.MAX_PER_SPEC`).
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass

from kvlib.errors import SpecError
from kvlib.registry import registered_name
from kvlib.spec_text import check_terms, parse_terms
from kvlib.strategy import (
    MAX_PER_SPEC,
    Budget,
    Eviction,
    LowRank,
    Quantization,
    Reuse,
    Strategy,
    Tiering,
)

SpecLike = typing.Union[str, Strategy, Sequence[str | Strategy], "Spec", None]


@dataclass(frozen=True)
class Spec:
    """A validated composition: at most one strategy per kind, any number of reuse strategies."""

    eviction: Eviction | None = None
    budget: Budget | None = None
    quantization: Quantization | None = None
    lowrank: LowRank | None = None
    reuse: tuple[Reuse, ...] = ()
    tiering: Tiering | None = None

    def strategies(self) -> list[Strategy]:
        """The strategies in canonical kind order."""
        single = (self.eviction, self.budget, self.quantization, self.lowrank)
        return [s for s in single if s is not None] + list(self.reuse) + ([self.tiering] if self.tiering else [])

    def __str__(self) -> str:
        return "+".join(s.spec() for s in self.strategies()) or "full"


def parse_spec(spec: SpecLike) -> Spec:
    """Build a :class:`Spec` from a spec string, strategy objects (or strings), or a Spec.

    ``None``, ``""`` and ``"full"`` mean no strategy. Raises :class:`~kvlib.errors.SpecError`
    (a ``ValueError``) for unknown names, unknown or ill-typed parameters, more strategies of
    a kind than it admits, and specs over the size limits, listing what is valid.
    """
    if spec is None:
        return Spec()
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, str):
        strategies = parse_terms(spec)
    elif isinstance(spec, Strategy):
        strategies = [spec]
    elif isinstance(spec, Sequence):
        check_terms(len(spec), f"a list of {len(spec)} items")
        strategies = []
        for item in spec:
            if isinstance(item, str):
                strategies.extend(parse_terms(item))
            elif isinstance(item, Strategy):
                strategies.append(item)
            else:
                raise SpecError(f"spec items must be strategy objects or spec strings, got {type(item).__name__}")
    else:
        raise SpecError(f"a spec is a string, a strategy, a list of them, or a Spec; got {type(spec).__name__}")
    return _compose(strategies)


def _compose(strategies: list[Strategy]) -> Spec:
    check_terms(len(strategies), f"{len(strategies)} strategies")
    by_kind: dict[str, list[Strategy]] = {kind: [] for kind in MAX_PER_SPEC}
    for strategy in strategies:
        if not registered_name(type(strategy)):
            raise SpecError(f"{type(strategy).__name__} is not registered; decorate it with @kvlib.register(name)")
        by_kind[strategy.kind].append(strategy)
    for kind, found in by_kind.items():
        limit = MAX_PER_SPEC[kind]
        if limit is not None and len(found) > limit:
            names = " and ".join(s.name for s in found)
            raise SpecError(f"a spec admits at most {limit} {kind} strategy; got {names}")
    return Spec(
        eviction=_single(by_kind["eviction"]),
        budget=_single(by_kind["budget"]),
        quantization=_single(by_kind["quantization"]),
        lowrank=_single(by_kind["lowrank"]),
        reuse=tuple(by_kind["reuse"]),
        tiering=_single(by_kind["tiering"]),
    )


def _single(found: list[Strategy]) -> Strategy | None:
    return found[0] if found else None
