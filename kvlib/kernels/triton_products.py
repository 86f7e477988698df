"""Matrix products of float32 tiles inside the Triton kernels, at float32's precision or close to
it, on tensor cores where the model runs in a half dtype.

``DOT`` (a constexpr) is the dtype the products run in: ``tl.float32`` gives IEEE float32
products (CUDA cores); ``tl.float16`` or ``tl.bfloat16`` gives tensor-core products of operands
split into parts of that dtype whose sum is the float32 operand (to the parts' precision), each
product accumulated in float32. IEEE float32 products on CUDA cores hold whole rows of both
operands in registers: at head dim 128, the attention kernel over coded pages took all 255
registers of 8 warps and spilled (ptxas for sm_90), where split products took 196-255 and did
not spill. :func:`dot_dtype` chooses ``DOT``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HALF_DOTS = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
"""The tensor-core dtype of the products for a query dtype; other query dtypes: IEEE float32."""


def dot_dtype(query_dtype: torch.dtype, device: torch.device) -> tl.dtype:
    """``DOT`` for queries of ``query_dtype`` on ``device``: their half dtype on a GPU, else
    float32. On the CPU the kernels run in Triton's interpreter, whose bfloat16 is not a GPU's
    (it rounds float32 by truncation and multiplies bfloat16 tiles as integers), so float16
    products are kept there and bfloat16 ones become IEEE float32."""
    dot = HALF_DOTS.get(query_dtype, tl.float32)
    return tl.float32 if device.type == "cpu" and dot == tl.bfloat16 else dot


@triton.jit
def split_dot(a, b, DOT: tl.constexpr):
    """``a @ b`` of float32 tiles: IEEE float32 products when ``DOT`` is ``tl.float32``; else each
    operand as a high part (rounded to ``DOT``) plus a low part (the remainder, rounded to
    ``DOT``), ``hi a . hi b + lo a . hi b + hi a . lo b`` on tensor cores with float32
    accumulation: 16 significant bits per operand in bfloat16, 22 in float16 (float32 has 24;
    float16's low parts of values below 2**-3 lose bits to its subnormals: absolute error under
    2**-24 times the other operand)."""
    if DOT == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        a_high = a.to(DOT)
        b_high = b.to(DOT)
        a_low = (a - a_high.to(tl.float32)).to(DOT)
        b_low = (b - b_high.to(tl.float32)).to(DOT)
        return tl.dot(a_high, b_low, tl.dot(a_low, b_high, tl.dot(a_high, b_high)))


@triton.jit
def dot_exact_right(a, b, DOT: tl.constexpr):
    """``a @ b`` of a float32 tile ``a`` and a float32 tile ``b`` exact in ``DOT`` (a matrix of
    signs): IEEE float32 products when ``DOT`` is ``tl.float32``; else ``a`` as the sum of three
    parts of ``DOT`` (24 significant bits in bfloat16, float32's; more in float16, whose range
    must then hold ``a``), each product with ``b`` exact, accumulated in float32."""
    if DOT == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        exact = b.to(DOT)
        high = a.to(DOT)
        rest = a - high.to(tl.float32)
        middle = rest.to(DOT)
        low = (rest - middle.to(tl.float32)).to(DOT)
        return tl.dot(low, exact, tl.dot(middle, exact, tl.dot(high, exact)))
