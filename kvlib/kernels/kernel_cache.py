"""Numba's on-disk cache for the kernels built per page reader: closures over other jitted functions.

:func:`~kvlib.kernels.paged_attention.attention_kernel` and
:func:`~kvlib.kernels.paged_scores.scores_kernel` build one kernel per pair of page readers (float
arenas, each codec's readers), each a closure whose cells hold other ``@numba.njit`` functions.
``numba.njit(cache=True)`` cannot reuse such a kernel in another process: it keys an entry by
the pickled closure cells, and a pickled dispatcher carries a fresh random id in every process.
So every process (each pytest-xdist worker, each Ray worker, each ``kvlib compare`` run) compiled
every kernel it used again, tens of seconds each.

:func:`cache_on_disk` gives such a kernel numba's cache under a key that is the same in every
process and changes with anything the compiled code depends on:

- the kernel's signature and the target machine (numba's own key), numba's and Python's version;
- for the kernel and every Python function it reaches (closure cells, the globals its code
  names, recursively): the whole text of the file that defines it (any edit there, a constant's
  included, is a new key), its qualified name and bytecode;
- the values numba freezes into the code: the numbers, strings, tuples and arrays among those
  cells and globals (an object of another kind is described by its ``repr``: one that names an
  address only makes the key unique to this process, a miss, never a wrong hit).

Entries live where numba keeps its cache (``__pycache__`` beside the source, or
``$NUMBA_CACHE_DIR``), one data file per key, named by the key's digest and written atomically
(numba's writes), so processes compiling the same kernel side by side (two xdist workers) can
at worst both compile it; no process ever loads another key's code.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import types
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
from numba.core.caching import FunctionCache, IndexDataCacheFile
from numba.core.dispatcher import Dispatcher


def cache_on_disk(kernel: Dispatcher) -> Dispatcher:
    """``kernel`` (a ``@numba.njit`` function, typically a closure) with numba's on-disk cache
    under :class:`ReachedSourceCache`'s key; returns ``kernel`` itself."""
    kernel._cache = ReachedSourceCache(kernel.py_func)
    return kernel


class DigestNamedFiles(IndexDataCacheFile):
    """Numba's cache files of one function, one data file per key named by the key's digest (no
    index: numba's numbers its data files from an index that two processes can each rewrite,
    so that one key's number could end up naming another key's code)."""

    def save(self, key: tuple, data: object) -> None:
        self._save_data(self._digest_name(key), data)

    def load(self, key: tuple) -> object | None:
        try:
            return self._load_data(self._digest_name(key))
        except OSError:  # not compiled yet (or removed meanwhile)
            return None

    def _digest_name(self, key: tuple) -> str:
        return self._data_name_pattern.replace("{number:d}", hashlib.sha256(repr(key).encode()).hexdigest()[:32])


class ReachedSourceCache(FunctionCache):
    """Numba's function cache keyed by :func:`reached_digest` of the function instead of its
    pickled closure cells (see the module's docstring)."""

    def __init__(self, py_func: Callable) -> None:
        super().__init__(py_func)
        self._cache_file = DigestNamedFiles(self._cache_path, self._impl.filename_base, source_stamp=None)

    def _index_key(self, sig: tuple, codegen: object) -> tuple:
        return (sig, codegen.magic_tuple(), numba.__version__, sys.version, reached_digest(self._py_func))


def reached_digest(function: types.FunctionType) -> str:
    """A sha256 over what compiling ``function`` depends on beside its argument types: the text of
    the file of every Python function it reaches, each one's name and bytecode, and the plain
    values its closure cells and named globals hold (the module's docstring lists them)."""
    digest = hashlib.sha256()
    reached: set[int] = set()
    _describe(function, digest, reached)
    return digest.hexdigest()


def _describe(value: object, digest: hashlib._Hash, reached: set[int]) -> None:
    """Feed ``value`` into ``digest``: a function with all it reaches (each once), a container
    element by element (a dict's items and a set's elements in sorted order), an array by its
    bytes, anything else by its ``repr``."""
    if isinstance(value, Dispatcher):
        _describe(value.targetoptions, digest, reached)
        value = value.py_func
    if isinstance(value, types.FunctionType):
        if id(value) in reached:
            return
        reached.add(id(value))
        _describe_function(value, digest, reached)
    elif isinstance(value, (tuple, list)):
        digest.update(f"{type(value).__qualname__}[{len(value)}]".encode())
        for item in value:
            _describe(item, digest, reached)
    elif isinstance(value, dict):
        digest.update(f"dict[{len(value)}]".encode())
        for key in sorted(value, key=repr):
            _describe(key, digest, reached)
            _describe(value[key], digest, reached)
    elif isinstance(value, (set, frozenset)):  # in sorted order: a set's own order changes with each process's hash seed
        digest.update(f"set {sorted(repr(item) for item in value)}".encode())
    elif isinstance(value, np.ndarray):
        digest.update(f"array {value.dtype} {value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, types.ModuleType):
        digest.update(f"module {value.__name__}".encode())
    else:
        digest.update(f"{type(value).__qualname__} {value!r}".encode())


def _describe_function(function: types.FunctionType, digest: hashlib._Hash, reached: set[int]) -> None:
    digest.update(f"function {function.__module__}.{function.__qualname__}".encode())
    digest.update(_file_digest(function.__code__.co_filename).encode())
    for code in _code_objects(function.__code__):
        digest.update(code.co_code)
        digest.update(repr([c for c in code.co_consts if not isinstance(c, types.CodeType)]).encode())
    for cell in function.__closure__ or ():
        _describe(cell.cell_contents, digest, reached)
    for name in sorted({name for code in _code_objects(function.__code__) for name in code.co_names}):
        if name in function.__globals__:
            digest.update(f"global {name}".encode())
            _describe(function.__globals__[name], digest, reached)


def _code_objects(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and the code objects nested in it (comprehensions, inner functions)."""
    return [code] + [inner for const in code.co_consts if isinstance(const, types.CodeType) for inner in _code_objects(const)]


@functools.cache
def _file_digest(path: str) -> str:
    """The sha256 of the file at ``path`` (read once per process), or its path where it cannot
    be read (a function defined in an interactive session)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return path
