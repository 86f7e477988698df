"""The page codec contract: how sealed pages of one layer are stored.

A page is *sealed* once it is full and its layer's attention has run over it; only then is it
encoded. Open pages (each head's last, partly filled page) stay in the compute dtype: that is
KIVI's full-precision residual window, given by the paging. A sealed page is immutable and
always full (``page_size`` tokens).

A :class:`PageCodec` pairs a :class:`TensorCodec` for keys with one for values. A tensor codec
turns blocks ``[pages, page_size, dim]`` into fixed-size per-page *fields* (packed codes,
scales, coefficients) and back. Every field has the same shape for every page of the layer, so
a pool stores each field as one arena ``[capacity, *shape]``: the bytes held are real and equal
``sealed pages * sum(field bytes)``, which :meth:`PageCodec.page_bytes` states.

Fitted codecs (low-rank bases, pruned channels) learn from a layer's first attention call
(:class:`FitSample`); until :attr:`TensorCodec.ready` they cannot encode, and the layer's full
pages wait open. Per-layer state they learn (bases) is reported by :meth:`TensorCodec.state_bytes`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.kernel_readers import KernelReader


@dataclass(frozen=True)
class Field:
    """One per-page field of an encoded page: ``shape`` per page, ``dtype``, and whether it is
    codec metadata (scales, zero points: ``metadata=True``) or payload (codes, coefficients)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    metadata: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of this field in one page."""
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


def arena_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a field's arena is held in: one-byte floats (float8) as uint8 bytes, viewed back
    on read (torch's index kernels do not take float8); every other dtype as it is."""
    return torch.uint8 if dtype.is_floating_point and dtype.itemsize == 1 else dtype


@dataclass(frozen=True)
class TensorShape:
    """What a tensor codec encodes: blocks ``[pages, page_size, dim]`` of one layer's keys or
    values in ``dtype`` (the compute dtype), for ``kv_heads`` heads, on ``device``."""

    layer_idx: int
    num_layers: int
    kv_heads: int
    page_size: int
    dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class FitSample:
    """A layer's first attention call, for codecs that fit to data.

    ``keys`` ``[batch, kv_heads, tokens, head_dim]`` and ``values`` (after RoPE, as stored),
    ``valid`` bool ``[batch, kv_heads, tokens]`` (False for padding), ``queries``
    ``[batch, query_heads, q_len, head_dim]`` of the call (after RoPE), ``query_valid`` bool
    ``[batch, q_len]`` (False for padding queries).
    """

    layer_idx: int
    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    queries: torch.Tensor
    query_valid: torch.Tensor


