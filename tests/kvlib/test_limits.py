"""Bounds on user-given sizes (kvlib.limits), the memory check (kvlib.devices) and how errors
quote what they were given (kvlib.errors)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from kvlib.devices import available_bytes, check_fits
from kvlib.errors import ECHO_CHARS, cut, quoted
from kvlib.limits import MAX_PAGE_SIZE, MAX_REQUEST_TOKENS, check_page_size, check_request_tokens, check_seed, read_bounded

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


def test_files_are_read_only_when_regular_and_within_their_bound(tmp_path) -> None:
    small = tmp_path / "small.txt"
    small.write_bytes(b"12345")
    assert read_bounded(small, 5, "text") == b"12345"
    with pytest.raises(ValueError, match=re.escape(f"text {quoted(str(small))} holds more than 4 bytes, the most a text may hold")):
        read_bounded(small, 4, "text")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", fifo, tmp_path):
        with pytest.raises(ValueError, match=re.escape(f"text {quoted(str(path))} is not a regular file")):
            read_bounded(path, 2**30, "text")
    with pytest.raises(ValueError, match=re.escape(f"cannot read text {quoted(str(tmp_path / 'missing'))}: No such file")):
        read_bounded(tmp_path / "missing", 10, "text")


def test_requests_are_bounded_by_the_context_or_the_request_limit() -> None:
    check_request_tokens(500, 12, 512)
    with pytest.raises(ValueError, match=r"a request of 500 prompt \+ 13 new tokens is longer than the model's context of 512 tokens"):
        check_request_tokens(500, 13, 512)
    check_request_tokens(MAX_REQUEST_TOKENS - 1, 1, None)
    with pytest.raises(ValueError, match=f"longer than the limit of {MAX_REQUEST_TOKENS} tokens"):
        check_request_tokens(MAX_REQUEST_TOKENS, 1, None)


def test_seeds_are_none_or_ints_in_range() -> None:
    for seed in (None, 0, 2**63 - 1):
        check_seed(seed)
    for seed in (-1, 2**63, 2**80, "abc", True, 1.5):
        with pytest.raises(ValueError, match=r"seed must be None or an int in \[0, 2\*\*63\)"):
            check_seed(seed)
