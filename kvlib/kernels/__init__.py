"""Kernels: paged attention (numba on the CPU, torch, Triton on CUDA), page scores, coded-page
loaders and bit packing, as torch ops and plain functions over arenas.

A layer of its own between the strategy API (:mod:`kvlib.codec`, :mod:`kvlib.devices`, ...) and
what uses the kernels (:mod:`kvlib.storage`'s pools and store, :mod:`kvlib.strategies`' codecs):
nothing here imports a pool, a store or a strategy (``pyproject.toml``'s import contracts).
"""
