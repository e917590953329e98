"""The profiling helpers: seconds per record_function label, the torch.compile readiness check, the speed-up chart."""

import time

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEventAvg
from torch.profiler import ProfilerActivity, profile, record_function

from helpers.profiling import compile_ready, seconds_by_label


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


SLEEP_S = 0.02  # each of the 3 recorded steps sleeps this long inside "inner", which runs inside "outer"


@pytest.fixture(scope="module")
def sleeping_profile():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("outer"):
                torch.ones(8).sum()
                with record_function("inner"):
                    time.sleep(SLEEP_S)
    return prof


def test_seconds_by_label_counts_seconds_and_includes_what_is_nested(sleeping_profile):
    seconds = seconds_by_label(sleeping_profile, ["outer", "inner"])
    slept = 3 * SLEEP_S
    assert slept <= seconds["inner"] < slept + 1.0  # seconds: not milliseconds (x1000) nor microseconds
    assert seconds["outer"] >= seconds["inner"]  # the inner range's time is part of the outer one's


class _Profile:
    """What seconds_by_label reads from a finished torch.profiler.profile: key_averages()."""

    def __init__(self, events):
        self.events = events

    def key_averages(self):
        return self.events


def _average(key: str, device_type: DeviceType, cpu_us: int, device_us: int = 0) -> FunctionEventAvg:
    """A key_averages() row as the profiler builds it: one per label and device side (times in microseconds)."""
    event = FunctionEventAvg()
    event.key, event.count, event.device_type = key, 5, device_type
    event.cpu_time_total, event.device_time_total = cpu_us, device_us
    return event


@pytest.mark.parametrize("gpu_copy_first", [False, True])
def test_seconds_by_label_takes_the_cpu_range_when_cuda_adds_a_gpu_copy_of_each_label(gpu_copy_first):
    """With CUDA activities each label is listed twice: the CPU range and its GPU-side annotation (CPU time 0)."""
    rows = []
    for label, cpu_us in [("load", 2_500_000), ("forward", 40_000)]:
        cpu, gpu = _average(label, DeviceType.CPU, cpu_us), _average(label, DeviceType.CUDA, 0, cpu_us * 9 // 10)
        rows += [gpu, cpu] if gpu_copy_first else [cpu, gpu]
    seconds = seconds_by_label(_Profile(rows), ["load", "forward"])
    assert seconds == {"load": pytest.approx(2.5), "forward": pytest.approx(0.04)}  # microseconds / 1e6


def test_seconds_by_label_refuses_a_label_found_only_on_the_gpu_side():
    rows = [_average("load", DeviceType.CPU, 10), _average("forward", DeviceType.CUDA, 0, 5)]
    with pytest.raises(ValueError, match=r"no record_function range named \['forward'\].*'load'"):
        seconds_by_label(_Profile(rows), ["load", "forward"])


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