class TensorCodec(abc.ABC):
    """Encodes one stored tensor (keys or values) of a layer's sealed pages.

    Invariant: ``decode(encode(x, heads), heads)`` has ``x``'s shape and the compute dtype;
    ``encode`` returns exactly the tensors :attr:`fields` names, each ``[pages, *field.shape]``.
    """

    learns: bool = False
    """Whether the codec fits to data (:meth:`observe`) before it is :attr:`ready`."""

    def __init__(self, shape: TensorShape) -> None:
        self.shape = shape

    @property
    @abc.abstractmethod
    def fields(self) -> dict[str, Field]:
        """Per-page fields, by name."""

    @abc.abstractmethod
    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode ``block [pages, page_size, dim]``; ``heads`` int64 ``[pages]`` (each page's KV head)."""

    @abc.abstractmethod
    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        """Decode fields of ``pages`` pages back to ``[pages, page_size, dim]`` in the compute dtype."""

    def decode_into(
        self, arenas: dict[str, torch.Tensor], pages: torch.Tensor, heads: torch.Tensor, out: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Decode arena rows ``pages`` (int64, CPU) into ``out[rows]`` (``out`` ``[m, page_size, dim]``
        contiguous, the compute dtype or float32; ``rows`` int64 on the CPU). ``arenas`` hold each field for
        every page of the pool (``[capacity, *shape]``; one-byte float fields as uint8 bytes, which
        torch's index kernels take on every device). Default: gather, :meth:`decode`, copy;
        codecs with fused kernels override it to skip the copies."""
        index = pages.to(out.device, non_blocking=True)
        fields = self.fields
        encoded = {name: arena.index_select(0, index).view(fields[name].dtype) for name, arena in arenas.items()}
        out.index_copy_(0, rows.to(out.device, non_blocking=True), self.decode(encoded, heads).to(out.dtype))

    def kernel_reader(self, arenas: dict[str, torch.Tensor]) -> KernelReader | None:
        """How the paged kernels read sealed pages of this codec where they lie, from the pool's
        field ``arenas`` (on the pool's device, as :meth:`decode_into` takes them; no copy): the
        name of a reader registered in :mod:`kvlib.kernels.page_readers`, the tensors it reads and
        its int parameters (:class:`~kvlib.kernel_readers.KernelReader`). None where it cannot be
        read in place (the layer is then read through :meth:`decode_into`). Default: None."""
        return None

    @property
    def ready(self) -> bool:
        """Whether the codec can encode (fitted codecs: once their fit has run)."""
        return True

    def observe(self, sample: FitSample, part: str) -> None:
        """Learn from a layer's first call; ``part`` is ``"keys"`` or ``"values"``. Default: nothing."""

    def state_bytes(self) -> int:
        """Bytes of per-layer state this codec holds (bases, channel lists); counted once per layer."""
        return 0


class IdentityCodec(TensorCodec):
    """Stores the tensor as it is, in the compute dtype (for the side a codec leaves alone)."""

    @property
    def fields(self) -> dict[str, Field]:
        return {"data": Field((self.shape.page_size, self.shape.dim), self.shape.dtype)}

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"data": block}

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        return encoded["data"]

    def kernel_reader(self, arenas: dict[str, torch.Tensor]) -> KernelReader:
        """``"plain"``: the stored tensor widened to float32 inside the paged kernel."""
        return KernelReader("plain", (arenas["data"],), ())


class PageCodec:
    """The codec of one layer's sealed pages: one tensor codec for keys, one for values.

    Field names are prefixed ``key.`` and ``value.``.
    """

    uses_salience: bool = False
    """Whether :meth:`encode` spends bits by token salience: the cache then hands it each sealed
    page's per-token scores (see :meth:`encode`); a plain codec ignores them."""

    def __init__(self, key: TensorCodec, value: TensorCodec, name: str) -> None:
        self.key = key
        self.value = value
        self.name = name

    @property
    def fields(self) -> dict[str, Field]:
        """Per-page fields of keys and values (known once :attr:`ready`)."""
        return {f"key.{n}": f for n, f in self.key.fields.items()} | {f"value.{n}": f for n, f in self.value.fields.items()}

    @property
    def ready(self) -> bool:
        return self.key.ready and self.value.ready

    @property
    def learns(self) -> bool:
        """Whether either tensor codec fits to a layer's first calls (see :class:`FitSample`)."""
        return self.key.learns or self.value.learns

    def observe(self, sample: FitSample) -> None:
        """Hand a layer's first call to both tensor codecs (fitted codecs learn from it)."""
        self.key.observe(sample, "keys")
        self.value.observe(sample, "values")

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, heads: torch.Tensor, salience: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Fields of pages ``keys [n, page_size, head_dim]``, ``values [n, page_size, value_dim]``;
        ``salience`` float ``[n, page_size]`` (higher: more salient; None where no scorer ran) is
        read by codecs that :attr:`uses_salience` only."""
        encoded = {f"key.{n}": t for n, t in self.key.encode(keys, heads).items()}
        encoded.update({f"value.{n}": t for n, t in self.value.encode(values, heads).items()})
        return encoded

    def decode_into(
        self,
        arenas: dict[str, torch.Tensor],
        pages: torch.Tensor,
        heads: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Decode arena rows ``pages`` into ``keys[rows]`` and ``values[rows]`` (see :meth:`TensorCodec.decode_into`)."""
        self.key.decode_into({n[4:]: t for n, t in arenas.items() if n.startswith("key.")}, pages, heads, keys, rows)
        self.value.decode_into({n[6:]: t for n, t in arenas.items() if n.startswith("value.")}, pages, heads, values, rows)

    def kernel_readers(self, arenas: dict[str, torch.Tensor]) -> tuple[KernelReader, KernelReader] | None:
        """``(keys, values)`` readers of the pool's field ``arenas`` for the paged kernels (see
        :meth:`TensorCodec.kernel_reader`), or None unless both tensor codecs have one."""
        key = self.key.kernel_reader({n[4:]: t for n, t in arenas.items() if n.startswith("key.")})
        value = self.value.kernel_reader({n[6:]: t for n, t in arenas.items() if n.startswith("value.")})
        return None if key is None or value is None else (key, value)

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of the pages whose fields are ``encoded``."""
        keys = self.key.decode({n[4:]: t for n, t in encoded.items() if n.startswith("key.")}, heads)
        values = self.value.decode({n[6:]: t for n, t in encoded.items() if n.startswith("value.")}, heads)
        return keys, values

    def page_bytes(self, metadata: bool | None = None) -> int:
        """Bytes one sealed page holds: all fields, or only metadata (True) or payload (False)."""
        return sum(f.nbytes for f in self.fields.values() if metadata is None or f.metadata == metadata)

    def state_bytes(self) -> int:
        return self.key.state_bytes() + self.value.state_bytes()


def layer_shapes(
    num_layers: int,
    kv_heads: int | Sequence[int],
    head_dim: int | Sequence[int],
    value_dim: int | Sequence[int],
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[TensorShape, TensorShape]]:
    """``(key shape, value shape)`` of every layer: ``kv_heads``, ``head_dim`` and ``value_dim``
    each one int for every layer or one per layer."""
    heads, keys, values = (_per_layer(sizes, num_layers) for sizes in (kv_heads, head_dim, value_dim))
    return [
        (
            TensorShape(layer, num_layers, heads[layer], page_size, keys[layer], dtype, device),
            TensorShape(layer, num_layers, heads[layer], page_size, values[layer], dtype, device),
        )
        for layer in range(num_layers)
    ]


def _per_layer(sizes: int | Sequence[int], num_layers: int) -> list[int]:
    return [sizes] * num_layers if isinstance(sizes, int) else list(sizes)


class Codec(abc.ABC):
    """A policy that stores sealed pages through codecs (quantization and low-rank kinds).

    ``fits_each_prompt``: whether its per-layer codecs learn from each cache's first calls (a
    basis, kept channels), so that pages of different prompts cannot share them (the Engine's
    pages, a prefix store's).

    ``check_shape`` raises ``ValueError`` before any model work if the codec cannot serve a
    layout; ``layer_codecs`` builds one :class:`PageCodec` per layer (codecs of different layers
    may share state, as cross-layer bases do).
    """

    fits_each_prompt: ClassVar[bool] = False

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        """``ValueError`` if this codec cannot encode these (key, value) shapes. Default: any."""

    @abc.abstractmethod
    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec | None]:
        """One codec per layer, for ``shapes[layer] = (key shape, value shape)``; None keeps a
        layer in the compute dtype. A codec with a ``partner_layer`` attribute is the deeper
        layer of a cross-layer pair (see :class:`~kvlib.storage.pools.formats.partnered_format.PartneredPages`)."""
