"""Randomized Hadamard rotation of a group quantizer's pages (the ``rotated`` codec's helper, not a policy).

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
the torch :func:`hadamard` that serves other devices). The paged-attention kernel instead
rotates the query once, not every key (``q . R_h^T y = (R_h q) . y``: :func:`rotated_work`),
and sums the values in the rotated basis, rotated back once per (row, KV head)
(:func:`rotated_finish`): the ``"rotated"`` numba reader. The kernel's readers get a page id, so
each sealed page also stores its KV head (one byte, ``head`` field); a page stored for another
head than the one read (never, as the store lays pages out) is rotated back page by page.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvlib.codec import Field, TensorCodec, TensorShape
from kvlib.devices import to_arena_device
from kvlib.kernel_readers import KernelReader
from kvlib.kernels.host_arrays import host_array
from kvlib.kernels.page_kernel_parts import FASTMATH, float_accumulate, float_scores
from kvlib.kernels.page_readers import NumbaReader, register_numba_reader
from kvlib.policies.quantization.page_readers import decode_page_groups, group_accumulate, group_fields, group_key_scores
from kvlib.policies.quantization.uniform import write_rows

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
    """``inner`` (a tensor codec; a :class:`~.uniform.GroupQuantizer` for the ``rotated`` policy)
    applied to pages rotated by their head's ``R_h``; decoding rotates back. The kernels read
    pages in place when ``inner``'s reader is a group quantizer's, else reads go through
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

    def kernel_reader(self, arenas: dict[str, torch.Tensor]) -> KernelReader | None:
        """``"rotated"``: the inner group quantizer's codes read with the query rotated once per
        (row, KV head) and the values summed in the rotated basis, rotated back once
        (:func:`rotated_key_scores`, :func:`rotated_finish`); on CUDA decoded and rotated back in
        registers (:mod:`~.triton_loaders.rotated`). None where the inner codec is not a group
        quantizer, or for a head dim over :data:`MAX_TRITON_DIM` on CUDA (the
        layer is then read through :meth:`decode_into`)."""
        inner = self.inner.kernel_reader({name: t for name, t in arenas.items() if name != "head"})
        if inner is None or inner.kernel != "group":  # the rotated readers read a group quantizer's fields
            return None
        if arenas["head"].device.type == "cuda" and self.shape.dim > MAX_TRITON_DIM:
            return None
        return KernelReader("rotated", (*inner.fields, arenas["head"], self.signs.to(arenas["head"].device)), inner.params)

    def state_bytes(self) -> int:
        return self.signs.numel() * self.signs.element_size()


MAX_TRITON_DIM = 128
"""The widest head dim the Triton loader decodes rotated pages at (its Hadamard matrix is a float32
``tl.dot`` operand, ``4 * dim**2`` bytes of shared memory: 64 KiB at 128)."""


def rotated_fields(tensors: tuple[torch.Tensor, ...], params: tuple[int, ...]) -> tuple:
    """:func:`~.page_readers.group_fields` of the inner codes, then ``head`` uint8 ``[capacity, 1]``
    (each sealed page's KV head) and ``signs`` int8 ``[kv_heads, dim]``."""
    *inner, head, signs = tensors
    return (*group_fields(tuple(inner), params), host_array(head), host_array(signs))


@numba.njit(fastmath=FASTMATH)
def rotate_back(fields, page, out, rows) -> None:  # pragma: no cover - compiled
    """Sealed ``page`` decoded into ``out``'s first ``rows`` rows in the model's basis (the inner
    codes, then each row rotated back with the signs of the page's own head)."""
    codes, scale, minimum, kind, bits, per_channel, group, head, signs = fields
    decode_page_groups(codes, scale, minimum, kind, bits, per_channel, group, page, out, rows)
    h = head[page, 0]
    dim = out.shape[1]
    norm = np.float32(dim**-0.5)
    for t in range(rows):
        butterflies(out[t])
        for c in range(dim):
            out[t, c] = (out[t, c] * norm) * np.float32(signs[h, c])


@numba.njit(fastmath=FASTMATH)
def rotated_work(fields, query, head):  # pragma: no cover - compiled
    """Rows ``[0, rows)``: ``R_h q`` of each query row (``q . R_h^T y = (R_h q) . y``); then the
    group reader's work."""
    signs = fields[8]
    rows, dim = query.shape
    work = np.empty((2 * rows + 2, dim), dtype=np.float32)
    norm = np.float32(dim**-0.5)
    for r in range(rows):
        row = work[r]
        for c in range(dim):
            row[c] = query[r, c] * np.float32(signs[head, c])
        butterflies(row)
        for c in range(dim):
            row[c] *= norm
    return work


@numba.njit(fastmath=FASTMATH)
def rotated_key_scores(fields, page, head, query, work, filled, scores, scratch) -> None:  # pragma: no cover - compiled
    """Scores of rotated keys: the rotated query against the page's codes (the group reader); a
    page stored for another head than the one read is rotated back first."""
    rows = query.shape[0]
    if fields[7][page, 0] == head:
        group_key_scores(fields[:7], page, head, work[:rows], work[rows:], filled, scores, scratch)
    else:
        rotate_back(fields, page, scratch, filled)
        float_scores(query, scratch, filled, scores)


@numba.njit
def rotated_state(fields, rows, value_dim):  # pragma: no cover - compiled
    """The weighted sum of the values in the rotated basis, ``[rows, value_dim]``."""
    return np.zeros((rows, value_dim), dtype=np.float32)


@numba.njit(fastmath=FASTMATH)
def rotated_accumulate(fields, page, head, weights, filled, acc, state, scratch) -> None:  # pragma: no cover - compiled
    """Rotated values added in the rotated basis (``state``), or rotated back first for a page
    stored for another head."""
    if fields[7][page, 0] == head:
        group_accumulate(fields[:7], page, head, weights, filled, state, state, scratch)
    else:
        rotate_back(fields, page, scratch, filled)
        float_accumulate(weights, scratch, filled, acc)


@numba.njit(fastmath=FASTMATH)
def rotated_finish(fields, acc, state, head) -> None:  # pragma: no cover - compiled
    """``acc += R_h^T state`` row by row (``D_h H y / sqrt(d)``): the rotation undone once."""
    signs = fields[8]
    dim = state.shape[1]
    norm = np.float32(dim**-0.5)
    for r in range(state.shape[0]):
        row = state[r]
        butterflies(row)
        for c in range(dim):
            acc[r, c] += (row[c] * norm) * np.float32(signs[head, c])


ROTATED = register_numba_reader(
    "rotated", NumbaReader(rotated_fields, rotated_work, rotated_key_scores, rotated_state, rotated_accumulate, rotated_finish)
)
"""The numba reader of :class:`RotatedQuantizer` pages."""
