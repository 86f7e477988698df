"""The on-disk cache of kernels built as closures: a kernel built again (as a new process builds
it) loads from disk and computes the same; another closure value, or an edit to a function it
calls in another file, compiles anew; the key is the same in another process (a pickled
dispatcher's is not)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import numba
import pytest

import kvlib.kernels.kernel_cache
from kvlib.kernels.kernel_cache import cache_on_disk, reached_digest

PARTS = """
import numba
SHIFT = {shift}


@numba.njit(inline="always")
def add_shift(x):
    return x + SHIFT
"""
FACTORY = """
import numba
from parts import add_shift


def make(scale):
    @numba.njit
    def kernel(x):
        return add_shift(x) * scale

    return kernel
"""


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``load(shift)``: the factory module (``tmp_path/factory.py``) over ``tmp_path/parts.py``
    written with ``SHIFT = shift``, both loaded as fresh modules, as a new process loads them
    (the cache: ``tmp_path/__pycache__``, numba's place beside the source, whatever
    ``$NUMBA_CACHE_DIR`` the run has)."""
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    (tmp_path / "factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))

    def load(shift: float) -> types.ModuleType:
        text = PARTS.format(shift=shift)
        if not (tmp_path / "parts.py").exists() or (tmp_path / "parts.py").read_text() != text:
            (tmp_path / "parts.py").write_text(text)
        monkeypatch.setitem(sys.modules, "parts", _module(tmp_path / "parts.py", "parts"))
        return _module(tmp_path / "factory.py", "factory")

    return load


def _module(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_kernel_built_again_loads_from_disk_and_an_edit_compiles_anew(kernels, tmp_path: Path) -> None:
    first = cache_on_disk(kernels(1.0).make(2.0))
    assert first(1.0) == 4.0 and first.stats.cache_misses[first.signatures[0]] == 1
    assert len(list((tmp_path / "__pycache__").glob("factory.make.locals.kernel-*.nbc"))) == 1
    again = cache_on_disk(kernels(1.0).make(2.0))  # the same text in fresh modules: loaded, not compiled
    assert again(1.0) == 4.0 and again.stats.cache_hits[again.signatures[0]] == 1
    other_scale = cache_on_disk(kernels(1.0).make(3.0))  # another closure value
    assert other_scale(1.0) == 6.0 and other_scale.stats.cache_misses[other_scale.signatures[0]] == 1
    edited = cache_on_disk(kernels(5.0).make(2.0))  # the called function's file edited (a constant)
    assert edited(1.0) == 12.0 and edited.stats.cache_misses[edited.signatures[0]] == 1
    assert len(list((tmp_path / "__pycache__").glob("factory.make.locals.kernel-*.nbc"))) == 3


def test_the_key_is_the_same_in_another_process(kernels, tmp_path: Path) -> None:
    """A fresh interpreter (another hash seed: fastmath flags are a set) computes the same digest
    for the same kernel; the module under test is loaded by its path, without kvlib's imports."""
    kernel = kernels(1.0).make(2.0)
    script = f"""
import importlib.util, sys
sys.path.insert(0, {str(tmp_path)!r})
spec = importlib.util.spec_from_file_location("kernel_cache", {kvlib.kernels.kernel_cache.__file__!r})
kernel_cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_cache)
spec = importlib.util.spec_from_file_location("factory", {str(tmp_path / "factory.py")!r})
factory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(factory)
print(kernel_cache.reached_digest(factory.make(2.0).py_func))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "7"})
    assert result.stdout.strip() == reached_digest(kernel.py_func)
    assert reached_digest(kernels(1.0).make(3.0).py_func) != reached_digest(kernel.py_func)
