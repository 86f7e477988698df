"""The policy registry: names to policy classes, by kind, with entry-point plugins.

Built-in policies live in :mod:`kvlib.policies` and register on import. Third-party
policies register with the same decorator, or are advertised in the ``kvlib.policies``
entry-point group: each entry point names a module (whose import registers its policies) or a
policy class (registered under the entry point's name). Built-ins and plugins load lazily on
the first look-up. Names are unique across kinds.

The registry knows no policy class: :mod:`kvlib.policy` declares its kind bases here
(:func:`declare_kinds`) and each class checks what is particular to its kind
(``check_registration``), so imports run one way, policies -> registry.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
import warnings
from collections.abc import Callable
from importlib.metadata import entry_points

from kvlib.errors import ECHO_CHARS, SpecError, quoted

ENTRY_POINT_GROUP = "kvlib.policies"
LEGACY_ENTRY_POINT_GROUP = "kvlib.strategies"
"""The group's name in 0.1 (which said "strategy" for a registered plugin): still read,
with a ``DeprecationWarning`` per plugin, for one release."""
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

_registry: dict[str, type] = {}
_kind_bases: dict[str, type] = {}
_loaded = False


def declare_kinds(*bases: type) -> dict[str, type]:
    """Declare the kind bases, in listing order (called once, by :mod:`kvlib.policy`); returns
    them by kind name."""
    _kind_bases.update((base.kind, base) for base in bases)
    return dict(_kind_bases)


def register(name: str) -> Callable[[type], type]:
    """Class decorator: register a policy dataclass under ``name`` (its kind comes from its base).

    Raises ``ValueError`` for a malformed name, a class that is not a dataclass subclassing one
    of the kind bases, unknown ``needs``, or a name already taken by another class.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"policy name must match {_NAME.pattern} (lowercase, digits, _), got {quoted(name)}")

    def decorate(cls: type) -> type:
        _check_class(name, cls)
        own = registered_name(cls)
        if own and own != name and _registry.get(own) is cls:
            raise ValueError(f"{_qualname(cls)} is already registered as {own!r}; a class has one name")
        existing = _registry.get(name)
        if existing is not None and _qualname(existing) != _qualname(cls):
            raise ValueError(f"policy name {name!r} is taken by {_qualname(existing)}; choose another name for {_qualname(cls)}")
        cls.name = name
        _registry[name] = cls
        return cls

    return decorate


def registered_name(cls: type) -> str:
    """The name ``cls`` itself was registered under, or ``""`` (a subclass does not inherit it)."""
    return cls.__dict__.get("name", "")


def available_policies() -> dict[str, list[str]]:
    """Registered policy names by kind (every kind present, names sorted), plugins included."""
    _load()
    by_kind: dict[str, list[str]] = {kind: [] for kind in _kind_bases}
    for name, cls in _registry.items():
        by_kind[cls.kind].append(name)
    return {kind: sorted(names) for kind, names in by_kind.items()}


def available_strategies() -> dict[str, list[str]]:
    """Deprecated name of :func:`available_policies` (kept for one release)."""
    warnings.warn("kvlib.available_strategies is deprecated: use kvlib.available_policies", DeprecationWarning, stacklevel=2)
    return available_policies()


def get_policy(name: str) -> type:
    """The policy class registered under ``name``; ``SpecError`` listing valid names if none
    (the name quoted cut to :data:`~kvlib.errors.ECHO_CHARS` characters; names that long get no
    close-match hint)."""
    _load()
    if name in _registry:
        return _registry[name]
    close = difflib.get_close_matches(name, list(_registry), n=3) if len(name) <= ECHO_CHARS else []
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    listing = "; ".join(f"{kind}: {', '.join(names) or '(none)'}" for kind, names in available_policies().items())
    raise SpecError(f"unknown policy {quoted(name)}.{hint} Valid policies by kind: {listing}")


def get_strategy(name: str) -> type:
    """Deprecated name of :func:`get_policy` (kept for one release)."""
    warnings.warn("kvlib.get_strategy is deprecated: use kvlib.get_policy", DeprecationWarning, stacklevel=2)
    return get_policy(name)


def _check_class(name: str, cls: type) -> None:
    if not isinstance(cls, type) or not issubclass(cls, tuple(_kind_bases.values())):
        kinds = ", ".join(base.__name__ for base in _kind_bases.values())
        raise ValueError(f"policy {name!r} must subclass one of kvlib's kind bases ({kinds})")
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"policy {name!r} must be a @dataclass (its fields are its parameters)")
    cls.check_registration(name)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _load() -> None:
    """Import the built-in policies and the entry-point plugins, once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    importlib.import_module("kvlib.policies")
    for group in (ENTRY_POINT_GROUP, LEGACY_ENTRY_POINT_GROUP):
        for entry in entry_points(group=group):
            _load_plugin(group, entry)


def _load_plugin(group: str, entry) -> None:
    """Register what one entry point advertises; a plugin that fails to load is a warning."""
    if group == LEGACY_ENTRY_POINT_GROUP:
        warnings.warn(
            f"kvlib: plugin {entry.name!r} is advertised in the deprecated entry-point group {group!r}; "
            f"advertise it in {ENTRY_POINT_GROUP!r}",
            DeprecationWarning,
            stacklevel=3,
        )
    try:
        loaded = entry.load()
        if isinstance(loaded, type) and loaded not in _registry.values():
            register(entry.name)(loaded)
    except Exception as exc:  # a broken plugin must not take kvlib down with it
        warnings.warn(
            f"kvlib: plugin {entry.name!r} ({entry.value}) from group {group!r} failed to load: {exc}",
            RuntimeWarning,
            stacklevel=3,
        )
