from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from helpers.plots import (
    LivePlot,
    bar_chart,
    confusion_matrix_plot,
    line_chart,
    measurement_chart,
    speedup_chart,
    stacked_bar_chart,
)
from helpers.rig import Measurement, Result


def test_live_plot_accumulates_rows_outside_jupyter():
    plot = LivePlot(["train_loss", "val_accuracy"])
    plot.update({"epoch": 1, "train_loss": 1.0, "val_accuracy": 0.5})
    plot.update({"epoch": 2, "train_loss": 0.5, "val_accuracy": 0.8})
    assert isinstance(plot.figure, Figure) and len(plot.axes) == 2
    assert list(plot.axes[0].lines[0].get_ydata()) == [1.0, 0.5]
    plot.close()


def test_live_plot_needs_metrics():
    with pytest.raises(ValueError, match="metrics"):
        LivePlot([])


def test_charts():
    assert isinstance(line_chart([1, 2], {"a": [1, 2]}, xlabel="x", ylabel="y", logx=True), Figure)
    assert isinstance(bar_chart({"a": 1.0, "b": 2.0}, ylabel="y"), Figure)
    assert isinstance(confusion_matrix_plot(np.eye(3, dtype=int), ["a", "b", "c"]), Figure)
    with pytest.raises(ValueError, match="series 'a'"):
        line_chart([1, 2, 3], {"a": [1, 2]}, xlabel="x", ylabel="y")
    with pytest.raises(ValueError, match="series"):
        line_chart([1], {}, xlabel="x", ylabel="y")
    with pytest.raises(ValueError, match="values"):
        bar_chart({}, ylabel="y")


def test_figure_png_renders_bytes():
    from helpers.plots import figure_png

    png = figure_png(bar_chart({"a": 1.0}, ylabel="y"))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_live_plot_and_charts_draw_without_layout_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot = LivePlot(["train_loss", "val_loss", "val_accuracy"], title="a run")
        for epoch in (1, 2):
            plot.update({"epoch": epoch, "train_loss": 1.0 / epoch, "val_loss": 1.2 / epoch, "val_accuracy": 0.5})
        plot.close()
        line_chart([1, 2], {"a": [1, 2]}, xlabel="x", ylabel="y")
        bar_chart({"a": 1.0}, ylabel="y")
        confusion_matrix_plot(np.eye(3, dtype=int), ["a", "b", "c"])


def test_live_plot_close_prints_a_summary_of_the_last_row(capsys):
    plot = LivePlot(["train_loss", "val_accuracy"])
    plot.update({"epoch": 1, "train_loss": 1.0, "val_accuracy": 0.5})
    plot.update({"epoch": 2, "train_loss": 0.25, "val_accuracy": 0.875})
    plot.close()
    assert capsys.readouterr().out.strip() == "epoch 2: train_loss 0.25, val_accuracy 0.875"


def test_an_executed_notebook_keeps_the_final_curves_and_summary(tmp_path):
    """The live widget's picture is lost when the kernel stops; close() leaves a PNG that the file keeps."""
    import nbformat
    from nbclient import NotebookClient

    root = Path(__file__).resolve().parents[1]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "import sys\n"
            f"sys.path.insert(0, {str(root)!r})\n"
            "from helpers.plots import LivePlot\n"
            "plot = LivePlot(['train_loss', 'val_accuracy'])\n"
            "for epoch in (1, 2):\n"
            "    plot.update({'epoch': epoch, 'train_loss': 1 / epoch, 'val_accuracy': 0.5 * epoch})\n"
            "plot.close()"
        )
    ]
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = notebook.cells[0].outputs
    pngs = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(pngs) == 1
    assert "epoch 2: train_loss 0.5, val_accuracy 1" in "".join(o.get("text", "") for o in outputs)


