"""Plots: live training curves that update in place in Jupyter, and charts of what the rig measured."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .memory import format_bytes
from .progress import in_notebook
from .timing import quartiles


class LivePlot:
    """Curves of named metrics against epoch (or step), redrawn in place after each `update`.

    In Jupyter the figure is drawn into an ipywidgets Image, whose picture is replaced on every update
    (this also works under a knob panel's Run button, where display-handle updates are lost); elsewhere
    it is just a matplotlib Figure (`.figure`) that a script can save. Used as a context manager it closes
    itself at the end of the block; `update` is the callback a training loop calls after each epoch:

        with LivePlot(["train_loss", "val_accuracy"]) as plot:
            fit(..., on_epoch_end=plot.update)
    """

    def __init__(self, metrics: Sequence[str], *, x: str = "epoch", title: str | None = None) -> None:
        if not metrics or not all(isinstance(m, str) for m in metrics):
            raise ValueError(f"metrics must be a non-empty list of metric names, got {metrics!r}")
        self.metrics, self.x = list(metrics), x
        self.rows: list[dict] = []
        groups = [[m for m in self.metrics if "acc" not in m], [m for m in self.metrics if "acc" in m]]
        self.groups = [g for g in groups if g]
        self.figure, axes = plt.subplots(
            1, len(self.groups), figsize=(5 * len(self.groups), 3.2), squeeze=False, layout="constrained"
        )
        self.axes = list(axes[0])
        if title:
            self.figure.suptitle(title)
        self._image, self.closed = None, False
        if in_notebook():
            import ipywidgets
            from IPython.display import display

            self._image = ipywidgets.Image(format="png", layout={"width": f"{int(100 * 5 * len(self.groups))}px"})
            display(self._image)

    def __enter__(self) -> LivePlot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def update(self, row: Mapping[str, float]) -> None:
        """Add one row (a dict with the x key and any of the metrics) and redraw."""
        self.rows.append(dict(row))
        for ax, group in zip(self.axes, self.groups):
            ax.clear()
            for metric in group:
                points = [(r.get(self.x, i + 1), r[metric]) for i, r in enumerate(self.rows) if metric in r]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", label=metric)
            ax.set_xlabel(self.x)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend()
        if self._image is not None:
            self._image.value = figure_png(self.figure)

    def summary(self) -> str:
        """One line with the last row's metrics, e.g. 'epoch 5: train_loss 0.1234, test_accuracy 0.9712'."""
        if not self.rows:
            return "no rows plotted"
        last = self.rows[-1]
        values = ", ".join(f"{m} {last[m]:.4g}" for m in self.metrics if m in last)
        return f"{self.x} {last.get(self.x, len(self.rows))}: {values}"

    def close(self) -> None:
        """Stop drawing and leave the result for good: the final figure as a static image and a summary line.

        The live image widget's picture lives only in the running kernel, so a saved or exported notebook
        (papermill, nbconvert, HTML) would show an empty plot. In Jupyter the widget is closed and the last
        frame is displayed as an ordinary PNG output, which the .ipynb file keeps; then one line of text
        with the final metrics is printed (everywhere). Closing again does nothing.
        """
        if self.closed:
            return
        self.closed = True
        if self._image is not None:
            from IPython.display import Image, display

            self._image.close()
            self._image = None
            if self.rows:
                display(Image(figure_png(self.figure)))
        plt.close(self.figure)
        print(self.summary())


def figure_png(figure: Figure, dpi: int = 100) -> bytes:
    """The figure rendered as PNG bytes."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def line_chart(
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    logy: bool = False,
) -> Figure:
    """One line per series against shared x values."""
    if not series:
        raise ValueError("series must hold at least one named sequence")
    for name, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"series {name!r} has {len(ys)} values but x has {len(x)}")
    figure, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
    for name, ys in series.items():
        ax.plot(list(x), list(ys), marker="o", label=name)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return figure


def bar_chart(values: Mapping[str, float], *, ylabel: str, title: str = "", annotate: str = "{:.3g}") -> Figure:
    """One bar per label, each annotated with its value."""
    if not values:
        raise ValueError("values must hold at least one label")
    figure, ax = plt.subplots(figsize=(max(4, 1.1 * len(values)), 3.5), layout="constrained")
    labels, heights = list(values), [float(v) for v in values.values()]
    bars = ax.bar(labels, heights, color="tab:blue")
    for bar, height in zip(bars, heights):
        ax.annotate(
            annotate.format(height), (bar.get_x() + bar.get_width() / 2, height), ha="center", va="bottom", fontsize=8
        )
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    return figure


def stacked_bar_chart(
    bars: Mapping[str, Mapping[str, float]], *, ylabel: str, title: str = "", annotate: str = "{:.3g}"
) -> Figure:
    """One bar per label, its named parts stacked (a colour and a legend entry each), annotated with its total.

    A part that a bar lacks counts as 0 there; parts are stacked in the order they first appear.
    """
    if not bars:
        raise ValueError("bars must hold at least one label")
    parts = list(dict.fromkeys(part for stack in bars.values() for part in stack))
    width = max(4, 1.1 * len(bars)) + 1.5  # and the legend, on the right
    figure, ax = plt.subplots(figsize=(width, 3.5), layout="constrained")
    labels, totals = list(bars), [0.0] * len(bars)
    for part in parts:
        heights = [float(stack.get(part, 0.0)) for stack in bars.values()]
        ax.bar(labels, heights, bottom=totals, label=part)
        totals = [total + height for total, height in zip(totals, heights)]
    for position, total in enumerate(totals):
        ax.annotate(annotate.format(total), (position, total), ha="center", va="bottom", fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    return figure


def image_grid(
    images: Mapping[str, Any] | Sequence[tuple[str, Any]], *, columns: int | None = None, title: str = ""
) -> Figure:
    """Titled images in rows of `columns` (all in one row by default): a mapping or a list of (title, image) pairs.

    An image is gray, [H, W] or [1, H, W] with values in [0, 1], or RGB, [H, W, 3] of uint8 or of floats in [0, 1];
    a tensor or an array.
    """
    import numpy as np

    from .checks import check_int

    pairs = list(images.items()) if isinstance(images, Mapping) else list(images)
    if not pairs:
        raise ValueError("images must hold at least one (title, image) pair")
    columns = len(pairs) if columns is None else columns
    check_int("columns", columns)
    rows = -(-len(pairs) // columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(1.1 * columns, 1.3 * rows + 0.3 * bool(title)), squeeze=False, layout="constrained"
    )
    for ax in axes.flat:
        ax.axis("off")
    for ax, (name, image) in zip(axes.flat, pairs):
        pixels = np.asarray(image)
        pixels = pixels[0] if pixels.ndim == 3 and pixels.shape[0] == 1 else pixels  # [1, H, W]: one gray channel
        if pixels.ndim == 2:
            ax.imshow(pixels, cmap="gray", vmin=0, vmax=1)
        else:
            ax.imshow(pixels)
        ax.set_title(name, fontsize=7)
    if title:
        figure.suptitle(title, fontsize=9)
    return figure


def shard_chart(orders: Mapping[str, Sequence[Sequence[int]]], *, show: int, title: str = "") -> Figure:
    """Which rank holds each of the samples 0 .. show - 1, one strip per named split of the data.

    A split is a list of shards, one per rank, each a list of sample indices (as DistributedSampler yields them); a
    sample held by no rank is left white, one held by two (a padding repeat) shows the lower rank.
    """
    import numpy as np
    from matplotlib.colors import ListedColormap

    from .checks import check_int

    check_int("show", show)
    if not orders:
        raise ValueError("orders must hold at least one named split (a list of shards, one per rank)")
    ranks = max(len(shards) for shards in orders.values())
    if ranks == 0:
        raise ValueError("every split must hold at least one shard")
    owner = np.full((len(orders), show), np.nan)
    for row, shards in enumerate(orders.values()):
        for rank in reversed(range(len(shards))):  # the lower rank wins where the padding repeats a sample
            held = [index for index in shards[rank] if 0 <= index < show]
            owner[row, held] = rank
    figure, ax = plt.subplots(figsize=(7, 0.45 * len(orders) + 1.1), layout="constrained")
    colors = ListedColormap(plt.get_cmap("tab10")(np.arange(ranks)))  # one of tab10's colours per rank
    image = ax.imshow(owner, aspect="auto", cmap=colors, vmin=-0.5, vmax=ranks - 0.5, interpolation="nearest")
    ax.set(yticks=range(len(orders)), yticklabels=list(orders), xlabel="sample index", title=title)
    figure.colorbar(image, ax=ax, ticks=range(ranks), label="rank", fraction=0.04)
    return figure


def confusion_matrix_plot(matrix, classes: Sequence[str], *, title: str = "confusion matrix") -> Figure:
    """A confusion matrix (rows: true class, columns: predicted) with counts in the cells."""
    from sklearn.metrics import ConfusionMatrixDisplay

    figure, ax = plt.subplots(figsize=(5, 4.5), layout="constrained")
    ConfusionMatrixDisplay(matrix, display_labels=list(classes)).plot(ax=ax, colorbar=False)
    ax.set_title(title)
    return figure


def latency_throughput_chart(
    seconds_per_sample: Mapping[str, Mapping[int, Sequence[float]]], *, title: str = ""
) -> Figure:
    """Latency per batch (ms) and throughput (samples/s) against batch size, one line per series, log-log.

    `seconds_per_sample[series][batch_size]` holds the seconds per sample of each timed round (a rig Result's
    `seconds` with unit='sample'); a point is their median, its whiskers the middle half.
    """
    from .timing import median, quartiles

    if not seconds_per_sample or not all(seconds_per_sample.values()):
        raise ValueError("seconds_per_sample must map each series name to {batch size: seconds per sample}")
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    for name, by_size in seconds_per_sample.items():
        sizes = sorted(by_size)
        middle = [median(list(by_size[size])) for size in sizes]
        spread = [quartiles(list(by_size[size])) for size in sizes]
        latency = [1e3 * size * m for size, m in zip(sizes, middle)]  # ms per batch
        latency_errors = [
            [1e3 * size * (m - low) for size, m, (low, _) in zip(sizes, middle, spread)],
            [1e3 * size * (high - m) for size, m, (_, high) in zip(sizes, middle, spread)],
        ]
        throughput = [1 / m for m in middle]  # samples per second: the fewer seconds, the more samples
        throughput_errors = [
            [1 / m - 1 / high for m, (_, high) in zip(middle, spread)],
            [1 / low - 1 / m for m, (low, _) in zip(middle, spread)],
        ]
        axes[0].errorbar(sizes, latency, yerr=latency_errors, marker="o", capsize=3, label=name)
        axes[1].errorbar(sizes, throughput, yerr=throughput_errors, marker="o", capsize=3, label=name)
    axes[0].set(ylabel="latency per batch, ms (median)", title="latency: a batch in, answers out")
    axes[1].set(ylabel="throughput, samples/s (median)", title="throughput")
    for ax in axes:
        ax.set(xlabel="batch size", xscale="log", yscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    if title:
        figure.suptitle(title)
    return figure


def data_parallel_timeline() -> Figure:
    """One training step of nn.DataParallel and of DDP on two GPUs, lane by lane: a schematic (widths not measured)."""
    colours = {"compute": "tab:blue", "copy": "tab:orange", "comm": "tab:green", "host": "tab:gray"}
    ddp = [(0, 0.9, "own batch", "host"), (0.9, 1.5, "forward", "compute"), (2.4, 0.6, "loss", "compute")]
    ddp += [(3.0, 1.8, "backward", "compute"), (3.5, 1.6, "all-reduce", "comm"), (5.1, 0.7, "step", "compute")]
    gpu0 = [(0, 1.0, "scatter batch", "copy"), (1.0, 1.0, "copy weights", "copy"), (2.0, 1.5, "forward", "compute")]
    gpu0 += [(3.5, 1.0, "gather out", "copy"), (4.5, 0.8, "loss", "compute"), (5.3, 1.5, "backward", "compute")]
    gpu0 += [(6.8, 1.0, "sum grads", "copy"), (7.8, 0.7, "step", "compute")]
    lanes = {
        "DataParallel, GPU 0": gpu0,
        "DataParallel, GPU 1": [(2.0, 1.5, "forward", "compute"), (5.3, 1.5, "backward", "compute")],
        "DDP, rank 0 on GPU 0": ddp,
        "DDP, rank 1 on GPU 1": ddp,
    }
    figure, ax = plt.subplots(figsize=(9, 3.2), layout="constrained")
    for y, (lane, boxes) in enumerate(reversed(lanes.items())):
        for start, width, label, kind in boxes:
            # DDP's all-reduce runs while its backward pass does: the same time, in a band of its own below it
            if kind == "comm":
                bottom, height = y - 0.4, 0.3
            else:
                bottom, height = (y - 0.05, 0.4) if lane.startswith("DDP") else (y - 0.3, 0.6)
            ax.broken_barh([(start + 0.03, width - 0.06)], (bottom, height), color=colours[kind], alpha=0.85)
            centre = (start + width / 2, bottom + height / 2)
            ax.text(*centre, label, ha="center", va="center", fontsize=7.5, color="white")
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)))
    ax.set_xlabel("time within one training step (schematic)")
    ax.spines[["top", "right"]].set_visible(False)
    legend = ["compute", "copy through GPU 0", "all-reduce (overlaps backward)", "data loading"]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour, alpha=0.85) for colour in colours.values()]
    ax.legend(handles, legend, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize=8, frameon=False)
    return figure


def measurement_chart(measurement: Any, title: str = "") -> Figure:
    """Bars of the median time per unit (whiskers: the middle half) and, where metered, of the memory, of a
    helpers.rig.Measurement (not imported here: the rig draws through plots, not the reverse)."""
    memory = [("saved for backward", "saved_bytes"), ("CUDA step peak", "cuda_peak_bytes")]
    memory = [(label, key) for label, key in memory if getattr(measurement[measurement.baseline], key) is not None]
    figure, axes = plt.subplots(1, 1 + len(memory), figsize=(4.5 * (1 + len(memory)), 3.4), layout="constrained")
    axes = list(axes) if memory else [axes]
    names = list(measurement.results)
    labels = [measurement.label(name) for name in names]
    medians = [measurement.median_ms(name) for name in names]
    spreads = [[1e3 * q for q in quartiles(measurement[name].seconds)] for name in names]
    errors = [
        [m - low for m, (low, _) in zip(medians, spreads)],
        [high - m for m, (_, high) in zip(medians, spreads)],
    ]
    bars = axes[0].bar(labels, medians, yerr=errors, capsize=4, color="tab:blue")
    axes[0].bar_label(bars, [f"x{measurement.time_ratio(name):.2f}" for name in names], fontsize=8, padding=2)
    axes[0].set(ylabel=f"ms per {measurement.unit} (median)", title=title or f"time on {measurement.device.type}")
    for ax, (label, key) in zip(axes[1:], memory):
        values = [getattr(measurement[name], key) for name in names]
        power = min(3, max(0, int(max(values)).bit_length() - 1) // 10)  # the largest value's binary unit
        bars = ax.bar(labels, [v / 1024**power for v in values], color="tab:orange")
        ax.bar_label(bars, [format_bytes(v) for v in values], fontsize=8, padding=2)
        ax.set(ylabel=f"{label}, {('B', 'KiB', 'MiB', 'GiB')[power]}", title=label)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20 if max(len(text) for text in labels) > 8 else 0)
        ax.margins(y=0.15)
    return figure


def speedup_chart(measurement: Any, *, notes: Mapping[str, str] | None = None, title: str = "") -> Figure:
    """Bars of each variant's throughput relative to the baseline (baseline time / its time, median of the
    rounds), whiskers for the middle half of the per-round ratios, and an optional note under each label."""
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


def branch_chart(
    reference: Sequence[float],
    branches: Mapping[str, Sequence[float]],
    *,
    at: int,
    reference_label: str,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logy: bool = False,
) -> Figure:
    """A reference curve over steps 1 to n (wide, grey) and curves that leave it after step `at`, each drawn from
    step at + 1 on; each branch holds all n values, its first `at` being the reference's."""
    if not branches:
        raise ValueError("branches must hold at least one named curve")
    if not 0 <= at < len(reference):
        raise ValueError(
            f"at must be a step in [0, {len(reference) - 1}] (the reference has {len(reference)}), got {at!r}"
        )
    for name, ys in branches.items():
        if len(ys) != len(reference):
            raise ValueError(f"branch {name!r} has {len(ys)} values but the reference has {len(reference)}")
    figure, ax = plt.subplots(figsize=(10, 3.5), layout="constrained")
    steps = list(range(1, len(reference) + 1))
    ax.plot(steps, list(reference), color="grey", lw=3, alpha=0.5, label=reference_label)
    for number, (name, ys) in enumerate(branches.items()):
        ax.plot(steps[at:], list(ys)[at:], lw=1, ls="--" if number == 0 else "-", label=name)
    ax.axvline(at + 0.5, color="black", lw=0.8, ls=":")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logy:
        ax.set_yscale("log")
    ax.legend()
    return figure
