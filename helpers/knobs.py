"""Knobs: a notebook's parameters cell as ipywidgets, with a Run button that re-runs the notebook below.

    KNOBS = {"LR": log_float(1e-4, 1.0), "EPOCHS": int_range(1, 30, minimum=1), "SEED": seed_knob()}
    knob_panel(KNOBS, globals())

The panel starts at the parameters' current values and checks them, so a bad value set in the
parameters cell (or by papermill) fails at once with an error naming it. Run writes the knobs' values
back into the notebook's namespace and asks JupyterLab to run the knobs cell and every cell below it
(through ipylab), so each section, plot and check follows the knobs. A slider's range only limits the
slider: a parameter accepts any value that is valid for it (`minimum` / `maximum`), and a value set
outside the slider's range widens the slider.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from .checks import check_choice
from .devices import available_devices

KINDS = ("int", "float", "log", "choice", "bool")
SEED_MAX = 2**32 - 1  # numpy's seeds end there; torch's go further


@dataclass(frozen=True)
class Knob:
    """What a parameter may be, and the slider or dropdown that shows it.

    `low`/`high` are the slider's range; `minimum`/`maximum` (None: unbounded) are the values the
    parameter accepts. A log knob accepts only positive values.
    """

    kind: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    options: tuple[Any, ...] = ()
    description: str = ""
    minimum: float | None = None
    maximum: float | None = None

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, KINDS)
        if self.kind in ("int", "float", "log") and not (
            self.low is not None and self.high is not None and self.low < self.high
        ):
            raise ValueError(f"a {self.kind} knob needs low < high, got low={self.low!r}, high={self.high!r}")
        if self.kind == "log" and self.low is not None and self.low <= 0:
            raise ValueError(f"a log knob needs low > 0, got {self.low!r}")
        if self.kind == "choice" and not self.options:
            raise ValueError("a choice knob needs at least one option")


def int_range(
    low: int,
    high: int,
    step: int = 1,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    description: str = "",
) -> Knob:
    """An integer slider from low to high; the parameter accepts any int in [minimum, maximum]."""
    return Knob("int", low, high, step, description=description, minimum=minimum, maximum=maximum)


def float_range(
    low: float,
    high: float,
    step: float | None = None,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    description: str = "",
) -> Knob:
    """A float slider from low to high (100 steps unless `step` is given)."""
    step = step if step is not None else (high - low) / 100
    return Knob("float", low, high, step, description=description, minimum=minimum, maximum=maximum)


def log_float(low: float, high: float, *, maximum: float | None = None, description: str = "") -> Knob:
    """A log-scale slider, for learning rates and the like; the parameter accepts any positive number."""
    return Knob("log", low, high, description=description, maximum=maximum)


def choice(options: Sequence[Any], description: str = "") -> Knob:
    """A dropdown of options (any values, None included)."""
    return Knob("choice", options=tuple(options), description=description)


def device_knob(description: str = "device") -> Knob:
    """The DEVICE knob: 'auto' (cuda > mps > cpu, helpers.devices.pick_device) or a device kind available here."""
    return choice(["auto", *available_devices()], description=description)


def checkbox(description: str = "") -> Knob:
    """A checkbox for a bool."""
    return Knob("bool", description=description)


def seed_knob(description: str = "seed") -> Knob:
    """The SEED knob: a slider over 0..10,000; any seed numpy accepts (0 to 2**32 - 1) is valid."""
    return int_range(0, 10_000, minimum=0, maximum=SEED_MAX, description=description)


def _allowed(knob: Knob) -> str:
    if knob.kind == "log":
        return "a positive number" + (f" <= {knob.maximum}" if knob.maximum is not None else "")
    noun = "an int" if knob.kind == "int" else "a number"
    if knob.minimum is not None and knob.maximum is not None:
        return f"{noun} in [{knob.minimum}, {knob.maximum}]"
    if knob.minimum is not None:
        return f"{noun} >= {knob.minimum}"
    if knob.maximum is not None:
        return f"{noun} <= {knob.maximum}"
    return noun


def check_value(name: str, knob: Knob, value: Any) -> Any:
    """Return `value` converted to the knob's type, or raise ValueError/TypeError naming the parameter."""
    if knob.kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
        return value
    if knob.kind == "choice":
        check_choice(name, value, knob.options)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {_allowed(knob)}, got {type(value).__name__} {value!r}")
    if knob.kind == "int":
        if not (math.isfinite(value) and value == int(value)):
            raise ValueError(f"{name} must be {_allowed(knob)}, got {value!r}")
        value = int(value)
    else:
        value = float(value)
    too_low = knob.minimum is not None and value < knob.minimum
    too_high = knob.maximum is not None and value > knob.maximum
    if math.isnan(value) or too_low or too_high or (knob.kind == "log" and not value > 0):
        raise ValueError(f"{name} must be {_allowed(knob)}, got {value!r}")
    return value


