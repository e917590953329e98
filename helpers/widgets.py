"""Knobs: ipywidgets built from a notebook's parameters, and a Run button that re-runs its experiment.

    SPEC = {"lr": log_float(1e-4, 1.0), "epochs": int_range(1, 30), "amp": choice([None, "bf16"])}
    display(knob_panel(run_experiment, SPEC, {"lr": LR, "epochs": EPOCHS, "amp": AMP}))

`check_values` is the plain function behind the panel: it validates and converts values for a spec,
and notebooks also call it on their parameters cell so a bad value fails with a clear message.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

KINDS = ("int", "float", "log", "choice", "bool")


@dataclass(frozen=True)
class Knob:
    """What a parameter may be: an int or float range, a log-scale float range, a choice, or a checkbox."""

    kind: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    options: tuple = ()
    description: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in ("int", "float", "log"):
            if self.low is None or self.high is None or not self.low < self.high:
                raise ValueError(f"a {self.kind} knob needs low < high, got low={self.low!r}, high={self.high!r}")
            if self.kind == "log" and self.low <= 0:
                raise ValueError(f"a log knob needs low > 0, got {self.low!r}")
        if self.kind == "choice" and not self.options:
            raise ValueError("a choice knob needs at least one option")


def int_range(low: int, high: int, step: int = 1, description: str = "") -> Knob:
    """An integer slider from low to high."""
    return Knob("int", low, high, step, description=description)


def float_range(low: float, high: float, step: float | None = None, description: str = "") -> Knob:
    """A float slider from low to high (100 steps unless `step` is given)."""
    return Knob("float", low, high, step if step is not None else (high - low) / 100, description=description)


def log_float(low: float, high: float, description: str = "") -> Knob:
    """A float slider on a log scale, for learning rates and the like."""
    return Knob("log", low, high, description=description)


def choice(options: Sequence[Any], description: str = "") -> Knob:
    """A dropdown of options (any values, None included)."""
    return Knob("choice", options=tuple(options), description=description)


def checkbox(description: str = "") -> Knob:
    """A checkbox for a bool."""
    return Knob("bool", description=description)


def check_value(name: str, knob: Knob, value: Any) -> Any:
    """Return `value` converted to the knob's type, or raise ValueError/TypeError naming the parameter."""
    if knob.kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
        return value
    if knob.kind == "choice":
        if value not in knob.options:
            raise ValueError(f"{name} must be one of {list(knob.options)}, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if knob.kind == "int":
        if value != int(value):
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        value = int(value)
    else:
        value = float(value)
    if not (knob.low <= value <= knob.high) or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"{name} must be in [{knob.low}, {knob.high}], got {value!r}")
    return value


def check_values(spec: Mapping[str, Knob], values: Mapping[str, Any]) -> dict[str, Any]:
    """Validate and convert every value in `values` against `spec`; names must match exactly."""
    missing, unknown = set(spec) - set(values), set(values) - set(spec)
    if missing or unknown:
        raise ValueError(f"values must name exactly the knobs {sorted(spec)}; "
                         f"missing {sorted(missing)}, unknown {sorted(unknown)}")
    return {name: check_value(name, knob, values[name]) for name, knob in spec.items()}


def make_widget(name: str, knob: Knob, value: Any):
    """The ipywidget for one knob, starting at `value`."""
    import ipywidgets as w

    value = check_value(name, knob, value)
    label = knob.description or name
    style = {"description_width": "initial"}
    if knob.kind == "int":
        return w.IntSlider(value=value, min=int(knob.low), max=int(knob.high), step=int(knob.step or 1),
                           description=label, style=style, continuous_update=False)
    if knob.kind == "float":
        return w.FloatSlider(value=value, min=knob.low, max=knob.high, step=knob.step, description=label,
                             style=style, continuous_update=False)
    if knob.kind == "log":
        return w.FloatLogSlider(value=value, base=10, min=math.log10(knob.low), max=math.log10(knob.high),
                                step=0.1, description=label, style=style, continuous_update=False,
                                readout_format=".2e")
    if knob.kind == "choice":
        return w.Dropdown(options=[(str(o), o) for o in knob.options], value=value, description=label, style=style)
    return w.Checkbox(value=value, description=label, style=style)


def knob_panel(run: Callable[..., Any], spec: Mapping[str, Knob], values: Mapping[str, Any], *,
               button: str = "Run"):
    """Sliders/dropdowns for `spec` starting at `values`, and a button that calls run(**current values).

    The experiment's printed output, plots and return value appear under the button.
    """
    import ipywidgets as w
    from IPython.display import display

    values = check_values(spec, values)
    controls = {name: make_widget(name, knob, values[name]) for name, knob in spec.items()}
    run_button = w.Button(description=button, button_style="primary", icon="play")
    output = w.Output()

    def on_click(_=None) -> None:
        output.clear_output(wait=True)
        with output:
            current = check_values(spec, {name: control.value for name, control in controls.items()})
            result = run(**current)
            if result is not None:
                display(result)

    run_button.on_click(on_click)
    panel = w.VBox([*controls.values(), run_button, output])
    panel.controls, panel.output, panel.click = controls, output, on_click  # for scripts and tests
    return panel
