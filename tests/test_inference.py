import pytest
import torch

from helpers import inference, tables
from helpers.inference import num_threads


def test_num_threads_sets_and_restores():
    before = torch.get_num_threads()
    with num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with num_threads(None):
        assert torch.get_num_threads() == before


def test_num_threads_restores_after_an_error_and_after_changes_inside():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"):
        with num_threads(1):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with num_threads(None):
        torch.set_num_threads(1)  # what a timed run may do; the block's end puts the old count back
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_num_threads_rejects_bad_counts_before_changing_anything(bad):
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="threads must be a positive int or None"):
        with num_threads(bad):
            pass
    assert torch.get_num_threads() == before


def test_format_table_is_the_one_in_helpers_tables():
    assert inference.format_table is tables.format_table
