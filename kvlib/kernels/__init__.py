"""Kernels: paged attention (numba on the CPU, torch, Triton on CUDA), page scores, coded-page
loaders and bit packing, as torch ops and plain functions over arenas.

A layer of its own between the policy API (:mod:`kvlib.codec`, :mod:`kvlib.devices`, ...) and
what uses the kernels (:mod:`kvlib.storage`'s pools and store, :mod:`kvlib.policies`' codecs):
nothing here imports a pool, a store or a policy (``pyproject.toml``'s import contracts).
"""
