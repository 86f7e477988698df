"""Spec strings: a composition of strategies such as ``"snapkv(window=32)+kivi(bits=2)"``.

Grammar: terms joined by ``+``; a term is a strategy name, optionally called with keyword
arguments whose values are Python literals (numbers, strings, booleans, None, tuples). The
string is parsed with :mod:`ast` and values with ``ast.literal_eval``: nothing is executed.
Every Python entry point accepts a spec string, strategy objects, or a :class:`Spec`. A spec
string has at most :data:`~kvlib.limits.MAX_SPEC_CHARS` characters (checked before parsing) and
a spec at most :data:`~kvlib.limits.MAX_SPEC_TERMS` strategies (checked before any is built);
error messages quote the spec and its names cut to :data:`~kvlib.errors.ECHO_CHARS` characters.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass

from kvlib.errors import SpecError, cut, quoted
from kvlib.limits import MAX_SPEC_CHARS, MAX_SPEC_TERMS
from kvlib.params import describe
from kvlib.registry import get_policy, registered_name
from kvlib.strategy import (
    MAX_PER_SPEC,
    Budget,
    Eviction,
    LowRank,
    Quantization,
    Reuse,
    Strategy,
    Tiering,
    field_default,
)

SpecLike = typing.Union[str, Strategy, Sequence[typing.Union[str, Strategy]], "Spec", None]


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
        strategies = _parse_string(spec)
    elif isinstance(spec, Strategy):
        strategies = [spec]
    elif isinstance(spec, Sequence):
        _check_terms(len(spec), f"a list of {len(spec)} items")
        strategies = []
        for item in spec:
            if isinstance(item, str):
                strategies.extend(_parse_string(item))
            elif isinstance(item, Strategy):
                strategies.append(item)
            else:
                raise SpecError(f"spec items must be strategy objects or spec strings, got {type(item).__name__}")
    else:
        raise SpecError(f"a spec is a string, a strategy, a list of them, or a Spec; got {type(spec).__name__}")
    return _compose(strategies)


def parse_strategy(text: str) -> Strategy:
    """Parse a spec string that names exactly one strategy."""
    strategies = _parse_string(text)
    if len(strategies) != 1:
        raise SpecError(f"expected exactly one strategy, got {len(strategies)} in {quoted(text)}")
    return strategies[0]


def _check_terms(count: int, what: str) -> None:
    if count > MAX_SPEC_TERMS:
        raise SpecError(
            f"a spec holds at most {MAX_SPEC_TERMS} strategies (one per kind, and reuse strategies); got {what}"
        )


def _compose(strategies: list[Strategy]) -> Spec:
    _check_terms(len(strategies), f"{len(strategies)} strategies")
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


def _parse_string(text: str) -> list[Strategy]:
    if len(text) > MAX_SPEC_CHARS:
        raise SpecError(f"a spec string has at most {MAX_SPEC_CHARS} characters; got {len(text)}: {quoted(text)}")
    stripped = text.strip()
    if stripped in ("", "full"):
        return []
    try:
        tree = ast.parse(stripped, mode="eval").body
    except (SyntaxError, RecursionError, MemoryError) as exc:
        column = f" at column {exc.offset}" if isinstance(exc, SyntaxError) else ""
        raise SpecError(
            f"cannot parse spec {quoted(text)}{column}: expected terms like name or"
            f" name(param=value) joined by '+', e.g. 'snapkv(window=32)+kivi(bits=2)'"
        ) from None
    terms = _terms(tree)
    _check_terms(len(terms), f"{len(terms)} terms in {quoted(text)}")
    return [_build(term, text) for term in terms]


def _terms(node: ast.expr) -> list[ast.expr]:
    """The operands of a chain of ``+`` in order, walked without recursion (``a+b+c`` nests to
    the left, as deep as it has terms; parenthesised groups nest to the right)."""
    terms, pending = [], [node]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            pending += [node.right, node.left]
        else:
            terms.append(node)
    return terms


def _build(term: ast.expr, text: str) -> Strategy:
    if isinstance(term, ast.Name):
        return _instantiate(term.id, {})
    if isinstance(term, ast.Call) and isinstance(term.func, ast.Name):
        name = term.func.id
        if term.args:
            raise SpecError(
                f"{cut(name)}: parameters must be named, as in {cut(name)}(param=value); got a positional one in {quoted(text)}"
            )
        kwargs = {}
        for keyword in term.keywords:
            if keyword.arg is None:
                raise SpecError(f"{cut(name)}: '**' is not allowed in a spec")
            if keyword.arg in kwargs:
                raise SpecError(f"{cut(name)}: parameter {quoted(keyword.arg)} is given twice in {quoted(text)}")
            try:
                kwargs[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise SpecError(
                    f"{cut(name)}: value of {quoted(keyword.arg)} must be a literal (number, string, True/False, None,"
                    f" tuple), got {quoted(ast.unparse(keyword.value))}"
                ) from None
        return _instantiate(name, kwargs)
    raise SpecError(f"cannot read {quoted(ast.unparse(term))} in spec {quoted(text)}: expected name or name(param=value)")


def _instantiate(name: str, kwargs: dict[str, object]) -> Strategy:
    cls = get_policy(name)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in kwargs if k not in fields]
    if unknown:
        raise SpecError(f"{name} has no parameter {', '.join(map(quoted, unknown))}; valid: {parameters_help(cls)}")
    try:
        return cls(**kwargs)
    except SpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{name}: {exc}") from None


def parameters_help(cls: type[Strategy]) -> str:
    """``name (type, default value)`` for each parameter of a strategy class, or ``(none)``."""
    hints = typing.get_type_hints(cls)
    parts = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        value = field_default(field)
        default = "required" if value is dataclasses.MISSING else f"default {value!r}"
        parts.append(f"{field.name} ({describe(hints[field.name])}, {default})")
    return ", ".join(parts) or "(none)"
