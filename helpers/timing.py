"""The clock: timing done right (warm-up first, synchronise CUDA before reading the clock, compare in one run),
the statistics of repeated timings, and the plain-text tables measurements are printed in. It knows nothing of
training; `helpers.rig` builds the course's measurements on top of it."""

from __future__ import annotations

import math
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


# A direction needs the rounds to agree beyond chance: with n rounds of which k favour one side, the chance of k
# or more under "no difference" (each round a coin toss) must be at most SIGN_TEST_LEVEL. So 5 rounds all agreeing
# are the fewest that can tell (2**-5 = 0.03); 8 rounds may have one round the other way, 10 rounds one too.
SIGN_TEST_LEVEL = 0.05
MIN_ROUNDS = 5  # fewer interleaved rounds than this cannot pass the sign test, however they fall


def middle_half(seconds: list[float], *, scale: float = 1e3, digits: int = 3) -> str:
    """The first to third quartile of repeated timings as text, in ms by default: '0.520-0.550'.

    Print it beside every median: one timing says little on a shared machine, its spread says how far to
    trust it.
    """
    if not seconds:
        raise ValueError("seconds must not be empty")
    first, third = quartiles(seconds)
    return f"{scale * first:.{digits}f}-{scale * third:.{digits}f}"


def sign_test(favouring: int, rounds: int) -> float:
    """The chance that `favouring` or more of `rounds` coin tosses land one way: how likely the rounds would agree
    this much if there were no difference at all."""
    return sum(math.comb(rounds, k) for k in range(favouring, rounds + 1)) / 2**rounds


def verdict(seconds_a: list[float], seconds_b: list[float]) -> str | None:
    """'faster' or 'slower' when one interleaved run showed a's time against b's, else None.

    A direction needs both: the whole middle half of the per-round ratios a/b on one side of 1, and the rounds
    agreeing beyond chance (the sign test at SIGN_TEST_LEVEL: at least MIN_ROUNDS rounds, nearly all one way)."""
    ratios = _pairwise_ratios(seconds_a, seconds_b)
    low, high = quartiles(ratios)
    below, above = sum(r < 1 for r in ratios), sum(r > 1 for r in ratios)
    if high < 1 and sign_test(below, len(ratios)) <= SIGN_TEST_LEVEL:
        return "faster"
    if low > 1 and sign_test(above, len(ratios)) <= SIGN_TEST_LEVEL:
        return "slower"
    return None


def compare(name_a: str, seconds_a: list[float], name_b: str, seconds_b: list[float]) -> str:
    """What one interleaved run showed about a's time against b's, as a sentence built from the measured ratios.

    a counts as faster or slower only when `verdict` says so; otherwise the run did not tell them apart, and the
    sentence says why. So the text never states a conclusion the run itself did not show. Ratios get three
    decimals, enough to read a small difference.
    """
    ratio, (low, high) = median_ratio(seconds_a, seconds_b), ratio_quartiles(seconds_a, seconds_b)
    ratios = _pairwise_ratios(seconds_a, seconds_b)
    below = sum(r < 1 for r in ratios)
    measured = f"time ratio {ratio:.3f}, middle half {low:.3f}-{high:.3f}, {below} of {len(ratios)} rounds below 1"
    found = verdict(seconds_a, seconds_b)
    if found:
        return f"{name_a} was {found} than {name_b} ({measured})"
    if len(ratios) < MIN_ROUNDS:
        why = f"too few rounds to judge, at least {MIN_ROUNDS} are needed"
    elif low <= 1 <= high:
        why = "the middle half of the ratios spans 1"
    else:
        why = "the rounds disagree too often to rule out chance"
    return f"{name_a} and {name_b} were not told apart: {why} ({measured})"


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


def format_rows(
    rows: Mapping[Hashable, Mapping[str, object]],
    *,
    key: str,
    formats: Mapping[str, str] | None = None,
    title: str = "",
) -> str:
    """A table with one row per entry of `rows`: its key in the first column (headed `key`), then its values.

    `rows` maps each key (a segment count, a variant's name) to that row's values by column, as an experiment
    returns them: {0: {"kept": 101, "predicted": 101}, 2: {...}}. The columns are the first row's, in order;
    `formats` and the default number formats are `format_table`'s.
    """
    if not isinstance(rows, Mapping) or not all(isinstance(row, Mapping) for row in rows.values()):
        raise TypeError(f"rows must map each key to a mapping of column -> value, got {type(rows).__name__}")
    if not rows:
        raise ValueError("rows must hold at least one row")
    columns = list(next(iter(rows.values())))
    if key in columns:
        raise ValueError(f"key {key!r} is also a column of the rows; name the key column otherwise")
    table = [{key: name, **row} for name, row in rows.items()]
    return format_table(table, [key, *columns], formats=formats, title=title)


def format_columns(
    columns: Mapping[Hashable, Mapping[Hashable, object]],
    *,
    key: str,
    rows: Sequence[Hashable] | None = None,
    value_format: str | Callable[[object], str] | None = None,
    title: str = "",
) -> str:
    """A table with one column per entry of `columns`, each mapping row names to values, side by side.

    `columns` is what several sources give for the same quantities: {"by hand": {"loss": 0.1, ...},
    "scikit-learn": {"loss": 0.1, ...}}. The row names go in the first column (headed `key`): `rows` picks them
    in order, else the first column's names. `value_format` formats every value, as a format such as '{:.4f}' or
    a function such as memory.format_bytes; without it, `format_table`'s default number formats apply.
    """
    if not isinstance(columns, Mapping) or not all(isinstance(column, Mapping) for column in columns.values()):
        raise TypeError(f"columns must map each column to a mapping of row -> value, got {type(columns).__name__}")
    if not columns:
        raise ValueError("columns must hold at least one column")
    if key in columns:
        raise ValueError(f"key {key!r} is also a column; name the key column otherwise")
    if value_format is not None and not (isinstance(value_format, str) or callable(value_format)):
        raise TypeError(f"value_format must be a format string or a function, got {type(value_format).__name__}")
    names = list(next(iter(columns.values())) if rows is None else rows)
    for column, values in columns.items():
        missing = [name for name in names if name not in values]
        if missing:
            raise ValueError(f"column {column!r} lacks the rows {missing}")

    def cell(value: object) -> object:
        if value_format is None:
            return value
        return value_format.format(value) if isinstance(value_format, str) else value_format(value)

    table = [[name, *(cell(values[name]) for values in columns.values())] for name in names]
    return format_table(table, [key, *map(str, columns)], title=title)
