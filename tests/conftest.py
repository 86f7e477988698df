"""Fixtures shared by every test package."""

from __future__ import annotations

import pytest

from kvlib import registry


@pytest.fixture
def scratch_registry(monkeypatch):
    """Give a test a private copy of the registry (built-ins loaded first), restored afterwards."""
    registry.available_policies()
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    return registry._registry