def check_values(spec: Mapping[str, Knob], values: Mapping[str, Any]) -> dict[str, Any]:
    """Check and convert the value of every knob in `spec`, taken from `values` (which may hold more)."""
    missing = [name for name in spec if name not in values]
    if missing:
        raise ValueError(f"no value for the knob(s) {missing}: define them in the parameters cell")
    return {name: check_value(name, knob, values[name]) for name, knob in spec.items()}


def make_widget(name: str, knob: Knob, value: Any) -> Any:
    """The ipywidget for one knob, starting at `value`; a value beyond the slider's range widens it."""
    import ipywidgets as w

    value = check_value(name, knob, value)
    common: dict[str, Any] = {"description": knob.description or name, "style": {"description_width": "initial"}}
    if knob.kind == "choice":
        return w.Dropdown(options=[(str(o), o) for o in knob.options], value=value, **common)
    if knob.kind == "bool":
        return w.Checkbox(value=value, **common)
    assert knob.low is not None and knob.high is not None  # checked by Knob
    low, high = min(knob.low, value), max(knob.high, value)
    if knob.kind == "int":
        step = int(knob.step or 1)
        return w.IntSlider(value=value, min=int(low), max=int(high), step=step, continuous_update=False, **common)
    if knob.kind == "float":
        return w.FloatSlider(value=value, min=low, max=high, step=knob.step, continuous_update=False, **common)
    return w.FloatLogSlider(
        value=value,
        base=10,
        min=math.log10(low),
        max=math.log10(high),
        step=0.1,
        readout_format=".2e",
        continuous_update=False,
        **common,
    )


def _frontend() -> Any:
    """ipylab's handle on JupyterLab, or None where ipylab is missing."""
    try:
        from ipylab import JupyterFrontEnd
    except ImportError:
        return None
    return JupyterFrontEnd()


def knob_panel(spec: Mapping[str, Knob], namespace: MutableMapping[str, Any], *, button: str = "Run") -> Any:
    """Widgets for the parameters named in `spec`, starting at their values in `namespace`.

    Run checks the widgets' values, writes them into `namespace` (pass the notebook's `globals()`) and
    runs this cell and every cell below it in JupyterLab. Elsewhere (VS Code, Colab) it says to run
    the cells below by hand.
    """
    import ipywidgets as w

    values = check_values(spec, namespace)
    namespace.update(values)
    controls = {name: make_widget(name, knob, values[name]) for name, knob in spec.items()}
    run_button = w.Button(description=button, button_style="primary", icon="play")
    status = w.HTML()
    frontend = _frontend()

    def on_click(_: Any = None) -> dict[str, Any]:
        try:
            current = check_values(spec, {name: control.value for name, control in controls.items()})
        except (TypeError, ValueError) as error:
            status.value = f"<b>Not applied:</b> {error}"
            raise
        namespace.update(current)
        applied = ", ".join(f"{name} = {value!r}" for name, value in current.items())
        if frontend is not None and frontend.version:  # set once JupyterLab has answered
            frontend.commands.execute("notebook:run-all-below")
            status.value = f"Applied {applied}; running this cell and all below."
        else:
            status.value = (
                f"Applied {applied}. Now run the cells below (Run &gt; Run Selected Cell and All Below): "
                "this front end cannot be asked to."
            )
        return current

    run_button.on_click(on_click)
    panel = w.VBox([*controls.values(), w.HBox([run_button, status])])
    panel.controls, panel.status, panel.click = controls, status, on_click  # for scripts and tests
    return panel
