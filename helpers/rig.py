"""The course's one measuring rig, shared by the notebooks and the benchmark.

`measure` takes the variants being compared as named zero-argument calls (a training step in float32 and in
bfloat16, a loop with and without checkpointing, ...), then: warms each up, times them in interleaved rounds
(`timing.time_interleaved`, which synchronizes CUDA before reading the clock), and, when asked, meters what
autograd saves for backward and each call's own CUDA allocator peak. The `Measurement` it returns gives the
ratios against a baseline with their middle half, the sentence each ratio supports (`timing.compare`), a
table and a chart, so a lesson only writes out what it compares and asserts what must hold.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from matplotlib.figure import Figure

from . import compat
from .checks import check_choice, check_int
from .loop import PRECISIONS, make_grad_scaler, tf32_available, train_epoch
from .memory import format_bytes, peak_memory, saved_tensors_meter
from .timing import (
    compare,
    format_table,
    median,
    median_ratio,
    middle_half,
    quartiles,
    ratio_quartiles,
    time_interleaved,
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
        """Bars of the median time per unit (whiskers: the middle half) and, where metered, of the memory."""
        import matplotlib.pyplot as plt

        memory = [("saved for backward", "saved_bytes"), ("CUDA step peak", "cuda_peak_bytes")]
        memory = [(label, key) for label, key in memory if getattr(self[self.baseline], key) is not None]
        figure, axes = plt.subplots(1, 1 + len(memory), figsize=(4.5 * (1 + len(memory)), 3.4), layout="constrained")
        axes = list(axes) if memory else [axes]
        names = list(self.results)
        labels = [self.label(name) for name in names]
        medians = [self.median_ms(name) for name in names]
        spreads = [[1e3 * q for q in quartiles(self[name].seconds)] for name in names]
        errors = [
            [m - low for m, (low, _) in zip(medians, spreads)],
            [high - m for m, (_, high) in zip(medians, spreads)],
        ]
        bars = axes[0].bar(labels, medians, yerr=errors, capsize=4, color="tab:blue")
        axes[0].bar_label(bars, [f"x{self.time_ratio(name):.2f}" for name in names], fontsize=8, padding=2)
        axes[0].set(ylabel=f"ms per {self.unit} (median)", title=title or f"time on {self.device.type}")
        for ax, (label, key) in zip(axes[1:], memory):
            values = [getattr(self[name], key) for name in names]
            power = min(3, max(0, int(max(values)).bit_length() - 1) // 10)  # the largest value's binary unit
            bars = ax.bar(labels, [v / 1024**power for v in values], color="tab:orange")
            ax.bar_label(bars, [format_bytes(v) for v in values], fontsize=8, padding=2)
            ax.set(ylabel=f"{label}, {('B', 'KiB', 'MiB', 'GiB')[power]}", title=label)
        for ax in axes:
            ax.tick_params(axis="x", labelrotation=20 if max(len(text) for text in labels) > 8 else 0)
            ax.margins(y=0.15)
        return figure

    def speedup_chart(self, *, notes: Mapping[str, str] | None = None, title: str = "") -> Figure:
        """Bars of each variant's throughput relative to the baseline (baseline time / its time, median of the
        rounds), whiskers for the middle half of the per-round ratios, and an optional note under each label."""
        import matplotlib.pyplot as plt

        notes = dict(notes or {})
        names = list(self.results)
        unknown = set(notes) - {self.label(name) for name in names}
        if unknown:
            raise ValueError(f"notes name variants that were not measured: {sorted(unknown)}")
        speedups = [1 / self.time_ratio(name) for name in names]
        spreads = [self.ratio_spread(name) for name in names]  # time ratios: the low one is the fast end
        errors = [
            [s - 1 / high for s, (_, high) in zip(speedups, spreads)],
            [1 / low - s for s, (low, _) in zip(speedups, spreads)],
        ]
        labels = [self.label(name) for name in names]
        ticks = [f"{label}\n{notes[label]}" if label in notes else label for label in labels]
        figure, ax = plt.subplots(figsize=(max(5.0, 1.25 * len(names)), 3.6), layout="constrained")
        bars = ax.bar(ticks, speedups, yerr=errors, capsize=4, color="tab:green")
        ax.bar_label(bars, [f"x{s:.2f}" for s in speedups], fontsize=8, padding=2)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        unit = self.unit
        ax.set(
            ylabel=f"{unit}s per second, relative",
            title=title or f"throughput against {self.label(self.baseline)!r}",
        )
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(y=0.15)
        return figure


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


def precision_steps(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    precisions: Sequence[str],
    device: torch.device | str,
    lr: float = 0.01,
    accumulation_steps: int = 1,
) -> dict[str, Callable[[], object]]:
    """One training step of `model` on one batch per precision ('fp32', 'tf32', 'bf16', 'fp16'), ready for `measure`.

    A step is `helpers.loop.train_epoch` over the one batch: forward and loss under autocast (none for fp32 and
    tf32), backward, SGD step (through a GradScaler for fp16). 'fp32' follows the float32 setting in force (true
    float32 matmuls under torch's default, `set_float32_matmul_precision("highest")`); 'tf32' is the same step run
    under `compat.fp32_precision_as("tf32")`: CUDA only, where `helpers.loop.tf32_available` says so. With
    `accumulation_steps` the batch is cut into that many micro-batches (`torch.chunk`: fewer when the batch is
    smaller), whose gradients make the one step. Each precision trains its own copy of `model`, so `model` itself
    is left alone.
    """
    import torch.nn.functional as F

    known = (*PRECISIONS, "tf32")
    if isinstance(precisions, str) or not precisions or any(p not in known for p in precisions):
        raise ValueError(f"precisions must be a non-empty list drawn from {known}, got {precisions!r}")
    check_int("accumulation_steps", accumulation_steps)
    device = torch.device(device)
    if "tf32" in precisions:
        available, why = tf32_available(device)
        if not available:
            raise ValueError(f"precisions names 'tf32', but {why}; leave it out (precisions_for(device, tf32=True))")
    batch = list(zip(inputs.to(device).chunk(accumulation_steps), targets.to(device).chunk(accumulation_steps)))
    steps: dict[str, Callable[[], object]] = {}
    for name in precisions:
        amp = None if name in ("fp32", "tf32") else name
        replica = copy.deepcopy(model).to(device)
        optimizer = torch.optim.SGD(replica.parameters(), lr=lr)
        scaler = make_grad_scaler(device, amp)  # one scaler across steps, as in training
        step = functools.partial(
            train_epoch,
            replica,
            batch,
            optimizer,
            F.cross_entropy,
            device=device,
            accumulation_steps=accumulation_steps,
            amp=amp,
            scaler=scaler,
            progress=False,
        )
        steps[name] = in_fp32_precision(step, "tf32") if name == "tf32" else step
    return steps


def in_fp32_precision(step: Callable[[], object], mode: str) -> Callable[[], object]:
    """`step` as a call that runs with CUDA float32 products in `mode`, 'ieee' or 'tf32' (restored after each call)."""
    check_choice("mode", mode, compat.FP32_MODES)

    def call() -> object:
        with compat.fp32_precision_as(mode):
            return step()

    return call
