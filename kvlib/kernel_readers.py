"""How a codec describes its sealed pages to the paged kernels: :class:`KernelReader`.

A codec that can be read in place gives, for keys and for values, the name of a reader the
kernels registered, the tensors that reader reads and its int parameters
(:meth:`kvlib.codec.TensorCodec.kernel_reader`). That is all that crosses the decode operator's
boundary (``kvlib::paged_decode_coded``, :mod:`kvlib.kernels.paged_ops`): tensors, a str and
ints, so the operator traces under ``torch.compile`` and every cache of a codec shares its
compiled graph. Each kernel resolves the name itself (:mod:`kvlib.kernels.page_readers`): the numba
kernel to a reader with the codec's scales folded into the query or the weights, the Triton
kernels to a tile loader. Nothing here imports numba or triton, so codecs name this contract
on any machine.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KernelReader(NamedTuple):
    """One tensor (keys or values) of a codec's sealed pages as the paged kernels read it:
    ``kernel``, the name its readers are registered under; ``fields``, the tensors they read
    (field arenas ``[capacity, ...]`` indexed by page id, contiguous, on the arenas' device, and
    any codec state such as sign vectors); ``params``, its int parameters (bits, layout flags, group sizes)."""

    kernel: str
    fields: tuple[torch.Tensor, ...]
    params: tuple[int, ...]
