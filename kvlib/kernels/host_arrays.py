"""CPU tensors as numpy arrays over the same memory, with no torch operator.

``tensor.numpy()`` is four trips through torch's dispatcher (``detach``, ``to``,
``resolve_conj``, ``resolve_neg``): inside a decode step's operators, over a model's layers, that
was most of what kvlib's own operators dispatched. :func:`host_array` reads the tensor's address,
shape and strides instead (attribute reads, no operator) and builds the numpy view over that
memory; views of tensors that live across calls (arenas, block tables, a plan's tensors) are
kept, keyed by what defines them, so a later call with the same memory gets the same view.

A view built from an address does not keep the tensor alive: it is valid while the tensor is
(an operator's arguments are, for the whole call). A kept view is only ever handed out for a
tensor that lies at the same address with the same dtype, shape and strides, i.e. one it
describes exactly.

Float dtypes numpy has no arithmetic for in numba's CPU target are handed out as their bit
patterns: float16 and bfloat16 as uint16, float8 as uint8 (:data:`NUMPY_DTYPES`).
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict

import numpy as np
import torch

NUMPY_DTYPES: dict[torch.dtype, type] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.uint16,
    torch.bfloat16: np.uint16,
    torch.float8_e4m3fn: np.uint8,
    torch.float8_e5m2: np.uint8,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
"""The numpy dtype each torch dtype is read as (16- and 8-bit floats as their bit patterns)."""

FLOAT_KINDS: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""The float dtypes the CPU kernels read, by the kind number their bit patterns are widened by
(:func:`~kvlib.kernels.page_kernel_parts.float_of`): 0 float32 (float32 or uint32 bits), 1
float16, 2 bfloat16 (uint16 bits)."""

KEPT_VIEWS = 512
"""Views kept for tensors seen again (the least recently used beyond this are dropped)."""

_views: OrderedDict[tuple, np.ndarray] = OrderedDict()


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of CPU ``tensor``'s memory (its shape and strides; dtype per
    :data:`NUMPY_DTYPES`), without a torch operator. ValueError for a tensor off the CPU or of
    a dtype not listed."""
    if tensor.device.type != "cpu":
        raise ValueError(f"host arrays are views of CPU tensors, got one on {tensor.device}")
    dtype = NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"host arrays are read for {sorted(map(str, NUMPY_DTYPES))}, got {tensor.dtype}")
    key = (tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride())
    view = _views.get(key)
    if view is not None:
        _views.move_to_end(key)
        return view
    view = _view(tensor, dtype)
    _views[key] = view
    if len(_views) > KEPT_VIEWS:
        _views.popitem(last=False)
    return view


def float_bits(tensor: torch.Tensor) -> tuple[np.ndarray, int]:
    """A CPU float tensor's elements as the kernels read them (:func:`host_array`: float32 as
    float32, float16 and bfloat16 as uint16 bit patterns) and its :data:`FLOAT_KINDS` kind.
    ValueError for another dtype."""
    if tensor.dtype not in FLOAT_KINDS:
        raise ValueError(f"float bits are read for {tuple(FLOAT_KINDS)}, got {tensor.dtype}")
    return host_array(tensor), FLOAT_KINDS[tensor.dtype]


def _view(tensor: torch.Tensor, dtype: type) -> np.ndarray:
    """The numpy array over ``tensor``'s elements at its address (read-write, not owning)."""
    size = tensor.element_size()
    if tensor.numel() == 0:
        return np.empty(tuple(tensor.shape), dtype=dtype)
    span = 1 + sum((extent - 1) * stride for extent, stride in zip(tensor.shape, tensor.stride()) if stride > 0)
    memory = (ctypes.c_char * (span * size)).from_address(tensor.data_ptr())
    strides = tuple(stride * size for stride in tensor.stride())
    return np.ndarray(tuple(tensor.shape), dtype=dtype, buffer=memory, strides=strides)
