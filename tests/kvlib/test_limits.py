"""Bounds on user-given sizes (kvlib.limits), the memory check (kvlib.devices) and how errors
quote what they were given (kvlib.errors)."""

from __future__ import annotations

import os

import pytest
import torch

from kvlib.devices import available_bytes, check_fits
from kvlib.errors import ECHO_CHARS, cut, quoted
from kvlib.limits import MAX_PAGE_SIZE, check_page_size

CPU = torch.device("cpu")


def test_page_size_is_an_int_up_to_the_limit() -> None:
    assert check_page_size(1) == 1 and check_page_size(MAX_PAGE_SIZE) == MAX_PAGE_SIZE
    with pytest.raises(ValueError, match=rf"page_size={MAX_PAGE_SIZE + 1} is over the limit of {MAX_PAGE_SIZE} tokens per page"):
        check_page_size(MAX_PAGE_SIZE + 1)
    for bad in (0, True, 16.0, "16"):
        with pytest.raises(ValueError, match=r"page_size must be an int >= 1 \(tokens per page\)"):
            check_page_size(bad)


def test_host_memory_available_is_positive_and_within_physical_memory() -> None:
    available = available_bytes(CPU)
    assert 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert available_bytes(torch.device("meta")) is None  # a device kvlib cannot ask: nothing checked


def test_check_fits_names_what_would_be_allocated_and_what_is_available() -> None:
    check_fits("a small arena", 1, CPU)
    check_fits("anything", 2**70, torch.device("meta"))
    with pytest.raises(
        ValueError,
        match=r"^a huge arena would allocate 1180591620717411303424 bytes \(1.1e\+12 GiB\) on cpu up"
        r" front, more than the \d+ bytes \(.* GiB\) available there: lower it$",
    ):
        check_fits("a huge arena", 2**70, CPU)


def test_messages_cut_what_they_echo() -> None:
    assert quoted("snapkv") == "'snapkv'" and cut("short") == "short"
    long = quoted("x" * 100_000)
    assert len(long) == ECHO_CHARS and long.startswith("'xxx") and long.endswith("x...")
