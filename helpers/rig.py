"""The course's one measuring rig, shared by the notebooks and the benchmark.

`measure` takes the variants being compared as named zero-argument calls (a training step in float32 and in
bfloat16, a loop with and without checkpointing, ...), then: warms each up, times them in interleaved rounds
(`timing.time_interleaved`, which synchronizes CUDA before reading the clock), and, when asked, meters what
autograd saves for backward and each call's own CUDA allocator peak. The `Measurement` it returns gives the
ratios against a baseline with their middle half, the sentence each ratio supports (`timing.compare`), a
table and a chart, so a lesson only writes out what it compares and asserts what must hold.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from matplotlib.figure import Figure

from . import plots
from .checks import check_int, check_positive_number
from .memory import format_bytes, peak_memory, saved_tensors_meter
from .timing import (
    compare,
    format_table,
    median,
    median_ratio,
    middle_half,
    ratio_quartiles,
    time_interleaved,
    verdict,
)


@dataclass
class Result:
    """One variant's figures: seconds per unit in each round, and its memory when metered."""

    name: Hashable
    seconds: list[float]
    saved_bytes: int | None = None  # the most bytes autograd held for backward at one time during one call
    cuda_peak_bytes: int | None = None  # CUDA: one call's own allocator peak, above what was allocated before it


@dataclass
class Measurement:
    """What `measure` found: a Result per variant, compared with the baseline variant."""

    device: torch.device
    results: dict[Any, Result]
    baseline: Hashable
    unit: str = "step"
    labels: dict[Any, str] = field(default_factory=dict)

    def __getitem__(self, name: Hashable) -> Result:
        if name not in self.results:
            raise KeyError(f"no variant named {name!r}; measured: {list(self.results)}")
        return self.results[name]

    def label(self, name: Hashable) -> str:
        return self.labels.get(name, str(name))

    def median_ms(self, name: Hashable) -> float:
        """Median milliseconds per unit."""
        return 1e3 * median(self[name].seconds)

    def time_ratio(self, name: Hashable, against: Hashable | None = None) -> float:
        """Median of the per-round time ratios name / against (the baseline by default): below 1 is faster."""
        return median_ratio(self[name].seconds, self[self.baseline if against is None else against].seconds)

    def ratio_spread(self, name: Hashable, against: Hashable | None = None) -> tuple[float, float]:
        """First and third quartile of the same per-round ratios."""
        return ratio_quartiles(self[name].seconds, self[self.baseline if against is None else against].seconds)

    def conclusion(self, name: Hashable, against: Hashable | None = None) -> str:
        """What this run showed about name's time against `against` (the baseline by default), in words."""
        other = self.baseline if against is None else against
        return compare(self.label(name), self[name].seconds, self.label(other), self[other].seconds)

    def verdict(self, name: Hashable, against: Hashable | None = None) -> str | None:
        """'faster' or 'slower' when this run showed name's time against `against` (the baseline), else None."""
        other = self.baseline if against is None else against
        return verdict(self[name].seconds, self[other].seconds)

    def conclusions(self) -> list[str]:
        """One sentence per variant against the baseline."""
        return [self.conclusion(name) for name in self.results if name != self.baseline]

    def memory_ratio(self, name: Hashable, against: Hashable | None = None) -> float:
        """Bytes saved for backward, name / against (the baseline by default)."""
        mine, theirs = self[name].saved_bytes, self[self.baseline if against is None else against].saved_bytes
        if mine is None or not theirs:
            raise ValueError("memory_ratio needs saved_tensors=True in measure() and a baseline that saves something")
        return mine / theirs

    def peak_ratio(self, name: Hashable, against: Hashable | None = None) -> float:
        """Own CUDA allocator peak, name / against (the baseline by default)."""
        mine, theirs = self[name].cuda_peak_bytes, self[self.baseline if against is None else against].cuda_peak_bytes
        if mine is None or not theirs:
            raise ValueError("peak_ratio needs a CUDA device (the allocator's peak is read there only)")
        return mine / theirs

    def rows(self) -> list[dict[str, Any]]:
        """One dict per variant, numbers unformatted (the benchmark's JSON); `table` formats them."""
        rows = []
        for name, result in self.results.items():
            low, high = self.ratio_spread(name)
            row: dict[str, Any] = {
                "variant": self.label(name),
                f"ms/{self.unit}": self.median_ms(name),
                "middle half (ms)": middle_half(result.seconds),
                "time ratio": self.time_ratio(name),
                "ratio middle half": f"{low:.2f}-{high:.2f}",
            }
            if result.saved_bytes is not None:
                row["saved for backward"] = result.saved_bytes
                if self[self.baseline].saved_bytes:
                    row["memory ratio"] = self.memory_ratio(name)
            if result.cuda_peak_bytes is not None:
                row["CUDA step peak"] = result.cuda_peak_bytes
                if self[self.baseline].cuda_peak_bytes:
                    row["peak ratio"] = self.peak_ratio(name)
            rows.append(row)
        return rows

    def table(self, title: str = "") -> str:
        """The rows as an aligned text table; ratios are against the baseline."""
        rows = self.rows()
        for row in rows:
            for key in ("saved for backward", "CUDA step peak"):
                if key in row:
                    row[key] = format_bytes(row[key])
        formats = {f"ms/{self.unit}": "{:.3f}", "time ratio": "x{:.2f}"}
        formats |= {key: "x{:.2f}" for key in ("memory ratio", "peak ratio") if key in rows[0]}
        heading = title or f"on {self.device.type}; ratios against {self.label(self.baseline)!r}"
        return format_table(rows, list(rows[0]), formats=formats, title=heading)

    def report(self, title: str = "") -> None:
        """Print the table, then what the run showed against the baseline."""
        print(self.table(title))
        for sentence in self.conclusions():
            print("  " + sentence)

    def chart(self, title: str = "") -> Figure:
        """Bars of the median time per unit and, where metered, of the memory: helpers.plots.measurement_chart."""
        return plots.measurement_chart(self, title)

    def speedup_chart(self, *, notes: Mapping[str, str] | None = None, title: str = "") -> Figure:
        """Each variant's throughput relative to the baseline: helpers.plots.speedup_chart."""
        return plots.speedup_chart(self, notes=notes, title=title)


