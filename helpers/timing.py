"""The clock: timing done right (warm-up first, synchronise CUDA before reading the clock, compare in one run),
the statistics of repeated timings, and the plain-text tables measurements are printed in. It knows nothing of
training; `helpers.rig` builds the course's measurements on top of it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

import torch

from .checks import check_int


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued GPU work (a no-op on CPU), so the clock measures the work and not its launch."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _check_counts(repeat: int, warmup: int) -> None:
    check_int("repeat", repeat)
    check_int("warmup", warmup, minimum=0)


def time_call(
    fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1, device: torch.device | str | None = None
) -> list[float]:
    """Seconds taken by each of `repeat` calls of fn(), after `warmup` untimed calls."""
    _check_counts(repeat, warmup)
    for _ in range(warmup):
        fn()
    synchronize(device)
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


Key = TypeVar("Key", bound=Hashable)


def time_interleaved(
    fns: Mapping[Key, Callable[[], object]],
    *,
    repeat: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
) -> dict[Key, list[float]]:
    """Time several functions in rounds, so drifts in machine load hit them alike.

    Every other round runs them in reverse order (A B, B A, A B, ...), so that neither always runs
    right after the other (caches, allocator and CPU frequency favour whoever comes second).
    """
    _check_counts(repeat, warmup)
    if not fns:
        raise ValueError("fns must hold at least one named function")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    synchronize(device)
    seconds: dict[Key, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_index in range(repeat):
        for name in names if round_index % 2 == 0 else names[::-1]:
            fn = fns[name]
            start = time.perf_counter()
            fn()
            synchronize(device)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def median(values: list[float]) -> float:
    """The median, which shrugs off the odd slow repetition better than the mean."""
    if not values:
        raise ValueError("values must not be empty")
    return statistics.median(values)


def _pairwise_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"need two equally long, non-empty lists, got {len(numerator)} and {len(denominator)}")
    return [a / b for a, b in zip(numerator, denominator)]


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median of pairwise ratios numerator[i] / denominator[i] from an interleaved run."""
    return statistics.median(_pairwise_ratios(numerator, denominator))


def quartiles(values: list[float]) -> tuple[float, float]:
    """First and third quartile: the middle half of repeated measurements lies between them."""
    if not values:
        raise ValueError("values must not be empty")
    if len(values) == 1:
        return values[0], values[0]
    first, _, third = statistics.quantiles(values, n=4, method="inclusive")
    return first, third


def ratio_quartiles(numerator: list[float], denominator: list[float]) -> tuple[float, float]:
    """First and third quartile of the same pairwise ratios: how steady their median is."""
    return quartiles(_pairwise_ratios(numerator, denominator))


MIN_ROUNDS = 3  # fewer interleaved rounds than this have no middle half worth the name


def middle_half(seconds: list[float], *, scale: float = 1e3, digits: int = 3) -> str:
    """The first to third quartile of repeated timings as text, in ms by default: '0.520-0.550'.

    Print it beside every median: one timing says little on a shared machine, its spread says how far to
    trust it.
    """
    if not seconds:
        raise ValueError("seconds must not be empty")
    first, third = quartiles(seconds)
    return f"{scale * first:.{digits}f}-{scale * third:.{digits}f}"


def compare(name_a: str, seconds_a: list[float], name_b: str, seconds_b: list[float]) -> str:
    """What one interleaved run showed about a's time against b's, as a sentence built from the measured ratios.

    a counts as faster only when the whole middle half of the per-round ratios a/b lies below 1, slower
    only when it lies above 1, and only from at least MIN_ROUNDS rounds; otherwise the run did not tell
    them apart. So the text never states a
    conclusion the run itself did not show.
    """
    ratio, (low, high) = median_ratio(seconds_a, seconds_b), ratio_quartiles(seconds_a, seconds_b)
    measured = f"time ratio {ratio:.2f}, middle half {low:.2f}-{high:.2f}, {len(seconds_a)} rounds"
    if len(seconds_a) < MIN_ROUNDS:
        return f"{name_a} and {name_b} were not told apart: too few rounds to judge ({measured})"
    if high < 1:
        return f"{name_a} was faster than {name_b} ({measured})"
    if low > 1:
        return f"{name_a} was slower than {name_b} ({measured})"
    return f"{name_a} and {name_b} were not told apart: the middle half of the ratios spans 1 ({measured})"


def _default_format(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if 0.001 <= abs(value) < 1000 else f"{value:.4g}"
    return "" if value is None else str(value)


def format_table(
    rows: Sequence[Mapping | Sequence],
    columns: Sequence[str],
    *,
    formats: Mapping[str, str] | None = None,
    title: str = "",
) -> str:
    """Rows (dicts keyed by column, or sequences in column order) as an aligned table.

    `formats` maps a column to a format such as '{:.2f}'.
    Floats without a format get 3 decimals (or 4 significant digits when very large or small).
    """
    if not columns:
        raise ValueError("columns must name at least one column")
    formats = dict(formats or {})
    unknown = set(formats) - set(columns)
    if unknown:
        raise ValueError(f"formats names columns not in columns: {sorted(unknown)}")
    cells = [[str(c) for c in columns]]
    for number, row in enumerate(rows):
        if not isinstance(row, Mapping):
            if len(row) != len(columns):
                raise ValueError(f"row {number} has {len(row)} cells for {len(columns)} columns: {list(row)}")
            row = dict(zip(columns, row))
        missing = [c for c in columns if c not in row]
        if missing:
            raise ValueError(f"row {number} lacks the columns {missing}")
        cells.append([formats[c].format(row[c]) if c in formats else _default_format(row[c]) for c in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(text.rjust(width) for text, width in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(([title] if title else []) + lines)