def test_latency_throughput_chart_draws_medians_per_batch_and_per_second():
    import matplotlib.pyplot as plt

    from helpers.plots import latency_throughput_chart

    rounds = {"1 thread": {4: [0.002, 0.001, 0.003], 1: [0.004, 0.004, 0.004]}, "GPU": {1: [0.01], 4: [0.001]}}
    figure = latency_throughput_chart(rounds, title="sweep")
    latency, throughput = figure.axes
    line = latency.get_lines()[0]
    assert list(line.get_xdata()) == [1, 4]  # sorted by batch size
    assert list(line.get_ydata()) == pytest.approx([4.0, 8.0])  # ms per batch: batch size x median s/sample
    assert list(throughput.get_lines()[0].get_ydata()) == pytest.approx([250.0, 500.0])  # samples/s
    assert latency.get_xscale() == latency.get_yscale() == "log"
    assert [text.get_text() for text in latency.get_legend().get_texts()] == ["1 thread", "GPU"]
    plt.close(figure)
    for bad in ({}, {"a": {}}):
        with pytest.raises(ValueError, match="seconds_per_sample must map"):
            latency_throughput_chart(bad)


def test_data_parallel_timeline_draws_four_lanes():
    from helpers.plots import data_parallel_timeline

    figure = data_parallel_timeline()
    labels = [tick.get_text() for tick in figure.axes[0].get_yticklabels()]
    assert labels == ["DDP, rank 1 on GPU 1", "DDP, rank 0 on GPU 0", "DataParallel, GPU 1", "DataParallel, GPU 0"]
    assert {"all-reduce", "gather out", "sum grads"} <= {text.get_text() for text in figure.axes[0].texts}


def test_image_grid_lays_out_titled_images_in_rows():
    import torch

    from helpers.plots import image_grid

    gray, channel_first, rgb = np.zeros((6, 5)), torch.rand(1, 6, 5), np.zeros((6, 5, 3), dtype=np.uint8)
    figure = image_grid({"gray": gray, "tensor [1, H, W]": channel_first, "rgb": rgb})
    assert [ax.get_title() for ax in figure.axes] == ["gray", "tensor [1, H, W]", "rgb"]
    assert figure.axes[1].images[0].get_array().shape == (6, 5)
    pairs = [("same title", gray)] * 5  # a list of pairs keeps repeated titles
    figure = image_grid(pairs, columns=2, title="five")
    assert len(figure.axes) == 6 and sum(bool(ax.images) for ax in figure.axes) == 5
    with pytest.raises(ValueError, match="images"):
        image_grid({})
    with pytest.raises(ValueError, match="columns"):
        image_grid(pairs, columns=0)


def _fixed(seconds_a, seconds_b) -> Measurement:
    return Measurement(
        torch.device("cpu"), {"a": Result("a", seconds_a), "b": Result("b", seconds_b)}, baseline="a", unit="batch"
    )


def test_chart_draws_memory_in_the_largest_values_binary_unit():
    import matplotlib.pyplot as plt

    measured = _fixed([0.001, 0.002, 0.003], [0.002, 0.004, 0.006])
    measured["a"].saved_bytes, measured["b"].saved_bytes = 68608, 17152  # 67.00 KiB and 16.75 KiB
    figure = measurement_chart(measured)
    memory = figure.axes[1]
    assert memory.get_ylabel() == "saved for backward, KiB"
    assert [bar.get_height() for bar in memory.patches] == pytest.approx([67.0, 16.75])
    assert [text.get_text() for text in memory.texts] == ["67.00 KiB", "16.75 KiB"]
    plt.close(figure)


def _measurement() -> Measurement:
    results = {
        "plain": Result("plain", [1.0, 1.0, 1.0, 1.0]),
        "fast": Result("fast", [0.5, 0.4, 0.5, 0.5]),  # per-round time ratios 0.5, 0.4, 0.5, 0.5
    }
    return Measurement(torch.device("cpu"), results, "plain", unit="image")


def test_speedup_chart_draws_throughput_relative_to_the_baseline():
    figure = speedup_chart(_measurement(), notes={"fast": "acc 0.95"})
    assert isinstance(figure, Figure)
    ax = figure.axes[0]
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == pytest.approx([1.0, 2.0])  # 1 / the median time ratio
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["plain", "fast\nacc 0.95"]
    assert "images per second" in ax.get_ylabel()


def test_speedup_chart_refuses_notes_for_variants_not_measured():
    with pytest.raises(ValueError, match="slow"):
        speedup_chart(_measurement(), notes={"slow": "acc 0.1"})


