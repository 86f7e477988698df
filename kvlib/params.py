"""Typed, validated policy parameters, driven by a dataclass field's type annotation.

Supported annotations: ``int``, ``float`` (ints are widened; finite only), ``bool``, ``str``,
:class:`Seed` (an int in ``[0, 2**63)``),
``Literal[...]`` (matched by type and value), ``X | None``, ``tuple[X, ...]`` and classes with
a ``coerce_parameter(value)`` classmethod, which convert a value to themselves or raise
``TypeError`` / ``ValueError`` (policy classes take a policy object, or a one-policy spec
string such as ``"snapkv(window=16)"``; see :meth:`kvlib.policy.Policy.coerce_parameter`).
This module knows no policy: the dependency runs from policies to it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union

from kvlib.errors import SpecError, quoted
from kvlib.limits import MAX_SEED


class Seed(int):
    """A random seed parameter: an int in ``[0, 2**63)`` (:data:`kvlib.limits.MAX_SEED`), what
    ``torch.Generator.manual_seed`` and numpy take; another value is refused when the spec is parsed."""

    @classmethod
    def coerce_parameter(cls, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_SEED:
            raise ValueError("a seed is an int in [0, 2**63)")
        return value


def describe(annotation: Any) -> str:
    """A short human name for a parameter type (``int``, ``float | None``, ``'a' | 'b'``)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(describe(a) for a in typing.get_args(annotation))
    if origin is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{describe(args[0])}, ...]"
        return f"tuple[{', '.join(describe(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def coerce(owner: str, name: str, annotation: Any, value: Any) -> Any:
    """Return ``value`` converted to ``annotation``; raise :class:`SpecError` naming the problem."""
    try:
        return _coerce(annotation, value)
    except (TypeError, ValueError) as exc:
        detail = f" ({exc})" if str(exc) else ""
        raise SpecError(
            f"{owner}: parameter {name!r} must be {describe(annotation)}, got {quoted(value)} ({type(value).__name__}){detail}"
        ) from None


def field_default(field: dataclasses.Field) -> object:
    """A dataclass field's default value (calling its factory), or ``dataclasses.MISSING``."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _homogeneous_tuple_item(annotation: Any) -> Any:
    """``X`` of ``tuple[X, ...]``; other tuple forms are not supported parameter types."""
    args = typing.get_args(annotation)
    if len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    raise TypeError(f"unsupported parameter annotation {describe(annotation)}: use tuple[X, ...]")


def _coerce(annotation: Any, value: Any) -> Any:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin in (Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _coerce(option, value)
            except (TypeError, ValueError):
                continue
        raise TypeError("")
    if origin is Literal:
        if any(type(value) is type(option) and value == option for option in typing.get_args(annotation)):
            return value
        raise ValueError("")
    if origin is tuple:
        item = _homogeneous_tuple_item(annotation)
        if not isinstance(value, (tuple, list)):
            raise TypeError("")
        return tuple(_coerce(item, v) for v in value)
    if annotation is type(None):
        if value is None:
            return None
        raise TypeError("")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise TypeError("")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError("")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError("must be finite")
            return float(value)
        raise TypeError("")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise TypeError("")
    converter = getattr(annotation, "coerce_parameter", None)
    if isinstance(annotation, type) and converter is not None:
        return converter(value)
    raise TypeError(f"unsupported parameter annotation {annotation!r}")
