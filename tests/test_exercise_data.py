"""The Windows exercise gives each kind of mistake its own hint."""

import pytest
import torch
from torch.utils.data import Dataset

from helpers.exercises.data import check_windows


class AllPositions(Dataset):  # len(series) windows: the last ones run past the end
    def __init__(self, series, length):
        self.series, self.length = series, length

    def __len__(self):
        return len(self.series)

    def __getitem__(self, i):
        return self.series[i : i + self.length], self.series[i + self.length]


class OneTooMany(AllPositions):  # len(series) - length + 1: the last target lies past the end
    def __len__(self):
        return len(self.series) - self.length + 1


class TargetInsideTheWindow(AllPositions):  # the window's last value as its target
    def __len__(self):
        return len(self.series) - self.length

    def __getitem__(self, i):
        return self.series[i : i + self.length], self.series[i + self.length - 1]


class WindowOneTooLong(TargetInsideTheWindow):  # the window takes the target in too
    def __getitem__(self, i):
        return self.series[i : i + self.length + 1], self.series[i + self.length]


class AsLists(TargetInsideTheWindow):  # Python lists: the default collate_fn cannot stack them into a batch
    def __getitem__(self, i):
        return self.series[i : i + self.length].tolist(), self.series[i + self.length].item()


class EveryWindowFromZero(TargetInsideTheWindow):  # ignores i: always the first window
    def __getitem__(self, i):
        return self.series[: self.length], self.series[self.length]


class WindowOnly(TargetInsideTheWindow):  # forgets the target
    def __getitem__(self, i):
        return self.series[i : i + self.length]


class NormalisesInPlace(TargetInsideTheWindow):  # scales the caller's series in place
    def __init__(self, series, length):
        super().__init__(series.sub_(series.min()) if series.is_floating_point() else series, length)

    def __getitem__(self, i):
        return self.series[i : i + self.length], self.series[i + self.length]


class TargetAsASlice(TargetInsideTheWindow):  # series[i + length : i + length + 1]: a batch of targets [N, 1]
    def __getitem__(self, i):
        return self.series[i : i + self.length], self.series[i + self.length : i + self.length + 1]


class TargetOneTooFar(TargetInsideTheWindow):  # one step too far: the value after the next one
    def __getitem__(self, i):
        return self.series[i : i + self.length], self.series[i + self.length + 1]


class AsFloat32(Dataset):  # "models want floats": the integer series' values cast on the way out
    def __init__(self, series, length):
        self.series, self.length = series.float(), length

    def __len__(self):
        return len(self.series) - self.length

    def __getitem__(self, i):
        return self.series[i : i + self.length], self.series[i + self.length]


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (AllPositions, r"len\(dataset\) is 50, not len\(series\) - length = 42"),
    (OneTooMany, "one window too many"),
    (TargetInsideTheWindow, "the window's own last value"),
    (WindowOneTooLong, r"window has shape \(9,\), not \(8,\)"),
    (AsLists, "return tensors"),
    (EveryWindowFromZero, r"window is not series\[1 : 9\]"),
    (WindowOnly, r"a sample must be a pair \(window, target\)"),
    (NormalisesInPlace, "the series was changed"),
    (AsFloat32, "came out as torch.float32 and torch.float32, but the series is torch.int64"),
    (TargetAsASlice, r"target must be the single value series\[8\]"),
    (TargetOneTooFar, r"sample 0's target must be the single value series\[8\]"),
]


class WithUnfold(Dataset):  # every window at once, as a view: series.unfold(0, length, 1)
    def __init__(self, series, length):
        self.windows, self.targets = series[:-1].unfold(0, length, 1), series[length:]

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.windows[i], self.targets[i]


class PlainClass:  # no Dataset base class: __len__ and __getitem__ are the whole protocol
    def __init__(self, series, length):
        self.pairs = [(series[i : i + length], series[i + length]) for i in range(len(series) - length)]

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


RIGHT = [WithUnfold, PlainClass]


@pytest.mark.parametrize("wrong, hint", WRONG, ids=lambda v: getattr(v, "__name__", "hint"))
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        check_windows.check(wrong)


@pytest.mark.parametrize("right", RIGHT, ids=lambda v: v.__name__)
def test_other_right_answers_pass(right):
    assert check_windows.check(right).startswith("✓ ")


def test_the_reference_batches_windows_and_next_values():
    windows, targets = next(
        iter(torch.utils.data.DataLoader(check_windows.reference(torch.arange(10), 3), batch_size=2))
    )
    assert windows.tolist() == [[0, 1, 2], [1, 2, 3]]
    assert targets.tolist() == [3, 4]
