"""helpers.knobs: values checked against what a parameter accepts (not the slider), and a Run that applies them."""

import pytest

from helpers import knobs

SPEC = {
    "LR": knobs.log_float(1e-4, 1.0),
    "EPOCHS": knobs.int_range(1, 20, minimum=1),
    "AMP": knobs.choice([None, "bf16"]),
    "DROPOUT": knobs.float_range(0.0, 0.9, minimum=0.0, maximum=0.99),
    "PROGRESS": knobs.checkbox(),
    "SEED": knobs.seed_knob(),
    "DEVICE": knobs.choice(["auto", "cpu"]),
}
GOOD = {"LR": 0.01, "EPOCHS": 3, "AMP": None, "DROPOUT": 0.1, "PROGRESS": True, "SEED": 0, "DEVICE": "auto"}


def test_check_values_accepts_and_converts():
    values = knobs.check_values(SPEC, {**GOOD, "EPOCHS": 3.0, "DROPOUT": 0, "OTHER": "ignored"})
    assert values["EPOCHS"] == 3 and isinstance(values["EPOCHS"], int)
    assert isinstance(values["DROPOUT"], float)
    assert "OTHER" not in values


@pytest.mark.parametrize("change", [{"SEED": 2**32 - 1}, {"SEED": 20261122}, {"EPOCHS": 500}, {"LR": 5.0}])
def test_values_beyond_the_slider_are_accepted(change):
    assert knobs.check_values(SPEC, {**GOOD, **change}) == {**GOOD, **change}


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"LR": 0.0}, ValueError, "LR must be a positive number, got 0.0"),
        ({"LR": -1e-3}, ValueError, "LR must be a positive number"),
        ({"EPOCHS": 0}, ValueError, "EPOCHS must be an int >= 1, got 0"),
        ({"EPOCHS": 2.5}, ValueError, "EPOCHS must be an int >= 1, got 2.5"),
        ({"EPOCHS": float("inf")}, ValueError, "EPOCHS must be an int"),
        ({"EPOCHS": "3"}, TypeError, "EPOCHS must be an int >= 1, got str '3'"),
        ({"AMP": "fp8"}, ValueError, r"AMP must be one of \[None, 'bf16'\]"),
        ({"PROGRESS": 1}, TypeError, "PROGRESS must be True or False"),
        ({"DROPOUT": float("nan")}, ValueError, "DROPOUT"),
        ({"DROPOUT": 1.0}, ValueError, r"DROPOUT must be a number in \[0.0, 0.99\], got 1.0"),
        ({"SEED": -1}, ValueError, r"SEED must be an int in \[0, 4294967295\], got -1"),
        ({"SEED": 2**32}, ValueError, "SEED must be an int in"),
        ({"SEED": "7"}, TypeError, r"SEED must be an int in \[0, 4294967295\], got str '7'"),
        ({"DEVICE": "tpu"}, ValueError, r"DEVICE must be one of \['auto', 'cpu'\], got 'tpu'"),
    ],
)
def test_check_values_names_the_bad_parameter(change, error, message):
    with pytest.raises(error, match=message):
        knobs.check_values(SPEC, {**GOOD, **change})


def test_check_values_wants_every_knob():
    with pytest.raises(ValueError, match=r"no value for the knob\(s\) \['PROGRESS'\]"):
        knobs.check_values(SPEC, {k: v for k, v in GOOD.items() if k != "PROGRESS"})


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: knobs.int_range(5, 5), "low < high"),
        (lambda: knobs.log_float(0.0, 1.0), "low > 0"),
        (lambda: knobs.choice([]), "option"),
        (lambda: knobs.Knob("slider"), "kind"),
    ],
)
def test_bad_knobs(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_knob_panel_applies_the_values_to_the_namespace():
    namespace = dict(GOOD, EPOCHS=3.0, UNRELATED=1)
    panel = knobs.knob_panel(SPEC, namespace)
    assert set(panel.controls) == set(SPEC)
    assert namespace["EPOCHS"] == 3 and isinstance(namespace["EPOCHS"], int)  # converted in place
    panel.controls["EPOCHS"].value = 7
    panel.controls["AMP"].value = "bf16"
    panel.controls["SEED"].value = 123
    assert namespace["EPOCHS"] == 3  # nothing changes before Run
    applied = panel.click()
    assert applied == {**GOOD, "EPOCHS": 7, "AMP": "bf16", "SEED": 123}
    assert {k: namespace[k] for k in SPEC} == applied and namespace["UNRELATED"] == 1
    assert "EPOCHS = 7" in panel.status.value
    assert "run the cells below" in panel.status.value  # no JupyterLab front end here


def test_knob_panel_asks_jupyterlab_to_run_the_cells_below(monkeypatch):
    executed = []

    class FakeCommands:
        def execute(self, name, args=None):
            executed.append(name)

    class FakeFrontEnd:
        version = "4.x"
        commands = FakeCommands()

    monkeypatch.setattr(knobs, "_frontend", FakeFrontEnd)
    panel = knobs.knob_panel(SPEC, dict(GOOD))
    panel.click()
    assert executed == ["notebook:run-all-below"]
    assert "running this cell and all below" in panel.status.value


def test_a_value_beyond_the_slider_widens_it():
    panel = knobs.knob_panel(SPEC, dict(GOOD, SEED=20261122, EPOCHS=50))
    assert panel.controls["SEED"].value == 20261122 and panel.controls["SEED"].max == 20261122
    assert panel.controls["EPOCHS"].value == 50


def test_knob_panel_refuses_bad_starting_values_and_keeps_the_namespace():
    namespace = dict(GOOD, EPOCHS=0)
    with pytest.raises(ValueError, match="EPOCHS"):
        knobs.knob_panel(SPEC, namespace)
    assert namespace["EPOCHS"] == 0


def test_run_with_a_bad_widget_value_applies_nothing():
    namespace = dict(GOOD)
    panel = knobs.knob_panel(SPEC, namespace)
    panel.controls["SEED"].value = 9
    panel.controls["EPOCHS"].min = 0
    panel.controls["EPOCHS"].value = 0
    with pytest.raises(ValueError, match="EPOCHS"):
        panel.click()
    assert namespace == GOOD and "Not applied" in panel.status.value


def test_device_knob_offers_auto_and_the_devices_here_and_refuses_others():
    from helpers.devices import available_devices
    from helpers.knobs import check_value, device_knob

    knob = device_knob()
    assert knob.kind == "choice" and knob.options == ("auto", *available_devices())
    assert check_value("DEVICE", knob, "auto") == "auto"
    with pytest.raises(ValueError, match="DEVICE"):
        check_value("DEVICE", knob, "tpu")
