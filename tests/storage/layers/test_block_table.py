"""The block table's numpy views stay views of its own tensors, through copies too."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import torch

from kvlib.storage.layers.block_table import BlockTable

MIRRORED = ("pages", "lengths", "logical", "sealed")


def assert_views_of_own_tensors(table: BlockTable) -> None:
    for name in MIRRORED:
        tensor, view = getattr(table, name), getattr(table, name + "_np")
        assert view.ctypes.data == tensor.data_ptr() and view.shape == tuple(tensor.shape)


def test_views_follow_growth_and_assignment():
    table = BlockTable(num_heads=2, page_size=4)
    table.ensure_rows(5)
    table.ensure_pages(3)
    table.lengths = torch.ones(5, 2, dtype=torch.int64)
    assert_views_of_own_tensors(table)
    table.pages_np[1, 0, 2] = 7  # a write through the view is a write to the tensor
    assert int(table.pages[1, 0, 2]) == 7


def test_a_copy_has_views_of_its_own_memory():
    """``copy.deepcopy`` (as a model's generate may do to its cache) and pickling: the copy's
    numpy views name the copy's tensors, so a write through one reaches the other and never the original."""
    table = BlockTable(num_heads=2, page_size=4, rows=2, max_pages=2)
    table.pages_np[0, 1, 1] = 3
    table.advance(np.array([0]), 5, 5)
    for clone in (copy.deepcopy(table), pickle.loads(pickle.dumps(table))):
        assert_views_of_own_tensors(clone)
        assert torch.equal(clone.pages, table.pages) and torch.equal(clone.lengths, table.lengths)
        clone.pages_np[0, 1, 1] = 9
        clone.advance(np.array([0]), 1, 1)
        assert int(clone.pages[0, 1, 1]) == 9 and int(table.pages[0, 1, 1]) == 3
        assert clone.lengths[0].tolist() == [6, 6] and table.lengths[0].tolist() == [5, 5]
