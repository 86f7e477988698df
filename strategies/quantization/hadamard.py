"""Randomized Hadamard rotation of a group quantizer's pages (the ``rotated`` codec's helper, not a strategy).

The rotation of head ``h`` is ``R_h = H D_h / sqrt(d)``: ``D_h`` a fixed diagonal of random signs
(one vector per layer, tensor and KV head, drawn from a seed), ``H`` the ``d x d`` Sylvester
Hadamard matrix (``d`` a power of two). ``R_h`` is orthogonal, so ``q . k = (R_h q) . (R_h k)``
and the quantization error's norm is the same in both bases; what changes is its spread: an
outlier channel of ``k`` is shared out over all ``d`` rotated channels, so a group's min/max
range shrinks (QuaRot, Ashkboos et al., 2024; SpinQuant; RotateKV). A token row is rotated
alone, in ``O(d log d)`` (the butterfly of the fast Walsh-Hadamard transform).

Pages are stored rotated; every read undoes the rotation (``x = D_h H y / sqrt(d)``), so reads
return keys and values in the model's basis: the dense encode and decode here (on the CPU one
fused numba pass per page batch, :func:`rotate_rows`, in the same float32 operations and order as
the torch :func:`hadamard` that serves other devices), and inside the paged-attention kernel :func:`load_rotated`, which decodes the codes as the group
quantizer's loader does and then rotates each token row back. The kernel's loaders get a page
id, not its head, so each sealed page also stores its KV head (one byte, ``head`` field).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvlib.codec import CodedReader, Field, TensorCodec, TensorShape
from kvlib.devices import to_arena_device
from kvlib.kernels.coded_page_loaders import OPEN_ITEMS, load_open
from kvlib.strategies.quantization.page_loaders import decode_page_groups, load_group_quantized
from kvlib.strategies.quantization.uniform import write_rows
from kvlib.triton_readers import TritonReader

MAX_HEADS = 256
"""KV heads a layer may have: a page's head is stored in one byte."""


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def random_signs(seed: int, shape: TensorShape, part: int) -> torch.Tensor:
    """int8 ``[kv_heads, dim]`` of +-1, fixed by ``(seed, layer, part)`` (``part`` 0 keys, 1 values)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 2 * shape.layer_idx + part)
    bits = torch.randint(0, 2, (shape.kv_heads, shape.dim), generator=generator, dtype=torch.int8)
    return (2 * bits - 1).to(shape.device)


@numba.njit(inline="always")
def butterflies(row: np.ndarray) -> None:
    """``row H`` in place (float32 ``[d]``, ``d`` a power of two, unnormalized): the butterfly
    passes of :func:`hadamard`, in its order (so float32 results are the same)."""
    dim = row.shape[0]
    half = 1
    while half < dim:
        for start in range(0, dim, 2 * half):
            for j in range(start, start + half):
                a = row[j]
                b = row[j + half]
                row[j] = a + b
                row[j + half] = a - b
        half *= 2


@numba.njit(parallel=True, cache=True)
def rotate_rows(
    x: np.ndarray, sources: np.ndarray, signs: np.ndarray, heads: np.ndarray, out: np.ndarray, targets: np.ndarray, forward: bool
) -> None:
    """Rotate every token row of float32 page ``x[sources[p]]`` (``x [pages, tokens, d]``) into
    ``out[targets[p]]`` (float32 ``[rows, tokens, d]``; in place where ``out`` is ``x`` and
    ``targets`` is ``sources``), with the signs of page ``p``'s head ``signs[heads[p]]`` (int8
    ``[kv_heads, d]``). ``forward``: ``R_h x``
    = ``H (D_h x) / sqrt(d)`` (encoding); else ``R_h^T y = D_h H y / sqrt(d)`` (decoding). The
    same float32 operations in the same order as the torch path (:func:`hadamard`)."""
    tokens, dim = x.shape[1], x.shape[2]
    norm = np.float32(dim**-0.5)
    for p in numba.prange(sources.shape[0]):
        h = heads[p]
        src = sources[p]
        dst = targets[p]
        tile = np.empty((dim, tokens), dtype=np.float32)  # the page transposed: a butterfly pairs two contiguous rows
        for t in range(tokens):
            for c in range(dim):
                value = x[src, t, c]
                tile[c, t] = value * np.float32(signs[h, c]) if forward else value
        half = 1
        while half < dim:  # butterflies' passes, every token at once (2.5x faster than row by row here)
            for start in range(0, dim, 2 * half):
                for j in range(start, start + half):
                    first = tile[j]
                    second = tile[j + half]
                    for t in range(tokens):
                        a = first[t]
                        b = second[t]
                        first[t] = a + b
                        second[t] = a - b
            half *= 2
        for t in range(tokens):
            for c in range(dim):
                if forward:
                    out[dst, t, c] = tile[c, t] * norm
                else:
                    out[dst, t, c] = (tile[c, t] * norm) * np.float32(signs[h, c])


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x H / sqrt(d)`` along the last dim of float32 ``x [..., d]`` (``d`` a power of two; ``H``
    Sylvester's, symmetric, so this is its own inverse), by ``log2(d)`` butterfly passes."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    half = 1
    while half < d:
        pairs = x.reshape(*lead, d // (2 * half), 2, half)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((first + second, first - second), dim=-2).reshape(*lead, d)
        half *= 2
    return x * d**-0.5


class RotatedQuantizer(TensorCodec):
    """``inner`` (a tensor codec; a :class:`~.uniform.GroupQuantizer` for the ``rotated`` strategy)
    applied to pages rotated by their head's ``R_h``; decoding rotates back. The kernel decodes
    pages in place when ``inner``'s page reader is a group quantizer's, else reads go through
    :meth:`decode_into`. Fields: the inner quantizer's plus ``head`` (uint8, the page's
    KV head, metadata). State: the sign vectors, int8 ``[kv_heads, dim]`` (:meth:`state_bytes`).

    Error: the inner quantizer's bound holds for the rotated page; since ``R_h`` is orthogonal a
    token row's decoded error has the same L2 norm as its rotated error (plus rounding to the
    compute dtype).
    """

    def __init__(self, inner: TensorCodec, seed: int, part: int) -> None:
        super().__init__(inner.shape)
        if not is_power_of_two(inner.shape.dim):
            raise ValueError(f"a Hadamard rotation needs a power-of-two head dim, got {inner.shape.dim}")
        if inner.shape.kv_heads > MAX_HEADS:
            raise ValueError(f"rotated pages store their head in one byte: at most {MAX_HEADS} KV heads, got {inner.shape.kv_heads}")
        self.inner = inner
        self.signs = random_signs(seed, inner.shape, part)
        self._fields = inner.fields | {"head": Field((1,), torch.uint8, metadata=True)}

    @property
    def fields(self) -> dict[str, Field]:
        return self._fields

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        """On the CPU the rows are rotated by one fused numba pass (:func:`rotate_rows`), elsewhere by torch."""
        if block.device.type == "cpu":
            x = block.float().contiguous()
            rotated = torch.empty_like(x)
            every = np.arange(x.shape[0])
            rotate_rows(x.numpy(), every, self.signs.numpy(), heads.numpy(), rotated.numpy(), every, True)
        else:
            rotated = hadamard(block.float() * self._signs(heads, block.device))
        encoded = self.inner.encode(rotated, heads)
        encoded["head"] = heads.to(torch.uint8).view(-1, 1)
        return encoded

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        """As :meth:`decode_into` (the inner codes decoded in float32, rotated back, one rounding)."""
        n = encoded["head"].shape[0]
        out = torch.empty(n, self.shape.page_size, self.shape.dim, dtype=self.shape.dtype, device=self.shape.device)
        every = torch.arange(n)
        self.decode_into(encoded, every, heads, out, every)
        return out

    def decode_into(
        self, arenas: dict[str, torch.Tensor], pages: torch.Tensor, heads: torch.Tensor, out: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """The inner codec decodes into float32 (its fused kernels on the CPU), which is rotated
        back and written to ``out[rows]`` (one rounding, to ``out``'s dtype). On the CPU a float32
        ``out`` is decoded and rotated in place (:func:`rotate_rows`); elsewhere torch rotates."""
        m = pages.numel()
        inner = {name: t for name, t in arenas.items() if name != "head"}
        every = torch.arange(m)
        if out.device.type == "cpu":
            if out.dtype == torch.float32:
                self.inner.decode_into(inner, pages, heads, out, rows)
                target, places = out.numpy(), rows.numpy()
                rotate_rows(target, places, self.signs.numpy(), heads.numpy(), target, places, False)
                return
            decoded = torch.empty(m, self.shape.page_size, self.shape.dim, dtype=torch.float32)
            self.inner.decode_into(inner, pages, heads, decoded, every)
            buffer, places = decoded.numpy(), every.numpy()
            rotate_rows(buffer, places, self.signs.numpy(), heads.numpy(), buffer, places, False)
            write_rows(out, rows, decoded)
            return
        rotated = torch.empty(m, self.shape.page_size, self.shape.dim, dtype=torch.float32, device=out.device)
        self.inner.decode_into(inner, pages, heads, rotated, every)
        decoded = hadamard(rotated) * self._signs(heads, out.device)
        out.index_copy_(0, to_arena_device(rows, out.device), decoded.to(out.dtype))

    def _signs(self, heads: torch.Tensor, device: torch.device) -> torch.Tensor:
        """float32 ``[pages, 1, dim]``: the signs of each page's head, on ``device``."""
        return self.signs.index_select(0, to_arena_device(heads, self.signs.device)).unsqueeze(1).to(device, torch.float32)

    def page_reader(self, arenas: dict[str, torch.Tensor]) -> CodedReader | None:
        """The inner quantizer's codes decoded, then each token row rotated back, inside the kernel
        (None where the inner codec has no reader: the layer is then read through :meth:`decode_into`)."""
        inner = self.inner.page_reader({name: t for name, t in arenas.items() if name != "head"})
        if inner is None or inner.load is not load_group_quantized:  # load_rotated reads a group quantizer's fields
            return None
        return CodedReader((*inner.fields, arenas["head"].numpy(), self.signs.numpy()), load_rotated)

    def triton_reader(self, arenas: dict[str, torch.Tensor]) -> TritonReader | None:
        """The inner quantizer's codes decoded, then each token row rotated back, in registers
        inside the Triton kernel (None where the inner codec is not a group quantizer, or for a
        head dim over :data:`~.triton_loaders.rotated.MAX_DIM`: the layer is then read through
        :meth:`decode_into`)."""
        from kvlib.strategies.quantization.triton_loaders.group import load_group_quantized  # triton is optional
        from kvlib.strategies.quantization.triton_loaders.rotated import rotated_triton_reader

        inner = self.inner.triton_reader({name: t for name, t in arenas.items() if name != "head"})
        if inner is None or inner.load is not load_group_quantized:  # load_rotated reads a group quantizer's fields
            return None
        return rotated_triton_reader(inner, arenas["head"], self.signs)

    def state_bytes(self) -> int:
        return self.signs.numel() * self.signs.element_size()


@numba.njit(inline="always")
def load_rotated(source, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
    """A :class:`RotatedQuantizer`'s page. ``fields = (codes, scale, minimum, meta kind, bits,
    per_channel, group)`` as a group quantizer's loader reads them, then ``head`` uint8
    ``[capacity, 1]`` and ``signs`` int8 ``[kv_heads, dim]``: an open page is read raw (it was
    never rotated), a sealed page's rotated rows are decoded and each rotated back."""
    if load_open(source, page, out, out_bits, rows):
        return
    codes, scale, minimum, kind, bits, per_channel, group, head, signs = source[OPEN_ITEMS:]
    decode_page_groups(codes, scale, minimum, kind, bits, per_channel, group, page, out, rows)
    h = head[page, 0]
    dim = out.shape[1]
    norm = np.float32(dim**-0.5)
    for t in range(rows):
        butterflies(out[t])
        for c in range(dim):
            out[t, c] = (out[t, c] * norm) * np.float32(signs[h, c])
