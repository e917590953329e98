"""Plots: live training curves that update in place in Jupyter, and charts for measurement tables."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .progress import in_notebook


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


def confusion_matrix_plot(matrix, classes: Sequence[str], *, title: str = "confusion matrix") -> Figure:
    """A confusion matrix (rows: true class, columns: predicted) with counts in the cells."""
    from sklearn.metrics import ConfusionMatrixDisplay

    figure, ax = plt.subplots(figsize=(5, 4.5), layout="constrained")
    ConfusionMatrixDisplay(matrix, display_labels=list(classes)).plot(ax=ax, colorbar=False)
    ax.set_title(title)
    return figure