def test_stacked_bar_chart_stacks_each_bars_parts_and_annotates_its_total():
    import warnings

    bars = {"DDP": {"state": 3.0, "activations": 1.0}, "FSDP": {"state": 1.5, "activations": 1.0}, "none": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layout warnings, the legend outside the axes included
        figure = stacked_bar_chart(bars, ylabel="bytes", title="per rank", annotate="{:.2f}")
        figure.canvas.draw()  # the constrained layout runs here
    ax = figure.axes[0]
    assert [bar.get_height() for bar in ax.patches] == pytest.approx([3.0, 1.5, 0.0, 1.0, 1.0, 0.0])
    assert [bar.get_y() for bar in ax.patches] == pytest.approx([0.0, 0.0, 0.0, 3.0, 1.5, 0.0])  # on the parts below
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["state", "activations"]
    assert [text.get_text() for text in ax.texts] == ["4.00", "2.50", "0.00"]  # each bar's total
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["DDP", "FSDP", "none"]
    assert (ax.get_ylabel(), ax.get_title()) == ("bytes", "per rank")


def test_stacked_bar_chart_needs_a_bar():
    with pytest.raises(ValueError, match="bars"):
        stacked_bar_chart({}, ylabel="y")


def test_branch_chart_draws_the_reference_whole_and_each_branch_after_the_split():
    from helpers.plots import branch_chart

    reference = [4.0, 3.0, 2.0, 1.0]
    branches = {"resumed": [4.0, 3.0, 2.0, 1.0], "weights only": [4.0, 3.0, 2.5, 2.0]}
    figure = branch_chart(reference, branches, at=2, reference_label="never stopped", xlabel="step", ylabel="loss",
                          title="stopped after step 2", logy=True)  # fmt: skip
    ax = figure.axes[0]
    assert list(ax.lines[0].get_xdata()) == [1, 2, 3, 4]
    assert [list(line.get_xdata()) for line in ax.lines[1:3]] == [[3, 4], [3, 4]]
    assert list(ax.lines[2].get_ydata()) == [2.5, 2.0]
    assert list(ax.lines[3].get_xdata()) == [2.5, 2.5]  # the stop, between steps 2 and 3
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["never stopped", "resumed", "weights only"]
    assert (ax.get_yscale(), ax.get_title()) == ("log", "stopped after step 2")


def test_branch_chart_refuses_a_branch_of_another_length_or_a_split_outside_the_curve():
    from helpers.plots import branch_chart

    labels = {"reference_label": "r", "xlabel": "x", "ylabel": "y"}
    with pytest.raises(ValueError, match="branch 'b' has 2 values but the reference has 3"):
        branch_chart([1, 2, 3], {"b": [1, 2]}, at=1, **labels)
    with pytest.raises(ValueError, match=r"at must be a step in \[0, 2\]"):
        branch_chart([1, 2, 3], {"b": [1, 2, 3]}, at=3, **labels)
    with pytest.raises(ValueError, match="branches"):
        branch_chart([1, 2, 3], {}, at=1, **labels)


def test_shard_chart_colours_each_sample_by_the_rank_that_holds_it():
    from helpers.plots import shard_chart

    orders = {"epoch 0": [[0, 2, 4], [1, 3, 0]], "epoch 1": [[3, 1, 0], [2, 4, 3]]}
    figure = shard_chart(orders, show=5, title="shards")
    owner = figure.axes[0].images[0].get_array()
    assert owner.shape == (2, 5)
    assert list(owner[0]) == [0, 1, 0, 1, 0]  # sample 0 is rank 0's, though rank 1 repeats it as padding
    assert list(owner[1]) == [0, 0, 1, 0, 1]
    assert [label.get_text() for label in figure.axes[0].get_yticklabels()] == ["epoch 0", "epoch 1"]
    figure.clear()


def test_shard_chart_refuses_an_empty_split_or_a_bad_count():
    from helpers.plots import shard_chart

    with pytest.raises(ValueError, match="at least one named split"):
        shard_chart({}, show=4)
    with pytest.raises(ValueError, match="at least one shard"):
        shard_chart({"none": []}, show=4)
    with pytest.raises((ValueError, TypeError), match="show"):
        shard_chart({"a": [[0]]}, show=0)
