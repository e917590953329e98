"""Finding where training time goes and what a speed-up bought: the seconds a torch.profiler run spent under each
`record_function` label, whether torch.compile can build kernels here, and a chart of throughput relative to a
baseline (from `helpers.rig.measure`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from matplotlib.figure import Figure

from .rig import Measurement


def seconds_by_label(profile: torch.profiler.profile, labels: Sequence[str]) -> dict[str, float]:
    """Seconds of CPU wall time spent inside each `record_function(label)` range of a finished profile, summed
    over the recorded steps (a range's time includes everything nested in it)."""
    if isinstance(labels, str) or not labels:
        raise ValueError(f"labels must be a non-empty list of record_function names, got {labels!r}")
    found = {event.key: event for event in profile.key_averages()}
    missing = [label for label in labels if label not in found]
    if missing:
        named = sorted(key for key in found if not key.startswith(("aten::", "ProfilerStep")))[:12]
        raise ValueError(f"no record_function range named {missing} in the profile; it holds ranges such as {named}")
    return {label: found[label].cpu_time_total / 1e6 for label in labels}


def compile_ready(device: torch.device | str, *, compile_fn: Callable = torch.compile) -> tuple[bool, str]:
    """Whether torch.compile's default backend builds and runs a kernel on `device` here (it needs a C++ compiler
    on the CPU, Triton on a GPU), with the reason when it does not. The first call imports the compiler stack."""

    def probe(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + 1

    x = torch.ones(3, device=device)
    try:
        result = compile_fn(probe)(x)
    except Exception as error:  # a missing compiler surfaces as many error types, deep inside inductor
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return False, f"{type(error).__name__}: {reason[:200]}"
    if not torch.allclose(result, probe(x)):
        return False, "the compiled function returned a wrong result"
    return True, f"torch.compile built and ran a kernel on {x.device.type}"


def speedup_chart(measurement: Measurement, *, notes: Mapping[str, str] | None = None, title: str = "") -> Figure:
    """Bars of each variant's throughput relative to the baseline (baseline time / its time, median of the
    rounds), whiskers for the middle half of the per-round ratios, and an optional note under each label."""
    import matplotlib.pyplot as plt

    notes = dict(notes or {})
    names = list(measurement.results)
    unknown = set(notes) - {measurement.label(name) for name in names}
    if unknown:
        raise ValueError(f"notes name variants that were not measured: {sorted(unknown)}")
    speedups = [1 / measurement.time_ratio(name) for name in names]
    spreads = [measurement.ratio_spread(name) for name in names]  # time ratios: the low one is the fast end
    errors = [
        [s - 1 / high for s, (_, high) in zip(speedups, spreads)],
        [1 / low - s for s, (low, _) in zip(speedups, spreads)],
    ]
    labels = [measurement.label(name) for name in names]
    ticks = [f"{label}\n{notes[label]}" if label in notes else label for label in labels]
    figure, ax = plt.subplots(figsize=(max(5.0, 1.25 * len(names)), 3.6), layout="constrained")
    bars = ax.bar(ticks, speedups, yerr=errors, capsize=4, color="tab:green")
    ax.bar_label(bars, [f"x{s:.2f}" for s in speedups], fontsize=8, padding=2)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    unit = measurement.unit
    ax.set(
        ylabel=f"{unit}s per second, relative",
        title=title or f"throughput against {measurement.label(measurement.baseline)!r}",
    )
    ax.tick_params(axis="x", labelsize=8)
    ax.margins(y=0.15)
    return figure