def measure(
    steps: Mapping[Any, Callable[[], object]],
    *,
    device: torch.device | str,
    repeat: int = 10,
    warmup: int = 2,
    baseline: Hashable | None = None,
    per: int | Mapping[Hashable, int] = 1,
    unit: str = "step",
    saved_tensors: bool = False,
    exclude: torch.nn.Module | Sequence[torch.Tensor] | None = None,
    cuda_peak: bool | None = None,
    labels: Mapping[Any, str] | None = None,
) -> Measurement:
    """Time every call in `steps` in `repeat` interleaved rounds after `warmup` rounds, and meter its memory.

    `per` divides a call's seconds into units (10 steps per call: per=10; a mapping gives it per variant).
    With `saved_tensors`, one more call of each runs under `memory.saved_tensors_meter(exclude=exclude)`, and
    its peak of bytes held for backward is kept. On CUDA (or with `cuda_peak=True`) one more call runs under
    `memory.peak_memory`, and its own allocator peak (above what was allocated when it began) is kept. The
    baseline of the ratios is `baseline`, or the first variant.
    """
    if not isinstance(steps, Mapping) or not steps or not all(callable(step) for step in steps.values()):
        raise TypeError("steps must be a non-empty mapping of names to zero-argument calls, e.g. {'fp32': step}")
    check_int("repeat", repeat)
    check_int("warmup", warmup, minimum=0)
    baseline = next(iter(steps)) if baseline is None else baseline
    if baseline not in steps:
        raise ValueError(f"baseline must name one of the steps {list(steps)}, got {baseline!r}")
    units = {name: per[name] if isinstance(per, Mapping) else per for name in steps}
    for name, count in units.items():
        check_int(f"per[{name!r}]" if isinstance(per, Mapping) else "per", count)
    device = torch.device(device)
    seconds = time_interleaved(steps, repeat=repeat, warmup=warmup, device=device)
    results = {name: Result(name, [s / units[name] for s in seconds[name]]) for name in steps}
    if saved_tensors:
        for name, step in steps.items():
            with saved_tensors_meter(exclude=exclude) as meter:
                step()
            results[name].saved_bytes = meter.peak_bytes
    if cuda_peak and device.type != "cuda":
        raise ValueError(f"cuda_peak=True needs a CUDA device (the allocator's peak is read there), got {device}")
    if cuda_peak or (cuda_peak is None and device.type == "cuda"):
        for name, step in steps.items():
            with peak_memory(device) as peak:
                step()
            results[name].cuda_peak_bytes = peak.bytes - peak.start_bytes
    return Measurement(device, results, baseline, unit, dict(labels or {}))


