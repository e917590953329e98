"""The shared argument checks and the progress-bar rule."""

import io

import pytest
import torch

from helpers.checks import check_choice, check_int, check_positive_number, check_range
from helpers.progress import progress_bar, someone_watches


@pytest.mark.parametrize(
    "value, options, message",
    [
        (0, {}, "n must be a positive int, got 0"),
        (True, {}, "n must be a positive int, got True"),
        (2.0, {}, "n must be a positive int, got 2.0"),
        (-1, {"minimum": 0}, "n must be an int >= 0, got -1"),
        (5, {"maximum": 4}, r"n must be an int in \[1, 4\], got 5"),
        (None, {}, "n must be a positive int, got None"),
        ("3", {"allow_none": True}, "n must be a positive int or None, got '3'"),
    ],
)
def test_check_int_names_the_parameter_and_what_is_allowed(value, options, message):
    with pytest.raises(ValueError, match=message):
        check_int("n", value, **options)


def test_check_int_and_number_accept_what_they_allow():
    check_int("n", 1)
    check_int("n", 0, minimum=0)
    check_int("n", 4, maximum=4)
    check_int("n", None, allow_none=True)
    check_positive_number("lr", 0.1)
    check_positive_number("lr", 3)
    check_positive_number("lr", None, allow_none=True)
    for bad in (0, -1.0, True, "0.1", float("nan")):
        with pytest.raises(ValueError, match="lr must be a positive number"):
            check_positive_number("lr", bad)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_show_on_a_terminal_but_not_in_a_log_or_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not someone_watches()  # a file or a pipe: no bar
    assert progress_bar(range(3)).disable
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert someone_watches()
    bar = progress_bar(range(3), desc="x")
    assert not bar.disable and list(bar) == [0, 1, 2]
    assert progress_bar(range(3), enabled=False).disable
    monkeypatch.setenv("CI", "true")
    assert not someone_watches()


@pytest.mark.parametrize("bad", [None, 3, "digits", object()])
def test_make_loader_and_dataset_wrappers_refuse_what_is_not_a_dataset(bad):
    from helpers.data import RandomShiftDataset, SlowDataset, make_loader

    with pytest.raises(TypeError, match="dataset must be a dataset .* got"):
        make_loader(bad, batch_size=8)
    with pytest.raises(TypeError, match="base must be a dataset"):
        SlowDataset(bad, delay_s=0.0)
    with pytest.raises(TypeError, match="base must be a dataset"):
        RandomShiftDataset(bad)


def test_check_dataset_accepts_datasets_lists_and_iterable_datasets():
    from torch.utils.data import IterableDataset, TensorDataset

    from helpers.checks import check_dataset

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    for good in (TensorDataset(torch.zeros(2, 1)), [(1, 2), (3, 4)], Stream()):
        check_dataset("dataset", good)


def test_check_choice_names_the_parameter_and_the_choices():
    check_choice("strategy", "ddp", ("ddp", "fsdp"))
    for bad in ("DDP", None, 1):
        with pytest.raises(ValueError, match=r"strategy must be one of \['ddp', 'fsdp'\], got"):
            check_choice("strategy", bad, ("ddp", "fsdp"))
    with pytest.raises(ValueError, match="got True"):  # True == 1, but it is not the option 1
        check_choice("n", True, (1, 2))


@pytest.mark.parametrize(
    "value, high_open, ok",
    [
        (0, False, True),
        (1, False, True),
        (1, True, False),
        (0.999, True, True),
        (-0.1, False, False),
        (True, False, False),
        ("0.5", False, False),
        (float("nan"), False, False),
    ],
)
def test_check_range_takes_numbers_between_the_bounds(value, high_open, ok):
    if ok:
        check_range("momentum", value, 0, 1, high_open=high_open)
    else:
        with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1[)\]], got"):
            check_range("momentum", value, 0, 1, high_open=high_open)
