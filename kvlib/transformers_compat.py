"""What differs between the `transformers` releases kvlib supports (``pyproject.toml``'s range).

transformers 5.24 renamed the cache argument of ``generate`` and of every model's ``forward``
from ``past_key_values`` to ``cache`` (the old name warns until 5.40 for forwards and 6.0 for
``generate``), renamed the outputs' field likewise, and started passing the attention keyword
arguments to ``Cache.update(..., kwargs=...)``. kvlib calls models through the names here, so
that no kvlib call raises a deprecation warning on any supported release.
"""

from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version

INSTALLED = Version(transformers.__version__)
"""The installed transformers release."""

CACHE_ARGUMENT = "cache" if INSTALLED >= Version("5.24.0.dev0") else "past_key_values"
"""The keyword under which ``generate`` and model forwards take a cache, and outputs return it."""

_ALL_CACHE_ARGUMENTS = ("cache", "past_key_values")


def cache_argument(cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``generate`` or a model call: ``model.generate(ids, **cache_argument(c))``."""
    return {CACHE_ARGUMENT: cache}


def passed_cache(kwargs: dict[str, Any]) -> Any:
    """The cache in a module call's keyword arguments under either name (a caller on 5.24+ may
    still pass the deprecated ``past_key_values``), or None."""
    for name in _ALL_CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None
