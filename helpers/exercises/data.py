"""Dataset & DataLoader: write `Windows(series, length)`, a map-style Dataset of sliding windows over a series and
the value that follows each, which a default DataLoader batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from . import exercise


class reference_windows(Dataset):  # a class: the learner writes a Dataset
    """Sample i: the window series[i : i + length] and its target, the next value series[i + length]."""

    def __init__(self, series: torch.Tensor, length: int) -> None:
        self.series, self.length = series, length

    def __len__(self) -> int:
        return len(self.series) - self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.series[index : index + self.length], self.series[index + self.length]


def _sample(dataset: Any, index: int, what: str) -> tuple[Any, Any]:
    try:
        sample = dataset[index]
    except IndexError:
        raise AssertionError(
            f"hint: {what}: dataset[{index}] raised IndexError though {index} < len(dataset) = {len(dataset)}: the "
            "last window's target must still lie in the series, so there are len(series) - length samples"
        ) from None
    assert isinstance(sample, tuple) and len(sample) == 2, (
        f"hint: {what}: a sample must be a pair (window, target), got {type(sample).__name__}"
    )
    return sample


def _check_one(Windows: Callable[..., Any], series: torch.Tensor, length: int, what: str) -> None:
    dataset = Windows(series, length)
    expected = len(series) - length
    assert len(dataset) == expected, (
        f"hint: {what}: len(dataset) is {len(dataset)}, not len(series) - length = {expected}: a window of {length} "
        f"needs one more value after it, its target"
        + (" (one window too many: the last one's target would lie past the end)" if len(dataset) > expected else "")
    )
    for index in sorted({0, 1, expected // 2, expected - 1} & set(range(expected))):
        window, target = _sample(dataset, index, what)
        assert isinstance(window, torch.Tensor) and isinstance(target, torch.Tensor), (
            f"hint: {what}: return tensors (slices of series), got {type(window).__name__} and "
            f"{type(target).__name__}: the default collate_fn stacks tensors into a batch"
        )
        assert window.shape == (length,), (
            f"hint: {what}: sample {index}'s window has shape {tuple(window.shape)}, not ({length},): "
            "series[i : i + length] holds length values"
        )
        assert window.dtype == series.dtype and target.dtype == series.dtype, (
            f"hint: {what}: sample {index} came out as {window.dtype} and {target.dtype}, but the series is "
            f"{series.dtype}: a Dataset hands its data over as it is (torch.equal compares values, not dtypes: "
            "100000001 in float32 is 100000000); convert in the model, or with a transform the caller asks for"
        )
        assert torch.equal(window, series[index : index + length]), (
            f"hint: {what}: sample {index}'s window is not series[{index} : {index + length}]: sample i starts at i"
        )
        if torch.equal(target, series[index + length - 1]):
            raise AssertionError(
                f"hint: {what}: sample {index}'s target is the window's own last value: the target is the value "
                "after the window, series[i + length]"
            )
        assert target.shape == () and torch.equal(target, series[index + length]), (
            f"hint: {what}: sample {index}'s target must be the single value series[{index + length}]"
        )
    windows, targets = next(iter(DataLoader(dataset, batch_size=4)))
    assert windows.shape == (min(4, expected), length) and targets.shape == (min(4, expected),), (
        f"hint: {what}: a DataLoader batch of 4 came out as {tuple(windows.shape)} and {tuple(targets.shape)}"
    )


@exercise("Windows", reference=reference_windows)
def check_windows(Windows: Callable[..., Any]) -> str:
    """Windows(series, length) on three series (floats, integers, a window as long as all but one value): its
    length, the first, middle and last samples, and a default DataLoader's batch."""
    generator = torch.Generator().manual_seed(0)
    cases = [
        (torch.randn(50, generator=generator), 8, "a series of 50 floats, windows of 8"),
        (torch.arange(100, 130), 5, "the integers 100..129, windows of 5"),
        (torch.randn(7, generator=generator), 6, "a series of 7 values, windows of 6 (one sample)"),
    ]
    for series, length, what in cases:
        given = series.clone()
        _check_one(Windows, series, length, what)
        assert torch.equal(series, given), f"hint: {what}: the series was changed: a Dataset only reads its data"
    return "✓ Windows gave len(series) - length (window, next value) pairs, and a DataLoader batched them"
