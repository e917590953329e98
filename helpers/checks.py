"""Argument checks shared by the helpers: a learner's mistake is named where it is made, not deep inside torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_int(name: str, value: Any, *, minimum: int = 1, maximum: int | None = None, allow_none: bool = False) -> None:
    """Raise a ValueError naming `name` unless `value` is an int in [minimum, maximum] (or None, if allowed)."""
    if allow_none and value is None:
        return
    if (
        not isinstance(value, bool)
        and isinstance(value, int)
        and value >= minimum
        and (maximum is None or value <= maximum)
    ):
        return
    if maximum is not None:
        allowed = f"an int in [{minimum}, {maximum}]"
    else:
        allowed = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    raise ValueError(f"{name} must be {allowed}{' or None' if allow_none else ''}, got {value!r}")


def check_positive_number(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise a ValueError naming `name` unless `value` is an int or float above 0 (or None, if allowed)."""
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number{' or None' if allow_none else ''}, got {value!r}")


def check_choice(name: str, value: Any, options: Sequence[Any]) -> None:
    """Raise a ValueError naming `name` and the allowed values unless `value` is one of `options`."""
    if not any(value == option and type(value) is type(option) for option in options):
        raise ValueError(f"{name} must be one of {list(options)}, got {value!r}")


def check_range(name: str, value: Any, low: float, high: float, *, high_open: bool = False) -> None:
    """Raise a ValueError naming `name` unless `value` is a number in [low, high] (or [low, high), `high_open`)."""
    inside = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value
    if not (inside and (value < high if high_open else value <= high)):
        raise ValueError(f"{name} must be a number in [{low}, {high}{')' if high_open else ']'}, got {value!r}")


def check_dataset(name: str, value: Any) -> None:
    """Raise a TypeError naming `name` unless `value` is a dataset: an IterableDataset, or an object with
    `__getitem__` and `__len__` (a map-style Dataset, a TensorDataset, a list of samples)."""
    from torch.utils.data import IterableDataset

    map_style = hasattr(value, "__getitem__") and hasattr(value, "__len__") and not isinstance(value, (str, bytes))
    if map_style or isinstance(value, IterableDataset):
        return
    raise TypeError(
        f"{name} must be a dataset (with __getitem__ and __len__, e.g. a TensorDataset, or an IterableDataset), "
        f"got {type(value).__name__}"
    )
