"""Specs: a composition of policies such as ``"snapkv(window=32)+kivi(bits=2)"``.

Every Python entry point accepts a spec string (read by :mod:`kvlib.spec_text`), policy
objects, or a :class:`Spec`. A spec holds at most :data:`~kvlib.limits.MAX_SPEC_TERMS` policies
and at most one of each kind but reuse (:data:`~kvlib.policy.MAX_PER_SPEC`).
"""

from __future__ import annotations

import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from kvlib.errors import SpecError
from kvlib.policy import (
    MAX_PER_SPEC,
    Budget,
    Eviction,
    LowRank,
    Policy,
    Quantization,
    Recompute,
    Reuse,
    Tiering,
)
from kvlib.registry import registered_name
from kvlib.spec_text import check_terms, parse_terms

SpecLike = typing.Union[str, Policy, Sequence[str | Policy], "Spec", None]


@dataclass(frozen=True)
class Spec:
    """A validated composition: at most one policy per kind, any number of reuse policies."""

    eviction: Eviction | None = None
    budget: Budget | None = None
    quantization: Quantization | None = None
    lowrank: LowRank | None = None
    reuse: tuple[Reuse, ...] = ()
    tiering: Tiering | None = None
    recompute: Recompute | None = None

    def policies(self) -> list[Policy]:
        """The policies in canonical kind order."""
        single = (self.eviction, self.budget, self.quantization, self.lowrank)
        last = [policy for policy in (self.tiering, self.recompute) if policy is not None]
        return [s for s in single if s is not None] + list(self.reuse) + last

    def strategies(self) -> list[Policy]:
        """Deprecated name of :meth:`policies` (0.1 said "strategy"; kept for one release)."""
        warnings.warn("Spec.strategies() is deprecated: use Spec.policies()", DeprecationWarning, stacklevel=2)
        return self.policies()

    def __str__(self) -> str:
        return "+".join(s.spec() for s in self.policies()) or "full"


def parse_spec(spec: SpecLike) -> Spec:
    """Build a :class:`Spec` from a spec string, policy objects (or strings), or a Spec.

    ``None``, ``""`` and ``"full"`` mean no policy. Raises :class:`~kvlib.errors.SpecError`
    (a ``ValueError``) for unknown names, unknown or ill-typed parameters, more policies of
    a kind than it admits, and specs over the size limits, listing what is valid.
    """
    if spec is None:
        return Spec()
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, str):
        policies = parse_terms(spec)
    elif isinstance(spec, Policy):
        policies = [spec]
    elif isinstance(spec, Sequence):
        check_terms(len(spec), f"a list of {len(spec)} items")
        policies = []
        for item in spec:
            if isinstance(item, str):
                policies.extend(parse_terms(item))
            elif isinstance(item, Policy):
                policies.append(item)
            else:
                raise SpecError(f"spec items must be policy objects or spec strings, got {type(item).__name__}")
    else:
        raise SpecError(f"a spec is a string, a policy, a list of them, or a Spec; got {type(spec).__name__}")
    return _compose(policies)


def _compose(policies: list[Policy]) -> Spec:
    check_terms(len(policies), f"{len(policies)} policies")
    by_kind: dict[str, list[Policy]] = {kind: [] for kind in MAX_PER_SPEC}
    for policy in policies:
        if not registered_name(type(policy)):
            raise SpecError(f"{type(policy).__name__} is not registered; decorate it with @kvlib.register(name)")
        by_kind[policy.kind].append(policy)
    for kind, found in by_kind.items():
        limit = MAX_PER_SPEC[kind]
        if limit is not None and len(found) > limit:
            names = " and ".join(s.name for s in found)
            raise SpecError(f"a spec admits at most {limit} {kind} policy; got {names}")
    return Spec(
        eviction=_single(by_kind["eviction"]),
        budget=_single(by_kind["budget"]),
        quantization=_single(by_kind["quantization"]),
        lowrank=_single(by_kind["lowrank"]),
        reuse=tuple(by_kind["reuse"]),
        tiering=_single(by_kind["tiering"]),
        recompute=_single(by_kind["recompute"]),
    )


def _single(found: list[Policy]) -> Policy | None:
    return found[0] if found else None
