"""Every built-in policy, one module per policy, in one package per kind. Importing this
registers them all: adding a policy is adding one file."""

import importlib
import pkgutil
from collections.abc import Iterable

KIND_PACKAGES = ("eviction", "budget", "quantization", "lowrank", "reuse", "tiering", "recompute")
"""Subpackages of built-in policies, one per kind that has any."""


def import_modules(package: str, path: Iterable[str]) -> None:
    """Import every module of ``package`` (found on ``path``), registering the policies they define."""
    for module in sorted(pkgutil.iter_modules(path), key=lambda found: found.name):
        importlib.import_module(f"{package}.{module.name}")


for _kind in KIND_PACKAGES:
    importlib.import_module(f"{__name__}.{_kind}")
