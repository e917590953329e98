import numpy as np
import pytest
from matplotlib.figure import Figure

from helpers import widgets
from helpers.plots import LivePlot, bar_chart, confusion_matrix_plot, line_chart


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


SPEC = {"lr": widgets.log_float(1e-4, 1.0), "epochs": widgets.int_range(1, 20), "amp": widgets.choice([None, "bf16"]),
        "dropout": widgets.float_range(0.0, 0.9), "progress": widgets.checkbox()}
GOOD = {"lr": 0.01, "epochs": 3, "amp": None, "dropout": 0.1, "progress": True}


def test_check_values_accepts_and_converts():
    values = widgets.check_values(SPEC, {**GOOD, "epochs": 3.0, "dropout": 0})
    assert values["epochs"] == 3 and isinstance(values["epochs"], int)
    assert isinstance(values["dropout"], float)


@pytest.mark.parametrize("change, error, message", [
    ({"lr": 5.0}, ValueError, r"lr must be in \[0.0001, 1.0\], got 5.0"),
    ({"epochs": 2.5}, ValueError, "epochs must be a whole number"),
    ({"epochs": "3"}, TypeError, "epochs must be a number"),
    ({"amp": "fp8"}, ValueError, r"amp must be one of \[None, 'bf16'\]"),
    ({"progress": 1}, TypeError, "progress must be True or False"),
    ({"dropout": float("nan")}, ValueError, "dropout"),
])
def test_check_values_names_the_bad_parameter(change, error, message):
    with pytest.raises(error, match=message):
        widgets.check_values(SPEC, {**GOOD, **change})


def test_check_values_wants_exactly_the_knobs():
    with pytest.raises(ValueError, match="missing \\['progress'\\]"):
        widgets.check_values(SPEC, {k: v for k, v in GOOD.items() if k != "progress"})
    with pytest.raises(ValueError, match="unknown \\['momentum'\\]"):
        widgets.check_values(SPEC, {**GOOD, "momentum": 0.9})


@pytest.mark.parametrize("factory, message", [
    (lambda: widgets.int_range(5, 5), "low < high"), (lambda: widgets.log_float(0.0, 1.0), "low > 0"),
    (lambda: widgets.choice([]), "option"), (lambda: widgets.Knob("slider"), "kind")])
def test_bad_knobs(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_knob_panel_runs_the_experiment_with_current_values():
    calls = []
    panel = widgets.knob_panel(lambda **kw: calls.append(kw), SPEC, GOOD)
    assert set(panel.controls) == set(SPEC)
    panel.controls["epochs"].value = 7
    panel.controls["amp"].value = "bf16"
    panel.click()
    assert calls == [{**GOOD, "epochs": 7, "amp": "bf16"}]
    assert panel.controls["lr"].value == pytest.approx(0.01)


def test_knob_panel_refuses_bad_starting_values():
    with pytest.raises(ValueError, match="epochs"):
        widgets.knob_panel(lambda **kw: None, SPEC, {**GOOD, "epochs": 99})


def test_figure_png_renders_bytes():
    from helpers.plots import figure_png

    png = figure_png(bar_chart({"a": 1.0}, ylabel="y"))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
