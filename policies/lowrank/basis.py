"""Per-head orthonormal bases fitted by SVD, and the codec that stores coefficients in them
(shared by the low-rank policies; not a policy itself).

For one head, rows ``X [tokens, dim]`` (padding rows zeroed: zero rows change neither the right
singular vectors nor the singular values) factor as ``X = U S V^T``. The basis is the first ``r``
columns of ``V``; a token ``x`` is stored as ``c = x V_r`` and read back as ``c V_r^T``. For the
fitted rows the squared reconstruction error is exactly the discarded energy
``sum_{i > r} s_i^2`` (Eckart-Young).
"""

from __future__ import annotations

import torch

from kvlib.codec import Field, TensorCodec, TensorShape
from kvlib.kernel_readers import KernelReader


def fit_basis(rows: torch.Tensor, rank: int, energy: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Bases of ``rows`` float32 ``[heads, tokens, dim]``: ``(basis [heads, dim, r], singular values [heads, k])``.

    ``r`` is ``rank`` if ``rank > 0``; otherwise the smallest rank keeping at least ``energy`` of
    the squared singular values in every head (one rank per layer: fields have one shape).
    """
    _, singular, vh = torch.linalg.svd(rows, full_matrices=False)
    dim = rows.shape[-1]
    if rank > 0:
        r = min(rank, dim)
    else:
        squared = singular.square()
        kept = squared.cumsum(-1) / squared.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        r = int((kept < energy - 1e-6).sum(-1).max()) + 1
        r = min(r, dim)
    basis = vh.transpose(-1, -2)[..., :r]
    if basis.shape[-1] < r:  # fewer fitted rows than the rank: pad with zero columns
        basis = torch.nn.functional.pad(basis, (0, r - basis.shape[-1]))
    return basis, singular


def enough_rows(valid: torch.Tensor, dim: int) -> bool:
    """Whether every head of ``valid [batch, heads, tokens]`` has at least ``dim`` real tokens to
    fit a basis of ``dim`` channels on (fewer leave directions the basis never saw)."""
    return bool((valid.sum((0, 2)) >= dim).all())


def head_rows(tensor: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``tensor [batch, heads, tokens, dim]`` as float32 ``[heads, batch * tokens, dim]``, invalid rows zeroed."""
    rows = tensor.float() * valid.unsqueeze(-1)
    batch, heads, tokens, dim = rows.shape
    return rows.transpose(0, 1).reshape(heads, batch * tokens, dim)


class BasisCodec(TensorCodec):
    """Stores each token as its coefficients in a per-head basis ``[kv_heads, dim, rank]``.

    Not :attr:`ready` until :meth:`set_basis`. Coefficients are payload in the compute dtype;
    the basis is per-layer state (:meth:`state_bytes`).
    """

    def __init__(self, shape: TensorShape) -> None:
        super().__init__(shape)
        self.basis: torch.Tensor | None = None

    @property
    def ready(self) -> bool:
        return self.basis is not None

    @property
    def rank(self) -> int:
        if self.basis is None:
            raise RuntimeError("the basis is not fitted yet: no rank")
        return self.basis.shape[-1]

    def set_basis(self, basis: torch.Tensor) -> None:
        """Use ``basis`` float ``[kv_heads, dim, rank]`` (orthonormal columns) from now on."""
        self.basis = basis.to(self.shape.device, self.shape.dtype)
        self._fields = {"coefficients": Field((self.shape.page_size, self.rank), self.shape.dtype)}

    @property
    def fields(self) -> dict[str, Field]:
        if self.basis is None:
            raise RuntimeError("the basis is not fitted yet: fields unknown")
        return self._fields

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"coefficients": torch.bmm(block, self.basis[heads])}

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        return self._decoded(encoded["coefficients"], heads).to(self.shape.dtype)

    def decode_into(
        self, arenas: dict[str, torch.Tensor], pages: torch.Tensor, heads: torch.Tensor, out: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Gather the pages' coefficients, take them back to the model's channels in float32 and
        round once, to ``out``'s dtype (what the ``"basis"`` kernel reader computes)."""
        coefficients = arenas["coefficients"].index_select(0, pages.to(out.device, non_blocking=True))
        out.index_copy_(0, rows.to(out.device, non_blocking=True), self._decoded(coefficients, heads).to(out.dtype))

    def _decoded(self, coefficients: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """float32 ``[pages, page_size, dim]``: ``c V_h^T`` of each page's coefficients, in float32."""
        return torch.bmm(coefficients.float(), self.basis[heads.to(self.basis.device)].float().transpose(1, 2))

    def kernel_reader(self, arenas: dict[str, torch.Tensor]) -> KernelReader | None:
        """``"basis"``: keys scored against the query projected into the basis, values summed in it
        and taken back once (:mod:`~kvlib.policies.lowrank.page_readers`); None before the basis
        is fitted. No Triton loader: on CUDA these layers are read densely."""
        if self.basis is None:
            return None
        return KernelReader("basis", (arenas["coefficients"], self.basis.contiguous()), (self.rank,))

    def state_bytes(self) -> int:
        return 0 if self.basis is None else self.basis.numel() * self.basis.element_size()
