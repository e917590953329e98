"""The profiling helpers: seconds per record_function label, the torch.compile readiness check, the speed-up chart."""

import pytest
import torch
from matplotlib.figure import Figure
from torch.profiler import ProfilerActivity, profile, record_function

from helpers.profiling import compile_ready, seconds_by_label
from helpers.rig import Measurement, Result


@pytest.fixture(scope="module")
def nested_profile():
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("outer"):
                y = x @ x
                with record_function("inner"):
                    y = (y @ x).relu()
    return prof


def test_seconds_by_label_sums_each_labelled_range_and_its_children(nested_profile):
    seconds = seconds_by_label(nested_profile, ["outer", "inner"])
    assert list(seconds) == ["outer", "inner"]
    assert all(isinstance(value, float) and value > 0 for value in seconds.values())
    assert seconds["outer"] >= seconds["inner"]  # inner runs inside outer: its time is part of outer's


def test_seconds_by_label_names_a_missing_label_and_what_the_profile_holds(nested_profile):
    with pytest.raises(ValueError, match=r"no record_function range named \['load'\].*'inner'"):
        seconds_by_label(nested_profile, ["outer", "load"])
    with pytest.raises(ValueError, match="non-empty list"):
        seconds_by_label(nested_profile, "outer")


def test_compile_ready_reports_why_compilation_failed():
    def broken_compile(fn):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    ok, why = compile_ready("cpu", compile_fn=broken_compile)
    assert not ok and why == "RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    assert compile_ready("cpu", compile_fn=lambda fn: fn)[0]  # a "compiler" that returns the function as it is
    ok, why = compile_ready("cpu", compile_fn=lambda fn: lambda x: fn(x) + 1)
    assert not ok and "wrong result" in why


def _measurement() -> Measurement:
    results = {
        "plain": Result("plain", [1.0, 1.0, 1.0, 1.0]),
        "fast": Result("fast", [0.5, 0.4, 0.5, 0.5]),  # per-round time ratios 0.5, 0.4, 0.5, 0.5
    }
    return Measurement(torch.device("cpu"), results, "plain", unit="image")


def test_speedup_chart_draws_throughput_relative_to_the_baseline():
    figure = _measurement().speedup_chart(notes={"fast": "acc 0.95"})
    assert isinstance(figure, Figure)
    ax = figure.axes[0]
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == pytest.approx([1.0, 2.0])  # 1 / the median time ratio
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["plain", "fast\nacc 0.95"]
    assert "images per second" in ax.get_ylabel()


def test_speedup_chart_refuses_notes_for_variants_not_measured():
    with pytest.raises(ValueError, match="slow"):
        _measurement().speedup_chart(notes={"slow": "acc 0.1"})
