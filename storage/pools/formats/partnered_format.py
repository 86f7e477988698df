"""The partnered page format: a coded pool whose sealed pages each lean on a *partner* page of another layer's pool.

Cross-layer codecs (MiniCache) store what two layers share once: the shallower layer's sealed
page holds the shared part (merged directions), the deeper layer's page holds the rest
(magnitudes, tokens kept unmerged) and the id of its partner page in the shallower pool. Decoding
a deep page reads its partner's fields.

Invariants (beside :class:`~kvlib.storage.pools.formats.coded_format.CodedPages`'): a sealed page of this
pool has a partner page in ``partner_pool`` (``partner[page] >= 0``), on which it holds one
reference, so the partner outlives it whatever the shallower layer's table does (eviction,
truncation, release); the reference is returned when the page is freed. Open pages have no
partner. ``partner_pool``'s reference counts therefore count table references plus partner
references.
"""

from __future__ import annotations

import torch

from kvlib.codec import PageCodec
from kvlib.devices import to_arena_device
from kvlib.storage.pools.formats.coded_format import CodedPages
from kvlib.storage.pools.formats.page_format import extend_rows
from kvlib.storage.pools.page_indexing import first_occurrences
from kvlib.storage.pools.page_pool import PagePool

PARTNER_ID_BYTES = 8
"""Bytes of the partner page id each sealed page holds (int64), counted as codec metadata."""


class PartneredPages(CodedPages):
    """The format of the deeper layer's pool of a cross-layer codec (see the module docstring):
    ``partner_pool`` is the shallower layer's pool (a coded one).

    ``codec`` must implement ``decode_with_partner(own, partner, heads) -> (keys, values)``
    (``own``/``partner``: field dicts of the pages and of their partners).
    """

    def __init__(self, codec: PageCodec, partner_pool: PagePool) -> None:
        super().__init__(codec)
        self.partner_pool = partner_pool

    @property
    def partner_layer(self) -> int:
        """The layer of ``partner_pool`` (the codec's ``partner_layer``)."""
        return self.codec.partner_layer

    @property
    def seals(self) -> bool:
        """Pairs are sealed whenever both pages are full and open (the codec fits on the pair)."""
        return True

    def create(self, capacity: int) -> None:
        super().create(capacity)
        self.partner = torch.full((capacity,), -1, dtype=torch.int64)

    def grow(self, capacity: int) -> None:
        super().grow(capacity)
        self.partner = extend_rows(self.partner, capacity, -1)

    def page_source(self) -> None:
        """None: a sealed page decodes with its partner's fields (attention reads through :meth:`read_pages`)."""
        return None

    def metadata_bytes(self) -> int:
        return super().metadata_bytes() + self.sealed_pages * PARTNER_ID_BYTES

    def freed(self, ids: torch.Tensor) -> None:
        partners = self.partner[ids]
        self.partner[ids] = -1
        super().freed(ids)
        self.partner_pool.decref(partners[partners >= 0])

    def copy(self, source: torch.Tensor, target: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        super().copy(source, target, src, dst)
        partners = self.partner[source]
        self.partner[target] = partners
        self.partner_pool.incref(partners[partners >= 0])

    def seal_full_pages(self, ids: torch.Tensor, partner_ids: torch.Tensor | None, salience: torch.Tensor | None) -> int:
        """Seal full pages ``ids`` together with the pages ``partner_ids`` of the partner pool that
        hold the same tokens (same positions, both open); each pair is encoded by the codec at
        once. A page pairs with one partner only; pages without such a partner stay open.
        Returns the pairs sealed. Cross-layer codecs read no ``salience``."""
        open_pair = ~self.sealed[ids] & ~self.partner_pool.sealed[partner_ids]
        ids, partner_ids = ids[open_pair], partner_ids[open_pair]
        if ids.numel() == 0:
            return 0
        same = (
            self.pool.positions[to_arena_device(ids, self.device)] == self.partner_pool.positions[to_arena_device(partner_ids, self.device)]
        ).all(-1)
        ids, partner_ids = ids[same.cpu()], partner_ids[same.cpu()]
        _, first = first_occurrences(ids)
        ids, partner_ids = ids[first], partner_ids[first]
        _, first = first_occurrences(partner_ids)  # a page pairs with one partner only
        ids, partner_ids = ids[first], partner_ids[first]
        if ids.numel() == 0:
            return 0
        shallow_fields, deep_fields = self.codec.merge(self.partner_pool.raw_pages(partner_ids), self.raw_pages(ids))
        self.partner_pool.seal(partner_ids, shallow_fields)
        self.seal_pairs(ids, partner_ids, deep_fields)
        return int(ids.numel())

    def seal_pairs(self, ids: torch.Tensor, partners: torch.Tensor, encoded: dict[str, torch.Tensor]) -> None:
        """Seal open pages ``ids`` with their fields ``encoded``, each leaning on page ``partners[i]``
        of the partner pool (sealed there by the caller), on which it takes a reference."""
        self.seal(ids, encoded)
        self.partner[ids] = partners
        self.partner_pool.incref(partners)

    def _decode_sealed(
        self, pages: torch.Tensor, heads: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor
    ) -> None:
        index = to_arena_device(pages, self.device)
        partner_index = to_arena_device(self.partner[pages], self.device)
        own = {name: t.index_select(0, index) for name, t in self.encoded.items()}
        partner = {name: t.index_select(0, partner_index) for name, t in self.partner_pool.encoded.items()}
        decoded_keys, decoded_values = self.codec.decode_with_partner(own, partner, heads)
        target = to_arena_device(rows, self.device)
        keys.index_copy_(0, target, decoded_keys)
        values.index_copy_(0, target, decoded_values)
