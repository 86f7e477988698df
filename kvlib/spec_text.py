"""Spec text: the terms of a spec string, each built into a registered policy object.

Grammar: terms joined by ``+``; a term is a policy name, optionally called with keyword
arguments whose values are Python literals (numbers, strings, booleans, None, tuples). The
string is parsed with :mod:`ast` and values with ``ast.literal_eval``: nothing is executed. A
spec string has at most :data:`~kvlib.limits.MAX_SPEC_CHARS` characters (checked before parsing)
and at most :data:`~kvlib.limits.MAX_SPEC_TERMS` terms (checked before any is built); error
messages quote the spec and its names cut to :data:`~kvlib.errors.ECHO_CHARS` characters.

Below :mod:`kvlib.policy` (a policy parameter given as a string is parsed here) and above the
registry (names to classes); composing the policies into a :class:`~kvlib.spec.Spec` is
:mod:`kvlib.spec`'s job.
"""

from __future__ import annotations

import ast
import dataclasses
import typing

from kvlib.errors import SpecError, cut, quoted
from kvlib.limits import MAX_SPEC_CHARS, MAX_SPEC_TERMS
from kvlib.params import describe, field_default
from kvlib.registry import get_policy


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs on the commas outside parentheses (``kivi(bits=4,group=32)`` stays whole)."""
    policies, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            policies.append(current.strip())
            current = ""
        else:
            current += char
    return [p for p in policies + [current.strip()] if p]


def parse_policy(text: str) -> object:
    """The one policy a spec string names (:class:`~kvlib.errors.SpecError` for none or several)."""
    policies = parse_terms(text)
    if len(policies) != 1:
        raise SpecError(f"expected exactly one policy, got {len(policies)} in {quoted(text)}")
    return policies[0]


def parse_terms(text: str) -> list[object]:
    """The policies a spec string names, in order (``""`` and ``"full"`` name none)."""
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
    check_terms(len(terms), f"{len(terms)} terms in {quoted(text)}")
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


def _build(term: ast.expr, text: str) -> object:
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


def _instantiate(name: str, kwargs: dict[str, object]) -> object:
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


def parameters_help(cls: type) -> str:
    """``name (type, default value)`` for each parameter of a policy class, or ``(none)``."""
    hints = typing.get_type_hints(cls)
    parts = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        value = field_default(field)
        default = "required" if value is dataclasses.MISSING else f"default {value!r}"
        parts.append(f"{field.name} ({describe(hints[field.name])}, {default})")
    return ", ".join(parts) or "(none)"


def check_terms(count: int, what: str) -> None:
    if count > MAX_SPEC_TERMS:
        raise SpecError(f"a spec holds at most {MAX_SPEC_TERMS} policies (one per kind, and reuse policies); got {what}")
