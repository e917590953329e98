"""Timing done right (warm-up first, synchronise CUDA before reading the clock, compare in one run), and the
plain-text tables that notebooks and the benchmark print the measurements in."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

import torch


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
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive int, got {repeat!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")


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


def ratio_quartiles(numerator: list[float], denominator: list[float]) -> tuple[float, float]:
    """First and third quartile of the same pairwise ratios: how steady their median is."""
    ratios = _pairwise_ratios(numerator, denominator)
    if len(ratios) == 1:
        return ratios[0], ratios[0]
    first, _, third = statistics.quantiles(ratios, n=4, method="inclusive")
    return first, third


MIN_ROUNDS = 3  # fewer interleaved rounds than this have no middle half worth the name


def middle_half(seconds: list[float], *, scale: float = 1e3, digits: int = 3) -> str:
    """The first to third quartile of repeated timings as text, in ms by default: '0.520-0.550'.

    Print it beside every median: one timing says little on a shared machine, its spread says how far to
    trust it.
    """
    if not seconds:
        raise ValueError("seconds must not be empty")
    if len(seconds) == 1:
        first = third = seconds[0]
    else:
        first, _, third = statistics.quantiles(seconds, n=4, method="inclusive")
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


def precisions_for(device: torch.device | str) -> list[str]:
    """The precisions worth comparing on `device`: fp32 and bf16, and fp16 on CUDA (where it is fast)."""
    device = torch.device(device)
    return ["fp32", "bf16", "fp16"] if device.type == "cuda" else ["fp32", "bf16"]


def time_training_steps(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    precisions: list[str] | tuple[str, ...],
    device: torch.device | str,
    repeat: int = 10,
    warmup: int = 3,
    lr: float = 0.01,
) -> dict[str, list[float]]:
    """Seconds per training step of `model` on one batch in each precision ('fp32', 'bf16', 'fp16').

    A step is `helpers.loop.train_epoch` over the one batch: forward and loss under autocast (none for
    fp32), backward, optimizer step (through a GradScaler for fp16). Each precision trains its own copy of
    `model` with its own SGD; the steps are timed in turns (`time_interleaved`), so load changes hit all
    precisions alike, and `model` itself is left alone.
    """
    import copy

    import torch.nn.functional as F

    from .loop import make_grad_scaler, train_epoch

    allowed = ("fp32", "bf16", "fp16")
    if isinstance(precisions, str) or not precisions or any(p not in allowed for p in precisions):
        raise ValueError(f"precisions must be a non-empty list drawn from {allowed}, got {precisions!r}")
    device = torch.device(device)
    batch = [(inputs.to(device), targets.to(device))]
    steps = {}
    for name in precisions:
        amp = None if name == "fp32" else name
        replica = copy.deepcopy(model).to(device)
        optimizer = torch.optim.SGD(replica.parameters(), lr=lr)
        scaler = make_grad_scaler(device, amp)  # one scaler across steps, as in training
        steps[name] = lambda replica=replica, optimizer=optimizer, scaler=scaler, amp=amp: train_epoch(
            replica, batch, optimizer, F.cross_entropy, device=device, amp=amp, scaler=scaler, progress=False
        )
    return time_interleaved(steps, repeat=repeat, warmup=warmup, device=device)


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