def powers_up_to(largest: int, base: int) -> list[int]:
    """The sizes of a sweep: 1, base, base**2, ... while below `largest`, then `largest` (256, 4: 1, 4, 16, 64, 256)."""
    check_int("largest", largest)
    check_int("base", base, minimum=2)
    sizes = [1]
    while sizes[-1] * base < largest:
        sizes.append(sizes[-1] * base)
    return sizes if largest == 1 else [*sizes, largest]


def payback(measurement: Measurement, name: Hashable, cost_s: float, *, cost: str = "compiling") -> str:
    """After how many units the `cost_s` seconds paid once (the first call's compile) are won back by name's
    quicker unit against the baseline, in words: only where the run showed name faster (`Measurement.verdict`);
    otherwise the sentence says why there is no such figure."""
    check_positive_number("cost_s", cost_s)
    mine, base = measurement.label(name), measurement.label(measurement.baseline)
    found = measurement.verdict(name)
    if found == "slower":
        return f"{mine} was slower than {base} here: the {cost_s:.1f} s of {cost} never pay back at this size"
    if found is None:
        return f"{mine} and {base} were not told apart here: no payback figure (more rounds may tell)"
    saved_s = measurement.median_ms(measurement.baseline) / 1e3 * (1 - measurement.time_ratio(name))
    return f"the {cost_s:.1f} s of {cost} pay back after {cost_s / saved_s:,.0f} {measurement.unit}s of {mine}"


def throughput_table(
    measurement: Measurement,
    *,
    columns: Mapping[str, Mapping[Any, object]] | None = None,
    formats: Mapping[str, str] | None = None,
    title: str = "",
) -> str:
    """Each variant's units per second, its throughput against the baseline (xN: N times as many per second) with
    the middle half of the rounds, then `columns`: more figures per variant (an accuracy, a count), by column."""
    columns = dict(columns or {})
    for column, values in columns.items():
        missing = [measurement.label(name) for name in measurement.results if name not in values]
        if missing:
            raise ValueError(f"columns[{column!r}] has no value for the variants {missing}")
    rows = []
    for name in measurement.results:
        low, high = measurement.ratio_spread(name)  # time ratios: the low one is the fast end
        speed = [1e3 / measurement.median_ms(name), f"x{1 / measurement.time_ratio(name):.2f}"]
        rows.append([measurement.label(name), *speed, f"{1 / high:.2f}-{1 / low:.2f}"])
        rows[-1] += [values[name] for values in columns.values()]
    unit = measurement.unit
    header = ["variant", f"{unit}s/s", "throughput", "middle half", *columns]
    return format_table(rows, header, formats={f"{unit}s/s": "{:.0f}", **(formats or {})}, title=title)


def rung_by_rung(measurement: Measurement) -> list[str]:
    """A ladder's findings in words, from this run's rounds only: what each variant bought against the one measured
    before it, which of them paid and which cost time, and the last one against the baseline."""
    names = list(measurement.results)
    if len(names) < 2:
        raise ValueError(f"a ladder needs at least two variants, got {names}")
    pairs = list(itertools.pairwise(names))
    sentences = [measurement.conclusion(name, against=below) for below, name in pairs]
    verdicts = {name: measurement.verdict(name, below) for below, name in pairs}
    paid = [measurement.label(name) for name, found in verdicts.items() if found == "faster"]
    cost = [measurement.label(name) for name, found in verdicts.items() if found == "slower"]
    where = measurement.device.type
    sentences.append(f"On this {where}, {', '.join(paid) or 'no rung'} paid; {', '.join(cost) or 'no rung'} cost time.")
    return [*sentences, f"All together: {measurement.conclusion(names[-1])}"]
