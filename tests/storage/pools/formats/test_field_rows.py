"""A codec's fields pack into a page's two byte rows and read back as views, bit for bit: key
fields in the key row, the rest in the value row, each field aligned to its item size."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.codec import Field
from kvlib.storage.pools.formats.field_rows import ROW_ALIGN, FieldRows

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn]

fields = st.dictionaries(
    st.tuples(st.sampled_from(["key.", "value."]), st.sampled_from(["codes", "scale", "minimum", "index"])).map("".join),
    st.builds(
        Field,
        st.lists(st.integers(1, 5), min_size=1, max_size=2).map(tuple),
        st.sampled_from(DTYPES),
        st.booleans(),
    ),
    min_size=1,
)


def random_field(field: Field, pages: int, generator: torch.Generator) -> torch.Tensor:
    """Random bytes of ``pages`` pages of ``field`` seen as its dtype (any bit pattern)."""
    count = pages * field.nbytes
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator).view(field.dtype).view(pages, *field.shape)


@settings(max_examples=60, deadline=None)
@given(fields=fields, pages=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_fields_pack_into_aligned_rows_and_read_back_bit_for_bit(fields: dict[str, Field], pages: int, seed: int) -> None:
    rows = FieldRows.of(fields)
    assert rows.key_bytes % ROW_ALIGN == 0 and rows.value_bytes % ROW_ALIGN == 0
    for name, (row, offset) in rows.places.items():
        assert row == (0 if name.startswith("key.") else 1)
        assert offset % fields[name].dtype.itemsize == 0
    generator = torch.Generator().manual_seed(seed)
    encoded = {name: random_field(field, pages, generator) for name, field in fields.items()}
    key_rows, value_rows = rows.pack(encoded)
    assert key_rows.shape == (pages, 1, rows.key_bytes) and value_rows.shape == (pages, 1, rows.value_bytes)
    views = rows.views(key_rows, value_rows)
    for name, tensor in encoded.items():
        view = views[name]
        assert view.data_ptr() >= min(key_rows.data_ptr(), value_rows.data_ptr())  # a view of the rows, no copy
        assert torch.equal(view.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8))


def test_pack_refuses_other_fields() -> None:
    rows = FieldRows.of({"key.codes": Field((4,), torch.uint8)})
    with pytest.raises(ValueError, match="differ from the codec's"):
        rows.pack({"key.other": torch.zeros(1, 4, dtype=torch.uint8)})
